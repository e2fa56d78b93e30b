"""The router's drain decisions (`DrainDesk`) over a real instance table: a draining member gets no new
placement, is acknowledged once while the router holds some of its requests and released once it holds none,
and its leaving is counted (with the cause "drain" for what it still held). Pure: no sockets, no clock."""

from __future__ import annotations

from deepinfer.protocol import messages as m
from deepinfer.services.router_drain import DrainDesk
from deepinfer.services.router_placement import WORKER, Assignment, InstanceTable

NOW = 1000.0


def beat(name: str, seq: int, draining: bool = False, incarnation: str = "inc-1") -> m.Heartbeat:
    return m.Heartbeat(WORKER, name, incarnation, seq, progress=seq, free_blocks=100, total_blocks=100,
                       draining=draining)


def table_of(*names: str) -> InstanceTable:
    table = InstanceTable(heartbeat_timeout_s=5.0, progress_timeout_s=None, block_size=16)
    for name in names:
        table.hello(WORKER, name, "inc-1", NOW)
        table.heartbeat(beat(name, 1), NOW)
        table.get(name).pid = 4242
    return table


def shutdowns(out: list) -> list[tuple[str, bool]]:
    assert all(isinstance(o.msg, m.Shutdown) for o in out)
    return [(o.dest, o.msg.drain) for o in out]


def test_an_operators_drain_takes_the_member_out_of_placement_at_once():
    table = table_of("worker-0", "worker-1")
    desk = DrainDesk(table)
    status, out = desk.on_drain_service(m.DrainService("worker-0", timeout_s=7.0), NOW)
    assert [(o.dest, o.msg) for o in out] == [("worker-0", m.Shutdown(True, "drained by an operator", 7.0))]
    assert status.draining and status.alive and not status.serving and status.pid == 4242
    # Its heartbeats have not said so yet: placement avoids it all the same.
    for _ in range(3):
        placed = table.place(16, 16, NOW)
        assert placed is not None and placed.prefill.name == "worker-1"
    assert desk.begun == 1
    # A restart (a new incarnation adopted) is a new process: not draining.
    table.reset("worker-0", WORKER, "inc-2", NOW, beat("worker-0", 1, incarnation="inc-2"))
    assert desk.status("worker-0", NOW).serving


def test_a_member_not_running_is_not_drained():
    table = table_of("worker-0")
    table.retire(table.get("worker-0"))
    desk = DrainDesk(table)
    for name in ("worker-0", "nobody"):
        status, out = desk.on_drain_service(m.DrainService(name), NOW)
        assert out == [] and not status.alive and not status.draining
    assert desk.status("nobody", NOW) == m.ServiceStatus("nobody", known=False)
    assert desk.begun == 0


def test_draining_heartbeats_are_acknowledged_once_while_held_then_released():
    table = table_of("worker-0")
    desk = DrainDesk(table)
    assert desk.on_heartbeat(beat("worker-0", 2)) == []  # not draining: nothing to say
    table.hold(Assignment("r1", "tok"), ["worker-0"])
    draining = beat("worker-0", 3, draining=True)
    table.heartbeat(draining, NOW)
    assert shutdowns(desk.on_heartbeat(draining)) == [("worker-0", True)]  # the acknowledgement
    assert table.get("worker-0").draining and desk.begun == 1
    assert desk.on_heartbeat(beat("worker-0", 4, draining=True)) == []  # once
    table.hold(Assignment("r1", "tok", holders=frozenset({"worker-0"})), [])  # the request is done with it
    assert shutdowns(desk.on_heartbeat(beat("worker-0", 5, draining=True))) == [("worker-0", False)]  # released
    assert desk.begun == 1
    # A heartbeat of another incarnation (a late one, or the successor's before its reset) changes nothing.
    assert desk.on_heartbeat(beat("worker-0", 6, draining=True, incarnation="inc-0")) == []


def test_an_idle_member_draining_by_itself_is_released_at_its_first_draining_heartbeat():
    table = table_of("worker-0")
    desk = DrainDesk(table)
    assert shutdowns(desk.on_heartbeat(beat("worker-0", 2, draining=True))) == [("worker-0", False)]


def test_leaving_is_counted_and_named_drain_only_for_a_draining_member():
    table = table_of("worker-0", "worker-1")
    desk = DrainDesk(table)
    assert desk.on_exit(m.ServiceExited("worker-1", 4242, 0)) is None  # a death, not a drain
    desk.on_drain_service(m.DrainService("worker-0"), NOW)
    assert desk.on_exit(m.ServiceExited("worker-0", 999, 0)) is None  # another process: a stale note
    table.hold(Assignment("r1", "tok"), ["worker-0"])
    assert desk.on_exit(m.ServiceExited("worker-0", 4242, 0)) == "drain"
    assert (desk.begun, desk.finished, desk.timed_out) == (1, 1, 1)


def test_an_operator_sees_a_members_restarts_load_last_heartbeat_and_cached_blocks():
    table = table_of("worker-0")
    desk = DrainDesk(table)
    table.heartbeat(m.Heartbeat(WORKER, "worker-0", "inc-1", 2, progress=2, free_blocks=40, total_blocks=100,
                                running=3, waiting=2, tokens_per_s=55.0), NOW)
    status = desk.status("worker-0", NOW + 1.5, {"device": 12})
    assert (status.restarts, status.heartbeat_age_s, status.running, status.waiting) == (0, 1.5, 3, 2)
    assert (status.free_blocks, status.total_blocks, status.tokens_per_s) == (40, 100, 55.0)
    assert status.cached_blocks == {"device": 12} and status.serving and status.clock_offset_s is None
    table.instances["worker-0"].clock_offset_s = -29.5  # the router's shell sets it from each heartbeat's sent_time
    assert desk.status("worker-0", NOW).clock_offset_s == -29.5
    for n, incarnation in enumerate(("inc-2", "inc-3"), start=1):
        table.reset("worker-0", WORKER, incarnation, NOW)
        restarted = desk.status("worker-0", NOW)
        assert restarted.restarts == n and restarted.incarnation == incarnation and restarted.heartbeat_age_s == 0.0
