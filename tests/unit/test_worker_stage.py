"""The worker's stage (services/worker_stage.py): jobs enter the engine only while its queue is short, in
the engine's order, so each job's cache lookup runs when work on it is about to start."""

from __future__ import annotations

import pytest

from deepinfer.services.worker_stage import Stage


def test_jobs_enter_while_the_queue_ahead_stays_within_the_depth():
    st: Stage[str] = Stage(depth_tokens=100)
    for rid, tokens in (("a", 60), ("b", 30), ("c", 20)):
        st.push(rid, tokens, 0, rid)
    assert st.enter(engine_queued_tokens=0) == ["a", "b"]  # 90 ahead; c would make 110
    assert (len(st), st.staged_tokens, st.entering_tokens) == (1, 20, 90)
    assert st.enter(0) == []  # a and b still entering (their lookups run): they count
    st.entered("a")
    st.entered("b")
    assert st.enter(engine_queued_tokens=90) == []  # now in the engine's queue instead
    assert st.enter(engine_queued_tokens=70) == ["c"]
    assert len(st) == 0 and st.staged_tokens == 0


def test_a_prompt_longer_than_the_depth_enters_alone_when_nothing_is_ahead():
    st: Stage[str] = Stage(depth_tokens=100)
    st.push("long", 500, 0, "long")
    st.push("short", 10, 0, "short")
    assert st.enter(engine_queued_tokens=5) == []
    assert st.enter(engine_queued_tokens=0) == ["long"]
    st.entered("long")
    assert st.enter(engine_queued_tokens=400) == []
    assert st.enter(engine_queued_tokens=90) == ["short"]


def test_order_is_priority_then_arrival():
    st: Stage[str] = Stage(depth_tokens=1000)
    for rid, prio in (("low-1", 1), ("high-1", 0), ("low-2", 1), ("high-2", 0)):
        st.push(rid, 10, prio, rid)
    assert st.enter(0) == ["high-1", "high-2", "low-1", "low-2"]


def test_a_dropped_job_never_enters_and_stops_counting():
    st: Stage[str] = Stage(depth_tokens=50)
    st.push("a", 40, 0, "a")
    st.push("b", 40, 0, "b")
    assert st.drop("a") and not st.drop("a") and not st.drop("nobody")
    assert (len(st), st.staged_tokens) == (1, 40)
    assert st.enter(0) == ["b"]
    assert not st.drop("b")  # entering: the core's abort covers it (its add is skipped)
    st.push("c", 10, 0, "c")
    st.clear()
    assert st.enter(0) == [] and len(st) == 0 and st.staged_tokens == 0


def test_pushing_an_id_again_replaces_the_first():
    st: Stage[str] = Stage(depth_tokens=1000)
    st.push("a", 10, 0, "first")
    st.push("a", 20, 0, "second")
    assert (len(st), st.staged_tokens) == (1, 20)
    assert st.enter(0) == ["second"]


def test_the_depth_must_be_positive():
    with pytest.raises(ValueError):
        Stage(0)
