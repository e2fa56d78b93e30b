"""The cache daemon (`kvcache`, one per host): the host-DRAM and disk tiers of the KV cache behind a socket.

A thin shell around `deepinfer.cache.store.TieredStore`. Sockets: the service DEALER to the router (Hello,
heartbeats, KvEvents out; KvResync, Shutdown in) and a bound ROUTER where the workers of this host ask:

* CacheLookup → CacheLookupReply: where each block is, from memory and answered at once; where that leaves
  a gap in the prefix, after looking through the disk on the I/O threads for blocks other daemons on a shared
  pool wrote since this one opened (a task within the fetch limit; past it, the memory answer at once);
* CacheFetch → CacheBlocks: the longest cached prefix, read and verified on the I/O threads (pinned while
  read, promoted from disk to DRAM), one zero-copy frame per block straight from the tier's own bytes
  (gathering ~90 MB into one fresh buffer would cost more than the wire); whatever is not ready by the
  deadline is left out — a slow disk means fewer hits, never a stalled prefill;
* CachePrefetch, no reply: the disk-held head of a prefix a worker will fetch soon is read into DRAM on the I/O
  threads, at most `max_prefetches_in_flight` at once (past that, dropped and counted: prefetching only saves
  time, and must not take the room of a fetch someone waits for);
* CacheStore → CacheStoreAck: write-behind from workers; blocks go to DRAM now and to disk behind, on
  the I/O threads (files are written and fsynced before they become visible).

Every file operation runs on a thread pool, never on the event loop; the store is thread-safe. Requests are
handled concurrently (a slow disk read does not hold up lookups). On start the disk tier's index is
rebuilt from the files (warm restart) and a snapshot of both tiers is published, so a router that knew
the previous incarnation resynchronizes at once.

Bounded whatever arrives: fetches and stores run as tasks, at most `max_fetches_in_flight` and
`max_stores_in_flight` at once (TaskLimit). Past that a request is answered at once in its own reply type,
with reason "overloaded" (an empty CacheBlocks: a miss; a CacheStoreAck that stored nothing: a cache may
forget), so the worker carries on without waiting out a timeout. Lookups are answered inline (a look-through
is a task within the fetch limit). Replies never wait on a peer: one whose queue is full (it does not read) or
that is gone loses the reply (counted).

Scoped by namespace: a daemon holds one namespace (its model's CacheNamespace: model and tokenizer
fingerprints, KV dtype and layout, block size, hash scheme), and every request names the namespace its hashes
are under. A lookup, fetch or store naming another (or none) is refused — all misses, no blocks, nothing
stored — counted by reason (`refused`, exported as deepinfer_cache_refused_total) and logged with the peer.
Who may ask at all is the socket's business: on tcp:// the cache socket's CURVE allow-list holds only the keys
of the workers that name this daemon, each bound to its instance name (protocol.auth, launch.keys), and every
one of them serves this daemon's model. Tenants are kept apart inside the namespace by the hash chain: each
block's hash is seeded with its tenant's cache salt, which only the router knows and hands out with that
tenant's requests, so no key can name another tenant's blocks it was not given (a worker is trusted with
every tenant it serves; it could store wrong KV under a hash it was given: the daemon cannot check KV).

A disk that fails or fills up costs disk hits only: the store counts the failed writes, the blocks stay in
DRAM, lookups and DRAM hits go on, and the daemon logs the failures (at most every LOG_PERIOD_S).
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import zmq
import zmq.asyncio

from deepinfer.cache.hashing import HASH_BYTES
from deepinfer.cache.pool_share import PoolShare
from deepinfer.cache.store import DISK, TieredStore
from deepinfer.config.engine import DEFAULT_BLOCK_SIZE, DEFAULT_KV_CACHE_DTYPE
from deepinfer.loading.fetch import resolve_model
from deepinfer.loading.identity import model_identity
from deepinfer.metrics.recorders.cache import CacheExport
from deepinfer.protocol import messages as m
from deepinfer.protocol.sockets import arecv_routed, asend_msg, make_router
from deepinfer.services.base import Handler, Service
from deepinfer.services.kv_events import KvEventPublisher

TIERS = ("host", "disk")
EVENTS_PERIOD_S = 0.05
FLUSH_BATCH = 16  # blocks per disk-flush call: bounds how long one I/O-thread task runs
# A fetch has a deadline of about a second: more waiting than this would miss it anyway.
MAX_FETCHES_IN_FLIGHT = 64
# Each in-flight store holds its received KV until copied into the store: this bounds that memory.
MAX_STORES_IN_FLIGHT = 16
MAX_PREFETCHES_IN_FLIGHT = 2  # a prefetch reads disk ahead of need: a couple at once keep the disk busy
PREFETCH_DEADLINE_S = 10.0  # a prefetch still reading after this has been overtaken by its fetch
POOL_ROUND_S = 5.0  # how often a daemon with a pool budget agrees its share with the others
OVERLOADED = "overloaded"  # the reason in a reply to a request refused for lack of room (ErrorCode's word)
LOG_PERIOD_S = 10.0  # a warning that a flood or a failing disk would repeat is logged at most this often


class Throttle:
    """`ready()` is True at most once per `period_s` (monotonic time)."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self._last = -math.inf

    def ready(self) -> bool:
        now = time.monotonic()
        if now - self._last < self.period_s:
            return False
        self._last = now
        return True


