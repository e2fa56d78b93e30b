"""The cache daemon as one service with fake peers over inproc://: a fake router (answers Hello, collects
KvEvents) and a fake worker (a DEALER). Real files on disk for the disk tier."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
import zmq
import zmq.asyncio

from deepinfer.cache import block_file as bf
from deepinfer.protocol import messages as m
from deepinfer.protocol.handshake import check_hello
from deepinfer.protocol.sockets import arecv_msg, arecv_routed, asend_msg, make_dealer, make_router
from deepinfer.services.kvcache import KvCacheService
from tests.small_fs import small_tmpfs

pytestmark = pytest.mark.smollm2  # the daemon derives its namespace from the real model's files


class FakeRouter:
    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        self.sock = make_router(ctx, endpoint)
        self.events: list[m.KvEvents] = []
        self.hellos: list[m.Hello] = []
        self.peer: bytes | None = None
        self.task = asyncio.ensure_future(self._loop())

    async def _loop(self) -> None:
        while True:
            ident, msg = await arecv_routed(self.sock)
            if isinstance(msg, m.Hello):
                self.hellos.append(msg)
                self.peer = ident
                await asend_msg(self.sock, check_hello(msg, m.PROTOCOL_VERSION, None, None, service="router"), ident)
            elif isinstance(msg, m.KvEvents):
                self.events.append(msg)

    def view(self, tier: str) -> set[bytes]:
        """What a consumer applying the events in order believes `tier` holds."""
        held: set[bytes] = set()
        for ev in self.events:
            if ev.tier != tier:
                continue
            if ev.snapshot:
                held = set()
            held |= set(ev.stored)
            held -= set(ev.evicted)
        return held

    def close(self) -> None:
        self.task.cancel()
        self.sock.close(linger=0)


def block_hashes(n: int, tag: bytes = b"") -> list[bytes]:
    return [hashlib.sha256(tag + i.to_bytes(4, "little")).digest() for i in range(n)]


class Mesh:
    """A daemon between a fake router and a fake worker."""

    def __init__(self, model: Path, directory: Path, host_mb: int = 64, disk_mb: int = 256, **daemon_kw: Any) -> None:
        self.ctx = zmq.asyncio.Context()
        self.model, self.directory, self.host_mb, self.disk_mb = model, directory, host_mb, disk_mb
        self.daemon_kw = daemon_kw
        self.router = FakeRouter(self.ctx, "inproc://router")
        self.worker = make_dealer(self.ctx, "inproc://kvcache", b"worker-0")
        self.daemon: KvCacheService | None = None
        self.task: asyncio.Task[None] | None = None

    async def start_daemon(self) -> KvCacheService:
        # inproc:// does not reconnect to a re-bound endpoint (ipc:// and tcp:// do): a new worker socket,
        # connected only once the daemon has bound. Connecting earlier can attach it to the previous daemon's
        # socket while libzmq is still tearing it down; that pipe then dies and a DEALER with no peer blocks
        # its sends forever (a CI run hung here for 900 s).
        self.worker.close(linger=0)
        self.daemon = KvCacheService("kvcache-0", "inproc://router", self.ctx, str(self.model), "inproc://kvcache",
                                     self.directory, self.host_mb, self.disk_mb, heartbeat_s=0.2, **self.daemon_kw)
        ready = asyncio.Event()
        self.task = asyncio.ensure_future(self.daemon.run(ready))
        await asyncio.wait_for(ready.wait(), 30)
        self.worker = make_dealer(self.ctx, "inproc://kvcache", b"worker-0")
        return self.daemon

    async def stop_daemon(self) -> None:
        assert self.daemon is not None and self.task is not None
        self.daemon.stop()
        await asyncio.wait_for(self.task, 30)

    async def ask(self, msg: Any) -> Any:
        await asyncio.wait_for(asend_msg(self.worker, msg), 30)
        return await asyncio.wait_for(arecv_msg(self.worker), 30)

    async def flushed(self) -> None:
        assert self.daemon is not None
        for _ in range(400):
            if not self.daemon.store.pending_writes():
                return
            await asyncio.sleep(0.025)
        raise AssertionError("disk writes did not finish")

    async def close(self) -> None:
        if self.task is not None and not self.task.done():
            await self.stop_daemon()
        self.router.close()
        self.worker.close(linger=0)
        self.ctx.term()


def kv_for(daemon: KvCacheService, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(daemon.kv.pool_shape(n), generator=g, dtype=daemon.kv.dtype)


def test_store_lookup_fetch_and_events(smollm2_path, tmp_path):
    async def run():
        mesh = Mesh(smollm2_path, tmp_path / "kv")
        try:
            d = await mesh.start_daemon()
            hashes = block_hashes(3)
            kv = kv_for(d, 3)
            ack = await mesh.ask(m.CacheStore("r1", d.namespace.id, hashes, kv))
            assert (ack.stored, ack.skipped, ack.reason) == (3, 0, "")
            again = await mesh.ask(m.CacheStore("r2", d.namespace.id, hashes, kv))
            assert (again.stored, again.skipped) == (0, 3)
            missing = block_hashes(1, b"other")[0]
            look = await mesh.ask(m.CacheLookup("r3", [hashes[0], missing, hashes[2]], d.namespace.id))
            assert look.tiers == ["host", "", "host"]
            got = await mesh.ask(m.CacheFetch("r4", [*hashes, missing], namespace=d.namespace.id))
            assert got.block_hashes == hashes and got.tiers == ["host"] * 3
            assert torch.equal(torch.stack(got.blocks), kv)
            none = await mesh.ask(m.CacheFetch("r5", [missing, hashes[0]], namespace=d.namespace.id))
            assert none.block_hashes == [] and none.blocks == []
            await mesh.flushed()
            await asyncio.sleep(0.2)  # one events period
            return set(hashes), mesh.router
        finally:
            await mesh.close()

    hashes, router = asyncio.run(run())
    assert router.hellos[0].block_hash_scheme.startswith("sha256-chain-v1:")
    assert [e.seq for e in router.events] == list(range(len(router.events)))  # numbered without gaps
    assert router.events[0].snapshot  # a fresh daemon announces what it holds at once
    assert router.view("host") == hashes and router.view("disk") == hashes


def test_bad_stores_are_refused_and_the_daemon_keeps_serving(smollm2_path, tmp_path):
    async def run():
        mesh = Mesh(smollm2_path, tmp_path / "kv")
        try:
            d = await mesh.start_daemon()
            hashes = block_hashes(2)
            wrong_ns = await mesh.ask(m.CacheStore("a", "0" * 64, hashes, kv_for(d, 2)))
            wrong_shape = await mesh.ask(m.CacheStore("b", d.namespace.id, hashes, torch.zeros(2, 3)))
            wrong_count = await mesh.ask(m.CacheStore("c", d.namespace.id, hashes, kv_for(d, 3)))
            await mesh.worker.send_multipart([b"\x44", b"\xc1garbage"])  # a malformed frame
            ok = await mesh.ask(m.CacheStore("d", d.namespace.id, hashes, kv_for(d, 2)))
            # The blocks are held now, and still only a request in the daemon's namespace reaches them.
            foreign = [await mesh.ask(m.CacheLookup("e", hashes, "0" * 64)),
                       await mesh.ask(m.CacheFetch("f", hashes, namespace="0" * 64)),
                       await mesh.ask(m.CacheFetch("g", hashes))]  # none named: refused too
            own = await mesh.ask(m.CacheFetch("h", hashes, namespace=d.namespace.id))
            return [wrong_ns, wrong_shape, wrong_count], ok, d.refused_stores, d.malformed, foreign, own, d.refused
        finally:
            await mesh.close()

    refused, ok, n_refused, malformed, foreign, own, by_reason = asyncio.run(run())
    assert all(r.stored == 0 and r.reason for r in refused)
    assert "namespace" in refused[0].reason and "expected float32" in refused[1].reason
    assert ok.stored == 2 and n_refused == 3 and malformed == 1
    look, *fetches = foreign
    assert look.tiers == ["", ""]
    assert all(f.block_hashes == [] and f.blocks == [] and "namespace" in f.reason for f in fetches)
    assert own.block_hashes == block_hashes(2)
    assert by_reason == {"namespace": 4, "kv": 2}


def test_warm_restart_serves_from_disk_and_never_serves_a_corrupt_block(smollm2_path, tmp_path):
    async def run():
        mesh = Mesh(smollm2_path, tmp_path / "kv")
        try:
            d = await mesh.start_daemon()
            hashes = block_hashes(4)
            kv = kv_for(d, 4, seed=1)
            assert (await mesh.ask(m.CacheStore("w", d.namespace.id, hashes, kv))).stored == 4
            await mesh.flushed()
            await mesh.stop_daemon()

            # Damage block 2's file on disk while the daemon is down.
            files = {p.stem: p for p in (tmp_path / "kv").rglob("*.kvb")}
            assert len(files) == 4
            victim = files[hashes[2].hex()]
            raw = bytearray(victim.read_bytes())
            raw[len(raw) // 2] ^= 0xFF
            victim.write_bytes(bytes(raw))

            d = await mesh.start_daemon()
            look = await mesh.ask(m.CacheLookup("l", hashes, d.namespace.id))
            got = await mesh.ask(m.CacheFetch("f", hashes, namespace=d.namespace.id))
            stats = d.store.stats()
            later = await mesh.ask(m.CacheLookup("l2", hashes, d.namespace.id))
            return look, got, kv, stats, later
        finally:
            await mesh.close()

    look, got, kv, stats, later = asyncio.run(run())
    assert look.tiers == ["disk"] * 4  # rebuilt from the files: a warm restart
    assert got.block_hashes == block_hashes(4)[:2] and got.tiers == ["disk", "disk"]
    assert torch.equal(torch.stack(got.blocks), kv[:2])  # the prefix before the corrupt block, byte for byte
    assert got.reason == "corrupt"
    assert sum(v for k, v in stats.items() if "quarantine" in k) >= 1
    assert later.tiers == ["host", "host", "", "disk"]  # promoted on hit; the corrupt one is gone


def test_a_lookup_finds_what_another_daemon_on_the_pool_wrote_after_this_one_opened(smollm2_path, tmp_path):
    """Two hosts' daemons on one pool directory (issue 32): blocks the other wrote after this daemon opened are
    answered as disk hits, fetched byte for byte, and announced to the router as this daemon's."""
    from deepinfer.cache.store import TieredStore

    async def run():
        mesh = Mesh(smollm2_path, tmp_path / "kv")
        try:
            d = await mesh.start_daemon()
            hashes = block_hashes(3, b"pool")
            kv = kv_for(d, 3, seed=2)
            other = TieredStore(d.namespace.id, d.kv.block_nbytes, 64 << 20, tmp_path / "kv", 256 << 20)
            other.open()
            other.write(hashes[:2], d.kv.block_payloads(kv)[:2])
            assert other.flush() == 2
            look = await mesh.ask(m.CacheLookup("l", hashes, d.namespace.id))
            got = await mesh.ask(m.CacheFetch("f", hashes, namespace=d.namespace.id))
            await asyncio.sleep(0.3)  # one events period
            return look, got, kv, hashes, mesh.router
        finally:
            await mesh.close()

    look, got, kv, hashes, router = asyncio.run(run())
    assert look.tiers == ["disk", "disk", ""]
    assert got.block_hashes == hashes[:2] and torch.equal(torch.stack(got.blocks), kv[:2])
    assert set(hashes[:2]) <= router.view("disk")


