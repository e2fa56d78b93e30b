"""A simulated co-located worker: the real scheduling cores on the twin's clock, the forward pass a cost model.

Real, driven as the worker service drives them (services/worker.py, engine/engine.py, services/engine_thread.py):

* `WorkerCore` (role "worker"): every PrefillJob, abort and engine output goes through it, and its actions
  (PrefillDone and ErrorReply to the router, DetokenizeBatch to the tokenizer, blocks offered to the cache
  daemon) are what this worker sends;
* `Scheduler` over a `BlockPool` (chunked prefill, prefix hits, preemption, block naming), with `Request`
  objects carrying the real hash chain;
* `DevicePrefixCache` for imports of fetched blocks (its KV tensor is a one-float-per-token stand-in: what the
  blocks hold does not matter here, only which names the pool has);
* `Stage` (jobs wait and their prefix is looked up as they enter the engine), `FetchPlanner` (fetch or
  recompute), `KvEventPublisher` (the device tier's events), `CadenceMeter` (TPOT by batch in heartbeats),
  `EngineThread._measure` (the prefill rate in heartbeats).

Replaced: the forward pass and sampling (a step lasts `CostModel.step.seconds(...)`; every sampled token is
token 0, and requests end at max_tokens or the context limit, as the replay's ignore_eos requests do), and
the sockets (each message costs a hop). The shell's sequencing that has no pure core of its own is followed
here step by step, each place naming what it follows: the engine thread's command queue and step loop, the
cache client's lookup / plan / fetch / import and write-behind.

Not modelled yet: P/D handoff (prefill and decode roles), speculation, swap (preempted requests recompute),
a worker group.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from deepinfer.cache.block_pool import BlockPool
from deepinfer.cache.fetch_plan import FetchPlanner
from deepinfer.cache.hashing import CacheNamespace
from deepinfer.config.kv import KvSpec
from deepinfer.engine.prefix_cache import DevicePrefixCache
from deepinfer.engine.request import FinishReason, Request, RequestOutput, RequestStatus, Usage
from deepinfer.engine.scheduler import Scheduler, SchedulerOutput
from deepinfer.protocol import messages as m
from deepinfer.services.cache_client import FETCH_DEADLINE_S, MAX_STORES_IN_FLIGHT
from deepinfer.services.engine_thread import COALESCE_GAP_S, COALESCE_MAX_S, EngineThread
from deepinfer.services.kv_events import KvEventPublisher
from deepinfer.services.token_cadence import CadenceMeter
from deepinfer.services.wire import to_engine_params
from deepinfer.services.worker import EVENTS_PERIOD_S, STAGE_DEPTH_STEPS
from deepinfer.services.worker_actions import Abort, Action, AddJob, OfferBlocks, ToRouter, ToTokenizer
from deepinfer.services.worker_core import WorkerCore
from deepinfer.services.worker_stage import Stage
from deepinfer.twin.costs import CostModel
from deepinfer.twin.events import Event, EventLoop

if TYPE_CHECKING:
    from deepinfer.twin.cache import SimCacheDaemon

__all__ = ["SimWorker", "WorkerSettings", "stand_in_spec"]

Send = Callable[[str, str, Any], None]  # (sender, destination, message): the cluster delivers it after a hop
SAMPLED_TOKEN = 0  # the token every step "samples": the replay's requests ignore EOS and have no stops


def stand_in_spec(block_size: int) -> KvSpec:
    """The KV the simulated pools hold: one float per token and layer. Only block names matter to the twin."""
    return KvSpec(1, block_size, ("k",), (("d", 1),), "float32")


@dataclass(frozen=True)
class WorkerSettings:
    """What the mesh's WorkerSpec / EngineConfig say about one worker, and the real KV's block size in bytes."""

    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    real_block_nbytes: int  # the model's KV block: what fetches and stores move
    prefix_caching: bool = True
    lookup_ahead_steps: int = STAGE_DEPTH_STEPS
    fetch_always: bool = False
    heartbeat_s: float = 0.5  # services/base.Service's default
    stream_interval_s: float = 0.05
    transport: str = "ipc"


class _Rate:
    """The attribute EngineThread._measure updates (called unbound on this, so the EWMA is the real one)."""

    tokens_per_s = 0.0


class SimWorker:
    def __init__(self, name: str, loop: EventLoop, send: Send, costs: CostModel, settings: WorkerSettings,
                 namespace: CacheNamespace, daemon: SimCacheDaemon | None = None) -> None:
        self.name, self.loop, self.send, self.costs, self.s = name, loop, send, costs, settings
        self.daemon = daemon
        self.incarnation = f"{name}-twin"
        bs = settings.block_size
        self.pool = BlockPool(settings.num_blocks)
        self.scheduler = Scheduler(self.pool, bs, settings.max_num_seqs, settings.max_num_batched_tokens,
                                   enable_prefix_caching=settings.prefix_caching)
        spec = stand_in_spec(bs)
        self._spec = spec
        self.prefix_cache = DevicePrefixCache(self.pool, torch.zeros(spec.pool_shape(settings.num_blocks)), spec,
                                              namespace, settings.prefix_caching)
        self.core = WorkerCore(name, "worker", spec, set(), offer_blocks=daemon is not None,
                               stream_interval_s=settings.stream_interval_s)
        self.stage: Stage[AddJob] | None = (Stage(settings.lookup_ahead_steps * settings.max_num_batched_tokens)
                                            if daemon is not None and settings.lookup_ahead_steps > 0 else None)
        self.planner = FetchPlanner(bs, max_deadline_s=FETCH_DEADLINE_S, always=settings.fetch_always)
        self.publisher = KvEventPublisher(name, self.incarnation)
        self.cadence = CadenceMeter()
        self.rate = _Rate()
        self.steps = 0
        self.tokens_computed = 0
        self.tokens_generated = 0
        self.imported_blocks = 0
        self._commands: deque[Callable[[], None]] = deque()
        self._stepping = False
        self._boundary: Event | None = None
        self._burst_started = 0.0
        self._previous: tuple[float, int, int] | None = None
        self._seq = 0
        self._stores_in_flight = 0
        self._published_at: tuple[int, int] | None = None

    # -- lifecycle: the shell's Hello, timers ---------------------------------------------------------

    def start(self) -> None:
        caps = {"incarnation": self.incarnation} | ({"kvcache": self.daemon.name} if self.daemon else {})
        self.send(self.name, "router", m.Hello(m.PROTOCOL_VERSION, "worker", self.name, capabilities=caps))
        self._heartbeat()
        if self.s.prefix_caching:
            self._publish(snapshot=True)
            self.loop.after(EVENTS_PERIOD_S, self._events_timer)

    def _heartbeat(self) -> None:
        # services/worker.py heartbeat_fields over group/control.engine_load
        sched = self.scheduler
        staged = (len(self.stage), self.stage.staged_tokens + self.stage.entering_tokens) if self.stage else (0, 0)
        self._seq += 1
        hb = m.Heartbeat("worker", self.name, self.incarnation, self._seq, self.steps,
                         free_blocks=self.pool.num_free, total_blocks=self.pool.num_blocks,
                         running=len(sched.running), waiting=len(sched.waiting) + staged[0],
                         queued_prompt_tokens=self._queued_prompt_tokens() + staged[1],
                         tokens_per_s=self.rate.tokens_per_s, tpot_by_batch=self.cadence.points())
        self.send(self.name, "router", hb)
        self.loop.after(self.s.heartbeat_s, self._heartbeat)

    def _queued_prompt_tokens(self) -> int:
        return sum(r.num_tokens - r.num_computed_tokens for r in self.scheduler.waiting)

    def _events_timer(self) -> None:
        # services/worker.py _events_loop: publish when a step or an import may have changed the names
        mark = (self.steps, self.imported_blocks)
        if mark != self._published_at:
            self._published_at = mark
            self._publish(snapshot=False)
        self.loop.after(EVENTS_PERIOD_S, self._events_timer)

    def _publish(self, snapshot: bool) -> None:
        stored, evicted = self.pool.drain_events()
        for msg in self.publisher.changes("device", stored, evicted):
            self.send(self.name, "router", msg)
        if snapshot:
            for msg in self.publisher.snapshot("device", self.pool.cached_hashes()):
                self.send(self.name, "router", msg)

    # -- messages in --------------------------------------------------------------------------------

    def receive(self, msg: Any) -> None:
        now = self.loop.now
        if isinstance(msg, m.PrefillJob):
            self._apply(self.core.on_job(msg, now))
        elif isinstance(msg, m.AbortRequest):
            if self.stage is not None:
                self.stage.drop(msg.request_id)
            self._apply(self.core.on_abort(msg.request_id))
        elif isinstance(msg, m.KvResync):
            self._command(lambda: self._publish(snapshot=True))
        else:
            raise TypeError(f"{self.name}: the twin's co-located worker takes no {type(msg).__name__}")

    # -- the core's actions (services/worker.py _perform) ---------------------------------------------

    def _apply(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, ToRouter):
                self.send(self.name, "router", action.msg)
            elif isinstance(action, ToTokenizer):
                self.send(self.name, action.tokenizer, action.batch)
            elif isinstance(action, AddJob):
                self._add_job(action)
            elif isinstance(action, Abort):
                rid = action.request_id
                self._command(lambda rid=rid: self._abort(rid))
            elif isinstance(action, OfferBlocks):
                self._offer(action.request_id, action.block_hashes)
            else:
                raise NotImplementedError(f"the twin's co-located worker does not perform {type(action).__name__}")

    def _add_job(self, action: AddJob) -> None:
        # services/worker.py _add_job: no daemon → straight to the engine; a stage → wait there; else load first
        job = action.job
        if self.daemon is None:
            self._command(lambda: self._engine_add(action))
        elif self.stage is None:
            self._load_prefix(action)
        else:
            if len(self.stage) or self.stage.entering_tokens or self._queued_prompt_tokens():
                self.daemon.prefetch(self._prompt_hashes(job))
            self.stage.push(job.request_id, len(job.token_ids), job.priority, action)
            self._stage_enter()

    def _stage_enter(self) -> None:
        if self.stage is not None:
            for action in self.stage.enter(self._queued_prompt_tokens()):
                self._load_prefix(action)

    def _prompt_hashes(self, job: m.PrefillJob) -> list[bytes]:
        # cache_client.load_prefix: a hit never covers the last prompt token
        hashes = self.prefix_cache.block_hashes(job.token_ids, job.cache_salt)
        return hashes[: (len(job.token_ids) - 1) // self.s.block_size]

    def _entered(self, job: m.PrefillJob) -> None:
        if self.stage is not None:
            self.stage.entered(job.request_id)
            self._stage_enter()

    # -- cache_client.load_prefix, on the clock -------------------------------------------------------

    def _load_prefix(self, action: AddJob) -> None:
        assert self.daemon is not None
        job, t0 = action.job, self.loop.now
        hashes = self._prompt_hashes(job) if self.s.prefix_caching else []
        if not hashes:
            self._prefix_loaded(action, 0.0, None)
            return

        def on_engine() -> None:  # the device-held head is read on the engine thread, at a step boundary
            have = self.prefix_cache.cached_prefix_blocks(hashes)
            if have == len(hashes):
                self._prefix_loaded(action, self.loop.now - t0, None)
            else:
                self.daemon.lookup(self.name, hashes[have:],
                                   lambda tiers: self._planned(action, t0, hashes, have, tiers))

        self._command(on_engine)

    def _planned(self, action: AddJob, t0: float, hashes: list[bytes], have: int, tiers: list[str]) -> None:
        plan = self.planner.plan(tiers, self.rate.tokens_per_s)
        if plan.blocks == 0:
            self._prefix_loaded(action, self.loop.now - t0, None)
            return
        wanted = hashes[have:have + plan.blocks]
        started = self.loop.now

        def fetched(got: list[bytes], got_tiers: list[str]) -> None:
            self.planner.observe(got_tiers, self.loop.now - started, first_asked=plan.first_tier)
            importer = (lambda: self._import(hashes[:have], got, got_tiers)) if got else None
            self._prefix_loaded(action, self.loop.now - t0, importer)

        self.daemon.fetch(self.name, wanted, started + plan.deadline_s, self.s.transport, fetched)

    def _import(self, head: list[bytes], hashes: list[bytes], tiers: list[str]) -> None:
        # cache_client._import: each run of one tier, holding the chain before it
        start = 0
        for i in range(1, len(tiers) + 1):
            if i == len(tiers) or tiers[i] != tiers[start]:
                run = hashes[start:i]
                data = torch.zeros(len(run), *self._spec.block_shape)
                n = self.prefix_cache.import_blocks(run, data, tiers[start], keep_resident=head)
                self.imported_blocks += n
                if n < i - start:
                    break
                head = head + run
                start = i

    def _prefix_loaded(self, action: AddJob, fetch_s: float, importer: Callable[[], None] | None) -> None:
        job = action.job
        if self.core.on_prefix_loaded(job, fetch_s):
            def add() -> None:
                if importer is not None:
                    importer()
                self._engine_add(action)
                self._entered(job)
            self._command(add)
        else:
            self._entered(job)

    # -- write-behind (cache_client.offer / _write_behind) --------------------------------------------

    def _offer(self, rid: str, hashes: list[bytes]) -> None:
        if not hashes or not self.s.prefix_caching or self.daemon is None:
            return
        if self._stores_in_flight >= MAX_STORES_IN_FLIGHT:
            return
        self._stores_in_flight += 1
        daemon = self.daemon

        def known(tiers: list[str]) -> None:
            wanted = [h for h, t in zip(hashes, tiers) if not t]
            if not wanted:
                self._stores_in_flight -= 1
                return

            def export() -> None:  # on the engine thread: those still resident, in order
                names = [h for h in wanted if self.pool.block_of(h) is not None]
                if not names:
                    self._stores_in_flight -= 1
                    return
                daemon.store_blocks(self.name, names, self.s.transport, self._stored)

            self._command(export)

        daemon.lookup(self.name, hashes, known)

    def _stored(self) -> None:
        self._stores_in_flight -= 1

    # -- the engine: EngineThread's loop and LLMEngine.step, the forward a cost ------------------------

    def _command(self, fn: Callable[[], None]) -> None:
        """Queue `fn` for the next step boundary (EngineThread.call). An idle engine gathers a burst first:
        it starts once no command came for COALESCE_GAP_S, at most COALESCE_MAX_S after the first."""
        self._commands.append(fn)
        if self._stepping:
            return
        now = self.loop.now
        if self._boundary is None:
            self._burst_started = now
        else:
            self._boundary.cancel()
        self._boundary = self.loop.at(min(now + COALESCE_GAP_S, self._burst_started + COALESCE_MAX_S), self._turn)

    def _turn(self) -> None:
        """A step boundary: run the queued commands, then start the next step if there is work. Exactly one
        step is ever in flight: a boundary armed by a command while idle is cancelled when a step's end
        comes first, and one that fires while a step runs leaves its commands to that step's end."""
        if self._boundary is not None:
            self._boundary.cancel()
            self._boundary = None
        if self._stepping:
            return
        while self._commands:
            self._commands.popleft()()
        if not self.scheduler.has_unfinished():
            self._stepping = False
            self._previous = None  # an idle wait is no stream's cadence
            return
        now = self.loop.now
        if self._previous is not None:
            start, streams, given = self._previous
            self.cadence.record(streams, given, now - start)
        sched = self.scheduler.schedule()
        if sched.is_empty:  # nothing admissible until a command frees something
            self._stepping = False
            self._previous = None
            return
        self._stepping = True
        seconds = self.costs.step.seconds(*self._step_shape(sched))
        self.loop.after(seconds, lambda: self._step_done(sched, now))

    @staticmethod
    def _step_shape(sched: SchedulerOutput) -> tuple[list[tuple[int, int]], list[int]]:
        prefill: list[tuple[int, int]] = []
        decode: list[int] = []
        for c in sched.chunks:
            if c.num_new_tokens == 1 and c.start >= len(c.request.prompt_token_ids):
                decode.append(c.start)
            else:
                prefill.append((c.num_new_tokens, c.start))
        return prefill, decode

    def _step_done(self, sched: SchedulerOutput, started: float) -> None:
        now = self.loop.now
        self.steps += 1
        committed: list[tuple[Request, FinishReason | None]] = []
        for chunk in sched.chunks:
            if not chunk.samples:
                continue
            req = chunk.request
            req.output_token_ids.append(SAMPLED_TOKEN)
            done = len(req.output_token_ids) >= req.params.max_tokens or req.num_tokens >= self.s.max_model_len
            committed.append((req, FinishReason.LENGTH if done else None))
        self.scheduler.update(sched)
        outputs = []
        for req, reason in committed:
            if reason is not None:
                self.scheduler.finish(req, reason)
            outputs.append(self._output(req))
        tokens = sched.num_batched_tokens
        self.tokens_computed += tokens
        self.tokens_generated += len(committed)
        EngineThread._measure(self.rate, tokens, now - started)  # type: ignore[arg-type]
        self._previous = (started, len(outputs), len(committed))
        if outputs:
            self._apply(self.core.on_outputs(outputs, self.steps, now))
        self._stepping = False
        self._stage_enter()  # (may queue commands: they run in the boundary below)
        self._turn()

    def _output(self, req: Request) -> RequestOutput:
        # engine_outputs._output, without text or logprobs
        finished = req.status == RequestStatus.FINISHED
        hashes = (list(req.block_hashes(req.num_computed_tokens // self.s.block_size))
                  if finished and self.s.prefix_caching and req.hasher is not None else [])
        usage = Usage(len(req.prompt_token_ids), len(req.output_token_ids), req.num_cached_tokens,
                      dict(req.cached_by_tier))
        return RequestOutput(req.request_id, [SAMPLED_TOKEN], list(req.output_token_ids) if finished else [],
                             finished, req.finish_reason, usage, block_hashes=hashes)

    def _engine_add(self, action: AddJob) -> None:
        # LLMEngine.add_request: the hash chain salted per tenant; arrival is the add's time, as there
        job = action.job
        params = to_engine_params(job.params)
        req = Request(job.request_id, list(action.prompt), params, priority=job.priority,
                      arrival_time=self.loop.now, prefill_only=action.prefill_only,
                      hasher=self.prefix_cache.new_hasher(job.cache_salt), tenant=job.cache_salt)
        req.output_token_ids.extend(action.resumed)
        self.scheduler.add(req)

    def _abort(self, rid: str) -> None:
        req = self.scheduler.requests.get(rid)
        if req is not None:
            self.scheduler.finish(req, FinishReason.ABORT)
        self.scheduler.release(rid)
