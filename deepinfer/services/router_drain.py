"""Graceful drain at the router: which members are draining, what to tell them, and what an operator sees.

A drain begins one of two ways: an operator's DrainService (the `drain` command, from a supervisor
identity), or the member's own heartbeat saying `draining` (it got SIGTERM: `systemctl stop` or `restart`,
`up`'s stop, a plain `kill`). From that moment the router places no new work on it (`Instance.draining`,
which placement filters on). What follows travels on the member's own connection, so in order with any
work sent to it before:

* The router tells the member it knows: `Shutdown(drain=True)`. For an operator's drain that message
  starts the drain (with the operator's timeout); for a member that drains by itself it is the
  acknowledgement, sent once, at a draining heartbeat while the router still holds some of its requests.
* An acknowledged member with nothing left in flight does not stop yet: tokens it finished may still be on
  their way through a tokenizer, a request placed on it may still be on its way (a prefill worker's KV
  handoff). At a draining heartbeat that finds the router holding none of its requests, the router
  releases it: `Shutdown(drain=False)`.
* As it stops, the member says goodbye (a ServiceExited about itself). The router retires it at once and
  moves whatever it still held: something only when its drain timed out (migration cause "drain").

A member whose drain was never acknowledged (the router was gone: `up` stops the router before the
workers) stops as soon as it is idle, as before; its goodbye, if the router hears it, covers the rest.

Pure: no sockets, no clock reads; the router shell feeds it events and sends what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.protocol.messages import DrainService, Heartbeat, ServiceExited, ServiceStatus, Shutdown
from deepinfer.services.router_placement import Instance, InstanceTable
from deepinfer.services.router_state import Outbound

DRAIN = "drain"  # the migration cause of what a draining member still held when it left


@dataclass
class DrainDesk:
    """The router's drains over its instance table, and their counts (for the metrics)."""

    table: InstanceTable
    begun: int = 0  # drains the router saw begin: an operator's, or a member's own
    finished: int = 0  # draining members that left (their goodbye, or the exit a supervisor saw)
    timed_out: int = 0  # of those, the ones that left holding requests (moved elsewhere: cause "drain")

    def on_drain_service(self, req: DrainService, now: float) -> tuple[ServiceStatus, list[Outbound]]:
        """An operator's drain: no new work on the member from now, and the member told to drain. A member
        that is not running is left as it is; the status says so."""
        inst = self.table.get(req.instance)
        if inst is None or not inst.alive:
            return self.status(req.instance, now), []
        self._begin(inst)
        inst.drain_acked = True
        drain = Shutdown(drain=True, reason="drained by an operator", timeout_s=req.timeout_s)
        return self.status(req.instance, now), [Outbound(inst.name, drain)]

    def on_heartbeat(self, hb: Heartbeat) -> list[Outbound]:
        """After the core took the heartbeat: a member that says it drains is draining here too; it is
        acknowledged while the router holds some of its requests, and released once it holds none."""
        inst = self.table.get(hb.instance)
        if inst is None or not inst.alive or inst.incarnation != hb.incarnation or not hb.draining:
            return []
        self._begin(inst)
        if not inst.held:
            return [Outbound(inst.name, Shutdown(drain=False, reason="released: the router holds none of its work"))]
        if not inst.drain_acked:
            inst.drain_acked = True
            return [Outbound(inst.name, Shutdown(drain=True, reason="the router saw the drain"))]
        return []

    def on_exit(self, note: ServiceExited) -> str | None:
        """A member's process exits (its goodbye, or a supervisor's note): the migration cause of what it still
        holds, "drain" for a draining member (counted), else None (the core's default: a death)."""
        inst = self.table.get(note.instance)
        if inst is None or not inst.alive or inst.pid != note.pid or not inst.draining:
            return None
        self.finished += 1
        self.timed_out += bool(inst.held)
        return DRAIN

    def status(self, name: str, now: float, cached_blocks: dict[str, int] | None = None) -> ServiceStatus:
        """What an operator sees of member `name` (`cached_blocks`: the prefix index's count, by tier)."""
        inst = self.table.get(name)
        if inst is None:
            return ServiceStatus(name, known=False)
        hb, age = inst.load, None if inst.last_heartbeat is None else max(0.0, now - inst.last_heartbeat)
        return ServiceStatus(name, True, inst.role, inst.incarnation or "", inst.pid or 0, inst.alive,
                             draining(inst), inst.placeable(now, self.table.heartbeat_timeout_s), len(inst.held),
                             inst.restarts, age, hb.running if hb else 0, hb.waiting if hb else 0,
                             hb.free_blocks if hb else 0, hb.total_blocks if hb else 0,
                             hb.tokens_per_s if hb else 0.0, dict(cached_blocks or {}), inst.clock_offset_s)

    def _begin(self, inst: Instance) -> None:
        if not inst.draining:
            inst.draining = True
            self.begun += 1


def draining(inst: Instance) -> bool:
    """Told to drain, or saying so in its latest heartbeat."""
    return inst.draining or (inst.load is not None and inst.load.draining)
