"""RouterCore's resumes (`router_resume`) driven with messages and a fake clock: a client whose connection came
back to the router that holds its request gets what it missed; a successor router admits the request again and
continues it from the client's output; each ends exactly once and leaves nothing behind."""

from __future__ import annotations

from typing import Any

from deepinfer.protocol.messages import (
    AbortRequest,
    EncodeRequest,
    ErrorReply,
    GenerateRequest,
    HeldRequest,
    HeldRequests,
    PrefillJob,
    Reclaim,
    RequestFinished,
    Resumed,
    ResumeRequest,
    SamplingParamsWire,
    StreamDelta,
    TextDeltaItem,
)
from deepinfer.services.router_core import RouterConfig
from deepinfer.services.router_resume import client_key
from tests.unit.test_router_core import C1, C2, Mesh, assert_clean, basic_mesh, msgs

PROMPT = [101, 102, 103, 104]


def gen(rid: str = "r", max_tokens: int = 8, **kw: Any) -> GenerateRequest:
    return GenerateRequest(rid, prompt_token_ids=PROMPT, params=SamplingParamsWire(max_tokens=max_tokens),
                           stream=True, **kw)


def resume(req: GenerateRequest, tokens: list[int], text: str = "", **kw: Any) -> ResumeRequest:
    return ResumeRequest(req.request_id, req, tokens, text, streamed=bool(tokens), **kw)


def run_to_decoding(mesh: Mesh, req: GenerateRequest, client: bytes = C1) -> PrefillJob:
    [enc] = msgs(mesh.core.on_generate(client, req, mesh.now), EncodeRequest)
    [job] = msgs(mesh.encoded(enc), PrefillJob)
    mesh.done(job)
    return job


def item(job: PrefillJob, offset: int, *tokens: int, **kw: Any) -> TextDeltaItem:
    return TextDeltaItem(job.request_id, offset, "".join(f"<{t}>" for t in tokens), list(tokens), **kw)


def test_a_client_back_on_the_same_router_gets_what_it_missed_then_the_rest() -> None:
    mesh = basic_mesh()
    req = gen()
    job = run_to_decoding(mesh, req)
    mesh.deltas(item(job, 0, 5, 6), worker="dec0")
    mesh.deltas(item(job, 2, 7), worker="dec0")  # lost on the way: the client had only the first delta
    out = mesh.core.on_resume(C1, resume(req, [5, 6], "<5><6>"), mesh.now)
    assert msgs(out) == [Resumed("r", 2), StreamDelta("r", "<7>", [7], 2, None)]
    assert mesh.core.metrics.resumes == {"attached": 1}
    [delta] = msgs(mesh.deltas(item(job, 3, 8), worker="dec0"))
    assert delta.offset == 3
    [end] = msgs(mesh.deltas(item(job, 4, 9, finished=True, finish_reason="stop"), worker="dec0"), RequestFinished)
    assert end.token_ids == [5, 6, 7, 8, 9] and end.text == "<5><6><7><8><9>"
    assert_clean(mesh.core)


def test_a_client_whose_output_is_not_the_requests_is_refused_and_the_request_ends() -> None:
    mesh = basic_mesh()
    req = gen()
    job = run_to_decoding(mesh, req)
    mesh.deltas(item(job, 0, 5, 6), worker="dec0")
    out = mesh.core.on_resume(C1, resume(req, [5, 9]), mesh.now)
    [err] = msgs(out, ErrorReply)
    assert err.code == "invalid_request" and sorted(o.dest for o in out if isinstance(o.msg, AbortRequest)) == \
        ["dec0", "tok0"]
    assert_clean(mesh.core)


