"""The cache daemon (`kvcache`, one per host): the host-DRAM and disk tiers of the KV cache behind a socket.

A thin shell around `deepinfer.cache.store.TieredStore`. Sockets: the service DEALER to the router (Hello,
heartbeats, KvEvents out; KvResync, Shutdown in) and a bound ROUTER where the workers of this host ask:

* CacheLookup → CacheLookupReply: where each block is (memory only, answered at once);
* CacheFetch → CacheBlocks: the longest cached prefix, read and verified on the I/O threads (pinned while
  read, promoted from disk to DRAM), one zero-copy frame per block straight from the tier's own bytes
  (gathering ~90 MB into one fresh buffer would cost more than the wire); whatever is not ready by the
  deadline is left out — a slow disk means fewer hits, never a stalled prefill;
* CacheStore → CacheStoreAck: write-behind from workers; blocks go to DRAM now and to disk behind, on
  the I/O threads (files are written and fsynced before they become visible).

Every file operation runs on a thread pool, never on the event loop; the store is thread-safe. Requests are
handled concurrently (a slow disk read does not hold up lookups). On start the disk tier's index is
rebuilt from the files (warm restart) and a snapshot of both tiers is published, so a router that knew
the previous incarnation resynchronizes at once.
"""

from __future__ import annotations

import asyncio
import math
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import zmq.asyncio

from deepinfer.cache.hashing import HASH_BYTES
from deepinfer.cache.store import TieredStore
from deepinfer.engine.fetch import resolve_model
from deepinfer.engine.identity import cache_namespace, model_config_at
from deepinfer.engine.tokenizer import Tokenizer
from deepinfer.protocol import messages as m
from deepinfer.protocol.sockets import arecv_routed, asend_msg, make_router
from deepinfer.services.base import Handler, Service
from deepinfer.services.kv_events import KvEventPublisher

TIERS = ("host", "disk")
EVENTS_PERIOD_S = 0.05
FLUSH_BATCH = 16  # blocks per disk-flush call: bounds how long one I/O-thread task runs


