"""deepinfer-launch drain: take one service of a running mesh out of service without losing a request.

    deepinfer-launch drain decode-0 --run-dir /tmp/deepinfer-run-XXXX        # a mesh `up` runs
    deepinfer-launch drain prefill-1 --topology topology.toml --timeout 30    # any topology, from any host

The command reaches the service through the router, as an operator: it connects to the router's backend
under a supervisor identity (on a secured backend with the supervisor's key from the topology's keys
directory, so only whoever may read that key can drain) and sends DrainService. The router places no new
work on the service from that moment and tells it to drain (`services.router_drain`): what it holds
finishes where it runs, what still runs at the timeout moves to other services and continues there without
a gap or a repeated token, and then the service exits 0. Under `up` the supervisor starts it again, so
draining each worker in turn with `--serving` is a rolling restart; under systemd (Restart=on-failure) it
stays stopped until `systemctl start`.

SIGTERM drains a service the same way (`systemctl stop` / `restart`, `kill PID`): its first heartbeat says
so, and the router stops placing work on it then.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click

from deepinfer.launch.operator_link import OperatorLink, mesh_topology

QUERY_PERIOD_S = 0.2  # how often the command asks the router how the service is doing
SERVING_WAIT_S = 600.0  # with --serving: the longest wait for the successor (it loads its model)


@click.command()
@click.argument("name")
@click.option("--topology", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="The mesh's topology file (its router backend and [security] keys).")
@click.option("--run-dir", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Or the run directory of an `up` (its topology.toml).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0), default=None,
              help="Seconds the service's requests get to finish where they are; what still runs then moves to "
                   "another service (0: move everything now). Default: the service's drain timeout (60).")
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="Wait until the service has drained and its process left.")
@click.option("--serving", is_flag=True,
              help="Then wait until its successor serves (under `up` the supervisor restarts it): one step of a "
                   "rolling restart.")
def drain(name: str, topology: Path | None, run_dir: Path | None, timeout_s: float | None, wait: bool,
          serving: bool) -> None:
    """Drain service NAME gracefully: no new work goes to it from now on, its requests finish (or move to
    another service at --timeout), then it exits 0; under `up` the supervisor starts it again.

    The command asks the router, as an operator: it connects to the router's backend under a supervisor
    identity, with the supervisor's key when the topology has a [security] table. Tokenizers, workers, cache
    daemons and the expert balancer can be drained. SIGTERM drains a service the same way: `systemctl stop`
    or `systemctl restart deepinfer-worker@NAME` under systemd; the router and HTTP gateways drain only so."""
    topo = mesh_topology(topology, run_dir)
    _check_drainable(topo, name)
    if serving and not wait:
        raise click.UsageError("--serving waits for the successor: drop --no-wait")
    with OperatorLink(topo) as link:
        _drain(link, name, timeout_s, wait, serving)


def _check_drainable(topo: Any, name: str) -> None:
    members = {*(t.name for t in topo.tokenizers), *(w.name for w in topo.workers), *(k.name for k in topo.kvcaches)}
    if topo.balancer is not None:
        from deepinfer.services.balancer_config import BALANCER_NAME

        members.add(BALANCER_NAME)
    if name in members:
        return
    if name == "router" or name in {g.name for g in topo.gateways}:
        raise click.UsageError(f"{name} drains on SIGTERM (systemctl stop, or stopping `up`); `drain` takes the "
                               f"services behind the router")
    raise click.UsageError(f"the topology has no service {name!r}; it has {', '.join(sorted(members))}")


def _drain(link: OperatorLink, name: str, timeout_s: float | None, wait: bool, serving: bool) -> None:
    from deepinfer.protocol import messages as m
    from deepinfer.services.base import DRAIN_TIMEOUT_S

    first = link.ask(m.DrainService(name, timeout_s))
    if not first.known:
        raise click.ClickException(f"the router knows no service {name!r}: it never registered (still starting?)")
    if not first.alive:
        raise click.ClickException(f"{name} is not running (its last process, pid {first.pid}, is gone)")
    click.echo(f"draining {name} (pid {first.pid}): no new work goes to it; {first.held} request(s) in flight")
    if not wait:
        return
    limit = (DRAIN_TIMEOUT_S if timeout_s is None else timeout_s) + 60.0  # its drain, its goodbye, the exit
    _until(link, name, lambda s: s.incarnation != first.incarnation or not s.alive, limit, f"{name} did not leave",
           held=first.held)
    click.echo(f"{name} drained: its process (pid {first.pid}) left")
    if serving:
        status = _until(link, name, lambda s: s.incarnation != first.incarnation and s.serving, SERVING_WAIT_S,
                        f"{name} has no successor serving (is it supervised?)")
        click.echo(f"{name} serving again (pid {status.pid})")


def _until(link: OperatorLink, name: str, done: Any, limit_s: float, failure: str, held: int | None = None) -> Any:
    """Ask the router about `name` until `done(status)`; a ClickException after `limit_s`. With `held` (the
    requests it held when last said), each change of that count is printed."""
    from deepinfer.protocol import messages as m

    deadline = time.monotonic() + limit_s
    while True:
        status = link.ask(m.ServiceQuery(name), deadline)
        if done(status):
            return status
        if held is not None and status.held != held:
            held = status.held
            click.echo(f"{name}: {held} request(s) in flight")
        if time.monotonic() > deadline:
            raise click.ClickException(f"{failure} within {limit_s:g}s")
        time.sleep(QUERY_PERIOD_S)
