"""RouterCore at the front door (issue 30), driven with messages and a fake clock: prefill workers lost
before, during and after the KV handoff; handoff failures retried once elsewhere; text accepted only from
the worker a request was placed on; unknown api keys sharing one anonymous tenant; load shedding on the
prefill backlog's predicted wait and on a tenant's queued prompt tokens; migrations counted by cause."""

from __future__ import annotations

import pytest

from deepinfer.protocol.messages import (
    AbortRequest,
    EncodeRequest,
    EncodeResult,
    ErrorReply,
    Hello,
    PrefillDone,
    PrefillJob,
    RequestFinished,
    ServiceExited,
    StreamDelta,
    TextDeltaItem,
)
from deepinfer.services.router_core import Phase, RouterConfig
from deepinfer.services.router_state import ANONYMOUS
from tests.unit.test_router_core import C1, C2, Mesh, assert_clean, dests, msgs


def mesh_of(**instances: str) -> Mesh:
    return Mesh(RouterConfig(heartbeat_timeout_s=3.0), **instances)


def spare_mesh() -> Mesh:
    """Two prefill workers, two decode workers, one tokenizer."""
    return mesh_of(tok0="tokenizer", pre0="prefill", pre1="prefill", dec0="decode", dec1="decode")


def with_pid(mesh: Mesh, name: str, role: str, pid: int, incarnation: str = "i0") -> None:
    mesh.core.on_hello(Hello(1, role, name, capabilities={"incarnation": incarnation, "pid": str(pid)}), mesh.now)


def reencode(mesh: Mesh, enc: EncodeRequest) -> list:
    """The tokenizer's answer to a moved request's EncodeRequest (its prompt, already encoded)."""
    return mesh.core.on_encode_result("tok0", EncodeResult(enc.request_id, enc.prompt_token_ids, []), mesh.now)


def finish(mesh: Mesh, rid: str, offset: int, tokens: list[int], worker: str | None = None) -> RequestFinished:
    out = mesh.deltas(TextDeltaItem(rid, offset, "z", tokens, True, "length"), worker=worker)
    [fin] = msgs(out, RequestFinished)
    return fin


# ----- prefill workers lost -----


def test_prefill_death_mid_prefill_moves_its_requests_to_the_spare() -> None:
    mesh = spare_mesh()
    with_pid(mesh, "pre0", "prefill", 10)
    jobs = [mesh.placed(stream=True) for _ in range(4)]  # least predicted time: spread over pre0 and pre1
    on_pre0 = [j for j in jobs if mesh.core.request(j.request_id).where.prefill == "pre0"]
    assert on_pre0 and len(on_pre0) < len(jobs)
    out = mesh.core.on_service_exited(ServiceExited("pre0", 10, -9), mesh.now)
    assert not [o for o in out if o.to_client]  # the clients see nothing of it
    moved = msgs(out, EncodeRequest)
    assert len(moved) == len(on_pre0) and all(e.resume_output_ids == [] for e in moved)
    assert "pre0" not in dests(out, AbortRequest)  # dead: nothing to tell it
    for enc in moved:
        [job] = msgs(reencode(mesh, enc), PrefillJob)
        assert mesh.core.request(job.request_id).where.prefill == "pre1"
        mesh.done(job)
        assert finish(mesh, job.request_id, 0, [5, 6]).token_ids == [5, 6]
    assert mesh.core.metrics.migrations == {"prefill_death": len(on_pre0)}
    for j in jobs:
        if j not in on_pre0:
            mesh.done(j)
            finish(mesh, j.request_id, 0, [1])
    assert_clean(mesh.core)


