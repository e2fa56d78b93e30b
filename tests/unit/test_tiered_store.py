"""TieredStore: lookup and prefix reads across host and disk, promotion, write-behind and its bound, exact
tier events, deadlines on an injected clock, and crash safety under kill -9."""

from __future__ import annotations

import errno
import hashlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

from deepinfer.cache import block_file as bf
from deepinfer.cache import block_io
from deepinfer.cache.store import DISK, HOST, ReadResult, TieredStore, TierEvent

NS_ID = hashlib.sha256(b"store test namespace").hexdigest()
N = 2048  # payload bytes per block
FILE = bf.HEADER_BYTES + N
REPO = Path(__file__).resolve().parents[2]


def h(i: int) -> bytes:
    return hashlib.sha256(b"block %d" % i).digest()


def payload_for(block_hash: bytes, nbytes: int = N) -> bytes:
    return hashlib.shake_256(block_hash).digest(nbytes)


def make(root: Path | None, host_blocks: int = 100, disk_blocks: int = 1000, **kw: object) -> TieredStore:
    store = TieredStore(NS_ID, N, host_blocks * N, root, disk_blocks * FILE, **kw)  # type: ignore[arg-type]
    store.open()
    return store


def write(store: TieredStore, ids: Iterable[int]) -> tuple[int, int]:
    hashes = [h(i) for i in ids]
    return store.write(hashes, [payload_for(x) for x in hashes])


def check(result: ReadResult) -> None:
    for x, p in zip(result.hashes, result.payloads):
        assert bytes(p) == payload_for(x)


class Replica:
    """What a router would know from the events alone; strict: a block is stored in a tier only while
    absent there and evicted only while present, so a duplicated or missing event fails."""

    def __init__(self) -> None:
        self.tiers: dict[str, set[bytes]] = {HOST: set(), DISK: set()}

    def apply(self, events: list[TierEvent]) -> None:
        for e in events:
            assert not (e.stored and e.evicted), "one kind of change per event"
            held = self.tiers[e.tier]
            for x in e.stored:
                assert x not in held, "stored twice"
                held.add(x)
            for x in e.evicted:
                assert x in held, "evicted without being stored"
                held.remove(x)

    def matches(self, store: TieredStore) -> bool:
        return {t: set(hs) for t, hs in store.snapshot().items()} == {t: self.tiers[t] for t in store.tiers}


# --- lookup and read -------------------------------------------------------------------------------------


def test_lookup_reports_the_tier_of_each_block(tmp_path: Path) -> None:
    store = make(tmp_path, host_blocks=2)
    write(store, range(4))
    assert store.lookup([h(i) for i in range(4)]) == ["", "", HOST, HOST]  # 0 and 1 are still queued
    assert store.flush() == 4
    assert store.lookup([h(i) for i in range(5)]) == [DISK, DISK, HOST, HOST, ""]
    assert store.lookup([b"not a hash"]) == [""]


def test_look_through_extends_the_prefix_with_another_daemons_blocks(tmp_path: Path) -> None:
    """Two daemons on one pool: what one wrote after the other opened is found by looking through the disk,
    up to the first block nobody wrote; the lookup alone (memory) does not see it."""
    a, b = make(tmp_path), make(tmp_path)
    write(a, [0, 1, 2, 4])
    assert a.flush() == 4
    write(b, [0])
    hashes = [h(i) for i in range(6)]
    tiers = b.lookup(hashes)
    assert tiers == [HOST, "", "", "", "", ""]  # b's own block 0 is in its DRAM
    assert b.look_through(hashes, tiers) == [HOST, DISK, DISK, "", "", ""]  # 3: nobody wrote it; 4 is past it
    assert b.lookup(hashes) == [HOST, DISK, DISK, "", "", ""]  # adopted: memory knows them now
    check(b.read(hashes[:3]))
    assert make(tmp_path / "elsewhere").look_through(hashes, [""] * 6) == [""] * 6
    assert TieredStore(NS_ID, N, 100 * N, None, 0).look_through(hashes, ["", HOST]) == ["", HOST]  # no disk


