"""The speculation controller, driven directly: exact choices from recorded costs and acceptance, no clocks."""

from __future__ import annotations

import itertools
import random
import time

import pytest

from deepinfer.engine.speculative.controller import MIN_GAIN, SAMPLES, STALE_STEPS, CostCurve, SpecController

BUCKET_ROWS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128]


def offers(n: int, k: int, conf: list[float] | None = None) -> list[tuple[str, int, list[float] | None]]:
    return [(f"r{i}", k, conf) for i in range(n)]


def accept_all(sc: SpecController, rid: str, k: int = 4, times: int = 30) -> None:
    for _ in range(times):
        sc.record_acceptance(rid, k, k)


def objective(sc: SpecController, alphas: list[float], ks: list[int], base_rows: int) -> float:
    tokens = base_rows + sc.draft_value * sum(sum(a ** j for j in range(1, k + 1)) for a, k in zip(alphas, ks))
    return tokens / sc.step_cost(base_rows + sum(ks))


# -- the choice -------------------------------------------------------------------------------


def test_flat_cost_and_high_acceptance_speculate_up_to_the_cap():
    sc = SpecController(4, explore_every=0)
    for r in BUCKET_ROWS:
        sc.record_step(r, 0.010 + 1e-7 * r)  # weights-bound: rows nearly free
    for i in range(4):
        accept_all(sc, f"r{i}")
    assert sc.acceptance("r0") > 0.95
    assert sc.choose(offers(4, 6), base_rows=4) == [4, 4, 4, 4]


def test_steep_cost_turns_speculation_off():
    sc = SpecController(4, explore_every=0)
    for r in BUCKET_ROWS:
        sc.record_step(r, 0.010 * r)  # every row costs as much as a whole one-row step
    for i in range(8):
        accept_all(sc, f"r{i}")
    assert sc.choose(offers(1, 4), base_rows=1) == [0]
    assert sc.choose(offers(8, 4), base_rows=8) == [0] * 8
    assert sc.choose(offers(8, 4), base_rows=40) == [0] * 8  # a step with prefill rows too


def test_drafts_near_break_even_are_left_unspent():
    # 32 requests, a row costs 1% of the step, each request's first draft token is expected to commit 0.4
    # (1.25% of the step's 32 tokens): worth it on the estimates, not by the margin the estimates need.
    def choose(draft_value: float) -> list[int]:
        sc = SpecController(4, explore_every=0, prior_acceptance=0.4, draft_value=draft_value)
        for r in BUCKET_ROWS:
            sc.record_step(r, 0.090 * (1 + 0.01 * (r - 32)) if r >= 32 else 0.090 * r / 32)
        return sc.choose(offers(32, 4), base_rows=32)

    assert sum(choose(1.0)) > 0
    assert choose(0.75) == [0] * 32
    # A single request whose drafts return many times their row still speculates to the cap.
    sc = SpecController(4, explore_every=0)
    for r in BUCKET_ROWS:
        sc.record_step(r, 0.010 + 5e-4 * r)
    accept_all(sc, "r0")
    assert sc.choose(offers(1, 4), base_rows=1) == [4]
    with pytest.raises(ValueError):
        SpecController(4, draft_value=0.0)


def test_acceptance_near_zero_turns_speculation_off():
    sc = SpecController(4, explore_every=0)  # prior cost: a row is 2.5% of a one-row step
    for _ in range(20):
        sc.record_acceptance("r0", 4, 0)
    # The prior's pseudo-trials age like evidence, so the estimate goes towards 0 rather than a floor.
    assert sc.acceptance("r0") < 0.02
    assert sc.choose(offers(1, 4), base_rows=1) == [0]
    assert sc.choose([("new", 4, None)], base_rows=1) == [4]  # an unknown request starts at the prior


def test_mixed_batch_gives_high_acceptance_requests_tokens_first():
    sc = SpecController(4, explore_every=0)
    for rows, seconds in [(2, 0.0100), (4, 0.0102), (6, 0.0300), (8, 0.0500)]:
        sc.record_step(rows, seconds)  # two extra rows nearly free, then steep
    accept_all(sc, "hi")
    for _ in range(30):
        sc.record_acceptance("lo", 4, 0)
        sc.record_acceptance("lo", 1, 1)
    assert sc.acceptance("hi") > 0.9 and sc.acceptance("lo") < 0.6
    assert sc.choose([("lo", 4, None), ("hi", 4, None)], base_rows=2) == [0, 2]


