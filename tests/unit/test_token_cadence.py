"""The time per output token a worker measures by batch size, and the router's prediction from it
(services/token_cadence)."""

from __future__ import annotations

import pytest

from deepinfer.services.token_cadence import CadenceMeter, bucket_of, predict_tpot


def test_batch_sizes_fall_in_power_of_two_buckets() -> None:
    assert [bucket_of(r) for r in (1, 2, 3, 4, 7, 8, 15, 16, 1000)] == [0, 1, 1, 2, 2, 3, 3, 4, 9]


def test_a_bucket_is_reported_only_after_enough_steps_and_follows_its_steps() -> None:
    meter = CadenceMeter(alpha=0.5, min_samples=3)
    meter.record(1, 1, 0.010)
    meter.record(1, 1, 0.010)
    assert meter.points() == []
    meter.record(1, 1, 0.020)
    [(rows, s)] = meter.points()
    assert rows == 1 and s == pytest.approx(0.015)  # 0.010, then halfway to 0.020


def test_a_stream_that_got_several_tokens_in_a_step_waited_less_for_each() -> None:
    meter = CadenceMeter(min_samples=1)
    meter.record(4, 8, 0.040)  # speculation: 4 streams, 2 tokens each in a 40 ms step
    assert meter.points() == [(4.0, pytest.approx(0.020))]


def test_steps_that_gave_nothing_or_took_no_time_teach_nothing() -> None:
    meter = CadenceMeter(min_samples=1)
    for streams, tokens, interval in ((0, 0, 0.01), (2, 0, 0.01), (2, 2, 0.0), (2, 2, float("nan"))):
        meter.record(streams, tokens, interval)
    assert meter.points() == []


def test_points_come_fewest_rows_first_with_the_mean_rows_of_each_bucket() -> None:
    meter = CadenceMeter(alpha=1.0, min_samples=1)
    meter.record(9, 9, 0.09)
    meter.record(1, 1, 0.02)
    meter.record(3, 3, 0.04)
    assert meter.points() == [(1.0, 0.02), (3.0, 0.04), (9.0, 0.09)]


def test_prediction_interpolates_holds_below_and_grows_in_proportion_past_the_last_point() -> None:
    points = [(1.0, 0.02), (3.0, 0.04), (9.0, 0.09)]
    assert predict_tpot([], 5) is None
    assert predict_tpot(points, 1) == pytest.approx(0.02)
    assert predict_tpot(points, 2) == pytest.approx(0.03)
    assert predict_tpot(points, 6) == pytest.approx(0.04 + 0.05 * 3 / 6)
    assert predict_tpot(points, 18) == pytest.approx(0.18)  # twice the last point's rows: twice its time
    assert predict_tpot([(2.0, 0.05)], 1) == pytest.approx(0.05)  # below the first point: its time