def test_new_requests_are_refused_once_no_worker_was_live_for_the_placement_timeout() -> None:
    mesh = mesh_of(tok0="tokenizer", pre0="prefill", dec0="decode")
    with_pid(mesh, "pre0", "prefill", 10)
    mesh.placed()  # a worker pair took a request at 0
    [enc] = msgs(mesh.core.on_service_exited(ServiceExited("pre0", 10, -9), mesh.now), EncodeRequest)
    assert reencode(mesh, enc) == []  # parked
    timeout = mesh.core.config.placement_timeout_s
    ended = []
    for mesh.now in (1.0, timeout - 1, timeout + 1):  # the tokenizer and the decode worker beat throughout
        ended += msgs(mesh.beat("tok0", "tokenizer") + mesh.beat("dec0", "decode") + mesh.core.tick(mesh.now),
                      ErrorReply)
    assert [e.code for e in ended] == ["worker_lost"]  # parked for longer than the same bound
    refused = msgs(mesh.generate(), ErrorReply)[0]
    assert (refused.code, refused.message) == ("unavailable", "no live prefill/decode workers")
    assert mesh.core.metrics.rejected["unavailable"] == 1 and mesh.core.num_inflight == 0


def test_without_a_spare_requests_wait_parked_for_the_restarted_prefill_worker() -> None:
    mesh = mesh_of(tok0="tokenizer", pre0="prefill", dec0="decode")
    assert mesh.core.config.placement_timeout_s == 30.0  # a restart and a model load fit in it
    with_pid(mesh, "pre0", "prefill", 10)
    job = mesh.placed(stream=True)
    [enc] = msgs(mesh.core.on_service_exited(ServiceExited("pre0", 10, -9), mesh.now), EncodeRequest)
    assert reencode(mesh, enc) == []
    assert mesh.core.request(enc.request_id).phase is Phase.PARKED
    # A new request meanwhile is admitted too (a worker was live moments ago) and waits parked beside it.
    late = mesh.admit(prompt_token_ids=[7, 8, 9])
    assert mesh.encoded(late) == [] and mesh.core.request(late.request_id).phase is Phase.PARKED
    mesh.now = 2.0  # the others keep beating; the restarted pre0 says Hello, then beats
    for name, role in (("tok0", "tokenizer"), ("dec0", "decode")):
        mesh.beat(name, role)
    assert mesh.core.tick(mesh.now) == []
    with_pid(mesh, "pre0", "prefill", 11, incarnation="i1")
    assert mesh.core.tick(mesh.now) == []  # known, but no load yet: not placeable
    job2, job3 = msgs(mesh.beat("pre0", "prefill", incarnation="i1"), PrefillJob)  # in arrival order
    assert job2.token_ids == job.token_ids and job2.decode_worker == "dec0"
    assert job3.token_ids == [7, 8, 9]
    for j, tokens in ((job2, [3, 4]), (job3, [5])):
        mesh.done(j)
        fin = finish(mesh, j.request_id, 0, tokens)
        assert fin.token_ids == tokens
    assert fin.request_id == "c2"
    assert mesh.core.metrics.migrations == {"prefill_death": 1}
    assert_clean(mesh.core)


def test_prefill_death_after_prefill_done_leaves_decoding_alone() -> None:
    mesh = mesh_of(tok0="tokenizer", pre0="prefill", dec0="decode")
    with_pid(mesh, "pre0", "prefill", 10)
    job = mesh.placed(stream=True)
    mesh.done(job)
    mesh.deltas(TextDeltaItem(job.request_id, 0, "a", [1]))
    assert mesh.core.on_service_exited(ServiceExited("pre0", 10, -9), mesh.now) == []
    assert finish(mesh, job.request_id, 1, [2]).token_ids == [1, 2]
    assert not mesh.core.metrics.migrations and mesh.core.metrics.moves == 0
    assert_clean(mesh.core)


