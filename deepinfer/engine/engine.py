"""The in-process engine: a plain `step()` loop over scheduler, model runner and sampler.

    engine = LLMEngine.load("smollm2")
    outs = engine.generate(["Hello"], SamplingParams(max_tokens=32))

or, driven step by step (what a worker service does):

    engine.add_request("r1", prompt_token_ids, params)
    while engine.has_unfinished():
        for out in engine.step(): ...

Every request ends exactly once: its last `RequestOutput` has `finished=True` and a finish reason
(stop, length, abort or error), and by then all its KV blocks are back in the pool — except a
prefill-only request that hands off, whose last output has `handoff=True` and whose prompt blocks
stay held until `release` (or `abort`).

Prefill/decode disaggregation, engine side (the services pick the engines and move the bytes):

    prefill.add_request(rid, ids, params, prefill_only=True)
    ...                                  # a step() output with handoff=True carries the first token
    decode.reserve(rid, num_blocks, lease_s=10.0)      # the decode side accepts the job
    kv = prefill.export_kv(rid)                        # ... sent ...
    prefill.release(rid)
    decode.add_prefilled_request(rid, ids, first_token, params, kv, reservation_id=rid)

Expert parallelism: with `ep_group` (see `deepinfer.engine.ep`), this engine is one rank of a group that
splits every MoE layer's experts between ranks. Each rank has its own requests, KV and scheduler, but
the ranks' forwards meet at every MoE layer, so `step()` is a collective: every rank calls it the same
number of times, and each call runs exactly one forward — of zero tokens when this rank has nothing
scheduled. Who decides that the group steps (while any rank has work) is the caller's business:
`has_unfinished()` stays local. A failure inside the forward (a peer died, a collective timed out)
raises `ExpertParallelError` from `step()`, carrying the terminal outputs of the step's requests; the
engine refuses to step again. Between steps the group can move the engine to a new expert placement
(`stage_placement` in the background, then `switch_placement` at a step the whole group agrees on; see
`deepinfer.engine.ep.move`). Not available under expert parallelism: a draft-model speculator (its
forwards would not be collective; n-gram and suffix guessers are fine), `prompt_logits` and
`generate` (they run forwards on this rank's schedule alone).

The device tier of the prefix cache (DESIGN §4) lives in the block pool: a block full of computed KV
is named by its chain hash (`block_hashes`, salted per tenant with `cache_salt`) and stays cached after
its request ends, until the pool reuses it (LRU). A new request takes the longest cached prefix of its
prompt instead of computing it. Between steps the worker moves named blocks to and from the cache
daemon's tiers with `export_cached_blocks` and `import_cached_blocks`; `pool.drain_events()` and
`pool.cached_hashes()` feed the router's prefix index.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from deepinfer.cache.block_pool import BlockPool, NoFreeBlocksError
from deepinfer.cache.hashing import BlockHash, CacheNamespace
from deepinfer.config.engine import EngineConfig, parse_speculative
from deepinfer.config.kv import KvSpec
from deepinfer.config.model import ConfigError, ModelConfig
from deepinfer.engine.attention import Segment, layout
from deepinfer.engine.ep.experts import EpStats
from deepinfer.engine.ep.group import EpGroup, ExpertParallelError
from deepinfer.engine.ep.move import PlacementRefused, PlacementStager, shard_movable
from deepinfer.engine.ep.placement import ExpertPlacement
from deepinfer.engine.handoff import (
    HandoffError,
    Reservations,
    blocks_for,
    check_kv,
    export_blocks,
    import_blocks,
)
from deepinfer.engine.model_runner import ModelRunner, PromptRows, num_blocks_for_budget
from deepinfer.engine.models import build_model
from deepinfer.engine.models.moe import moe_blocks
from deepinfer.engine.prefix_cache import DevicePrefixCache
from deepinfer.engine.request import (
    FinishReason,
    InvalidRequestError,
    Logprob,
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
    Usage,
)
from deepinfer.engine.sampler import Sampler, make_generator, token_logprobs
from deepinfer.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from deepinfer.engine.speculative.registry import registration
from deepinfer.engine.speculative.speculator import Speculator, build_proposer
from deepinfer.engine.speculative.verify import VerifyGroup, VerifyResult, verify
from deepinfer.loading.fetch import resolve_model
from deepinfer.loading.identity import cache_namespace
from deepinfer.loading.weights import LoadedModel, load_model_weights
from deepinfer.text.detokenizer import IncrementalDetokenizer
from deepinfer.text.tokenizer import Tokenizer

log = structlog.get_logger("deepinfer.engine")
_PROMPT_LOGPROB_ROWS = 256  # prompt positions whose log-softmax is taken at once (bounds the extra memory)


@dataclass
class EngineStats:
    """Monotonic counters since the engine started."""

    num_steps: int = 0
    num_preemptions: int = 0
    tokens_computed: int = 0  # every token through the model, recomputation after preemption included
    tokens_generated: int = 0
    handoffs_out: int = 0  # prefill-only requests held for export
    handoffs_in: int = 0  # requests added with KV computed elsewhere
    reservations_expired: int = 0
    # Prefix cache: admissions that looked their prompt up, their tokens, and the tokens found cached.
    prefix_lookups: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    blocks_imported: int = 0  # named blocks copied in from another tier (import_cached_blocks)
    # Speculative decoding: draft tokens verified, and how many of them were accepted.
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    # Expert parallelism: steps that ran a zero-token forward (nothing scheduled on this rank).
    ep_empty_steps: int = 0


class LLMEngine:
    """One engine (see the module docstring). Implements `ServingEngine` (deepinfer.engine.interface), the
    calls the services make of an engine; tests/unit/test_engine_interface.py checks it."""

    def __init__(self, loaded: LoadedModel, tokenizer: Tokenizer | None = None,
                 config: EngineConfig | None = None, *, clock: Callable[[], float] = time.monotonic,
                 ep_group: EpGroup | None = None, ep_placement: ExpertPlacement | None = None) -> None:
        """`ep_group`: make this engine one rank of that expert-parallel group (see the module docstring),
        holding its share of the experts per `ep_placement` (default: `ExpertPlacement.static`)."""
        self.config = config or EngineConfig()
        if ep_group is not None:
            _check_ep(self.config, ep_group)
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        self.model_config: ModelConfig = loaded.config
        self.fingerprint = loaded.fingerprint
        self.tokenizer = tokenizer
        # The one description of this engine's KV: pool, transfers, cache tiers and namespace all follow it.
        self.kv_spec = KvSpec.for_model(self.model_config, self.config.block_size, self.config.kv_cache_dtype)
        num_blocks = num_blocks_for_budget(self.kv_spec, self.config)
        capacity = num_blocks * self.config.block_size
        # One sequence must always fit in the whole pool, or preemption could not make room for it.
        self.max_model_len = min(
            self.config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
            capacity,
        )
        model = build_model(self.model_config, loaded.state_dict, self.max_model_len, self.config.device)
        self.ep_group = ep_group
        self.ep_placement: ExpertPlacement | None = None
        self._ep_stats: EpStats | None = None
        self._ep_failure: ExpertParallelError | None = None
        self._ep_moves: PlacementStager | None = None
        if ep_group is not None:
            self.ep_placement, self._ep_stats, self._ep_moves = shard_movable(
                model, loaded, ep_group, ep_placement, self.config.redundant_experts)
        self.pool = BlockPool(num_blocks)
        self.scheduler = Scheduler(
            self.pool, self.config.block_size, self.config.max_num_seqs, self.config.max_num_batched_tokens,
            enable_prefix_caching=self.config.enable_prefix_caching,
        )
        self.runner = ModelRunner(model, self.config, self.kv_spec, num_blocks)
        self.cache_namespace: CacheNamespace = cache_namespace(
            loaded.source, self.kv_spec, tokenizer.fingerprint if tokenizer else "none"
        )
        self.prefix_cache = DevicePrefixCache(self.pool, self.runner.kv, self.kv_spec, self.cache_namespace,
                                              self.config.enable_prefix_caching)
        self.reservations = Reservations(self.pool)
        # Reservation leases are measured on this clock (injectable for tests).
        self._clock = clock
        self.sampler = Sampler()
        self.speculator: Speculator | None = None
        if self.config.speculative:
            proposer = build_proposer(self.config, model, self.runner.kv)
            self.speculator = Speculator(self.config, proposer, self.max_model_len)
        self.eos_token_ids = tuple(tokenizer.eos_token_ids) if tokenizer else self.model_config.eos_token_ids
        self._generators: dict[str, torch.Generator | None] = {}
        # Per request: the detokenizer and the text it has released so far.
        self._texts: dict[str, tuple[IncrementalDetokenizer, list[str]]] = {}
        self._pending: list[RequestOutput] = []  # terminal outputs of aborted requests
        self._ids = itertools.count()
        self.stats = EngineStats()

    @classmethod
    def load(cls, model: str | Path, config: EngineConfig | None = None) -> LLMEngine:
        """`model` is "smollm2" (fetched on first use), a Hugging Face directory or a .gguf file."""
        path = resolve_model(str(model))
        config = config or EngineConfig()
        return cls(load_model_weights(path, config.weights, config.device), Tokenizer.load(path), config)

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, request_id: str | None, prompt: str | Sequence[int], params: SamplingParams,
                    priority: int = 0, *, prefill_only: bool = False, cache_salt: str | None = None,
                    resume_output_ids: Sequence[int] = ()) -> str:
        """Queue a request (text needs a tokenizer). Raises InvalidRequestError, leaving the engine untouched.

        `resume_output_ids`: tokens this request already generated elsewhere (a worker that died): they are
        computed with the prompt, as a preempted request's are, and the request continues at output
        position len(resume_output_ids) — penalties, `max_tokens`, stop strings and a seed's draws all
        count them, so the continuation is what the undisturbed request would have produced.

        `cache_salt` (the tenant's, set by the service, never by a client) salts the request's block
        hashes: it shares cached blocks only with requests of the same salt.

        `prefill_only`: compute the prompt (chunked as usual), sample the first token, then stop and
        hand off: the step's output for it has `finished=True, handoff=True, finish_reason=None` and
        the first token; its blocks stay held for `export_kv` until `release` or `abort`. If the first
        token already ends the request (stop token, EOS, stop string, max_tokens=1, context limit),
        it finishes normally instead and nothing is held.
        """
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        self._check_id_free(request_id)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("a text prompt needs a tokenizer; pass token ids instead")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = list(prompt)
        resumed = list(resume_output_ids)
        self._validate(prompt_ids, params, resumed)
        req = Request(request_id, prompt_ids, params, priority=priority, eos_token_ids=self.eos_token_ids,
                      prefill_only=prefill_only, hasher=self.prefix_cache.new_hasher(cache_salt), tenant=cache_salt)
        req.output_token_ids.extend(resumed)
        self._track(req)
        self.scheduler.add(req)
        return request_id

    def _check_id_free(self, request_id: str) -> None:
        # A held request's id stays in use until it is released: export_kv and release address it.
        if request_id in self.scheduler.requests or request_id in self.scheduler.held:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")

    def _track(self, req: Request) -> None:
        """Per-request engine state beside the scheduler's: the seeded generator, the detokenizer (fed the
        output the request already has, so its text and stop strings continue across a resume)."""
        self._generators[req.request_id] = make_generator(req.params.seed)
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids=req.prompt_token_ids, stop=req.params.stop,
                                           skip_special_tokens=True)
            pieces = [detok.push(req.output_token_ids).text] if req.output_token_ids else []
            self._texts[req.request_id] = (detok, pieces)

    def _validate(self, prompt_ids: list[int], params: SamplingParams, resumed: Sequence[int] = ()) -> None:
        vocab = self.model_config.vocab_size
        params.validate(vocab)
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer")
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty")
        bad = next((t for t in [*prompt_ids, *resumed] if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad!r} is outside the vocabulary [0, {vocab})")
        if len(prompt_ids) + len(resumed) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_ids)} tokens (and {len(resumed)} resumed output tokens); the "
                f"context limit is {self.max_model_len} (prompt plus at least one generated token)"
            )
        if resumed and len(resumed) >= params.max_tokens:
            raise InvalidRequestError(f"{len(resumed)} resumed output tokens leave nothing of max_tokens "
                                      f"{params.max_tokens} to generate")

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its blocks are freed now and its terminal output comes with the next step().

        Also releases a held request of that id (it already had its final, handoff output: no second
        one comes) and cancels a reservation of that id (services name a decode-side reservation after
        its request, so one abort covers every point of a handoff). Returns False if nothing of that
        id was live."""
        cancelled = self.cancel_reservation(request_id)
        if self.release(request_id):
            return True
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return cancelled
        self._finish(req, FinishReason.ABORT)
        self._pending.append(self._output(req, []))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    # -- prefill side of a handoff ------------------------------------------------------------

    @property
    def num_held(self) -> int:
        return len(self.scheduler.held)

    @property
    def held_request_ids(self) -> list[str]:
        return list(self.scheduler.held)

    def export_kv(self, request_id: str) -> torch.Tensor:
        """A contiguous copy of a held request's KV — every token but the one it just sampled: the prompt,
        and any resumed output — [ceil(n / block_size), *kv_spec.block_shape], block i
        holding tokens [i * block_size, (i + 1) * block_size); slots past them are zero. The blocks stay
        held: export again or release."""
        req = self.scheduler.held.get(request_id)
        if req is None:
            raise HandoffError(f"request {request_id!r} is not held for handoff")
        return export_blocks(self.kv_spec, self.runner.kv, req.block_ids, req.num_tokens - 1)

    def release(self, request_id: str) -> bool:
        """Free a held request's blocks (its KV has been sent, or never will be). False if `request_id`
        is not held (unknown, already released, or never handed off)."""
        return self.scheduler.release(request_id) is not None

    # -- decode side of a handoff -------------------------------------------------------------

    @property
    def num_reserved_blocks(self) -> int:
        return self.reservations.num_blocks

    def reserve(self, reservation_id: str, num_blocks: int, lease_s: float, now: float | None = None) -> bool:
        """Set `num_blocks` free blocks aside now for KV that is on its way, until `now + lease_s` (now
        defaults to the engine clock). False, changing nothing, if fewer are free: admission for a
        handoff is this reservation, and it never preempts running requests."""
        return self.reservations.reserve(reservation_id, num_blocks, lease_s, self._now(now))

    def expire_reservations(self, now: float | None = None) -> list[str]:
        """Free every reservation whose lease has run out by `now` (default: the engine clock); returns
        their ids. `step()` calls it too; an idle worker calls it from a timer."""
        expired = self.reservations.expire(self._now(now))
        if expired:
            self.stats.reservations_expired += len(expired)
            log.warning("reservation leases expired", reservation_ids=expired)
        return expired

    def cancel_reservation(self, reservation_id: str) -> bool:
        """Free a reservation now; False if it is unknown (never made, used, cancelled or expired)."""
        return self.reservations.cancel(reservation_id)

    def add_prefilled_request(self, request_id: str, prompt_token_ids: Sequence[int], first_token: int,
                              params: SamplingParams, kv: torch.Tensor, reservation_id: str | None = None,
                              priority: int = 0, first_logprob: Logprob | None = None,
                              cache_salt: str | None = None, resume_output_ids: Sequence[int] = ()) -> str:
        """Continue a request whose prompt a prefill engine computed: `kv` is its `export_kv`, and
        `first_token` what it sampled, with `first_logprob` when `params.logprobs` is set (ignored
        otherwise). The prompt's full blocks are named in this engine's prefix cache under the
        request's chain (salted with `cache_salt`), like blocks computed here.

        Blocks come from the reservation `reservation_id` (it must exist and hold at least the
        prompt's ceil(len / block_size) blocks) or, without one, from the free pool (NoFreeBlocksError
        if short; admission never preempts). `kv` is copied into the first of them. Reserved blocks
        beyond the prompt's stay with the request for its next tokens, up to as many as its longest
        possible output needs (prompt + max_tokens - 1 tokens of KV, within the context limit); any
        beyond that go back to the pool at once.

        The request then runs exactly as if it had been prefilled here: in `running` at once (even
        past `max_num_seqs`: the reservation was its admission), the detokenizer fed the first token (a
        seeded request's stream is keyed by position, so its next token draws exactly what a single
        engine would have drawn). If the first token ends it (stop
        token, EOS, stop string, max_tokens=1, context limit) its terminal output comes with the next
        `step()` and its blocks are freed now.

        `resume_output_ids`: output the request had before this handoff (it was resumed on the prefill
        engine after a worker died; see `add_request`): `kv` covers the prompt and them, and `first_token`
        is the token that follows them.

        Outputs never repeat the first token in `new_token_ids` (the caller has it from the handoff);
        the final output's `token_ids`, `logprobs`, `usage` and `text` cover the whole output, first
        token included. Raises InvalidRequestError (HandoffError for handoff-specific checks) or
        NoFreeBlocksError, leaving the engine and the reservation untouched.
        """
        prompt_ids, resumed = list(prompt_token_ids), list(resume_output_ids)
        self._check_id_free(request_id)
        self._validate(prompt_ids, params, resumed)
        vocab = self.model_config.vocab_size
        if isinstance(first_token, bool) or not isinstance(first_token, int) or not 0 <= first_token < vocab:
            raise InvalidRequestError(f"first token {first_token!r} is outside the vocabulary [0, {vocab})")
        if params.logprobs is not None and (first_logprob is None or first_logprob.token_id != first_token):
            raise HandoffError("params ask for logprobs: first_logprob must be given, for the first token")
        num_kv = len(prompt_ids) + len(resumed)
        check_kv(kv, self.kv_spec, num_kv)
        bs = self.config.block_size
        need = blocks_for(num_kv, bs)
        if reservation_id is not None:
            reservation = self.reservations.get(reservation_id)
            if reservation is None:
                raise HandoffError(f"unknown or expired reservation {reservation_id!r}")
            if len(reservation.block_ids) < need:
                raise HandoffError(
                    f"reservation {reservation_id!r} has {len(reservation.block_ids)} blocks; "
                    f"the prompt's KV needs {need}"
                )
            # Still the reservation's: a failed copy leaves it as it was.
            blocks = reservation.block_ids
        else:
            if need > self.pool.num_free:
                raise NoFreeBlocksError(f"the prompt's KV needs {need} blocks, {self.pool.num_free} free")
            blocks = self.pool.allocate(need)
        try:
            import_blocks(self.runner.kv, blocks[:need], kv)
        except BaseException:
            if reservation_id is None:
                self.pool.free(reversed(blocks))
            raise
        if reservation_id is not None:
            self.reservations.take(reservation_id)
        # Positions [0, final_len - 1) get KV; the last sampled token's is never computed.
        final_len = min(len(prompt_ids) + params.max_tokens, self.max_model_len)
        keep = max(need, blocks_for(final_len - 1, bs))
        self.pool.free(reversed(blocks[keep:]))

        req = Request(request_id, prompt_ids, params, priority=priority, eos_token_ids=self.eos_token_ids,
                      hasher=self.prefix_cache.new_hasher(cache_salt), tenant=cache_salt)
        # Its prompt logprobs (if asked) came with the prefill engine's handoff output: none are computed
        # here, and a preempted request may take cached prefix blocks like any other.
        req.prompt_logprobs, req.prompt_logprobs_done, req.prompt_logprobs_sent = None, True, True
        req.block_ids = blocks[:keep]
        req.num_computed_tokens = num_kv
        req.output_token_ids.extend(resumed)
        self._track(req)
        req.output_token_ids.append(first_token)
        if params.logprobs is not None and first_logprob is not None:
            req.output_logprobs.append(first_logprob)
        self.scheduler.add_running(req)
        self.stats.handoffs_in += 1
        reason = self._check_stop(req, first_token)
        if reason is not None:
            self._finish(req, reason)
            self._pending.append(self._output(req, []))
        return request_id

    def _now(self, now: float | None) -> float:
        return self._clock() if now is None else now

    # -- the loop ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self._ep_failure is not None:
            owed, self._pending = self._pending, []
            raise ExpertParallelError(f"the expert-parallel group failed earlier: {self._ep_failure}", owed)
        # Leases hold even where no timer runs: a lost transfer's blocks come back here.
        self.expire_reservations()
        outputs, self._pending = self._pending, []
        spec = self.speculator
        if spec is not None:
            spec.plan(self.scheduler.running, self.scheduler.max_num_batched_tokens)
        sched = self.scheduler.schedule()
        if spec is not None:
            spec.clear_plan()
        if sched.is_empty:
            if self.ep_group is not None:
                # The group's step is collective: join every MoE layer with zero tokens.
                self.stats.ep_empty_steps += 1
                try:
                    self._forward(sched)
                except ExpertParallelError as exc:
                    exc.outputs = outputs  # aborted requests' terminal outputs, still owed
                    raise
            return outputs
        self.stats.num_steps += 1
        self.stats.num_preemptions += len(sched.preempted)
        self.stats.prefix_lookups += sched.prefix_lookups
        self.stats.prefix_query_tokens += sched.prefix_query_tokens
        self.stats.prefix_hit_tokens += sched.prefix_hit_tokens
        try:
            if spec is not None:
                spec.draft(sched)
            started = time.perf_counter()
            sampled, logits, prompt_rows = self._forward(sched)
            # The model returns inference tensors, which the sampler's penalties update in place.
            with torch.inference_mode():
                for part in prompt_rows:
                    self._collect_prompt_logprobs(part)
                results = verify(self.sampler, logits, [self._verify_group(c) for c in sampled])
            if spec is not None:
                spec.record_step(sched.num_batched_tokens, time.perf_counter() - started)
        except Exception as exc:  # a failed step fails its requests, never the engine
            failed = [c.request.request_id for c in sched.chunks]
            if isinstance(exc, ExpertParallelError):
                # The cause is the message (a peer's closed connection, a timeout); a traceback rendered
                # with its frames' locals would take seconds while the caller waits to tear the group down.
                log.error("expert-parallel step failed", error=str(exc), requests=failed)
            else:
                log.exception("step failed", requests=failed)
            for chunk in sched.chunks:
                req = chunk.request
                if not req.is_finished:
                    req.error = f"{type(exc).__name__}: {exc}"
                    self._finish(req, FinishReason.ERROR)
                    outputs.append(self._output(req, []))
            if isinstance(exc, ExpertParallelError):
                exc.outputs = outputs
                raise
            return outputs
        self.stats.tokens_computed += sched.num_batched_tokens
        committed = [(chunk, *self._commit(chunk, result)) for chunk, result in zip(sampled, results)]
        # Only now, with the committed tokens known, does the scheduler learn what KV stays.
        self.scheduler.update(sched)
        for chunk, new_tokens, reason in committed:
            req = chunk.request
            if reason is not None:
                self._finish(req, reason)
            elif req.prefill_only:
                self._hold(req)
            outputs.append(self._output(req, new_tokens))
        return outputs

    def _forward(self, sched: SchedulerOutput) -> tuple[list[ScheduledChunk], torch.Tensor, list[PromptRows]]:
        """The step's one forward. Under expert parallelism any failure in it is the group's: the other
        ranks are inside (or past) collectives this rank will not join, so the engine stops for good."""
        if self.ep_group is None:
            return self.runner.execute(sched)
        try:
            if sched.is_empty:
                self.runner.execute_empty()
                return [], torch.zeros(0, self.model_config.vocab_size), []
            return self.runner.execute(sched)
        except Exception as exc:
            self._ep_failure = ExpertParallelError(f"{type(exc).__name__}: {exc}")
            raise self._ep_failure from exc

    def expert_counts(self) -> torch.Tensor:
        """Assignments per logical expert of every MoE layer since the last call, [num_moe_layers,
        num_experts] int64 on the host (a token counts once for each expert it chose), then zero. Under
        expert parallelism a rank counts its own tokens: the group's histogram is the sum over ranks.
        Forwards a self-draft runs through the shared layers count too. [0, 0] for a dense model."""
        blocks = moe_blocks(self.runner.model)
        if not blocks:
            return torch.zeros(0, 0, dtype=torch.int64)
        return torch.stack([b.experts.take_counts() for b in blocks])  # type: ignore[attr-defined]

    def expert_computed(self) -> list[int]:
        """Under expert parallelism, per MoE layer the assignments this rank's experts computed since the
        last call (for any rank's tokens: the rank's measured expert load), then zero; [] otherwise."""
        if self.ep_group is None:
            return []
        return [b.experts.take_computed() for b in moe_blocks(self.runner.model)]  # type: ignore[attr-defined]

    def ep_stats(self) -> EpStats | None:
        """Expert-parallel dispatch/compute/combine times and bytes since the last call (then zero);
        None without an expert-parallel group."""
        return self._ep_stats.take() if self._ep_stats is not None else None

    # -- expert placement moves (deepinfer.engine.ep.move; the group decides when to switch) ---------

    def stage_placement(self, placement: ExpertPlacement) -> None:
        """Start loading this rank's experts of `placement` in the background; the current placement
        keeps serving. PlacementRefused without expert parallelism or for a table that cannot follow
        the current one."""
        self._placement_stager().stage(placement)

    def staged_placement(self) -> tuple[int | None, str | None]:
        """(the version staged and ready to switch to, or None; why the staging failed, or None)."""
        return self._ep_moves.status() if self._ep_moves is not None else (None, None)

    def switch_placement(self, version: int) -> None:
        """Between steps: serve from the staged placement `version` from the next step on (every rank of
        the group must switch before the same step)."""
        self.ep_placement = self._placement_stager().switch(version)

    def drop_staged_placement(self) -> None:
        if self._ep_moves is not None:
            self._ep_moves.drop()

    def stop_staging(self) -> None:
        """Drop any staging and wait for its loading thread to end: before the process exits."""
        if self._ep_moves is not None:
            self._ep_moves.close()

    def _placement_stager(self) -> PlacementStager:
        if self._ep_moves is None:
            raise PlacementRefused("this engine is not a rank of an expert-parallel group")
        return self._ep_moves

    def _collect_prompt_logprobs(self, part: PromptRows) -> None:
        """Keep, from one chunk's logits at prompt positions, each next prompt token's raw logprob and the
        top alternatives: the chunk's log-softmax is dropped right after (never a [prompt, vocab] matrix
        across chunks). Entries are written by position, so a prompt recomputed after a preemption
        rewrites the same values."""
        req = part.chunk.request
        lps = req.prompt_logprobs
        assert lps is not None
        start, m = part.chunk.start, part.logits.shape[0]
        num_top = req.params.prompt_logprobs or 0
        for lo in range(0, m, _PROMPT_LOGPROB_ROWS):  # a slice at a time: one more [rows, vocab] at most
            hi = min(m, lo + _PROMPT_LOGPROB_ROWS)
            logp = part.logits[lo:hi].float().log_softmax(dim=-1)
            targets = req.prompt_token_ids[start + 1 + lo : start + 1 + hi]
            for j, lp in enumerate(token_logprobs(logp, targets, [num_top] * (hi - lo)), start + 1 + lo):
                lps[j] = lp
        if start + 1 + m >= len(req.prompt_token_ids):
            req.prompt_logprobs_done = True

    def _verify_group(self, chunk: ScheduledChunk) -> VerifyGroup:
        r = chunk.request
        probs = self.speculator.draft_probs(chunk) if self.speculator is not None else None
        return VerifyGroup(r.params, r.prompt_token_ids, r.output_token_ids, self._generators[r.request_id],
                           chunk.draft_token_ids, probs)

    def _commit(self, chunk: ScheduledChunk, result: VerifyResult) -> tuple[list[int], FinishReason | None]:
        """Append the verified run to the request, token by token, stopping at the first stop; set the
        chunk's `num_rejected` so only KV of committed positions is kept. Returns the tokens appended
        and the finish reason, if one of them ended the request."""
        req = chunk.request
        new_tokens: list[int] = []
        reason = None
        for token, logprob in zip(result.token_ids, result.logprobs, strict=True):
            req.output_token_ids.append(token)
            if logprob is not None:
                req.output_logprobs.append(logprob)
            new_tokens.append(token)
            reason = self._check_stop(req, token)
            if reason is not None:
                break
        self.stats.tokens_generated += len(new_tokens)
        end = chunk.start + chunk.num_new_tokens
        # KV exists for the step's positions up to the last accepted draft; of those, a position stays
        # only if its token was committed and is not the last one (whose KV the next step computes).
        kept = min(end - (chunk.num_spec - result.num_accepted), req.num_tokens - 1)
        chunk.num_rejected = end - kept
        if chunk.num_spec and self.speculator is not None:
            self.stats.spec_proposed_tokens += chunk.num_spec
            committed_drafts = min(result.num_accepted, len(new_tokens) - 1)
            self.stats.spec_accepted_tokens += committed_drafts
            self.speculator.record(chunk, result.num_accepted, committed_drafts)
        return new_tokens, reason

    def _hold(self, req: Request) -> None:
        """End a prefill-only request's life here by handoff, keeping its prompt blocks."""
        self.scheduler.hold(req)
        self._generators.pop(req.request_id, None)
        if self.speculator is not None:
            self.speculator.finished(req)
        # The decode side detokenizes the whole output, first token included.
        self._texts.pop(req.request_id, None)
        self.stats.handoffs_out += 1

    def _check_stop(self, req: Request, token: int) -> FinishReason | None:
        p = req.params
        text = self._texts.get(req.request_id)
        if text is not None:
            delta = text[0].push([token])
            text[1].append(delta.text)
            if delta.stopped:
                return FinishReason.STOP
        if token in p.stop_token_ids or (not p.ignore_eos and token in req.eos_token_ids):
            return FinishReason.STOP
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self.scheduler.finish(req, reason)
        self._generators.pop(req.request_id, None)
        if self.speculator is not None:
            self.speculator.finished(req)

    def _output(self, req: Request, new_tokens: list[int]) -> RequestOutput:
        handoff = req.status == RequestStatus.HELD
        finished = req.is_finished or handoff
        text = None
        if finished and req.request_id in self._texts:
            detok, pieces = self._texts.pop(req.request_id)
            text = "".join(pieces) + detok.flush().text
        prompt_logprobs = None
        if req.prompt_logprobs is not None and req.prompt_logprobs_done and (
                finished or (new_tokens and not req.prompt_logprobs_sent)):
            prompt_logprobs = list(req.prompt_logprobs)
            req.prompt_logprobs_sent = req.prompt_logprobs_sent or bool(new_tokens)
        wants_logprobs = req.params.logprobs is not None
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_tokens,
            token_ids=list(req.output_token_ids) if finished else [],
            finished=finished,
            finish_reason=req.finish_reason,
            usage=Usage(len(req.prompt_token_ids), len(req.output_token_ids), req.num_cached_tokens,
                        dict(req.cached_by_tier), req.spec_proposed_tokens, req.spec_accepted_tokens),
            logprobs=list(req.output_logprobs) if finished and wants_logprobs else None,
            error=req.error,
            text=text,
            handoff=handoff,
            block_hashes=self._computed_block_hashes(req) if finished else [],
            # Every token this engine committed appended its logprob: the last len(new_tokens) are theirs.
            new_logprobs=req.output_logprobs[len(req.output_logprobs) - len(new_tokens):] if wants_logprobs else None,
            prompt_logprobs=prompt_logprobs,
        )

    def _computed_block_hashes(self, req: Request) -> list[BlockHash]:
        if not self.config.enable_prefix_caching or req.hasher is None:
            return []
        return list(req.block_hashes(req.num_computed_tokens // self.config.block_size))

    # -- prefix cache, between steps ----------------------------------------------------------

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[BlockHash]:
        """The chain hashes of the full blocks of `token_ids`, as a request with this salt names them."""
        return self.prefix_cache.block_hashes(token_ids, cache_salt)

    def cached_prefix_blocks(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading `hashes` are device-resident now (takes nothing: a later step may evict them)."""
        return self.prefix_cache.cached_prefix_blocks(hashes)

    def cache_route(self, request_id: str, hashes: Sequence[BlockHash]) -> LLMEngine:
        """Where request `request_id`'s cached-prefix lookup and import go (a `PrefixTarget`): this engine (a
        worker group answers with the one rank it places the request on)."""
        return self

    def export_cached_blocks(self, hashes: Sequence[BlockHash]) -> tuple[list[BlockHash], torch.Tensor | None]:
        """The KV of those of `hashes` that are device-resident, in order, as one contiguous copy
        [n, *kv_spec.block_shape] (None when none is): for write-behind."""
        return self.prefix_cache.export_blocks(hashes)

    def import_cached_blocks(self, hashes: Sequence[BlockHash], kv: torch.Tensor | Sequence[torch.Tensor], tier: str,
                             keep_resident: Sequence[BlockHash] = ()) -> int:
        """Cache KV fetched from `tier` ("host" or "disk"): block i of `kv` (one tensor [n,
        *kv_spec.block_shape], or n per-block tensors) is named hashes[i]. Fills
        free blocks only (evicting least recently used cached ones, never a referenced block); returns
        how many blocks were imported. A later hit on one counts under `tier` in `Usage.cached_by_tier`.

        `keep_resident`: the chain's blocks before `hashes` that are already here (a device-resident
        head, an earlier import of another tier); they are held through the import so it cannot evict
        them, and if one is gone nothing is imported (0). Raises HandoffError for KV of the wrong shape
        or dtype, ValueError for a bad tier or hash."""
        n = self.prefix_cache.import_blocks(hashes, kv, tier, keep_resident)
        self.stats.blocks_imported += n
        return n

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds (an operator's reset, and how tests empty the device
        tier to reach the cache daemon's). Returns how many were forgotten."""
        return self.pool.forget_free()

    def prompt_logits(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        """Logits [len(prompt), vocab] at every prompt position from one prefill pass, outside the
        scheduler (for scoring and for checking against an oracle). Uses and returns pool blocks.
        Refused under expert parallelism: it is a forward outside the group's lockstep steps."""
        if self.ep_group is not None:
            raise NotImplementedError("prompt_logits runs a forward outside step(); under expert parallelism "
                                      "every forward is a collective of the whole group, so it is not available")
        req = Request("__prompt_logits__", list(prompt_ids), SamplingParams(max_tokens=1))
        self._validate(req.prompt_token_ids, req.params)
        req.block_ids = self.pool.allocate(-(-len(prompt_ids) // self.config.block_size))
        try:
            step = layout([Segment(prompt_ids, 0, req.block_ids, num_logits=len(prompt_ids))], self.config.block_size,
                          self.runner.use_native)
            return self.runner.model.forward(step.input_ids, step.positions, self.runner.kv, step.meta,
                                             step.logits_rows)
        finally:
            self.pool.free(reversed(req.block_ids))

    # -- convenience ------------------------------------------------------------------------

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Submit every prompt at once, run until all finish; final outputs in input order. Not under
        expert parallelism: it steps until this rank's prompts finish, which the other ranks cannot know."""
        if self.ep_group is not None:
            raise NotImplementedError("generate steps on this rank's schedule alone; under expert parallelism "
                                      "the group steps together (add_request, then step() in lockstep)")
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, plist):
                ids.append(self.add_request(None, p, sp))
        except InvalidRequestError:
            for rid in ids:  # all or nothing: leave no half-submitted batch behind
                self.abort(rid)
            self._pending.clear()
            raise
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]


def _check_ep(config: EngineConfig, group: EpGroup) -> None:
    """What expert parallelism needs of the engine's configuration (ConfigError otherwise)."""
    if torch.device(config.device).type != group.device.type:
        raise ConfigError(f"the engine's device {config.device!r} is not the expert-parallel group's "
                          f"{str(group.device)!r}")
    if config.speculative is not None and not registration(parse_speculative(config.speculative).kind).cls.cheap:
        raise ConfigError(f"speculative {config.speculative!r} runs a draft model's forwards beside the step's, "
                          "which the expert-parallel group cannot join; use ngram or suffix speculation")