def test_read_serves_the_longest_prefix_and_promotes_disk_hits(tmp_path: Path) -> None:
    store = make(tmp_path, host_blocks=3)
    write(store, range(4))
    store.flush()
    store.drain_events()
    asked = [h(2), h(0), h(3), h(9), h(1)]  # host, disk, host, absent, disk
    result = store.read(asked)
    assert result.hashes == asked[:3] and result.tiers == [HOST, DISK, HOST] and result.reason == "miss"
    check(result)
    assert store.lookup([h(0)]) == [HOST]  # promoted
    events = store.drain_events()
    assert events == [TierEvent(HOST, evicted=[h(1)]), TierEvent(HOST, stored=[h(0)])]  # room for the promotion
    assert store.stats()["promotions"] == 1 and store.stats()["read_stopped_miss"] == 1
    full = store.read([h(0), h(1)])
    assert full.reason == "" and full.tiers == [HOST, DISK] and len(full.payloads) == 2
    check(full)


def test_read_of_nothing_and_of_a_cold_store(tmp_path: Path) -> None:
    store = make(tmp_path)
    assert store.read([]) == ReadResult([], [], [], "")
    assert store.read([h(1)]) == ReadResult([], [], [], "miss")


def test_a_corrupt_disk_block_ends_the_prefix_and_is_quarantined(tmp_path: Path) -> None:
    store = make(tmp_path, host_blocks=0)  # disk only
    write(store, range(3))
    store.flush()
    path = store.disk.path_of(h(1))  # type: ignore[union-attr]
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    result = store.read([h(0), h(1), h(2)])
    assert result.hashes == [h(0)] and result.reason == "corrupt"
    check(result)
    stats = store.stats()
    assert stats["disk_quarantined_checksum_mismatch"] == 1 and stats["read_stopped_corrupt"] == 1
    assert store.lookup([h(1)]) == [""]
    # The right bytes can be written again and are then served.
    assert write(store, [1]) == (1, 0)
    store.flush()
    result = store.read([h(0), h(1), h(2)])
    assert result.reason == "" and len(result.hashes) == 3
    check(result)


def test_deadline_stops_the_read_early() -> None:
    ticks = iter(range(1000))
    store = TieredStore(NS_ID, N, 100 * N, None, 0, clock=lambda: float(next(ticks)))
    store.open()
    write(store, range(10))
    result = store.read([h(i) for i in range(10)], deadline=3.5)  # the clock reads 0, 1, 2, 3, then 4
    assert result.hashes == [h(i) for i in range(4)] and result.reason == "deadline"
    assert store.read([h(0)], deadline=0.0).hashes == []  # already past
    assert store.read([h(i) for i in range(10)]).reason == ""  # no deadline


# --- writes ----------------------------------------------------------------------------------------------


def test_write_skips_held_blocks_and_refuses_malformed_ones(tmp_path: Path) -> None:
    store = make(tmp_path)
    assert write(store, range(3)) == (3, 0)
    assert write(store, range(3)) == (0, 3)  # in host and queued
    store.flush()
    store.host.clear()  # only on disk now
    assert write(store, [0, 3]) == (1, 1)
    assert store.write([h(5)], [b"short"]) == (0, 1)
    assert store.write([b"short hash"], [payload_for(h(5))]) == (0, 1)
    with pytest.raises(ValueError):
        store.write([h(5)], [])
    stats = store.stats()
    assert stats["write_refused_malformed"] == 2 and stats["write_skipped_held"] == 4


def test_write_copies_the_callers_buffer(tmp_path: Path) -> None:
    store = make(tmp_path)
    frame = bytearray(payload_for(h(1)) + payload_for(h(2)))  # two blocks in one received frame
    view = memoryview(frame)
    assert store.write([h(1), h(2)], [view[:N].cast("f"), view[N:]]) == (2, 0)
    frame[:] = bytes(len(frame))  # the caller reuses its buffer
    check(store.read([h(1), h(2)]))
    store.flush()
    store.host.clear()
    check(store.read([h(1), h(2)]))


def test_pending_write_bound_drops_disk_writes_not_host_writes(tmp_path: Path) -> None:
    store = make(tmp_path, max_pending_write_bytes=3 * N)
    assert write(store, range(5)) == (5, 0)  # all in host
    assert store.pending_writes() == 3
    assert store.stats()["disk_writes_dropped_queue_full"] == 2
    assert store.flush(max_blocks=2) == 2 and store.pending_writes() == 1
    assert store.flush() == 1 and store.pending_writes() == 0
    assert store.snapshot()[DISK] == [h(0), h(1), h(2)]
    assert store.lookup([h(3), h(4)]) == [HOST, HOST]