def test_prefill_death_once_the_decode_worker_decodes_is_adopted_without_prefill_done() -> None:
    """PrefillDone is still on its way when the prefill worker dies, but the decode worker's engine made a
    token (the second: the first is streamed before the KV is installed): the request decodes on there."""
    mesh = mesh_of(tok0="tokenizer", pre0="prefill", dec0="decode", dec1="decode")
    with_pid(mesh, "pre0", "prefill", 10)
    job = mesh.placed(stream=True)
    mesh.deltas(TextDeltaItem(job.request_id, 0, "ab", [1, 2]), worker="dec0")
    assert mesh.core.table.get("pre0").prefill_tokens > 0
    assert mesh.core.on_service_exited(ServiceExited("pre0", 10, -9), mesh.now) == []  # no abort, no move
    st = mesh.core.request(job.request_id)
    assert st.phase is Phase.DECODING and st.where.holders == {"tok0", "dec0"}
    assert mesh.core.queued_requests == 0 and mesh.core.table.get("dec0").pending_blocks == 0
    assert mesh.core.on_prefill_done(PrefillDone(job.request_id, "pre0", 10, 0), mesh.now) == []  # late: stale
    fin = finish(mesh, job.request_id, 2, [3], worker="dec0")
    assert fin.token_ids == [1, 2, 3] and fin.usage.cached_tokens == 0  # that usage went with the worker
    assert mesh.core.metrics.handoffs_adopted == 1 and mesh.core.metrics.moves == 0
    assert_clean(mesh.core)


def test_prefill_silent_after_the_handoff_is_told_to_drop_it_and_the_request_decodes_on() -> None:
    mesh = mesh_of(tok0="tokenizer", pre0="prefill", dec0="decode")
    job = mesh.placed(stream=True)
    mesh.deltas(TextDeltaItem(job.request_id, 0, "ab", [1, 2]))
    mesh.now = 2.5
    for name, role in (("tok0", "tokenizer"), ("dec0", "decode")):
        mesh.beat(name, role)
    out = mesh.core.tick(3.5)  # pre0 fell silent: it may only be wedged, holding the exported KV
    assert [(o.dest, type(o.msg)) for o in out] == [("pre0", AbortRequest)]
    assert finish(mesh, job.request_id, 2, [3]).token_ids == [1, 2, 3]
    assert_clean(mesh.core)


def test_prefill_death_with_only_the_first_token_streamed_moves_the_request() -> None:
    """The first token is pushed by the decode worker before it installs the KV: it proves nothing yet."""
    mesh = mesh_of(tok0="tokenizer", pre0="prefill", pre1="prefill", dec0="decode")
    with_pid(mesh, "pre0", "prefill", 10)
    mesh.beat("pre1", "prefill", queued_prompt_tokens=5000)  # so that the request goes to pre0
    job = mesh.placed(stream=True)
    assert mesh.core.request(job.request_id).where.prefill == "pre0"
    mesh.deltas(TextDeltaItem(job.request_id, 0, "a", [1]))
    out = mesh.core.on_service_exited(ServiceExited("pre0", 10, -9), mesh.now)
    [enc] = msgs(out, EncodeRequest)
    assert enc.resume_output_ids == [1] and dests(out, AbortRequest) == ["dec0", "tok0"]
    [job2] = msgs(reencode(mesh, enc), PrefillJob)
    assert job2.num_output_tokens == 1 and mesh.core.request(job2.request_id).where.prefill == "pre1"
    mesh.done(job2)
    assert finish(mesh, job2.request_id, 1, [2]).token_ids == [1, 2]
    assert_clean(mesh.core)


def test_prefill_death_during_a_moved_requests_second_prefill_counts_from_its_resume_point() -> None:
    """A moved request's job starts at the output it had: two tokens streamed before the move prove nothing
    about the new decode worker."""
    mesh = mesh_of(tok0="tokenizer", pre0="prefill", pre1="prefill", dec0="decode", dec1="decode")
    job = mesh.placed(stream=True)
    mesh.done(job)
    mesh.deltas(TextDeltaItem(job.request_id, 0, "ab", [1, 2]))
    first = mesh.core.request(job.request_id).where.decode
    [enc] = msgs(mesh.beat(first, "decode", incarnation="i1"), EncodeRequest)
    [job2] = msgs(reencode(mesh, enc), PrefillJob)
    prefill = mesh.core.request(job2.request_id).where.prefill
    out = mesh.beat(prefill, "prefill", incarnation="i1")
    [enc2] = msgs(out, EncodeRequest)
    assert enc2.resume_output_ids == [1, 2] and mesh.core.metrics.handoffs_adopted == 0
    assert mesh.core.metrics.migrations == {"decode_death": 1, "prefill_death": 1}


