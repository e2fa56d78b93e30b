"""deepinfer-launch status: every service of a running mesh as its router sees it, host by host.

    deepinfer-launch status --topology cluster.toml          # from any host that reaches the router's backend
    deepinfer-launch status --run-dir /tmp/deepinfer-run-XXXX --json

It asks the router as the `drain` command does (an operator's ServiceQuery per member named in the topology, on
the backend under a supervisor identity, with the supervisor's key on a secured mesh) and prints one line per
service: its host (from its endpoint in the topology), role, state (serving, draining, up but not placeable, dead,
or never registered), pid, incarnation and the restarts the router saw, requests held, its load (running and
waiting sequences, free KV blocks, measured tokens/s), how long ago its last heartbeat came, its wall clock
against the router's (a host whose clock is off shows here; nothing in the mesh depends on it), and the blocks it
published to the router's prefix index by tier. The exit status is 0 when every service is alive, 1 when one is
not (or the router does not answer): a health check for scripts and monitors.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click

from deepinfer.launch.operator_link import OperatorLink, mesh_topology

COLUMNS = ("HOST", "SERVICE", "ROLE", "STATE", "PID", "RESTARTS", "HELD", "RUN/WAIT", "KV FREE", "TOK/S", "BEAT",
           "CLOCK", "CACHED BLOCKS")


@click.command()
@click.option("--topology", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="The mesh's topology file (its router backend, its services and [security] keys).")
@click.option("--run-dir", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Or the run directory of an `up` (its topology.toml).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per service instead of the table.")
def status(topology: Path | None, run_dir: Path | None, as_json: bool) -> None:
    """Show every service of the mesh as the router sees it: host, state, restarts, load, clock, cache by tier.
    Exits 1 when a service is not alive."""
    from deepinfer.protocol import messages as m

    topo = mesh_topology(topology, run_dir)
    members = _members(topo)
    with OperatorLink(topo) as link:
        rows = [(host, link.ask(m.ServiceQuery(name))) for name, host in members]
    if as_json:
        for host, st in rows:
            click.echo(json.dumps({"host": host, "state": state(st), **asdict(st)}))
    else:
        click.echo(f"router {topo.backend}: answering; {len(rows)} services")
        click.echo(table([COLUMNS, *(_row(host, st) for host, st in rows)]))
    if not all(st.alive for _, st in rows):
        sys.exit(1)


def _members(topo: Any) -> list[tuple[str, str]]:
    """(name, host) of every service the router knows by name: tokenizers, workers, cache daemons, the balancer."""
    out = [(t.name, host_of(t.detok)) for t in topo.tokenizers]
    out += [(w.name, host_of(w.kv)) for w in topo.workers]
    out += [(k.name, host_of(k.endpoint)) for k in topo.kvcaches]
    if topo.balancer is not None:
        from deepinfer.services.balancer_config import BALANCER_NAME

        out.append((BALANCER_NAME, "-"))  # it binds nothing: its host is not in the topology
    return out


def host_of(endpoint: str) -> str:
    """The host part of a tcp:// endpoint; "local" for ipc:// and inproc:// (the router's host)."""
    parts = urlsplit(endpoint)
    return parts.hostname or "-" if parts.scheme == "tcp" else "local"


def state(st: Any) -> str:
    if not st.known:
        return "unregistered"
    if not st.alive:
        return "dead"
    if st.draining:
        return "draining"
    return "serving" if st.serving else "up"


def _row(host: str, st: Any) -> tuple[str, ...]:
    if not st.known:
        return (host, st.instance, "", state(st), *("",) * 9)
    beat = "" if st.heartbeat_age_s is None else f"{st.heartbeat_age_s:.1f}s"
    kv = f"{st.free_blocks}/{st.total_blocks}" if st.total_blocks else ""
    cached = " ".join(f"{tier}={n}" for tier, n in st.cached_blocks.items())
    clock = "" if st.clock_offset_s is None else f"{st.clock_offset_s:+.1f}s"  # its wall clock against the router's
    return (host, st.instance, st.role, state(st), str(st.pid), str(st.restarts), str(st.held),
            f"{st.running}/{st.waiting}", kv, f"{st.tokens_per_s:.0f}", beat, clock, cached)


def table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows)
