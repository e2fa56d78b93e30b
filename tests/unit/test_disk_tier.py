"""The NVMe tier on real files: round trip, every kind of damage caught and quarantined, warm restart,
watermark eviction, a full or failing disk, and concurrent readers and writers."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from deepinfer.cache import block_file as bf
from deepinfer.cache import block_io, pool_files
from deepinfer.cache import disk_tier as dt
from deepinfer.cache.disk_tier import DiskTier

NS_ID = hashlib.sha256(b"test namespace").hexdigest()
OTHER_NS_ID = hashlib.sha256(b"other namespace").hexdigest()
N = 4096  # payload bytes per block
FILE = bf.HEADER_BYTES + N


def h(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


def payload_for(block_hash: bytes) -> bytes:
    return hashlib.shake_256(block_hash).digest(N)


class Log:
    """Records a tier's changes and checks they are consistent: stored only when absent, evicted only
    when present."""

    def __init__(self) -> None:
        self.live: set[bytes] = set()
        self.changes: list[tuple[str, bytes]] = []

    def __call__(self, kind: str, hashes: list[bytes]) -> None:
        for x in hashes:
            self.changes.append((kind, x))
            if kind == "stored":
                assert x not in self.live
                self.live.add(x)
            else:
                self.live.remove(x)


def make(root: Path, capacity_blocks: int = 1000, namespace: str = NS_ID, **kw: object) -> DiskTier:
    tier = DiskTier(root, namespace, N, capacity_blocks * FILE, **kw)  # type: ignore[arg-type]
    tier.open()
    return tier


def put(tier: DiskTier, *ids: int) -> None:
    for i in ids:
        assert tier.put(h(i), payload_for(h(i))).stored


def served(tier: DiskTier, i: int) -> bool:
    got = tier.get(h(i))
    if got.payload is None:
        return False
    assert bytes(got.payload) == payload_for(h(i))
    return True


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith(dt.TEMP_SUFFIX)]


def test_round_trip_and_layout(tmp_path: Path) -> None:
    tier = make(tmp_path)
    put(tier, 1, 2, 3)
    path = tier.path_of(h(1))
    assert path == tmp_path / NS_ID / h(1).hex()[:2] / f"{h(1).hex()}.kvb"
    assert path.stat().st_size == FILE
    assert bytes(bf.verify(path.read_bytes(), NS_ID, h(1))) == payload_for(h(1))
    assert all(served(tier, i) for i in (1, 2, 3)) and not served(tier, 4)
    assert tier.get(h(4)).reason == dt.MISS
    assert temp_files(tmp_path) == []
    stats = tier.stats()
    assert stats["writes"] == 3 and stats["hits"] == 3 and stats["misses"] == 2 and stats["bytes"] == 3 * FILE


def test_put_skips_held_and_refuses_wrong_size(tmp_path: Path) -> None:
    tier = make(tmp_path)
    put(tier, 1)
    assert tier.put(h(1), payload_for(h(1))).reason == dt.EXISTS
    assert tier.put(h(2), b"short").reason == dt.WRONG_SIZE
    assert tier.put(b"short hash", payload_for(h(2))).reason == dt.WRONG_SIZE
    assert len(tier) == 1


def test_put_before_open_is_a_programming_error(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, NS_ID, N, 10 * FILE)
    with pytest.raises(RuntimeError):
        tier.put(h(1), payload_for(h(1)))


# --- damage ----------------------------------------------------------------------------------------------


def flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x5A
    path.write_bytes(bytes(raw))


def damage_header(tier: DiskTier) -> list[tuple[int, str]]:
    flip(tier.path_of(h(1)), 50)  # inside the block-hash field
    return [(1, bf.CHECKSUM_MISMATCH)]


def damage_magic(tier: DiskTier) -> list[tuple[int, str]]:
    flip(tier.path_of(h(1)), 0)
    return [(1, bf.BAD_MAGIC)]


def damage_payload(tier: DiskTier) -> list[tuple[int, str]]:
    flip(tier.path_of(h(1)), bf.HEADER_BYTES + N // 2)
    return [(1, bf.CHECKSUM_MISMATCH)]


def truncate(tier: DiskTier) -> list[tuple[int, str]]:
    os.truncate(tier.path_of(h(1)), FILE - 100)
    return [(1, bf.TRUNCATED)]


def truncate_into_header(tier: DiskTier) -> list[tuple[int, str]]:
    os.truncate(tier.path_of(h(1)), 10)
    return [(1, bf.TRUNCATED)]


def grow(tier: DiskTier) -> list[tuple[int, str]]:
    with open(tier.path_of(h(1)), "ab") as f:
        f.write(b"\0" * 10)
    return [(1, bf.LENGTH_MISMATCH)]


def swap_payloads(tier: DiskTier) -> list[tuple[int, str]]:
    a, b = tier.path_of(h(1)), tier.path_of(h(2))
    raw_a, raw_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(raw_a[:bf.HEADER_BYTES] + raw_b[bf.HEADER_BYTES:])
    b.write_bytes(raw_b[:bf.HEADER_BYTES] + raw_a[bf.HEADER_BYTES:])
    return [(1, bf.CHECKSUM_MISMATCH), (2, bf.CHECKSUM_MISMATCH)]


def copy_under_other_name(tier: DiskTier) -> list[tuple[int, str]]:
    shutil.copyfile(tier.path_of(h(2)), tier.path_of(h(1)))  # a valid file, of another block
    return [(1, bf.WRONG_HASH)]


def other_namespace_file(tier: DiskTier) -> list[tuple[int, str]]:
    tier.path_of(h(1)).write_bytes(bf.encode(OTHER_NS_ID, h(1), payload_for(h(1))))
    return [(1, bf.WRONG_NAMESPACE)]


DAMAGE = [damage_header, damage_magic, damage_payload, truncate, truncate_into_header, grow, swap_payloads,
          copy_under_other_name, other_namespace_file]


@pytest.mark.parametrize("damage", DAMAGE, ids=[d.__name__ for d in DAMAGE])
def test_damaged_file_is_a_miss_quarantined_and_replaceable(
        tmp_path: Path, damage: Callable[[DiskTier], list[tuple[int, str]]]) -> None:
    log = Log()
    tier = make(tmp_path, on_change=log)
    put(tier, 1, 2, 3)
    expected = damage(tier)
    for i, reason in expected:
        got = tier.get(h(i))
        assert got.payload is None and got.reason == reason and got.removed
        assert not tier.path_of(h(i)).exists() and not tier.contains(h(i))
        assert tier.get(h(i)).reason == dt.MISS  # and stays a miss
    stats = tier.stats()
    assert stats["quarantined"] == len(expected)
    for reason in {r for _, r in expected}:
        assert stats[f"quarantined_{reason}"] == sum(r == reason for _, r in expected)
    quarantined = [p.name for p in tier.quarantine.dir.iterdir()]
    assert len(quarantined) == len(expected)
    for i, reason in expected:  # named by block and reason
        assert any(name.startswith(f"{h(i).hex()}.{reason}.") for name in quarantined)
    assert ("evicted", h(1)) in log.changes and log.live == set(tier.hashes())
    # The untouched block is still served, and a fresh write of the right data is accepted and served.
    assert served(tier, 3)
    for i, _ in expected:
        put(tier, i)
        assert served(tier, i)


def test_vanished_file_is_a_miss(tmp_path: Path) -> None:
    log = Log()
    tier = make(tmp_path, on_change=log)
    put(tier, 1, 2)
    tier.path_of(h(1)).unlink()
    got = tier.get(h(1))
    assert got.payload is None and got.reason == dt.VANISHED and got.removed
    assert tier.stats()["vanished"] == 1 and tier.stats().get("quarantined", 0) == 0
    assert log.live == {h(2)} and served(tier, 2)


def test_quarantine_keeps_only_the_newest_files(tmp_path: Path) -> None:
    tier = make(tmp_path, max_quarantine_files=2)
    put(tier, *range(4))
    for i in range(4):
        flip(tier.path_of(h(i)), bf.HEADER_BYTES)
        assert tier.get(h(i)).reason == bf.CHECKSUM_MISMATCH
    names = {p.name[:64] for p in (tmp_path / dt.QUARANTINE_DIR / NS_ID).iterdir()}
    assert names == {h(2).hex(), h(3).hex()} and tier.stats()["quarantined"] == 4


# --- warm restart ----------------------------------------------------------------------------------------


def test_warm_restart_serves_what_was_written(tmp_path: Path) -> None:
    put(make(tmp_path), *range(10))
    log = Log()
    tier = DiskTier(tmp_path, NS_ID, N, 1000 * FILE, on_change=log)
    report = tier.open()
    assert report.loaded == 10 and report.loaded_bytes == 10 * FILE
    assert report.other_namespaces == report.temp_removed == report.quarantined == report.evicted == 0
    assert all(served(tier, i) for i in range(10))
    assert log.live == {h(i) for i in range(10)}  # loaded blocks are reported stored


def test_open_twice_is_refused(tmp_path: Path) -> None:
    tier = make(tmp_path)
    with pytest.raises(RuntimeError):
        tier.open()


def test_restart_leaves_other_namespaces_alone_and_removes_only_abandoned_temp_files(tmp_path: Path) -> None:
    put(make(tmp_path), 1, 2)
    put(make(tmp_path / "sub"), 9)  # a different root is not touched
    other = DiskTier(tmp_path, OTHER_NS_ID, N, 100 * FILE)
    assert other.open().loaded == 0  # another model on the same root: ours is not its business...
    put(other, 3, 4, 5)
    shard = tmp_path / NS_ID / "ab"
    shard.mkdir(parents=True, exist_ok=True)
    day_old = os.stat(tmp_path).st_mtime - pool_files.ABANDONED_AFTER_S - 60
    stale = [shard / f".{'ab' * 32}.x1.tmp", shard / ".zz.tmp"]  # not our naming: judged by age alone
    fresh = shard / f".{'ab' * 32}.y2.tmp"  # maybe a write in progress on another host
    for path in (*stale, fresh):
        path.write_bytes(b"half a block")
    for path in stale:
        os.utime(path, (day_old, day_old))
    (tmp_path / "notes.txt").write_text("not ours")
    (tmp_path / "some-dir").mkdir()

    tier = DiskTier(tmp_path, NS_ID, N, 100 * FILE)
    report = tier.open()  # ... and theirs is not ours
    assert report.loaded == 2 and report.other_namespaces == 1
    assert report.temp_removed == 2 and report.temp_kept == 1
    assert all(served(tier, i) for i in (1, 2)) and all(served(other, i) for i in (3, 4, 5))
    assert len(list((tmp_path / OTHER_NS_ID).rglob("*.kvb"))) == 3
    assert (tmp_path / "notes.txt").exists() and (tmp_path / "some-dir").exists()
    assert (tmp_path / "sub" / NS_ID).exists()
    assert temp_files(tmp_path / NS_ID) == [fresh]


def test_restart_quarantines_files_whose_header_does_not_match(tmp_path: Path) -> None:
    tier = make(tmp_path)
    put(tier, *range(6))
    flip(tier.path_of(h(0)), 0)  # bad magic
    os.truncate(tier.path_of(h(1)), FILE - 1)
    shutil.copyfile(tier.path_of(h(3)), tier.path_of(h(2)))  # valid file, wrong name
    tier.path_of(h(4)).write_bytes(bf.encode(OTHER_NS_ID, h(4), payload_for(h(4))))
    flip(tier.path_of(h(5)), bf.HEADER_BYTES + 7)  # payload damage: passes the header check, caught on read

    again = DiskTier(tmp_path, NS_ID, N, 1000 * FILE)
    report = again.open()
    assert report.quarantined == 4 and report.loaded == 2
    stats = again.stats()
    for reason in (bf.BAD_MAGIC, bf.TRUNCATED, bf.WRONG_HASH, bf.WRONG_NAMESPACE):
        assert stats[f"quarantined_{reason}"] == 1
    assert served(again, 3)
    assert again.get(h(5)).reason == bf.CHECKSUM_MISMATCH


def test_restart_orders_eviction_by_file_mtime(tmp_path: Path) -> None:
    tier = make(tmp_path)
    put(tier, *range(4))
    for age, i in enumerate([2, 0, 3, 1]):  # 2 is oldest
        os.utime(tier.path_of(h(i)), ns=(1_000_000_000 * (age + 1),) * 2)
    again = make(tmp_path)
    assert again.hashes() == [h(2), h(0), h(3), h(1)]


def test_restart_with_a_smaller_capacity_evicts_down_to_low_watermark(tmp_path: Path) -> None:
    put(make(tmp_path), *range(10))
    tier = DiskTier(tmp_path, NS_ID, N, 5 * FILE, high_watermark=0.9, low_watermark=0.5)
    report = tier.open()
    assert report.evicted == 8 and report.loaded == 2 and len(tier) == 2
    assert len(list((tmp_path / NS_ID).rglob("*.kvb"))) == 2


# --- capacity --------------------------------------------------------------------------------------------


def test_watermark_eviction_is_lru_and_spares_pinned_blocks(tmp_path: Path) -> None:
    log = Log()
    tier = make(tmp_path, capacity_blocks=10, high_watermark=0.95, low_watermark=0.85, on_change=log)
    put(tier, *range(9))  # 9 of 10: below the high watermark
    assert len(tier) == 9
    assert served(tier, 0)  # a use: 0 is now the most recent
    assert tier.pin(h(1))
    result = tier.put(h(9), payload_for(h(9)))  # would pass 95%: evict down to 85% first
    assert result.stored and result.evicted == [h(2), h(3)]
    assert not tier.path_of(h(2)).exists() and not tier.path_of(h(3)).exists()
    assert len(tier) == 8 and tier.used_bytes == 8 * FILE
    assert tier.contains(h(1)) and tier.contains(h(0))
    assert log.live == set(tier.hashes()) and tier.stats()["evictions"] == 2
    tier.unpin(h(1))  # order now, oldest first: 1 4 5 6 7 8 0 9
    put(tier, 10)  # 9 files: still below 95%
    assert tier.put(h(11), payload_for(h(11))).evicted == [h(1), h(4)]  # unpinned, 1 is evictable again


def test_everything_pinned_means_no_room(tmp_path: Path) -> None:
    tier = make(tmp_path, capacity_blocks=3, high_watermark=1.0, low_watermark=1.0)
    put(tier, 0, 1, 2)
    for i in range(3):
        tier.pin(h(i))
    result = tier.put(h(3), payload_for(h(3)))
    assert not result.stored and result.reason == dt.NO_ROOM and result.evicted == []
    assert tier.stats()["dropped_no_room"] == 1
    assert all(served(tier, i) for i in range(3))


def test_disk_full_drops_the_write_frees_space_and_keeps_serving(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    log = Log()
    tier = make(tmp_path, capacity_blocks=100, on_change=log)
    put(tier, *range(20))
    real_write_all = block_io.write_all

    def full_disk(fd: int, chunks: object) -> None:
        os.write(fd, b"partial")  # a write that fails half way
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(block_io, "write_all", full_disk)
    result = tier.put(h(20), payload_for(h(20)))  # must not raise
    assert not result.stored and result.reason == dt.DISK_FULL
    assert len(result.evicted) == 3 and set(result.evicted) == {h(0), h(1), h(2)}  # 15% of 20, oldest first
    assert not tier.contains(h(20)) and not tier.path_of(h(20)).exists()
    assert temp_files(tmp_path) == []
    stats = tier.stats()
    assert stats["write_errors_no_space"] == 1 and stats["write_errors"] == 1
    assert all(served(tier, i) for i in range(3, 20))

    def io_error(fd: int, chunks: object) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(block_io, "write_all", io_error)
    assert tier.put(h(21), payload_for(h(21))).reason == dt.IO_ERROR
    assert tier.stats()["write_errors_io"] == 1 and temp_files(tmp_path) == []

    monkeypatch.setattr(block_io, "write_all", real_write_all)
    put(tier, 20, 21)
    assert served(tier, 20) and served(tier, 21)
    assert log.live == set(tier.hashes())


def test_a_removed_shard_directory_is_recreated(tmp_path: Path) -> None:
    tier = make(tmp_path)
    put(tier, 1)
    shutil.rmtree(tier.path_of(h(1)).parent)  # someone wipes part of the cache by hand
    assert not served(tier, 1)
    put(tier, 1)
    assert served(tier, 1)


def test_drop_page_cache_advises_every_file(tmp_path: Path) -> None:
    tier = make(tmp_path)
    put(tier, *range(5))
    assert tier.drop_page_cache() == (5 if hasattr(os, "posix_fadvise") else 0)
    assert all(served(tier, i) for i in range(5))


def test_closed_tier_serves_and_stores_nothing(tmp_path: Path) -> None:
    tier = make(tmp_path)
    put(tier, 1)
    tier.close()
    assert tier.get(h(1)).payload is None
    assert tier.put(h(2), payload_for(h(2))).reason == dt.CLOSED
    assert tier.path_of(h(1)).exists()  # files stay for the next open


def test_concurrent_readers_and_writers_never_see_wrong_bytes(tmp_path: Path) -> None:
    log = Log()
    tier = make(tmp_path, capacity_blocks=20, on_change=log)
    lock = threading.Lock()
    wrong: list[int] = []

    def writer(seed: int) -> None:
        for k in range(150):
            i = (k * 5 + seed) % 60
            tier.put(h(i), payload_for(h(i)))

    def reader(seed: int) -> None:
        for k in range(300):
            i = (k * 3 + seed) % 60
            got = tier.get(h(i))
            if got.payload is not None and bytes(got.payload) != payload_for(h(i)):
                with lock:
                    wrong.append(i)
            elif got.payload is None and got.reason not in (dt.MISS,):
                with lock:
                    wrong.append(-i - 1)  # no file may vanish or go bad under a reader

    threads = [threading.Thread(target=writer, args=(s,)) for s in range(2)]
    threads += [threading.Thread(target=reader, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []
    assert log.live == set(tier.hashes())
    assert tier.used_bytes == len(tier) * FILE <= tier.capacity_bytes
    on_disk = {bytes.fromhex(p.stem) for p in (tmp_path / NS_ID).rglob("*.kvb")}
    assert on_disk == set(tier.hashes())
    assert temp_files(tmp_path) == []