# ----- handoff failures retried once elsewhere -----


@pytest.mark.parametrize("code", ["internal", "worker_lost"])
def test_a_failed_handoff_is_moved_once_avoiding_its_workers(code: str) -> None:
    mesh = spare_mesh()
    job = mesh.placed(stream=True)
    where = mesh.core.request(job.request_id).where
    first = (where.prefill, where.decode)
    out = mesh.core.on_error(where.prefill, ErrorReply(job.request_id, code, "dec: refused the KV"), mesh.now)
    assert not [o for o in out if o.to_client]
    assert sorted(dests(out, AbortRequest)) == sorted([where.decode, "tok0"])  # (the prefill worker dropped it)
    [enc] = msgs(out, EncodeRequest)
    assert enc.resume_output_ids == []
    [job2] = msgs(reencode(mesh, enc), PrefillJob)
    where2 = mesh.core.request(job2.request_id).where
    assert where2.prefill not in first and where2.decode not in first  # elsewhere, both of them
    assert mesh.core.metrics.migrations == {"handoff_failure": 1}
    # A second failure reaches the client.
    out = mesh.core.on_error(where2.prefill, ErrorReply(job2.request_id, code, "again"), mesh.now)
    [err] = msgs(out, ErrorReply)
    assert (err.request_id, err.code, err.message) == ("c1", code, "again")
    assert_clean(mesh.core)


def test_a_failed_handoff_after_the_first_token_resumes_from_it() -> None:
    """The decode worker streamed the first token, then failed to install the KV."""
    mesh = spare_mesh()
    job = mesh.placed(stream=True)
    where = mesh.core.request(job.request_id).where
    out = mesh.deltas(TextDeltaItem(job.request_id, 0, "a", [9]), worker=where.decode)
    assert [d.token_ids for d in msgs(out, StreamDelta)] == [[9]]
    out = mesh.core.on_error(where.prefill, ErrorReply(job.request_id, "internal", "install failed"), mesh.now)
    [enc] = msgs(out, EncodeRequest)
    assert enc.resume_output_ids == [9]
    [job2] = msgs(reencode(mesh, enc), PrefillJob)
    assert job2.num_output_tokens == 1 and job2.token_ids == job.token_ids + [9]
    mesh.done(job2)
    out = mesh.deltas(TextDeltaItem(job2.request_id, 1, "b", [8], True, "length"))
    assert [(d.offset, d.token_ids) for d in msgs(out, StreamDelta)] == [(1, [8])]  # no gap, no repeat
    assert msgs(out, RequestFinished)[0].token_ids == [9, 8]
    assert_clean(mesh.core)


def test_a_failed_handoff_goes_to_whichever_other_worker_there_is() -> None:
    mesh = mesh_of(tok0="tokenizer", pre0="prefill", dec0="decode", dec1="decode")
    job = mesh.placed()
    where = mesh.core.request(job.request_id).where
    out = mesh.core.on_error("pre0", ErrorReply(job.request_id, "worker_lost", "no answer"), mesh.now)
    [job2] = msgs(reencode(mesh, msgs(out, EncodeRequest)[0]), PrefillJob)
    assert job2.decode_worker != where.decode and mesh.core.request(job2.request_id).where.prefill == "pre0"


def test_a_failed_handoff_without_another_worker_ends_at_the_client() -> None:
    mesh = mesh_of(tok0="tokenizer", pre0="prefill", dec0="decode")
    job = mesh.placed()
    out = mesh.core.on_error("pre0", ErrorReply(job.request_id, "internal", "export raised"), mesh.now)
    assert [m.code for m in msgs(out, ErrorReply)] == ["internal"] and not msgs(out, EncodeRequest)
    assert_clean(mesh.core)


