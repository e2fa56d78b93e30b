"""Fetch or recompute (cache.fetch_plan): scripted rates in, plans out."""

from __future__ import annotations

import pytest

from deepinfer.cache.fetch_plan import (
    ALWAYS,
    DEADLINE_SLACK,
    FASTER,
    MIN_DEADLINE_S,
    MISS,
    PROBE,
    SLOWER,
    UNMEASURED,
    FetchPlanner,
    leading_run,
)

BS = 16
RATE = 320.0  # prefill tokens/s: one block costs 50 ms to compute
COMPUTE_S = BS / RATE


def measured(**per_block_s: float) -> FetchPlanner:
    planner = FetchPlanner(BS)
    for tier, seconds in per_block_s.items():
        planner.observe([tier] * 4, 4 * seconds)
    return planner


def test_the_leading_run_stops_at_the_first_block_the_daemon_does_not_hold() -> None:
    assert leading_run(["host", "disk", "", "host"]) == 2
    assert leading_run(["", "host"]) == 0
    assert leading_run([]) == 0


def test_a_miss_and_an_unknown_compute_rate() -> None:
    planner = FetchPlanner(BS)
    assert planner.plan(["", "disk"], RATE).decision == MISS
    plan = planner.plan(["host", "disk", ""], 0.0)  # no step measured yet: fetch what is there, as before
    assert (plan.blocks, plan.deadline_s, plan.decision, plan.first_tier) == (2, 1.0, UNMEASURED, "host")


def test_unmeasured_tiers_are_fetched_so_they_get_measured() -> None:
    plan = FetchPlanner(BS).plan(["disk"] * 8, RATE)
    assert (plan.blocks, plan.decision) == (8, FASTER)
    assert plan.deadline_s == pytest.approx(DEADLINE_SLACK * 8 * COMPUTE_S)  # bounded by computing them


def test_tiers_faster_than_computing_are_fetched_whole() -> None:
    planner = measured(host=COMPUTE_S / 20, disk=COMPUTE_S / 4)
    plan = planner.plan(["host"] * 3 + ["disk"] * 5, RATE)
    assert (plan.blocks, plan.decision) == (8, FASTER)
    assert planner.computed_blocks == 0


def test_a_slow_disk_behind_a_fast_host_splits_the_prefix() -> None:
    planner = measured(host=COMPUTE_S / 20, disk=COMPUTE_S * 3)
    plan = planner.plan(["host"] * 3 + ["disk"] * 5, RATE)
    assert (plan.blocks, plan.decision) == (3, FASTER)  # load the head, compute the rest
    assert plan.deadline_s == pytest.approx(DEADLINE_SLACK * 3 * COMPUTE_S)
    assert planner.computed_blocks == 5


def test_a_short_slow_stretch_is_crossed_when_what_follows_repays_it() -> None:
    # host, one slow disk block, then many fast host blocks: fetching all gains more than stopping at the first
    planner = measured(host=COMPUTE_S / 10, disk=COMPUTE_S * 2)
    assert planner.plan(["host", "disk"] + ["host"] * 6, RATE).blocks == 8
    assert planner.plan(["host", "disk", "disk", "disk"], RATE).blocks == 1


def test_a_prefix_slower_to_fetch_is_computed_and_probed_now_and_then() -> None:
    planner = measured(disk=COMPUTE_S * 2)
    plans = [planner.plan(["disk"] * 4, RATE) for _ in range(2 * planner.probe_every)]
    probes = [i for i, p in enumerate(plans) if p.decision == PROBE]
    assert probes == [planner.probe_every - 1, 2 * planner.probe_every - 1]
    assert all(p.decision == SLOWER and p.blocks == 0 for i, p in enumerate(plans) if i not in probes)
    assert plans[probes[0]].blocks == 4 and plans[probes[0]].deadline_s == pytest.approx(
        DEADLINE_SLACK * 4 * COMPUTE_S)
    assert planner.decisions == {SLOWER: 30, PROBE: 2}
    # The probe finds the disk fast again: the next plan fetches.
    for _ in range(10):
        planner.observe(["disk"] * 4, 4 * COMPUTE_S / 10)
    assert planner.plan(["disk"] * 4, RATE).decision == FASTER


def test_always_fetches_every_hit_however_slow_and_still_measures() -> None:
    planner = measured(disk=COMPUTE_S * 3)
    planner.always = True
    plan = planner.plan(["disk"] * 4 + [""], RATE)  # slower than computing: the plan would compute it
    assert (plan.blocks, plan.deadline_s, plan.decision, plan.first_tier) == (4, planner.max_deadline_s, ALWAYS,
                                                                              "disk")
    assert planner.plan(["", "disk"], RATE).decision == MISS
    planner.observe(["disk"] * 4, 4 * COMPUTE_S)
    assert planner.fetch_s_per_block["disk"] < COMPUTE_S * 3
    assert planner.computed_blocks == 0


def test_a_fetch_time_is_split_over_its_tiers_by_their_estimates() -> None:
    planner = measured(host=0.001, disk=0.004)
    planner.alpha = 1.0  # take each sample whole, to read it
    planner.observe(["host", "disk", "disk"], 0.018)  # estimates 1:4, so host 0.002 per block, disk 0.008
    assert planner.fetch_s_per_block == pytest.approx({"host": 0.002, "disk": 0.008})
    fresh = FetchPlanner(BS, alpha=1.0)
    fresh.observe(["host", "disk"], 0.01)  # nothing known: equal shares
    assert fresh.fetch_s_per_block == pytest.approx({"host": 0.005, "disk": 0.005})


def test_a_fetch_that_brought_nothing_teaches_that_its_tier_is_slow() -> None:
    planner = FetchPlanner(BS)
    planner.observe([], 0.5)  # nothing asked, nothing learnt
    assert planner.fetch_s_per_block == {}
    planner.observe([], 0.5, first_asked="disk")  # the deadline passed before the first disk block
    assert planner.fetch_s_per_block == {"disk": 0.5}
    assert planner.plan(["disk"] * 4, RATE).decision == SLOWER


def test_deadlines_stay_within_bounds() -> None:
    planner = FetchPlanner(BS, max_deadline_s=2.0)
    assert planner.plan(["host"], 1e9).deadline_s == MIN_DEADLINE_S  # a block computes in nanoseconds
    assert planner.plan(["host"] * 1000, RATE).deadline_s == 2.0
