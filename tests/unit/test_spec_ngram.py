"""NgramIndex / NgramProposer: exact prompt-lookup proposals on hand-built sequences, incremental
indexing equal to a from-scratch build, rebuild on non-extension, per-request state."""

from __future__ import annotations

import random

import pytest

from deepinfer.engine.request import SamplingParams
from deepinfer.engine.speculative.base import SpecContext
from deepinfer.engine.speculative.ngram import NgramIndex, NgramProposer


def ctx(rid: str, tokens: list[int], num_prompt: int | None = None) -> SpecContext:
    return SpecContext(rid, tokens, len(tokens) if num_prompt is None else num_prompt, SamplingParams())


def test_longest_match_beats_a_more_recent_shorter_one() -> None:
    # "1 2 3" occurred first (then 9); only "2 3" occurred more recently (then 7).
    index = NgramIndex(1, 4, tokens=[1, 2, 3, 9, 5, 2, 3, 7, 8, 1, 2, 3])
    assert index.lookup(2) == ([9, 5], 3)


def test_most_recent_occurrence_among_equal_lengths() -> None:
    index = NgramIndex(2, 2, tokens=[1, 2, 5, 1, 2, 6, 1, 2])
    assert index.lookup(3) == ([6, 1, 2], 2)


def test_proposal_is_cut_at_the_end_of_the_sequence() -> None:
    assert NgramIndex(1, 4, tokens=[1, 2, 3, 1, 2]).lookup(5) == ([3, 1, 2], 2)


def test_an_occurrence_may_overlap_the_suffix() -> None:
    assert NgramIndex(1, 4, tokens=[1, 2, 1, 2, 1]).lookup(2) == ([2, 1], 3)


def test_min_n_is_respected() -> None:
    tokens = [1, 5, 7, 1]
    assert NgramIndex(1, 4, tokens=tokens).lookup(3) == ([5, 7, 1], 1)
    assert NgramIndex(2, 4, tokens=tokens).lookup(3) == ([], 0)


def test_max_n_caps_the_match_so_recency_decides() -> None:
    tokens = [1, 2, 3, 9, 2, 3, 8, 1, 2, 3]
    assert NgramIndex(1, 2, tokens=tokens).lookup(1) == ([8], 2)
    assert NgramIndex(1, 3, tokens=tokens).lookup(1) == ([9], 3)


def test_no_match_and_trivial_cases() -> None:
    assert NgramIndex(1, 4, tokens=[1, 2, 3, 4]).lookup(4) == ([], 0)
    assert NgramIndex(1, 4, tokens=[]).lookup(4) == ([], 0)
    assert NgramIndex(1, 4, tokens=[7]).lookup(4) == ([], 0)
    assert NgramIndex(1, 4, tokens=[1, 2, 1]).lookup(0) == ([], 0)


def test_repetitive_input_is_bounded_and_right() -> None:
    # The most recent full-length occurrence ends one token before the end: one token follows it.
    index = NgramIndex(1, 4, tokens=[7] * 20_000)
    assert index.lookup(5) == ([7], 4)
    index.extend([1, 2] * 5_000)
    assert index.lookup(5) == ([1, 2], 4)


def test_candidate_scan_is_bounded() -> None:
    # The 3-token match (then 9) is older than the 2 most recent occurrences of the key "3".
    tokens = [1, 2, 3, 9, 0, 3, 5, 0, 3, 6, 1, 2, 3]
    assert NgramIndex(1, 4, max_candidates=3, tokens=tokens).lookup(1) == ([9], 3)
    assert NgramIndex(1, 4, max_candidates=2, tokens=tokens).lookup(1) == ([6], 1)


def test_arguments_are_validated() -> None:
    for bad in [(0, 4), (3, 2)]:
        with pytest.raises(ValueError):
            NgramIndex(*bad)
        with pytest.raises(ValueError):
            NgramProposer(*bad)


def test_incremental_extend_equals_a_scratch_build() -> None:
    rng = random.Random(1234)
    for trial in range(60):
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        vocab = rng.randint(2, 6)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 120))]
        inc = NgramIndex(min_n, max_n)
        pos = 0
        while pos < len(tokens):
            step = rng.randint(0, 7)
            inc.extend(tokens[pos:pos + step])
            pos += step
            scratch = NgramIndex(min_n, max_n, tokens=tokens[:pos])
            assert inc.tokens == scratch.tokens
            assert inc._ends == scratch._ends, trial
            for k in range(6):
                assert inc.lookup(k) == scratch.lookup(k), (trial, pos, k)


def test_lookup_matches_a_brute_force_oracle() -> None:
    def oracle(toks: list[int], min_n: int, max_n: int, k: int) -> tuple[list[int], int]:
        size = len(toks)
        for n in range(min(max_n, size - 1), min_n - 1, -1):
            for e in range(size - 1, n - 1, -1):  # ends before the last token, newest first
                if toks[e - n:e] == toks[size - n:]:
                    return toks[e:e + k], n
        return [], 0

    rng = random.Random(99)
    for _ in range(400):
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        toks = [rng.randrange(rng.randint(2, 5)) for _ in range(rng.randint(0, 40))]
        k = rng.randint(0, 5)
        got = NgramIndex(min_n, max_n, max_candidates=10_000, tokens=toks).lookup(k)
        assert got == (oracle(toks, min_n, max_n, k) if k > 0 else ([], 0)), (toks, min_n, max_n, k)


def test_proposer_extends_per_request_and_drops_on_finish() -> None:
    prop = NgramProposer(1, 4)
    tokens = [1, 2, 3, 4, 1, 2]
    out = prop.propose([ctx("a", tokens), ctx("b", [5, 6, 5])], [3, 3])
    assert [p.token_ids for p in out] == [[3, 4, 1], [6, 5]]
    assert all(p.probs is None and p.confidence is None for p in out)
    tokens.append(3)  # the engine committed one token
    assert prop.propose([ctx("a", tokens, 4)], [3])[0].token_ids == [4, 1, 2]
    assert prop.num_tracked == 2
    prop.finished(ctx("a", tokens, 4))
    assert prop.num_tracked == 1
    prop.finished(ctx("a", tokens, 4))  # twice is harmless
    prop.finished(ctx("b", [5, 6, 5]))
    assert prop.num_tracked == 0


def test_proposer_rebuilds_when_tokens_are_not_an_extension() -> None:
    prop = NgramProposer(1, 4)
    assert prop.propose([ctx("a", [1, 2, 3, 1])], [3])[0].token_ids == [2, 3, 1]
    # Same length, other tokens: a reused request id.
    assert prop.propose([ctx("a", [5, 6, 7, 5])], [3])[0].token_ids == [6, 7, 5]
    # Shorter.
    assert prop.propose([ctx("a", [8, 9, 8])], [3])[0].token_ids == [9, 8]
    # Longer, but the last indexed token differs.
    assert prop.propose([ctx("a", [8, 9, 4, 9])], [3])[0].token_ids == [4, 9]
    index = prop.index_for(ctx("a", [8, 9, 4, 9]))
    assert index.tokens == [8, 9, 4, 9]
    assert index._ends == NgramIndex(1, 4, tokens=[8, 9, 4, 9])._ends


def test_k_zero_gives_empty_proposals() -> None:
    prop = NgramProposer()
    out = prop.propose([ctx("a", [1, 2, 1]), ctx("b", [3, 3])], [0, 0])
    assert [p.token_ids for p in out] == [[], []]
