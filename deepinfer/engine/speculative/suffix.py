"""Suffix guesser: propose what earlier requests of the same tenant wrote after the same context.

Agents, templated tasks and retries repeat whole answers (the idea of SuffixDecoding, Snowflake's
ArcticInference). `SuffixIndex` remembers the token sequences of finished requests; `SuffixProposer`
combines it with prompt lookup within the request (`ngram.NgramIndex`).

What is stored: each finished request's output tokens, preceded by the last `prompt_tail` (default
max_n) tokens of its prompt. Only positions whose continuation is an output token are indexed, so
nothing is ever proposed from a prompt, but the tail lets a new request match at the very start of its
answer: a retry of the same question matches its whole tail, a templated one at least the chat
template's "assistant" header. Prompts themselves are not stored: they are mostly unique text that would
eat the budget, and the request's own prompt is covered by prompt lookup.

Lookup for a context: the longest suffix of its tokens (up to max_n, at least min_n) that occurs in the
tenant's stored sequences; among those occurrences the continuation is built greedily: at each depth the
next token most occurrences agree on (ties: the most recent occurrence's), keeping only the agreeing
ones, stopping at k tokens, when none is left, or when the agreeing fraction (an occurrence that ran
out of tokens disagrees) falls below `threshold`. Each token's confidence is its fraction times
L/(L+1), L being the match length it extends (max_n + depth at most): one short match is weak evidence.

Invariants and bounds:
* tenants never mix: each tenant (None is one too) has its own key table, entries point only at that
  tenant's documents, and lookups read only the caller's table;
* a table maps hash(min_n-gram) to packed (document seq << 32 | end position) entries in insertion
  order, which is seq order; a longer match, and the min_n-gram itself (hash collisions), is verified
  by comparing tokens backwards, so memory is one entry per stored output token, not one per n;
* memory is bounded by `max_tokens` stored tokens and `max_documents` documents across tenants; the
  oldest whole document is evicted first. Its entries are at the front of their lists (insertion order),
  so eviction costs O(its tokens). Lists are also trimmed to the `max_candidates` newest entries once
  they double that, as a lookup never examines more: a hot key costs bounded time and memory.
Costs: add O(tokens × min_n); lookup O(max_candidates × max_n + k × occurrences), a few microseconds
when the tail is unknown. Documents are 4-byte arrays; with the index, about 170 bytes of host memory per
stored token when every min_n-gram is distinct (1M random tokens: 163 MiB), less for repetitive text.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from itertools import islice

from deepinfer.engine.speculative import tree
from deepinfer.engine.speculative.base import Proposal, Proposer, SpecContext
from deepinfer.engine.speculative.ngram import NgramProposer
from deepinfer.engine.speculative.registry import register_proposer

_POS_BITS = 32
_POS_MASK = (1 << _POS_BITS) - 1


class SuffixIndex:
    """Bounded, per-tenant index over finished requests' outputs; see the module docstring."""

    def __init__(self, max_tokens: int = 1_000_000, max_documents: int = 100_000, min_n: int = 3, max_n: int = 12,
                 threshold: float = 0.4, max_candidates: int = 32, prompt_tail: int | None = None) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n (got min_n={min_n}, max_n={max_n})")
        if max_tokens < 1 or max_documents < 1 or max_candidates < 1:
            raise ValueError("max_tokens, max_documents and max_candidates must be positive")
        if prompt_tail is not None and prompt_tail < 0:
            raise ValueError(f"prompt_tail must not be negative (got {prompt_tail})")
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1] (got {threshold})")
        self.max_tokens, self.max_documents, self.max_candidates = max_tokens, max_documents, max_candidates
        self.min_n, self.max_n, self.threshold = min_n, max_n, threshold
        self.prompt_tail = max_n if prompt_tail is None else prompt_tail
        # seq -> (tenant, tokens, first indexed end position); ordered oldest first.
        self._docs: OrderedDict[int, tuple[str | None, array[int], int]] = OrderedDict()
        self._tokens: dict[int, array[int]] = {}  # seq -> tokens: the lookup's hot path
        self._tables: dict[str | None, dict[int, list[int]]] = {}
        self._next_seq = 0
        self.num_tokens = 0

    @property
    def num_documents(self) -> int:
        return len(self._docs)

    def num_entries(self) -> int:
        """Index entries across tenants (O(keys): for tests and metrics)."""
        return sum(len(lst) for table in self._tables.values() for lst in table.values())

    def add(self, tenant: str | None, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """Store a finished request's output (with its prompt tail) for its tenant; no output, no-op."""
        if len(token_ids) <= num_prompt_tokens:
            return
        start = max(0, num_prompt_tokens - self.prompt_tail)
        toks = array("i", token_ids[start:start + self.max_tokens])  # one huge answer cannot exceed the budget
        first = num_prompt_tokens - start
        if max(first, self.min_n) >= len(toks):  # no position to index: it could never be proposed from
            return
        seq = self._next_seq
        self._next_seq += 1
        table = self._tables.setdefault(tenant, {})
        n, cap, packed = self.min_n, self.max_candidates, seq << _POS_BITS
        for e in range(max(first, n), len(toks)):  # e < len(toks): a continuation exists
            key = hash(tuple(toks[e - n:e]))
            lst = table.get(key)
            if lst is None:
                table[key] = [packed | e]
            else:
                lst.append(packed | e)
                if len(lst) > 2 * cap:
                    del lst[:len(lst) - cap]
        self._docs[seq] = (tenant, toks, first)
        self._tokens[seq] = toks
        self.num_tokens += len(toks)
        while self.num_tokens > self.max_tokens or len(self._docs) > self.max_documents:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        seq, (tenant, toks, first) = self._docs.popitem(last=False)
        del self._tokens[seq]
        self.num_tokens -= len(toks)
        table = self._tables.get(tenant)
        if table is None:  # cannot happen while every stored document keeps an entry; stay safe
            return
        n = self.min_n
        for e in range(max(first, n), len(toks)):
            key = hash(tuple(toks[e - n:e]))
            lst = table.get(key)
            if lst is None:  # a repeated key of this document, already emptied
                continue
            i = 0
            while i < len(lst) and lst[i] >> _POS_BITS == seq:
                i += 1
            if i == len(lst):
                del table[key]
            elif i:
                del lst[:i]
        if not table:
            del self._tables[tenant]

    def _match(self, tenant: str | None, token_ids: Sequence[int]) -> tuple[int, list[tuple[array[int], int]]]:
        """(best match length, its occurrences as (document, end), newest first); (0, []) when none."""
        table = self._tables.get(tenant)
        if table is None or len(token_ids) < self.min_n:
            return 0, []
        tail = array("i", token_ids[-self.max_n:])
        t, n = len(tail), self.min_n
        lst = table.get(hash(tuple(tail[t - n:])))
        if lst is None:
            return 0, []
        docs = self._tokens
        # Only occurrences matching at least best_m tokens matter: one slice comparison (in C) rejects
        # the others, and checks the hashed min_n-gram too (a collision is not a match).
        best_m, want, occ = n - 1, tail[t - n + 1:], []
        for p in islice(reversed(lst), self.max_candidates):  # newest first
            doc, e = docs[p >> _POS_BITS], p & _POS_MASK
            if e < best_m or doc[e - best_m:e] != want:
                continue
            m, limit = best_m, min(t, e)
            while m < limit and doc[e - 1 - m] == tail[t - 1 - m]:
                m += 1
            if m > best_m:
                best_m, want, occ = m, tail[t - m:], [(doc, e)]
            elif occ:  # m == best_m >= n
                occ.append((doc, e))
        return best_m, occ

    def continuations(self, tenant: str | None, token_ids: Sequence[int], k: int) -> list[list[int]]:
        """Up to k tokens after each occurrence `lookup` would build on, newest first: a tree's branches."""
        if k <= 0:
            return []
        return [list(doc[e:e + k]) for doc, e in self._match(tenant, token_ids)[1]]

    def lookup(self, tenant: str | None, token_ids: Sequence[int], k: int) -> tuple[list[int], list[float], int]:
        """(tokens, per-token confidence, match length) continuing `token_ids` from the tenant's stored
        sequences; ([], [], 0) when there is nothing to propose."""
        if k <= 0:
            return [], [], 0
        best_m, occ = self._match(tenant, token_ids)
        tokens: list[int] = []
        conf: list[float] = []
        depth = 0
        while depth < k and occ:
            if len(occ) == 1:  # one occurrence left: it agrees with itself to its end
                doc, e = occ[0]
                for tok in doc[e + depth:e + k]:
                    tokens.append(tok)
                    conf.append((best_m + depth) / (best_m + depth + 1))
                    depth += 1
                break
            counts: dict[int, int] = {}
            for doc, e in occ:
                if e + depth < len(doc):
                    tok = doc[e + depth]
                    counts[tok] = counts.get(tok, 0) + 1
            if not counts:
                break
            tok = max(counts, key=counts.__getitem__)  # first maximum: the newest occurrence's token
            frac = counts[tok] / len(occ)
            if frac < self.threshold:
                break
            tokens.append(tok)
            conf.append(frac * (best_m + depth) / (best_m + depth + 1))
            occ = [(doc, e) for doc, e in occ if e + depth < len(doc) and doc[e + depth] == tok]
            depth += 1
        return (tokens, conf, best_m) if tokens else ([], [], 0)


def expected_accepted(confidence: Sequence[float]) -> float:
    """Expected number of accepted tokens when confidence[i] is token i's acceptance probability given
    that the ones before it were accepted: sum over i of the product of confidence[:i + 1]."""
    total, p = 0.0, 1.0
    for c in confidence:
        p *= c
        total += p
    return total


SOURCE_PRIOR, SOURCE_PRIOR_WEIGHT, SOURCE_DECAY = 0.5, 2.0, 0.9


def _discounted(scores: Sequence[float], alpha: float) -> float:
    """Expected accepted length of a source's proposal, its scores scaled down while the source's measured
    acceptance for the request is below the prior (the rule of SuffixProposer's docstring)."""
    f = min(1.0, alpha / SOURCE_PRIOR)
    return expected_accepted([f * s for s in scores])


class SuffixProposer(Proposer):
    """Prompt lookup within the request plus the cross-request `SuffixIndex`; a cheap proposer.

    Rule: each candidate is scored by its expected accepted length (`expected_accepted`) under per-token
    probabilities p_i = f * s_i, where s_i is the suffix index's confidence, or for a prompt-lookup proposal
    (one occurrence) (L + i)/(L + i + 1) as a single suffix match of length L would get; and f = min(1,
    alpha / SOURCE_PRIOR), alpha being the request's measured per-token acceptance of that source's
    proposals (discounted counts over its verified steps, as the controller keeps them, starting at
    SOURCE_PRIOR with SOURCE_PRIOR_WEIGHT pseudo-trials; reported through `observe`). So a longer or
    better-supported proposal wins, but a source whose proposals keep failing for this request (earlier
    answers to other documents, while this one quotes its own prompt) loses to the other; a source doing
    well is not boosted. A tie goes to the request's own text. The winner keeps its confidence; a
    prompt-lookup proposal reports none (see `ngram`). Measured (bench_spec, c = 1, suffix): summaries
    1.12x -> 1.53x, agentic repeats unchanged (2.41 tokens a step either way).

    With `tree_leaves` > 1 the winner comes as a tree (tree.py): prompt lookup's as `NgramProposer` builds it, the
    index's from every occurrence it matched, around its majority chain."""

    cheap = True

    def __init__(self, index: SuffixIndex | None = None, ngram_min_n: int = 1, ngram_max_n: int = 4,
                 tree_leaves: int = 1) -> None:
        self.index = SuffixIndex() if index is None else index
        self.tree_leaves = tree_leaves
        self._local = NgramProposer(ngram_min_n, ngram_max_n, tree_leaves)
        # request id -> [local successes, local trials, cross successes, cross trials]; and which source
        # the request's last non-empty proposal came from (0 local, 2 cross: the offset in that list).
        self._stats: dict[str, list[float]] = {}
        self._last: dict[str, int] = {}

    def _alpha(self, request_id: str, source: int) -> float:
        st = self._stats.get(request_id)
        return SOURCE_PRIOR if st is None else st[source] / st[source + 1]

    def propose(self, batch: Sequence[SpecContext], ks: Sequence[int]) -> list[Proposal]:
        out = []
        for ctx, k in zip(batch, ks, strict=True):
            if k <= 0:
                out.append(Proposal())
                continue
            rid = ctx.request_id
            index = self._local.index_for(ctx)
            local, m = index.lookup(k)
            cross, conf, cross_m = self.index.lookup(ctx.tenant, ctx.token_ids, k)
            a_local, a_cross = self._alpha(rid, 0), self._alpha(rid, 2)
            local_score = _discounted([(m + i) / (m + i + 1) for i in range(len(local))], a_local)
            if cross and _discounted(conf, a_cross) > local_score:
                out.append(self._cross_tree(ctx, k, cross, conf, cross_m) if self.tree_leaves > 1
                           else Proposal(token_ids=cross, confidence=conf))
                self._last[rid] = 2
            else:
                out.append(self._local.propose_one(index, k))
                if local:
                    self._last[rid] = 0
        return out

    def _cross_tree(self, ctx: SpecContext, k: int, chain: list[int], conf: list[float], m: int) -> Proposal:
        """The index's tree around its chain proposal: the chain's nodes keep its confidences; a branch node's is
        its share shaded by its match length, as `SuffixIndex.lookup` scores a token."""
        branches = self.index.continuations(ctx.tenant, ctx.token_ids, k)
        nodes, parents, shares = tree.build(branches, k, self.tree_leaves, main=chain)
        if tree.is_chain(parents):
            return Proposal(token_ids=chain, confidence=conf)
        confidence = [s * (m + d - 1) / (m + d) for s, d in zip(shares, tree.depths(parents))]
        for j, node in enumerate(tree.main_chain(parents)):
            confidence[node] = conf[j]
        return Proposal(token_ids=nodes, confidence=confidence, parents=parents, shares=shares)

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:
        source = self._last.get(request_id)
        if source is None or proposed <= 0:
            return
        st = self._stats.get(request_id)
        if st is None:
            w = SOURCE_PRIOR_WEIGHT
            st = self._stats[request_id] = [SOURCE_PRIOR * w, w, SOURCE_PRIOR * w, w]
        accepted = min(max(accepted, 0), proposed)
        st[source] = SOURCE_DECAY * st[source] + accepted
        st[source + 1] = SOURCE_DECAY * st[source + 1] + accepted + (accepted < proposed)

    def finished(self, ctx: SpecContext) -> None:
        self._local.finished(ctx)
        self._stats.pop(ctx.request_id, None)
        self._last.pop(ctx.request_id, None)
        self.index.add(ctx.tenant, ctx.token_ids, ctx.num_prompt_tokens)

    @property
    def num_tracked(self) -> int:
        """How many requests have per-request state (for tests and leak checks)."""
        return len(self._local.tracked_ids() | self._stats.keys() | self._last.keys())


register_proposer("suffix", SuffixProposer,
                  lambda a: SuffixProposer(ngram_min_n=a.config.ngram_min, ngram_max_n=a.config.ngram_max,
                                           tree_leaves=a.spec.tree_leaves))
