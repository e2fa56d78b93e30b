"""bench/replay_sweep.py's arithmetic: arrivals at a load, goodput within the SLO, and the targets read off."""

from __future__ import annotations

import pytest

from bench.replay_sweep import ARMS, arms_for, at_rate, pooled, servable_reusable, targets, with_goodput
from bench.trace import ScaledRequest


def request(i: int, arrival_s: float) -> ScaledRequest:
    return ScaledRequest(i, arrival_s, (1, 2, 3), 4, (i,))


def test_arrivals_are_rescaled_to_the_asked_rate_keeping_their_shape() -> None:
    trace = [request(0, 0.0), request(1, 1.0), request(2, 4.0), request(3, 8.0)]  # 4 requests over 8 s: 0.5/s
    fast = at_rate(trace, 2.0)  # four times the rate: a quarter of the span
    assert [r.arrival_s for r in fast] == pytest.approx([0.0, 0.25, 1.0, 2.0])
    assert [r.prompt for r in fast] == [r.prompt for r in trace]
    assert at_rate([request(0, 0.0)], 3.0)[0].arrival_s == 0.0  # one arrival: nothing to scale


def row(ttft_s: float | None = None, error: str | None = None, finished_s: float = 10.0) -> dict:
    base = {"prompt_tokens": 100, "late_s": 0.0, "finished_s": finished_s}
    if error is not None:
        return {**base, "error": error}
    return {**base, "cached_tokens": 50, "cached_by_tier": {"device": 30, "disk": 20}, "ttft_s": ttft_s,
            "completion_tokens": 8}


def test_goodput_counts_answers_within_the_slo_per_second_of_the_run() -> None:
    rows = [row(1.0), row(4.9), row(7.0), row(error="overloaded", finished_s=2.0), row(error="worker_lost")]
    s = with_goodput(rows, slo_s=5.0, reusable_kv=0.625)
    assert (s["met_slo"], s["admitted_over_slo"], s["refused"]) == (2, 1, 1)
    assert s["goodput_req_s"] == pytest.approx(2 / 10.0)
    assert s["hit_rate"] == pytest.approx(0.5) and s["hit_of_reusable"] == pytest.approx(0.8)
    # 5 requests, the last arriving at 2.5 s: no policy answers more than 5 / 2.5 s within the SLO.
    arrived = [{**r, "arrival_s": 0.5 * i} for i, r in enumerate(rows, start=1)]
    assert with_goodput(arrived, slo_s=5.0, reusable_kv=0.625)["goodput_ceiling_req_s"] == pytest.approx(2.0)


def test_repeated_runs_pool_their_requests_and_sum_their_wall_times() -> None:
    first = [{**row(1.0), "arrival_s": 1.0}, {**row(6.0, finished_s=8.0), "arrival_s": 2.0}]  # 10 s wall: 1 met
    second = [{**row(2.0, finished_s=12.0), "arrival_s": 1.0}, {**row(3.0, finished_s=4.0), "arrival_s": 2.0}]
    s = pooled([first, second], slo_s=5.0, reusable_kv=0.625, servable_kv=[0.5, 0.7])
    assert (s["ok"], s["met_slo"], s["admitted_over_slo"], s["runs"]) == (4, 3, 1, 2)
    assert s["wall_s"] == pytest.approx(22.0) and s["goodput_req_s"] == pytest.approx(3 / 22)
    assert s["goodput_runs"] == [pytest.approx(1 / 10), pytest.approx(2 / 12)]
    assert (s["ttft_p50_s"], s["ttft_p99_s"]) == (2.0, 6.0)  # over all four requests: 1, 2, 3, 6 s
    assert s["hit_of_servable"] == pytest.approx(0.5 / 0.6)
    assert s["goodput_ceiling_req_s"] == pytest.approx(1.0)  # one run's: 2 requests by 2 s
    assert pooled([first], 5.0, 0.625, [0.5]) == with_goodput(first, 5.0, 0.625, 0.5)


def test_servable_reuse_counts_only_prefixes_an_answered_request_computed() -> None:
    """Two conversations of two turns (each turn's prompt extends the first's 4 blocks of 16 tokens by one more):
    with every request answered, each second turn can reuse its 64-token prefix; with conversation A's first turn
    refused, A's second turn can reuse nothing."""
    def turn(i: int, conv: int, blocks: int) -> ScaledRequest:
        return ScaledRequest(i, float(i), tuple(range(16 * blocks)), 4, tuple(100 * conv + b for b in range(blocks)))

    requests = [turn(0, 1, 4), turn(1, 2, 4), turn(2, 1, 5), turn(3, 2, 5)]
    answered = [{"index": i} for i in range(4)]
    assert servable_reusable(requests, answered, block_tokens=16) == pytest.approx(128 / 288)
    a_refused = [{"index": 0, "error": "overloaded"}, {"index": 1}, {"index": 2}, {"index": 3}]
    assert servable_reusable(requests, a_refused, block_tokens=16) == pytest.approx(64 / 224)
    s = with_goodput([row(1.0)], slo_s=5.0, reusable_kv=0.625, servable_kv=0.5)
    assert (s["hit_of_reusable"], s["hit_of_servable"]) == (pytest.approx(0.8), pytest.approx(1.0))


def point(goodput: float, p50: float, p99: float, hit: float = 0.97, over: int = 0) -> dict:
    return {"goodput_req_s": goodput, "ttft_p50_s": p50, "ttft_p99_s": p99, "hit_of_reusable": hit,
            "admitted_over_slo": over}


def test_targets_are_each_judged_at_each_load() -> None:
    points = {"1": {"full": point(0.5, 0.3, 4.0), "cache off": point(0.4, 2.0, 3.0, hit=0.0),
                    "always remote": point(0.45, 0.4, 5.0), "always local": point(0.55, 0.2, 3.0)},
              "4": {"full": point(0.6, 1.0, 5.0, hit=0.9, over=2), "no admission": point(0.3, 9.0, 30.0),
                    "always remote": point(0.7, 1.0, 5.0)}}
    got = dict(targets(points, reusable_kv=0.6))
    verdict = {what.split(" (")[0]: met for what, met in got.items()}
    assert verdict == {
        "1x: hit rate >= 0.95 of reusable": True, "1x: cache-on TTFT p50 <= cache-off's": True,
        "1x: cache-on TTFT p99 <= cache-off's": False, "1x: TTFT p50 >= 1.3x better with the cache": True,
        "1x: conditional goodput >= always remote's": True, "1x: conditional goodput >= always local's": False,
        "1x: every admitted request within its SLO": True,
        "4x: hit rate >= 0.95 of reusable": False, "4x: conditional goodput >= always remote's": False,
        "4x: goodput >= 1.5x no admission's": True, "4x: every admitted request within its SLO": False}


def test_each_arm_differs_from_the_full_policy_in_one_thing() -> None:
    arms = arms_for(slo_s=5.0, local_prefill=512)
    assert tuple(arms) == ARMS
    full = arms["full"]
    assert full.cache and full.router_options == {"default_ttft_slo_s": 5.0, "local_prefill_max_tokens": 512}
    assert not arms["cache off"].cache and arms["cache off"].router_options == full.router_options
    assert arms["always fetch"].worker_options == {"fetch_policy": "always"}
    assert arms["always remote"].router_options["local_prefill_max_tokens"] == 0
    assert arms["always local"].router_options == {**full.router_options, "prefill_site": "local"}
    assert "default_ttft_slo_s" not in arms["no admission"].router_options
    assert arms["no admission"].router_options["max_queue_wait_s"] >= 1e9  # never, in practice