def test_a_successor_router_admits_the_request_again_and_continues_from_the_clients_output() -> None:
    mesh = basic_mesh()
    req = gen(api_key=None, priority=3)
    out = mesh.core.on_resume(C1, resume(req, [5, 6, 7], "<5><6><7>", elapsed_s=4.0), mesh.now)
    assert [type(x) for x in msgs(out)] == [Resumed, EncodeRequest]
    resumed, enc = msgs(out)
    assert resumed == Resumed("r", 3) and enc.resume_output_ids == [5, 6, 7] and enc.prompt_token_ids == PROMPT
    st = mesh.core.request(enc.request_id)
    assert st.arrival == -4.0 and st.priority == 3 and st.resumed
    [job] = msgs(mesh.encoded(enc), PrefillJob)
    assert job.token_ids == PROMPT + [5, 6, 7] and job.num_output_tokens == 3
    mesh.done(job)
    [delta] = msgs(mesh.deltas(item(job, 3, 8), worker="dec0"))
    assert delta == StreamDelta("r", "<8>", [8], 3, None)  # the stream goes on where the client was
    [end] = msgs(mesh.deltas(item(job, 4, 9, finished=True, finish_reason="stop"), worker="dec0"), RequestFinished)
    assert end.token_ids == [5, 6, 7, 8, 9] and end.text == "<5><6><7><8><9>"
    assert mesh.core.metrics.resumes == {"readmitted": 1}
    assert mesh.core.metrics.migrations == {"router_lost": 1}
    assert_clean(mesh.core)


def test_resumes_before_any_tokenizer_said_hello_wait_for_one_then_time_out() -> None:
    mesh = Mesh(RouterConfig(heartbeat_timeout_s=3.0, placement_timeout_s=5.0))
    early, late = gen("early"), gen("late")
    assert mesh.core.on_resume(C1, resume(early, [5]), mesh.now) == []
    assert mesh.core.on_resume(C2, resume(late, [5]), mesh.now) == []
    mesh.now = 1.0
    assert mesh.core.tick(mesh.now) == []
    mesh.core.on_abort(C2, AbortRequest("late"), mesh.now)  # its client gave up: never admitted
    mesh.beat("tok0", "tokenizer")
    mesh.beat("pre0", "prefill")
    mesh.beat("dec0", "decode")
    out = mesh.core.tick(mesh.now)
    assert [(o.dest, type(o.msg)) for o in out] == [(C1, Resumed), ("tok0", EncodeRequest)]
    # One that finds no tokenizer for placement_timeout_s is refused, typed.
    lone = Mesh(RouterConfig(heartbeat_timeout_s=3.0, placement_timeout_s=5.0))
    lone.core.on_resume(C1, resume(gen(), []), 0.0)
    [err] = msgs(lone.core.tick(6.0))
    assert (err.code, err.request_id) == ("unavailable", "r")
    assert lone.core.metrics.resumes == {"refused": 1} and lone.core.num_inflight == 0


def test_a_resume_whose_client_has_every_token_ends_with_length_once_encoded() -> None:
    mesh = basic_mesh()
    req = gen(max_tokens=3)
    [_, enc] = msgs(mesh.core.on_resume(C1, resume(req, [5, 6, 7], "<5><6><7>"), mesh.now))
    out = mesh.encoded(enc)
    [end] = msgs(out, RequestFinished)
    assert (end.finish_reason, end.token_ids, end.text) == ("length", [5, 6, 7], "<5><6><7>")
    assert [o.dest for o in out if isinstance(o.msg, AbortRequest)] == ["tok0"]
    assert_clean(mesh.core)


def test_bad_resumes_are_refused_and_change_nothing() -> None:
    mesh = basic_mesh(require_api_key=True, tenants={"k": "salt"})
    req = gen()
    for bad, code in [(ResumeRequest("other", req), "invalid_request"),
                      (ResumeRequest("r", req, elapsed_s=float("nan")), "invalid_request"),
                      (resume(gen(max_tokens=0), []), "invalid_request"),
                      (resume(req, [5]), "unauthorized")]:
        [err] = msgs(mesh.core.on_resume(C1, bad, mesh.now))
        assert err.code == code, (bad, err)
    assert mesh.core.num_inflight == 0 and mesh.core.metrics.resumes == {"refused": 4}


