"""The worker service: an engine behind sockets, in one of three roles.

* ``worker``  — prefill and decode co-located: a PrefillJob runs to the end here.
* ``prefill`` — computes the prompt, samples the first token, then hands the KV to the decode worker the
  router named: KvReserve → KvReserveReply → KvTransfer (the KV as one zero-copy frame) → KvAck, then frees
  its blocks and reports PrefillDone.
* ``decode``  — reserves blocks under a lease for an announced handoff, installs the KV, decodes.

With a cache daemon (`kvcache`), a prefill-capable worker first loads the prompt's cached prefix that its
own pool lacks from the daemon, then computes only the rest; new full blocks go back to the daemon behind
the request (the prompt's at handoff, the whole conversation's when a request finishes), so the next turn
reuses the answer too. The device tier's changes are published to the router as numbered KvEvents.

Sockets: a DEALER to the router (jobs and aborts in; PrefillDone, ErrorReply, heartbeats out), PUSH
sockets to every tokenizer (one DetokenizeBatch per tokenizer per engine step), and for the KV edge a bound
ROUTER on decode-capable workers and one DEALER per decode peer on prefill workers. The engine steps on
its own thread (`EngineThread`); this module only moves messages.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import zmq.asyncio

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import InvalidRequestError, RequestOutput
from deepinfer.protocol import messages as m
from deepinfer.protocol.sockets import arecv_msg, arecv_routed, asend_msg, make_dealer, make_push, make_router
from deepinfer.services.base import Handler, Service
from deepinfer.services.cache_client import CacheClient
from deepinfer.services.engine_thread import EngineThread
from deepinfer.services.kv_events import KvEventPublisher
from deepinfer.services.wire import from_wire_logprob, to_engine_params, to_wire_logprobs

KV_LAYOUT = "blocks,layers,kv,block_size,kv_heads,head_dim"
HANDOFF_TIMEOUT_S = 30.0
LEASE_S = 10.0
EVENTS_PERIOD_S = 0.1


def split_resumed(token_ids: list[int], num_output_tokens: int) -> tuple[list[int], list[int]]:
    """A job's tokens as (prompt, output already streamed); ValueError when the count is impossible."""
    if not 0 <= num_output_tokens < len(token_ids):
        raise ValueError(f"num_output_tokens {num_output_tokens} does not fit {len(token_ids)} tokens")
    cut = len(token_ids) - num_output_tokens
    return list(token_ids[:cut]), list(token_ids[cut:])


@dataclass
class Track:
    """What this worker remembers about a request it holds."""

    detokenizer: str
    sent: int = 0  # generated tokens already pushed to the tokenizer (a resumed request's from its start)
    job: m.PrefillJob | None = None
    prefill_reported: bool = False  # PrefillDone sent (co-located: with the first token computed here)
    started: float = 0.0
    fetch_s: float = 0.0  # spent loading cached blocks from the cache daemon


