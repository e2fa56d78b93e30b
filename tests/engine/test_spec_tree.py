"""Draft trees in the engine (speculative/tree.py), on a tiny random-weight Llama.

* A tree step's logits at every node equal a chain step's over that node's path: the mask, the rotary
  positions by depth and the slots in node order are right, on both attention backends.
* A scripted tree guesser whose right continuation sits sometimes on the main chain, sometimes on a branch
  (so verification walks off the main chain and the walked nodes' K/V moves to its chain positions) leaves
  greedy and seeded outputs equal to the plain engine's, under chunking and preemption, and returns every block.
* The real guessers with `:tree` keep greedy output.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch

from deepinfer.engine.attention import Segment, layout
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.speculative import tree
from deepinfer.engine.speculative.base import Proposal, Proposer, SpecContext
from tests.engine.test_pd_handoff import assert_whole
from tests.engine.test_speculative import GREEDY, MODES, SEEDED, VOCAB, engine, prompts, run, same

pytestmark = pytest.mark.usefixtures("one_thread")


def forward(e: LLMEngine, kv: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
    step = layout(segments, e.runner.block_size, e.runner.backend)
    with torch.inference_mode():
        return e.runner.model.forward(step.input_ids, step.positions, kv, step.meta, step.logits_rows)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_a_tree_step_gives_each_node_its_paths_chain_logits(tiny_llama, native):
    e = engine(tiny_llama, use_native_kernels=native)
    rng = random.Random(5)
    context = [rng.randrange(3, VOCAB) for _ in range(13)]
    blocks = list(range(1, 9))  # an idle engine: no request owns any block
    forward(e, e.runner.kv, [Segment(context[:-1], 0, blocks, num_logits=1)])
    prefilled = e.runner.kv.clone()
    parents = [-1, 0, 1, 0, -1, 4, 3, 2]
    nodes = [rng.randrange(3, VOCAB) for _ in parents]
    root = len(context) - 1
    got = forward(e, e.runner.kv, [Segment([context[-1], *nodes], root, blocks, num_logits=1 + len(nodes),
                                           tree=parents)])
    for row in range(1 + len(nodes)):
        path = [nodes[n] for n in tree.path(parents, row - 1)]
        kv = prefilled.clone()
        chain = forward(e, kv, [Segment([context[-1], *path], root, blocks, rows=True, num_logits=1)])
        torch.testing.assert_close(got[row], chain[0], rtol=1e-5, atol=1e-5)


class ScriptedTreeProposer(Proposer):
    """Knows each prompt's answer; proposes a tree of 2-3 branches of random depths whose right continuation is
    the main chain, a later branch, or (with errors) none: every walk shape occurs, on and off the main chain."""

    def __init__(self, refs: dict[tuple[int, ...], list[int]], seed: int = 1, vocab: int = VOCAB) -> None:
        self.refs = refs
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.finished_ids: list[str] = []

    def propose(self, batch: Sequence[SpecContext], ks: Sequence[int]) -> list[Proposal]:
        out = []
        for ctx, k in zip(batch, ks):
            ref = self.refs[tuple(ctx.token_ids[: ctx.num_prompt_tokens])]
            done = len(ctx.token_ids) - ctx.num_prompt_tokens
            right = ref[done : done + self.rng.randint(1, max(1, k))]
            branches = [self._wrong(right) for _ in range(self.rng.randint(1, 2))]
            where = self.rng.randrange(len(branches) + 1)
            branches.insert(where, right if self.rng.random() < 0.8 else self._wrong(right))
            out.append(_as_proposal(*tree.build(branches, k, 4)))
        return out

    def _wrong(self, right: list[int]) -> list[int]:
        cut = self.rng.randrange(len(right)) if right else 0
        return right[:cut] + [(t + 1 + self.rng.randrange(5)) % self.vocab for t in right[cut:]] + [7]

    def finished(self, ctx: SpecContext) -> None:
        self.finished_ids.append(ctx.request_id)


def _as_proposal(tokens: list[int], parents: list[int], shares: list[float]) -> Proposal:
    return Proposal(tokens, parents=None if tree.is_chain(parents) else parents, shares=shares)


def count_moves(e: LLMEngine) -> list[int]:
    """Counts the steps whose tree walk left the main chain (K/V moved), by wrapping the runner."""
    moved = [0]
    inner = e.runner.move_slots

    def move_slots(block_ids, moves):  # type: ignore[no-untyped-def]
        moved[0] += bool(moves)
        inner(block_ids, moves)

    e.runner.move_slots = move_slots  # type: ignore[method-assign]
    return moved


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("mode", MODES)
def test_scripted_trees_change_nothing(tiny_llama, mode, params):
    batch = prompts()
    ref = run(engine(tiny_llama, **MODES[mode]), batch, params)
    e = engine(tiny_llama, "ngram", num_speculative_tokens=8, **MODES[mode])
    assert e.speculator is not None
    proposer = ScriptedTreeProposer({tuple(p): o.token_ids for p, o in zip(batch, ref)})
    e.speculator.proposer = proposer
    moved = count_moves(e)
    got = run(e, batch, params)
    same(got, ref)
    assert moved[0] > 0, "no walk left the main chain: the test did not exercise K/V moves"
    assert e.stats.spec_accepted_tokens > 0
    if mode == "preempt":
        assert e.stats.num_preemptions > 0
    assert sorted(proposer.finished_ids) == sorted(o.request_id for o in got)
    assert_whole(e)


def test_scripted_trees_on_the_torch_backend(tiny_llama):
    batch = prompts(6, seed=2)
    ref = run(engine(tiny_llama, use_native_kernels=False), batch, GREEDY)
    e = engine(tiny_llama, "ngram", num_speculative_tokens=8, use_native_kernels=False)
    assert e.speculator is not None
    e.speculator.proposer = ScriptedTreeProposer({tuple(p): o.token_ids for p, o in zip(batch, ref)}, seed=4)
    moved = count_moves(e)
    same(run(e, batch, GREEDY), ref)
    assert moved[0] > 0
    assert_whole(e)


@pytest.mark.parametrize("method", ["ngram:tree", "suffix:tree=3"])
@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
def test_real_tree_guessers_keep_greedy_output(tiny_llama, method, adaptive):
    # Repeating units with variations: the history branches, so the guessers propose trees.
    rng = random.Random(8)
    batch = []
    for _ in range(6):
        units = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 7))] for _ in range(2)]
        batch.append([t for _ in range(4) for u in units for t in (u if rng.random() < 0.5 else u[::-1])])
    ref = run(engine(tiny_llama), batch, GREEDY)
    e = engine(tiny_llama, method, num_speculative_tokens=8, adaptive_speculation=adaptive)
    assert e.speculator is not None
    trees = [0]
    plain_draft = e.speculator.draft

    def draft(sched):  # type: ignore[no-untyped-def]
        plain_draft(sched)
        trees[0] += sum(c.draft_parents is not None for c in sched.chunks)

    e.speculator.draft = draft  # type: ignore[method-assign]
    for _ in range(2):  # the second round finds the first one's answers in the suffix index
        same(run(e, batch, GREEDY), ref)
    # The controller verifies branch nodes only where it measures them worth their rows (timing-dependent).
    assert e.stats.spec_proposed_tokens > 0 and (adaptive or trees[0] > 0)
    assert_whole(e)


def test_blocks_written_by_tree_steps_serve_later_prefix_hits(tiny_llama):
    """Blocks holding tree-verified tokens are named in the prefix cache; a later prompt that extends an earlier
    answer reuses them, and its answer is the one a fresh engine gives: the moved K/V is the chain's."""
    batch = prompts(6, seed=5)
    ref = run(engine(tiny_llama), batch, GREEDY)
    e = engine(tiny_llama, "ngram", num_speculative_tokens=8)
    assert e.speculator is not None
    e.speculator.proposer = ScriptedTreeProposer({tuple(p): o.token_ids for p, o in zip(batch, ref)}, seed=6)
    moved = count_moves(e)
    same(run(e, batch, GREEDY), ref)
    assert moved[0] > 0
    follow = [p + o.token_ids for p, o in zip(batch, ref)]
    e.speculator = None  # plain decoding now: only the cached blocks carry the tree steps' work
    hits_before = e.stats.prefix_hit_tokens
    same(run(e, follow, GREEDY), run(engine(tiny_llama), follow, GREEDY))
    assert e.stats.prefix_hit_tokens - hits_before > sum(len(p) for p in batch)
    assert_whole(e)


class MalformedTreeProposer(Proposer):
    """Proposes trees whose parents point forward, or whose lengths disagree: a guesser's bug."""

    def __init__(self) -> None:
        self.calls = 0

    def propose(self, batch: Sequence[SpecContext], ks: Sequence[int]) -> list[Proposal]:
        self.calls += 1
        bad = [Proposal([5, 6, 7], parents=[-1, 2, 0]), Proposal([5, 6], parents=[-1]),
               Proposal([5, 6], parents=[-1, 0], shares=[1.0])]
        return [bad[(self.calls + i) % len(bad)] for i in range(len(batch))]


def test_a_malformed_tree_costs_its_drafts_never_the_step(tiny_llama):
    batch = prompts(4, seed=9)
    ref = run(engine(tiny_llama), batch, GREEDY)
    e = engine(tiny_llama, "ngram", num_speculative_tokens=8)
    assert e.speculator is not None
    e.speculator.proposer = MalformedTreeProposer()
    same(run(e, batch, GREEDY), ref)
    assert e.stats.spec_proposed_tokens == 0
    assert_whole(e)