def test_a_prefetch_reads_the_disk_held_head_into_dram_before_its_fetch(smollm2_path, tmp_path):
    async def run():
        mesh = Mesh(smollm2_path, tmp_path / "kv")
        try:
            d = await mesh.start_daemon()
            hashes = block_hashes(4)
            kv = kv_for(d, 4, seed=3)
            assert (await mesh.ask(m.CacheStore("w", d.namespace.id, hashes, kv))).stored == 4
            await mesh.flushed()
            await mesh.stop_daemon()
            d = await mesh.start_daemon()  # a warm restart: every block on disk only
            before = await mesh.ask(m.CacheLookup("l0", hashes, d.namespace.id))
            await asend_msg(mesh.worker, m.CachePrefetch("p-foreign", hashes, "another-namespace"))
            await asend_msg(mesh.worker, m.CachePrefetch("p", hashes[:3] + block_hashes(1, b"absent"),
                                                         d.namespace.id))
            for _ in range(400):
                if d.prefetched_blocks == 3 and not d.prefetches.tasks:
                    break
                await asyncio.sleep(0.025)
            after = await mesh.ask(m.CacheLookup("l1", hashes, d.namespace.id))  # (no reply came to either)
            got = await mesh.ask(m.CacheFetch("f", hashes, namespace=d.namespace.id))
            return before, after, got, kv, d.prefetched_blocks, dict(d.refused)
        finally:
            await mesh.close()

    before, after, got, kv, prefetched, refused = asyncio.run(run())
    assert before.request_id == "l0" and before.tiers == ["disk"] * 4
    assert after.request_id == "l1" and after.tiers == ["host", "host", "host", "disk"]
    assert prefetched == 3 and refused == {"namespace": 1}
    assert got.tiers == ["host", "host", "host", "disk"] and torch.equal(torch.stack(got.blocks), kv)


