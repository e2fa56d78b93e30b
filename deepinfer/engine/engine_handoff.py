"""Prefill/decode disaggregation, engine side: `LLMEngine`'s handoff calls (`HandoffMixin`).

The services pick the engines and move the bytes:

    prefill.add_request(rid, ids, params, prefill_only=True)
    ...                                  # a step() output with handoff=True carries the first token
    decode.reserve(rid, num_blocks, lease_s=10.0)      # the decode side accepts the job
    kv = prefill.export_kv(rid)                        # ... sent ...
    prefill.release(rid)
    decode.add_prefilled_request(rid, ids, first_token, params, kv, reservation_id=rid)

The prefill side's step loop holds a prefill-only request's blocks once it has sampled the first token;
here they are exported and released. The decode side sets blocks aside under a lease before the KV
arrives (`reserve`) and then admits the request straight into its running set (`add_prefilled_request`).
The bookkeeping underneath — reservations, block export and import, the KV checks — is `handoff.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import structlog
import torch

from deepinfer.cache.block_pool import NoFreeBlocksError
from deepinfer.engine.handoff import HandoffError, Reservations, blocks_for, check_kv, export_blocks, import_blocks
from deepinfer.engine.request import InvalidRequestError, Logprob, Request, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from deepinfer.cache.block_pool import BlockPool
    from deepinfer.config.engine import EngineConfig
    from deepinfer.config.kv import KvSpec
    from deepinfer.config.model import ModelConfig
    from deepinfer.engine.engine import EngineStats
    from deepinfer.engine.model_runner import ModelRunner
    from deepinfer.engine.prefix_cache import DevicePrefixCache
    from deepinfer.engine.scheduler import Scheduler
    from deepinfer.engine.structured import StructuredOutput

log = structlog.get_logger("deepinfer.engine")


class HandoffMixin:
    """The handoff calls of `LLMEngine` (module docstring). A prefilled request joins the step loop through the
    engine's request bookkeeping (`_check_id_free`, `_validate`, `_track`, `_check_stop`, `_finish`,
    `_output`), exactly as one added with `add_request` would."""

    # The engine's state this part uses, set by `LLMEngine.__init__`.
    config: EngineConfig
    model_config: ModelConfig
    kv_spec: KvSpec
    max_model_len: int
    eos_token_ids: Sequence[int]
    pool: BlockPool
    scheduler: Scheduler
    runner: ModelRunner
    prefix_cache: DevicePrefixCache
    reservations: Reservations
    stats: EngineStats
    structured: StructuredOutput
    _clock: Callable[[], float]
    _pending: list[RequestOutput]

    # -- prefill side -------------------------------------------------------------------------

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

    # -- decode side --------------------------------------------------------------------------

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
        constraint = self.structured.constraint_for(params, resumed)  # the first token is checked as it commits
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
        req.constraint = constraint
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