def test_the_choice_is_the_exact_optimum_for_any_cost_shape():
    rng = random.Random(7)
    for trial in range(30):
        sc = SpecController(3, explore_every=0)
        seconds = 0.01
        for r in BUCKET_ROWS[:9]:
            seconds += rng.choice([0.0, 1e-4, 2e-3, 8e-3])  # flat stretches and jumps, like tile boundaries
            sc.record_step(r, seconds)
        alphas = [rng.uniform(0.05, 0.95) for _ in range(3)]
        for i, a in enumerate(alphas):
            sc._acc[f"r{i}"] = [a, 1.0]  # pin the estimate exactly
        base = rng.randint(3, 10)
        ks = sc.choose(offers(3, 3), base_rows=base)
        best = max(objective(sc, alphas, list(c), base) for c in itertools.product(range(4), repeat=3))
        assert objective(sc, alphas, ks, base) == pytest.approx(best, rel=1e-12), trial


def test_choose_respects_each_offer_and_the_cap():
    sc = SpecController(4, prior_acceptance=0.9, step_seconds=0.01, row_seconds=1e-8, explore_every=0)
    assert sc.choose([("a", 2, None), ("b", 0, None), ("c", 5, None), ("d", -1, None)], base_rows=4) == [2, 0, 4, 0]
    assert sc.choose([], base_rows=4) == []
    rng = random.Random(1)
    for _ in range(50):
        sc = SpecController(rng.randint(1, 8), prior_acceptance=rng.random(), row_seconds=rng.choice([1e-6, 1e-3]))
        offered = [(f"r{i}", rng.randint(0, 10), None) for i in range(rng.randint(0, 20))]
        ks = sc.choose(offered, base_rows=len(offered) + rng.randint(0, 50))
        assert all(0 <= k <= min(sc.max_k, o[1]) for k, o in zip(ks, offered))


def test_non_adaptive_returns_the_cap_or_the_offer():
    sc = SpecController(4, adaptive=False)
    for r in BUCKET_ROWS:
        sc.record_step(r, 0.010 * r)  # costs are ignored
    sc.record_acceptance("a", 4, 0)
    assert sc.choose([("a", 7, None), ("b", 3, None), ("c", 0, None)], base_rows=3) == [4, 3, 0]


def test_confidences_blend_with_the_estimate():
    conf = [0.99, 0.99, 0.0, 0.9]
    trusted = SpecController(4, step_seconds=0.01, row_seconds=1e-8, confidence_weight=1.0, explore_every=0)
    assert trusted.choose(offers(1, 4, conf), base_rows=1) == [2]  # nothing pays after a certain rejection
    ignored = SpecController(4, step_seconds=0.01, row_seconds=1e-8, confidence_weight=0.0, explore_every=0)
    assert ignored.choose(offers(1, 4, conf), base_rows=1) == [4]  # the prior 0.5 everywhere
    # Blended, the third token's chance is 0.5 * 0 + 0.5 * 0.5: cheap rows still take it.
    assert SpecController(4, row_seconds=1e-8, explore_every=0).choose(offers(1, 4, conf), base_rows=1) == [4]
    # Confidences shorter than the offer fall back to the estimate for the rest.
    assert trusted.choose(offers(1, 4, [0.99]), base_rows=1) == [4]


def test_a_costly_proposer_pays_for_its_draft_forwards():
    for costly_seconds, expected in [(1e-7, [4, 4]), (0.05, [0, 0])]:
        sc = SpecController(4, step_seconds=0.01, row_seconds=1e-7, explore_every=0)
        accept_all(sc, "r0")
        accept_all(sc, "r1")
        for r in BUCKET_ROWS:
            sc.record_draft(r, costly_seconds)
        assert sc.choose(offers(2, 4), base_rows=2, costly=True) == expected
        assert sc.choose(offers(2, 4), base_rows=2) == [4, 4]  # a cheap proposer's choice ignores them


# -- the cost model ---------------------------------------------------------------------------