# -- requests the workers kept through a router restart (reclaims) -------------------------------------------


def young_mesh() -> Mesh:
    """A router that has just started (at t=0): resumes wait RECLAIM_WAIT_S for the workers' reports."""
    mesh = basic_mesh()
    mesh.core.started_at = 0.0
    return mesh


def held(mesh: Mesh, worker: str, *entries: tuple[str, bytes, str, int]) -> list[Any]:
    report = HeldRequests(worker, mesh.inc[worker], [HeldRequest(rid, client_key(client, crid), n)
                                                     for rid, client, crid, n in entries])
    return mesh.core.on_held(worker, report, mesh.now)


def test_jobs_name_their_client() -> None:
    mesh = basic_mesh()
    job = run_to_decoding(mesh, gen("r7"), client=C2)
    assert job.client_key == client_key(C2, "r7") == f"{C2.hex()}/r7"


def test_a_successor_router_sends_a_kept_request_back_to_its_worker_and_nothing_is_computed_again() -> None:
    mesh = young_mesh()
    assert held(mesh, "dec0", ("old-7", C1, "r", 5)) == []
    req = gen()
    out = mesh.core.on_resume(C1, resume(req, [5, 6, 7], "<5><6><7>"), mesh.now)
    resumed, enc = msgs(out)
    assert resumed == Resumed("r", 3) and enc.request_id == "old-7" and enc.resume_output_ids == [5, 6, 7]
    [reclaim] = out2 = mesh.encoded(enc)
    assert reclaim.dest == "dec0" and reclaim.msg == Reclaim("old-7", "tok0", PROMPT + [5, 6, 7], 3)
    assert not msgs(out2, PrefillJob) and mesh.core.queued_requests == 0
    assert mesh.core.table.instances["pre0"].held == set()
    # The worker streams what it made meanwhile, from the client's count.
    [delta] = msgs(mesh.deltas(TextDeltaItem("old-7", 3, "<8><9>", [8, 9]), worker="dec0"))
    assert delta == StreamDelta("r", "<8><9>", [8, 9], 3, None)
    [end] = msgs(mesh.deltas(TextDeltaItem("old-7", 5, "<10>", [10], finished=True, finish_reason="stop"),
                             worker="dec0"), RequestFinished)
    assert end.token_ids == [5, 6, 7, 8, 9, 10]
    assert mesh.core.metrics.resumes == {"reclaimed": 1} and not mesh.core.metrics.migrations
    assert_clean(mesh.core)


def test_a_young_router_waits_for_the_reports_then_computes_what_no_worker_kept() -> None:
    mesh = young_mesh()
    kept, lost = gen("kept"), gen("lost")
    assert mesh.core.on_resume(C1, resume(kept, [5]), mesh.now) == []
    assert mesh.core.on_resume(C1, resume(lost, [5]), mesh.now) == []
    mesh.now = 0.5
    held(mesh, "dec0", ("old-1", C1, "kept", 2))
    out = mesh.core.tick(mesh.now)
    assert [(o.dest, type(o.msg)) for o in out] == [(C1, Resumed), ("tok0", EncodeRequest)]
    assert msgs(out, EncodeRequest)[0].request_id == "old-1"
    mesh.now = 3.5  # past RECLAIM_WAIT_S: no worker kept the other one
    for name, role in (("tok0", "tokenizer"), ("pre0", "prefill"), ("dec0", "decode")):
        mesh.beat(name, role)  # alive all along (their heartbeats' timeout is 3 s too)
    [_, enc] = msgs(mesh.core.tick(mesh.now))
    assert enc.request_id != "old-1" and mesh.core.metrics.resumes == {"reclaimed": 1, "readmitted": 1}
    assert mesh.core.metrics.migrations == {"router_lost": 1}