def test_host_eviction_keeps_queued_blocks_on_their_way_to_disk(tmp_path: Path) -> None:
    store = make(tmp_path, host_blocks=2)
    write(store, range(4))
    assert store.snapshot()[HOST] == [h(2), h(3)]
    assert store.lookup([h(0)]) == [""]  # neither in host nor on disk yet: not advertised
    assert write(store, [0]) == (0, 1)  # but still held (queued), so not taken twice
    assert store.flush() == 4
    assert store.lookup([h(i) for i in range(4)]) == [DISK, DISK, HOST, HOST]


def test_a_full_disk_costs_disk_writes_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC injected at the one call that writes block data (a real full disk: test_disk_full.py)."""
    store = make(tmp_path)
    write(store, range(2))
    assert store.flush() == 2

    def no_space(fd: int, chunks: object) -> None:
        os.write(fd, b"part of a block")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(block_io, "write_all", no_space)
    assert write(store, range(2, 6)) == (4, 0)
    assert store.flush() == 0  # never raises
    stats = store.stats()
    assert stats["disk_write_errors_no_space"] == 4 and stats["pending_writes"] == 0
    assert store.lookup([h(i) for i in range(6)]) == [HOST] * 6  # host still holds everything
    result = store.read([h(i) for i in range(6)])
    assert result.reason == "" and len(result.hashes) == 6
    check(result)
    assert [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")] == []


def test_a_block_that_fits_nowhere_is_dropped(tmp_path: Path) -> None:
    store = make(None, host_blocks=1)
    assert write(store, [0]) == (1, 0)
    store.host.pin(h(0))
    assert write(store, [1]) == (0, 1)  # host full of pinned blocks, no disk
    assert store.stats()["write_dropped_no_room"] == 1


def test_store_without_disk(tmp_path: Path) -> None:
    store = make(None, host_blocks=3)
    assert store.tiers == [HOST]
    write(store, range(5))
    assert store.flush() == 0 and store.pending_writes() == 0
    assert store.lookup([h(i) for i in range(5)]) == ["", "", HOST, HOST, HOST]
    assert store.snapshot() == {HOST: [h(2), h(3), h(4)]}
    result = store.read([h(2), h(3), h(0)])
    assert result.reason == "miss" and len(result.hashes) == 2
    assert store.open().loaded == 0


def test_flush_before_open_is_a_programming_error(tmp_path: Path) -> None:
    store = TieredStore(NS_ID, N, 10 * N, tmp_path, 10 * FILE)
    write(store, [1])
    with pytest.raises(RuntimeError):
        store.flush()
    store.open()
    assert store.flush() == 1


def test_close_drops_queued_writes_and_serves_nothing(tmp_path: Path) -> None:
    store = make(tmp_path)
    write(store, range(3))
    store.flush(max_blocks=1)
    store.close()
    assert store.read([h(0)]).reason == "closed"
    assert write(store, [7]) == (0, 1)
    assert store.stats()["disk_writes_dropped_at_close"] == 2
    again = make(tmp_path)
    assert again.lookup([h(0), h(1)]) == [DISK, ""]


def test_warm_restart_serves_what_was_flushed(tmp_path: Path) -> None:
    store = make(tmp_path)
    write(store, range(20))
    store.flush()
    store.close()
    again = TieredStore(NS_ID, N, 100 * N, tmp_path, 1000 * FILE)
    report = again.open()
    assert report.loaded == 20
    replica = Replica()
    replica.apply(again.drain_events())  # loaded blocks are announced
    assert replica.matches(again)
    result = again.read([h(i) for i in range(20)])
    assert result.reason == "" and result.tiers == [DISK] * 20
    check(result)


# --- events ----------------------------------------------------------------------------------------------


def test_events_are_exact_under_a_random_workload(tmp_path: Path) -> None:
    rng = random.Random(7)
    store = make(tmp_path, host_blocks=6, disk_blocks=12)
    replica = Replica()
    for step in range(400):
        op = rng.random()
        if op < 0.45:
            write(store, [rng.randrange(40) for _ in range(rng.randrange(1, 4))])
        elif op < 0.7:
            check(store.read([h(rng.randrange(40)) for _ in range(rng.randrange(1, 4))]))
        elif op < 0.85:
            store.flush(max_blocks=rng.randrange(1, 4))
        elif op < 0.9:
            only_on_disk = [x for x in store.snapshot()[DISK] if not store.host.contains(x)]
            if only_on_disk:
                victim = rng.choice(only_on_disk)  # damage its file: the read quarantines it
                path = store.disk.path_of(victim)  # type: ignore[union-attr]
                path.write_bytes(path.read_bytes()[:-1])
                assert store.read([victim]).reason == "corrupt"
        if step % 7 == 0:
            replica.apply(store.drain_events())
            assert replica.matches(store)
    replica.apply(store.drain_events())
    assert replica.matches(store)
    stats = store.stats()
    assert stats["host_evictions"] > 0 and stats["disk_evictions"] > 0 and stats["disk_quarantined"] > 0


def test_events_are_exact_with_concurrent_callers(tmp_path: Path) -> None:
    store = make(tmp_path, host_blocks=8, disk_blocks=16)
    replica = Replica()
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(150):
                op = rng.random()
                if op < 0.4:
                    write(store, [rng.randrange(48) for _ in range(3)])
                elif op < 0.75:
                    check(store.read([h(rng.randrange(48)) for _ in range(3)]))
                else:
                    store.flush(max_blocks=4)
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        replica.apply(store.drain_events())  # drained while the workers run
        threads[0].join(0.01)
    for t in threads:
        t.join()
    assert errors == []
    replica.apply(store.drain_events())
    assert replica.matches(store)
    assert store.stats()["disk_bytes"] <= 16 * FILE


def test_stats_names(tmp_path: Path) -> None:
    store = make(tmp_path)
    write(store, range(2))
    store.flush()
    store.read([h(0), h(5)])
    stats = store.stats()
    for key in ("host_hits", "host_misses", "host_blocks", "host_bytes", "disk_blocks", "disk_bytes",
                "disk_writes", "disk_misses", "pending_writes", "pending_write_bytes", "read_stopped_miss"):
        assert key in stats, key
    assert stats["host_hits"] == 1 and stats["disk_blocks"] == 2
    assert store.drop_page_cache() in (0, 2)  # 0 where the platform has no posix_fadvise


# --- crash safety ----------------------------------------------------------------------------------------

WRITER = """
import hashlib, sys
from pathlib import Path
from deepinfer.cache.store import TieredStore

