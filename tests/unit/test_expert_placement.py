"""The expert placement table on its own: the static default, the invariants every table is checked
against, the replica rule and the dict round trip."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepinfer.engine.ep.placement import EMPTY, ExpertPlacement, replica_index


@st.composite
def static_args(draw: st.DrawFn) -> tuple[int, int, int, int]:
    experts = draw(st.integers(1, 40))
    ranks = draw(st.integers(1, 9))
    redundant = draw(st.integers(0, experts * (ranks - 1)))
    return draw(st.integers(0, 3)), experts, ranks, redundant


def test_static_without_replicas_is_contiguous_blocks() -> None:
    p = ExpertPlacement.static(num_layers=2, num_experts=8, num_ranks=2)
    assert p.slots_per_rank == 4 and p.version == 0
    assert [p.experts_on(0, r) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert p.layers[0] == p.layers[1]
    # Uneven: balanced blocks, the short rank's spare slot empty.
    q = ExpertPlacement.static(1, 5, 2)
    assert q.slots_per_rank == 3 and q.layers[0] == (0, 1, EMPTY, 2, 3, 4)


def test_static_replicas_go_to_other_ranks_spread_over_blocks() -> None:
    p = ExpertPlacement.static(1, 8, 2, redundant=3)
    # One copy of the first of each block, then of the second of rank 0's: each on the other rank.
    assert p.experts_on(0, 0) == [0, 1, 2, 3, 4]
    assert p.experts_on(0, 1) == [4, 5, 6, 7, 0, 1]
    assert p.replica_ranks(0)[0] == [0, 1] and p.replica_ranks(0)[5] == [1]


@given(static_args())
def test_static_always_fits(args: tuple[int, int, int, int]) -> None:
    """Any redundancy up to E·(N-1) fits: every expert placed, no rank holding one twice (checked on
    construction), exactly E + redundant copies, at most one slot per rank beyond the even share."""
    layers, experts, ranks, redundant = args
    p = ExpertPlacement.static(layers, experts, ranks, redundant)
    assert p.num_layers == layers
    for slots in p.layers:
        assert sum(e != EMPTY for e in slots) == experts + redundant
        copies = [len(r) for r in p.replica_ranks(0)]
        assert max(copies) - min(copies) <= 1  # replicas cycle through the experts
    assert p.slots_per_rank <= math.ceil((experts + redundant) / ranks) + 1


def test_static_refuses_more_replicas_than_ranks_can_hold() -> None:
    with pytest.raises(ValueError, match="at most one replica"):
        ExpertPlacement.static(1, 4, 2, redundant=5)


@pytest.mark.parametrize("layers, match", [
    ([[0, 1, 2]], "lists 3 slots"),
    ([[0, 1, 2, 9]], "outside"),
    ([[0, 1, 2, 2]], "no replica of experts \\[3\\]"),
    ([[0, 0, 1, 2], [0, 1, 2, 3]], "no replica"),
    ([[0, 0, 1, 2]], "no replica"),
])
def test_invariants_are_checked(layers: list[list[int]], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ExpertPlacement(2, 4, 2, tuple(map(tuple, layers)))


def test_a_rank_may_not_hold_an_expert_twice() -> None:
    with pytest.raises(ValueError, match="rank 0 holds an expert twice"):
        ExpertPlacement(2, 3, 3, ((0, 0, 1, 2, EMPTY, EMPTY),))
    ExpertPlacement(2, 3, 3, ((0, 1, EMPTY, 2, 0, EMPTY),))  # the same copies on two ranks: fine


def test_too_few_slots_and_bad_ranks_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        ExpertPlacement(2, 5, 2, ())
    with pytest.raises(ValueError, match="outside a group"):
        ExpertPlacement.static(1, 4, 2).experts_on(0, 2)


@given(st.integers(0, 10_000), st.integers(0, 15), st.integers(1, 8))
def test_replica_rule_is_in_range_and_round_robin(token: int, rank: int, n: int) -> None:
    i = replica_index(token, rank, n)
    assert 0 <= i < n
    # Consecutive rows of one batch take the replicas in turn.
    assert {replica_index(token + j, rank, n) for j in range(n)} == set(range(n))


def test_destination_follows_the_rule() -> None:
    p = ExpertPlacement.static(1, 8, 2, redundant=2)
    assert p.replica_ranks(0)[0] == [0, 1]
    assert [p.destination(0, 0, t, rank=0) for t in range(4)] == [0, 1, 0, 1]
    assert [p.destination(0, 0, t, rank=1) for t in range(4)] == [1, 0, 1, 0]
    assert {p.destination(0, 6, t, rank=0) for t in range(4)} == {1}  # a single copy, always its rank


@given(static_args(), st.integers(0, 1000))
def test_dict_round_trip_is_plain_data(args: tuple[int, int, int, int], version: int) -> None:
    p = ExpertPlacement.static(*args)
    p = ExpertPlacement(p.num_ranks, p.num_experts, p.slots_per_rank, p.layers, version)
    d = json.loads(json.dumps(p.to_dict()))  # plain ints and lists only
    assert ExpertPlacement.from_dict(d) == p


def test_from_dict_checks_what_it_reads() -> None:
    d = ExpertPlacement.static(1, 4, 2).to_dict()
    d["layers"] = [[0, 1, 1, EMPTY]]
    with pytest.raises(ValueError, match="no replica"):
        ExpertPlacement.from_dict(d)
    with pytest.raises(ValueError, match="not an expert placement"):
        ExpertPlacement.from_dict({"layers": []})


def test_with_layers_bumps_the_version() -> None:
    p = ExpertPlacement.static(2, 4, 2)
    q = p.with_layers([[3, 2, 1, 0], [0, 1, 2, 3]])
    assert q.version == p.version + 1 and q.experts_on(0, 0) == [3, 2]
