"""The scheduler and block pool, driven directly: exact block ids, counts and states after every step."""

from __future__ import annotations

import random

import pytest

from deepinfer.cache.block_pool import BlockPool, NoFreeBlocksError
from deepinfer.engine.request import FinishReason, Request, RequestStatus, SamplingParams
from deepinfer.engine.scheduler import Scheduler


def make(rid: str, n_prompt: int, priority: int = 0, t: float = 0.0) -> Request:
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=100), priority=priority,
                   arrival_time=t)


def run_step(s: Scheduler, token: int = 7) -> dict[str, int]:
    """One step with a fake model: every chunk computed, every sampling request gains `token`."""
    out = s.schedule()
    s.update(out)
    for c in out.chunks:
        if c.request.num_computed_tokens == c.request.num_tokens:
            c.request.output_token_ids.append(token)
    s.pool.check_integrity()
    return {c.request.request_id: c.num_new_tokens for c in out.chunks}


# -- block pool -------------------------------------------------------------------------------


def test_pool_allocates_in_lru_order_and_counts():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert (pool.num_free, pool.num_used) == (2, 2)
    pool.free([1, 0])
    # Freed blocks go to the tail: 2, 3 are older free blocks and are reused first.
    assert pool.allocate(4) == [2, 3, 1, 0]
    assert pool.num_free == 0
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.check_integrity()


def test_pool_refcounts_and_double_free():
    pool = BlockPool(3)
    [b] = pool.allocate(1)
    pool.incref([b])
    assert pool.ref_cnt(b) == 2
    pool.free([b])
    assert pool.ref_cnt(b) == 1 and pool.num_free == 2
    pool.free([b])
    assert pool.num_free == 3
    with pytest.raises(ValueError, match="double free"):
        pool.free([b])
    with pytest.raises(ValueError, match="free"):
        pool.incref([b])
    pool.check_integrity()


def test_pool_integrity_check_catches_a_leak():
    pool = BlockPool(2)
    pool.allocate(1)
    pool._ref_cnt[0] = 0  # simulate a bug: dropped the reference without freeing
    with pytest.raises(AssertionError, match="leaked"):
        pool.check_integrity()


# -- scheduler --------------------------------------------------------------------------------