def test_an_invalid_request_from_the_prefill_worker_is_not_retried() -> None:
    mesh = spare_mesh()
    job = mesh.placed()
    prefill = mesh.core.request(job.request_id).where.prefill
    out = mesh.core.on_error(prefill, ErrorReply(job.request_id, "invalid_request", "bad"), mesh.now)
    assert [m.code for m in msgs(out, ErrorReply)] == ["invalid_request"]
    assert_clean(mesh.core)


def test_a_decode_side_failure_before_prefill_done_is_retried_too() -> None:
    mesh = spare_mesh()
    job = mesh.placed()
    where = mesh.core.request(job.request_id).where
    out = mesh.core.on_error(where.decode, ErrorReply(job.request_id, "internal", "install failed"), mesh.now)
    assert sorted(dests(out, AbortRequest)) == [where.prefill, "tok0"] and len(msgs(out, EncodeRequest)) == 1


def test_a_moved_handoff_whose_avoided_workers_are_all_that_is_left_goes_back_to_them() -> None:
    mesh = spare_mesh()
    job = mesh.placed()
    where = mesh.core.request(job.request_id).where
    [enc] = msgs(mesh.core.on_error(where.prefill, ErrorReply(job.request_id, "internal", "x"), mesh.now),
                 EncodeRequest)
    mesh.now = 2.5  # meanwhile only the failed pair (and the tokenizer) keeps beating
    for name, role in (("tok0", "tokenizer"), (where.prefill, "prefill"), (where.decode, "decode")):
        mesh.beat(name, role)
    mesh.core.tick(3.5)
    [job2] = msgs(reencode(mesh, enc), PrefillJob)
    assert job2.decode_worker == where.decode


def test_a_refused_reservation_and_a_failed_handoff_share_the_one_retry() -> None:
    mesh = spare_mesh()
    job = mesh.placed()
    prefill = mesh.core.request(job.request_id).where.prefill
    [retry] = msgs(mesh.core.on_error(prefill, ErrorReply(job.request_id, "overloaded", "no room"), mesh.now),
                   PrefillJob)
    assert mesh.core.metrics.retries == 1 and mesh.core.metrics.migrations == {"handoff_failure": 1}
    out = mesh.core.on_error(prefill, ErrorReply(retry.request_id, "internal", "export raised"), mesh.now)
    assert [m.code for m in msgs(out, ErrorReply)] == ["internal"]
    assert_clean(mesh.core)


# ----- text only from the worker the request was placed on -----


def test_text_from_another_worker_is_refused_and_counted() -> None:
    mesh = spare_mesh()
    job = mesh.placed(stream=True)
    mesh.done(job)
    rid, placed_on = job.request_id, job.decode_worker
    other = "dec1" if placed_on == "dec0" else "dec0"
    prefill = mesh.core.request(rid).where.prefill
    other_prefill = "pre1" if prefill == "pre0" else "pre0"
    for worker in (other, other_prefill, "tok0"):
        assert mesh.deltas(TextDeltaItem(rid, 0, "evil", [66]), worker=worker) == []
    assert mesh.deltas(TextDeltaItem(rid, 1, "evil", [66]), worker=prefill) == []  # a prefill samples one token
    assert mesh.core.metrics.refused_deltas == 4 and mesh.core.metrics.stale == 0
    out = mesh.deltas(TextDeltaItem(rid, 0, "good", [1]), worker=prefill)  # its first token, after PrefillDone
    assert [d.text for d in msgs(out, StreamDelta)] == ["good"]
    out = mesh.deltas(TextDeltaItem(rid, 1, " and", [3]), worker=placed_on)
    assert [d.text for d in msgs(out, StreamDelta)] == [" and"]
    out = mesh.deltas(TextDeltaItem(rid, 2, "!", [2], True, "stop"))  # a tokenizer that names no worker
    assert msgs(out, RequestFinished)[0].text == "good and!"
    assert_clean(mesh.core)