class TaskLimit:
    """Runs handlers as tasks, at most `limit` at once. Past that `try_spawn` refuses at once (the caller
    answers "overloaded") rather than queueing, so what a flood of messages can make the daemon hold is
    bounded: `limit` tasks, their messages, and their share of the I/O pool's queue."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a task limit is at least 1, got {limit}")
        self.limit = limit
        self.tasks: set[asyncio.Task[None]] = set()
        self.peak = 0  # the most tasks ever in flight at once: never above `limit`
        self.refused = 0

    def try_spawn(self, handler: Callable[..., Coroutine[Any, Any, None]], *args: Any) -> bool:
        if len(self.tasks) >= self.limit:
            self.refused += 1
            return False
        task = asyncio.ensure_future(handler(*args))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        self.peak = max(self.peak, len(self.tasks))
        return True

    def cancel_all(self) -> None:
        for task in list(self.tasks):
            task.cancel()


class KvCacheService(Service):
    role = "kvcache"

    def __init__(self, instance: str, backend: str, ctx: zmq.asyncio.Context, model: str, endpoint: str,
                 directory: str | Path, host_mb: int, disk_mb: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 kv_cache_dtype: str = DEFAULT_KV_CACHE_DTYPE, io_threads: int = 4,
                 max_fetches_in_flight: int = MAX_FETCHES_IN_FLIGHT,
                 max_stores_in_flight: int = MAX_STORES_IN_FLIGHT,
                 max_prefetches_in_flight: int = MAX_PREFETCHES_IN_FLIGHT, pool_mb: int | None = None,
                 **kw: Any) -> None:
        identity = model_identity(resolve_model(model), block_size, kv_cache_dtype)
        # The engine's KV as the workers hold it: the daemon stores and serves blocks of exactly this spec.
        self.kv = identity.kv
        self.namespace = identity.namespace
        super().__init__(instance, backend, ctx, block_hash_scheme=self.namespace.handshake_scheme, **kw)
        self.endpoint = endpoint
        self.store = TieredStore(self.namespace.id, self.kv.block_nbytes, host_mb << 20, Path(directory),
                                 disk_mb << 20)
        # One budget for every daemon on this pool directory (pool_share), on top of this daemon's own disk_mb.
        self.pool_share = None if pool_mb is None else PoolShare(Path(directory) / self.namespace.id, instance,
                                                                   pool_mb << 20)
        self.io = ThreadPoolExecutor(io_threads, thread_name_prefix=f"{instance}-io")
        self.publisher = KvEventPublisher(instance, self.incarnation)
        self.sock: Any = None
        self.fetches = TaskLimit(max_fetches_in_flight)
        self.stores = TaskLimit(max_stores_in_flight)
        self.prefetches = TaskLimit(max_prefetches_in_flight)
        self.prefetched_blocks = 0  # blocks a prefetch read from disk into DRAM
        self.refused_stores = 0
        self.refused: collections.Counter[str] = collections.Counter()  # requests refused, by reason
        self.replies_dropped = 0  # the peer was gone or not reading (its queue full)
        self._disk_errors_logged = 0
        self._disk_errors_throttle = Throttle(LOG_PERIOD_S)
        self._drops_throttle = Throttle(LOG_PERIOD_S)
        self._overload_throttle = Throttle(LOG_PERIOD_S)
        self._refusal_throttle = Throttle(LOG_PERIOD_S)
        self.cache_export: CacheExport | None = None  # Prometheus: the tiers' sizes, evictions, reads

    # -- lifecycle --------------------------------------------------------------------------

    async def on_start(self) -> None:
        report = await self._io(self.store.open)
        if self.store.disk_error:
            self.log.error("disk tier unusable: serving from DRAM only", error=self.store.disk_error)
        else:
            self.log.info("disk tier opened", report=str(report), namespace=self.namespace.id[:12])
        self.sock = self.socket(make_router(self.ctx, self.endpoint, auth=self.auth.for_bind(self.endpoint, "cache")))
        await self._publish_snapshot()

    async def on_stop(self) -> None:
        self.fetches.cancel_all()
        self.stores.cancel_all()
        self.prefetches.cancel_all()
        self.io.shutdown(wait=True, cancel_futures=True)
        self.store.close()

    def tasks(self) -> list[Any]:
        # The workers' socket takes cache requests only: control comes from the router's side.
        cache_table: dict[type, Handler] = {m.CacheLookup: self._on_lookup, m.CacheFetch: self._on_fetch,
                                            m.CacheStore: self._on_store, m.CachePrefetch: self._on_prefetch}
        loops = [self.dispatch_forever(self.sock, arecv_routed, cache_table), self._flush_loop(), self._events_loop()]
        return loops + ([self._pool_loop()] if self.pool_share is not None else [])

    def handlers(self) -> dict[type, Handler]:
        return {m.KvResync: self._on_resync}

    def record_metrics(self, beat: m.Heartbeat) -> None:
        super().record_metrics(beat)
        if self.exported is not None:
            if self.cache_export is None:
                self.cache_export = CacheExport(self.role, self.instance)
            self.cache_export.stats(self.store.stats())
            self.cache_export.refused(self.refused)

    def idle(self) -> bool:
        return (not self.fetches.tasks and not self.stores.tasks and not self.prefetches.tasks
                and not self.store.pending_writes())

    def _io(self, fn: Any, *args: Any) -> asyncio.Future[Any]:
        return asyncio.get_running_loop().run_in_executor(self.io, fn, *args)

    async def _reply(self, peer: bytes, msg: Any) -> None:
        """Send without ever waiting on the peer: a worker that is gone, or does not read its replies (its
        queue is full), loses this one rather than stalling the daemon for every other worker."""
        try:
            await asend_msg(self.sock, msg, peer, flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self.replies_dropped += 1
            if self._drops_throttle.ready():
                self.log.warning("replies dropped: a worker is gone or not reading", type=type(msg).__name__,
                                 error=str(exc), dropped=self.replies_dropped)

    # -- requests from workers --------------------------------------------------------------

    def _foreign(self, peer: bytes, req: m.CacheLookup | m.CacheFetch | m.CacheStore | m.CachePrefetch) -> str | None:
        """Why `req` is not this daemon's to answer (its namespace is another's), counted and logged; None
        when it is."""
        if req.namespace == self.namespace.id:
            return None
        self.refused["namespace"] += 1
        problem = f"namespace {req.namespace[:12]!r}… is not this cache's {self.namespace.id[:12]}…"
        if self._refusal_throttle.ready():
            self.log.warning("cache request for another namespace refused", type=type(req).__name__,
                             peer=peer.decode(errors="replace"), reason=problem, refused=dict(self.refused))
        return problem

    async def _on_lookup(self, peer: bytes, req: m.CacheLookup) -> None:
        self.progress += 1
        if self._foreign(peer, req) is not None:
            await self._reply(peer, m.CacheLookupReply(req.request_id, [""] * len(req.block_hashes)))
            return
        hashes = _valid_hashes(req.block_hashes)
        tiers = self.store.lookup(hashes)
        if self.store.disk is None or all(tiers) or not self.fetches.try_spawn(self._look_through, peer, req,
                                                                               hashes, tiers):
            await self._reply(peer, m.CacheLookupReply(req.request_id, tiers))

    async def _look_through(self, peer: bytes, req: m.CacheLookup, hashes: list[bytes], tiers: list[str]) -> None:
        """Answer a lookup whose index answer has a gap after looking through the disk (on the I/O threads)
        for blocks other daemons on a shared pool wrote since this one opened (TieredStore.look_through)."""
        try:
            tiers = await self._io(self.store.look_through, hashes, tiers)
        except Exception:  # a store bug costs this look-through only: the memory answer stands
            self.log.exception("look-through failed")
        await self._reply(peer, m.CacheLookupReply(req.request_id, tiers))

    async def _on_fetch(self, peer: bytes, req: m.CacheFetch) -> None:
        """Read on a task of its own (the socket keeps being read meanwhile), if there is room for one."""
        problem = self._foreign(peer, req)
        if problem is not None:
            await self._reply(peer, m.CacheBlocks(req.request_id, [], [], [], problem))
            return
        if not self.fetches.try_spawn(self._fetch, peer, req):
            self._log_overload()
            await self._reply(peer, m.CacheBlocks(req.request_id, [], [], [], OVERLOADED))

    async def _on_store(self, peer: bytes, req: m.CacheStore) -> None:
        problem = self._foreign(peer, req)
        if problem is not None:  # answered at once: it never takes a store's room
            self.refused_stores += 1
            await self._reply(peer, m.CacheStoreAck(req.request_id, 0, 0, problem))
            return
        if not self.stores.try_spawn(self._store, peer, req):
            self._log_overload()
            await self._reply(peer, m.CacheStoreAck(req.request_id, 0, len(req.block_hashes), OVERLOADED))

    async def _on_prefetch(self, peer: bytes, req: m.CachePrefetch) -> None:
        if self._foreign(peer, req) is not None:
            return
        hashes = _valid_hashes(req.block_hashes)[: m.MAX_FETCH_BLOCKS]
        tiers = self.store.lookup(hashes)
        run = next((i for i, t in enumerate(tiers) if not t), len(tiers))  # the leading run: what a fetch reads
        if DISK in tiers[:run]:  # past the limit it is dropped, counted in prefetches.refused: not worth a warning
            self.prefetches.try_spawn(self._prefetch, hashes[:run])

    async def _prefetch(self, hashes: list[bytes]) -> None:
        self.progress += 1
        try:
            result = await self._io(self.store.read, hashes, time.monotonic() + PREFETCH_DEADLINE_S)
        except Exception:  # a store bug costs this prefetch only
            self.log.exception("prefetch failed")
            return
        self.prefetched_blocks += sum(t == DISK for t in result.tiers)

    def _log_overload(self) -> None:
        if self._overload_throttle.ready():
            self.log.warning("overloaded: refusing fetches and stores past the task limits",
                             fetches_refused=self.fetches.refused, stores_refused=self.stores.refused)

    async def _fetch(self, peer: bytes, req: m.CacheFetch) -> None:
        self.progress += 1
        hashes = _valid_hashes(req.block_hashes)
        deadline = time.monotonic() + max(0.0, min(req.deadline_s, 60.0))
        try:
            reply = await self._io(self._read, req.request_id, hashes, deadline)
        except Exception as exc:  # a store bug is a miss for the worker, never a dead daemon
            self.log.exception("fetch failed", request_id=req.request_id)
            reply = m.CacheBlocks(req.request_id, [], [], [], f"internal: {exc}")
        await self._reply(peer, reply)

    def _read(self, request_id: str, hashes: list[bytes], deadline: float) -> m.CacheBlocks:
        """On an I/O thread: read the prefix; each block becomes a tensor over its payload (no copy: a host
        payload is never modified once stored, and the reply holds a reference to it until sent)."""
        limited = len(hashes) > m.MAX_FETCH_BLOCKS
        result = self.store.read(hashes[: m.MAX_FETCH_BLOCKS], deadline)
        if not result.hashes:
            return m.CacheBlocks(request_id, [], [], [], result.reason or "miss")
        blocks = [self.kv.view_block(p) for p in result.payloads]  # read-only views: the frame is only read
        reason = result.reason or ("reply limit" if limited and len(blocks) == m.MAX_FETCH_BLOCKS else "")
        return m.CacheBlocks(request_id, list(result.hashes), list(result.tiers), blocks, reason)

    async def _store(self, peer: bytes, req: m.CacheStore) -> None:
        self.progress += 1
        problem = self._store_problem(req)
        if problem is not None:
            self.refused_stores += 1
            self.refused["kv"] += 1
            self.log.warning("store refused", request_id=req.request_id, reason=problem)
            await self._reply(peer, m.CacheStoreAck(req.request_id, 0, 0, problem))
            return
        stored, skipped = await self._io(self._write, req.block_hashes, req.kv)
        await self._reply(peer, m.CacheStoreAck(req.request_id, stored, skipped))

    def _store_problem(self, req: m.CacheStore) -> str | None:
        """What is wrong with a store in this daemon's namespace: KV of another spec or count, bad hashes."""
        problem = self.kv.problem(req.kv, len(req.block_hashes))
        if problem is not None:
            return problem
        if len(_valid_hashes(req.block_hashes)) != len(req.block_hashes):
            return f"block hashes must be {HASH_BYTES} bytes each"
        return None

    def _write(self, hashes: list[bytes], kv: torch.Tensor) -> tuple[int, int]:
        # Copies: the received frame's memory goes back to ZeroMQ once this message is dropped.
        return self.store.write(hashes, self.kv.block_payloads(kv))

    # -- write-behind and events --------------------------------------------------------------

    async def _pool_loop(self) -> None:
        """The pool's shared budget, a round every POOL_ROUND_S (pool_share)."""
        assert self.pool_share is not None
        while True:
            try:
                evicted = await self._io(self.store.balance_pool, self.pool_share)
            except Exception:  # the store counts a pool it cannot reach; anything else is a bug, not a stop
                self.log.exception("pool budget round failed")
                evicted = 0
            if evicted:
                self.log.info("over the pool's budget: evicted this daemon's share", blocks=evicted)
            await asyncio.sleep(POOL_ROUND_S)

    async def _flush_loop(self) -> None:
        while True:
            if self.store.pending_writes():
                try:
                    await self._io(self.store.flush, FLUSH_BATCH)
                except Exception:  # the disk tier reports its own failures as counters; this is a bug
                    self.log.exception("disk flush failed")
                    await asyncio.sleep(1.0)
                self._log_disk_errors()
            else:
                await asyncio.sleep(0.02)

    def _log_disk_errors(self) -> None:
        """Warn when disk writes have failed since the last warning (at most every LOG_PERIOD_S): the
        blocks stay in DRAM, so this is fewer disk hits, not an error any request sees."""
        stats = self.store.stats()
        errors = stats.get("disk_write_errors", 0)
        if errors > self._disk_errors_logged and self._disk_errors_throttle.ready():
            self.log.warning("disk writes failing: blocks kept in DRAM only", failed=errors - self._disk_errors_logged,
                             no_space=stats.get("disk_write_errors_no_space", 0),
                             io_errors=stats.get("disk_write_errors_io", 0), disk_blocks=stats.get("disk_blocks", 0))
            self._disk_errors_logged = errors

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