def test_prefill_then_decode_exact_blocks():
    s = Scheduler(BlockPool(8), block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    a = make("a", 6)
    s.add(a)
    assert run_step(s) == {"a": 6}
    assert a.block_ids == [0, 1] and a.num_computed_tokens == 6 and a.output_token_ids == [7]
    assert a.status == RequestStatus.RUNNING
    assert run_step(s) == {"a": 1}  # token 7 at position 6: still block 1
    assert a.block_ids == [0, 1] and a.num_computed_tokens == 7
    assert run_step(s) == {"a": 1}  # position 7 fills block 1
    assert run_step(s) == {"a": 1}  # position 8 needs a third block
    assert a.block_ids == [0, 1, 2] and s.pool.num_free == 5
    s.finish(a, FinishReason.STOP)
    assert s.pool.num_free == 8 and a.block_ids == [] and a.status == RequestStatus.FINISHED
    assert not s.has_unfinished()
    s.pool.check_integrity()


def test_chunked_prefill_under_budget_with_decode_in_same_step():
    s = Scheduler(BlockPool(16), block_size=4, max_num_seqs=8, max_num_batched_tokens=5)
    a, b = make("a", 3, t=0), make("b", 9, t=1)
    s.add(a)
    s.add(b)
    assert run_step(s) == {"a": 3, "b": 2}
    assert (a.block_ids, b.block_ids) == ([0], [1])
    assert b.output_token_ids == []  # mid-prefill: nothing sampled
    # a decodes (1 token) while b's prefill continues with the rest of the budget.
    assert run_step(s) == {"a": 1, "b": 4}
    assert b.block_ids == [1, 2] and b.num_computed_tokens == 6
    assert run_step(s) == {"a": 1, "b": 3}
    assert b.num_computed_tokens == 9 and b.output_token_ids == [7]
    assert a.block_ids == [0, 3] and b.block_ids == [1, 2, 4]  # running requests reserve in order
    assert run_step(s) == {"a": 1, "b": 1}


def test_waiting_request_not_admitted_without_blocks_and_fcfs_holds():
    s = Scheduler(BlockPool(3), block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    a, b, c = make("a", 8, t=0), make("b", 8, t=1), make("c", 2, t=2)
    for r in (a, b, c):
        s.add(r)
    assert run_step(s) == {"a": 8}  # b needs 2 blocks, only 1 free; c must wait behind b (FCFS)
    assert s.waiting == [b, c]
    s.finish(a, FinishReason.STOP)
    # Free queue is now [2, 1, 0]: a's blocks came back tail first.
    assert run_step(s) == {"b": 8, "c": 2}
    assert (b.block_ids, c.block_ids) == ([2, 1], [0]) and s.pool.num_free == 0


def test_priority_orders_admission():
    s = Scheduler(BlockPool(16), block_size=4, max_num_seqs=1, max_num_batched_tokens=64)
    low, high = make("low", 4, priority=5, t=0), make("high", 4, priority=-1, t=1)
    s.add(low)
    s.add(high)
    assert run_step(s) == {"high": 4}


def test_preemption_by_recompute_frees_tail_and_requeues():
    s = Scheduler(BlockPool(4), block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = make("a", 8, t=0), make("b", 7, t=1)
    s.add(a)
    s.add(b)
    assert run_step(s) == {"a": 8, "b": 7}
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3]) and s.pool.num_free == 0
    # b's 8th token (position 7) still fits in block 3; a needs a 3rd block for position 8: b is preempted.
    out = s.schedule()
    assert [r.request_id for r in out.preempted] == ["b"]
    assert [(c.request.request_id, c.num_new_tokens) for c in out.chunks] == [("a", 1)]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.block_ids == []
    assert b.num_preemptions == 1 and s.waiting == [b]
    assert a.block_ids == [0, 1, 3]  # b's blocks were freed tail first, so block 3 comes back first
    s.update(out)
    a.output_token_ids.append(7)
    s.pool.check_integrity()
    # b recomputes prompt + its one generated token once a finishes.
    s.finish(a, FinishReason.STOP)
    assert run_step(s) == {"b": 8}
    assert b.output_token_ids == [7, 7] and b.num_computed_tokens == 8


def test_preempts_lowest_priority_first():
    s = Scheduler(BlockPool(6), block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    hi, lo, mid = make("hi", 8, priority=0, t=2), make("lo", 4, priority=9, t=0), make("mid", 4, priority=1, t=1)
    for r in (lo, mid, hi):
        s.add(r)
    assert run_step(s) == {"hi": 8, "mid": 4, "lo": 4}  # served in priority order, not arrival
    assert (hi.block_ids, mid.block_ids, lo.block_ids) == ([0, 1], [2], [3]) and s.pool.num_free == 2
    # hi (position 8) and mid (position 4) each need a new block; lo, the oldest but least important, goes.
    s.pool.allocate(1)  # leave a single free block
    out = s.schedule()
    assert [r.request_id for r in out.preempted] == ["lo"]
    assert [(c.request.request_id, c.num_new_tokens) for c in out.chunks] == [("hi", 1), ("mid", 1)]
    assert (hi.block_ids, mid.block_ids) == ([0, 1, 5], [2, 3])
    assert s.waiting == [lo] and s.pool.num_free == 0


def test_request_preempts_itself_when_it_is_the_lowest():
    s = Scheduler(BlockPool(2), block_size=2, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = make("a", 2, t=0), make("b", 2, t=1)
    s.add(a)
    s.add(b)
    run_step(s)
    out = s.schedule()  # both need a second block and none is free: b (the later) goes, then a fits
    assert [r.request_id for r in out.preempted] == ["b"]
    assert [c.request.request_id for c in out.chunks] == ["a"]


def test_abort_anywhere_frees_everything():
    s = Scheduler(BlockPool(8), block_size=4, max_num_seqs=8, max_num_batched_tokens=6)
    a, b, c = make("a", 10, t=0), make("b", 4, t=1), make("c", 4, t=2)
    for r in (a, b, c):
        s.add(r)
    run_step(s)  # a mid-prefill, b/c waiting
    s.finish(c, FinishReason.ABORT)  # waiting
    s.finish(a, FinishReason.ABORT)  # mid-prefill
    s.finish(a, FinishReason.ABORT)  # twice: no-op
    run_step(s)
    s.finish(b, FinishReason.ABORT)  # running
    assert s.pool.num_free == 8 and not s.has_unfinished()
    assert a.finish_reason == FinishReason.ABORT
    s.pool.check_integrity()


def test_random_workload_keeps_invariants():
    rng = random.Random(0)
    pool = BlockPool(12)
    s = Scheduler(pool, block_size=4, max_num_seqs=5, max_num_batched_tokens=16)
    live: list[Request] = []
    for step in range(400):
        if rng.random() < 0.3:
            r = make(f"r{step}", rng.randint(1, 20), priority=rng.randint(0, 2), t=step)
            s.add(r)
            live.append(r)
        run_step(s)
        for r in list(live):
            if r.status == RequestStatus.RUNNING and (len(r.output_token_ids) > rng.randint(3, 12)):
                s.finish(r, FinishReason.LENGTH)
            elif rng.random() < 0.02:
                s.finish(r, FinishReason.ABORT)
            if r.is_finished:
                live.remove(r)
        held = sum(len(r.block_ids) for r in s.requests.values())
        assert held + pool.num_free == pool.num_blocks
        for r in s.running:
            assert len(r.block_ids) * 4 >= r.num_computed_tokens
    for r in live:
        s.finish(r, FinishReason.ABORT)
    assert pool.num_free == 12
    pool.check_integrity()


# -- prefill/decode handoff: hold and add_running ---------------------------------------------


def handed_off(rid: str, n_prompt: int, block_ids: list[int], first: int = 9, t: float = 0.0) -> Request:
    """A request whose prompt KV arrived from a prefill engine, with its first token sampled there."""
    r = make(rid, n_prompt, t=t)
    r.output_token_ids = [first]
    r.num_computed_tokens = n_prompt
    r.block_ids = block_ids
    return r


def test_hold_keeps_blocks_out_of_the_queues_until_release():
    s = Scheduler(BlockPool(8), block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    a = make("a", 6)
    s.add(a)
    assert run_step(s) == {"a": 6}
    s.hold(a)
    assert a.status == RequestStatus.HELD and a.block_ids == [0, 1]
    assert s.running == [] and s.requests == {} and s.held == {"a": a}
    assert not s.has_unfinished() and s.pool.num_free == 6
    assert s.schedule().is_empty  # never scheduled, so never preempted: its KV stays put
    with pytest.raises(ValueError, match="duplicate"):
        s.add(make("a", 2))  # the id stays in use while held
    with pytest.raises(ValueError, match="only a running request"):
        s.hold(a)
    assert s.release("a") is a
    assert a.status == RequestStatus.FINISHED and a.finish_reason is None and a.block_ids == []
    assert s.pool.num_free == 8 and s.held == {}
    assert s.release("a") is None
    s.pool.check_integrity()


def test_finish_frees_a_held_request():
    s = Scheduler(BlockPool(4), block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    a = make("a", 5)
    s.add(a)
    run_step(s)
    s.hold(a)
    s.finish(a, FinishReason.ABORT)
    assert s.pool.num_free == 4 and s.held == {} and a.finish_reason == FinishReason.ABORT
    s.pool.check_integrity()


def test_add_running_decodes_in_its_given_blocks():
    s = Scheduler(BlockPool(8), block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    a = make("a", 3, t=0)
    s.add(a)
    assert run_step(s) == {"a": 3}
    reserved = s.pool.allocate(3)  # what a reservation would hold
    assert reserved == [1, 2, 3]
    # 6 prompt tokens need 2 blocks; the third reserved block stays with the request for its outputs.
    h = handed_off("h", 6, reserved, t=1)
    s.add_running(h)
    assert h.status == RequestStatus.RUNNING and s.running == [a, h] and s.requests["h"] is h
    assert run_step(s) == {"a": 1, "h": 1}  # h computes its first token's KV at position 6, block 2
    assert h.num_computed_tokens == 7 and h.output_token_ids == [9, 7] and h.block_ids == [1, 2, 3]
    run_step(s)  # h position 7; a position 4 takes block 4
    run_step(s)  # h position 8: the spare block 3, no allocation
    assert h.block_ids == [1, 2, 3] and a.block_ids == [0, 4] and s.pool.num_free == 3
    run_step(s)
    run_step(s)
    run_step(s)  # h position 11 fills block 3; a position 8 takes block 5
    assert a.block_ids == [0, 4, 5] and h.block_ids == [1, 2, 3]
    assert run_step(s) == {"a": 1, "h": 1}  # position 12: h needs a fourth block
    assert h.block_ids == [1, 2, 3, 6] and s.pool.num_free == 1
    s.finish(h, FinishReason.STOP)
    assert s.pool.num_free == 5
    s.pool.check_integrity()


def test_add_running_bypasses_max_num_seqs():
    s = Scheduler(BlockPool(8), block_size=4, max_num_seqs=1, max_num_batched_tokens=64)
    a, c = make("a", 2, t=0), make("c", 2, t=2)
    s.add(a)
    s.add(c)
    assert run_step(s) == {"a": 2}
    s.add_running(handed_off("h", 4, s.pool.allocate(1), t=1))  # admission was the reservation
    assert len(s.running) == 2
    assert run_step(s) == {"a": 1, "h": 1}  # h's first token's KV needs a second block: [2]
    assert s.requests["h"].block_ids == [1, 2]
    s.finish(a, FinishReason.STOP)
    assert run_step(s) == {"h": 1}  # still at max_num_seqs: c waits
    s.finish(s.requests["h"], FinishReason.STOP)
    assert run_step(s) == {"c": 2}


def test_add_running_refuses_inconsistent_requests():
    s = Scheduler(BlockPool(8), block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    s.add(make("w", 2))
    with pytest.raises(ValueError, match="duplicate"):
        s.add_running(handed_off("w", 4, [0]))
    nothing_computed = handed_off("x", 4, [0])
    nothing_computed.num_computed_tokens = 0
    with pytest.raises(ValueError, match="computed"):
        s.add_running(nothing_computed)
    nothing_left = make("y", 4)
    nothing_left.num_computed_tokens = 4
    nothing_left.block_ids = [0]
    with pytest.raises(ValueError, match="still to compute"):
        s.add_running(nothing_left)
    with pytest.raises(ValueError, match="1 blocks for 5 computed"):
        s.add_running(handed_off("z", 5, [0]))
    assert s.running == [] and list(s.requests) == ["w"]


def test_handed_off_request_is_preempted_and_recomputes_prompt_and_outputs():
    s = Scheduler(BlockPool(4), block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    a = make("a", 8, t=0)
    s.add(a)
    assert run_step(s) == {"a": 8} and a.block_ids == [0, 1]
    h = handed_off("h", 8, s.pool.allocate(2), first=5, t=1)
    s.add_running(h)
    assert h.block_ids == [2, 3] and s.pool.num_free == 0
    out = s.schedule()  # a (position 8) and h (position 8) each need a third block: h, the later, goes
    assert [r.request_id for r in out.preempted] == ["h"] and a.block_ids == [0, 1, 3]
    assert h.status == RequestStatus.PREEMPTED and h.num_computed_tokens == 0 and h.block_ids == []
    s.update(out)
    a.output_token_ids.append(7)
    s.finish(a, FinishReason.STOP)
    # Recompute: the prompt plus the first token (which came from the prefill engine) in one chunk.
    assert run_step(s) == {"h": 9}
    assert h.output_token_ids == [5, 7] and h.block_ids == [2, 3, 1]


def test_random_workload_with_handoffs_keeps_invariants():
    rng = random.Random(1)
    pool = BlockPool(16)
    s = Scheduler(pool, block_size=4, max_num_seqs=4, max_num_batched_tokens=12)
    live: list[Request] = []
    for step in range(400):
        roll = rng.random()
        if roll < 0.2:
            r = make(f"r{step}", rng.randint(1, 20), t=step)
            r.prefill_only = rng.random() < 0.5
            s.add(r)
            live.append(r)
        elif roll < 0.3:
            n = rng.randint(1, 20)
            need = -(-n // 4) + rng.randint(0, 2)
            if need <= pool.num_free:
                h = handed_off(f"h{step}", n, pool.allocate(need), t=step)
                s.add_running(h)
                live.append(h)
        run_step(s)
        for r in list(live):
            if r.status == RequestStatus.RUNNING and r.prefill_only and r.output_token_ids:
                s.hold(r)
            elif r.status == RequestStatus.HELD and rng.random() < 0.3:
                assert s.release(r.request_id) is r
            elif r.status == RequestStatus.RUNNING and len(r.output_token_ids) > rng.randint(3, 12):
                s.finish(r, FinishReason.LENGTH)
            elif rng.random() < 0.02:
                s.finish(r, FinishReason.ABORT)
            if r.is_finished:
                live.remove(r)
        held = sum(len(r.block_ids) for r in [*s.requests.values(), *s.held.values()])
        assert held + pool.num_free == pool.num_blocks
        for r in s.held.values():
            assert len(r.block_ids) == -(-len(r.prompt_token_ids) // 4) and r.num_computed_tokens == r.num_tokens - 1
    for r in live:
        s.finish(r, FinishReason.ABORT)
    assert pool.num_free == 16
    pool.check_integrity()
