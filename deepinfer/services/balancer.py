"""The expert balancer service (`balancer`, one per mesh): a thin shell over `BalancerCore`.

It is a mesh `Service` like the cache daemon: a DEALER to the router, Hello (service "balancer") and
heartbeats. The router forwards it every worker group's `ExpertLoad` and `PlacementResult`, and relays its
`PlacementUpdate`s to the group named in each (from no one else).

One core per MoE worker group, keyed by the group's name. Per report: when the table the group says it
runs differs from the core's current one, a newer version of the same shape is adopted (the group
switched); anything else — an older version, another shape, the same version with other slots — means
the group restarted, and a fresh core starts from the reported table. The report's loads are then
observed. Every `interval_s` each core plans; a decision goes out as a PlacementUpdate, and its
PlacementResult settles it (ok: adopt, not ok: abandon). A decision unanswered after `move_timeout_s` is
abandoned; if the group still completes it later, its next report shows the newer table and is adopted.

State lives in the groups alone: the balancer keeps nothing on disk. If it dies the groups keep serving on
their last placement; a restarted balancer resumes from the next reports (each carries the table), and its
versions continue above the reported one, so it never sends a version a group has passed. Times come
from `time.monotonic()` and are passed into the core.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from deepinfer.engine.ep.placement import ExpertPlacement
from deepinfer.metrics.recorders.balancer import BalancerExport
from deepinfer.protocol import messages as m
from deepinfer.services.balancer_config import BALANCER_NAME, BalancerConfig
from deepinfer.services.balancer_core import BalancerCore, Decision
from deepinfer.services.base import Handler, Service

__all__ = ["BALANCER_NAME", "BalancerConfig", "BalancerService", "placement_of", "table_of"]

MAX_TICK_S = 0.5  # the most time between looks for decisions that timed out


def table_of(placement: ExpertPlacement) -> m.PlacementTable:
    """A placement as the wire carries it."""
    return m.PlacementTable(**placement.to_dict())


def placement_of(table: m.PlacementTable) -> ExpertPlacement:
    """The placement a wire table names; ValueError when it breaks the placement's invariants."""
    return ExpertPlacement.from_dict(dataclasses.asdict(table))


@dataclass
class GroupState:
    """The balancer's view of one worker group. Invariant: `sent_at` is set exactly while the core has a
    pending decision (sent, neither adopted nor abandoned)."""

    core: BalancerCore
    sent_at: float | None = None


