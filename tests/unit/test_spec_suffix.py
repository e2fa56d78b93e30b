"""SuffixIndex / SuffixProposer: frequency-majority continuations, threshold cut, tenant isolation,
the memory bound with whole-document eviction, and the rule combining it with prompt lookup."""

from __future__ import annotations

import random

import pytest

from deepinfer.engine.request import SamplingParams
from deepinfer.engine.speculative.base import SpecContext
from deepinfer.engine.speculative.suffix import SuffixIndex, SuffixProposer, expected_accepted

PROMPT = [1, 2, 3, 10, 11, 12]


def ctx(rid: str, tokens: list[int], num_prompt: int | None = None, tenant: str | None = "t") -> SpecContext:
    return SpecContext(rid, tokens, len(tokens) if num_prompt is None else num_prompt, SamplingParams(), tenant)


def three_answers(**kw: object) -> SuffixIndex:
    index = SuffixIndex(**kw)  # type: ignore[arg-type]
    for out in ([20, 21, 22], [20, 21, 23], [20, 24, 25]):
        index.add("t", PROMPT + out, len(PROMPT))
    return index


def test_majority_continuation_with_confidence() -> None:
    index = three_answers(threshold=0.4)
    tokens, conf, m = index.lookup("t", [5, 10, 11, 12], 8)
    # 20: 3/3; 21: 2/3; then 22 vs 23, 1/2 each: the newest answer's 23; then the answers end.
    assert (tokens, m) == ([20, 21, 23], 3)
    assert conf == pytest.approx([1 * 3 / 4, 2 / 3 * 4 / 5, 1 / 2 * 5 / 6])


def test_threshold_cuts_the_continuation() -> None:
    assert three_answers(threshold=0.6).lookup("t", [5, 10, 11, 12], 8)[0] == [20, 21]
    assert three_answers(threshold=0.7).lookup("t", [5, 10, 11, 12], 8)[0] == [20]
    index = SuffixIndex(threshold=0.4)
    for first in (20, 30, 40):
        index.add("t", PROMPT + [first], len(PROMPT))
    assert index.lookup("t", [10, 11, 12], 4) == ([], [], 0)  # 1/3 agree on any first token


def test_k_limits_and_answer_end_cuts() -> None:
    index = three_answers()
    assert index.lookup("t", [10, 11, 12], 1)[0] == [20]
    assert index.lookup("t", [10, 11, 12], 0) == ([], [], 0)
    # Deep in one answer: a single occurrence, proposed to its end.
    tokens, conf, m = index.lookup("t", [11, 12, 20, 24], 5)
    assert (tokens, m) == ([25], 4)
    assert conf == pytest.approx([4 / 5])


def test_longest_match_beats_a_more_frequent_shorter_one() -> None:
    index = SuffixIndex()
    for _ in range(3):
        index.add("t", [7, 10, 11, 12, 40], 4)
    index.add("t", [9, 10, 11, 12, 30], 4)
    for _ in range(3):
        index.add("t", [8, 10, 11, 12, 40], 4)
    assert index.lookup("t", [1, 9, 10, 11, 12], 2)[:1] == ([30],)
    assert index.lookup("t", [1, 6, 10, 11, 12], 2)[0] == [40]


def test_prompt_continuations_are_never_proposed() -> None:
    index = SuffixIndex()
    index.add("t", [1, 2, 3, 4, 5, 6, 7], 6)
    assert index.lookup("t", [1, 2, 3], 3) == ([], [], 0)  # 4 follows in the prompt only
    assert index.lookup("t", [4, 5, 6], 3)[0] == [7]


def test_prompt_tail_bounds_the_stored_context() -> None:
    index = SuffixIndex(prompt_tail=4)
    index.add("t", [1, 2, 3, 4, 5, 6, 7, 8], 6)
    assert index.num_tokens == 6
    assert index.lookup("t", [0, 3, 4, 5, 6], 2)[2] == 4
    assert index.lookup("t", [2, 3, 4, 5, 6], 2)[2] == 4  # 2 was not stored: the match stops there


def test_requests_without_output_are_not_stored() -> None:
    index = SuffixIndex()
    index.add("t", [1, 2, 3], 3)
    assert (index.num_documents, index.num_tokens, index.num_entries()) == (0, 0, 0)


def test_tenants_are_isolated() -> None:
    index = SuffixIndex()
    index.add("a", PROMPT + [20, 21], len(PROMPT))
    index.add(None, PROMPT + [30, 31], len(PROMPT))
    assert index.lookup("a", PROMPT, 4)[0] == [20, 21]
    assert index.lookup(None, PROMPT, 4)[0] == [30, 31]
    assert index.lookup("b", PROMPT, 4) == ([], [], 0)
    assert index.lookup("", PROMPT, 4) == ([], [], 0)

    prop = SuffixProposer(SuffixIndex())
    prop.finished(ctx("r1", PROMPT + [20, 21], len(PROMPT), tenant="a"))
    out = prop.propose([ctx("r2", PROMPT, tenant="a"), ctx("r3", PROMPT, tenant="b"),
                        ctx("r4", PROMPT, tenant=None)], [4, 4, 4])
    assert [p.token_ids for p in out] == [[20, 21], [], []]