def test_a_refused_reclaim_computes_the_request_again() -> None:
    mesh = young_mesh()
    held(mesh, "dec0", ("old-7", C1, "r", 5))
    req = gen()
    [_, enc] = msgs(mesh.core.on_resume(C1, resume(req, [5, 6], "<5><6>"), mesh.now))
    mesh.encoded(enc)
    out = mesh.core.on_error("dec0", ErrorReply("old-7", "worker_lost", "dec0 does not hold old-7 any more"), mesh.now)
    assert [(o.dest, type(o.msg)) for o in out] == [("tok0", AbortRequest), ("tok0", EncodeRequest)]
    enc2 = msgs(out, EncodeRequest)[0]
    assert enc2.request_id == "old-7~1" and enc2.resume_output_ids == [5, 6]
    [job] = msgs(mesh.encoded(enc2), PrefillJob)
    assert job.token_ids == PROMPT + [5, 6] and job.num_output_tokens == 2
    assert mesh.core.metrics.resumes == {"reclaimed": 1, "reclaim_refused": 1}
    assert mesh.core.metrics.migrations == {"router_lost": 1}
    # An error after its worker streamed on is the request's own: it ends, it does not move.
    mesh.done(job)
    mesh.deltas(TextDeltaItem("old-7~1", 2, "<7>", [7]), worker="dec0")
    [err] = msgs(mesh.core.on_error("dec0", ErrorReply("old-7~1", "internal", "boom"), mesh.now), ErrorReply)
    assert err.code == "internal"
    assert_clean(mesh.core)


def test_late_stale_and_unclaimed_reports() -> None:
    mesh = basic_mesh()  # not young: a resume with no report is computed again at once
    req = gen()
    [_, enc] = msgs(mesh.core.on_resume(C1, resume(req, [5]), mesh.now))
    # The worker's report came after the client resumed: what it kept is aborted there.
    out = held(mesh, "dec0", ("old-7", C1, "r", 3), ("old-8", C2, "gone", 1))
    assert [(o.dest, o.msg.request_id) for o in out] == [("dec0", "old-7")]
    # A report from an incarnation the router no longer knows changes nothing.
    stale = HeldRequests("dec0", "i-old", [HeldRequest("old-9", client_key(C2, "x"), 1)])
    assert mesh.core.on_held("dec0", stale, mesh.now) == [] and mesh.core.metrics.stale == 1
    # No client claims old-8 within UNCLAIMED_S: aborted on its worker.
    mesh.now = 31.0
    for name, role in (("tok0", "tokenizer"), ("pre0", "prefill"), ("dec0", "decode")):
        mesh.beat(name, role)
    out = mesh.core.tick(mesh.now)
    assert [(o.dest, o.msg.request_id) for o in out if isinstance(o.msg, AbortRequest)] == [("dec0", "old-8")]
    # A worker that restarted after its report holds nothing: the client's resume is computed again.
    held(mesh, "dec0", ("old-10", C2, "late", 4))
    mesh.beat("dec0", "decode", incarnation="i1")
    [_, enc] = msgs(mesh.core.on_resume(C2, resume(gen("late"), [5]), mesh.now))
    assert enc.request_id != "old-10"


def test_a_reclaim_whose_client_had_every_token_ends_with_length_and_frees_the_worker() -> None:
    mesh = young_mesh()
    held(mesh, "dec0", ("old-7", C1, "r", 3))
    req = gen(max_tokens=3)
    [_, enc] = msgs(mesh.core.on_resume(C1, resume(req, [5, 6, 7], "<5><6><7>"), mesh.now))
    out = mesh.encoded(enc)
    [end] = msgs(out, RequestFinished)
    assert end.finish_reason == "length"
    assert sorted(o.dest for o in out if isinstance(o.msg, AbortRequest)) == ["dec0", "tok0"]
    assert_clean(mesh.core)