def test_cost_curve_interpolates_extrapolates_and_stays_monotone():
    c = CostCurve(0.02, 0.0005)
    assert c.costs(1, 3) == pytest.approx([0.0205, 0.021, 0.0215])  # the prior before any measurement
    c.record(4, 0.01)
    c.record(12, 0.03)
    assert c(4) == pytest.approx(0.01) and c(12) == pytest.approx(0.03)
    assert c(8) == pytest.approx(0.02)  # linear between measured buckets
    assert c(2) == pytest.approx(0.01 * 0.021 / 0.022)  # below: the prior's shape through the first point
    assert c(16) == pytest.approx(0.04)  # above: the last measured slope, steeper than the scaled prior's
    assert c.costs(2, 15) == pytest.approx([c(t) for t in range(2, 17)])
    c.record(16, 0.02)  # noise below an earlier point must not make more rows look cheaper
    assert c(16) == pytest.approx(0.03) and c(14) == pytest.approx(0.03)
    c.record(5, 0.02)  # bucket [4, 6): mean rows, lower median seconds
    assert c.points[3][:2] == pytest.approx([4.5, 0.01])
    c.record(5, 0.015)
    assert c.points[3][:2] == pytest.approx([14 / 3, 0.015])
    c.record(0, 1.0)
    c.record(3, float("nan"))
    c.record(3, -1.0)
    assert c.records == 5
    with pytest.raises(ValueError):
        CostCurve(0.0, 0.0)


