"""bench/spec_bound.py's replay: step counts of a guesser over known answers, checked by hand-counted cases."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from bench.spec_bound import make_proposer, replay
from deepinfer.engine.speculative.base import Proposal, Proposer, SpecContext


class Scripted(Proposer):
    """Proposes fixed drafts in order and records what the replay reports back."""

    cheap = True

    def __init__(self, drafts: list[list[int]]) -> None:
        self.drafts = drafts
        self.observed: list[tuple[int, int]] = []
        self.finished_contexts: list[list[int]] = []
        self.seen: list[list[int]] = []

    def propose(self, batch: Sequence[SpecContext], ks: Sequence[int]) -> list[Proposal]:
        self.seen.append(list(batch[0].token_ids))
        return [Proposal(token_ids=self.drafts.pop(0) if self.drafts else [])]

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:
        self.observed.append((proposed, accepted))

    def finished(self, ctx: SpecContext) -> None:
        self.finished_contexts.append(list(ctx.token_ids))


def test_a_step_commits_the_matching_prefix_plus_the_targets_token() -> None:
    # Answer 10..15, its first token from the prefill step. Step 2: [11, 12, 99] accepts 11, 12 and commits the
    # target's 13. Step 3: [14, 15, 16] accepts 14, 15, which end the answer (16 is never compared).
    p = Scripted([[11, 12, 99], [14, 15, 16]])
    r = replay(p, [([1, 2], [10, 11, 12, 13, 14, 15])], k=3)
    assert (r.tokens, r.steps, r.proposed, r.accepted) == (6, 3, 6, 4)
    assert p.observed == [(3, 2), (3, 2)]
    assert p.seen == [[1, 2, 10], [1, 2, 10, 11, 12, 13]]
    assert p.finished_contexts == [[1, 2, 10, 11, 12, 13, 14, 15]]


def test_drafts_are_cut_to_k_and_a_wrong_first_draft_still_commits_one_token() -> None:
    p = Scripted([[5, 6, 7, 8], [0]])
    r = replay(p, [([1], [4, 5, 6, 7])], k=2)
    # step 2: draft cut to [5, 6], both right, plus 7: the answer is done
    assert (r.steps, r.proposed, r.accepted) == (2, 2, 2)
    p = Scripted([[9], [9], [9]])
    r = replay(p, [([1], [4, 5, 6, 7])], k=2)
    assert r.steps == 4 and r.accepted == 0 and r.tokens_per_step == 1.0


def test_the_suffix_index_learns_from_earlier_answers_in_order() -> None:
    answer = list(range(100, 160))
    pairs = [([1, 2, 3], answer), ([1, 2, 3], answer)]
    first = replay(make_proposer("suffix"), pairs[:1], k=16)
    both = replay(make_proposer("suffix"), pairs, k=16)
    assert first.steps == len(answer)  # nothing repeats inside the first answer
    second_steps = both.steps - first.steps
    assert second_steps == 1 + -(-(len(answer) - 1) // 17)  # the repeat: 16 drafts + 1 a step


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        replay(make_proposer("ngram"), [], k=0)
    with pytest.raises(ValueError):
        make_proposer("self:1")


class ScriptedTree(Scripted):
    """Proposes one fixed tree, then nothing."""

    def __init__(self, tokens: list[int], parents: list[int]) -> None:
        super().__init__([])
        self.tree: tuple[list[int], list[int]] | None = (tokens, parents)

    def propose(self, batch: Sequence[SpecContext], ks: Sequence[int]) -> list[Proposal]:
        self.seen.append(list(batch[0].token_ids))
        tree, self.tree = self.tree, None
        return [Proposal(tree[0], parents=tree[1]) if tree else Proposal()]


def test_a_tree_is_walked_along_the_answer_through_any_branch() -> None:
    # Answer 10..14. The tree: 11 -> 99 on the main chain, 11 -> 12 -> 13 on a branch, and 50 from the root.
    # The walk takes 11, 12, 13 (off the main chain after 11) and the target's 14 ends the answer.
    p = ScriptedTree([11, 99, 12, 13, 50], [-1, 0, 0, 2, -1])
    r = replay(p, [([1], [10, 11, 12, 13, 14])], k=3)
    assert (r.tokens, r.steps, r.proposed, r.accepted) == (5, 2, 5, 3)
    assert p.observed == [(2, 1)]  # the main chain (11, 99): its first node accepted


def test_tree_methods_replay_and_never_walk_fewer_tokens_than_their_main_chain() -> None:
    unit = list(range(200, 206))
    answer = (unit + [7]) * 3 + (unit + [8]) * 3 + unit
    pairs = [([1, 2, 3, *unit, 9, *unit, 7], answer)]
    chain = replay(make_proposer("ngram"), pairs, k=8)
    tree = replay(make_proposer("ngram:tree"), pairs, k=8)
    assert tree.tokens == chain.tokens and tree.steps <= chain.steps
    with pytest.raises(ValueError):
        make_proposer("self:2")
