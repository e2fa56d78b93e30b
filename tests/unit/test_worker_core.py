"""WorkerCore driven directly with hand-made engine outputs and peer replies: co-located jobs, engine
errors, the prefill side's handoff through success and every failure, aborts and router restarts at any
point, the decode side's checks — and a state machine asserting every request ends exactly once, nothing
is sent about it afterwards, and held KV blocks are freed exactly once."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from deepinfer.config.kv import KvSpec
from deepinfer.engine.request import FinishReason, InvalidRequestError, Logprob, RequestOutput, Usage
from deepinfer.protocol.messages import (
    DetokenizeItem,
    ErrorReply,
    HeldRequest,
    KvAck,
    KvReserve,
    KvReserveReply,
    KvTransfer,
    LogprobWire,
    PrefillDone,
    PrefillJob,
    Reclaim,
    SamplingParamsWire,
)
from deepinfer.services.worker_actions import (
    Abort,
    AbortAll,
    Action,
    AddJob,
    CancelReservation,
    ExportKv,
    Install,
    OfferBlocks,
    Release,
    ToDecode,
    ToPrefill,
    ToRouter,
    ToTokenizer,
)
from deepinfer.services.worker_core import (
    HandoffFailure,
    HandoffState,
    WorkerCore,
)

BS = 4
SPEC = KvSpec(2, BS, ("k", "v"), (("kv_heads", 2), ("head_dim", 8)))
KV_LAYOUT = SPEC.layout
TIMEOUT = 5.0
KV = object()  # an export: the core only carries it
PEER = b"prefill-1"  # the prefill worker's identity on a decode worker's KV ROUTER


def job(rid: str = "r1", n: int = 10, decode: str = "d1", detok: str = "tok1", resumed: int = 0,
        key: str = "") -> PrefillJob:
    return PrefillJob(rid, list(range(100, 100 + n)), [b"h0", b"h1"], SamplingParamsWire(max_tokens=7), decode, detok,
                      priority=2, arrival_time=1.5, cache_salt="salt", num_output_tokens=resumed, client_key=key)


def output(rid: str = "r1", new: list[int] | None = None, finish: str | None = None, *, handoff: bool = False,
           error: str | None = None, hashes: list[bytes] | None = None) -> RequestOutput:
    new = [7] if new is None else new
    reason = FinishReason(finish) if finish else None
    return RequestOutput(rid, new, list(new), finish is not None or handoff, reason,
                         Usage(10, len(new), cached_tokens=4, cached_by_tier={"device": 4}, spec_proposed_tokens=3,
                               spec_accepted_tokens=2),
                         error=error, handoff=handoff, block_hashes=hashes or [])


def transfer(rid: str = "t1", n: int = 9, resumed: int = 0, layout: str = KV_LAYOUT, bs: int = BS,
             key: str = "") -> KvTransfer:
    return KvTransfer(rid, rid, 42, list(range(n)), [], SamplingParamsWire(), bs, layout, KV, "tok2",
                      num_output_tokens=resumed, client_key=key)


def colocated(**kw: Any) -> WorkerCore:
    return WorkerCore("w1", "worker", SPEC, set(), **kw)


def prefill(**kw: Any) -> WorkerCore:
    kw.setdefault("offer_blocks", True)
    return WorkerCore("p1", "prefill", SPEC, {"d1", "d2"}, handoff_timeout_s=TIMEOUT, **kw)


def items(actions: list[Action]) -> list[tuple[str, DetokenizeItem]]:
    return [(a.tokenizer, it) for a in actions if isinstance(a, ToTokenizer) for it in a.batch.items]


def to_router(actions: list[Action]) -> list[Any]:
    return [a.msg for a in actions if isinstance(a, ToRouter)]


# -- co-located jobs --------------------------------------------------------------------------------


def test_colocated_job_reports_prefill_once_then_streams_contiguous_items() -> None:
    core = colocated(offer_blocks=True)
    [add] = core.on_job(job(), now=10.0)
    assert isinstance(add, AddJob) and not add.prefill_only and add.prompt == job().token_ids and add.resumed == []
    assert core.on_prefix_loaded(add.job, fetch_s=0.25)

    first = core.on_outputs([output(new=[5])], step=3, now=12.0)
    [done] = to_router(first)
    assert isinstance(done, PrefillDone)
    assert (done.request_id, done.prefill_worker, done.num_prompt_tokens, done.num_cached_tokens) == ("r1", "w1", 10, 4)
    assert done.cached_by_tier == {"device": 4} and done.prefill_s == 2.0 and done.fetch_s == 0.25
    assert isinstance(first[-1], ToTokenizer) and first[-1].batch.worker == "w1" and first[-1].batch.step == 3
    [(tok, it)] = items(first)
    assert (tok, it.offset, it.token_ids, it.finished) == ("tok1", 0, [5], False)
    assert (it.spec_proposed_tokens, it.spec_accepted_tokens) == (3, 2)

    second = core.on_outputs([output(new=[6, 8])], step=4, now=13.0)
    assert to_router(second) == [] and [it.offset for _, it in items(second)] == [1]
    last = core.on_outputs([output(new=[9], finish="stop", hashes=[b"a", b"b"])], step=5, now=14.0)
    [(_, it)] = items(last)
    assert (it.offset, it.finished, it.finish_reason) == (3, True, "stop")
    [offer] = [a for a in last if isinstance(a, OfferBlocks)]
    assert (offer.request_id, offer.block_hashes, offer.kv) == ("r1", [b"a", b"b"], None)
    assert core.track("r1") is None and len(core) == 0
    assert core.on_outputs([output(new=[1], finish="abort")], step=6, now=15.0) == []


def test_resumed_job_starts_at_num_output_tokens() -> None:
    core = colocated()
    [add] = core.on_job(job(n=10, resumed=3), now=0.0)
    assert isinstance(add, AddJob) and add.prompt == list(range(100, 107)) and add.resumed == [107, 108, 109]
    first = core.on_outputs([output(new=[1, 2])], step=1, now=1.0)
    assert len(to_router(first)) == 1
    assert [it.offset for _, it in items(first)] == [3]
    assert [it.offset for _, it in items(core.on_outputs([output(new=[3])], step=2, now=2.0))] == [5]


def test_one_batch_per_tokenizer_after_the_router_messages() -> None:
    core = colocated()
    core.on_job(job("a", detok="tok1"), 0.0)
    core.on_job(job("b", detok="tok2"), 0.0)
    core.on_job(job("c", detok="tok1"), 0.0)
    actions = core.on_outputs([output("a"), output("b"), output("c")], step=1, now=1.0)
    assert [type(a) for a in actions] == [ToRouter] * 3 + [ToTokenizer] * 2
    assert {a.tokenizer: [it.request_id for it in a.batch.items] for a in actions if isinstance(a, ToTokenizer)} \
        == {"tok1": ["a", "c"], "tok2": ["b"]}


def test_impossible_resume_count_is_refused_without_a_track() -> None:
    core = colocated()
    [out] = core.on_job(job(n=3, resumed=3), 0.0)
    assert isinstance(out, ToRouter) and out.msg.code == "invalid_request" and len(core) == 0


def test_engine_error_ends_the_request_with_internal() -> None:
    core = colocated()
    core.on_job(job(), 0.0)
    core.on_outputs([output(new=[5])], 1, 1.0)
    actions = core.on_outputs([output(new=[], finish="error", error="nan logits")], 2, 2.0)
    assert actions == [ToRouter(ErrorReply("r1", "internal", "nan logits"))]
    assert core.track("r1") is None
    assert core.on_outputs([output(new=[6])], 3, 3.0) == []


@pytest.mark.parametrize(("error", "code", "aborts"), [(InvalidRequestError("too long"), "invalid_request", False),
                                                       (RuntimeError("boom"), "internal", True)])
def test_a_refused_add_ends_the_job(error: Exception, code: str, aborts: bool) -> None:
    core = colocated()
    [add] = core.on_job(job(), 0.0)
    assert isinstance(add, AddJob)
    actions = core.on_add_failed(add.job, error)
    assert [m.code for m in to_router(actions)] == [code] and (Abort("r1") in actions) == aborts
    assert len(core) == 0


def test_a_job_aborted_before_it_was_added_sends_nothing_more() -> None:
    core = colocated()
    [add] = core.on_job(job(), 0.0)
    assert isinstance(add, AddJob)
    assert core.on_abort("r1") == [Abort("r1")]
    assert not core.on_prefix_loaded(add.job, 0.1)
    assert core.on_add_failed(add.job, InvalidRequestError("late")) == []


# -- prefill side: the handoff ------------------------------------------------------------------------


def handing_off(core: WorkerCore, rid: str = "r1", decode: str = "d1") -> list[Action]:
    core.on_job(job(rid, decode=decode), now=0.0)
    return core.on_outputs([output(rid, new=[55], handoff=True, hashes=[b"h0", b"h1"])], step=1, now=1.0)


def state(core: WorkerCore, rid: str = "r1") -> HandoffState | None:
    track = core.track(rid)
    return track.handoff.state if track is not None and track.handoff is not None else None


def test_handoff_success_goes_through_every_state_and_reports_prefill_once() -> None:
    core = prefill()
    [add] = core.on_job(job(), now=0.0)
    assert isinstance(add, AddJob) and add.prefill_only
    track = core.track("r1")
    assert track is not None
    assert handing_off_output(core) == [ExportKv("r1")] and state(core) is HandoffState.EXPORTING

    [reserve] = core.on_exported("r1", KV, now=2.0)
    assert isinstance(reserve, ToDecode) and reserve.peer == "d1" and state(core) is HandoffState.RESERVING
    assert reserve.msg == KvReserve("r1", 3, 10, 7, "p1", 10.0)  # ceil((10 + 1) / 4) blocks

    [send] = core.on_kv_reply("d1", KvReserveReply("r1", "lease-1", True, lease_s=10.0), now=3.0)
    assert isinstance(send, ToDecode) and state(core) is HandoffState.TRANSFERRING
    t = send.msg
    assert isinstance(t, KvTransfer) and t.kv is KV
    assert (t.request_id, t.lease_id, t.first_token, t.token_ids) == ("r1", "lease-1", 55, job().token_ids)
    assert (t.block_size, t.kv_layout, t.detokenizer, t.priority, t.arrival_time) == (BS, KV_LAYOUT, "tok1", 2, 1.5)
    assert (t.num_cached_tokens, t.cache_salt, t.num_output_tokens) == (4, "salt", 0)

    done = core.on_kv_reply("d1", KvAck("r1", "lease-1", True), now=4.0)
    [pd] = to_router(done)
    assert isinstance(pd, PrefillDone) and pd.prefill_s == 4.0 and pd.num_prompt_tokens == 10
    [offer] = [a for a in done if isinstance(a, OfferBlocks)]
    assert offer.kv is KV and offer.block_hashes == [b"h0", b"h1"]
    assert done[-1] == Release("r1") and len(done) == 3
    assert track.handoff is not None and track.handoff.state is HandoffState.DONE
    assert core.track("r1") is None and core.handoffs_done == 1
    # Whatever comes late changes nothing: no second PrefillDone, no second release.
    assert core.on_kv_reply("d1", KvAck("r1", "lease-1", True), now=5.0) == []
    assert core.on_tick(100.0) == []


def handing_off_output(core: WorkerCore) -> list[Action]:
    return core.on_outputs([output("r1", new=[55], handoff=True, hashes=[b"h0", b"h1"])], step=1, now=1.0)


def _reserving(core: WorkerCore) -> None:
    handing_off(core)
    core.on_exported("r1", KV, now=2.0)


def _transferring(core: WorkerCore) -> None:
    _reserving(core)
    core.on_kv_reply("d1", KvReserveReply("r1", "lease-1", True), now=3.0)


FAILURES = {
    "reserve refused": (_reserving, lambda c: c.on_kv_reply("d1", KvReserveReply("r1", "", False, "full"), 4.0),
                        "overloaded", HandoffFailure.RESERVE_REFUSED, "d1: full"),
    "ack refused": (_transferring, lambda c: c.on_kv_reply("d1", KvAck("r1", "lease-1", False, "bad"), 4.0),
                    "internal", HandoffFailure.KV_REFUSED, "d1 refused the KV: bad"),
    "reserve timeout": (_reserving, lambda c: c.on_tick(2.0 + TIMEOUT), "worker_lost", HandoffFailure.TIMED_OUT,
                        "d1 did not answer the handoff"),
    "ack timeout": (_transferring, lambda c: c.on_tick(3.0 + TIMEOUT), "worker_lost", HandoffFailure.TIMED_OUT,
                    "d1 did not answer the handoff"),
    "export failed": (handing_off, lambda c: c.on_handoff_error("r1", RuntimeError("not held")), "internal",
                      HandoffFailure.ERROR, "handoff failed: not held"),
    "send failed": (_transferring, lambda c: c.on_handoff_error("r1", OSError("gone")), "internal",
                    HandoffFailure.ERROR, "handoff failed: gone"),
}


@pytest.mark.parametrize("case", FAILURES)
def test_handoff_failure_reports_its_code_once_and_releases(case: str) -> None:
    setup, fail, code, failure, message = FAILURES[case]
    core = prefill()
    setup(core)
    track = core.track("r1")
    assert track is not None and track.handoff is not None
    actions = fail(core)
    assert actions == [ToRouter(ErrorReply("r1", code, message)), Release("r1")]
    assert failure.code == code and track.handoff.state is HandoffState.FAILED and track.handoff.failure is failure
    assert core.track("r1") is None and core.handoffs_failed == Counter({failure: 1})
    assert core.on_tick(1000.0) == [] and core.on_kv_reply("d1", KvAck("r1", "lease-1", True), 5.0) == []


def test_unknown_decode_worker_fails_at_once_with_internal() -> None:
    core = prefill()
    actions = handing_off(core, decode="d9")
    assert actions == [ToRouter(ErrorReply("r1", "internal", "handoff failed: unknown decode worker 'd9'")),
                       Release("r1")]
    assert core.track("r1") is None and core.handoffs_failed[HandoffFailure.UNKNOWN_PEER] == 1


def test_timeout_counts_from_each_send() -> None:
    core = prefill()
    _reserving(core)
    assert core.on_tick(2.0 + TIMEOUT - 0.01) == []
    core.on_kv_reply("d1", KvReserveReply("r1", "lease-1", True), now=6.0)
    assert core.on_tick(6.0 + TIMEOUT - 0.01) == [] and state(core) is HandoffState.TRANSFERRING
    assert [m.code for m in to_router(core.on_tick(6.0 + TIMEOUT))] == ["worker_lost"]


@pytest.mark.parametrize("reply", [
    KvReserveReply("r1", "lease-1", True),  # from the wrong peer
    KvAck("r1", "lease-1", True),  # not the awaited reply yet
])
def test_replies_that_do_not_answer_the_awaited_question_are_stale(reply: Any) -> None:
    core = prefill()
    _reserving(core)
    peer = "d2" if isinstance(reply, KvReserveReply) else "d1"
    assert core.on_kv_reply(peer, reply, 3.0) == [] and state(core) is HandoffState.RESERVING and core.stale == 1
    core.on_kv_reply("d1", KvReserveReply("r1", "lease-1", True), 3.0)
    assert core.on_kv_reply("d1", KvAck("r1", "other-lease", True), 4.0) == []  # not for the granted lease
    assert state(core) is HandoffState.TRANSFERRING


@pytest.mark.parametrize("setup", [handing_off, _reserving, _transferring])
def test_abort_mid_handoff_sends_nothing_more(setup: Any) -> None:
    core = prefill()
    setup(core)
    track = core.track("r1")
    assert track is not None and track.handoff is not None
    assert core.on_abort("r1") == [Abort("r1")]  # the engine abort releases the held blocks
    assert track.handoff.state is HandoffState.DROPPED and len(core) == 0
    late = [core.on_exported("r1", KV, 5.0), core.on_handoff_error("r1", RuntimeError("not held")),
            core.on_kv_reply("d1", KvReserveReply("r1", "lease-1", True), 5.0),
            core.on_kv_reply("d1", KvAck("r1", "lease-1", True), 5.0), core.on_tick(1000.0),
            core.on_outputs([output(new=[], finish="abort")], 9, 6.0)]
    assert late == [[]] * len(late)


def test_a_first_token_that_ends_the_request_finishes_on_the_prefill_worker() -> None:
    core = prefill()
    core.on_job(job(), 0.0)
    actions = core.on_outputs([output(new=[2], finish="stop")], 1, 1.0)
    assert [type(m) for m in to_router(actions)] == [PrefillDone]
    assert [(it.offset, it.finished) for _, it in items(actions)] == [(0, True)] and len(core) == 0


# -- decode side -------------------------------------------------------------------------------------


def test_reserve_reply_names_the_lease_after_the_request() -> None:
    core = WorkerCore("d1", "decode", SPEC, set())
    req = KvReserve("r1", 3, 10, 7, "p1", 10.0)
    assert core.on_reserved(PEER, req, True, 50) == [ToPrefill(PEER, KvReserveReply("r1", "r1", True, "", 10.0))]
    assert core.on_reserved(PEER, req, False, 2) == [
        ToPrefill(PEER, KvReserveReply("r1", "r1", False, "3 KV blocks not free (2 free)", 0.0))]


def test_transfer_pushes_the_first_token_before_install_then_acks() -> None:
    core = WorkerCore("d1", "decode", SPEC, set())
    t = transfer(n=9, resumed=2)
    push, install = core.on_transfer(PEER, t, step=8)
    assert isinstance(push, ToTokenizer) and push.tokenizer == "tok2" and push.batch.step == 8
    assert [(it.request_id, it.offset, it.token_ids) for it in push.batch.items] == [("t1", 2, [42])]
    assert isinstance(install, Install) and install.prompt == list(range(7)) and install.resumed == [7, 8]
    assert core.on_installed(PEER, t) == [ToPrefill(PEER, KvAck("t1", "t1", True))]
    nxt = core.on_outputs([output("t1", new=[43])], step=9, now=1.0)
    assert to_router(nxt) == [] and [it.offset for _, it in items(nxt)] == [3]  # never a PrefillDone here


@pytest.mark.parametrize(("t", "reason"), [
    (transfer(layout="blocks,kv,layers"), f"KV layout 'blocks,kv,layers'/block 4 does not match {KV_LAYOUT!r}/block 4"),
    (transfer(bs=8), f"KV layout {KV_LAYOUT!r}/block 8 does not match {KV_LAYOUT!r}/block 4"),
    (transfer(n=3, resumed=5), "num_output_tokens 5 does not fit 3 tokens"),
])
def test_a_transfer_that_does_not_fit_is_refused_and_its_reservation_cancelled(t: KvTransfer, reason: str) -> None:
    core = WorkerCore("w1", "worker", SPEC, set())
    assert core.on_transfer(PEER, t, 1) == [CancelReservation("t1"), ToPrefill(PEER, KvAck("t1", "t1", False, reason))]
    assert len(core) == 0


def test_a_failed_install_cancels_the_reservation_and_refuses_the_ack() -> None:
    core = WorkerCore("d1", "decode", SPEC, set())
    t = transfer()
    core.on_transfer(PEER, t, 1)
    assert core.on_install_failed(PEER, t, RuntimeError("no reservation")) == [
        CancelReservation("t1"), ToPrefill(PEER, KvAck("t1", "t1", False, "no reservation"))]
    assert len(core) == 0 and core.on_outputs([output("t1")], 2, 1.0) == []


# -- router restart ------------------------------------------------------------------------------------


def test_router_restart_drops_everything() -> None:
    core = WorkerCore("p1", "prefill", SPEC, {"d1"}, handoff_timeout_s=TIMEOUT)
    core.on_job(job("a"), 0.0)
    handing_off(core, "b")
    _ = core.on_exported("b", KV, 2.0)
    core.on_transfer(PEER, transfer("c"), 1)
    assert len(core) == 3
    assert core.on_router_restart(3.0) == [AbortAll()]
    assert len(core) == 0
    assert core.on_outputs([output("a"), output("c")], 2, 3.0) == []
    assert core.on_kv_reply("d1", KvReserveReply("b", "b", True), 3.0) == [] and core.on_tick(1000.0) == []


def test_router_restart_keeps_the_decoding_requests_a_client_can_resume() -> None:
    core = colocated(offer_blocks=True)
    for rid, key, params in [("a", "c/a", SamplingParamsWire(max_tokens=7)), ("b", "c/b", None),
                             ("lp", "c/lp", SamplingParamsWire(max_tokens=7, logprobs=1)), ("nokey", "", None)]:
        j = job(rid, key=key)
        core.on_job(j if params is None else dataclasses.replace(j, params=params), 0.0)
    core.on_outputs([output("a", [5]), output("lp", [5]), output("nokey", [5])], 1, 1.0)  # b: still prefilling
    assert core.on_router_restart(2.0) == [AbortAll(frozenset({"a"}))]
    assert len(core) == 1
    # Orphaned: the engine goes on, nothing is streamed; the new router hears of it.
    assert core.on_outputs([output("a", [6, 7])], 2, 3.0) == []
    assert core.held() == [HeldRequest("a", "c/a", 3)]
    # The client had one token: the rest goes to the tokenizer the new router named, from offset 1.
    prompt = job("a").token_ids
    [(tok, it)] = items(core.on_reclaim(Reclaim("a", "tok7", [*prompt, 5], 1), 4))
    assert (tok, it.request_id, it.offset, it.token_ids, it.finished) == ("tok7", "a", 1, [6, 7], False)
    assert core.held() == []
    [(tok, it)] = items(core.on_outputs([output("a", [8], finish="stop")], 5, 4.0))
    assert (tok, it.offset, it.token_ids, it.finished, it.finish_reason) == ("tok7", 3, [8], True, "stop")
    assert len(core) == 0


def test_a_request_that_finished_while_orphaned_ends_with_its_reclaim() -> None:
    core = WorkerCore("d1", "decode", SPEC, set(), offer_blocks=True)
    core.on_transfer(PEER, transfer("t", n=6, resumed=2, key="c/t"), 1)
    assert core.on_router_restart(0.0) == [AbortAll(frozenset({"t"}))]
    assert core.owed() == 1  # decoding: a drain waits for it
    done = core.on_outputs([output("t", [9], finish="length", hashes=[b"x"])], 2, 1.0)
    assert core.owed() == 0 and len(core) == 1  # finished, held for a Reclaim: a drain does not wait for it
    [offer] = done  # its blocks still go to the cache; no item
    assert isinstance(offer, OfferBlocks) and (offer.request_id, offer.block_hashes) == ("t", [b"x"])
    # The transfer's prompt is 4 tokens and 2 of output; then 42 (the first token here) and 9.
    assert core.held() == [HeldRequest("t", "c/t", 4)]
    [(_, it)] = items(core.on_reclaim(Reclaim("t", "tok1", [0, 1, 2, 3, 4, 5, 42], 3), 3))
    assert (it.offset, it.token_ids, it.finished, it.finish_reason) == (3, [9], True, "length")
    assert len(core) == 0


def test_a_finished_request_whose_end_the_router_never_acknowledged_is_kept_too() -> None:
    core = colocated()
    for rid in ("acked", "lost"):
        core.on_job(job(rid, key=f"c/{rid}"), 0.0)
        core.on_outputs([output(rid, [5, 6], finish="stop")], 1, 1.0)
    core.on_abort("acked")  # the router's AbortRequest after the end: it reached the client
    assert core.on_router_restart(2.0) == [AbortAll(frozenset({"lost"}))]
    assert core.held() == [HeldRequest("lost", "c/lost", 2)] and core.owed() == 0
    [(_, it)] = items(core.on_reclaim(Reclaim("lost", "tok1", [*job("lost").token_ids, 5], 1), 3))
    assert (it.offset, it.token_ids, it.finished, it.finish_reason) == (1, [6], True, "stop")
    assert len(core) == 0


def test_a_reclaim_of_another_sequence_or_of_nothing_held_is_refused() -> None:
    core = colocated()
    core.on_job(job("a", key="c/a"), 0.0)
    core.on_outputs([output("a", [5])], 1, 1.0)
    core.on_router_restart(2.0)
    assert to_router(core.on_reclaim(Reclaim("zz", "tok1", [1], 0), 3))[0].code == "worker_lost"
    # The right prompt but another first token: not this sequence.
    actions = core.on_reclaim(Reclaim("a", "tok1", [*job("a").token_ids, 6], 1), 3)
    assert [m.code for m in to_router(actions)] == ["worker_lost"] and Abort("a") in actions and len(core) == 0
    # A prompt of another length (the client's count does not match): refused too.
    core.on_job(job("b", key="c/b"), 0.0)
    core.on_outputs([output("b", [5])], 1, 1.0)
    core.on_router_restart(2.0)
    assert to_router(core.on_reclaim(Reclaim("b", "tok1", [*job("b").token_ids, 5], 0), 3))[0].code == "worker_lost"


def test_an_orphan_no_client_reclaims_is_aborted_when_its_hold_runs_out() -> None:
    core = colocated(held_for_s=10.0)
    core.on_job(job("a", key="c/a"), 0.0)
    core.on_outputs([output("a", [5])], 1, 1.0)
    core.on_router_restart(2.0)
    core.on_router_restart(5.0)  # a second restart: still one orphan, held from the first
    assert core.expire_held(11.0) == [] and len(core) == 1
    assert core.expire_held(12.5) == [Abort("a")] and len(core) == 0


# -- every request ends exactly once ---------------------------------------------------------------------


class WorkerCoreMachine(RuleBasedStateMachine):
    """Random interleavings of jobs, engine outputs, export results, peer replies, timer ticks, aborts,
    restarts and transfers. After each event: messages concern only requests held before it (or started
    by it); a request whose track went away ended with exactly one terminal message (ErrorReply, finished
    item, or PrefillDone of its handoff), or silently by abort/restart/failed install; held blocks were
    freed exactly once on the way out; offsets are contiguous; PrefillDone at most once per job.
    Run once per role (a subclass each), so that every run can reach the role's later states."""

    role = "worker"

    @initialize()
    def start(self) -> None:
        self.core = WorkerCore("w", self.role, SPEC, {"d1", "d2"}, offer_blocks=True, handoff_timeout_s=TIMEOUT)
        self.now, self.n = 0.0, 0
        self.known: list[str] = []
        self.kind: dict[str, str] = {}
        self.jobs: dict[str, PrefillJob] = {}
        self.pending_add: set[str] = set()
        self.pending_install: dict[str, KvTransfer] = {}
        self.next_offset: dict[str, int] = {}
        self.holding_blocks: set[str] = set()  # got a handoff output: the engine holds its blocks
        self.ended: set[str] = set()
        self.prefill_done: Counter[str] = Counter()
        self.orphans: set[str] = set()  # kept through a router restart, not reclaimed yet
        self.done_orphans: set[str] = set()  # of those, finished meanwhile
        self.keyed: set[str] = set()  # started with a client key
        self.unacked: set[str] = set()  # keyed, finished here, not aborted since (the router's acknowledgement)

    def held(self) -> set[str]:
        return {rid for rid in self.known if self.core.track(rid) is not None}

    def new_rid(self, kind: str) -> str:
        self.n += 1
        rid = f"{kind}{self.n}"
        self.known.append(rid)
        self.kind[rid] = kind
        return rid

    def feed(self, actions: list[Action], before: set[str], *, new: str | None = None,
             silent: set[str] | None = None, abort_all: bool = False) -> None:
        silent = silent or set()
        after = self.held()
        msgs: dict[str, list[Any]] = {}
        for a in actions:
            if isinstance(a, ToRouter | ToDecode):
                msgs.setdefault(a.msg.request_id, []).append(a.msg)
            elif isinstance(a, ToTokenizer):
                for it in a.batch.items:
                    msgs.setdefault(it.request_id, []).append(it)
            elif isinstance(a, Release):
                assert a.request_id in self.holding_blocks and a.request_id not in after, a
        for rid, ms in msgs.items():
            assert rid in before or rid == new, (rid, ms)  # nothing about a request no longer held
            for msg in ms:
                if isinstance(msg, DetokenizeItem):
                    assert msg.offset == self.next_offset[rid], (rid, msg)
                    self.next_offset[rid] += len(msg.token_ids)
                elif isinstance(msg, PrefillDone):
                    assert self.kind[rid] == "job"
                    self.prefill_done[rid] += 1
                    assert self.prefill_done[rid] == 1
                elif isinstance(msg, ErrorReply):
                    assert msg.code in ("internal", "invalid_request", "overloaded", "worker_lost")
        for rid in (before - after) | ({new} - after if new else set()):
            ms = msgs.get(rid, [])
            terminal = sum(isinstance(m, ErrorReply) or (isinstance(m, DetokenizeItem) and m.finished)
                           or (isinstance(m, PrefillDone) and rid in self.holding_blocks) for m in ms)
            assert rid not in self.ended
            self.ended.add(rid)
            assert terminal == (0 if rid in silent else 1), (rid, ms)
            if rid in self.holding_blocks:
                freed = actions.count(Release(rid)) + actions.count(Abort(rid)) + sum(
                    isinstance(a, AbortAll) and rid not in a.keep for a in actions)
                assert freed == 1, (rid, actions)
        for rid in after & before:
            ms = msgs.get(rid, [])
            assert not any(isinstance(m, ErrorReply) or (isinstance(m, DetokenizeItem) and m.finished) for m in ms)
        assert abort_all == any(isinstance(a, AbortAll) for a in actions)
        for rid in self.orphans:  # nothing is streamed of a request no router holds
            assert rid not in msgs, (rid, msgs[rid])

    @invariant()
    def core_holds_what_was_started_and_not_ended(self) -> None:
        if hasattr(self, "core"):
            assert len(self.core) == len(self.held()) == len(set(self.known) - self.ended)

    # -- the router ----------------------------------------------------------------------------------

    @precondition(lambda self: self.core.role != "decode" and len(self.held()) < 4)
    @rule(resumed=st.integers(0, 6), peer=st.sampled_from(["d1", "d1", "d2", "d9"]), added=st.integers(0, 3),
          keyed=st.booleans())
    def new_job(self, resumed: int, peer: str, added: int, keyed: bool) -> None:
        rid = self.new_rid("job")
        j = self.jobs[rid] = job(rid, n=6, decode=peer, resumed=resumed, key=f"c/{rid}" if keyed else "")
        if keyed and self.core.role != "prefill":
            self.keyed.add(rid)
        self.next_offset[rid] = resumed
        actions = self.core.on_job(j, self.now)
        if resumed < 6:
            assert [type(a) for a in actions] == [AddJob]
            if not added:  # else the engine took it at once
                self.pending_add.add(rid)
            self.feed(actions, self.held() - {rid})
        else:  # refused before it was held
            assert [m.code for m in to_router(actions)] == ["invalid_request"] and self.core.track(rid) is None
            self.ended.add(rid)

    @precondition(lambda self: self.pending_add)
    @rule(data=st.data(), fails=st.sampled_from([None, "invalid", "error"]), loaded=st.booleans())
    def add_resolved(self, data: st.DataObject, fails: str | None, loaded: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.pending_add)))
        self.pending_add.discard(rid)
        before = self.held()
        if loaded:
            assert self.core.on_prefix_loaded(self.jobs[rid], 0.1) == (rid in before)
        if fails is not None:
            error = InvalidRequestError("no") if fails == "invalid" else RuntimeError("boom")
            self.feed(self.core.on_add_failed(self.jobs[rid], error), before)

    @rule(data=st.data(), go=st.sampled_from([False, False, False, True]))
    def abort(self, data: st.DataObject, go: bool) -> None:
        if not go:
            return  # aborts come at a quarter of the rate, so that handoffs get far enough to end otherwise
        rid = data.draw(st.sampled_from([*self.known, "never-seen"]))
        before = self.held()
        actions = self.core.on_abort(rid)
        assert actions == [Abort(rid)] and self.core.track(rid) is None
        self.orphans.discard(rid)
        self.done_orphans.discard(rid)
        self.unacked.discard(rid)
        self.feed(actions, before, silent={rid})

    @precondition(lambda self: len(self.held()) >= 3)
    @rule()
    def router_restart(self) -> None:
        before = self.held()
        # Kept: what decodes here (its first token made here, or its KV installed or coming) under a client key,
        # and every orphan of an earlier restart (one that finished before its first token was reported too).
        keep = {rid for rid in before if (t := self.core.track(rid)) is not None and (t.orphaned_at is not None or (
                t.client_key and t.handoff is None and (t.job is None or t.prefill_reported)))}
        actions = self.core.on_router_restart(self.now)
        assert actions == [AbortAll(frozenset(keep | self.unacked))]
        self.feed(actions, before, silent=before - keep, abort_all=True)
        # The finished ones whose end the router never acknowledged are back, finished, for a Reclaim.
        self.ended -= self.unacked
        self.done_orphans |= self.unacked
        keep |= self.unacked
        self.unacked.clear()
        self.orphans |= keep
        assert self.held() == keep
        assert {h.request_id for h in self.core.held()} == keep

    @precondition(lambda self: self.orphans or self.ended)
    @rule(data=st.data(), right=st.sampled_from([True, True, True, False]))
    def reclaim(self, data: st.DataObject, right: bool) -> None:
        """The new router sends a resumed request back: the client's output (any prefix of what this worker
        made), or a sequence that is not this worker's, or a request it no longer holds."""
        rid = data.draw(st.sampled_from(sorted(self.orphans) or sorted(self.ended)))
        track = self.core.track(rid)
        before = self.held()
        if track is None or track.orphaned_at is None:
            actions = self.core.on_reclaim(Reclaim(rid, "tok9", [1, 2], 1), 1)
            # The answer to the router's question, about a request that ended here: nothing else.
            assert [m.code for m in to_router(actions)] == ["worker_lost"] and len(actions) == 1
            assert self.held() == before
            return
        made = len(track.tokens) - track.prompt_len
        n = data.draw(st.integers(0, made))
        tokens = track.tokens[:track.prompt_len + n]
        if not right:
            tokens = [*tokens[:-1], tokens[-1] + 1000]
        actions = self.core.on_reclaim(Reclaim(rid, "tok9", tokens, n), 1)
        self.orphans.discard(rid)
        if right:
            self.next_offset[rid] = n
            assert not to_router(actions)
            if rid in self.done_orphans or made > n:
                [(tok, it)] = items(actions)
                assert (tok, it.token_ids, it.finished) == ("tok9", track.tokens[track.prompt_len + n:],
                                                           rid in self.done_orphans)
            self.done_orphans.discard(rid)
            self.feed(actions, before)
        else:
            assert [m.code for m in to_router(actions)] == ["worker_lost"] and Abort(rid) in actions
            self.done_orphans.discard(rid)
            self.feed(actions, before)

    @precondition(lambda self: self.orphans)
    @rule()
    def hold_runs_out(self) -> None:
        before = self.held()
        self.now += self.core.held_for_s + 1
        actions = self.core.expire_held(self.now)
        assert sorted(actions, key=str) == sorted((Abort(rid) for rid in self.orphans), key=str)
        self.feed(actions, before, silent=set(self.orphans))
        self.orphans.clear()
        self.done_orphans.clear()

    # -- the engine ----------------------------------------------------------------------------------

    def steppable(self) -> list[str]:
        return [rid for rid in sorted(self.held()) if rid not in self.pending_add and rid not in self.pending_install
                and rid not in self.holding_blocks and rid not in self.done_orphans]

    @precondition(lambda self: self.steppable())
    @rule(data=st.data(), late=st.booleans())
    def step(self, data: st.DataObject, late: bool) -> None:
        pool = self.steppable() + (sorted(self.ended) if late else [])
        rids = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique=True))
        outs = []
        for rid in rids:
            # A prefill-only request's one output either hands it off or finishes it.
            prefill_only = self.core.role == "prefill" and self.kind[rid] == "job" and rid not in self.ended
            if prefill_only and data.draw(st.booleans()):
                self.holding_blocks.add(rid)
                outs.append(output(rid, new=[1], handoff=True))
            else:
                finish = data.draw(st.sampled_from([None, None, "stop", "length", "error", "abort"]))
                if finish == "abort" and rid not in self.ended:
                    finish = None  # the engine reports an abort only after one was asked
                if prefill_only and finish is None:
                    finish = "length"
                outs.append(output(rid, new=data.draw(st.lists(st.integers(0, 9), max_size=3)), finish=finish))
        before = self.held()
        silent = set()
        for out in outs:
            if out.request_id in self.orphans and out.finished:
                if out.finish_reason is FinishReason.ERROR:  # it ends here, silently: a Reclaim is refused
                    self.orphans.discard(out.request_id)
                    silent.add(out.request_id)
                else:
                    self.done_orphans.add(out.request_id)
            elif (out.request_id in before and out.request_id in self.keyed and out.finished and not out.handoff
                  and out.finish_reason is not FinishReason.ERROR):
                self.unacked.add(out.request_id)
        self.feed(self.core.on_outputs(outs, step=1, now=self.now), before, silent=silent)

    def in_state(self, *states: HandoffState) -> list[str]:
        return [rid for rid in sorted(self.held()) if (t := self.core.track(rid)) and t.handoff
                and t.handoff.state in states]

    # One rule for every handoff event, so that a run that enables it can take a handoff to its end (a
    # run enables only some of the rules).
    @precondition(lambda self: self.holding_blocks)
    @rule(data=st.data(), ok=st.sampled_from([True] * 5 + [False]),
          what=st.sampled_from(["answer"] * 6 + ["wrong peer", "send failed", "overdue"]))
    def handoff_event(self, data: st.DataObject, ok: bool, what: str) -> None:
        """The next event of one handoff: the export's result, the decode worker's reply (or one from another
        peer), a failed send, or its deadline passing; for a handoff that ended, the same arriving late."""
        live, ended = sorted(self.held() & self.holding_blocks), sorted(self.holding_blocks - self.held())
        late = not live or bool(ended) and data.draw(st.sampled_from([False, False, False, True]))
        rid = data.draw(st.sampled_from(ended if late else live))
        track = self.core.track(rid)
        hand = track.handoff if track is not None else None
        before = self.held()
        if what == "send failed":
            actions = self.core.on_handoff_error(rid, OSError("gone"))
        elif what == "overdue":
            self.now += TIMEOUT
            actions = self.core.on_tick(self.now)
        elif hand is not None and hand.state is HandoffState.EXPORTING or hand is None and data.draw(st.booleans()):
            actions = (self.core.on_exported(rid, KV, self.now) if ok
                       else self.core.on_handoff_error(rid, RuntimeError("not held")))
        else:
            right = hand is not None and what == "answer"
            peer = hand.peer if right and hand is not None else "d2" if hand is None or hand.peer == "d1" else "d1"
            reply: Any = (KvAck(rid, hand.lease_id, ok) if hand is not None and hand.state is HandoffState.TRANSFERRING
                          else KvReserveReply(rid, f"lease-{rid}", ok, "" if ok else "full"))
            actions = self.core.on_kv_reply(peer, reply, self.now)
            if not right:
                assert actions == []
        self.feed(actions, before)

    @precondition(lambda self: self.in_state(HandoffState.RESERVING, HandoffState.TRANSFERRING))
    @rule(dt=st.sampled_from([0.5, 2.0, TIMEOUT]))
    def tick(self, dt: float) -> None:
        self.now += dt
        before = self.held()
        self.feed(self.core.on_tick(self.now), before)

    # -- the decode side -------------------------------------------------------------------------------

    @precondition(lambda self: self.core.role != "prefill" and len(self.held()) < 4)
    @rule(resumed=st.integers(0, 5), fits=st.booleans(), keyed=st.booleans())
    def kv_transfer(self, resumed: int, fits: bool, keyed: bool) -> None:
        rid = self.new_rid("kv")
        t = transfer(rid, n=5, resumed=resumed, layout=KV_LAYOUT if fits else "other", key=f"c/{rid}" if keyed else "")
        if keyed:
            self.keyed.add(rid)
        before = self.held()
        self.next_offset[rid] = resumed
        actions = self.core.on_transfer(PEER, t, 1)
        if fits and resumed < 5:
            assert [type(a) for a in actions] == [ToTokenizer, Install]
            self.pending_install[rid] = t
            self.feed(actions, before, new=rid)
        else:
            assert [type(a) for a in actions] == [CancelReservation, ToPrefill]
            self.ended.add(rid)
            self.feed(actions, before)

    @precondition(lambda self: self.pending_install)
    @rule(data=st.data(), ok=st.booleans())
    def installed(self, data: st.DataObject, ok: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.pending_install)))
        t = self.pending_install.pop(rid)
        before = self.held()
        if ok:
            actions = self.core.on_installed(PEER, t)
            assert actions == [ToPrefill(PEER, KvAck(rid, rid, True))]
        else:
            actions = self.core.on_install_failed(PEER, t, RuntimeError("no room"))
            assert actions[0] == CancelReservation(rid)
            self.orphans.discard(rid)
        self.feed(actions, before, silent={rid})


