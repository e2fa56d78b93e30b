"""A worker group's side of expert balancing, for `WorkerService` (rank 0 of an expert-parallel group).

* `report()`: one `ExpertLoad` (tokens per expert and per rank since the last report, and the placement
  table the ranks run now), preceded by a `PlacementResult` for every move that ended since the last
  report. Everything is read in one engine-thread call, so the table and the results agree: a move that
  ended ok is in the results and is the table sent after them.
* `on_update()`: a `PlacementUpdate` from the balancer (relayed by the router) starts a move on the
  ranks (`GroupEngine.begin_placement`); a table that breaks the placement invariants, or a move the
  group refuses (`PlacementRefused`, a ValueError: a move in flight, a stale version, another shape), is
  answered at once with `PlacementResult(ok=False, reason)`. An accepted move is answered when it ends.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from deepinfer.protocol import messages as m
from deepinfer.services.balancer import placement_of, table_of
from deepinfer.services.group.channel import GroupBroken
from deepinfer.services.group.engine import GroupEngine

__all__ = ["ExpertLink"]

# Runs a function on the engine thread; resolves to its result.
OnEngine = Callable[[Callable[[], Any]], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]


class ExpertLink:
    """The worker group `worker` (its engine `engine`) towards the balancer, through the router."""

    def __init__(self, worker: str, engine: GroupEngine, on_engine: OnEngine, send: Send, log: Any) -> None:
        self.worker = worker
        self.engine = engine
        self.on_engine = on_engine
        self.send = send
        self.log = log

    def _take(self) -> tuple[Any, list[int], list[list[int]], int, m.PlacementTable | None, list[Any]]:
        """On the engine thread: the load since the last call, the placement run now, ended moves."""
        e = self.engine
        counts, per_rank, computed = e.take_expert_load()
        placement = e.placement
        return counts, per_rank, computed, e.placement_version, None if placement is None else table_of(placement), \
            e.take_placement_results()

    async def report(self, period_s: float) -> None:
        counts, per_rank, computed, version, table, results = await self.on_engine(self._take)
        for r in results:
            self.log.info("placement move ended", version=r.version, ok=r.ok, reason=r.reason)
            await self.send(m.PlacementResult(self.worker, r.version, r.ok, r.reason))
        await self.send(m.ExpertLoad(self.worker, version, period_s, counts or [], per_rank, table, computed))

    async def on_update(self, update: m.PlacementUpdate) -> None:
        version = update.placement.version
        if update.worker != self.worker:
            await self._refuse(version, f"the update names {update.worker!r}, not this worker")
            return
        try:
            placement = placement_of(update.placement)
            await self.on_engine(lambda: self.engine.begin_placement(placement))
        except GroupBroken:
            raise  # the group is over and this process exits: no answer to give
        except ValueError as exc:  # a bad table, or PlacementRefused
            await self._refuse(version, str(exc))
        except Exception as exc:
            self.log.exception("starting a placement move failed", version=version)
            await self._refuse(version, f"internal: {exc!r}")
        else:
            self.log.info("placement move begun", version=version, before=update.before, after=update.after)

    async def _refuse(self, version: int, reason: str) -> None:
        self.log.warning("placement refused", version=version, reason=reason)
        await self.send(m.PlacementResult(self.worker, version, False, reason))


async def refuse_not_a_group(worker: str, update: m.PlacementUpdate, send: Send) -> None:
    """A worker that is no expert-parallel group has no placement to change."""
    await send(m.PlacementResult(worker, update.placement.version, False, "not an expert-parallel worker group"))
