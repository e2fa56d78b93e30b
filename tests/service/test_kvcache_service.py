"""The cache daemon as one service with fake peers over inproc://: a fake router (answers Hello, collects
KvEvents) and a fake worker (a DEALER). Real files on disk for the disk tier."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
import zmq.asyncio

from deepinfer.protocol import messages as m
from deepinfer.protocol.handshake import check_hello
from deepinfer.protocol.sockets import arecv_msg, arecv_routed, asend_msg, make_dealer, make_router
from deepinfer.services.kvcache import KvCacheService

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

    def __init__(self, model: Path, directory: Path, host_mb: int = 64, disk_mb: int = 256) -> None:
        self.ctx = zmq.asyncio.Context()
        self.model, self.directory, self.host_mb, self.disk_mb = model, directory, host_mb, disk_mb
        self.router = FakeRouter(self.ctx, "inproc://router")
        self.worker = make_dealer(self.ctx, "inproc://kvcache", b"worker-0")
        self.daemon: KvCacheService | None = None
        self.task: asyncio.Task[None] | None = None

    async def start_daemon(self) -> KvCacheService:
        # inproc:// does not reconnect to a re-bound endpoint (ipc:// and tcp:// do): a new worker socket.
        self.worker.close(linger=0)
        self.worker = make_dealer(self.ctx, "inproc://kvcache", b"worker-0")
        self.daemon = KvCacheService("kvcache-0", "inproc://router", self.ctx, str(self.model), "inproc://kvcache",
                                     self.directory, self.host_mb, self.disk_mb, heartbeat_s=0.2)
        ready = asyncio.Event()
        self.task = asyncio.ensure_future(self.daemon.run(ready))
        await asyncio.wait_for(ready.wait(), 30)
        return self.daemon

    async def stop_daemon(self) -> None:
        assert self.daemon is not None and self.task is not None
        self.daemon.stop()
        await asyncio.wait_for(self.task, 30)

    async def ask(self, msg: Any) -> Any:
        await asend_msg(self.worker, msg)
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
    return torch.randn((n, *daemon.block_shape), generator=g, dtype=torch.float32)


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
            look = await mesh.ask(m.CacheLookup("r3", [hashes[0], missing, hashes[2]]))
            assert look.tiers == ["host", "", "host"]
            got = await mesh.ask(m.CacheFetch("r4", [*hashes, missing]))
            assert got.block_hashes == hashes and got.tiers == ["host"] * 3
            assert torch.equal(torch.stack(got.blocks), kv)
            none = await mesh.ask(m.CacheFetch("r5", [missing, hashes[0]]))
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
            return [wrong_ns, wrong_shape, wrong_count], ok, d.refused_stores, d.malformed
        finally:
            await mesh.close()

    refused, ok, n_refused, malformed = asyncio.run(run())
    assert all(r.stored == 0 and r.reason for r in refused)
    assert "namespace" in refused[0].reason and "expected float32" in refused[1].reason
    assert ok.stored == 2 and n_refused == 3 and malformed == 1


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
            look = await mesh.ask(m.CacheLookup("l", hashes))
            got = await mesh.ask(m.CacheFetch("f", hashes))
            stats = d.store.stats()
            later = await mesh.ask(m.CacheLookup("l2", hashes))
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


def test_a_fetch_longer_than_one_reply_is_cut_at_the_frame_limit(smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setattr(m, "MAX_FETCH_BLOCKS", 2)

    async def run():
        mesh = Mesh(smollm2_path, tmp_path / "kv")
        try:
            d = await mesh.start_daemon()
            hashes = block_hashes(5)
            kv = kv_for(d, 5, seed=2)
            await mesh.ask(m.CacheStore("w", d.namespace.id, hashes, kv))
            first = await mesh.ask(m.CacheFetch("f1", hashes))
            rest = await mesh.ask(m.CacheFetch("f2", hashes[2:]))
            return first, rest, kv
        finally:
            await mesh.close()

    first, rest, kv = asyncio.run(run())
    assert first.block_hashes == block_hashes(5)[:2] and first.reason == "reply limit"
    assert torch.equal(torch.stack(first.blocks + rest.blocks[:1]), kv[:3])