class KvCacheService(Service):
    role = "kvcache"

    def __init__(self, instance: str, backend: str, ctx: zmq.asyncio.Context, model: str, endpoint: str,
                 directory: str | Path, host_mb: int, disk_mb: int, block_size: int = 16, io_threads: int = 4,
                 **kw: Any) -> None:
        path = resolve_model(model)
        config = model_config_at(path)
        self.namespace = cache_namespace(path, config, Tokenizer.load(path).fingerprint, block_size)
        super().__init__(instance, backend, ctx, block_hash_scheme=self.namespace.handshake_scheme, **kw)
        self.endpoint = endpoint
        self.block_shape = (config.num_layers, 2, block_size, config.num_kv_heads, config.head_dim)
        self.block_nbytes = math.prod(self.block_shape) * 4  # float32 KV
        self.store = TieredStore(self.namespace.id, self.block_nbytes, host_mb << 20, Path(directory),
                                 disk_mb << 20)
        self.io = ThreadPoolExecutor(io_threads, thread_name_prefix=f"{instance}-io")
        self.publisher = KvEventPublisher(instance, self.incarnation)
        self.sock: Any = None
        self._inflight: set[asyncio.Task[None]] = set()
        self.refused_stores = 0

    # -- lifecycle --------------------------------------------------------------------------

    async def on_start(self) -> None:
        report = await self._io(self.store.open)
        self.log.info("disk tier opened", report=str(report), namespace=self.namespace.id[:12])
        self.sock = self.socket(make_router(self.ctx, self.endpoint))
        await self._publish_snapshot()

    async def on_stop(self) -> None:
        for t in list(self._inflight):
            t.cancel()
        self.io.shutdown(wait=True, cancel_futures=True)
        self.store.close()

    def tasks(self) -> list[Any]:
        return [self.dispatch_forever(self.sock, arecv_routed), self._flush_loop(), self._events_loop()]

    def handlers(self) -> dict[type, Handler]:
        return {
            m.Welcome: self._ignore,
            m.Shutdown: self._on_shutdown,
            m.KvResync: self._on_resync,
            m.CacheLookup: self._on_lookup,
            m.CacheFetch: self._spawn(self._fetch),
            m.CacheStore: self._spawn(self._store),
        }

    def idle(self) -> bool:
        return not self._inflight and not self.store.pending_writes()

    async def _ignore(self, *msg: Any) -> None:
        pass

    async def _on_shutdown(self, msg: m.Shutdown) -> None:
        self.stop()

    def _io(self, fn: Any, *args: Any) -> asyncio.Future[Any]:
        return asyncio.get_running_loop().run_in_executor(self.io, fn, *args)

    def _spawn(self, handler: Any) -> Handler:
        """Run a slow handler as its own task, so the socket keeps being read meanwhile."""

        async def start(*args: Any) -> None:
            task = asyncio.ensure_future(handler(*args))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)

        return start

    # -- requests from workers --------------------------------------------------------------

    async def _on_lookup(self, peer: bytes, req: m.CacheLookup) -> None:
        self.progress += 1
        tiers = self.store.lookup(_valid_hashes(req.block_hashes))
        await asend_msg(self.sock, m.CacheLookupReply(req.request_id, tiers), peer)

    async def _fetch(self, peer: bytes, req: m.CacheFetch) -> None:
        self.progress += 1
        hashes = _valid_hashes(req.block_hashes)
        deadline = time.monotonic() + max(0.0, min(req.deadline_s, 60.0))
        try:
            reply = await self._io(self._read, req.request_id, hashes, deadline)
        except Exception as exc:  # a store bug is a miss for the worker, never a dead daemon
            self.log.exception("fetch failed", request_id=req.request_id)
            reply = m.CacheBlocks(req.request_id, [], [], [], f"internal: {exc}")
        await asend_msg(self.sock, reply, peer)

    def _read(self, request_id: str, hashes: list[bytes], deadline: float) -> m.CacheBlocks:
        """On an I/O thread: read the prefix; each block becomes a tensor over its payload (no copy: a host
        payload is never modified once stored, and the reply holds a reference to it until sent)."""
        limited = len(hashes) > m.MAX_FETCH_BLOCKS
        result = self.store.read(hashes[: m.MAX_FETCH_BLOCKS], deadline)
        if not result.hashes:
            return m.CacheBlocks(request_id, [], [], [], result.reason or "miss")
        with warnings.catch_warnings():  # frombuffer warns about read-only memory; the frame is only read
            warnings.simplefilter("ignore", UserWarning)
            blocks = [torch.frombuffer(p, dtype=torch.float32).view(self.block_shape) for p in result.payloads]
        reason = result.reason or ("reply limit" if limited and len(blocks) == m.MAX_FETCH_BLOCKS else "")
        return m.CacheBlocks(request_id, list(result.hashes), list(result.tiers), blocks, reason)

    async def _store(self, peer: bytes, req: m.CacheStore) -> None:
        self.progress += 1
        problem = self._store_problem(req)
        if problem is not None:
            self.refused_stores += 1
            self.log.warning("store refused", request_id=req.request_id, reason=problem)
            await asend_msg(self.sock, m.CacheStoreAck(req.request_id, 0, 0, problem), peer)
            return
        stored, skipped = await self._io(self._write, req.block_hashes, req.kv)
        await asend_msg(self.sock, m.CacheStoreAck(req.request_id, stored, skipped), peer)

    def _store_problem(self, req: m.CacheStore) -> str | None:
        if req.namespace != self.namespace.id:
            return f"namespace {req.namespace[:12]}… is not this cache's {self.namespace.id[:12]}…"
        want = (len(req.block_hashes), *self.block_shape)
        if req.kv.dtype != torch.float32 or tuple(req.kv.shape) != want:
            return f"kv is {req.kv.dtype} {tuple(req.kv.shape)}; expected float32 {want}"
        if len(_valid_hashes(req.block_hashes)) != len(req.block_hashes):
            return f"block hashes must be {HASH_BYTES} bytes each"
        return None

    def _write(self, hashes: list[bytes], kv: torch.Tensor) -> tuple[int, int]:
        raw = memoryview(kv.contiguous().numpy()).cast("B")
        nb = self.block_nbytes
        # Copies: the received frame's memory goes back to ZeroMQ once this message is dropped.
        payloads = [bytes(raw[i * nb:(i + 1) * nb]) for i in range(len(hashes))]
        return self.store.write(hashes, payloads)

    # -- write-behind and events --------------------------------------------------------------

    async def _flush_loop(self) -> None:
        while True:
            if self.store.pending_writes():
                try:
                    await self._io(self.store.flush, FLUSH_BATCH)
                except Exception:  # the disk tier reports its own failures as counters; this is a bug
                    self.log.exception("disk flush failed")
                    await asyncio.sleep(1.0)
            else:
                await asyncio.sleep(0.02)

    async def _events_loop(self) -> None:
        while True:
            await asyncio.sleep(EVENTS_PERIOD_S)
            await self._publish_changes()

    async def _publish_changes(self) -> None:
        for ev in self.store.drain_events():
            for msg in self.publisher.changes(ev.tier, ev.stored, ev.evicted):
                await self.send_router(msg)

    async def _publish_snapshot(self) -> None:
        await self._publish_changes()
        snap = self.store.snapshot()
        for tier in TIERS:
            for msg in self.publisher.snapshot(tier, snap.get(tier, [])):
                await self.send_router(msg)

    async def _on_resync(self, msg: m.KvResync) -> None:
        self.log.info("resync asked by the router", reason=msg.reason)
        await self._publish_snapshot()


def _valid_hashes(hashes: list[bytes]) -> list[bytes]:
    """The leading run of well-formed hashes (a malformed one ends a prefix like a miss would)."""
    out = []
    for h in hashes:
        if len(h) != HASH_BYTES:
            break
        out.append(h)
    return out
