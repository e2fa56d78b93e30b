"""One request's position in its grammar: which tokens may come next, advanced token by token.

Migration contract: a constraint's whole state is (its spec, the output token ids it accepted). Another worker
rebuilds it as `Constraint(cache.compile(spec)).replay(output_ids)`; the rebuilt constraint allows exactly the
tokens the original would (llguidance is deterministic in its grammar and token sequence), so nothing but the
spec and the ids the request already carries has to travel.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import llguidance
import torch

from deepinfer.grammar.compile import CompiledGrammar
from deepinfer.grammar.spec import ConstraintSpec, GrammarError


class Constraint:
    """The grammar state of one request's output.

    Invariants: `tokens` are exactly the ids accepted and not rolled back, in order, and the state is the start
    state advanced by them; a refused token changes nothing (`accept` returns False, the constraint stays usable).
    An EOS id is accepted exactly when the output so far is complete, ends the output (nothing is allowed after
    it), and counts as one token for `rollback`. Not thread-safe: one thread at a time (the step loop, or a mask
    worker it hands the constraint to).
    """

    __slots__ = ("compiled", "_matcher", "_tokens", "_ended")

    def __init__(self, compiled: CompiledGrammar) -> None:
        self.compiled = compiled
        self._matcher = compiled.new_matcher()
        self._tokens: list[int] = []
        # EOS is kept out of llguidance: its matcher takes EOS in some states and not others (try_consume_tokens
        # refuses it once the grammar cannot extend, consume_token takes it), and rolling one back is ambiguous.
        self._ended = False

    @property
    def spec(self) -> ConstraintSpec:
        return self.compiled.spec

    @property
    def tokens(self) -> tuple[int, ...]:
        """The accepted output ids: with the spec, everything needed to rebuild this state (`replay`)."""
        return tuple(self._tokens)

    @property
    def is_finished(self) -> bool:
        """True when nothing but EOS can follow (the output is a complete match that cannot be extended), or EOS
        was accepted. A grammar that may end but may also go on, like `[a-z]+`, is not finished: see
        `is_accepting`."""
        return self._ended or self._matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """True when the output so far is a complete match, so EOS is allowed now."""
        return not self._ended and self._matcher.is_accepting()

    def allowed_mask(self, out: torch.Tensor) -> None:
        """Write the next token's bitmask into `out`: a contiguous CPU int32 row of `vocab.mask_words` words, bit
        i of word w set when token 32 * w + i is allowed (llguidance's `fill_next_token_bitmask` layout). Ids past
        the tokenizer's vocabulary are never allowed; the EOS ids are allowed exactly when `is_accepting`; after
        EOS no bit is set. Releases the GIL while it computes."""
        words = self.compiled.vocab.mask_words
        if out.dtype != torch.int32 or out.device.type != "cpu" or not out.is_contiguous() or out.numel() != words:
            raise ValueError(f"a mask row is a contiguous CPU int32 tensor of {words} words, got "
                             f"{out.dtype} {tuple(out.shape)} on {out.device}")
        if self._ended:
            out.zero_()
        else:
            self._matcher.unsafe_compute_mask_ptr(out.data_ptr(), words * 4)

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (and no change) when the grammar forbids it here."""
        return self.accept_many((token_id,)) == 1

    def accept_many(self, token_ids: Sequence[int]) -> int:
        """Advance by the longest allowed prefix of `token_ids` and return its length: for a speculative draft,
        the draft ends at the first token the grammar forbids (or just after an EOS). Undo the ones verification
        rejects with `rollback`."""
        if self._ended:
            return 0
        vocab = self.compiled.vocab
        ids: list[int] = []
        for t in token_ids:
            if t in vocab.eos_token_ids or not 0 <= t < vocab.n_vocab:
                break
            ids.append(t)
        n = self._matcher.try_consume_tokens(ids) if ids else 0
        self._tokens.extend(ids[:n])
        if n == len(ids) and n < len(token_ids) and token_ids[n] in vocab.eos_token_ids \
                and self._matcher.is_accepting():
            self._ended = True
            self._tokens.append(token_ids[n])
            n += 1
        return n

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens (speculative tokens verification rejected). Raises ValueError for
        more than were accepted (llguidance would otherwise enter its error state for good)."""
        if not 0 <= n <= len(self._tokens):
            raise ValueError(f"cannot roll back {n} tokens: {len(self._tokens)} accepted")
        if n == 0:
            return
        in_matcher = n - 1 if self._ended else n
        if in_matcher and not self._matcher.rollback(in_matcher):
            raise RuntimeError(f"llguidance refused to roll back {in_matcher} tokens: "
                               f"{self._matcher.get_error()[:200]}")
        self._ended = False
        del self._tokens[-n:]

    def replay(self, token_ids: Sequence[int]) -> Constraint:
        """Accept all of `token_ids` (a migrated request's output so far) and return self. Raises GrammarError,
        with the state unchanged, when any of them is not allowed: the ids did not come from this spec."""
        ids = list(token_ids)
        n = self.accept_many(ids)
        if n != len(ids):
            self.rollback(n)
            raise GrammarError(f"output token {ids[n]} at position {len(self._tokens) + n} violates the constraint")
        return self

    def draft_masks(self, draft: Sequence[int], out: torch.Tensor) -> int:
        """Masks for verifying a speculative draft: row 0 of `out` gets the mask before draft[0], row i + 1 the
        mask after draft[i], for each draft token the grammar allows in order. Returns how many it allows (k);
        rows past k + 1 are not written. The state is unchanged afterwards."""
        if out.dim() != 2 or out.shape[0] < len(draft) + 1:
            raise ValueError(f"need {len(draft) + 1} mask rows, got a tensor of shape {tuple(out.shape)}")
        accepted = 0
        self.allowed_mask(out[0])
        for t in draft:
            if not self.accept(t):
                break
            accepted += 1
            self.allowed_mask(out[accepted])
        self.rollback(accepted)
        return accepted


_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()


def fill_bitmask_rows(rows: Sequence[tuple[Constraint, int]], bitmask: torch.Tensor) -> None:
    """For each (constraint, row): write the constraint's next mask into `bitmask[row]`, the rows in parallel on
    llguidance's own thread pool (GIL released). `bitmask` is a contiguous CPU int32 [batch, mask_words] tensor;
    rows not named are not written. All constraints must share one vocabulary."""
    if not rows:
        return
    words = rows[0][0].compiled.vocab.mask_words
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous() \
            or bitmask.dim() != 2 or bitmask.shape[1] != words:
        raise ValueError(f"the bitmask is a contiguous CPU int32 [batch, {words}] tensor, got "
                         f"{bitmask.dtype} {tuple(bitmask.shape)}")
    for c, r in rows:
        if c.compiled.vocab.mask_words != words or not 0 <= r < bitmask.shape[0]:
            raise ValueError(f"row {r}: another vocabulary, or outside the {bitmask.shape[0]} rows")
    live = [(c, r) for c, r in rows if not c._ended]
    for c, r in rows:
        if c._ended:
            bitmask[r].zero_()
    if len(live) <= 1:
        for c, r in live:
            c.allowed_mask(bitmask[r])
        return
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = llguidance.LLExecutor()
        executor = _executor
    executor.unsafe_compute_mask_ptr([(c._matcher, r) for c, r in live], bitmask.data_ptr(), words * 4,
                                     bitmask.shape[0])
