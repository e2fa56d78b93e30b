"""TPOT SLOs (router_admission): at its first placement a request goes only to a decode worker whose measured
cadence predicts, with it added, tokens no slower than its SLO and than the SLOs promised to the streams already
there; with none it ends with `overloaded` before any prefill. The predictor's error is kept per request."""

from __future__ import annotations

import pytest

from deepinfer.gateway.errors import ApiError
from deepinfer.gateway.openai_requests import ParseContext, parse_completion
from deepinfer.protocol.client_requests import build_request
from deepinfer.protocol.messages import ErrorReply, PrefillJob, RequestFinished, TextDeltaItem
from deepinfer.services.router_state import RouterConfig
from tests.unit.test_router_core import Mesh, assert_clean, msgs

# A decode worker's measured seconds per token: 20 ms alone, 50 ms at four streams, 80 ms at eight.
CADENCE = [(1.0, 0.02), (4.0, 0.05), (8.0, 0.08)]


def tpot_mesh(**config) -> Mesh:
    mesh = Mesh(RouterConfig(heartbeat_timeout_s=3.0, **config), tok0="tokenizer", pre0="prefill")
    mesh.beat("dec0", "decode", tpot_by_batch=CADENCE)
    return mesh


def finish(mesh: Mesh, job: PrefillJob, tokens: int, seconds: float) -> list:
    """The request's first token now, its last `tokens - 1` tokens `seconds` later."""
    mesh.done(job)
    mesh.deltas(TextDeltaItem(job.request_id, 0, "a", [5], False), worker="dec0")
    mesh.now += seconds
    return mesh.deltas(TextDeltaItem(job.request_id, 1, "b", [6] * (tokens - 1), True, "length"), worker="dec0")


def test_a_request_within_its_tpot_slo_is_placed_promised_and_its_prediction_error_kept() -> None:
    mesh = tpot_mesh(default_tpot_slo_s=0.05)
    mesh.beat("dec0", "decode", tpot_by_batch=CADENCE, running=3)  # with the new stream: 4 rows, 50 ms
    job = mesh.placed()
    st = mesh.core.request(job.request_id)
    assert job.decode_worker == "dec0" and st.predicted_tpot_s == pytest.approx(0.05)
    assert mesh.core.table.get("dec0").tpot_slos == {0.05: 1}
    assert msgs(finish(mesh, job, tokens=11, seconds=0.6), RequestFinished)  # 60 ms per token
    assert list(mesh.core.metrics.tpot_over_predicted) == [pytest.approx(1.2)]
    assert_clean(mesh.core)  # the promise went with the request


def test_a_decode_worker_too_slow_for_the_slo_is_skipped_for_one_that_keeps_it() -> None:
    mesh = tpot_mesh(default_tpot_slo_s=0.04)
    mesh.beat("dec0", "decode", tpot_by_batch=CADENCE, running=7, free_blocks=5000)  # more room, 80 ms
    mesh.beat("dec1", "decode", tpot_by_batch=CADENCE, running=1)  # 2 rows: 30 ms
    job = mesh.placed()
    assert job.decode_worker == "dec1"
    assert mesh.core.metrics.shed == {}


def test_with_no_decode_worker_fast_enough_the_request_ends_overloaded_before_any_prefill() -> None:
    mesh = tpot_mesh(default_tpot_slo_s=0.04, retry_after_s=2.0)
    mesh.beat("dec0", "decode", tpot_by_batch=CADENCE, running=7)
    out = mesh.encoded(mesh.admit())
    assert not msgs(out, PrefillJob)
    [err] = msgs(out, ErrorReply)
    assert err.code == "overloaded" and "0.080s, over the SLO of 0.04s" in err.message
    assert err.retry_after_s == 2.0
    assert mesh.core.metrics.shed == {"tpot_slo": 1}
    assert_clean(mesh.core)


def test_a_new_stream_may_not_slow_a_worker_past_what_its_streams_were_promised() -> None:
    mesh = tpot_mesh(tpot_slo_s={"strict": 0.03})
    mesh.beat("dec0", "decode", tpot_by_batch=CADENCE)
    first = mesh.placed(api_key="strict")  # alone: 20 ms
    assert mesh.core.table.get("dec0").tightest_tpot_slo == 0.03
    assert mesh.placed().decode_worker == "dec0"  # no SLO of its own; two streams: 30 ms, the promise holds
    out = mesh.encoded(mesh.admit())  # a third stream would make it 40 ms
    [err] = msgs(out, ErrorReply)
    assert err.code == "overloaded" and "promised to one of them" in err.message
    mesh.beat("dec1", "decode", tpot_by_batch=CADENCE)  # another decode worker: the same request goes there
    assert mesh.placed().decode_worker == "dec1"
    assert first.decode_worker == "dec0"


def test_nothing_is_refused_where_nothing_was_measured_or_nothing_promised() -> None:
    mesh = Mesh(RouterConfig(heartbeat_timeout_s=3.0, default_tpot_slo_s=0.001), tok0="tokenizer",
                pre0="prefill", dec0="decode")  # dec0 reports no cadence yet
    job = mesh.placed()
    assert mesh.core.request(job.request_id).predicted_tpot_s is None
    mesh = tpot_mesh()  # cadence measured, no SLO anywhere: placed, its prediction kept for the metric
    mesh.beat("dec0", "decode", tpot_by_batch=CADENCE, running=100)
    job = mesh.placed()
    assert mesh.core.request(job.request_id).predicted_tpot_s == pytest.approx(0.08 * 101 / 8)


def test_a_request_may_tighten_its_tenants_tpot_slo_never_loosen_it() -> None:
    mesh = tpot_mesh(tpot_slo_s={"key-a": 0.03})
    mesh.beat("dec0", "decode", tpot_by_batch=CADENCE, running=2)  # 3 rows: 40 ms
    loose = mesh.encoded(mesh.admit(api_key="key-a", tpot_slo_s=1.0))
    assert msgs(loose, ErrorReply)[0].code == "overloaded"
    tight = mesh.encoded(mesh.admit(tpot_slo_s=0.035))  # another tenant, asking for 35 ms itself
    assert "over the SLO of 0.035s" in msgs(tight, ErrorReply)[0].message
    assert msgs(mesh.encoded(mesh.admit(tpot_slo_s=0.05)), PrefillJob)
    assert mesh.core.metrics.shed == {"tpot_slo": 2}


def test_bad_tpot_slos_are_refused() -> None:
    mesh = tpot_mesh()
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        [out] = mesh.generate(tpot_slo_s=bad)
        assert out.msg.code == "invalid_request" and "tpot_slo_s" in out.msg.message
    with pytest.raises(ValueError, match="TPOT"):
        RouterConfig(default_tpot_slo_s=0.0)
    with pytest.raises(ValueError, match="TPOT"):
        RouterConfig(tpot_slo_s={"k": float("nan")})


def test_clients_and_the_gateway_pass_a_requests_tpot_slo_on() -> None:
    assert build_request("r", "hi", None, None, False, 0, None, None, {"tpot_slo_s": 0.05}).tpot_slo_s == 0.05
    ctx = ParseContext("m", 100)
    plan = parse_completion({"model": "m", "prompt": "hi", "tpot_slo_s": 0.05}, ctx)
    assert plan.requests[0].kwargs()["tpot_slo_s"] == 0.05
    with pytest.raises(ApiError):
        parse_completion({"model": "m", "prompt": "hi", "tpot_slo_s": 0}, ctx)