class WorkerService(Service):
    role = "worker"

    def __init__(self, instance: str, role: str, backend: str, ctx: zmq.asyncio.Context, model: str,
                 config: EngineConfig, kv_bind: str | None, decode_peers: dict[str, str],
                 tokenizers: dict[str, str], kvcache: tuple[str, str] | None = None, **kw: Any) -> None:
        self.engine = LLMEngine.load(model, config)
        super().__init__(instance, backend, ctx, model_fingerprint=self.engine.fingerprint,
                         block_hash_scheme=self.engine.cache_namespace.handshake_scheme, **kw)
        self.kvcache = kvcache  # (daemon name, endpoint)
        self.cache: CacheClient | None = None
        self.publisher = KvEventPublisher(instance, self.incarnation)
        self.role = role  # type: ignore[misc]  # the instance's role: worker, prefill or decode
        self.kv_bind = kv_bind
        self.decode_peers = decode_peers
        self.tokenizer_endpoints = tokenizers
        self.tracks: dict[str, Track] = {}
        self._pushes: dict[str, Any] = {}
        self._kv_router: Any = None
        self._kv_dealers: dict[str, Any] = {}
        self._replies: dict[tuple[str, type], asyncio.Future[Any]] = {}
        self._thread: EngineThread | None = None

    # -- lifecycle --------------------------------------------------------------------------

    async def on_start(self) -> None:
        for name, ep in self.tokenizer_endpoints.items():
            self._pushes[name] = self.socket(make_push(self.ctx, connect=ep, auth=self.auth.for_connect(ep, name)))
        if self.role in ("decode", "worker") and self.kv_bind:
            self._kv_router = self.socket(make_router(self.ctx, self.kv_bind,
                                                      auth=self.auth.for_bind(self.kv_bind, "kv")))
        if self.role == "prefill":
            for name, ep in self.decode_peers.items():
                self._kv_dealers[name] = self.socket(make_dealer(self.ctx, ep, self.instance.encode(),
                                                                 auth=self.auth.for_connect(ep, name)))
        self._thread = EngineThread(self.engine, asyncio.get_running_loop(), self._on_outputs, self.instance)
        self._thread.start()
        if self.kvcache is not None:
            self.cache = CacheClient(self.instance, self.kvcache[1], self.ctx, self.engine, self._thread,
                                     auth=self.auth.for_connect(self.kvcache[1], self.kvcache[0]))
        if self.engine.config.enable_prefix_caching:
            await self._publish_snapshot()

    async def on_stop(self) -> None:
        if self._thread is not None:
            self._thread.stop()
        if self.cache is not None:
            self.cache.close()

    def capabilities(self) -> dict[str, str]:
        return {"kvcache": self.kvcache[0]} if self.kvcache is not None else {}

    def tasks(self) -> list[Any]:
        tasks: list[Any] = [self._lease_loop()]
        if self.cache is not None:
            tasks.append(self.cache.recv_forever())
        if self.engine.config.enable_prefix_caching:
            tasks.append(self._events_loop())
        if self._kv_router is not None:
            kv_in: dict[type, Handler] = {m.KvReserve: self._on_reserve, m.KvTransfer: self._on_transfer}
            tasks.append(self.dispatch_forever(self._kv_router, arecv_routed, kv_in))
        kv_replies: dict[type, Handler] = {m.KvReserveReply: self._on_reply, m.KvAck: self._on_reply}
        tasks += [self.dispatch_forever(d, arecv_msg, kv_replies) for d in self._kv_dealers.values()]
        return tasks

    def handlers(self) -> dict[type, Handler]:
        return {
            m.PrefillJob: self._on_job,
            m.AbortRequest: self._on_abort,
            m.Shutdown: self._on_shutdown,
            m.KvResync: self._on_resync,
        }

    def heartbeat_fields(self) -> dict[str, Any]:
        e = self.engine
        self.progress = self._thread.steps if self._thread else 0
        waiting = list(e.scheduler.waiting)
        return dict(free_blocks=e.num_free_blocks, total_blocks=e.pool.num_blocks, running=len(e.scheduler.running),
                    waiting=len(waiting),
                    queued_prompt_tokens=sum(r.num_tokens - r.num_computed_tokens for r in waiting),
                    tokens_per_s=self._thread.tokens_per_s if self._thread else 0.0,
                    spec_proposed_tokens=e.stats.spec_proposed_tokens,
                    spec_accepted_tokens=e.stats.spec_accepted_tokens)

    def idle(self) -> bool:
        e = self.engine
        return not self.tracks and not e.has_unfinished() and not e.num_held and not e.num_reserved_blocks

    async def _on_shutdown(self, msg: m.Shutdown) -> None:
        self.stop()

    async def _lease_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            assert self._thread is not None
            await self._thread.call(self.engine.expire_reservations)

    # -- jobs from the router ---------------------------------------------------------------

    async def _on_job(self, job: m.PrefillJob) -> None:
        assert self._thread is not None
        prefill_only = self.role == "prefill"
        try:
            prompt, resumed = split_resumed(job.token_ids, job.num_output_tokens)
        except ValueError as exc:
            await self.send_router(m.ErrorReply(job.request_id, "invalid_request", str(exc)))
            return
        track = self.tracks[job.request_id] = Track(job.detokenizer, sent=len(resumed), job=job,
                                                    started=time.monotonic())
        importer = None
        if self.cache is not None:
            track.fetch_s, importer = await self.cache.load_prefix(job.request_id, job.token_ids, job.cache_salt)
            if self.tracks.get(job.request_id) is not track:
                return  # aborted while its prefix was loading

        def add() -> None:
            if importer is not None:
                try:
                    importer()
                except Exception:  # cached KV that cannot be used is a miss, never a failed request
                    self.log.exception("importing cached blocks failed", request_id=job.request_id)
            self.engine.add_request(job.request_id, prompt, to_engine_params(job.params), job.priority,
                                    prefill_only=prefill_only, cache_salt=job.cache_salt, resume_output_ids=resumed)

        try:
            await self._thread.call(add)
        except InvalidRequestError as exc:
            self.tracks.pop(job.request_id, None)
            await self.send_router(m.ErrorReply(job.request_id, "invalid_request", str(exc)))

    async def on_router_restart(self) -> None:
        assert self._thread is not None
        self.tracks.clear()
        engine = self.engine

        def abort_all() -> int:
            ids = {*engine.scheduler.requests, *engine.scheduler.held, *engine.reservations.ids}
            return sum(engine.abort(rid) for rid in ids)

        self.log.info("dropped the old router's requests", count=await self._thread.call(abort_all))

    async def _on_abort(self, req: m.AbortRequest) -> None:
        assert self._thread is not None
        track = self.tracks.pop(req.request_id, None)
        await self._thread.call(lambda: self.engine.abort(req.request_id))
        if track is not None:
            self.log.info("aborted", request_id=req.request_id)

    # -- engine outputs ---------------------------------------------------------------------

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        batches: dict[str, list[m.DetokenizeItem]] = {}
        for out in outputs:
            track = self.tracks.get(out.request_id)
            if track is None:
                continue  # aborted meanwhile
            if out.handoff:
                self.spawn(self._handoff(out, track), "handoff")
                continue
            if track.job is not None and not track.prefill_reported and out.new_token_ids:
                track.prefill_reported = True
                self.spawn(self.send_router(self._prefill_done(out, track)), "PrefillDone")
            if out.finish_reason is not None and out.finish_reason.value == "error":
                self.tracks.pop(out.request_id, None)
                self.spawn(self.send_router(m.ErrorReply(out.request_id, "internal", out.error or "")), "ErrorReply")
                continue
            item = m.DetokenizeItem(
                out.request_id, track.sent, list(out.new_token_ids), out.finished,
                out.finish_reason.value if out.finish_reason else None,
                None,  # per-token logprobs do not cross the mesh yet (the engine reports them at the end)
                spec_proposed_tokens=out.usage.spec_proposed_tokens,
                spec_accepted_tokens=out.usage.spec_accepted_tokens)
            track.sent += len(out.new_token_ids)
            batches.setdefault(track.detokenizer, []).append(item)
            if out.finished:
                self.tracks.pop(out.request_id, None)
                if self.cache is not None:
                    self.cache.offer(out.request_id, out.block_hashes)
        for tok, items in batches.items():
            self.spawn(self._push(tok, m.DetokenizeBatch(self.instance, self.progress, items)), "DetokenizeBatch")

    async def _push(self, tokenizer: str, batch: m.DetokenizeBatch) -> None:
        sock = self._pushes.get(tokenizer)
        if sock is None:
            self.log.error("unknown tokenizer", tokenizer=tokenizer)
            return
        await asend_msg(sock, batch)

    # -- prefill side of the handoff --------------------------------------------------------

    async def _request(self, peer: str, msg: Any, reply_type: type) -> Any:
        key = (msg.request_id, reply_type)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._replies[key] = fut
        try:
            await asend_msg(self._kv_dealers[peer], msg)
            return await asyncio.wait_for(fut, HANDOFF_TIMEOUT_S)
        finally:
            self._replies.pop(key, None)

    async def _on_reply(self, reply: Any) -> None:
        fut = self._replies.get((reply.request_id, type(reply)))
        if fut is not None and not fut.done():
            fut.set_result(reply)

    async def _handoff(self, out: RequestOutput, track: Track) -> None:
        assert self._thread is not None and track.job is not None
        job, rid = track.job, out.request_id
        bs = self.engine.config.block_size
        try:
            if job.decode_worker not in self._kv_dealers:
                raise RuntimeError(f"unknown decode worker {job.decode_worker!r}")
            n_blocks = -(-(len(job.token_ids) + 1) // bs)
            # Export first: the engine thread may be busy with a long prefill step, and the decode side's
            # lease must only cover the transfer, not that wait.
            kv = await self._thread.call(lambda: self.engine.export_kv(rid))
            reply = await self._request(job.decode_worker, m.KvReserve(
                rid, n_blocks, len(job.token_ids), job.params.max_tokens, self.instance, LEASE_S), m.KvReserveReply)
            if not reply.ok:
                await self.send_router(m.ErrorReply(rid, "overloaded", f"{job.decode_worker}: {reply.reason}"))
                return
            ack = await self._request(job.decode_worker, m.KvTransfer(
                rid, reply.lease_id, out.new_token_ids[0], list(job.token_ids), list(job.block_hashes), job.params,
                bs, KV_LAYOUT, kv, job.detokenizer, first_logprob=(to_wire_logprobs(out.logprobs) or [None])[-1],
                priority=job.priority, arrival_time=job.arrival_time, num_cached_tokens=out.usage.cached_tokens,
                cache_salt=job.cache_salt, num_output_tokens=job.num_output_tokens), m.KvAck)
            if not ack.ok:
                reason = f"{job.decode_worker} refused the KV: {ack.reason}"
                await self.send_router(m.ErrorReply(rid, "internal", reason))
                return
            await self.send_router(self._prefill_done(out, track))
            if self.cache is not None:
                self.cache.offer(rid, out.block_hashes, kv)
        except TimeoutError:
            await self.send_router(m.ErrorReply(rid, "worker_lost", f"{job.decode_worker} did not answer the handoff"))
        except Exception as exc:
            self.log.exception("handoff failed", request_id=rid)
            await self.send_router(m.ErrorReply(rid, "internal", f"handoff failed: {exc}"))
        finally:
            self.tracks.pop(rid, None)
            await self._thread.call(lambda: self.engine.release(rid))

    # -- decode side of the handoff ---------------------------------------------------------

    async def _on_reserve(self, peer: bytes, req: m.KvReserve) -> None:
        assert self._thread is not None
        ok = await self._thread.call(lambda: self.engine.reserve(req.request_id, req.num_blocks, req.lease_s))
        reason = "" if ok else f"{req.num_blocks} KV blocks not free ({self.engine.num_free_blocks} free)"
        await asend_msg(self._kv_router, m.KvReserveReply(req.request_id, req.request_id, ok, reason,
                                                          req.lease_s if ok else 0.0), peer)

    async def _on_transfer(self, peer: bytes, t: m.KvTransfer) -> None:
        assert self._thread is not None
        try:
            if t.kv_layout != KV_LAYOUT or t.block_size != self.engine.config.block_size:
                raise InvalidRequestError(f"KV layout {t.kv_layout!r}/block {t.block_size} does not match "
                                          f"{KV_LAYOUT!r}/block {self.engine.config.block_size}")
            prompt, resumed = split_resumed(t.token_ids, t.num_output_tokens)
            self.tracks[t.request_id] = Track(t.detokenizer, sent=len(resumed) + 1)
            # The first token goes to the tokenizer before the engine can produce the second: one PUSH
            # socket per tokenizer keeps them in order.
            await self._push(t.detokenizer, m.DetokenizeBatch(self.instance, self.progress, [
                m.DetokenizeItem(t.request_id, len(resumed), [t.first_token])]))
            await self._thread.call(lambda: self.engine.add_prefilled_request(
                t.request_id, prompt, t.first_token, to_engine_params(t.params), t.kv, reservation_id=t.lease_id,
                priority=t.priority, first_logprob=from_wire_logprob(t.first_logprob), cache_salt=t.cache_salt,
                resume_output_ids=resumed))
        except Exception as exc:
            self.tracks.pop(t.request_id, None)
            await self._thread.call(lambda: self.engine.cancel_reservation(t.lease_id))
            await asend_msg(self._kv_router, m.KvAck(t.request_id, t.lease_id, False, str(exc)), peer)
            return
        await asend_msg(self._kv_router, m.KvAck(t.request_id, t.lease_id, True), peer)

    # -- the device tier's KV events ----------------------------------------------------------

    def _prefill_done(self, out: RequestOutput, track: Track) -> m.PrefillDone:
        assert track.job is not None
        return m.PrefillDone(out.request_id, self.instance, len(track.job.token_ids), out.usage.cached_tokens,
                             dict(out.usage.cached_by_tier), prefill_s=time.monotonic() - track.started,
                             fetch_s=track.fetch_s)

    async def _events_loop(self) -> None:
        last: tuple[int, int] | None = None
        while True:
            await asyncio.sleep(EVENTS_PERIOD_S)
            assert self._thread is not None
            # The pool's names change only in steps and imports: an idle engine is not woken to drain nothing.
            now = (self._thread.steps, self.cache.stats.imported_blocks if self.cache is not None else 0)
            if now != last:
                last = now
                await self._publish_changes()

    async def _publish_changes(self) -> None:
        assert self._thread is not None
        stored, evicted = await self._thread.call(self.engine.pool.drain_events)
        for msg in self.publisher.changes("device", stored, evicted):
            await self.send_router(msg)

    async def _publish_snapshot(self) -> None:
        assert self._thread is not None
        await self._publish_changes()
        hashes = await self._thread.call(self.engine.pool.cached_hashes)
        for msg in self.publisher.snapshot("device", hashes):
            await self.send_router(msg)

    async def _on_resync(self, msg: m.KvResync) -> None:
        self.log.info("resync asked by the router", reason=msg.reason)
        await self._publish_snapshot()