def test_a_prefill_worker_that_ends_the_request_at_its_first_token_streams_it_itself() -> None:
    """The engine finishes a prefill-only request whose first token ends it (EOS, a stop, max_tokens) instead
    of handing it off: the prefill worker streams that token, at the output the job resumed from."""
    mesh = mesh_of(tok0="tokenizer", pre0="prefill", pre1="prefill", dec0="decode", dec1="decode")
    job = mesh.placed(stream=True)
    mesh.done(job)
    mesh.deltas(TextDeltaItem(job.request_id, 0, "ab", [1, 2]), worker=job.decode_worker)
    [enc] = msgs(mesh.beat(job.decode_worker, "decode", incarnation="i1"), EncodeRequest)  # moved at 2 tokens
    [job2] = msgs(reencode(mesh, enc), PrefillJob)
    assert job2.num_output_tokens == 2
    prefill = mesh.core.request(job2.request_id).where.prefill
    assert mesh.deltas(TextDeltaItem(job2.request_id, 3, "x", [7]), worker=prefill) == []  # not its first
    assert mesh.core.metrics.refused_deltas == 1
    out = mesh.deltas(TextDeltaItem(job2.request_id, 2, "c", [3], True, "length"), worker=prefill)
    assert msgs(out, RequestFinished) == [] and mesh.core.request(job2.request_id).phase is Phase.FINISHING
    [fin] = msgs(mesh.done(job2), RequestFinished)
    assert fin.token_ids == [1, 2, 3] and fin.text == "abc"
    assert_clean(mesh.core)


def test_text_is_only_taken_from_the_requests_own_tokenizer_as_sender() -> None:
    mesh = mesh_of(tok0="tokenizer", tok1="tokenizer", pre0="prefill", dec0="decode")
    job = mesh.placed()
    mesh.done(job)
    tok = mesh.core.request(job.request_id).where.tokenizer
    other = "tok1" if tok == "tok0" else "tok0"
    assert mesh.deltas(TextDeltaItem(job.request_id, 0, "x", [1]), tokenizer=other, worker="dec0") == []
    assert mesh.core.metrics.stale == 1


def test_a_co_located_workers_text_is_its_own() -> None:
    mesh = mesh_of(tok0="tokenizer", w0="worker", w1="worker")
    job = mesh.placed()
    worker = mesh.core.request(job.request_id).where.decode
    other = "w1" if worker == "w0" else "w0"
    assert mesh.deltas(TextDeltaItem(job.request_id, 0, "x", [1]), worker=other) == []
    mesh.done(job)
    assert finish(mesh, job.request_id, 0, [1], worker=worker).token_ids == [1]


# ----- tenants -----


def test_unknown_and_missing_keys_share_the_anonymous_tenants_cap() -> None:
    config = RouterConfig(heartbeat_timeout_s=3.0, tenants={"known": "salt"}, default_max_inflight_per_tenant=2)
    mesh = Mesh(config, tok0="tokenizer", pre0="prefill", dec0="decode")
    assert isinstance(mesh.generate(api_key="made-up-1")[0].msg, EncodeRequest)
    assert isinstance(mesh.generate()[0].msg, EncodeRequest)
    [refused] = msgs(mesh.generate(api_key="made-up-2"), ErrorReply)  # a new key does not escape the cap
    assert refused.code == "overloaded" and refused.retry_after_s == config.retry_after_s
    assert all(isinstance(mesh.generate(api_key="known")[0].msg, EncodeRequest) for _ in range(2))
    assert mesh.core._inflight_by_tenant == {ANONYMOUS: 2, "known": 2}
    assert mesh.core.metrics.shed == {"tenant_inflight": 1}


def test_a_key_named_by_any_tenant_setting_is_its_own_tenant() -> None:
    config = RouterConfig(tenants={"a": "s"}, priority_floor={"b": 1}, max_inflight_per_tenant={"c": 5},
                          max_queued_prompt_tokens_per_tenant={"d": 10})
    assert [config.known_tenant(k) for k in ("a", "b", "c", "d", "x", None, "")] == ["a", "b", "c", "d", "", "", ""]


