"""Structured output in the engine: each constrained request's grammar state, the masks of its rows in a step,
and what each committed token does to it. The grammar itself is deepinfer.grammar's (llguidance).

* A request whose `SamplingParams.constraint` is set gets a `Constraint` when it is added (`constraint_for`): compiled
  from the engine's `GrammarCache` (bounded in entries and compile time; a worker compiles ahead, off its step
  loop, with `compile_ahead`) and advanced over any output it already has (a resumed or handed-off request:
  the state is the spec plus the output ids, so nothing else travels). A constraint that cannot compile, or
  output it does not allow, is an InvalidRequestError naming the reason, and the request is not added.
* Each step, the constrained chunks that sample get their bitmask rows (`start_masks`), computed on a thread of
  their own while the forward runs where it leaves a core free (llguidance releases the GIL), else after it:
  row 0 for the next token and, for a
  speculating chunk, one per draft the constraint allows, in order. The sampler applies a row's mask after
  bias and penalties; a draft the constraint forbids is therefore never accepted, and greedy output with
  speculation equals output without it.
* Every committed token advances the constraint (`after_token`); the request stops when nothing but the end
  can follow, or when it accepted EOS (also with `ignore_eos`: past the end of a match nothing is allowed).
  A token the constraint refuses cannot be sampled; if one is ever committed the request ends with an error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from deepinfer.engine.request import FinishReason, InvalidRequestError, Request, SamplingParams
from deepinfer.engine.scheduler import ScheduledChunk
from deepinfer.grammar import (
    CompiledGrammar,
    Constraint,
    ConstraintSpec,
    GrammarCache,
    GrammarError,
    fill_bitmask_rows,
    grammar_vocab,
    new_bitmask,
)
from deepinfer.text.tokenizer import Tokenizer

# Per constrained request that samples this step: its bitmask rows and how many of them are written.
StepMasks = dict[str, tuple[torch.Tensor, int]]


class StructuredOutput:
    """The engine's output constraints (module docstring). The compile cache is built on first use: the
    vocabulary costs about a second, which an engine that never sees a constraint does not pay."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = tuple(eos_token_ids)
        self._cache: GrammarCache | None = None
        self._masker: ThreadPoolExecutor | None = None

    @property
    def cache(self) -> GrammarCache:
        if self._cache is None:
            if self._tokenizer is None:
                raise InvalidRequestError("structured output needs the model's tokenizer (this engine has none)")
            vocab = grammar_vocab(self._tokenizer, n_vocab=self._vocab_size, eos_token_ids=self._eos)
            self._cache = GrammarCache(vocab)
        return self._cache

    def compile_ahead(self, spec: ConstraintSpec) -> Future[CompiledGrammar]:
        """Compile `spec` into the cache on the cache's own threads; the future fails with GrammarError."""
        return self.cache.submit(spec)

    def constraint_for(self, params: SamplingParams, output_ids: Sequence[int] = ()) -> Constraint | None:
        """The constraint of a request with `params`, advanced over `output_ids` (what it generated before coming
        here); None when it has none. Call it before taking any resource for the request: it may raise."""
        spec = params.constraint
        if spec is None:
            return None
        try:
            return Constraint(self.cache.compile(spec)).replay(output_ids)
        except GrammarError as exc:
            raise InvalidRequestError(f"invalid constraint ({spec.kind}): {exc.reason}") from None

    def start_masks(self, chunks: Sequence[ScheduledChunk], overlap: bool) -> Callable[[], StepMasks]:
        """What gives the bitmask rows of the chunks that sample and are constrained, called after the forward:
        with `overlap` (the forward leaves a core free: a GPU's, or CPU threads fewer than the cores) they are
        computed meanwhile on the mask thread, else when it is called (on a CPU forward that uses every core, a
        thread beside it slows it down more than the masks cost: 2-core measurement, bench/results)."""
        work = [c for c in chunks if c.samples and c.request.constraint is not None]
        if not work:
            return dict
        if not overlap:
            return lambda: self._masks(work, parallel=False)
        if self._masker is None:
            self._masker = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._masker.submit(self._masks, work, True).result

    def _masks(self, chunks: list[ScheduledChunk], parallel: bool) -> StepMasks:
        out: StepMasks = {}
        plain = [c for c in chunks if not c.draft_token_ids]
        if plain:  # one row each, in parallel on llguidance's own threads when cores are free for them
            rows = new_bitmask(len(plain), self._vocab_size)
            pairs = [(c.request.constraint, i) for i, c in enumerate(plain)]
            if parallel:
                fill_bitmask_rows(pairs, rows)  # type: ignore[arg-type]
            else:
                for constraint, i in pairs:
                    constraint.allowed_mask(rows[i])  # type: ignore[union-attr]
            for i, c in enumerate(plain):
                out[c.request.request_id] = (rows[i : i + 1], 1)
        for c in chunks:
            if c.draft_token_ids:
                rows = new_bitmask(len(c.draft_token_ids) + 1, self._vocab_size)
                allowed = c.request.constraint.draft_masks(c.draft_token_ids, rows)  # type: ignore[union-attr]
                out[c.request.request_id] = (rows, allowed + 1)
        return out

    def after_token(self, req: Request, token: int) -> FinishReason | None:
        """Advance `req`'s constraint by a committed token: STOP when the output is now complete, ERROR (with
        `req.error`) when the constraint refuses it, else None."""
        constraint = req.constraint
        if constraint is None:
            return None
        if not constraint.accept(token):
            req.error = f"token {token} at output position {len(req.output_token_ids) - 1} violates the constraint"
            return FinishReason.ERROR
        return FinishReason.STOP if constraint.is_finished else None

    def close(self) -> None:
        if self._masker is not None:
            self._masker.shutdown(wait=False)