def test_a_bucket_shrugs_off_a_slow_step_and_follows_a_lasting_change():
    c = CostCurve(0.02, 0.0005)
    for _ in range(SAMPLES):
        c.record(4, 0.010)
    c.record(4, 0.200)  # one step descheduled for 190 ms
    assert c(4) == pytest.approx(0.010)
    for _ in range(SAMPLES // 2 - 1):
        c.record(4, 0.200)
    assert c(4) == pytest.approx(0.010)  # half the window slow: still the typical step
    c.record(4, 0.020)  # a majority of steps now cost more: the curve follows
    assert c(4) == pytest.approx(0.020)


def test_one_slow_verification_step_does_not_turn_speculation_off():
    # Rows nearly free, acceptance high: speculate to the cap. One step that took 20x longer (a VM
    # pause) used to lift its bucket's cost by 5x for the next steps and switch speculation off until
    # exploration re-measured the bucket; it must leave the choice as it was.
    sc = SpecController(4, explore_every=0)
    for r in BUCKET_ROWS:
        for _ in range(3):
            sc.record_step(r, 0.010 + 1e-5 * r)
    accept_all(sc, "r0")
    assert sc.choose(offers(1, 4), base_rows=1) == [4]
    sc.record_step(5, 0.200)
    assert sc.choose(offers(1, 4), base_rows=1) == [4]


def test_exploration_learns_that_larger_steps_are_cheap():
    # The prior says every row costs a whole step; really rows are free. Without exploration the
    # controller would never leave k = 0 and never find out.
    def run(explore_every: int, steps: int) -> list[list[int]]:
        sc = SpecController(4, prior_acceptance=0.6, step_seconds=0.01, row_seconds=0.01, explore_every=explore_every)
        history = []
        for _ in range(steps):
            ks = sc.choose(offers(8, 4), base_rows=8)
            sc.record_step(8 + sum(ks), 0.01)
            history.append(ks)
        return history

    assert all(sum(ks) == 0 for ks in run(0, 200))
    history = run(8, 80)
    assert all(sum(ks) == 0 for ks in history[:7])
    assert sum(history[7]) > 0  # the 8th step measures the next bucket up (12 rows)
    assert all(sum(ks) > 0 for ks in history[8:])  # and the controller now speculates on its own
    assert [4] * 8 in history[-16:]  # climbing a bucket per exploration, up to the cap


def test_exploration_remeasures_a_stale_base():
    sc = SpecController(4, prior_acceptance=0.9, step_seconds=0.01, row_seconds=1e-6, explore_every=16)
    chosen = []
    for _ in range(STALE_STEPS + 48):
        ks = sc.choose(offers(1, 4), base_rows=1)
        sc.record_step(1 + sum(ks), 0.01)
        chosen.append(ks[0])
    # The step with no speculation (1 row, bucket 1) is never measured, so the 16th call speculates
    # nothing once to measure it; the next such probe waits until that measurement is stale again:
    # the first 16th call with STALE_STEPS records after call 16's.
    again = -(-(16 + STALE_STEPS + 1) // 16) * 16
    assert chosen[15] == 0 and chosen[again - 1] == 0 and chosen.count(0) == 2
    assert sc.explorations == 2


def test_a_rejected_request_is_retried_in_time():
    sc = SpecController(4, explore_every=0)
    for _ in range(40):
        sc.record_acceptance("r0", 4, 0)
    steps = 0
    while sc.choose(offers(1, 4), base_rows=1) == [0]:
        steps += 1
        assert steps < 200
    assert steps > 5  # not at once: the evidence fades at 1 - idle_decay per step
    assert sc.acceptance("r0") < sc.prior


# -- bookkeeping ------------------------------------------------------------------------------


def test_forget_drops_a_requests_estimate():
    sc = SpecController(4, prior_acceptance=0.3)
    accept_all(sc, "r0")
    assert sc.acceptance("r0") > 0.9
    sc.forget("r0")
    sc.forget("never-seen")
    assert sc.acceptance("r0") == sc.prior_rate == sc.pooled_acceptance > 0.9  # back to the pooled rate


def test_a_new_or_idle_request_starts_from_the_pooled_rate_never_below_the_prior():
    # A 2-row step at 1.4x a 1-row one: one draft pays only above ~0.53 (with the draft value's shading).
    sc = SpecController(4, explore_every=0)
    for rows, ms in [(1, 10.0), (2, 14.0), (3, 18.0), (5, 26.0)]:
        sc.record_step(rows, ms / 1e3)
    for i in range(10):  # requests before this one accepted nearly everything
        accept_all(sc, f"old{i}", times=3)
    assert sc.pooled_acceptance > 0.9
    assert sc.choose([("new", 4, None)], base_rows=1) == [4]  # starts at the pooled rate: worth the rows
    for _ in range(3):  # one stretch of rejections pushes its own estimate below break-even
        sc.record_acceptance("new", 4, 0)
    assert sc.choose([("new", 4, None)], base_rows=1) == [0]
    steps = 0
    while sc.choose([("new", 4, None)], base_rows=1) == [0]:  # idle, it drifts back to the pooled rate
        steps += 1
        assert steps < 200
    # With a fixed prior of 0.5 it would stay declined: its estimate drifts only to 0.5, below break-even.
    fixed = SpecController(4, explore_every=0)
    for rows, ms in [(1, 10.0), (2, 14.0), (3, 18.0), (5, 26.0)]:
        fixed.record_step(rows, ms / 1e3)
    for _ in range(3):
        fixed.record_acceptance("new", 4, 0)
    assert all(fixed.choose([("new", 4, None)], base_rows=1) == [0] for _ in range(400))
    # A pool made low by other text never starts a request below the prior.
    low = SpecController(4, prior_acceptance=0.5)
    for i in range(10):
        low.record_acceptance(f"chat{i}", 4, 0)
    assert low.pooled_acceptance < 0.1 and low.acceptance("new") == low.prior_rate == 0.5


def test_acceptance_rate_counters_and_choices():
    sc = SpecController(4, window=2, row_seconds=1e-8, explore_every=0)
    assert sc.acceptance_rate == 0.0
    sc.record_acceptance("a", 4, 4)
    sc.record_acceptance("a", 4, 0)
    assert sc.acceptance_rate == 0.5
    sc.record_acceptance("a", 2, 1)  # the first record leaves the window
    assert sc.acceptance_rate == pytest.approx(1 / 6)
    sc.record_acceptance("a", 0, 0)  # nothing proposed: nothing recorded
    start = sc.prior_rate  # a new request's estimate starts at the prior rate, over PRIOR_WEIGHT pseudo-trials
    sc.record_acceptance("b", 2, 5)  # clipped to what was proposed
    assert sc.acceptance("b") == pytest.approx((0.9 * 2 * start + 2) / (0.9 * 2.0 + 2))
    ks = sc.choose([("x", 4, None), ("y", 2, None), ("z", 0, None)], base_rows=3)
    assert ks == sc.last_choices == [4, 2, 0]
    sc.last_choices.append(9)  # a copy
    assert sc.last_choices == [4, 2, 0]
    assert sc.k_histogram == [0, 0, 1, 0, 1]  # "z" proposed nothing: no choice, counted apart
    assert sc.counters == {"steps": 1, "explorations": 0, "drafted": 6, "proposed": 12, "accepted": 7,
                           "unproposed": 1}
    assert MIN_GAIN < 0.01


def test_choose_time_for_128_requests_at_k8(capsys):
    """A benchmark, not a check: prints the time of one choose() call (timings are never asserted)."""
    sc = SpecController(8, prior_acceptance=0.7)
    for i in range(128):
        sc.record_acceptance(f"r{i}", 8, i % 9)
    for r in range(1, 1200, 7):
        sc.record_step(r, 0.02 + 1e-4 * r)
    batch = offers(128, 8)
    best = min(_timed(lambda: sc.choose(batch, base_rows=128)) for _ in range(7))
    with capsys.disabled():
        print(f"\nSpecController.choose, 128 requests, K=8: {best * 1e6:.0f} us per call")


def _timed(fn, n: int = 50) -> float:
    t0 = time.process_time()  # CPU time: other processes on the machine do not inflate it
    for _ in range(n):
        fn()
    return (time.process_time() - t0) / n
