"""Rank 0's side of moving a worker group to a new expert placement: one move at a time across the group.

The leader stages the placement on its own engine and sends `Op.STAGE` to every follower; each report says
whether that rank's staging is ready; when every rank is ready the next round switches them all at once,
and when any reports an error every rank drops what it staged (the old placement stays). The per-rank
staging itself is `deepinfer.engine.ep.move`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import structlog

from deepinfer.engine.ep.move import MoveResult, PlacementRefused, check_successor
from deepinfer.engine.ep.placement import ExpertPlacement
from deepinfer.services.group.control import Op

log = structlog.get_logger("deepinfer.expert_move")


class PlacementMoves:
    """The leader's bookkeeping of a group move (see the module docstring, part 2). `local` is rank 0's
    engine; `queue(rank, command)` queues a command for a follower's next round."""

    def __init__(self, local: Any, size: int, queue: Callable[[int, list[Any]], None]) -> None:
        self.local = local
        self.size = size
        self._queue = queue
        self.pending: ExpertPlacement | None = None
        self._results: list[MoveResult] = []
        self._ready: set[int] = set()

    def begin(self, placement: ExpertPlacement) -> None:
        """Stage `placement` on every rank; PlacementRefused (see `GroupEngine.begin_placement`)."""
        if self.pending is not None:
            raise PlacementRefused(f"a move to placement version {self.pending.version} is in progress")
        check_successor(self.local.ep_placement, placement)
        self.local.stage_placement(placement)
        for r in range(1, self.size):
            self._queue(r, [Op.STAGE, placement.to_dict()])
        self.pending, self._ready = placement, set()
        log.info("placement move begun", version=placement.version)

    def switch_due(self) -> int | None:
        """The version the next round must switch every rank to: the pending one once all are ready."""
        if self.pending is not None and len(self._ready) == self.size:
            return self.pending.version
        return None

    def after_round(self, switched: int | None, staged: Mapping[int, Any]) -> None:
        """After a round: `switched` is the version it switched to (None: none); `staged` holds every
        follower's `Report.staged` ([version, error] or None)."""
        if self.pending is None:
            return
        if switched is not None:
            self._end(True)
            return
        states = {0: self.local.staged_placement(), **{r: tuple(s) if s else (None, None) for r, s in staged.items()}}
        errors = [f"{err}" for _, err in states.values() if err]
        if errors:
            self.local.drop_staged_placement()
            for r in range(1, self.size):
                self._queue(r, [Op.UNSTAGE])
            self._end(False, "; ".join(errors))
            return
        self._ready |= {r for r, (version, _) in states.items() if version == self.pending.version}

    def _end(self, ok: bool, reason: str = "") -> None:
        assert self.pending is not None
        self._results.append(MoveResult(self.pending.version, ok, reason))
        log.info("placement move ended", version=self.pending.version, ok=ok, reason=reason)
        self.pending, self._ready = None, set()

    def take_results(self) -> list[MoveResult]:
        results, self._results = self._results, []
        return results
