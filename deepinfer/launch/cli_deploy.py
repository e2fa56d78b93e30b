"""deepinfer-launch service, systemd, metrics and keys: the commands that deploy a topology across hosts by
hand or under systemd (one service, its units, a host's metrics endpoint, its CURVE keys)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import click

from deepinfer.launch.cli_options import INSECURE_HELP, check_listen, refuse_unsecured


@click.command()
@click.argument("role", type=click.Choice(["router", "tokenizer", "worker", "kvcache", "balancer", "gateway"]))
@click.option("--topology", type=click.Path(exists=True, path_type=Path), required=True)
@click.option("--name", default=None, help="The service's name in the topology.")
@click.option("--index", type=int, default=None, help="Or its position among the topology's services of ROLE.")
@click.option("--rank", type=int, default=0, show_default=True,
              help="An expert-parallel worker's rank in [0, ep): 0 speaks for the group to the mesh, 1..ep-1 "
                   "follow it (engine only).")
@click.option("--insecure", is_flag=True, help=INSECURE_HELP)
def service(role: str, topology: Path, name: str | None, index: int | None, rank: int, insecure: bool) -> None:
    """Run one service of a topology (what a systemd unit runs)."""
    from deepinfer.launch.supervisor import UnsafeRunDir, check_ipc_dirs
    from deepinfer.launch.topology import Topology, TopologyError

    topo = Topology.load(topology)
    try:
        check_ipc_dirs(topo)  # as up does: a unit or a hand-started service binds only where others cannot reach
    except UnsafeRunDir as exc:
        raise click.ClickException(str(exc)) from None
    if name is None:
        names = {"router": ["router"], "tokenizer": [t.name for t in topo.tokenizers],
                 "worker": [w.name for w in topo.workers], "kvcache": [k.name for k in topo.kvcaches],
                 "balancer": ["balancer"] if topo.balancer is not None else [],
                 "gateway": [g.name for g in topo.gateways]}[role]
        if index is None or not 0 <= index < len(names):
            raise click.UsageError(f"give --name or --index in [0, {len(names)}) for {role}")
        name = names[index]
    if rank != 0:
        if role != "worker":
            raise click.UsageError("--rank names a rank of an expert-parallel worker; a " + role + " has none")
        try:
            ep = topo.worker(name).ep
        except TopologyError as exc:
            raise click.UsageError(str(exc)) from None
        if not 0 < rank < ep:
            raise click.UsageError(f"--rank {rank}: worker {name} has ep = {ep}, so its ranks are 0..{ep - 1}")
    if role == "gateway":
        try:
            topo.gateway(name)
        except TopologyError as exc:
            raise click.UsageError(str(exc)) from None
    refuse_unsecured(topo, insecure)  # the command line is sound: now, is the mesh it joins safe to join?
    if rank != 0:
        from deepinfer.launch.mesh import engine_config
        from deepinfer.services.group.follower import run_follower  # torch.distributed: only in a follower

        config = engine_config(topo.worker(name), topo.block_size, rank, topo.kv_cache_dtype)
        sys.exit(run_follower(topo, name, rank, config))
    if role == "gateway":
        from deepinfer.launch.gateway_process import run_gateway

        run_gateway(topo, name)
        return
    from deepinfer.launch.mesh import run_service

    run_service(topo, role, name)


@click.command()
@click.option("--topology", type=click.Path(exists=True, path_type=Path), required=True)
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Directory for the unit files.")
@click.option("--user", default="deepinfer", show_default=True,
              help="The (existing, unprivileged) user every unit runs as.")
@click.option("--host", default=None, metavar="ADDRESS",
              help="This machine's address in the topology: the target starts only the services bound there "
                   "(and the expert-parallel ranks its workers' rank_hosts put there).")
def systemd(topology: Path, out: Path, user: str, host: str | None) -> None:
    """Write systemd units for a topology (templates per role, a target that starts every instance, or with --host
    this host's). A topology with tcp:// endpoints needs [security], or `insecure = true` in the file (what every
    unit reads)."""
    from deepinfer.launch.systemd import write_units
    from deepinfer.launch.topology import Topology, TopologyError

    refuse_unsecured(Topology.load(topology), False, flag=None)  # the units would refuse to start

    try:
        written = write_units(topology, out, user=user, host=host)
    except TopologyError as exc:
        raise click.UsageError(str(exc)) from None
    for path in written:
        click.echo(str(path))


@click.command()
@click.option("--listen", default="0.0.0.0:9400", show_default=True, callback=check_listen, metavar="HOST:PORT")
@click.option("--dir", "directory", type=click.Path(path_type=Path), default=None,
              help="The host's metrics directory, where the services write their samples (default: "
                   "$PROMETHEUS_MULTIPROC_DIR; systemd units use /run/deepinfer/metrics).")
def metrics(listen: str, directory: Path | None) -> None:
    """Serve GET /metrics for a host that runs services but no HTTP gateway (a gateway serves the same text),
    until SIGINT/SIGTERM."""
    import os
    import threading

    from deepinfer.launch.sections import split_host_port
    from deepinfer.metrics import MULTIPROC_ENV, serve

    if directory is not None:
        os.environ[MULTIPROC_ENV] = str(directory)
    if not os.environ.get(MULTIPROC_ENV):
        raise click.UsageError(f"give --dir (or set {MULTIPROC_ENV}): the directory the services write to")
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with serve(*split_host_port(listen)) as server:
        click.echo(f"metrics on http://{listen.rpartition(':')[0]}:{server.port}/metrics")
        sys.stdout.flush()
        stop.wait()


@click.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--topology", type=click.Path(exists=True, path_type=Path), required=True)
def keys(directory: Path, topology: Path) -> None:
    """Make CURVE key pairs for a topology's services, the supervisor and a first client, in DIRECTORY (0700;
    existing keys are kept). Name it in the topology's [security] table: keys_dir = "DIRECTORY"."""
    from deepinfer.launch.keys import make_keys
    from deepinfer.launch.topology import Topology

    for path in make_keys(directory, Topology.load(topology)):
        click.echo(str(path))