def test_memory_bound_evicts_oldest_whole_documents() -> None:
    index = SuffixIndex(max_tokens=40, max_documents=1000, prompt_tail=3)
    for i in range(20):  # each document: 3 prompt-tail tokens + 5 output tokens = 8 tokens
        tenant = "a" if i % 2 else "b"
        index.add(tenant, [100 + i, 200 + i, 300 + i, 1, 2, 3, 4, 5 + i], 3)
        assert index.num_tokens <= 40
    assert (index.num_documents, index.num_tokens) == (5, 40)
    # One entry per output token: ends 3..7 of 8 tokens.
    assert index.num_entries() == 5 * 5
    assert index.lookup("b", [100, 200, 300], 2) == ([], [], 0)  # document 0: evicted
    assert index.lookup("a", [119, 219, 319], 2)[0] == [1, 2]  # document 19: kept
    assert index.lookup("b", [118, 218, 318], 2)[0] == [1, 2]

    index.add("c", list(range(1000, 1100)), 1)  # bigger than the budget: truncated, evicts the rest
    assert (index.num_documents, index.num_tokens) == (1, 40)
    assert index._tables.keys() == {"c"}
    assert index.num_entries() == 40 - 3

    small = SuffixIndex(max_documents=2)
    for i in range(4):
        small.add("t", [i, i, i, 7], 3)
    assert small.num_documents == 2
    assert small.lookup("t", [1, 1, 1], 1)[0] == []
    assert small.lookup("t", [3, 3, 3], 1)[0] == [7]


def test_eviction_with_repeated_keys_and_trimmed_lists() -> None:
    index = SuffixIndex(max_tokens=60, max_candidates=2, min_n=1, max_n=4)
    for i in range(30):
        index.add("t", [9, 9, 9, 9, i], 1)  # key (9,) repeats within and across documents
        assert all(len(lst) <= 4 for lst in index._tables["t"].values())
    while index.num_documents:
        index._evict_oldest()
    assert index._tables == {} and index.num_tokens == 0


def oracle(docs: list[tuple[tuple[int, ...], int]], query: list[int], k: int, min_n: int, max_n: int,
           threshold: float) -> tuple[list[int], int]:
    """The lookup by brute force over (tokens, first output position) documents, oldest first."""
    for m in range(min(max_n, len(query)), min_n - 1, -1):
        occ = [(d, e) for d, first in reversed(docs) for e in range(len(d) - 1, max(first, m) - 1, -1)
               if list(d[e - m:e]) == query[len(query) - m:]]
        if occ:
            break
    else:
        return [], 0
    out: list[int] = []
    while len(out) < k and occ:
        nxt = [d[e + len(out)] for d, e in occ if e + len(out) < len(d)]
        if not nxt:
            break
        best = max(nxt, key=lambda t: (nxt.count(t), -nxt.index(t)))
        if nxt.count(best) / len(occ) < threshold:
            break
        occ = [(d, e) for d, e in occ if e + len(out) < len(d) and d[e + len(out)] == best]
        out.append(best)
    return out, (m if out else 0)


def test_lookup_and_eviction_match_a_brute_force_oracle() -> None:
    rng = random.Random(7)
    for trial in range(40):
        min_n, max_n = rng.randint(1, 3), rng.randint(3, 6)
        tail, budget, threshold = rng.randint(0, 5), rng.randint(10, 80), rng.choice([0.3, 0.5, 0.8])
        index = SuffixIndex(max_tokens=budget, max_documents=rng.randint(1, 8), min_n=min_n, max_n=max_n,
                            threshold=threshold, max_candidates=10_000, prompt_tail=tail)
        live: dict[str | None, list[tuple[tuple[int, ...], int]]] = {}
        for _ in range(25):
            tenant = rng.choice(["a", "b", None])
            prompt = [rng.randrange(4) for _ in range(rng.randint(0, 8))]
            tokens = prompt + [rng.randrange(4) for _ in range(rng.randint(0, 12))]
            index.add(tenant, tokens, len(prompt))
            live = {}
            for ten, toks, first in index._docs.values():
                live.setdefault(ten, []).append((toks, first))
            assert index.num_entries() == sum(len(t) - max(f, min_n) for d in live.values() for t, f in d
                                              if len(t) > max(f, min_n))
            assert index._tables.keys() == live.keys()
            for _ in range(5):
                ten = rng.choice(["a", "b", None])
                query = [rng.randrange(4) for _ in range(rng.randint(0, 8))]
                k = rng.randint(0, 5)
                got, conf, m = index.lookup(ten, query, k)
                want = oracle(live.get(ten, []), query, k, min_n, max_n, threshold) if k else ([], 0)
                assert (got, m) == want, (trial, ten, query, k)
                assert len(conf) == len(got)
        assert index.num_tokens <= budget


