"""The scheduler and block pool, driven directly: exact block ids, counts and states after every step."""

from __future__ import annotations

import random

import pytest

from deepinfer.cache.block_pool import BlockPool, NoFreeBlocksError
from deepinfer.cache.hashing import CacheNamespace, ChainHasher, HashKeys, hash_blocks
from deepinfer.engine.preemption import SwapPolicy
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


def test_a_higher_class_arrival_preempts_lower_running_requests_to_be_admitted_at_once():
    s = Scheduler(BlockPool(4), block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    # 7-token prompts: two blocks each, and their first output token still fits in the second.
    lo1, lo2, same = make("lo1", 7, priority=5, t=0), make("lo2", 7, priority=5, t=1), make("same", 4, priority=5, t=2)
    for r in (lo1, lo2, same):
        s.add(r)
    assert run_step(s) == {"lo1": 7, "lo2": 7}  # same class: `same` waits its turn, preempting no one
    assert s.pool.num_free == 0 and s.waiting == [same]
    hi = make("hi", 4, priority=0, t=3)  # needs one block: the latest lower-class request gives up its two
    s.add(hi)
    out = s.schedule()
    assert out.preempted == [lo2] and lo2.status == RequestStatus.PREEMPTED and lo2.block_ids == []
    assert [(c.request.request_id, c.num_new_tokens) for c in out.chunks] == [("lo1", 1), ("hi", 4)]
    assert s.waiting == [lo2, same]  # by class, then arrival
    s.update(out)
    s.pool.check_integrity()


def test_a_higher_class_preempts_no_one_where_that_cannot_make_room():
    s = Scheduler(BlockPool(4), block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    mid, lo = make("mid", 7, priority=1, t=0), make("lo", 7, priority=5, t=1)
    s.add(mid)
    s.add(lo)
    run_step(s)
    hi = make("hi", 12, priority=0, t=2)  # three blocks: lo's two are not enough, but mid is of a lower class
    s.add(hi)
    out = s.schedule()
    assert out.preempted == [lo, mid]  # than hi too: both go, latest of the lowest class first, and hi fits
    assert [c.request.request_id for c in out.chunks] == ["hi"]
    s2 = Scheduler(BlockPool(4), block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    top, lo = make("top", 7, priority=0, t=0), make("lo", 7, priority=5, t=1)
    s2.add(top)
    s2.add(lo)
    run_step(s2)
    hi = make("hi", 12, priority=1, t=2)  # lo's two blocks cannot hold three: lo keeps running
    s2.add(hi)
    out = s2.schedule()
    assert out.preempted == [] and s2.waiting == [hi] and lo.status == RequestStatus.RUNNING
    assert [c.request.request_id for c in out.chunks] == ["top", "lo"]


def test_a_higher_class_takes_a_seat_from_a_lower_one():
    s = Scheduler(BlockPool(16), block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    a, b = make("a", 4, priority=3, t=0), make("b", 4, priority=3, t=1)
    s.add(a)
    s.add(b)
    run_step(s)
    hi = make("hi", 4, priority=0, t=2)
    s.add(hi)
    out = s.schedule()
    assert out.preempted == [b] and {c.request.request_id for c in out.chunks} == {"a", "hi"}
    assert len(s.running) == 2


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
            elif step < 500 and rng.random() < 0.02:
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


# -- prefix cache -----------------------------------------------------------------------------

NS = CacheNamespace("model", "tokenizer", "float32", "test-layout", block_size=4)


def cached(rid: str, tokens: list[int], t: float = 0.0, salt: str | None = None, priority: int = 0) -> Request:
    """A request that takes part in the prefix cache: it carries its hash chain."""
    return Request(rid, list(tokens), SamplingParams(max_tokens=100), arrival_time=t, priority=priority,
                   hasher=ChainHasher(NS, HashKeys(salt)))


def chain(tokens: list[int], salt: str | None = None) -> list[bytes]:
    return hash_blocks(NS, tokens, HashKeys(salt))


def caching_scheduler(num_blocks: int, budget: int = 64, **kw) -> Scheduler:
    return Scheduler(BlockPool(num_blocks), block_size=4, max_num_seqs=8, max_num_batched_tokens=budget, **kw)


def test_full_blocks_are_named_as_their_kv_is_computed_prompt_and_output():
    s = caching_scheduler(8, budget=6)
    a = cached("a", list(range(1, 11)))  # 10 tokens
    s.add(a)
    assert run_step(s) == {"a": 6}  # chunk 1: block 0 full, block 1 half
    assert a.block_ids == [0, 1] and s.pool.cached_hashes() == chain(a.prompt_token_ids)[:1]
    assert run_step(s) == {"a": 4}  # the prompt: block 1 full, block 2 half, one token sampled
    assert s.pool.cached_hashes() == chain(a.prompt_token_ids)
    run_step(s)  # position 10 (the first output token)
    assert s.pool.num_cached == 2
    run_step(s)  # position 11: block 2 holds prompt tokens 8, 9 and two outputs, all computed
    assert a.output_token_ids == [7, 7, 7] and s.pool.cached_hashes() == chain(a.all_token_ids)[:3]
    assert s.pool.block_of(chain(a.all_token_ids)[2]) == 2
    s.finish(a, FinishReason.STOP)
    assert s.pool.num_free == 8 and s.pool.num_cached == 3  # freed, still cached
    s.pool.check_integrity()


def test_second_request_with_the_same_prefix_reuses_the_first_ones_blocks():
    s = caching_scheduler(8)
    a = cached("a", list(range(1, 11)), t=0)
    s.add(a)
    run_step(s)
    assert a.block_ids == [0, 1, 2]
    # While a runs: its two full blocks are shared, b computes only its own tail.
    b = cached("b", list(range(1, 9)) + [50, 51, 52], t=1)
    s.add(b)
    out = s.schedule()
    assert [(c.request.request_id, c.num_new_tokens, c.start) for c in out.chunks] == [("a", 1, 10), ("b", 3, 8)]
    assert b.block_ids == [0, 1, 3] and b.num_computed_tokens == 8
    assert [s.pool.ref_cnt(x) for x in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert (b.num_cached_tokens, b.cached_by_tier) == (8, {"device": 8})
    assert (out.prefix_lookups, out.prefix_query_tokens, out.prefix_hit_tokens) == (1, 11, 8)
    s.update(out)
    # After a finishes its shared blocks stay with b; a third request finds them all the same.
    s.finish(a, FinishReason.STOP)
    assert [s.pool.ref_cnt(x) for x in (0, 1, 2)] == [1, 1, 0]
    c = cached("c", list(range(1, 13)), t=2)
    s.add(c)
    out = s.schedule()
    assert c.block_ids == [0, 1, 4] and c.num_computed_tokens == 8  # block 2 held tokens 9-10 only: not full
    assert [ch.num_new_tokens for ch in out.chunks if ch.request is c] == [4]
    s.pool.check_integrity()


def test_a_prefix_being_computed_is_waited_for_not_computed_twice():
    """b has a's prompt head; admitted beside a it would compute a's blocks again. It is passed over (c, with
    another prefix, is admitted past it) until a has named them; then it takes them as a hit."""
    s = caching_scheduler(16, budget=16)
    head = list(range(1, 13))  # three full blocks
    a, b, c = cached("a", head + [60], t=0), cached("b", head + [70, 71], t=1), cached("c", [90] * 6, t=2)
    for r in (a, b, c):
        s.add(r)
    out = s.schedule()  # a's whole prompt; b's first block is a's: it waits; c (another prefix) goes past it
    assert [(ch.request.request_id, ch.num_new_tokens) for ch in out.chunks] == [("a", 13), ("c", 3)]
    assert out.prefix_waits == 1 and b.status == RequestStatus.WAITING
    s.update(out)
    a.output_token_ids.append(7)
    out = s.schedule()  # every block of the head is named now: b computes only its own two tokens
    assert [(ch.request.request_id, ch.num_new_tokens) for ch in out.chunks] == [("a", 1), ("c", 3), ("b", 2)]
    assert b.num_cached_tokens == 12 and b.block_ids[:3] == a.block_ids[:3] and out.prefix_waits == 0
    s.update(out)
    s.pool.check_integrity()


def test_a_chunked_prefill_is_waited_for_block_by_block():
    s = caching_scheduler(16, budget=8)
    head = list(range(1, 13))
    a, b = cached("a", head + [60], t=0), cached("b", head + [70], t=1)
    s.add(a)
    s.add(b)
    assert run_step(s) == {"a": 8}  # (no budget left to consider b)
    out = s.schedule()  # a's rest; b would hit two blocks and compute the third, which a is computing
    assert [(ch.request.request_id, ch.num_new_tokens) for ch in out.chunks] == [("a", 5)] and out.prefix_waits == 1
    s.update(out)
    a.output_token_ids.append(7)
    assert run_step(s) == {"a": 1, "b": 1} and b.num_cached_tokens == 12
    s.pool.check_integrity()


def test_without_prefix_caching_nothing_waits():
    s = caching_scheduler(16, budget=8, enable_prefix_caching=False)
    head = list(range(1, 13))
    a, b = cached("a", head + [60], t=0), cached("b", head + [70], t=1)
    s.add(a)
    s.add(b)
    s.max_num_batched_tokens = 32
    out = s.schedule()
    assert [ch.request.request_id for ch in out.chunks] == ["a", "b"] and out.prefix_waits == 0


def test_a_hit_never_covers_the_last_token():
    s = caching_scheduler(8)
    a = cached("a", list(range(1, 9)))  # exactly two blocks
    s.add(a)
    run_step(s)
    s.finish(a, FinishReason.STOP)  # free queue: 2..7, then 1, 0 (both named)
    b = cached("b", list(range(1, 9)))  # the same prompt: its last token's logits must be computed
    s.add(b)
    assert run_step(s) == {"b": 4}
    assert b.block_ids == [0, 2] and b.num_cached_tokens == 4
    # Block 2 now holds the same KV as block 1; the hash keeps its first block, 2 stays plain.
    h1 = chain(a.prompt_token_ids)[1]
    assert s.pool.block_of(h1) == 1 and s.pool.name_of(2) is None
    s.finish(b, FinishReason.STOP)
    c = cached("c", list(range(1, 4)))  # shorter than a block: nothing to look up
    s.add(c)
    assert run_step(s) == {"c": 3} and c.num_cached_tokens == 0
    s.pool.check_integrity()


def test_a_hit_then_a_chunked_rest_under_the_budget():
    s = caching_scheduler(16, budget=4)
    a = cached("a", list(range(1, 15)), t=0)  # 14 tokens: 4 chunks of at most 4
    s.add(a)
    for _ in range(4):
        run_step(s)
    assert a.num_computed_tokens == 14 and a.block_ids == [0, 1, 2, 3]
    s.finish(a, FinishReason.STOP)
    b = cached("b", list(range(1, 13)) + [60, 61, 62, 63, 64, 65], t=1)  # 12 shared tokens, then 6 more
    s.add(b)
    assert run_step(s) == {"b": 4}  # tokens 12-15 in a fresh block; the budget counts computed tokens only
    assert b.block_ids == [0, 1, 2, 4] and b.num_computed_tokens == 16 and b.output_token_ids == []
    assert run_step(s) == {"b": 2}
    assert b.block_ids == [0, 1, 2, 4, 5] and b.output_token_ids == [7] and b.num_cached_tokens == 12
    s.pool.check_integrity()


def test_a_preempted_request_refinds_its_own_blocks():
    s = caching_scheduler(4)
    a, b = cached("a", list(range(1, 9)), t=0), cached("b", list(range(20, 27)), t=1)
    s.add(a)
    s.add(b)
    assert run_step(s) == {"a": 8, "b": 7}
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3])
    out = s.schedule()  # a needs a third block: b goes; its full block 2 stays cached, 3 is reused
    assert out.preempted == [b] and a.block_ids == [0, 1, 3]
    s.update(out)
    a.output_token_ids.append(7)
    s.finish(a, FinishReason.STOP)
    out = s.schedule()
    # b's 8 tokens (7 prompt + 1 output): block 0 of its chain is still block 2; it recomputes the rest.
    assert [(c.request.request_id, c.start, c.num_new_tokens) for c in out.chunks] == [("b", 4, 4)]
    assert b.block_ids == [2, 3] and b.num_computed_tokens == 4
    assert (out.prefix_lookups, out.prefix_hit_tokens) == (1, 4)
    assert (b.num_cached_tokens, b.cached_by_tier) == (0, {})  # only a first admission's hit is the prompt's
    s.update(out)
    s.pool.check_integrity()


def test_failed_admission_leaves_the_hit_blocks_where_they_were():
    s = caching_scheduler(4)
    a = cached("a", list(range(1, 9)), t=0)
    s.add(a)
    run_step(s)
    s.finish(a, FinishReason.STOP)  # free queue: 2, 3, 1, 0 (1 and 0 named)
    c = cached("c", list(range(30, 37)), t=1)  # 7 tokens: 2 blocks, and its first output still fits
    s.add(c)
    run_step(s)
    assert c.block_ids == [2, 3]
    b = cached("b", list(range(1, 9)) + list(range(40, 48)), t=2)  # hits 0, 1; needs 2 more blocks, 0 left
    s.add(b)
    assert run_step(s) == {"c": 1}
    assert s.waiting == [b] and b.block_ids == [] and b.num_computed_tokens == 0 and b.num_cached_tokens == 0
    assert (s.pool.ref_cnt(0), s.pool.ref_cnt(1), s.pool.num_free) == (0, 0, 2)
    assert s.pool.lookup(chain(a.prompt_token_ids)) == [0, 1]
    s.finish(c, FinishReason.STOP)  # free queue: 1, 0, 3, 2
    assert run_step(s) == {"b": 8}
    assert b.block_ids == [0, 1, 3, 2] and b.num_cached_tokens == 8
    s.pool.check_integrity()


def test_hits_count_under_the_tier_the_block_was_imported_from_once():
    s = caching_scheduler(8)
    tokens = list(range(1, 10))
    [blk] = s.pool.allocate(1)  # what an import does: copy KV in, name it, mark its origin, free it
    s.pool.register(blk, chain(tokens)[0])
    s.pool.set_origin(blk, "host")
    s.pool.free([blk])
    a = cached("a", tokens, t=0)
    s.add(a)
    run_step(s)
    assert a.block_ids[0] == blk and (a.num_cached_tokens, a.cached_by_tier) == (4, {"host": 4})
    assert s.pool.origin(blk) is None  # device-resident from now on
    b = cached("b", tokens, t=1)
    s.add(b)
    run_step(s)
    assert (b.num_cached_tokens, b.cached_by_tier) == (8, {"device": 8})


def test_no_hits_across_salts_or_with_caching_disabled():
    s = caching_scheduler(8)
    a = cached("a", list(range(1, 10)), salt="tenant-1")
    s.add(a)
    run_step(s)
    b = cached("b", list(range(1, 10)), t=1, salt="tenant-2")
    s.add(b)
    run_step(s)
    assert b.num_cached_tokens == 0 and set(a.block_ids).isdisjoint(b.block_ids)
    c = cached("c", list(range(1, 10)), t=2, salt="tenant-1")
    s.add(c)
    run_step(s)
    assert c.num_cached_tokens == 8 and c.block_ids[:2] == a.block_ids[:2]

    off = caching_scheduler(8, enable_prefix_caching=False)
    x, y = cached("x", list(range(1, 10)), t=0), cached("y", list(range(1, 10)), t=1)
    off.add(x)
    run_step(off)
    off.add(y)
    out = off.schedule()
    assert y.num_cached_tokens == 0 and y.block_ids == [3, 4, 5] and out.prefix_lookups == 0
    assert off.pool.num_cached == 0


def test_handed_off_request_names_its_prompt_blocks():
    s = caching_scheduler(8)
    h = cached("h", list(range(1, 11)))
    h.output_token_ids = [9]
    h.num_computed_tokens = 10
    h.block_ids = s.pool.allocate(3)
    s.add_running(h)
    assert s.pool.cached_hashes() == chain(h.prompt_token_ids)  # two full prompt blocks
    s.finish(h, FinishReason.ABORT)
    assert s.pool.lookup(chain(list(range(1, 13)))) == [0, 1]


@pytest.mark.parametrize("swap_blocks", [0, 6], ids=["recompute", "swap"])
def test_random_workload_with_shared_prefixes_computes_the_right_kv(swap_blocks: int):
    """A fake model writes each position's token into its KV slot; every chunk checks that the KV it
    attends to (positions before it, hit, swapped back or computed) is exactly its own prefix, and that it
    only writes into blocks nobody else holds and nobody can find by hash. With a swap space of 6 blocks
    (rates unmeasured: a victim swaps whenever its blocks fit), swaps copy the fake KV out and back."""
    rng = random.Random(2)
    bs = 4
    pool = BlockPool(14)
    policy = SwapPolicy(swap_blocks) if swap_blocks else None
    s = Scheduler(pool, block_size=bs, max_num_seqs=4, max_num_batched_tokens=10, swap=policy)
    kv: dict[int, list[int | None]] = {b: [None] * bs for b in range(14)}
    stems = [[rng.randrange(1, 50) for _ in range(12)] for _ in range(3)]
    live: list[Request] = []
    block_of_hash: dict[bytes, list[int]] = {}  # every chain hash seen -> the block's tokens
    hit_tokens = preemptions = waits = swapped_in = 0
    for step in range(1000):  # arrivals and aborts for 500 steps, then every live request runs to its end
        if step >= 500 and not live:
            break
        for k in range(rng.choice([0, 0, 0, 1, 1, 2]) if step < 500 else 0):  # sometimes two at once
            tokens = rng.choice(stems)[: rng.randint(1, 12)] + [rng.randrange(1, 50) for _ in range(rng.randint(0, 6))]
            r = cached(f"r{step}.{k}", tokens, t=step, salt=rng.choice([None, None, "x"]),
                       priority=rng.choice([0, 0, 1]))  # two classes: arrivals of the higher one preempt
            s.add(r)
            live.append(r)
        out = s.schedule()
        hit_tokens += out.prefix_hit_tokens
        waits += out.prefix_waits
        for gone in out.swap_out:  # every copy out before any copy back, as the engine does
            gone.request.swapped_kv = [list(kv[b]) for b in gone.block_ids]
        for back in out.swap_in:
            for b, data in zip(back.block_ids, back.request.swapped_kv[back.first_block:], strict=False):
                assert pool.ref_cnt(b) == 1 and pool.name_of(b) is None, (back.request.request_id, b)
                kv[b] = list(data)
            back.request.swapped_kv = None
            swapped_in += len(back.block_ids)
        for c in out.chunks:
            req, toks = c.request, c.request.all_token_ids
            for p in range(c.start):
                assert kv[req.block_ids[p // bs]][p % bs] == toks[p], (req.request_id, p)
            for p in range(c.start, c.start + c.num_new_tokens):
                b = req.block_ids[p // bs]
                assert pool.ref_cnt(b) == 1 and pool.name_of(b) is None, (req.request_id, p, b)
                kv[b][p % bs] = toks[p]
        s.update(out)
        preemptions += len(out.preempted)
        for c in out.chunks:
            r = c.request
            for i, name in enumerate(r.hasher.hashes):
                block_of_hash[name] = r.all_token_ids[i * bs:(i + 1) * bs]
            if r.num_computed_tokens == r.num_tokens:
                r.output_token_ids.append(rng.randrange(1, 50))
        for r in list(live):
            if r.status == RequestStatus.RUNNING and len(r.output_token_ids) > rng.randint(2, 8):
                s.finish(r, FinishReason.LENGTH)
            elif rng.random() < 0.02:
                s.finish(r, FinishReason.ABORT)
            if r.is_finished:
                live.remove(r)
        holders = [b for r in s.requests.values() for b in r.block_ids]
        assert all(pool.ref_cnt(b) == holders.count(b) for b in range(14))
        assert len(set(holders)) + pool.num_free == pool.num_blocks
        for b in range(14):  # a named block holds exactly the tokens its name stands for
            name = pool.name_of(b)
            if name is not None:
                assert kv[b] == block_of_hash[name], b
        pool.check_integrity()
    assert hit_tokens > 0 and preemptions > 0 and waits > 0
    assert not live  # no request waited forever (for a prefix, for blocks) once arrivals stopped
    assert pool.num_free == 14
    if policy is not None:  # both fates happened, and every swap's space came back (copied in, or dropped)
        assert policy.decisions["swap"] > 0 and policy.decisions["recompute"] > 0 and swapped_in > 0
        assert policy.used_blocks == 0
    pool.check_integrity()


def test_a_request_collecting_prompt_logprobs_is_chunked_short() -> None:
    # Its chunks carry logits at every position, so their length is bounded whatever the token budget.
    from deepinfer.engine.scheduler import PROMPT_LOGPROBS_CHUNK

    s = Scheduler(BlockPool(256), block_size=16, max_num_seqs=8, max_num_batched_tokens=4096)
    n = 2 * PROMPT_LOGPROBS_CHUNK + 100
    plain = make("plain", n)
    scored = Request("scored", list(range(1, n + 1)), SamplingParams(max_tokens=4, prompt_logprobs=0))
    assert scored.wants_prompt_logprobs
    s.add(plain)
    s.add(scored)
    first = run_step(s)
    assert first == {"plain": n, "scored": PROMPT_LOGPROBS_CHUNK}
    assert run_step(s)["scored"] == PROMPT_LOGPROBS_CHUNK
    assert run_step(s)["scored"] == 100