class PrefillCoreMachine(WorkerCoreMachine):
    role = "prefill"


class DecodeCoreMachine(WorkerCoreMachine):
    role = "decode"


def _settings(examples: int) -> settings:
    return settings(max_examples=examples, stateful_step_count=50, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


TestColocatedCore = WorkerCoreMachine.TestCase
TestColocatedCore.settings = _settings(80)
TestPrefillCore = PrefillCoreMachine.TestCase
TestPrefillCore.settings = _settings(200)  # a handoff needs many events in a row to end
TestDecodeCore = DecodeCoreMachine.TestCase
TestDecodeCore.settings = _settings(60)


# -- logprobs (protocol 8) ----------------------------------------------------------------------------------


def _lps(tokens: list[int]) -> list[Logprob]:
    return [Logprob(t, -0.25 * (i + 1), [(t, -0.25 * (i + 1))]) for i, t in enumerate(tokens)]


def test_each_item_carries_its_own_tokens_logprobs_and_the_first_the_prompts() -> None:
    core = colocated()
    core.on_job(job(n=3), now=0.0)
    prompt = [None, *_lps([101, 102])]
    a = output(new=[5, 6])
    a.new_logprobs, a.prompt_logprobs = _lps([5, 6]), prompt
    b = output(new=[7], finish="length")
    b.new_logprobs, b.prompt_logprobs, b.logprobs = _lps([7]), prompt, _lps([5, 6]) + _lps([7])
    [(_, first)] = items(core.on_outputs([a], 1, 1.0))
    [(_, last)] = items(core.on_outputs([b], 2, 2.0))
    assert [lp.token_id for lp in first.logprobs] == [5, 6] and [lp.token_id for lp in last.logprobs] == [7]
    assert first.prompt_logprobs == [None, LogprobWire(101, -0.25, [(101, -0.25)]),
                                     LogprobWire(102, -0.5, [(102, -0.5)])]
    assert last.prompt_logprobs is None  # once, with the first item


def test_handoff_carries_prompt_and_first_logprobs_to_the_decode_worker() -> None:
    core = prefill()
    core.on_job(job(n=3), 0.0)
    out = output(new=[7], handoff=True)
    out.new_logprobs, out.prompt_logprobs = _lps([7]), [None, *_lps([101, 102])]
    core.on_outputs([out], 1, 1.0)
    core.on_exported("r1", KV, 1.0)
    [send] = core.on_kv_reply("d1", KvReserveReply("r1", "L1", True, "", 10.0), 1.0)
    t = send.msg
    assert isinstance(t, KvTransfer) and t.first_logprob == LogprobWire(7, -0.25, [(7, -0.25)])
    assert t.prompt_logprobs is not None and t.prompt_logprobs[0] is None and t.prompt_logprobs[2].token_id == 102


def test_the_decode_workers_first_item_carries_the_transferred_logprobs() -> None:
    core = WorkerCore("d1", "decode", SPEC, set())
    prompt = [None, LogprobWire(1, -1.0)]
    t = dataclasses.replace(transfer(n=2), params=SamplingParamsWire(logprobs=0, prompt_logprobs=0),
                            first_logprob=LogprobWire(42, -0.1), prompt_logprobs=prompt)
    push, _ = core.on_transfer(PEER, t, step=1)
    [item] = push.batch.items
    assert (item.token_ids, item.logprobs, item.prompt_logprobs) == ([42], [LogprobWire(42, -0.1)], prompt)
    nxt = core.on_outputs([dataclasses.replace(output("t1", new=[43]), new_logprobs=_lps([43]))], 2, 1.0)
    [(_, it)] = items(nxt)
    assert [lp.token_id for lp in it.logprobs] == [43] and it.prompt_logprobs is None
    plain = WorkerCore("d1", "decode", SPEC, set()).on_transfer(PEER, transfer(n=2), step=1)[0]
    assert plain.batch.items[0].logprobs is None and plain.batch.items[0].prompt_logprobs is None