class BalancerService(Service):
    """The expert balancer (see the module docstring): `groups` holds one core per MoE worker group; the
    counters say how many decisions went out and how they ended."""

    role = "balancer"

    def __init__(self, instance: str, backend: str, ctx: Any = None, config: BalancerConfig | None = None,
                 **kw: Any) -> None:
        super().__init__(instance, backend, ctx, **kw)
        self.config = config or BalancerConfig()
        self.groups: dict[str, GroupState] = {}
        self.decisions = 0  # PlacementUpdates sent
        self.adopted = 0  # decisions the groups confirmed
        self.abandoned = 0  # decisions refused, failed or timed out
        self.balancer_export: BalancerExport | None = None  # Prometheus: the decisions' outcomes

    def record_metrics(self, beat: m.Heartbeat) -> None:
        super().record_metrics(beat)
        if self.balancer_export is None:
            self.balancer_export = BalancerExport(self.role, self.instance)
        self.balancer_export.decisions(self.decisions, self.adopted, self.abandoned)

    def handlers(self) -> dict[type, Handler]:
        return {m.ExpertLoad: self._on_load, m.PlacementResult: self._on_result}

    def tasks(self) -> list[Any]:
        return [self._plan_loop()]

    # -- reports and results ------------------------------------------------------------------

    async def _on_load(self, load: m.ExpertLoad) -> None:
        self.progress += 1
        if load.placement is None or not load.expert_tokens:
            return  # a dense model, or a group that does not report its table: nothing to balance
        try:
            table = placement_of(load.placement)
        except ValueError as exc:
            self.log.warning("unusable placement in a load report", worker=load.worker, error=str(exc))
            return
        group = self._group_for(load.worker, table)
        try:
            group.core.observe(load.expert_tokens, load.placement_version, time.monotonic())
        except ValueError as exc:
            self.log.warning("unusable load report", worker=load.worker, error=str(exc))

    def _group_for(self, worker: str, table: ExpertPlacement) -> GroupState:
        """The group's state, brought in line with the table it reports (see the module docstring)."""
        group = self.groups.get(worker)
        if group is not None and table == group.core.current:
            return group
        if group is not None and table.version > group.core.current.version and _same_shape(table, group.core.current):
            settled = group.core.pending is not None
            group.core.adopt(table)  # it settles a pending decision too: the group has moved on
            group.sent_at = None
            self.log.info("group runs a newer placement", worker=worker, version=table.version,
                          settled_pending=settled)
            return group
        c = self.config
        core = BalancerCore(table, window_s=c.window_s, threshold=c.threshold, max_moves=c.max_moves,
                            max_moves_total=c.max_moves_total)
        self.groups[worker] = group = GroupState(core)
        self.log.info("balancing a worker group", worker=worker, version=table.version, ranks=table.num_ranks,
                      experts=table.num_experts, slots_per_rank=table.slots_per_rank, moe_layers=table.num_layers)
        return group

    async def _on_result(self, result: m.PlacementResult) -> None:
        self.progress += 1
        group = self.groups.get(result.worker)
        pending = group.core.pending if group is not None else None
        if group is None or pending is None or pending.version != result.version:
            self.log.info("result for no pending decision", worker=result.worker, version=result.version,
                          ok=result.ok)
            return
        if result.ok:
            group.core.adopt(pending)
            self.adopted += 1
            self.log.info("placement adopted", worker=result.worker, version=result.version)
        else:
            group.core.abandon()
            self.abandoned += 1
            self.log.warning("placement refused", worker=result.worker, version=result.version, reason=result.reason)
        group.sent_at = None

    # -- decisions ----------------------------------------------------------------------------

    async def _plan_loop(self) -> None:
        next_plan = time.monotonic() + self.config.interval_s
        while True:
            await asyncio.sleep(min(MAX_TICK_S, self.config.interval_s))
            now = time.monotonic()
            self._expire_pending(now)
            if now >= next_plan:
                next_plan = now + self.config.interval_s
                await self.plan_all(now)

    def _expire_pending(self, now: float) -> None:
        for worker, group in self.groups.items():
            if group.sent_at is not None and now - group.sent_at > self.config.move_timeout_s:
                version = group.core.pending.version if group.core.pending is not None else None
                group.core.abandon()
                group.sent_at = None
                self.abandoned += 1
                self.log.warning("placement unanswered: given up", worker=worker, version=version,
                                 timeout_s=self.config.move_timeout_s)

    async def plan_all(self, now: float) -> None:
        """Plan for every group; send each decision to its group (via the router)."""
        for worker, group in list(self.groups.items()):
            decision = group.core.plan(now)
            if decision is None:
                continue
            group.sent_at = now
            self.decisions += 1
            self._log_decision(worker, decision)
            await self.send_router(m.PlacementUpdate(worker, table_of(decision.placement), list(decision.before),
                                                     list(decision.after)))

    def _log_decision(self, worker: str, d: Decision) -> None:
        self.log.info("placement decided", worker=worker, version=d.placement.version, layers=list(d.changed),
                      moves=sum(d.moves), moves_per_layer=[d.moves[i] for i in d.changed],
                      before=[round(d.before[i], 3) for i in d.changed],
                      after=[round(d.after[i], 3) for i in d.changed])


def _same_shape(a: ExpertPlacement, b: ExpertPlacement) -> bool:
    return (a.num_ranks, a.num_experts, a.slots_per_rank, a.num_layers) == (
        b.num_ranks, b.num_experts, b.slots_per_rank, b.num_layers)
