"""A worker group's side of expert balancing (`ExpertLink`), over a stand-in for the GroupEngine: reports
carry the table the ranks run and come after the results of the moves that ended; an update starts a
move, and a bad table or a refused move is answered at once."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import structlog

from deepinfer.engine.ep.move import MoveResult, PlacementRefused
from deepinfer.engine.ep.placement import ExpertPlacement
from deepinfer.protocol import messages as m
from deepinfer.services.balancer import placement_of, table_of
from deepinfer.services.worker_experts import ExpertLink, refuse_not_a_group

STATIC = ExpertPlacement.static(2, 4, 2, 1)


class StandIn:
    """What ExpertLink asks of a GroupEngine."""

    def __init__(self) -> None:
        self.placement: ExpertPlacement | None = STATIC
        self.results: list[MoveResult] = []
        self.begun: list[ExpertPlacement] = []
        self.refuse: str | None = None

    @property
    def placement_version(self) -> int:
        return self.placement.version if self.placement is not None else 0

    def take_expert_load(self) -> tuple[list[list[int]], list[int], list[list[int]]]:
        return [[1, 2, 3, 4], [4, 3, 2, 1]], [12, 8], [[6, 4], [3, 7]]

    def take_placement_results(self) -> list[MoveResult]:
        taken, self.results = self.results, []
        return taken

    def begin_placement(self, placement: ExpertPlacement) -> None:
        if self.refuse is not None:
            raise PlacementRefused(self.refuse)
        self.begun.append(placement)


def link(engine: StandIn, sent: list[Any]) -> ExpertLink:
    async def on_engine(fn: Any) -> Any:
        return fn()

    async def send(msg: Any) -> None:
        sent.append(msg)

    return ExpertLink("w", engine, on_engine, send, structlog.get_logger("test"))  # type: ignore[arg-type]


def test_a_report_carries_the_table_after_the_ended_moves() -> None:
    engine, sent = StandIn(), []
    moved = dataclasses.replace(STATIC, version=1)
    engine.placement, engine.results = moved, [MoveResult(1, True), MoveResult(2, False, "a rank failed")]
    asyncio.run(link(engine, sent).report(5.0))
    assert sent[:2] == [m.PlacementResult("w", 1, True), m.PlacementResult("w", 2, False, "a rank failed")]
    load = sent[2]
    assert isinstance(load, m.ExpertLoad) and load.placement_version == 1 and load.rank_tokens == [12, 8]
    assert placement_of(load.placement) == moved and load.expert_tokens == [[1, 2, 3, 4], [4, 3, 2, 1]]
    assert load.rank_expert_tokens == [[6, 4], [3, 7]]
    sent.clear()
    engine.placement = None  # a dense model: no table
    asyncio.run(link(engine, sent).report(5.0))
    assert sent == [m.ExpertLoad("w", 0, 5.0, [[1, 2, 3, 4], [4, 3, 2, 1]], [12, 8], None, [[6, 4], [3, 7]])]


def test_an_update_starts_a_move_or_is_refused_at_once() -> None:
    engine, sent = StandIn(), []
    new = STATIC.with_layers([list(reversed(layer)) for layer in STATIC.layers])
    update = m.PlacementUpdate("w", table_of(new), [1.5, 1.5], [1.0, 1.0])
    asyncio.run(link(engine, sent).on_update(update))
    assert engine.begun == [new] and sent == []  # answered when the move ends, in a report
    engine.refuse = "a move is in progress"
    asyncio.run(link(engine, sent).on_update(update))
    assert sent == [m.PlacementResult("w", 1, False, "a move is in progress")]
    sent.clear()
    broken = dataclasses.replace(table_of(new), layers=[[0, 0, 1, 2, 3, -1]] * 2)  # rank 0 holds expert 0 twice
    asyncio.run(link(engine, sent).on_update(dataclasses.replace(update, placement=broken)))
    assert len(sent) == 1 and not sent[0].ok and "holds an expert twice" in sent[0].reason
    sent.clear()
    asyncio.run(link(engine, sent).on_update(dataclasses.replace(update, worker="other")))
    assert len(sent) == 1 and not sent[0].ok and "not this worker" in sent[0].reason
    assert engine.begun == [new]


def test_a_worker_that_is_no_group_refuses_updates() -> None:
    sent: list[Any] = []

    async def send(msg: Any) -> None:
        sent.append(msg)

    asyncio.run(refuse_not_a_group("w", m.PlacementUpdate("w", table_of(STATIC)), send))
    assert sent == [m.PlacementResult("w", 0, False, "not an expert-parallel worker group")]