def test_a_fetch_longer_than_one_reply_is_cut_at_the_frame_limit(smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setattr(m, "MAX_FETCH_BLOCKS", 2)

    async def run():
        mesh = Mesh(smollm2_path, tmp_path / "kv")
        try:
            d = await mesh.start_daemon()
            hashes = block_hashes(5)
            kv = kv_for(d, 5, seed=2)
            await mesh.ask(m.CacheStore("w", d.namespace.id, hashes, kv))
            first = await mesh.ask(m.CacheFetch("f1", hashes, namespace=d.namespace.id))
            rest = await mesh.ask(m.CacheFetch("f2", hashes[2:], namespace=d.namespace.id))
            return first, rest, kv
        finally:
            await mesh.close()

    first, rest, kv = asyncio.run(run())
    assert first.block_hashes == block_hashes(5)[:2] and first.reason == "reply limit"
    assert torch.equal(torch.stack(first.blocks + rest.blocks[:1]), kv[:3])


# --- bounds ----------------------------------------------------------------------------------------------

FLOOD = 10_000


def test_a_flood_of_requests_keeps_the_tasks_bounded_and_lookups_answered(smollm2_path, tmp_path):
    """10^4 fetches and stores while the disk stalls (every I/O thread blocked): at most the limits run as
    tasks, the rest are answered "overloaded" at once, and once the disk is back lookups are answered."""
    limits = dict(max_fetches_in_flight=8, max_stores_in_flight=2)

    async def run():
        mesh = Mesh(smollm2_path, tmp_path / "kv", **limits)
        try:
            d = await mesh.start_daemon()
            stored = block_hashes(1, b"stored")
            await mesh.ask(m.CacheStore("s0", d.namespace.id, stored, kv_for(d, 1)))
            disk_back = threading.Event()
            for _ in range(d.io._max_workers):  # a stalled disk: every I/O thread is stuck
                d.io.submit(disk_back.wait)
            baseline_tasks = len(asyncio.all_tasks())
            replies: list[Any] = []
            most_tasks = 0

            async def read_replies() -> None:
                nonlocal most_tasks
                while len(replies) + d.replies_dropped < FLOOD:
                    replies.append(await arecv_msg(mesh.worker))
                    most_tasks = max(most_tasks, len(asyncio.all_tasks()))

            reader = asyncio.ensure_future(read_replies())
            one_block = kv_for(d, 1)
            for i in range(FLOOD):
                if i % 100 == 0:  # 1 in 100 a store (each carries a whole block's KV)
                    msg = m.CacheStore(f"s{i}", d.namespace.id, block_hashes(1, b"%d" % i), one_block)
                else:
                    msg = m.CacheFetch(f"f{i}", stored + block_hashes(3, b"%d" % i), namespace=d.namespace.id)
                await asend_msg(mesh.worker, msg)
                if i == FLOOD // 2:
                    assert len(d.fetches.tasks) == d.fetches.limit  # full, and holding
            disk_back.set()
            await asyncio.wait_for(reader, 120)
            look = await mesh.ask(m.CacheLookup("after", stored, d.namespace.id))
            fetch = await mesh.ask(m.CacheFetch("after", stored, namespace=d.namespace.id))
            return d, replies, (look, fetch), baseline_tasks, most_tasks
        finally:
            await mesh.close()

    d, replies, (look, fetch), baseline_tasks, most_tasks = asyncio.run(run())
    assert d.fetches.peak == limits["max_fetches_in_flight"] and d.stores.peak <= limits["max_stores_in_flight"]
    assert most_tasks <= baseline_tasks + sum(limits.values()) + 2  # + the reader and the flood's own task
    assert len(replies) + d.replies_dropped == FLOOD  # every request got an answer (or its reader was too slow)
    fetched = [r for r in replies if isinstance(r, m.CacheBlocks)]
    acks = [r for r in replies if isinstance(r, m.CacheStoreAck)]
    assert len(fetched) + len(acks) == len(replies)
    overloaded = [r for r in fetched if r.reason == "overloaded"]
    assert 0 < len(overloaded) <= d.fetches.refused and all(r.block_hashes == [] for r in overloaded)
    served = [r for r in fetched if r.reason != "overloaded"]  # the disk stalled past their deadlines
    assert served and all(r.block_hashes in ([], block_hashes(1, b"stored")) for r in served)
    assert all((a.stored, a.skipped) == (0, 1) for a in acks if a.reason == "overloaded")
    assert look.tiers == ["host"] and fetch.block_hashes == block_hashes(1, b"stored")


# --- a really full disk ----------------------------------------------------------------------------------


def test_a_full_disk_keeps_the_daemon_serving(smollm2_path, tmp_path):
    """The disk tier on a 2 MiB tmpfs (two SmolLM2 blocks fit): stores beyond it fail on disk with ENOSPC,
    counted and logged; lookups and DRAM hits go on; no half-written file is left."""

    async def run(directory: Path):
        mesh = Mesh(smollm2_path, directory)
        try:
            with structlog.testing.capture_logs() as logs:
                d = await mesh.start_daemon()
                hashes = block_hashes(6, b"full")
                kv = kv_for(d, 6, seed=3)
                for i in range(6):
                    ack = await mesh.ask(m.CacheStore(f"w{i}", d.namespace.id, hashes[i:i + 1], kv[i:i + 1]))
                    assert ack.stored == 1
                    await mesh.flushed()
                look = await mesh.ask(m.CacheLookup("l", hashes, d.namespace.id))
                got = await mesh.ask(m.CacheFetch("f", hashes, namespace=d.namespace.id))
                alive = not mesh.task.done()
            return d, hashes, kv, look, got, alive, logs
        finally:
            await mesh.close()

    with small_tmpfs(tmp_path / "mnt", 2 << 20) as directory:
        d, hashes, kv, look, got, alive, logs = asyncio.run(run(directory))
        leftovers = [p for p in directory.rglob("*") if p.name.endswith(".tmp")]
        files = {p.stem: p for p in directory.rglob("*.kvb")}
        for name, path in files.items():  # whatever did land is whole and valid
            bf.verify(path.read_bytes(), d.namespace.id, bytes.fromhex(name), d.kv.block_nbytes)
    stats = d.store.stats()
    assert alive and stats["disk_write_errors_no_space"] >= 1
    assert any(e["event"] == "disk writes failing: blocks kept in DRAM only" for e in logs)
    assert look.tiers == ["host"] * 6
    assert got.block_hashes == hashes and got.tiers == ["host"] * 6 and torch.equal(torch.stack(got.blocks), kv)
    assert leftovers == [] and 0 < len(files) <= 2