def test_a_tenants_queued_prompt_tokens_are_capped() -> None:
    config = RouterConfig(heartbeat_timeout_s=3.0, tenants={"a": "s", "b": "t"},
                          max_queued_prompt_tokens_per_tenant={"a": 100})
    mesh = Mesh(config, tok0="tokenizer", pre0="prefill", dec0="decode")
    first = mesh.admit(api_key="a", n=80)
    [refused] = msgs(mesh.generate(api_key="a", n=30), ErrorReply)
    assert refused.code == "overloaded" and refused.retry_after_s == config.retry_after_s
    assert "prompt tokens waiting" in refused.message
    assert isinstance(mesh.generate(api_key="b", n=300)[0].msg, EncodeRequest)  # another tenant
    assert isinstance(mesh.generate(api_key="a", n=20)[0].msg, EncodeRequest)  # it still fits
    job = msgs(mesh.encoded(first), PrefillJob)[0]
    mesh.done(job)  # decoding: no longer queued, so the tenant has room again
    assert isinstance(mesh.generate(api_key="a", n=70)[0].msg, EncodeRequest)
    assert mesh.core.metrics.shed == {"tenant_tokens": 1}


def test_a_lone_prompt_is_never_refused_for_its_tenants_token_cap_but_the_exact_count_is_checked() -> None:
    config = RouterConfig(heartbeat_timeout_s=3.0, default_max_queued_prompt_tokens_per_tenant=100)
    mesh = Mesh(config, tok0="tokenizer", pre0="prefill", dec0="decode")
    big = mesh.admit(n=500)  # alone: admitted, and placed at its exact count
    assert msgs(mesh.encoded(big), PrefillJob)
    mesh.core.on_abort(C1, AbortRequest("c1"), mesh.now)
    fits = mesh.admit(n=50)
    small = mesh.admit(prompt="x" * 40)  # estimated at 10 tokens: fits beside the 50
    out = mesh.encoded(small, n=60)  # its exact count does not
    [err] = msgs(out, ErrorReply)
    assert err.code == "overloaded" and "prompt tokens waiting" in err.message
    assert mesh.core.metrics.shed == {"tenant_tokens": 1}
    assert msgs(mesh.encoded(fits), PrefillJob)


# ----- load shedding on the predicted wait -----


def shedding_mesh(bound: float | None = 10.0) -> Mesh:
    config = RouterConfig(heartbeat_timeout_s=3.0, max_queue_wait_s=bound, retry_after_s=1.0,
                          max_queued_prompt_tokens=10**9, max_queued_requests=10**6)
    return Mesh(config, tok0="tokenizer", dec0="decode")


def test_requests_are_shed_once_the_prefill_backlogs_predicted_wait_passes_the_bound() -> None:
    mesh = shedding_mesh(bound=10.0)
    mesh.beat("pre0", "prefill", queued_prompt_tokens=900, tokens_per_s=100.0)  # 9 s of work queued
    assert isinstance(mesh.generate(n=50)[0].msg, EncodeRequest)  # 9 s ahead of it: admitted
    assert mesh.core.unplaced_tokens == 50
    assert isinstance(mesh.generate(n=60)[0].msg, EncodeRequest)  # 9.5 s ahead (its tokens are not its wait)
    [shed] = msgs(mesh.generate(n=5), ErrorReply)  # 10.1 s ahead
    assert shed.code == "overloaded" and "predicted wait is 10.1s" in shed.message
    assert shed.retry_after_s == 1.0  # the excess (0.1 s), but never below retry_after_s
    mesh.beat("pre0", "prefill", queued_prompt_tokens=4000, tokens_per_s=100.0)
    [shed] = msgs(mesh.generate(n=5), ErrorReply)
    assert shed.retry_after_s == pytest.approx(41.1 - 10.0)  # how long the backlog takes to drain to the bound
    mesh.beat("pre0", "prefill", queued_prompt_tokens=100_000, tokens_per_s=100.0)
    assert msgs(mesh.generate(n=5), ErrorReply)[0].retry_after_s == 60.0  # capped
    assert mesh.core.metrics.shed == {"predicted_wait": 3} and mesh.core.metrics.rejected == {"overloaded": 3}
    assert mesh.core.metrics.admitted == 2


