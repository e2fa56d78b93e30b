"""Draft trees (speculative/tree.py) as pure objects: building from continuations, the verification walk, K/V
moves, the attention mask, node gains; the lookup guessers' trees; the controller ranking a tree's nodes."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.request import SamplingParams
from deepinfer.engine.speculative import tree
from deepinfer.engine.speculative.base import SpecContext
from deepinfer.engine.speculative.controller import SpecController
from deepinfer.engine.speculative.ngram import NgramIndex, NgramProposer
from deepinfer.engine.speculative.suffix import SuffixIndex, SuffixProposer


def test_build_keeps_the_first_continuation_as_the_main_chain_and_counts_shares():
    tokens, parents, shares = tree.build([[1, 2, 3], [1, 2, 4], [5, 6], [1, 7]], max_depth=4, max_leaves=4)
    assert tokens == [1, 2, 3, 4, 5, 6, 7]
    assert parents == [-1, 0, 1, 1, -1, 4, 0]
    assert shares == pytest.approx([3 / 4, 2 / 3, 1 / 2, 1 / 2, 1 / 4, 1.0, 1 / 3])
    assert [tokens[n] for n in tree.main_chain(parents)] == [1, 2, 3]


def test_build_respects_the_leaf_budget_and_the_depth():
    tokens, parents, _ = tree.build([[1, 2, 3], [1, 2, 4], [5, 6], [1, 7]], max_depth=4, max_leaves=2)
    assert (tokens, parents) == ([1, 2, 3, 4], [-1, 0, 1, 1])  # [5, 6] and [1, 7] would be third and fourth leaves
    tokens, parents, _ = tree.build([[1, 2, 3, 9], [1, 2, 3, 9, 8]], max_depth=3, max_leaves=1)
    assert (tokens, parents) == ([1, 2, 3], [-1, 0, 1]) and tree.is_chain(parents)
    # Extending a leaf adds no leaf: a longer second continuation grows the chain under a budget of one.
    tokens, parents, _ = tree.build([[1, 2], [1, 2, 3]], max_depth=4, max_leaves=1)
    assert (tokens, parents) == ([1, 2, 3], [-1, 0, 1])


def test_a_given_main_chain_is_not_counted_as_evidence():
    tokens, parents, shares = tree.build([[1, 5], [2, 6], [1, 5]], max_depth=2, max_leaves=4, main=[1, 5])
    assert (tokens, parents) == ([1, 5, 2, 6], [-1, 0, -1, 2])
    assert shares == pytest.approx([2 / 3, 1.0, 1 / 3, 1.0])


def test_the_walk_follows_the_targets_picks_through_any_branch():
    parents = [-1, 0, 0, -1, 3]
    tokens = [10, 11, 12, 20, 21]
    assert tree.accepted_path(parents, tokens, [10, 12, 0, 0, 0, 0]) == [0, 2]
    assert tree.accepted_path(parents, tokens, [20, 0, 0, 0, 21, 9]) == [3, 4]
    assert tree.accepted_path(parents, tokens, [30, 11, 12, 0, 21, 0]) == []
    assert tree.main_chain_acceptance(parents, [0, 2]) == (2, 1)
    assert tree.main_chain_acceptance(parents, [0, 1]) == (2, 2)
    assert tree.main_chain_acceptance(parents, [3, 4]) == (2, 0)


def test_moves_put_walked_nodes_at_their_chain_positions_without_clobbering():
    assert tree.moves([0, 1]) == []
    assert tree.moves([0, 2, 5]) == [(2, 1), (5, 2)]
    assert tree.moves([3, 4]) == [(3, 0), (4, 1)]
    # Applying the moves in order to a row of slots leaves every walked node where the chain puts it.
    for walked in ([0, 2, 5], [3, 4], [1, 6, 7, 9]):
        slots = list(range(10))
        for src, dst in tree.moves(walked):
            slots[dst] = slots[src]
        assert slots[: len(walked)] == walked


def test_the_mask_shows_each_node_its_context_and_ancestors_only():
    parents = [-1, 0, 0, -1]
    mask = tree.tree_mask(parents, context=3)
    assert mask.shape == (5, 8) and mask.dtype == torch.bool
    assert mask[:, :4].all()  # the context and the root
    rows = mask[:, 4:].int().tolist()
    assert rows == [[0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 1]]
    assert tree.depths(parents) == [1, 2, 2, 1]


def test_subtree_renumbers_and_validate_refuses_forward_parents():
    assert tree.subtree([-1, 0, 0, -1, 3], [0, 2, 3]) == [-1, 0, -1]
    tree.validate([-1, 0, 0, -1])
    with pytest.raises(ValueError):
        tree.validate([-1, 1])


def test_node_gains_give_later_children_the_first_childs_leftover():
    parents = [-1, 0, -1]
    shares = [0.6, 1.0, 0.3]
    gains = tree.node_gains(parents, shares, [0.8, 0.8, 0.8])
    # A sibling gets (1 - 0.8) * 0.3 / (1 - 0.6) of its parent's chance.
    assert gains == pytest.approx([0.8, 0.64, 0.2 * 0.3 / 0.4])
    assert tree.node_gains([-1, -1], [1.0, 0.0], [0.5, 0.5]) == [0.5, 0.0]  # a first child with all the evidence


def test_ngram_proposes_a_tree_where_the_history_branches():
    # After [1, 2]: [3, 9] once, [4, 8] once, [3, 7] most recently.
    index = NgramIndex(1, 4, tokens=[1, 2, 3, 9, 9, 1, 2, 4, 8, 8, 1, 2, 3, 7, 7, 1, 2])
    chain = NgramProposer(1, 4).propose_one(index, 3)
    assert chain.token_ids == [3, 7, 7] and chain.parents is None
    p = NgramProposer(1, 4, tree_leaves=4).propose_one(index, 3)
    assert p.parents is not None and p.shares is not None
    assert [p.token_ids[n] for n in tree.main_chain(p.parents)] == chain.token_ids
    paths = {tuple(p.token_ids[n] for n in tree.path(p.parents, i)) for i in range(len(p.parents))}
    assert {(3, 9, 9), (4, 8, 8), (3, 7, 7)} <= paths
    assert max(tree.depths(p.parents)) <= 3
    # One occurrence only: a chain, whatever the leaf budget.
    one = NgramIndex(1, 4, tokens=[5, 6, 7, 8, 5, 6])
    assert NgramProposer(1, 4, tree_leaves=4).propose_one(one, 3).parents is None


def test_suffix_proposes_the_indexs_tree_around_its_majority_chain():
    index = SuffixIndex(min_n=2, max_n=4)
    for answer in ([10, 11, 12], [10, 11, 12], [10, 13, 14]):
        index.add("t", [1, 2, 3, *answer], 3)
    ctx = SpecContext("r", [9, 1, 2, 3], 4, SamplingParams(), "t")
    chain = SuffixProposer(index).propose([ctx], [3])[0]
    assert chain.token_ids == [10, 11, 12] and chain.parents is None
    p = SuffixProposer(index, tree_leaves=4).propose([ctx], [3])[0]
    assert p.parents is not None and p.confidence is not None
    main = tree.main_chain(p.parents)
    assert [p.token_ids[n] for n in main] == chain.token_ids
    assert [p.confidence[n] for n in main] == pytest.approx(chain.confidence)
    branch = [i for i in range(len(p.parents)) if i not in main]
    assert [p.token_ids[n] for n in branch] == [13, 14]


def test_the_controller_ranks_a_trees_nodes_and_spends_rows_on_the_best():
    c = SpecController(max_k=3, prior_acceptance=0.5, step_seconds=0.02, row_seconds=0.0)
    parents, shares = [-1, 0, 1, -1], [0.5, 1.0, 1.0, 0.5]
    # Rows are free (row_seconds 0): the controller takes its cap, the three most valuable nodes.
    ks = c.choose([("r", 4, None, (parents, shares))], base_rows=1)
    assert ks == [3]
    order = c.tree_order(0)
    # Gains: node 0 at 0.5, its child 0.25, grandchild 0.125; the root's second child takes the first's leftover,
    # (1 - 0.5) * 0.5 / (1 - 0.5) = 0.5, and ranks above the main chain's deeper nodes.
    assert order == [0, 3, 1, 2]
    assert c.tree_order(1) is None
    # Without the controller's choice of k: its cap, of the nodes ranked the same way.
    fixed = SpecController(max_k=3, adaptive=False)
    assert fixed.choose([("r", 4, None, (parents, shares))], base_rows=1) == [3]
    assert fixed.tree_order(0) == [0, 3, 1, 2]
    assert fixed.choose([("r", 4, None)], base_rows=1) == [3] and fixed.tree_order(0) is None
