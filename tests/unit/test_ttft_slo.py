"""TTFT SLOs (router_core): a request predicted to miss its time-to-first-token SLO is refused with
`overloaded` — at arrival when the backlog alone misses it, at its first placement when the chosen worker's
predicted prefill does — before any prefill is spent on it; the predictor's error is kept per request."""

from __future__ import annotations

import pytest

from deepinfer.gateway.errors import ApiError
from deepinfer.gateway.openai_requests import ParseContext, parse_completion
from deepinfer.protocol.client_requests import build_request
from deepinfer.protocol.messages import ErrorReply, PrefillJob, RequestFinished, TextDeltaItem
from deepinfer.services.router_state import RouterConfig
from tests.unit.test_router_core import Mesh, assert_clean, msgs

RATE = 100.0  # the prefill worker's measured tokens/s: 10 prompt tokens predict 0.1 s


def slo_mesh(queued: int = 0, **config) -> Mesh:
    mesh = Mesh(RouterConfig(heartbeat_timeout_s=3.0, **config), tok0="tokenizer", dec0="decode")
    mesh.beat("pre0", "prefill", tokens_per_s=RATE, queued_prompt_tokens=queued)
    return mesh


def test_a_backlog_that_alone_misses_the_slo_is_refused_at_arrival() -> None:
    mesh = slo_mesh(queued=500, default_ttft_slo_s=2.0)  # 5 s of prompt tokens queued ahead
    [out] = mesh.generate()
    err = out.msg
    assert isinstance(err, ErrorReply) and err.code == "overloaded" and "over the SLO of 2s" in err.message
    assert err.retry_after_s == pytest.approx(3.0)  # the excess
    assert mesh.core.metrics.shed == {"ttft_slo": 1} and mesh.core.metrics.admitted == 0


def test_a_prefill_predicted_to_miss_the_slo_ends_before_any_work_is_sent() -> None:
    mesh = slo_mesh(default_ttft_slo_s=2.0)
    enc = mesh.admit(n=300)  # no backlog: admitted; 300 tokens at 100/s predict 3 s
    out = mesh.encoded(enc)
    assert not msgs(out, PrefillJob)
    [err] = msgs(out, ErrorReply)
    assert err.code == "overloaded" and "predicted time to first token is 3.00s" in err.message
    assert mesh.core.metrics.shed == {"ttft_slo": 1}
    assert_clean(mesh.core)


def test_a_request_within_its_slo_runs_and_its_prediction_error_is_kept() -> None:
    mesh = slo_mesh(default_ttft_slo_s=2.0)
    job = mesh.placed(n=100)  # predicts 1 s
    assert mesh.core.request(job.request_id).predicted_ttft_s == pytest.approx(1.0)
    mesh.now = 1.5
    mesh.done(job)
    out = mesh.deltas(TextDeltaItem(job.request_id, 0, "z", [5], True, "length"), worker="pre0")
    assert msgs(out, RequestFinished)
    assert list(mesh.core.metrics.ttft_over_predicted) == [pytest.approx(1.5)]
    assert_clean(mesh.core)


def test_a_request_may_tighten_its_tenants_slo_never_loosen_it() -> None:
    mesh = slo_mesh(ttft_slo_s={"key-a": 2.0})
    assert mesh.placed(n=100, api_key="key-a")  # 1 s predicted, within 2 s
    loose = mesh.admit(n=300, api_key="key-a", ttft_slo_s=60.0)  # asks for 60 s: the tenant's 2 s holds
    assert msgs(mesh.encoded(loose), ErrorReply)[0].code == "overloaded"
    [tight] = mesh.generate(n=50, api_key="key-a", ttft_slo_s=0.2)  # the first's 1 s is ahead of it
    assert tight.msg.code == "overloaded" and "over the SLO of 0.2s" in tight.msg.message
    other = mesh.admit(n=300, ttft_slo_s=None)  # another tenant, no SLO: placed however long
    assert msgs(mesh.encoded(other), PrefillJob)
    assert mesh.core.metrics.shed == {"ttft_slo": 2}


def test_a_request_that_waited_parked_past_its_slo_is_refused_when_a_worker_comes() -> None:
    mesh = Mesh(RouterConfig(heartbeat_timeout_s=3.0, default_ttft_slo_s=2.0), tok0="tokenizer", dec0="decode")
    mesh.beat("pre0", "prefill", tokens_per_s=RATE)
    mesh.admit(n=10)  # a worker pair took requests: a new one is parked while pre0 is away
    mesh.now = 4.0
    mesh.beat("tok0", "tokenizer")
    mesh.beat("dec0", "decode")
    mesh.core.tick(mesh.now)  # pre0 silent for 4 s: dead
    late = mesh.admit(n=10)
    assert mesh.encoded(late) == []  # parked
    mesh.now = 6.5
    mesh.beat("tok0", "tokenizer")
    mesh.beat("dec0", "decode")
    out = mesh.beat("pre0", "prefill", incarnation="i1", tokens_per_s=RATE)
    assert [e.code for e in msgs(out, ErrorReply)] == ["overloaded"]  # 2.5 s waited, 0.1 s to go: over 2 s


def test_bad_slos_are_refused() -> None:
    mesh = slo_mesh()
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        [out] = mesh.generate(ttft_slo_s=bad)
        assert out.msg.code == "invalid_request" and "ttft_slo_s" in out.msg.message
    with pytest.raises(ValueError):
        RouterConfig(default_ttft_slo_s=0.0)
    with pytest.raises(ValueError):
        RouterConfig(ttft_slo_s={"k": -2.0})


def test_clients_and_the_gateway_pass_a_requests_slo_on() -> None:
    assert build_request("r", "hi", None, None, False, 0, None, None, {"ttft_slo_s": 0.5}).ttft_slo_s == 0.5
    ctx = ParseContext("m", 100)
    plan = parse_completion({"model": "m", "prompt": "hi", "ttft_slo_s": 0.75}, ctx)
    assert plan.requests[0].kwargs()["ttft_slo_s"] == 0.75
    with pytest.raises(ApiError):
        parse_completion({"model": "m", "prompt": "hi", "ttft_slo_s": -1}, ctx)
