"""The expert-parallel bookkeeping kernel (`ep_route.c`) against its torch path: the same indices in the
same order, the same bytes on the wire; and out-of-range input refused with a clear error."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.ep.placement import ExpertPlacement
from deepinfer.engine.models.moe import Routing
from deepinfer.kernels import ep_route as er

EXPERTS, HIDDEN = 16, 24


def _tables(placement: ExpertPlacement, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    ranks = placement.replica_ranks(0)
    table = torch.tensor([r + [-1] * (placement.num_ranks - len(r)) for r in ranks])
    slots = placement.layers[0][rank * placement.slots_per_rank:(rank + 1) * placement.slots_per_rank]
    slot_of = torch.full((EXPERTS,), -1, dtype=torch.int64)
    for s, e in enumerate(slots):
        if e >= 0:
            slot_of[e] = s
    return table, torch.tensor([len(r) for r in ranks]), slot_of, placement.slots_per_rank


def _routing(seed: int, tokens: int, top_k: int) -> tuple[torch.Tensor, Routing]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    weights, experts = torch.randn(tokens, EXPERTS, generator=gen).softmax(-1).topk(top_k, dim=-1)
    # Shuffled assignment order: nothing may assume a token's assignments are adjacent.
    perm = torch.randperm(tokens * top_k, generator=gen)
    token = torch.arange(tokens).repeat_interleave(top_k)[perm]
    return x, Routing(token, experts.reshape(-1)[perm], weights.reshape(-1)[perm])


CASES = [(n, redundant, tokens, top_k, rank) for n, redundant, tokens, top_k, rank in [
    (2, 2, 16, 12, 0), (2, 2, 16, 12, 1), (2, 0, 1, 1, 0), (2, 5, 0, 12, 1), (3, 4, 40, 6, 2), (4, 0, 33, 2, 1),
    (2, 2, 300, 12, 0),
]]


def test_the_kernel_builds_here() -> None:
    assert er.native_available()


@pytest.mark.parametrize(("n", "redundant", "tokens", "top_k", "rank"), CASES)
def test_every_function_equals_the_torch_path(n: int, redundant: int, tokens: int, top_k: int, rank: int) -> None:
    placement = ExpertPlacement.static(1, EXPERTS, n, redundant)
    table, counts, slot_of, slots = _tables(placement, rank)
    x, routing = _routing(tokens * 31 + n, tokens, top_k)
    half = slots // 2

    got_counts, want_counts = torch.zeros(EXPERTS, dtype=torch.int64), torch.zeros(EXPERTS, dtype=torch.int64)
    s = er.split(routing, tokens, table, counts, slot_of, half, rank, got_counts)
    r = er._split_reference(routing, table, counts, slot_of, half, rank, want_counts)
    for name in ("dest", "at_early", "at_late", "at_far"):
        assert torch.equal(getattr(s, name), getattr(r, name)), name
    assert torch.equal(got_counts, want_counts)

    send, sent_at, sent_terms, rows = er.pack_dense(x, routing, s, rank, n, slots, torch.float32)
    w_send, w_sent_at, w_terms, w_rows = er._pack_dense_reference(x, routing, r, rank, n, slots, torch.float32)
    assert torch.equal(send, w_send) and torch.equal(sent_at, w_sent_at)
    assert (sent_terms, rows) == (w_terms, w_rows)

    # What a peer receives from this rank: its rows of `send`, as if two senders' shares came in.
    per_peer = [tokens] * (n - 1)
    states, recv, per_rank = er.unpack(send, per_peer, HIDDEN, torch.float32, slots, EXPERTS)
    w_states, w_recv, w_per_rank = er._unpack_reference(send, per_peer, HIDDEN, torch.float32, slots, EXPERTS)
    assert torch.equal(states, w_states) and per_rank == w_per_rank
    for name in ("token", "expert", "weight"):
        assert torch.equal(getattr(recv, name), getattr(w_recv, name)), name

    # The early and late terms come out in some expert-major order: any permutation will do here.
    gen = torch.Generator().manual_seed(tokens)
    early_order = torch.randperm(s.at_early.numel(), generator=gen)
    late_order = torch.randperm(s.at_late.numel(), generator=gen)
    got = er.combine_order(routing, tokens, s, early_order, late_order, sent_at)
    want = er._combine_order_reference(routing, r, early_order, late_order, w_sent_at)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_out_of_range_input_is_refused_and_counts_nothing() -> None:
    placement = ExpertPlacement.static(1, EXPERTS, 2, 2)
    table, counts, slot_of, slots = _tables(placement, 0)
    x, routing = _routing(5, 4, 3)
    bad = Routing(routing.token, routing.expert.clone(), routing.weight)
    bad.expert[-1] = EXPERTS
    seen = torch.zeros(EXPERTS, dtype=torch.int64)
    with pytest.raises(IndexError):
        er.split(bad, 4, table, counts, slot_of, slots // 2, 0, seen)
    with pytest.raises(IndexError):
        er.split(routing, 3, table, counts, slot_of, slots // 2, 0, seen)  # a token past the batch
    assert not seen.any()

    s = er.split(routing, 4, table, counts, slot_of, slots // 2, 0, seen)
    send = er.pack_dense(x, routing, s, 0, 2, slots, torch.float32)[0]
    ids = send[:, 4 * HIDDEN:4 * HIDDEN + 4 * slots].view(torch.int32)
    for wrong in (EXPERTS, -2):
        peer_data = send.clone()
        peer_data[:, 4 * HIDDEN:4 * HIDDEN + 4 * slots].view(torch.int32)[0, 0] = wrong
        with pytest.raises(ValueError, match="expert id"):
            er.unpack(peer_data, [4], HIDDEN, torch.float32, slots, EXPERTS)
        with pytest.raises(ValueError, match="expert id"):
            er._unpack_reference(peer_data, [4], HIDDEN, torch.float32, slots, EXPERTS)
    assert int((ids >= 0).sum()) == s.at_far.numel()


def test_a_missing_term_position_is_refused() -> None:
    placement = ExpertPlacement.static(1, EXPERTS, 2, 2)
    table, counts, slot_of, slots = _tables(placement, 1)
    _, routing = _routing(9, 8, 12)
    s = er.split(routing, 8, table, counts, slot_of, slots // 2, 1, torch.zeros(EXPERTS, dtype=torch.int64))
    order = torch.arange(s.at_early.numel())
    assert order.numel() > 1
    order[1] = order[0]  # two early terms claimed by one assignment, another left without
    late = torch.arange(s.at_late.numel())
    sent_at = torch.arange(s.at_far.numel())
    with pytest.raises(ValueError, match="cover each assignment once"):
        er.combine_order(routing, 8, s, order, late, sent_at)
