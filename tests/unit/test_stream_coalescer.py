"""The worker's stream interval (deepinfer/services/stream_coalescer.py, and WorkerCore's use of it)."""

from __future__ import annotations

import pytest

from deepinfer.protocol.messages import DetokenizeItem
from deepinfer.services.stream_coalescer import StreamCoalescer
from tests.unit.test_worker_core import colocated, items, job, output, transfer


def test_items_of_one_request_merge_in_order() -> None:
    s = StreamCoalescer(0.02)
    s.add("tok", DetokenizeItem("a", 3, [1, 2], logprobs=None, prompt_logprobs=None))
    s.add("tok", DetokenizeItem("b", 0, [9]))
    s.add("tok", DetokenizeItem("a", 5, [3], finished=True, finish_reason="stop", spec_proposed_tokens=4,
                                spec_accepted_tokens=2))
    s.add("other", DetokenizeItem("c", 0, [7]))
    out = s.take(1.0)
    assert not s
    a, b = out["tok"]
    assert (a.request_id, a.offset, a.token_ids, a.finished, a.finish_reason) == ("a", 3, [1, 2, 3], True, "stop")
    assert (a.spec_proposed_tokens, a.spec_accepted_tokens) == (4, 2)  # totals: the latest
    assert (b.request_id, b.token_ids) == ("b", [9]) and [i.request_id for i in out["other"]] == ["c"]


def test_logprobs_and_prompt_logprobs_merge() -> None:
    s = StreamCoalescer(0.02)
    lp1, lp2 = [(5, -0.1, [])], [(6, -0.2, [])]
    s.add("t", DetokenizeItem("a", 0, [5], logprobs=lp1, prompt_logprobs=[None, (1, -1.0, [])]))
    s.add("t", DetokenizeItem("a", 1, [6], logprobs=lp2))
    [merged] = s.take(0.0)["t"]
    assert merged.logprobs == lp1 + lp2 and merged.prompt_logprobs == [None, (1, -1.0, [])]


def test_due_counts_from_the_last_send() -> None:
    s = StreamCoalescer(0.02)
    assert s.due(0.0)  # nothing sent yet
    s.take(10.0)
    assert not s.due(10.01) and s.due(10.03)
    zero = StreamCoalescer(0.0)
    zero.take(5.0)
    assert zero.due(5.0)


def test_drop_forgets_a_request() -> None:
    s = StreamCoalescer()
    s.add("t", DetokenizeItem("a", 0, [1]))
    s.add("t", DetokenizeItem("b", 0, [2]))
    s.drop("a")
    assert [i.request_id for i in s.take(0.0)["t"]] == ["b"]
    s.add("t", DetokenizeItem("a", 0, [1]))
    s.drop("a")
    assert not s


def test_negative_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="stream interval"):
        StreamCoalescer(-1.0)


# -- in the worker core ----------------------------------------------------------------------------------


def test_core_sends_first_tokens_at_once_holds_the_rest_and_sends_finishes_at_once() -> None:
    core = colocated(stream_interval_s=0.02)
    core.on_job(job("a"), now=0.0)
    core.on_job(job("b"), now=0.0)
    first = items(core.on_outputs([output("a", new=[1]), output("b", new=[2])], step=1, now=1.0))
    assert [(it.request_id, it.token_ids) for _, it in first] == [("a", [1]), ("b", [2])]
    # within the interval: held
    assert items(core.on_outputs([output("a", new=[3]), output("b", new=[4])], step=2, now=1.005)) == []
    assert items(core.on_outputs([output("a", new=[5])], step=3, now=1.01)) == []
    assert core.stream
    # a finish sends everything held, each request's tokens merged and contiguous
    sent = items(core.on_outputs([output("b", new=[6], finish="stop")], step=4, now=1.015))
    assert [(it.request_id, it.offset, it.token_ids, it.finished) for _, it in sent] == [
        ("a", 1, [3, 5], False), ("b", 1, [4, 6], True)]
    assert not core.stream
    # the interval passed: the next step sends
    assert items(core.on_outputs([output("a", new=[7])], step=5, now=1.02)) == []
    [(_, it)] = items(core.on_outputs([output("a", new=[8])], step=6, now=1.04))
    assert (it.offset, it.token_ids) == (3, [7, 8])


def test_core_flush_from_the_timer_and_nothing_for_a_request_that_ended() -> None:
    core = colocated(stream_interval_s=0.02)
    core.on_job(job("a"), now=0.0)
    core.on_job(job("b"), now=0.0)
    core.on_outputs([output("a", new=[1]), output("b", new=[2])], step=1, now=1.0)
    core.on_outputs([output("a", new=[3]), output("b", new=[4])], step=2, now=1.001)
    core.on_abort("a")  # its held tokens must not follow the abort
    [(_, it)] = items(core.stream_flush(step=2, now=1.03))
    assert (it.request_id, it.token_ids) == ("b", [4])
    assert core.stream_flush(step=2, now=1.05) == []


def test_decode_side_first_engine_tokens_may_wait_the_pushed_first_token_did_not() -> None:
    core = colocated(stream_interval_s=0.02)
    pushed = items(core.on_transfer(b"p1", transfer("t1"), step=1))
    assert [it.token_ids for _, it in pushed] == [[transfer("t1").first_token]]
    core.stream.take(1.0)  # as if something was sent at t=1.0
    assert items(core.on_outputs([output("t1", new=[42])], step=2, now=1.001)) == []


def test_zero_interval_sends_every_step() -> None:
    core = colocated(stream_interval_s=0.0)
    core.on_job(job("a"), now=0.0)
    for step in range(1, 5):
        assert len(items(core.on_outputs([output("a", new=[step])], step=step, now=1.0))) == 1