def test_expected_accepted() -> None:
    assert expected_accepted([]) == 0
    assert expected_accepted([0.5, 0.5, 1.0]) == pytest.approx(0.5 + 0.25 + 0.25)


def test_proposer_prefers_the_better_scored_proposal() -> None:
    prop = SuffixProposer(SuffixIndex())
    prop.finished(ctx("old", [1, 2, 3, 4, 5], 3))
    # Prompt lookup matches "2 3" (then 8 1); the index matches "1 2 3" (then 4 5): the index wins.
    out = prop.propose([ctx("a", [2, 3, 8, 1, 2, 3])], [2])[0]
    assert out.token_ids == [4, 5] and out.confidence == pytest.approx([3 / 4, 4 / 5])
    # Both match "1 2 3" once, equally long: a tie goes to the request's own text.
    out = prop.propose([ctx("b", [1, 2, 3, 9, 1, 2, 3])], [2])[0]
    assert out.token_ids == [9, 1] and out.confidence is None
    # A longer local proposal scores more.
    assert prop.propose([ctx("b", [1, 2, 3, 9, 1, 2, 3])], [4])[0].token_ids == [9, 1, 2, 3]
    # Nothing local: the index alone.
    assert prop.propose([ctx("c", [6, 1, 2, 3])], [4])[0].token_ids == [4, 5]


def test_proposer_finished_learns_and_drops_state() -> None:
    prop = SuffixProposer(SuffixIndex())
    tokens = [1, 2, 3]
    assert prop.propose([ctx("a", tokens)], [4])[0].token_ids == []
    assert prop.num_tracked == 1
    tokens += [7, 8]
    prop.finished(ctx("a", tokens, 3))
    assert prop.num_tracked == 0 and prop.index.num_documents == 1
    prop.finished(ctx("empty", [1, 2, 3], 3))  # no output: not stored
    assert prop.num_tracked == 0 and prop.index.num_documents == 1
    assert prop.propose([ctx("b", [0, 1, 2, 3])], [4])[0].token_ids == [7, 8]


def test_proposer_learns_which_source_serves_a_request() -> None:
    """The index proposes an earlier answer's continuation, the request's own text another; while the index's
    proposals keep failing for this request (and only for it), its own text wins, and the reverse."""
    prop = SuffixProposer(SuffixIndex())
    prop.finished(ctx("old", [1, 2, 3, 4, 5, 6, 7], 3))  # an earlier answer: 1 2 3 -> 4 5 6 7
    tokens = [2, 3, 8, 1, 2, 3]  # prompt lookup: "2 3" -> 8 1 2 3; the index: "1 2 3" -> 4 5 6 7
    assert prop.propose([ctx("a", tokens)], [4])[0].token_ids == [4, 5, 6, 7]
    for _ in range(3):  # the index's proposals are rejected at once
        prop.observe("a", 4, 0)
    assert prop.propose([ctx("a", tokens)], [4])[0].token_ids == [8, 1, 2, 3]
    # Another request is not affected, and the local source failing in turn brings the index back.
    assert prop.propose([ctx("b", tokens)], [4])[0].token_ids == [4, 5, 6, 7]
    for _ in range(12):
        prop.observe("a", 4, 0)
    assert prop.propose([ctx("a", tokens)], [4])[0].token_ids == [4, 5, 6, 7]
    # Observations of unknown requests or empty steps are ignored; finishing drops the request's state.
    prop.observe("nobody", 4, 0)
    prop.observe("a", 0, 0)
    assert prop.num_tracked == 2
    for rid in ("a", "b"):
        prop.finished(ctx(rid, tokens, len(tokens)))
    assert prop.num_tracked == 0


def test_proposer_k_zero_gives_empty_proposals() -> None:
    prop = SuffixProposer(SuffixIndex())
    prop.finished(ctx("a", [1, 2, 3, 7, 8], 3))
    out = prop.propose([ctx("b", [1, 2, 3]), ctx("c", [1, 2, 3, 1])], [0, 0])
    assert [p.token_ids for p in out] == [[], []]
    assert prop.num_tracked == 0


def test_arguments_are_validated() -> None:
    for kw in ({"min_n": 0}, {"min_n": 5, "max_n": 4}, {"max_tokens": 0}, {"threshold": 0.0},
               {"threshold": 1.5}, {"max_candidates": 0}, {"prompt_tail": -1}):
        with pytest.raises(ValueError):
            SuffixIndex(**kw)  # type: ignore[arg-type]
