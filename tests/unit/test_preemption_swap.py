"""Swap or recompute on preemption: the policy on scripted rates, and the scheduler's swaps step by step.

The engine's copies and the oracle are in tests/engine/test_oracle_tiny.py (modes "preempt", which swaps, and
"preempt-recompute"); a random workload checking every swapped block's contents is in test_scheduler.py.
"""

from __future__ import annotations

import pytest

from deepinfer.cache.block_pool import BlockPool
from deepinfer.engine.preemption import PROBE, RECOMPUTE, SWAP, SwapPolicy
from deepinfer.engine.request import FinishReason, RequestStatus
from deepinfer.engine.scheduler import Scheduler, SwapIn, SwapOut
from tests.unit.test_scheduler import cached, make, run_step

# -- the policy ---------------------------------------------------------------------------------


def test_a_victim_swaps_where_two_copies_cost_less_than_recomputing_its_tokens():
    policy = SwapPolicy(capacity_blocks=10, compute_s_per_token=0.001, copy_s_per_block=0.004)
    d = policy.choose(num_tokens=64, num_blocks=4)  # swap 2 x 4 x 4 ms = 32 ms < recompute 64 x 1 ms
    assert (d.choice, d.swap_s, d.recompute_s) == (SWAP, pytest.approx(0.032), pytest.approx(0.064))
    assert policy.used_blocks == 4
    policy.copy_s_per_block = 0.010  # now 80 ms > 64 ms
    assert policy.choose(num_tokens=64, num_blocks=4).choice == RECOMPUTE
    assert policy.used_blocks == 4 and policy.decisions == {SWAP: 1, RECOMPUTE: 1}


def test_a_victim_recomputes_when_the_space_is_full_or_it_holds_nothing():
    policy = SwapPolicy(capacity_blocks=5)  # rates unmeasured: swap whenever it fits
    assert policy.choose(16, 4).choice == SWAP
    assert policy.choose(8, 2).choice == RECOMPUTE  # 4 + 2 > 5
    assert policy.choose(4, 1).choice == SWAP  # exactly fills it
    assert policy.choose(0, 0).choice == RECOMPUTE  # nothing computed: nothing to copy
    policy.release(4)
    assert policy.used_blocks == 1 and policy.choose(8, 2).choice == SWAP
    with pytest.raises(ValueError, match="releasing 9"):
        policy.release(9)
    assert SwapPolicy(0).choose(16, 4).choice == RECOMPUTE


def test_every_16th_victim_judged_slower_to_swap_is_swapped_anyway_to_measure_the_copy_rate_again():
    """One slow copy (a descheduled thread) made swaps look 100x dearer than they are; only a swap can measure them
    again, so every probe_every-th victim that fits swaps regardless, and the rate recovers."""
    policy = SwapPolicy(capacity_blocks=100, compute_s_per_token=0.001, copy_s_per_block=0.1)
    fates = [policy.choose(num_tokens=64, num_blocks=4) for _ in range(32)]
    probes = [i for i, d in enumerate(fates) if d.choice == SWAP]
    assert probes == [15, 31] and all(fates[i].probe for i in probes)
    assert policy.decisions == {RECOMPUTE: 30, PROBE: 2} and policy.used_blocks == 8
    for _ in range(20):  # the probes' copies measure 1 ms per block: swapping pays again
        policy.record_copy(num_blocks=4, seconds=0.004)
    assert policy.choose(num_tokens=64, num_blocks=4).choice == SWAP
    full = SwapPolicy(capacity_blocks=3, compute_s_per_token=0.001, copy_s_per_block=0.1)
    assert all(full.choose(64, 4).choice == RECOMPUTE for _ in range(32))  # a probe never overfills the space


