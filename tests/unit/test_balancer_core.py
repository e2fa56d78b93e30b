"""The expert balancer's pure core: hand-checked cases, DeepSeek EPLB's published example, the window,
and properties of every placement and every plan."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.engine.ep.placement import EMPTY, ExpertPlacement
from deepinfer.services.balancer_core import BalancerCore
from deepinfer.services.balancer_placement import (
    lower_bound,
    max_over_mean,
    rank_loads,
    rebalance,
    replica_counts,
)

# EPLB's README (deepseek-ai/EPLB): 2 layers of 12 experts, 16 replicas, 4 groups, 2 nodes of 4 GPUs.
EPLB_WEIGHT = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
               [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
EPLB_OUTPUT = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
               [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]


def ratios(p: ExpertPlacement, loads: list[list[int]]) -> list[float]:
    return [max_over_mean(r) for r in rank_loads(p, loads)]


def test_rank_loads_split_an_expert_over_its_replicas() -> None:
    # Rank 0: experts 0, 1; rank 1: experts 2, 0. Expert 0's 10 tokens go 5 and 5.
    p = ExpertPlacement(2, 3, 2, ((0, 1, 2, 0),))
    assert rank_loads(p, [[10, 4, 6]]) == [[9.0, 11.0]]
    assert max_over_mean([9.0, 11.0]) == pytest.approx(1.1)
    assert max_over_mean([0.0, 0.0]) == 1.0


def test_replica_counts_go_to_the_highest_load_per_replica() -> None:
    # 4 extra: 100 -> 50 (2), then 60 -> 30 (2), then 100 -> 33.3 (3), then 40 vs 33.3 vs 30: 40 (2).
    assert replica_counts([100, 60, 40, 10], 8, cap=4) == [3, 2, 2, 1]
    # The cap (one replica per rank) holds, and a tie goes to the lower id.
    assert replica_counts([100, 1], 5, cap=2) == [2, 2]
    assert replica_counts([5, 5], 3, cap=3) == [2, 1]


def test_lower_bound_is_the_mean_or_the_heaviest_replica() -> None:
    # 2 ranks, 4 replicas of [100, 60, 40, 10]: one each; the heaviest replica (100) is under the mean
    # (105), so the bound is the mean. 3 ranks of one slot and [90, 10, 10]: 90 against a mean of 110/3.
    assert lower_bound([100, 60, 40, 10], 2, 4) == pytest.approx(1.0)
    assert lower_bound([90, 10, 10], 3, 3) == pytest.approx(90 / (110 / 3))
    assert lower_bound([0, 0], 2, 2) == 1.0


def test_lower_bound_with_few_slots_per_rank_counts_whole_experts_sharing_a_rank() -> None:
    # 2 ranks of 2 slots, [10, 10, 10, 1], no extra replica: three tens on two ranks, so one rank holds two
    # (20 against a mean of 15.5), and {10, 10} {10, 1} reaches it. Without the slot count: 10 vs 15.5.
    assert lower_bound([10, 10, 10, 1], 2, 4) == pytest.approx(1.0)
    assert lower_bound([10, 10, 10, 1], 2, 4, slots_per_rank=2) == pytest.approx(20 / 15.5)
    # 2 ranks of 3 slots: k = 2·2 + 1 + 1 = 6 > 4 experts, no pigeonhole; the mean binds.
    assert lower_bound([10, 10, 10, 1], 2, 5, slots_per_rank=3) == pytest.approx(1.0)
    # 4 ranks of 2 slots, six tens and a one, one extra replica: at most one ten is split, five whole tens
    # on four ranks, so some rank holds two: 20 against 61 / 4 ({10,1} {10,5} {10,5} {10,10} reaches it).
    assert lower_bound([10] * 6 + [1], 4, 8, slots_per_rank=2) == pytest.approx(20 / (61 / 4))


def test_hand_checked_global_packing() -> None:
    # 2 ranks of 3 slots, loads [60, 30, 20, 10], 2 extra replicas. Counts: 60 -> 2 (30 each; expert 0
    # is then at its cap of 2 ranks), then 30 -> 2: [2, 2, 1, 1]. No rank holds an expert twice, so each
    # rank has a 30 and a 15; the 20 and the 10 go one each: 65 and 55, max/mean 65/60. No placement of
    # 6 replicas does better here ([2, 1, 2, 1] gives 70/50, [2, 1, 1, 2] 65/55 again), though the
    # slot-blind lower bound says 1.0.
    loads = [[60, 30, 20, 10]]
    p = rebalance(loads, num_ranks=2, slots_per_rank=3)
    assert Counter(p.layers[0]) == Counter({0: 2, 1: 2, 2: 1, 3: 1})
    assert sorted(rank_loads(p, loads)[0]) == [55.0, 65.0]
    assert ratios(p, loads)[0] == pytest.approx(65 / 60)
    assert lower_bound(loads[0], 2, 6) == 1.0


def test_eplb_readme_example_same_replicas_and_no_worse() -> None:
    ours = rebalance(EPLB_WEIGHT, num_ranks=8, slots_per_rank=2, ranks_per_node=4, num_groups=4)
    published = ExpertPlacement(8, 12, 2, tuple(tuple(s) for s in EPLB_OUTPUT))
    for layer in range(2):
        assert Counter(ours.layers[layer]) == Counter(published.layers[layer])
        # Hierarchical: each group of 3 experts stays within one node of 4 GPUs (8 slots).
        for node in range(2):
            held = set(ours.layers[layer][node * 8:(node + 1) * 8])
            assert all({3 * g, 3 * g + 1, 3 * g + 2} <= held or not {3 * g, 3 * g + 1, 3 * g + 2} & held
                       for g in range(4))
    mine, theirs = ratios(ours, EPLB_WEIGHT), ratios(published, EPLB_WEIGHT)
    assert all(m <= t + 1e-9 for m, t in zip(mine, theirs, strict=True))
    assert theirs[0] == pytest.approx(1.2081, abs=1e-4)  # the published table's own figure


def test_global_policy_when_nodes_do_not_divide_groups() -> None:
    # 3 groups over 2 nodes: global policy, replicas may cross nodes; still every expert placed.
    p = rebalance(EPLB_WEIGHT, num_ranks=8, slots_per_rank=2, ranks_per_node=4, num_groups=3)
    assert all(set(layer) == set(range(12)) for layer in p.layers)


def test_redundant_fewer_than_the_slots_leaves_empty_slots() -> None:
    p = rebalance([[5, 4, 3, 2, 1]], num_ranks=2, slots_per_rank=4, redundant=1)
    assert p.layers[0].count(EMPTY) == 2 and Counter(p.layers[0])[0] == 2


# --- the core -------------------------------------------------------------------------------------------


def skewed(num_layers: int, num_experts: int, hot: int = 0) -> list[list[int]]:
    return [[1000 if e == hot else 10 for e in range(num_experts)] for _ in range(num_layers)]


def test_plan_replicates_the_hot_expert_and_bumps_the_version() -> None:
    core = BalancerCore.for_group(2, 8, 4, redundant=4, window_s=60.0)
    assert core.plan(0.0) is None  # nothing reported yet
    core.observe(skewed(2, 8), version=0, now=0.0)
    d = core.plan(1.0)
    assert d is not None and d.placement.version == 1 and d.changed == (0, 1)
    assert all(a < b for a, b in zip(d.after, d.before, strict=True))
    assert Counter(d.placement.layers[0])[0] == 4  # one replica per rank: the most it can have
    assert core.plan(2.0) is None  # pending until adopted
    core.adopt(d.placement)
    assert core.current is d.placement
    assert core.plan(3.0) is None  # nothing left worth a move


def test_threshold_keeps_a_good_placement() -> None:
    core = BalancerCore.for_group(1, 4, 2, window_s=60.0, threshold=0.05)
    core.observe([[10, 10, 10, 11]], version=0, now=0.0)  # static: 20 vs 21, max/mean 1.024
    assert core.plan(0.0) is None


def test_abandon_frees_the_next_plan_with_a_new_version() -> None:
    core = BalancerCore.for_group(1, 8, 4, redundant=4, window_s=60.0)
    core.observe(skewed(1, 8), version=0, now=0.0)
    first = core.plan(0.0)
    core.abandon()
    second = core.plan(0.0)
    assert first is not None and second is not None
    assert second.placement.version == 2 and second.placement.layers == first.placement.layers


def test_a_report_from_an_unknown_newer_version_stops_plans_until_adopted() -> None:
    core = BalancerCore.for_group(1, 8, 4, redundant=4, window_s=60.0)
    core.observe(skewed(1, 8), version=7, now=0.0)
    assert core.plan(0.0) is None
    running = ExpertPlacement(4, 8, 3, core.current.layers, version=7)
    core.adopt(running)
    d = core.plan(0.0)
    assert d is not None and d.placement.version == 8


def test_window_drops_old_reports() -> None:
    core = BalancerCore.for_group(1, 4, 2, window_s=10.0)
    core.observe([[1, 2, 3, 4]], version=0, now=0.0)
    core.observe([[10, 0, 0, 0]], version=0, now=5.0)
    assert core.window_loads(10.0) == [[11, 2, 3, 4]]  # exactly window_s old still counts
    assert core.window_loads(10.5) == [[10, 0, 0, 0]]
    assert core.window_loads(15.5) == [[0, 0, 0, 0]] and core.reports == 0
    assert core.plan(15.5) is None


def test_bad_reports_are_refused() -> None:
    core = BalancerCore.for_group(2, 4, 2, window_s=10.0)
    with pytest.raises(ValueError):
        core.observe([[1, 2, 3, 4]], version=0, now=0.0)  # one layer of two
    with pytest.raises(ValueError):
        core.observe([[1, 2, 3], [1, 2, 3]], version=0, now=0.0)
    with pytest.raises(ValueError):
        core.observe([[1, 2, 3, -4], [1, 2, 3, 4]], version=0, now=0.0)


def test_max_moves_converges_over_rounds() -> None:
    core = BalancerCore.for_group(1, 16, 4, redundant=4, window_s=60.0, max_moves=2)
    loads = [[(e * 37) % 101 + (500 if e in (3, 7) else 0) for e in range(16)]]
    core.observe(loads, version=0, now=0.0)
    start = ratios(core.current, loads)[0]
    for _ in range(40):
        d = core.plan(0.0)
        if d is None:
            break
        assert max(d.moves) <= 2
        core.adopt(d.placement)
    assert ratios(core.current, loads)[0] < start * 0.95


# Three layers of 16 experts on 4 ranks (5 slots each, 4 redundant): layer 1 very skewed, layer 2 a little,
# layer 0 in between.
SKEWED = [[(e * 37) % 101 + (400 if e in (3, 7) else 0) for e in range(16)],
          [(e * 53) % 97 + (3000 if e in (0, 1, 2, 3) else 0) for e in range(16)],
          [(e * 29) % 89 + (120 if e == 5 else 0) for e in range(16)]]


def skewed_core(**bounds: int | None) -> BalancerCore:
    core = BalancerCore.for_group(3, 16, 4, redundant=4, window_s=60.0, **bounds)
    core.observe(SKEWED, version=0, now=0.0)
    return core


def test_max_moves_total_bounds_a_decision_and_spends_on_the_largest_gains_first() -> None:
    free = skewed_core().plan(0.0)
    assert free is not None and free.changed == (0, 1, 2)
    gains = [b - a for b, a in zip(free.before, free.after, strict=True)]
    best = max(range(3), key=lambda i: gains[i])
    assert best == 1 and sorted(gains, reverse=True) == [gains[1], gains[0], gains[2]]
    # Just enough for the largest gain's whole step: that layer moves, and nothing else.
    d = skewed_core(max_moves_total=free.moves[1]).plan(0.0)
    assert d is not None and d.changed == (1,)
    assert d.placement.layers[1] == free.placement.layers[1]
    # A little more: the next gain (layer 0) takes a bounded step with what is left; layer 2 waits.
    extra = 2
    d = skewed_core(max_moves_total=free.moves[1] + extra).plan(0.0)
    assert d is not None and 1 in d.changed and 2 not in d.changed and sum(d.moves) <= free.moves[1] + extra
    assert d.moves[0] <= extra
    # Both bounds together: each layer within max_moves, the decision within the total, every step better.
    d = skewed_core(max_moves=3, max_moves_total=5).plan(0.0)
    assert d is not None and max(d.moves) <= 3 and sum(d.moves) <= 5
    assert all(d.after[i] < d.before[i] for i in d.changed)
    assert d.moves[1] == 3  # the most skewed layer is served first, to its per-layer bound


def test_both_bounds_converge_over_rounds() -> None:
    core = skewed_core(max_moves=2, max_moves_total=3)
    start = ratios(core.current, SKEWED)
    for _ in range(200):
        d = core.plan(0.0)
        if d is None:
            break
        assert max(d.moves) <= 2 and sum(d.moves) <= 3
        core.adopt(d.placement)
    else:
        raise AssertionError("no convergence in 200 rounds")
    end = ratios(core.current, SKEWED)
    unbounded = skewed_core().plan(0.0)
    assert unbounded is not None
    for i in range(3):
        assert end[i] <= start[i]
        # It ends where the rest of the gain falls under the threshold (5%), as an unbounded plan would.
        assert end[i] < start[i] * 0.95 or start[i] - unbounded.after[i] < 0.05 * start[i]


def test_bad_move_bounds_are_refused() -> None:
    for bounds in ({"max_moves": 0}, {"max_moves_total": 0}, {"max_moves_total": -3}):
        with pytest.raises(ValueError, match="max_moves"):
            BalancerCore.for_group(1, 4, 2, window_s=1.0, **bounds)


# --- properties -----------------------------------------------------------------------------------------


@st.composite
def groups(draw: st.DrawFn) -> tuple[int, int, int, list[list[int]]]:
    experts = draw(st.integers(1, 12))
    ranks = draw(st.integers(1, 6))
    redundant = draw(st.integers(0, min(experts * (ranks - 1), 2 * ranks)))
    layers = draw(st.integers(1, 3))
    loads = draw(st.lists(st.lists(st.integers(0, 1000), min_size=experts, max_size=experts),
                          min_size=layers, max_size=layers))
    return experts, ranks, redundant, loads


def check_valid(p: ExpertPlacement) -> None:
    # The constructor checks coverage, duplicates and width; re-check them here in plain words.
    for layer in p.layers:
        assert set(range(p.num_experts)) <= set(layer)
        for r in range(p.num_ranks):
            held = [e for e in layer[r * p.slots_per_rank:(r + 1) * p.slots_per_rank] if e != EMPTY]
            assert len(held) == len(set(held)) <= p.slots_per_rank


@settings(max_examples=150, deadline=None)
@given(groups())
def test_rebalance_is_valid_deterministic_and_never_below_the_bound(g: tuple) -> None:
    experts, ranks, redundant, loads = g
    static = ExpertPlacement.static(len(loads), experts, ranks, redundant)
    p = rebalance(loads, ranks, static.slots_per_rank, redundant=redundant)
    check_valid(p)
    assert all(sum(1 for e in layer if e != EMPTY) == experts + redundant for layer in p.layers)
    assert p == rebalance(loads, ranks, static.slots_per_rank, redundant=redundant)
    for ratio, w in zip(ratios(p, loads), loads, strict=True):
        assert ratio >= lower_bound(w, ranks, experts + redundant, static.slots_per_rank) - 1e-9


@settings(max_examples=150, deadline=None)
@given(groups(), st.one_of(st.none(), st.integers(1, 6)), st.one_of(st.none(), st.integers(1, 10)),
       st.sampled_from([0.0, 0.05, 0.2]))
def test_plan_is_valid_bounded_never_worse_and_deterministic(g: tuple, max_moves: int | None,
                                                            max_moves_total: int | None, threshold: float) -> None:
    experts, ranks, redundant, loads = g

    def run() -> tuple[BalancerCore, object]:
        core = BalancerCore.for_group(len(loads), experts, ranks, redundant, window_s=30.0, threshold=threshold,
                                      max_moves=max_moves, max_moves_total=max_moves_total)
        core.observe(loads, version=0, now=0.0)
        return core, core.plan(1.0)

    core, d = run()
    assert run()[1] == d
    if d is None:
        return
    check_valid(d.placement)
    assert d.placement.version == core.current.version + 1
    before, after = ratios(core.current, loads), ratios(d.placement, loads)
    for i in range(len(loads)):
        assert after[i] <= before[i] + 1e-9  # never worse, threshold or not
        assert d.after[i] == pytest.approx(after[i]) and d.before[i] == pytest.approx(before[i])
        moved = sum(1 for a, b in zip(core.current.layers[i], d.placement.layers[i], strict=True)
                    if a != b and b != EMPTY)
        assert moved == d.moves[i]
        if max_moves is not None:
            assert moved <= max_moves
        if i not in d.changed:
            assert d.placement.layers[i] == core.current.layers[i]
    if max_moves_total is not None:
        assert sum(d.moves) <= max_moves_total
    # A changed layer came from a rebalance whose whole gain reached the threshold.
    assert d.changed


@st.composite
def running_groups(draw: st.DrawFn) -> tuple:
    """A group already running a balanced placement for some other load (version > 0), the load it sees now,
    both move bounds and a threshold. Half the time a shape the hierarchical policy takes (nodes divide the
    expert groups and the replicas, groups divide the experts), else any group, with ranks per node and
    expert groups drawn that the policy may refuse (then it is the global one)."""
    if draw(st.booleans()):  # a shape the hierarchical policy takes: 2-3 nodes of 1-3 ranks
        nodes, rpn = draw(st.integers(2, 3)), draw(st.integers(1, 3))
        num_groups = nodes * draw(st.integers(1, 2))
        experts = num_groups * draw(st.integers(1, 3))
        ranks = nodes * rpn
        redundant = nodes * draw(st.integers(0, (experts * (rpn - 1)) // nodes))
        loads = draw(st.lists(st.lists(st.integers(0, 1000), min_size=experts, max_size=experts),
                              min_size=1, max_size=3))
    else:
        experts, ranks, redundant, loads = draw(groups())
        rpn = draw(st.one_of(st.none(), st.sampled_from([d for d in range(1, ranks + 1) if ranks % d == 0])))
        num_groups = None if rpn is None else draw(st.integers(1, experts))
    earlier = draw(st.lists(st.lists(st.integers(0, 1000), min_size=experts, max_size=experts),
                            min_size=len(loads), max_size=len(loads)))
    version = draw(st.integers(1, 50))
    max_moves = draw(st.one_of(st.none(), st.integers(1, 6)))
    max_moves_total = draw(st.one_of(st.none(), st.integers(1, 10)))
    threshold = draw(st.sampled_from([0.0, 0.01, 0.05, 0.2]))
    return experts, ranks, redundant, loads, earlier, rpn, num_groups, version, max_moves, max_moves_total, threshold


@settings(max_examples=150, deadline=None)
@given(running_groups())
def test_plans_from_a_running_placement_stay_valid_bounded_never_worse_and_deterministic(g: tuple) -> None:
    experts, ranks, redundant, loads, earlier, rpn, num_groups, version, max_moves, max_moves_total, threshold = g
    slots = ExpertPlacement.static(len(loads), experts, ranks, redundant).slots_per_rank
    start = rebalance(earlier, ranks, slots, redundant=redundant, ranks_per_node=rpn, num_groups=num_groups,
                      version=version)
    check_valid(start)

    def core_on(current: ExpertPlacement) -> BalancerCore:
        core = BalancerCore(current, window_s=30.0, threshold=threshold, max_moves=max_moves,
                            max_moves_total=max_moves_total, redundant=redundant, ranks_per_node=rpn,
                            num_groups=num_groups)
        core.observe(loads, version=current.version, now=0.0)
        return core

    core = core_on(start)
    for _ in range(4):  # several plan/adopt rounds under the same load
        d = core.plan(1.0)
        again = core_on(core.current).plan(1.0)
        assert again == d  # the same table and reports give the same decision
        if d is None:
            break
        check_valid(d.placement)
        assert d.placement.version == core.current.version + 1
        before, after = ratios(core.current, loads), ratios(d.placement, loads)
        assert d.changed
        for i in range(len(loads)):
            assert after[i] <= before[i] + 1e-9  # never worse, whatever the threshold
            assert d.after[i] == pytest.approx(after[i]) and d.before[i] == pytest.approx(before[i])
            moved = sum(1 for a, b in zip(core.current.layers[i], d.placement.layers[i], strict=True)
                        if a != b and b != EMPTY)
            assert moved == d.moves[i]
            assert max_moves is None or moved <= max_moves
        assert max_moves_total is None or sum(d.moves) <= max_moves_total
        core.adopt(d.placement)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 100), st.integers(0, 50)), min_size=1, max_size=8),
       st.floats(1, 50), st.floats(0, 200))
def test_window_keeps_exactly_the_recent_reports(reports: list, window: float, now: float) -> None:
    core = BalancerCore.for_group(1, 2, 1, window_s=window)
    for at, x in reports:
        core.observe([[x, 1]], version=0, now=at)
    # Each observe(now=at) expires too: a report is gone once any later call's time is past its window.
    got = core.window_loads(now)[0][0]
    kept = [(at, x) for i, (at, x) in enumerate(reports)
            if all(later - at <= window for later, _ in reports[i:]) and now - at <= window]
    assert got == sum(x for _, x in kept)
    assert core.reports == len(kept)
