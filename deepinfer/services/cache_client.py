"""A worker's side of the cache daemon: fetch a cached prefix before prefill (its disk-held part prefetched
into the daemon's DRAM while the job waits in the worker's stage), write new blocks behind.

The daemon is an optimisation, never a dependency. Every call has a deadline; a call that times out marks
the daemon down, and while it is down fetches and writes are skipped (requests are computed in full)
and a probe asks it every `PROBE_PERIOD_S` whether it is back. Write-behind runs off the request's
path with a bounded number of stores in flight; past that, blocks are simply not offered (a cache may
always forget).

The engine (a `ServingEngine`) is touched only through `EngineThread.call`; the hashes used for lookups
are the engine's own chain over the request's tokens, so a block fetched here is one this engine would
compute. A request's lookup and import go to its `cache_route` (a worker group's: the rank the request will
be placed on, which places it then), a group's write-behind exports to the ranks holding the blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
import torch
import zmq

from deepinfer.cache.fetch_plan import MISS, FetchPlan, FetchPlanner
from deepinfer.engine.interface import PrefixTarget, ServingEngine
from deepinfer.protocol import messages as m
from deepinfer.protocol.auth import ClientAuth
from deepinfer.protocol.sockets import arecv_msg, asend_msg, make_dealer
from deepinfer.services.engine_thread import EngineThread

FETCH_DEADLINE_S = 1.0  # the longest a fetch waits: the daemon sends what it has read by then
REPLY_SLACK_S = 1.0  # on top of a deadline, for the wire and the daemon's queue
STORE_TIMEOUT_S = 10.0
PROBE_PERIOD_S = 1.0
MAX_STORES_IN_FLIGHT = 4


@dataclass
class CacheClientStats:
    fetches: int = 0
    fetched_blocks: int = 0
    imported_blocks: int = 0
    fetch_misses: int = 0
    skipped_down: int = 0  # fetches or writes skipped while the daemon was down
    timeouts: int = 0
    stores: int = 0
    stored_blocks: int = 0
    stores_dropped: int = 0  # write-behind not attempted: too many in flight
    prefetches: int = 0  # CachePrefetch sent for jobs that wait in the stage


class CacheClient:
    def __init__(self, instance: str, endpoint: str, ctx: Any, engine: ServingEngine, thread: EngineThread,
                 auth: ClientAuth | None = None, fetch_always: bool = False) -> None:
        self.instance = instance
        self.engine = engine
        self.thread = thread
        self.sock = make_dealer(ctx, endpoint, instance.encode(), auth=auth)
        self.up = True
        self.stats = CacheClientStats()
        # Fetch or recompute: how much of a prefix to load, and how long to wait for it (cache.fetch_plan).
        self.planner = FetchPlanner(engine.config.block_size if engine is not None else 1,
                                    max_deadline_s=FETCH_DEADLINE_S, always=fetch_always)
        self.log = structlog.get_logger("deepinfer").bind(service="cache-client", instance=instance)
        self._replies: dict[tuple[str, type], asyncio.Future[Any]] = {}
        self._ids = itertools.count()
        self._stores_in_flight = 0
        self._probe: asyncio.Task[None] | None = None
        self._writes: set[asyncio.Task[None]] = set()

    # -- plumbing ---------------------------------------------------------------------------

    async def recv_forever(self) -> None:
        while True:
            try:
                reply = await arecv_msg(self.sock)
            except Exception as exc:  # a malformed reply is a miss, not a dead worker
                self.log.warning("bad reply from the cache daemon", error=str(exc))
                continue
            fut = self._replies.get((getattr(reply, "request_id", ""), type(reply)))
            if fut is not None and not fut.done():
                fut.set_result(reply)

    async def _call(self, msg: Any, reply_type: type, timeout_s: float) -> Any:
        key = (msg.request_id, reply_type)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._replies[key] = fut
        try:
            async with asyncio.timeout(timeout_s):
                await asend_msg(self.sock, msg)
                return await fut
        except TimeoutError:
            if fut.done() and not fut.cancelled():  # the reply came as time ran out: it still counts
                return fut.result()
            self.stats.timeouts += 1
            self._mark_down(f"no {reply_type.__name__} within {timeout_s:g}s")
            raise
        finally:
            self._replies.pop(key, None)

    def _mark_down(self, why: str) -> None:
        if self.up:
            self.log.warning("cache daemon unreachable: computing in full until it answers", reason=why)
        self.up = False
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._probe_until_up())

    async def _probe_until_up(self) -> None:
        while not self.up:
            await asyncio.sleep(PROBE_PERIOD_S)
            rid = f"probe-{next(self._ids)}"
            key = (rid, m.CacheLookupReply)
            fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._replies[key] = fut
            try:
                async with asyncio.timeout(PROBE_PERIOD_S):
                    await asend_msg(self.sock, m.CacheLookup(rid, [], self.engine.cache_namespace.id))
                    await fut
                self.up = True
                self.log.info("cache daemon answers again")
            except TimeoutError:
                pass
            finally:
                self._replies.pop(key, None)

    def close(self) -> None:
        """Drop in-flight write-behind (a cache may forget) and close the socket."""
        for task in [self._probe, *self._writes]:
            if task is not None:
                task.cancel()
        self.sock.close(linger=0)

    # -- before prefill ---------------------------------------------------------------------

    async def prefetch(self, request_id: str, token_ids: list[int], cache_salt: str | None) -> None:
        """The prompt's blocks will be fetched once its job leaves the stage: ask the daemon to read the
        disk-held ones into DRAM meanwhile (no reply; never waits on the daemon, never raises for it)."""
        if not self.up or not self.engine.config.enable_prefix_caching:
            return
        full = (len(token_ids) - 1) // self.engine.config.block_size  # as load_prefix: never the last token's
        hashes = self.engine.block_hashes(token_ids, cache_salt)[:full]
        if not hashes:
            return
        try:
            await asend_msg(self.sock, m.CachePrefetch(f"{request_id}/prefetch", hashes[: m.MAX_FETCH_BLOCKS],
                                                       self.engine.cache_namespace.id), flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # the daemon is not reading: its fetch will find out; a prefetch only saves time
            return
        self.stats.prefetches += 1

    async def load_prefix(self, request_id: str, token_ids: list[int],
                          cache_salt: str | None) -> tuple[float, Callable[[], int] | None]:
        """Fetch the part of the prompt's cached prefix that is not on the device. Returns the seconds spent
        and, when blocks came, an importer: run it on the engine thread in the same call that adds the
        request, so no step can evict the imported blocks before the request's admission finds them."""
        if not self.engine.config.enable_prefix_caching:
            return 0.0, None
        bs = self.engine.config.block_size
        # A hit never covers the last prompt token: its logits are needed.
        hashes = self.engine.block_hashes(token_ids, cache_salt)[: (len(token_ids) - 1) // bs]
        if not hashes:
            return 0.0, None
        if not self.up:
            self.stats.skipped_down += 1
            return 0.0, None
        t0 = time.monotonic()
        target, have = await self.thread.call(lambda: self._lookup(request_id, hashes))
        if have == len(hashes):
            return time.monotonic() - t0, None
        plan = await self._plan(request_id, hashes[have:])
        if plan.blocks == 0:
            self.stats.fetch_misses += plan.decision == MISS
            return time.monotonic() - t0, None
        self.stats.fetches += 1
        wanted = hashes[have:have + plan.blocks]
        got: list[bytes] = []
        tiers: list[str] = []
        blocks: list[torch.Tensor] = []
        started = time.monotonic()
        deadline = started + plan.deadline_s
        while len(got) < len(wanted):  # one reply per MAX_FETCH_BLOCKS blocks
            want = wanted[len(got):]
            left = deadline - time.monotonic()
            try:
                fetch = m.CacheFetch(f"{request_id}/fetch-{len(got)}", want, max(left, 0.0),
                                     self.engine.cache_namespace.id)
                reply: m.CacheBlocks = await self._call(fetch, m.CacheBlocks, max(left, 0.0) + REPLY_SLACK_S)
            except TimeoutError:
                break
            n = len(reply.block_hashes)
            if reply.block_hashes != want[:n] or len(reply.tiers) != n or len(reply.blocks) != n:
                self.log.warning("cache daemon answered another prefix; ignored", request_id=request_id)
                break
            got += reply.block_hashes
            tiers += reply.tiers
            blocks += reply.blocks
            if n < min(len(want), m.MAX_FETCH_BLOCKS) or n == 0:
                break  # the daemon's prefix ends here
        self.planner.observe(tiers, time.monotonic() - started, first_asked=plan.first_tier)
        if not got:
            self.stats.fetch_misses += 1
            return time.monotonic() - t0, None
        self.stats.fetched_blocks += len(got)
        return time.monotonic() - t0, lambda: self._import(target, hashes[:have], got, tiers, blocks)

    async def _plan(self, request_id: str, hashes: list[bytes]) -> FetchPlan:
        """Ask the daemon where it holds `hashes` (the blocks past the device-held head), and plan from that and
        the measured rates how many to fetch and for how long (`cache.fetch_plan`)."""
        try:
            reply = await self._call(m.CacheLookup(f"{request_id}/lookup", hashes, self.engine.cache_namespace.id),
                                     m.CacheLookupReply, REPLY_SLACK_S)
        except TimeoutError:
            return self.planner.plan([], 0.0)  # marked down: computed in full
        if len(reply.tiers) != len(hashes):
            self.log.warning("cache daemon answered another lookup; ignored", request_id=request_id)
            return self.planner.plan([], 0.0)
        return self.planner.plan(reply.tiers, self.thread.tokens_per_s)

    def _lookup(self, request_id: str, hashes: list[bytes]) -> tuple[PrefixTarget, int]:
        """On the engine thread: what the request's lookup and import go to (a group places the request
        now, on one rank), and how many leading `hashes` it holds on the device."""
        target = self.engine.cache_route(request_id, hashes)
        return target, target.cached_prefix_blocks(hashes)

    def _import(self, target: PrefixTarget, head: list[bytes], hashes: list[bytes], tiers: list[str],
                blocks: list[torch.Tensor]) -> int:
        """On the engine thread: import each run of blocks that came from the same tier, holding the chain
        before it (the device-resident head, earlier runs) so an import cannot evict its own prefix."""
        imported, start = 0, 0
        for i in range(1, len(tiers) + 1):
            if i == len(tiers) or tiers[i] != tiers[start]:
                n = target.import_cached_blocks(hashes[start:i], blocks[start:i], tiers[start],
                                                keep_resident=head)
                imported += n
                if n < i - start:
                    break  # the pool is full or the head is gone: the rest could not be reached
                head = head + hashes[start:i]
                start = i
        self.stats.imported_blocks += imported
        return imported

    # -- write-behind -----------------------------------------------------------------------

    def offer(self, request_id: str, hashes: list[bytes], kv: torch.Tensor | None = None) -> None:
        """Offer a request's full blocks to the daemon, off the caller's path. `kv` holds at least
        len(hashes) blocks in order (a handoff's exported prompt KV); without it they are exported from the
        device pool (a finished request's blocks stay there, named, until evicted)."""
        if not hashes or not self.engine.config.enable_prefix_caching:
            return
        if not self.up:
            self.stats.skipped_down += 1
            return
        if self._stores_in_flight >= MAX_STORES_IN_FLIGHT:
            self.stats.stores_dropped += 1
            return
        self._stores_in_flight += 1
        task = asyncio.ensure_future(self._write_behind(request_id, hashes, kv))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write_behind(self, request_id: str, hashes: list[bytes], kv: torch.Tensor | None) -> None:
        rid = f"{request_id}/store-{next(self._ids)}"
        try:
            known: m.CacheLookupReply = await self._call(m.CacheLookup(rid, hashes, self.engine.cache_namespace.id),
                                                         m.CacheLookupReply,
                                                         REPLY_SLACK_S)
            missing = [i for i, tier in enumerate(known.tiers) if not tier]
            if not missing:
                return
            if kv is not None:
                names, blocks = [hashes[i] for i in missing], kv[missing]
            else:
                wanted = [hashes[i] for i in missing]
                names, blocks = await self.thread.call(lambda: self.engine.export_cached_blocks(wanted))
                if not names or blocks is None:
                    return
            ack: m.CacheStoreAck = await self._call(
                m.CacheStore(rid, self.engine.cache_namespace.id, names, blocks.contiguous()), m.CacheStoreAck,
                STORE_TIMEOUT_S)
            self.stats.stores += 1
            self.stats.stored_blocks += ack.stored
            if ack.reason:
                self.log.warning("cache daemon refused a store", reason=ack.reason)
        except TimeoutError:
            pass
        except Exception:
            self.log.exception("write-behind failed", request_id=request_id)
        finally:
            self._stores_in_flight -= 1