root, namespace, seed, nbytes = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
store = TieredStore(namespace, nbytes, 8 * nbytes, root, 1 << 40, max_pending_write_bytes=64 * nbytes)
store.open()
i = 0
while True:
    hashes = [hashlib.sha256(f"{seed}-{i + j}".encode()).digest() for j in range(4)]
    store.write(hashes, [hashlib.shake_256(x).digest(nbytes) for x in hashes])
    store.flush()
    print(" ".join(x.hex() for x in hashes), flush=True)  # only after flush returned: these are on disk
    i += 4
"""


def test_kill_9_during_heavy_writes_never_leaves_a_bad_block(tmp_path: Path) -> None:
    nbytes = 64 << 10
    rng = random.Random(1234)
    acknowledged: set[bytes] = set()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for round_ in range(3):
        child = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), NS_ID, f"r{round_}", str(nbytes)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
        assert child.stdout is not None
        for _ in range(rng.randrange(5, 40)):  # let it write some batches, then kill it mid-stream
            line = child.stdout.readline()
            assert line, child.stderr.read() if child.stderr else "writer died"
            acknowledged.update(bytes.fromhex(x) for x in line.split())
        # A batch takes tens of ms: a random pause puts the kill at a random point of a write (not an
        # assertion on timing; any moment must be safe).
        time.sleep(rng.uniform(0.0, 0.05))
        child.send_signal(signal.SIGKILL)
        out, _ = child.communicate()
        assert child.returncode == -signal.SIGKILL
        for line in out.splitlines(keepends=True):  # lines it got out before dying are acknowledged too
            if line.endswith("\n"):
                acknowledged.update(bytes.fromhex(x) for x in line.split())

        store = TieredStore(NS_ID, nbytes, 0, tmp_path, 1 << 40)
        report = store.open()
        assert report.quarantined == 0, "a kill must never leave a torn file under a final name"
        assert [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")] == []
        on_disk = store.snapshot()[DISK]
        assert acknowledged <= set(on_disk), "every flushed block survived"
        result = store.read(on_disk)
        assert result.reason == "" and result.hashes == on_disk
        for x, p in zip(result.hashes, result.payloads):
            assert bytes(p) == hashlib.shake_256(x).digest(nbytes)
        store.close()
