"""The in-process engine's one job, the step loop: requests in (`add_request`, `abort`), `step()` — schedule,
one forward of the model runner, sample and verify, commit — and each step's `RequestOutput`s out.

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

Under expert parallelism `step()` is a collective of the group's ranks (engine_ep.py says how).

`LLMEngine`'s other calls live beside it, each a mixin over the same engine state:

* `engine_handoff.py` — prefill/decode disaggregation: held requests' KV export, reservations, adding a
  request prefilled elsewhere;
* `engine_prefix.py` — the device prefix cache between steps: block hashes, residency, named blocks in and out;
* `engine_ep.py` — expert parallelism: setup, expert load counters, placement moves;
* `engine_outputs.py` — a request's outputs: its text and stop checks, the `RequestOutput`;
* `engine_offline.py` — `load`, `generate` and `prompt_logits`, for use without the services.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog
import torch

from deepinfer.cache.block_pool import BlockPool
from deepinfer.cache.hashing import CacheNamespace
from deepinfer.config.engine import EngineConfig
from deepinfer.config.kv import KvSpec
from deepinfer.config.model import ModelConfig
from deepinfer.engine.engine_ep import ExpertParallelMixin, check_ep_config
from deepinfer.engine.engine_handoff import HandoffMixin
from deepinfer.engine.engine_offline import OfflineMixin
from deepinfer.engine.engine_outputs import OutputsMixin
from deepinfer.engine.engine_prefix import PrefixCacheMixin
from deepinfer.engine.ep.group import EpGroup, ExpertParallelError
from deepinfer.engine.ep.placement import ExpertPlacement
from deepinfer.engine.handoff import Reservations
from deepinfer.engine.model_runner import ModelRunner, PromptRows, num_blocks_for_budget
from deepinfer.engine.models import build_model
from deepinfer.engine.preemption import SwapPolicy
from deepinfer.engine.prefix_cache import DevicePrefixCache
from deepinfer.engine.request import (
    FinishReason,
    InvalidRequestError,
    Request,
    RequestOutput,
    SamplingParams,
)
from deepinfer.engine.sampler import Sampler, token_logprobs
from deepinfer.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from deepinfer.engine.speculative import tree
from deepinfer.engine.speculative.speculator import Speculator, build_proposer
from deepinfer.engine.speculative.verify import VerifyGroup, VerifyResult, verify
from deepinfer.engine.structured import StepMasks, StructuredOutput
from deepinfer.kernels.amx import allow_amx
from deepinfer.loading.identity import cache_namespace
from deepinfer.loading.weights import LoadedModel
from deepinfer.text.detokenizer import IncrementalDetokenizer
from deepinfer.text.tokenizer import Tokenizer

log = structlog.get_logger("deepinfer.engine")
_PROMPT_LOGPROB_ROWS = 256  # prompt positions whose log-softmax is taken at once (bounds the extra memory)


@dataclass
class EngineStats:
    """Monotonic counters since the engine started."""

    num_steps: int = 0
    num_preemptions: int = 0
    # Preemptions that swapped the victim's KV to host memory (the rest recompute it), and the blocks copied
    # out and back (preemption.py).
    num_swapped_preemptions: int = 0
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0
    tokens_computed: int = 0  # every token through the model, recomputation after preemption included
    tokens_generated: int = 0
    handoffs_out: int = 0  # prefill-only requests held for export
    handoffs_in: int = 0  # requests added with KV computed elsewhere
    reservations_expired: int = 0
    # Prefix cache: admissions that looked their prompt up, their tokens, and the tokens found cached.
    prefix_lookups: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_waits: int = 0  # admissions put off while a running request computed their next block
    blocks_imported: int = 0  # named blocks copied in from another tier (import_cached_blocks)
    # Speculative decoding: draft tokens verified, and how many of them were accepted.
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    # Expert parallelism: steps that ran a zero-token forward (nothing scheduled on this rank).
    ep_empty_steps: int = 0


class LLMEngine(HandoffMixin, PrefixCacheMixin, ExpertParallelMixin, OutputsMixin, OfflineMixin):
    """One engine (see the module docstring). Implements `ServingEngine` (deepinfer.engine.interface), the
    calls the services make of an engine; tests/unit/test_engine_interface.py checks it. The step loop is
    here; the mixins add the engine's other calls over the same state (each names what it uses)."""

    def __init__(self, loaded: LoadedModel, tokenizer: Tokenizer | None = None,
                 config: EngineConfig | None = None, *, clock: Callable[[], float] = time.monotonic,
                 ep_group: EpGroup | None = None, ep_placement: ExpertPlacement | None = None) -> None:
        """`ep_group`: make this engine one rank of that expert-parallel group (see engine_ep.py),
        holding its share of the experts per `ep_placement` (default: `ExpertPlacement.static`)."""
        self.config = config or EngineConfig()
        if ep_group is not None:
            check_ep_config(self.config, ep_group)
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        allow_amx(self.config.amx)  # process-wide, as the thread count is: the kernels are loaded once per process
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
        self._init_expert_parallel(model, loaded, ep_group, ep_placement)
        self.pool = BlockPool(num_blocks)
        swap_blocks = self.config.swap_space_bytes // self.kv_spec.block_nbytes
        self.swap_policy = SwapPolicy(swap_blocks) if swap_blocks else None
        self.scheduler = Scheduler(
            self.pool, self.config.block_size, self.config.max_num_seqs, self.config.max_num_batched_tokens,
            enable_prefix_caching=self.config.enable_prefix_caching, swap=self.swap_policy,
        )
        self.runner = ModelRunner(model, self.config, self.kv_spec, num_blocks)
        if self.swap_policy is not None:
            self._seed_copy_rate()
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
        self.structured = StructuredOutput(tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        # Output constraints' masks are computed beside the forward only where it leaves a core free.
        threads = self.config.num_threads or torch.get_num_threads()
        self._masks_overlap = not self.config.device.startswith("cpu") or threads < (os.cpu_count() or 1)
        self._generators: dict[str, torch.Generator | None] = {}
        # Per request: the detokenizer and the text it has released so far.
        self._texts: dict[str, tuple[IncrementalDetokenizer, list[str]]] = {}
        self._pending: list[RequestOutput] = []  # terminal outputs of aborted requests
        self._ids = itertools.count()
        self.stats = EngineStats()

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
        constraint = self.structured.constraint_for(params, resumed)
        req = Request(request_id, prompt_ids, params, priority=priority, eos_token_ids=self.eos_token_ids,
                      prefill_only=prefill_only, hasher=self.prefix_cache.new_hasher(cache_salt), tenant=cache_salt)
        req.output_token_ids.extend(resumed)
        req.constraint = constraint
        self._track(req)
        self.scheduler.add(req)
        return request_id

    def _check_id_free(self, request_id: str) -> None:
        # A held request's id stays in use until it is released: export_kv and release address it.
        if request_id in self.scheduler.requests or request_id in self.scheduler.held:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")

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

    # -- the loop ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample and verify, commit: the outputs this step produced (aborted
        requests' terminal ones first). A failed forward fails the step's requests, never the engine."""
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
        if sched.preempted:
            self._log_preemptions(sched)
        self.stats.prefix_lookups += sched.prefix_lookups
        self.stats.prefix_query_tokens += sched.prefix_query_tokens
        self.stats.prefix_hit_tokens += sched.prefix_hit_tokens
        self.stats.prefix_waits += sched.prefix_waits
        try:
            if sched.swap_out or sched.swap_in:
                self._swap(sched)
            if spec is not None:
                spec.draft(sched)
            step_masks = self.structured.start_masks(sched.chunks, self._masks_overlap)
            started = time.perf_counter()
            sampled, logits, prompt_rows = self._forward(sched)
            masks = step_masks()
            # The model returns inference tensors, which the sampler's penalties update in place.
            with torch.inference_mode():
                for part in prompt_rows:
                    self._collect_prompt_logprobs(part)
                results = verify(self.sampler, logits, [self._verify_group(c, masks) for c in sampled])
            elapsed = time.perf_counter() - started
            if spec is not None:
                spec.record_step(sched.num_batched_tokens, elapsed)
            if self.swap_policy is not None:
                self.swap_policy.record_step(sched.num_batched_tokens, elapsed)
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

    def _swap(self, sched: SchedulerOutput) -> None:
        """Carry out the step's swaps (scheduler.py): every copy out before any copy back, all before the forward
        that may overwrite the blocks just freed. Times them for the swap policy's copy rate."""
        kv, started, blocks = self.runner.kv, time.perf_counter(), 0
        for out in sched.swap_out:
            req = out.request
            ids = torch.tensor(out.block_ids, dtype=torch.int64, device=kv.device)
            try:
                req.swapped_kv = self._copy_out(kv, ids)
            except (RuntimeError, MemoryError) as exc:  # no host memory: the victim recomputes instead
                log.warning("swap out failed; the request will recompute", request_id=req.request_id, error=str(exc))
                self.scheduler.drop_swap(req)
                continue
            blocks += len(out.block_ids)
            self.stats.swap_out_blocks += len(out.block_ids)
            self.stats.num_swapped_preemptions += 1
        for back in sched.swap_in:
            copy, back.request.swapped_kv = back.request.swapped_kv, None
            if back.block_ids:
                if copy is None:  # swapped out and back in this same step, and the copy out failed above
                    raise RuntimeError(f"request {back.request.request_id!r}: its swapped-out KV was lost")
                ids = torch.tensor(back.block_ids, dtype=torch.int64, device=kv.device)
                kv.index_copy_(0, ids, copy[back.first_block : back.first_block + len(ids)].to(kv.device))
                blocks += len(ids)
                self.stats.swap_in_blocks += len(ids)
        self.swap_policy.record_copy(blocks, time.perf_counter() - started)

    @staticmethod
    def _copy_out(kv: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Blocks `ids` of `kv`, copied to host memory."""
        return kv.index_select(0, ids).to("cpu")

    def _seed_copy_rate(self) -> None:
        """Time a copy of a few (still unused) blocks out and back, the fastest of three (a descheduled thread must
        not seed the rate), so the first preemption has a copy rate."""
        kv = self.runner.kv
        ids = torch.arange(min(4, kv.shape[0]), dtype=torch.int64, device=kv.device)
        times = []
        for _ in range(3):
            started = time.perf_counter()
            kv.index_copy_(0, ids, self._copy_out(kv, ids).to(kv.device))
            times.append(time.perf_counter() - started)
        self.swap_policy.record_copy(2 * len(ids), min(times))

    def _log_preemptions(self, sched: SchedulerOutput) -> None:
        decisions = sched.preempt_decisions or [None] * len(sched.preempted)
        for req, d in zip(sched.preempted, decisions, strict=True):
            if d is None:
                log.debug("preempted", request_id=req.request_id, priority=req.priority, mode="recompute")
            else:
                log.debug("preempted", request_id=req.request_id, priority=req.priority, mode=d.choice,
                          probe=d.probe, tokens=d.num_tokens, blocks=d.num_blocks,
                          predicted_swap_s=round(d.swap_s, 6), predicted_recompute_s=round(d.recompute_s, 6))

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

    def _verify_group(self, chunk: ScheduledChunk, masks: StepMasks) -> VerifyGroup:
        r = chunk.request
        probs = self.speculator.draft_probs(chunk) if self.speculator is not None else None
        rows, num_masked = masks.get(r.request_id, (None, 0))
        return VerifyGroup(r.params, r.prompt_token_ids, r.output_token_ids, self._generators[r.request_id],
                           chunk.draft_token_ids, probs, rows, num_masked, chunk.draft_parents)

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
        if result.walked:  # a draft tree: the walked nodes' K/V to the chain positions their tokens now hold
            root = chunk.start + 1
            self.runner.move_slots(req.block_ids, [(root + node, root + j) for node, j in tree.moves(result.walked)])
        end = chunk.start + chunk.num_new_tokens
        # KV exists for the step's positions up to the last accepted draft; of those, a position stays
        # only if its token was committed and is not the last one (whose KV the next step computes).
        kept = min(end - (chunk.num_spec - result.num_accepted), req.num_tokens - 1)
        chunk.num_rejected = end - kept
        if chunk.num_spec and self.speculator is not None:
            self.stats.spec_proposed_tokens += chunk.num_spec
            committed_drafts = min(result.num_accepted, len(new_tokens) - 1)
            self.stats.spec_accepted_tokens += committed_drafts
            self.speculator.record(chunk, result.num_accepted, committed_drafts, result.walked)
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

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self.scheduler.finish(req, reason)
        self._generators.pop(req.request_id, None)
        if self.speculator is not None:
            self.speculator.finished(req)
