"""N-gram (prompt-lookup) guesser: propose what followed the last time this request's tail occurred.

`NgramIndex` indexes one token sequence (prompt, then output) for the lookup:

* the match is the longest suffix of the sequence, of length n in [min_n, max_n], that also occurs
  earlier, ending before the last token; among occurrences of that length the most recent wins, since
  recent text (the answer being written) predicts the next tokens better than the distant prompt;
* the proposal is up to k tokens that followed that occurrence, cut at the end of the sequence (an
  occurrence may overlap the suffix itself: "a b a b a" proposes "b a" after "a b a");
* invariant: `_ends[key]` lists, in increasing order, every end position e (exclusive) with
  `tokens[e - min_n:e] == key`, the sequence's own suffix last. Only the min_n-gram is hashed; a longer
  match is verified by comparing backwards, so `extend` costs O(new tokens × min_n) and a lookup never
  rescans the context;
* a lookup examines only the `max_candidates` most recent occurrences of the key, so a pathological,
  repetitive context (one token a thousand times) stays O(max_candidates × max_n) per step; an older,
  longer match beyond that window is missed, which can only cost acceptance, never correctness.

`NgramProposer` keeps one index per request id. Committed tokens only grow, so each step appends just
the new ones; if a request's tokens are not an extension of what was indexed, the index is rebuilt.
That check is O(1) (length, first, middle and last indexed token), not a full comparison: a proposal
never changes output, verification only accepts tokens the target agrees with, so a missed rewrite
would cost acceptance at worst, and checking 2,000 tokens every step would cost more than the lookup.

With `tree_leaves` > 1 it proposes a tree (tree.py) where the history branches: every occurrence matching as
long a suffix as the best one (of the `max_candidates` most recent) contributes its continuation, the best
occurrence's is the main chain, and each node's share is the fraction of occurrences through it.

Its proposals carry no confidence: one occurrence has no frequency to report, and the controller's
measured acceptance rate for the request is a better estimate than any fixed guess.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice

from deepinfer.engine.speculative import tree
from deepinfer.engine.speculative.base import Proposal, Proposer, SpecContext
from deepinfer.engine.speculative.registry import register_proposer


class NgramIndex:
    """Incremental prompt-lookup index over one growing token sequence; see the module docstring."""

    def __init__(self, min_n: int = 1, max_n: int = 4, max_candidates: int = 64, tokens: Iterable[int] = ()) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n (got min_n={min_n}, max_n={max_n})")
        if max_candidates < 1:
            raise ValueError(f"max_candidates must be positive (got {max_candidates})")
        self.min_n, self.max_n, self.max_candidates = min_n, max_n, max_candidates
        self.tokens: list[int] = []  # read-only for callers
        self._ends: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new_tokens: Iterable[int]) -> None:
        """Append tokens and index the min_n-grams that end at each of them."""
        toks, n, ends = self.tokens, self.min_n, self._ends
        start = len(toks)
        toks.extend(new_tokens)
        for e in range(max(start + 1, n), len(toks) + 1):
            key = tuple(toks[e - n:e])
            lst = ends.get(key)
            if lst is None:
                ends[key] = [e]
            else:
                lst.append(e)

    def sync(self, token_ids: Sequence[int]) -> None:
        """Make the index cover exactly `token_ids`: append what is new, or rebuild when `token_ids` is
        not an extension of the indexed tokens (O(1) check; see the module docstring)."""
        toks = self.tokens
        n = len(toks)
        if n and (len(token_ids) < n or token_ids[n - 1] != toks[n - 1] or token_ids[0] != toks[0]
                  or token_ids[n // 2] != toks[n // 2]):
            self.tokens, self._ends = [], {}
            n = 0
        if len(token_ids) > n:
            self.extend(token_ids[n:])

    def lookup(self, k: int) -> tuple[list[int], int]:
        """Up to k tokens that followed the best earlier occurrence of the sequence's suffix, and the
        length of that match; ([], 0) when there is none (or k <= 0)."""
        toks = self.tokens
        size = len(toks)
        if k <= 0 or size <= self.min_n:
            return [], 0
        ends = self._ends.get(tuple(toks[size - self.min_n:]))
        if ends is None:
            return [], 0
        best_e, best_m = -1, 0
        # The last entry is the suffix itself (e == size): skip it, then newest first.
        for e in islice(reversed(ends), 1, self.max_candidates + 1):
            # To win, an older occurrence must match one token further back than the best so far.
            if best_m and (e <= best_m or toks[e - 1 - best_m] != toks[size - 1 - best_m]):
                continue
            m, limit = self.min_n, min(self.max_n, e)
            while m < limit and toks[e - 1 - m] == toks[size - 1 - m]:
                m += 1
            if m > best_m:
                best_e, best_m = e, m
                if m == self.max_n:
                    break
        if best_e < 0:
            return [], 0
        return toks[best_e:best_e + k], best_m

    def continuations(self, k: int, m: int) -> list[list[int]]:
        """Up to k tokens after each of the `max_candidates` most recent occurrences of the sequence's last m
        tokens (m from `lookup`), newest first: the branches of a tree proposal."""
        toks = self.tokens
        size = len(toks)
        if k <= 0 or m < self.min_n:
            return []
        want = toks[size - m:]
        ends = self._ends.get(tuple(toks[size - self.min_n:]), [])
        return [toks[e:e + k] for e in islice(reversed(ends), 1, self.max_candidates + 1)
                if e >= m and toks[e - m:e] == want]


class NgramProposer(Proposer):
    """Prompt lookup within each request: a cheap proposer with one `NgramIndex` per request id."""

    cheap = True

    def __init__(self, min_n: int = 1, max_n: int = 4, tree_leaves: int = 1) -> None:
        NgramIndex(min_n, max_n)  # validate the arguments now, not on the first request
        self.min_n, self.max_n, self.tree_leaves = min_n, max_n, tree_leaves
        self._indexes: dict[str, NgramIndex] = {}

    def index_for(self, ctx: SpecContext) -> NgramIndex:
        """The request's index, created on first sight and synced to `ctx.token_ids`."""
        index = self._indexes.get(ctx.request_id)
        if index is None:
            index = self._indexes[ctx.request_id] = NgramIndex(self.min_n, self.max_n)
        index.sync(ctx.token_ids)
        return index

    def propose(self, batch: Sequence[SpecContext], ks: Sequence[int]) -> list[Proposal]:
        out = []
        for ctx, k in zip(batch, ks, strict=True):
            out.append(self.propose_one(self.index_for(ctx), k) if k > 0 else Proposal())
        return out

    def propose_one(self, index: NgramIndex, k: int) -> Proposal:
        """The chain, or with `tree_leaves` > 1 the tree, that `index` proposes (empty when there is none)."""
        tokens, m = index.lookup(k)
        if self.tree_leaves < 2 or not tokens:
            return Proposal(token_ids=tokens)
        nodes, parents, shares = tree.build(index.continuations(k, m), k, self.tree_leaves, main=tokens)
        if tree.is_chain(parents):
            return Proposal(token_ids=nodes)
        return Proposal(token_ids=nodes, parents=parents, shares=shares)

    def finished(self, ctx: SpecContext) -> None:
        self._indexes.pop(ctx.request_id, None)

    @property
    def num_tracked(self) -> int:
        """How many requests have an index (for tests and leak checks)."""
        return len(self._indexes)

    def tracked_ids(self) -> set[str]:
        """The request ids that have an index."""
        return set(self._indexes)


register_proposer("ngram", NgramProposer,
                  lambda a: NgramProposer(a.config.ngram_min, a.config.ngram_max, a.spec.tree_leaves))