def test_rates_are_measured_from_steps_and_copies_not_configured():
    policy = SwapPolicy(capacity_blocks=4)
    policy.record_step(num_tokens=4, seconds=1.0)  # a decode step: says nothing about recompute
    assert policy.compute_s_per_token == 0.0
    policy.record_step(num_tokens=100, seconds=0.5)
    policy.record_step(num_tokens=100, seconds=1.5)
    assert policy.compute_s_per_token == pytest.approx(0.005 + 0.2 * (0.015 - 0.005))
    policy.record_copy(num_blocks=8, seconds=0.008)
    assert policy.copy_s_per_block == pytest.approx(0.001)
    policy.record_copy(num_blocks=0, seconds=1.0)
    assert policy.copy_s_per_block == pytest.approx(0.001)


# -- the scheduler --------------------------------------------------------------------------------


def swapping(num_blocks: int, swap_blocks: int = 8, budget: int = 64) -> Scheduler:
    return Scheduler(BlockPool(num_blocks), block_size=4, max_num_seqs=8, max_num_batched_tokens=budget,
                     swap=SwapPolicy(swap_blocks))


def test_a_swapped_victim_comes_back_with_its_kv_and_computes_only_its_next_token():
    s = swapping(4)
    a, b = make("a", 8, t=0), make("b", 7, t=1)
    s.add(a)
    s.add(b)
    assert run_step(s) == {"a": 8, "b": 7}
    out = s.schedule()  # a needs a 3rd block: b goes, its 7 computed tokens to host memory
    assert out.preempted == [b] and out.swap_out == [SwapOut(b, [2, 3])] and out.swap_in == []
    assert b.status == RequestStatus.PREEMPTED and b.swapped_tokens == 7 and b.block_ids == []
    assert s.swap.used_blocks == 2
    s.update(out)
    a.output_token_ids.append(7)
    s.finish(a, FinishReason.STOP)
    out = s.schedule()
    # b's blocks come back (into the two free at the head of the queue), and it computes only position 7.
    [chunk] = out.chunks
    assert (chunk.request, chunk.start, chunk.num_new_tokens) == (b, 7, 1)
    assert out.swap_in == [SwapIn(b, b.block_ids[:2], 0)] and len(b.block_ids) == 2
    assert b.swapped_tokens == 0 and s.swap.used_blocks == 0 and len(out.swap_in[0].block_ids) == 2


def test_the_cached_prefix_comes_from_the_pool_and_only_the_rest_from_the_copy():
    s = swapping(4)
    a, b = cached("a", list(range(1, 9)), t=0), cached("b", list(range(20, 27)), t=1)
    s.add(a)
    s.add(b)
    run_step(s)
    out = s.schedule()  # b goes: its full block 2 stays named in the pool, block 3 is reused by a
    assert out.swap_out == [SwapOut(b, [2, 3])] and b.swapped_tokens == 7
    s.update(out)
    a.output_token_ids.append(7)
    s.finish(a, FinishReason.STOP)
    out = s.schedule()
    assert b.block_ids[0] == 2 and out.prefix_hit_tokens == 4  # block 0 of its chain: a hit
    assert out.swap_in == [SwapIn(b, [b.block_ids[1]], 1)]  # block 1 of its copy comes back
    [chunk] = out.chunks
    assert (chunk.start, chunk.num_new_tokens) == (7, 1)
    s.update(out)
    s.pool.check_integrity()


def test_a_request_ending_while_swapped_out_gives_its_space_back_and_drops_its_copy():
    s = swapping(4)
    a, b = make("a", 8, t=0), make("b", 7, t=1)
    s.add(a)
    s.add(b)
    run_step(s)
    out = s.schedule()
    b.swapped_kv = object()  # the engine's copy
    s.update(out)
    s.finish(b, FinishReason.ABORT)
    assert (b.swapped_tokens, b.swapped_kv, s.swap.used_blocks) == (0, None, 0)
    s.finish(a, FinishReason.ABORT)
    assert s.pool.num_free == 4 and not s.has_unfinished()


def test_with_the_space_full_a_victim_recomputes():
    s = swapping(4, swap_blocks=1)
    a, b = make("a", 8, t=0), make("b", 7, t=1)
    s.add(a)
    s.add(b)
    run_step(s)
    out = s.schedule()
    assert out.preempted == [b] and out.swap_out == [] and b.swapped_tokens == 0
    assert [d.choice for d in out.preempt_decisions] == [RECOMPUTE]
