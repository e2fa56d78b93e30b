"""The worker service: an engine behind sockets, in one of three roles.

* ``worker``  — prefill and decode co-located: a PrefillJob runs to the end here.
* ``prefill`` — computes the prompt, samples the first token, then hands the KV to the decode worker the
  router named: KvReserve → KvReserveReply → KvTransfer (the KV as one zero-copy frame) → KvAck, then frees
  its blocks and reports PrefillDone.
* ``decode``  — reserves blocks under a lease for an announced handoff, installs the KV, decodes.

What to send where for each event — the requests held, the handoff's states, every failure's ErrorReply —
is decided by the pure `WorkerCore` (`worker_core`); this module is its shell: it wires the sockets, runs
the engine's commands on the engine thread, keeps the timers, and performs the core's actions.

With a cache daemon (`kvcache`), a prefill-capable worker first loads the prompt's cached prefix that its
own pool lacks from the daemon, then computes only the rest; new full blocks go back to the daemon behind
the request (the prompt's at handoff, the whole conversation's when a request finishes), so the next turn
reuses the answer too. The device tier's changes are published to the router as numbered KvEvents.

Sockets: a DEALER to the router (jobs and aborts in; PrefillDone, ErrorReply, heartbeats out), PUSH
sockets to every tokenizer (one DetokenizeBatch per tokenizer per engine step), and for the KV edge a bound
ROUTER on decode-capable workers and one DEALER per decode peer on prefill workers. The engine steps on
its own thread (`EngineThread`); this module only moves messages.

The engine is used through `ServingEngine` (deepinfer.engine.interface), which an LLMEngine and a group
implement alike. A worker group (`ep` > 1, expert parallelism with data-parallel attention): this process
is rank 0 and its engine is a `GroupEngine` spanning every rank (deepinfer.services.group.engine), also
held as `group` for what only a group does; the router sees one worker with the group's summed capacity.
A group reports its load (`ExpertLoad`: tokens per rank and, for an MoE model, per expert, with the
placement table the ranks run) every `EXPERT_LOAD_PERIOD_S`, and takes the expert balancer's placement
updates (`worker_experts.ExpertLink`). When the group breaks (a rank died) the worker ends at once with
`GroupBroken`, so its process exits nonzero: the supervisor restarts the whole group and the router moves
its requests elsewhere, resumed (answering each with ErrorReply would instead end them at their clients).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import zmq.asyncio

from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.interface import ServingEngine
from deepinfer.engine.request import InvalidRequestError, RequestOutput
from deepinfer.metrics.recorders.worker import WorkerExport
from deepinfer.protocol import messages as m
from deepinfer.protocol.sockets import arecv_msg, arecv_routed, asend_msg, make_dealer, make_push, make_router
from deepinfer.services.base import Handler, Service
from deepinfer.services.cache_client import CacheClient
from deepinfer.services.engine_thread import EngineThread, load_on_a_passing_thread
from deepinfer.services.group.channel import GroupBroken
from deepinfer.services.group.control import Load, engine_load
from deepinfer.services.group.engine import GroupEngine
from deepinfer.services.kv_events import KvEventPublisher
from deepinfer.services.stream_coalescer import STREAM_INTERVAL_S
from deepinfer.services.wire import from_wire_logprob, to_engine_params
from deepinfer.services.worker_actions import (
    Abort,
    AbortAll,
    Action,
    AddJob,
    CancelReservation,
    ExportKv,
    Install,
    OfferBlocks,
    Release,
    ToDecode,
    ToPrefill,
    ToRouter,
    ToTokenizer,
)
from deepinfer.services.worker_core import WorkerCore
from deepinfer.services.worker_experts import ExpertLink, refuse_not_a_group
from deepinfer.services.worker_stage import Stage

__all__ = ["WorkerService"]

EVENTS_PERIOD_S = 0.1
HANDOFF_TICK_S = 0.5  # how often overdue handoff replies are looked for (the timeout is the core's)
EXPERT_LOAD_PERIOD_S = 5.0  # a worker group's expert-load reports to the router
STAGE_POLL_S = 0.01  # while jobs are staged, how often the engine's queue is looked at (a step is longer)
STAGE_DEPTH_STEPS = 2  # the engine's queue is kept this many steps' token budgets deep (worker_stage)


class WorkerService(Service):
    role = "worker"

    def __init__(self, instance: str, role: str, backend: str, ctx: zmq.asyncio.Context, model: str,
                 config: EngineConfig, kv_bind: str | None, decode_peers: dict[str, str],
                 tokenizers: dict[str, str], kvcache: tuple[str, str] | None = None, ep: int = 1,
                 ep_master: str = "", stream_interval_s: float = STREAM_INTERVAL_S,
                 lookup_ahead_steps: int = STAGE_DEPTH_STEPS, fetch_policy: str = "plan", **kw: Any) -> None:
        # Rank 0 of a group waits here for every rank to join, then loads the model like each of them.
        # `group`: the same engine, for a group's own calls (keepalive, close, load, expert placement); None
        # when the engine is one LLMEngine.
        self.group: GroupEngine | None = GroupEngine.start(model, config, ep, ep_master) if ep > 1 else None
        self.engine: ServingEngine = self.group if self.group is not None else load_on_a_passing_thread(
            lambda: LLMEngine.load(model, config), f"{instance}-load")
        super().__init__(instance, backend, ctx, model_fingerprint=self.engine.fingerprint,
                         block_hash_scheme=self.engine.cache_namespace.handshake_scheme, **kw)
        self.kvcache = kvcache  # (daemon name, endpoint)
        self.fetch_policy = fetch_policy  # WorkerSpec.fetch_policy
        self.cache: CacheClient | None = None
        # With a daemon, jobs wait in the stage and their prefix is looked up only as they enter the engine
        # (lookup_ahead_steps 0: as they arrive, no stage).
        self.stage: Stage[AddJob] | None = (Stage(lookup_ahead_steps * config.max_num_batched_tokens)
                                            if lookup_ahead_steps > 0 else None)
        self._staged = asyncio.Event()
        self.publisher = KvEventPublisher(instance, self.incarnation)
        self.role = role  # type: ignore[misc]  # the instance's role: worker, prefill or decode
        self.kv_bind = kv_bind
        self.decode_peers = decode_peers
        self.tokenizer_endpoints = tokenizers
        # Only a prefill worker opens DEALERs to decode peers, so only its handoffs may name one.
        peers = set(decode_peers) if role == "prefill" else set()
        self.core = WorkerCore(instance, role, self.engine.kv_spec, peers, offer_blocks=kvcache is not None,
                               stream_interval_s=stream_interval_s)
        self._pushes: dict[str, Any] = {}
        self._stream_timer: asyncio.TimerHandle | None = None
        self._kv_router: Any = None
        self._kv_dealers: dict[str, Any] = {}
        self._thread: EngineThread | None = None
        self._broken: asyncio.Future[BaseException] | None = None
        self.expert_load_period_s = EXPERT_LOAD_PERIOD_S
        self.experts: ExpertLink | None = None  # a group's link to the expert balancer (set at start)
        self.worker_export: WorkerExport | None = None  # Prometheus: steps, KV moved, preemptions (set at start)

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
        loop = asyncio.get_running_loop()
        self._broken = loop.create_future()
        self.worker_export = WorkerExport(self.role, self.instance)
        self._thread = EngineThread(self.engine, loop, self._on_outputs, self.instance,
                                    on_failure=self._on_engine_failure, fatal=(GroupBroken,),
                                    step_metrics=self.worker_export.steps,
                                    keepalive=self.group.keepalive if self.group is not None else None)
        self._thread.start()
        if self.group is not None:
            self.experts = ExpertLink(self.instance, self.group, self._thread.call, self.send_router, self.log)
        if self.kvcache is not None:
            self.cache = CacheClient(self.instance, self.kvcache[1], self.ctx, self.engine, self._thread,
                                     auth=self.auth.for_connect(self.kvcache[1], self.kvcache[0]),
                                     fetch_always=self.fetch_policy == "always")
        if self.engine.config.enable_prefix_caching:
            await self._publish_snapshot()

    async def on_stop(self) -> None:
        if self._stream_timer is not None:
            self._stream_timer.cancel()
            self._stream_timer = None
        if self._thread is not None:
            self._thread.stop()
        if self.cache is not None:
            self.cache.close()
        if self.group is not None:
            self.group.close()  # the followers exit 0 (or have gone with a broken group)

    def capabilities(self) -> dict[str, str]:
        caps = {"kvcache": self.kvcache[0]} if self.kvcache is not None else {}
        if self.group is not None:
            caps["ep"] = str(self.group.size)
        return caps

    def tasks(self) -> list[Any]:
        tasks: list[Any] = [self._lease_loop(), self._watch_engine()]
        if self.group is not None:
            tasks.append(self._expert_load_loop())
        if self.cache is not None:
            tasks.append(self.cache.recv_forever())
            if self.stage is not None:
                tasks.append(self._stage_loop())
        if self.engine.config.enable_prefix_caching:
            tasks.append(self._events_loop())
        if self._kv_router is not None:
            kv_in: dict[type, Handler] = {m.KvReserve: self._on_reserve, m.KvTransfer: self._on_transfer}
            tasks.append(self.dispatch_forever(self._kv_router, arecv_routed, kv_in))
        if self._kv_dealers:
            tasks.append(self._handoff_timer())
        tasks += [self.dispatch_forever(d, arecv_msg, self._replies_from(name)) for name, d in self._kv_dealers.items()]
        return tasks

    def handlers(self) -> dict[type, Handler]:
        return {
            m.PrefillJob: self._on_job,
            m.AbortRequest: self._on_abort,
            m.Reclaim: self._on_reclaim,
            m.KvResync: self._on_resync,
            m.PlacementUpdate: self._on_placement_update,
        }

    def load(self) -> Load:
        """The engine's load; a group's summed over its ranks (the router sees one worker of N ranks)."""
        if self.group is not None:
            return self.group.load()
        assert isinstance(self.engine, LLMEngine)
        return engine_load(self.engine)

    def heartbeat_fields(self) -> dict[str, Any]:
        e = self.engine
        self.progress = self._thread.steps if self._thread else 0
        load, stats = self.load(), e.stats
        stage = self.stage
        staged = (len(stage), stage.staged_tokens + stage.entering_tokens) if stage is not None else (0, 0)
        return dict(free_blocks=load.free_blocks, total_blocks=load.total_blocks, running=load.running,
                    waiting=load.waiting + staged[0], queued_prompt_tokens=load.queued_prompt_tokens + staged[1],
                    tokens_per_s=self._thread.tokens_per_s if self._thread else 0.0,
                    spec_proposed_tokens=stats.spec_proposed_tokens,
                    spec_accepted_tokens=stats.spec_accepted_tokens,
                    tpot_by_batch=self._thread.cadence.points() if self._thread else [])

    def record_metrics(self, beat: m.Heartbeat) -> None:
        super().record_metrics(beat)
        if self.worker_export is not None:
            cache = self.cache.stats if self.cache is not None else None
            nbytes = self.engine.kv_spec.block_nbytes
            stats = self.engine.stats
            self.worker_export.totals(stats.num_preemptions,
                                      cache.fetched_blocks * nbytes if cache else 0,
                                      cache.stored_blocks * nbytes if cache else 0,
                                      self.cache.planner.decisions if self.cache is not None else None,
                                      swapped_preemptions=stats.num_swapped_preemptions,
                                      swap_out_bytes=stats.swap_out_blocks * nbytes,
                                      swap_in_bytes=stats.swap_in_blocks * nbytes)

    def idle(self) -> bool:
        e = self.engine
        return self.core.owed() == 0 and not e.has_unfinished() and not e.num_held and not e.num_reserved_blocks

    def _on_engine_failure(self, exc: BaseException) -> None:
        self.log.error("engine failed", error=repr(exc))
        if self._broken is not None and not self._broken.done():
            self._broken.set_result(exc)

    async def _watch_engine(self) -> None:
        """End the service (run() raises, the process exits nonzero) when the engine thread failed."""
        assert self._broken is not None
        raise await self._broken

    async def _expert_load_loop(self) -> None:
        assert self.experts is not None
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.expert_load_period_s)
            now = time.monotonic()
            await self.experts.report(now - last)
            last = now

    async def _on_placement_update(self, update: m.PlacementUpdate) -> None:
        if self.experts is None:
            await refuse_not_a_group(self.instance, update, self.send_router)
        else:
            await self.experts.on_update(update)

    async def _lease_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            assert self._thread is not None
            await self._thread.call(self.engine.expire_reservations)
            self._apply(self.core.expire_held(time.monotonic()))

    async def _handoff_timer(self) -> None:
        while True:
            await asyncio.sleep(HANDOFF_TICK_S)
            self._apply(self.core.on_tick(time.monotonic()))

    # -- events into the core ---------------------------------------------------------------

    async def _on_job(self, job: m.PrefillJob) -> None:
        await self._run(self.core.on_job(job, time.monotonic()))

    async def _on_abort(self, req: m.AbortRequest) -> None:
        held = self.core.track(req.request_id) is not None
        if self.stage is not None:
            self.stage.drop(req.request_id)
        await self._run(self.core.on_abort(req.request_id))
        if held:
            self.log.info("aborted", request_id=req.request_id)

    async def on_router_restart(self) -> None:
        if self.stage is not None:
            self.stage.clear()
        await self._run(self.core.on_router_restart(time.monotonic()))

    async def on_rejoined(self) -> None:
        held = self.core.held()
        if held:
            self.log.info("kept requests reported to the new router", count=len(held))
            await self.send_router(m.HeldRequests(self.instance, self.incarnation, held))

    async def _on_reclaim(self, rc: m.Reclaim) -> None:
        await self._run(self.core.on_reclaim(rc, self.progress))

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        self._apply(self.core.on_outputs(outputs, self.progress, time.monotonic()))
        self._arm_stream_flush()

    def _arm_stream_flush(self) -> None:
        """Tokens held for the stream interval go out when it ends even if no step comes first (a step
        slower than the interval, the engine going idle)."""
        if self.core.stream and self._stream_timer is None:
            self._stream_timer = asyncio.get_running_loop().call_later(self.core.stream.interval_s,
                                                                       self._stream_timer_fired)

    def _stream_timer_fired(self) -> None:
        self._stream_timer = None
        if self.core.stream.due(time.monotonic()):
            self._apply(self.core.stream_flush(self.progress, time.monotonic()))
        self._arm_stream_flush()

    def _replies_from(self, peer: str) -> dict[type, Handler]:
        async def on_reply(reply: m.KvReserveReply | m.KvAck) -> None:
            # Spawned, not awaited: this loop keeps reading replies while a KvTransfer is being sent.
            if isinstance(reply, m.KvAck) and self.worker_export is not None:
                self.worker_export.handoff_acked(reply.request_id)
            self._apply(self.core.on_kv_reply(peer, reply, time.monotonic()))

        return {m.KvReserveReply: on_reply, m.KvAck: on_reply}

    async def _on_reserve(self, peer: bytes, req: m.KvReserve) -> None:
        assert self._thread is not None
        engine = self.engine
        reserved = self._thread.call(lambda: (engine.reserve(req.request_id, req.num_blocks, req.lease_s),
                                              engine.num_free_blocks))

        async def reply() -> None:  # in a task: this socket's loop goes on reading (see `_perform`)
            ok, free = await reserved
            await self._run(self.core.on_reserved(peer, req, ok, free))

        self.spawn(reply(), "KvReserve")

    async def _on_transfer(self, peer: bytes, t: m.KvTransfer) -> None:
        if self.worker_export is not None:
            self.worker_export.handoff_received(int(getattr(t.kv, "nbytes", 0)))
        await self._run(self.core.on_transfer(peer, t, self.progress))

    # -- the core's actions -----------------------------------------------------------------

    def _apply(self, actions: list[Action]) -> None:
        """From a callback or a timer: each action its own task. The tasks start in order, and sends on one
        socket keep that order; no send waits behind another socket's, nor behind an engine command."""
        for action in actions:
            self.spawn(self._perform(action), type(action).__name__)

    async def _run(self, actions: list[Action]) -> None:
        """From a handler: each action done before the next begins (a transfer's first token is pushed before
        its Install is queued on the engine thread)."""
        for action in actions:
            await self._perform(action)

    async def _perform(self, action: Action) -> None:
        """Engine commands are queued here, in action order, and never awaited by the caller: a handler that
        waited for one held its socket's receive loop until the next step boundary, so a burst of jobs (or
        aborts, or transfers) was taken one per engine step. What follows from a command's result runs in a
        task of its own."""
        assert self._thread is not None
        engine = self.engine
        match action:
            case ToRouter(msg):
                await self.send_router(msg)
            case ToTokenizer(tokenizer, batch):
                await self._push(tokenizer, batch)
            case ToDecode(peer, msg):
                await self._to_decode(peer, msg)
            case ToPrefill(identity, msg):
                await asend_msg(self._kv_router, msg, identity)
            case AddJob():
                await self._add_job(action)
            case ExportKv(rid):
                await self._export(rid)
            case Install():
                await self._install(action)
            case Release(rid):
                self._command(lambda: engine.release(rid), "release")
            case CancelReservation(lease_id):
                self._command(lambda: engine.cancel_reservation(lease_id), "cancel_reservation")
            case Abort(rid):
                self._command(lambda: engine.abort(rid), "abort")
            case AbortAll(keep):
                self._command(lambda: self._abort_all(keep), "abort_all",
                              lambda n: self.log.info("dropped the old router's requests", count=n, kept=len(keep)))
            case OfferBlocks(rid, hashes, kv):
                if self.cache is not None:
                    self.cache.offer(rid, hashes, kv)

    async def _push(self, tokenizer: str, batch: m.DetokenizeBatch) -> None:
        sock = self._pushes.get(tokenizer)
        if sock is None:
            self.log.error("unknown tokenizer", tokenizer=tokenizer)
            return
        await asend_msg(sock, batch)

    def _command(self, fn: Callable[[], Any], what: str, then: Callable[[Any], None] | None = None) -> None:
        """Queue `fn` on the engine thread; its failure is logged, its result given to `then`."""
        assert self._thread is not None

        def done(fut: asyncio.Future[Any]) -> None:
            if fut.cancelled():
                return
            if (exc := fut.exception()) is not None:
                if not isinstance(exc, GroupBroken):  # the group's end is logged where it is handled
                    self.log.error("engine command failed", command=what, error=repr(exc))
            elif then is not None:
                then(fut.result())

        self._thread.call(fn).add_done_callback(done)

    async def _compile_ahead(self, params: m.SamplingParamsWire) -> None:
        """A constrained request's grammar compiled into the engine's cache here, off the step loop, before the
        request reaches the engine thread (which then finds it compiled, or its error, at once). Awaited in
        order with the other actions: bounded by the cache's compile timeout, milliseconds for common schemas."""
        if params.constraint is None:
            return
        engine = self.group.local if self.group is not None else self.engine
        try:
            spec = to_engine_params(params).constraint
            assert spec is not None
            await asyncio.wrap_future(engine.structured.compile_ahead(spec))
        except Exception:  # the engine's add raises it again, as invalid_request with the reason
            pass

    async def _add_job(self, action: AddJob) -> None:
        await self._compile_ahead(action.job.params)
        if self.cache is None:
            self.spawn(self._added(action.job, self._queue_add(action, None)), "AddJob")
        elif self.stage is None:
            self.spawn(self._load_prefix_then_add(action), "AddJob")
        else:
            job = action.job
            if len(self.stage) or self.stage.entering_tokens or self.load().queued_prompt_tokens:
                # It will wait behind others: the daemon reads its disk-held prefix into DRAM meanwhile.
                self.spawn(self.cache.prefetch(job.request_id, job.token_ids, job.cache_salt), "CachePrefetch")
            self.stage.push(job.request_id, len(job.token_ids), job.priority, action)
            self._staged.set()

    async def _stage_loop(self) -> None:
        """Let staged jobs enter as the engine's queue drains (see worker_stage)."""
        assert self.stage is not None
        while True:
            if not len(self.stage):
                self._staged.clear()
                await self._staged.wait()
            for action in self.stage.enter(self.load().queued_prompt_tokens):
                self.spawn(self._load_prefix_then_add(action), "AddJob")
            await asyncio.sleep(STAGE_POLL_S)

    async def _load_prefix_then_add(self, action: AddJob) -> None:
        assert self.cache is not None
        job = action.job
        try:
            fetch_s, importer = await self.cache.load_prefix(job.request_id, job.token_ids, job.cache_salt)
        except Exception as exc:
            self._entered(job)
            await self._add_failed(job, exc)
            return
        if importer is not None and self.worker_export is not None:
            self.worker_export.prefix_fetched(fetch_s)
        if self.core.on_prefix_loaded(job, fetch_s):  # else aborted while staged or while its prefix loaded
            await self._added(job, self._queue_add(action, importer))
        self._entered(job)

    def _entered(self, job: m.PrefillJob) -> None:
        if self.stage is not None:
            self.stage.entered(job.request_id)

    def _queue_add(self, action: AddJob, importer: Callable[[], int] | None) -> asyncio.Future[None]:
        """Queue the job on the engine thread now, so that an abort read after it is queued after it."""
        assert self._thread is not None
        job = action.job

        def add() -> None:
            if importer is not None:
                try:
                    importer()
                except Exception:  # cached KV that cannot be used is a miss, never a failed request
                    self.log.exception("importing cached blocks failed", request_id=job.request_id)
            self.engine.add_request(job.request_id, action.prompt, to_engine_params(job.params), job.priority,
                                    prefill_only=action.prefill_only, cache_salt=job.cache_salt,
                                    resume_output_ids=action.resumed)

        return self._thread.call(add)

    async def _added(self, job: m.PrefillJob, added: asyncio.Future[None]) -> None:
        try:
            await added
        except Exception as exc:
            await self._add_failed(job, exc)

    async def _add_failed(self, job: m.PrefillJob, exc: Exception) -> None:
        if isinstance(exc, GroupBroken):
            # Not this request's fault: the group is over and this process exits, so the router moves the
            # request to another worker as for any dead worker. An error reply would end it at the client.
            return
        if not isinstance(exc, InvalidRequestError):
            self.log.exception("adding the request failed", request_id=job.request_id)
        await self._run(self.core.on_add_failed(job, exc))

    def _abort_all(self, keep: frozenset[str]) -> int:
        """On the engine thread: abort everything it holds — requests, held handoffs, reservations — but
        `keep`."""
        engine = self.engine
        if self.group is not None:
            ids = self.group.live_ids()
        else:
            assert isinstance(engine, LLMEngine)
            ids = {*engine.scheduler.requests, *engine.scheduler.held, *engine.reservations.ids}
        return sum(engine.abort(rid) for rid in ids - keep)

    # -- the KV handoff's engine calls and sends --------------------------------------------

    async def _export(self, rid: str) -> None:
        assert self._thread is not None
        try:
            kv = await self._thread.call(lambda: self.engine.export_kv(rid))
        except Exception as exc:
            if self.core.track(rid) is not None:  # else aborted meanwhile: an export that fails is expected
                self.log.exception("handoff failed", request_id=rid)
            actions = self.core.on_handoff_error(rid, exc)
        else:
            actions = self.core.on_exported(rid, kv, time.monotonic())
        await self._run(actions)

    async def _to_decode(self, peer: str, msg: m.KvReserve | m.KvTransfer) -> None:
        try:
            self._record_sending(msg)  # before the send: its KvAck may come before the send returns
            await asend_msg(self._kv_dealers[peer], msg)
        except Exception as exc:
            if self.worker_export is not None:
                self.worker_export.handoff_dropped(msg.request_id)
            self.log.exception("handoff failed", request_id=msg.request_id)
            await self._run(self.core.on_handoff_error(msg.request_id, exc))

    def _record_sending(self, msg: m.KvReserve | m.KvTransfer) -> None:
        if isinstance(msg, m.KvTransfer) and self.worker_export is not None:
            self.worker_export.handoff_sent(msg.request_id, int(getattr(msg.kv, "nbytes", 0)))

    async def _install(self, action: Install) -> None:
        assert self._thread is not None
        t = action.transfer
        await self._compile_ahead(t.params)
        installed = self._thread.call(lambda: self.engine.add_prefilled_request(
            t.request_id, action.prompt, t.first_token, to_engine_params(t.params), t.kv,
            reservation_id=t.lease_id, priority=t.priority, first_logprob=from_wire_logprob(t.first_logprob),
            cache_salt=t.cache_salt, resume_output_ids=action.resumed))
        self.spawn(self._installed(action, installed), "Install")

    async def _installed(self, action: Install, installed: asyncio.Future[None]) -> None:
        t = action.transfer
        try:
            await installed
        except Exception as exc:
            actions = self.core.on_install_failed(action.identity, t, exc)
        else:
            actions = self.core.on_installed(action.identity, t)
        await self._run(actions)

    # -- the device tier's KV events ----------------------------------------------------------

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