def test_the_backlog_drains_over_every_prefill_workers_rate() -> None:
    mesh = shedding_mesh(bound=10.0)
    mesh.beat("pre0", "prefill", queued_prompt_tokens=900, tokens_per_s=100.0)
    mesh.beat("pre1", "prefill", queued_prompt_tokens=900, tokens_per_s=100.0)
    assert mesh.core.cache.backlog_s(mesh.core.table, 0, mesh.now) == pytest.approx(9.0)
    mesh.beat("w0", "worker", queued_prompt_tokens=0)  # measured nothing yet: the prior rate
    prior = mesh.core.config.prior_prefill_tokens_per_s
    assert mesh.core.cache.backlog_s(mesh.core.table, 200, mesh.now) == pytest.approx(2000 / (200 + prior))
    mesh.beat("dec0", "decode", queued_prompt_tokens=10**6, tokens_per_s=1.0)  # decode workers do not prefill
    assert mesh.core.cache.backlog_s(mesh.core.table, 200, mesh.now) == pytest.approx(2000 / (200 + prior))
    assert Mesh(RouterConfig()).core.cache.backlog_s(Mesh().core.table, 5, 0.0) is None  # no prefill worker


def test_placed_requests_count_on_their_worker_not_twice() -> None:
    mesh = shedding_mesh()
    mesh.beat("pre0", "prefill", tokens_per_s=100.0)
    enc = mesh.admit(n=300)
    assert mesh.core.cache.backlog_s(mesh.core.table, mesh.core.unplaced_tokens, mesh.now) == pytest.approx(3.0)
    mesh.encoded(enc)
    assert mesh.core.unplaced_tokens == 0 and mesh.core.table.get("pre0").queued_tokens == 300
    assert mesh.core.cache.backlog_s(mesh.core.table, mesh.core.unplaced_tokens, mesh.now) == pytest.approx(3.0)


def test_without_a_bound_nothing_is_shed() -> None:
    mesh = shedding_mesh(bound=None)
    mesh.beat("pre0", "prefill", queued_prompt_tokens=10**6, tokens_per_s=1.0)
    assert isinstance(mesh.generate()[0].msg, EncodeRequest)


@pytest.mark.parametrize("bound", [0.0, -1.0, float("inf"), float("nan")])
def test_the_bound_must_be_a_positive_number_of_seconds(bound: float) -> None:
    with pytest.raises(ValueError, match="max_queue_wait_s"):
        RouterConfig(max_queue_wait_s=bound)


def test_shed_requests_are_counted_by_cause() -> None:
    mesh = Mesh(RouterConfig(heartbeat_timeout_s=3.0, max_queued_requests=1), tok0="tokenizer", pre0="prefill",
                dec0="decode")
    mesh.admit()
    assert msgs(mesh.generate(), ErrorReply)[0].code == "overloaded"
    mesh.core.draining = True
    assert msgs(mesh.generate(), ErrorReply)[0].code == "overloaded"
    assert mesh.core.metrics.shed == {"queue_requests": 1, "draining": 1}


# ----- migrations by cause -----


def test_migrations_are_counted_by_the_lost_services_role() -> None:
    mesh = mesh_of(tok0="tokenizer", tok1="tokenizer", pre0="prefill", dec0="decode", dec1="decode")
    job = mesh.placed(C1)
    mesh.done(job)
    mesh.admit(C2)
    decode, tokenizer = job.decode_worker, mesh.core.request(job.request_id).where.tokenizer
    mesh.beat(decode, "decode", incarnation="i1")
    mesh.beat(tokenizer, "tokenizer", incarnation="i1")
    counted = mesh.core.metrics.migrations
    assert counted["decode_death"] == 1 and counted["tokenizer_death"] >= 1
    assert mesh.core.metrics.moves == sum(counted.values())
