"""deepinfer-launch up: build a topology (or read one), start its services under the supervisor on this host,
announce the client endpoint and serve until SIGINT/SIGTERM, then leave nothing behind."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from deepinfer.config.engine import DEFAULT_KV_CACHE_MB
from deepinfer.launch.cli_options import (
    INSECURE_HELP,
    check_listen,
    check_weights_for_model,
    numerics,
    numerics_options,
    refuse_unsecured,
    speculation,
    speculation_options,
)
from deepinfer.launch.sections import DEFAULT_DISK_CACHE_MB, DEFAULT_HOST_CACHE_MB, DEFAULT_MODEL
from deepinfer.services.balancer_config import BALANCER_DEFAULTS


@click.command()
@click.option("--model", default=DEFAULT_MODEL, show_default=True)
@click.option("--topology", type=click.Path(exists=True, path_type=Path), default=None,
              help="A topology file; otherwise one of each service on this host.")
@click.option("--inproc", is_flag=True, help="Run every service as a task in this process.")
@click.option("--colocated", is_flag=True, help="One worker doing prefill and decode instead of a P/D pair.")
@click.option("--prefill", "num_prefill", type=click.IntRange(min=1), default=None,
              help="Prefill workers of a P/D layout (with --decode; either one asks for a pair, the other then 1).")
@click.option("--decode", "num_decode", type=click.IntRange(min=1), default=None,
              help="Decode workers of a P/D layout. Neither given (nor --colocated): chosen from the machine.")
@click.option("--tokenizers", "num_tokenizers", type=int, default=1, show_default=True)
@click.option("--threads", type=int, default=None,
              help="torch threads per worker, shared by the ranks of an --ep group (default: a share of the cores, "
                   "a share per rank).")
@click.option("--ep", type=click.IntRange(min=1), default=None,
              help="Expert parallelism: every worker is a group of N ranks, a process each (on CUDA rank R uses "
                   "cuda:R), rendezvousing on a free 127.0.0.1 port; a rank that dies restarts its group. "
                   "Default: 1.")
@click.option("--kv-cache-mb", type=int, default=DEFAULT_KV_CACHE_MB, show_default=True)
@click.option("--run-dir", type=click.Path(path_type=Path), default=None,
              help="Where ipc sockets, the topology and logs go (default: a new temporary directory, removed "
                   "at exit; in a directory given here only the sockets and generated topology are removed).")
@click.option("--log-dir", type=click.Path(path_type=Path), default=None,
              help="Where each service's log goes, kept after exit (default: the run directory).")
@click.option("--cache-dir", type=click.Path(path_type=Path), default=None,
              help="The disk tier of the KV cache (default: $DEEPINFER_KVCACHE_DIR or ~/.cache/deepinfer/kvcache).")
@click.option("--host-cache-mb", type=int, default=DEFAULT_HOST_CACHE_MB, show_default=True,
              help="DRAM tier of the KV cache.")
@click.option("--disk-cache-mb", type=int, default=DEFAULT_DISK_CACHE_MB, show_default=True,
              help="Disk tier of the KV cache.")
@click.option("--no-kvcache", is_flag=True, help="Run without a cache daemon (workers still reuse their own pool).")
@click.option("--no-prefix-caching", is_flag=True, help="No KV reuse at all: every prompt is computed in full.")
@click.option("--redundant-experts", type=click.IntRange(min=0), default=None,
              help="MoE with --ep: extra expert replicas per layer in each group's starting placement, the room the "
                   "expert balancer moves hot experts into. Default: max(1, experts // 8); 0: none.")
@click.option("--no-balancer", is_flag=True,
              help="No expert balancer. By default one runs when the workers are --ep groups of an MoE model.")
@click.option("--balancer-interval", type=click.FloatRange(min=0, min_open=True), default=None,
              help=f"Seconds between the expert balancer's looks at each group. "
                   f"Default: {BALANCER_DEFAULTS.interval_s}.")
@click.option("--balancer-window", type=click.FloatRange(min=0, min_open=True), default=None,
              help=f"Seconds of expert-load reports it weighs. Default: {BALANCER_DEFAULTS.window_s}.")
@click.option("--http", metavar="HOST:PORT", default=None, callback=check_listen,
              help="Also run an OpenAI-compatible HTTP gateway listening there (/v1/completions, "
                   "/v1/chat/completions, ...); its URL is printed when the mesh is ready. With --topology, "
                   "add a [[gateway]] table instead.")
@click.option("--insecure", is_flag=True, help=INSECURE_HELP)
@speculation_options
@numerics_options
def up(model: str, topology: Path | None, inproc: bool, colocated: bool, num_prefill: int | None,
       num_decode: int | None,
       num_tokenizers: int, threads: int | None, ep: int | None, kv_cache_mb: int, run_dir: Path | None,
       log_dir: Path | None, cache_dir: Path | None, host_cache_mb: int, disk_cache_mb: int, no_kvcache: bool,
       no_prefix_caching: bool, redundant_experts: int | None, no_balancer: bool, balancer_interval: float | None,
       balancer_window: float | None, http: str | None, insecure: bool, speculative: str | None,
       num_speculative_tokens: int, no_adaptive_speculation: bool, weights: str | None,
       kv_cache_dtype: str | None) -> None:
    """Start the mesh on this host, print the client endpoint, and serve until SIGINT/SIGTERM.
    Without --colocated or --prefill/--decode the layout is chosen from the machine (`launch.layout`), said on
    stderr as `up` starts. With --topology, every worker option (the layout, speculation, --ep and the expert
    balancer's too) comes from the file, per worker (and its [balancer] table)."""
    from deepinfer.launch.layout import LayoutConflict, choose_layout, machine_facts
    from deepinfer.launch.topology import Topology

    balancing = (redundant_experts, "--redundant-experts", "`redundant_experts`"), \
        (balancer_interval, "--balancer-interval", "[balancer] interval_s"), \
        (balancer_window, "--balancer-window", "[balancer] window_s"), \
        (no_balancer or None, "--no-balancer", "a [balancer] table, or none")
    layout_flags = (colocated or None, "--colocated", "the [[worker]] tables"), \
        (num_prefill, "--prefill", "the [[worker]] tables"), (num_decode, "--decode", "the [[worker]] tables")
    for given, option, key in ((speculative, "--speculative", "`speculative`"), (ep, "--ep", "`ep` and `ep_master`"),
                               (weights, "--weights", "`weights`"), (kv_cache_dtype, "--kv-cache-dtype",
                                                                     "`kv_cache_dtype` at the top level"),
                               *balancing, *layout_flags):
        if topology is not None and given is not None:  # it would be silently ignored
            raise click.UsageError(f"{option} configures the workers `up` builds; with --topology, set {key} "
                                   f"per worker in the file")
    if topology is not None and http is not None:
        raise click.UsageError("--http adds a gateway to the topology `up` builds; with --topology, add a "
                               "[[gateway]] table (name, listen) to the file")
    if inproc and http is not None:
        raise click.UsageError("--http runs the gateway as a process of its own under the supervisor: drop --inproc")
    if inproc and (ep or 1) > 1:
        raise click.UsageError("--inproc runs every service in this process, and an --ep group needs a process "
                               "per rank: drop --inproc")
    try:
        layout = choose_layout(machine_facts(), colocated, num_prefill, num_decode)
    except LayoutConflict as exc:
        raise click.UsageError(str(exc)) from None
    given = None if topology is None or inproc else Topology.load(topology)  # (--inproc builds its own)
    if topology is None:
        check_weights_for_model(model, weights)
    elif given is not None:
        refuse_unsecured(given, insecure)  # fail closed, before anything is made or started
    temporary = run_dir is None  # made here: removed whole at exit
    run_dir = run_dir or Path(tempfile.mkdtemp(prefix="deepinfer-run-"))  # (mode 0700)
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    from deepinfer.launch.supervisor import UnsafeRunDir, check_ipc_dirs, check_private_dir

    try:  # an existing --run-dir is reused only if private (it is not silently repaired)
        check_private_dir(run_dir)
        if topology is not None:
            check_ipc_dirs(Topology.load(topology))
    except UnsafeRunDir as e:
        raise click.ClickException(str(e)) from None
    cache = dict(kvcache=not (no_kvcache or no_prefix_caching), cache_dir=cache_dir, host_cache_mb=host_cache_mb,
                 disk_cache_mb=disk_cache_mb, prefix_caching=not no_prefix_caching)
    spec_kw = speculation(speculative, num_speculative_tokens, no_adaptive_speculation)
    local = dict(disaggregated=layout.disaggregated, num_prefill=layout.num_prefill, num_decode=layout.num_decode,
                 num_tokenizers=num_tokenizers, threads=threads, kv_cache_mb=kv_cache_mb, **cache, **spec_kw,
                 **numerics(weights, kv_cache_dtype))
    made: list[Path] = []  # what this run put in a run directory the user gave (removed at exit; logs stay)
    try:
        if inproc:
            from deepinfer.launch.mesh import serve_inproc

            topo = Topology.local(model, "inproc", **local)
            topo = dataclasses.replace(topo, frontend=f"ipc://{run_dir}/router-frontend.sock")
            made += _ipc_paths(topo, run_dir)
            _say_layout(topo, layout.reason, threads=False)
            serve_inproc(topo, on_ready=lambda: _announce(topo.frontend))
            return
        if topology is None:
            topology = run_dir / "topology.toml"
            made.append(topology)
            balancer = expert_balancer(model, ep or 1, no_balancer, balancer_interval, balancer_window)
            topology.write_text(Topology.local(model, "ipc", run_dir, ep=ep or 1, redundant_experts=redundant_experts,
                                               balancer=balancer, http=http, **local).to_toml())
        elif given is not None and insecure and not given.insecure and given.unsecured_endpoints():
            topology = _accepted_insecure(given, run_dir)  # the children read the operator's --insecure in it
            made.append(topology)
        supervised = Topology.load(topology)
        made += _ipc_paths(supervised, run_dir)
        _say_layout(supervised, layout.reason if given is None else f"the topology file {topology}")
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
        logs = f"logs in {log_dir or run_dir}" + (" until exit" if temporary and log_dir is None else "")
        _share_metrics_dir(run_dir / "metrics")
        _supervise(topology, log_dir or run_dir, logs)
    finally:
        _remove_run_files(run_dir, temporary, made)


def expert_balancer(model: str, ep: int, off: bool, interval_s: float | None,
                    window_s: float | None) -> Any:
    """The `[balancer]` settings `up` gives its topology: a BalancerConfig when the workers are expert-parallel
    groups (ep > 1) of an MoE model (its config says so) and `off` is not set, else None."""
    if off or ep <= 1:
        return None
    from deepinfer.loading.fetch import resolve_model
    from deepinfer.loading.identity import model_config_at

    if model_config_at(resolve_model(model)).moe is None:
        return None  # a dense model has no experts to balance
    given = {k: v for k, v in (("interval_s", interval_s), ("window_s", window_s)) if v is not None}
    return dataclasses.replace(BALANCER_DEFAULTS, **given)


def _say_layout(topology: Any, why: str, threads: bool = True) -> None:
    """One line on stderr as `up` starts: the workers it runs (with their threads, when each is a process the
    supervisor gives a share of the cores) and why. Stdout keeps the lines scripts read (`_announce`)."""
    from collections import Counter

    from deepinfer.launch.supervisor import thread_shares

    kinds = {"worker": "co-located", "prefill": "prefill", "decode": "decode"}
    roles = Counter(kinds.get(w.role, w.role) for w in topology.workers)
    workers = " + ".join(f"{n} {role}" for role, n in roles.items())
    workers += f" worker{'s' if len(topology.workers) != 1 else ''}"
    if threads and topology.workers:
        shares = sorted(set(thread_shares(topology).values()))
        workers += f", {'/'.join(map(str, shares))} thread{'s' if shares != [1] else ''} each"
    click.echo(f"layout: {workers}: {why}", err=True)


def _share_metrics_dir(metrics_dir: Path) -> None:
    """Every child `up` starts writes its metrics samples to `metrics_dir` (in the run directory: emptied now;
    a temporary run directory goes at exit with it, one the user gave keeps it), which gateways export."""
    import os

    from deepinfer.metrics import MULTIPROC_ENV, prepare_dir

    prepare_dir(metrics_dir)
    os.environ[MULTIPROC_ENV] = str(metrics_dir)  # the children inherit it; process_exited reads it here


def _supervise(topology: Path, log_dir: Path, logs: str) -> None:
    """Start the supervisor's children and keep them up until SIGINT/SIGTERM, then drain and stop them."""
    from deepinfer.launch.exit_notes import ExitNotifier
    from deepinfer.launch.keys import supervisor_auth
    from deepinfer.launch.supervisor import Supervisor, gateway_url

    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    sup = Supervisor(topology, log_dir=log_dir)
    sup.on_exit = notes = ExitNotifier(sup.topology.backend, supervisor_auth(sup.topology))
    sup.start()
    try:
        sup.wait_ready(lambda: stopping)
        if not stopping:
            _announce(sup.topology.frontend, logs, [gateway_url(g.listen) for g in sup.topology.gateways])
        while not stopping:
            sup.poll()
            time.sleep(0.2)
    finally:
        sup.stop()
        notes.close()


def _accepted_insecure(topology: Any, run_dir: Path) -> Path:
    """`topology` written to the run directory saying `insecure = true`: what `up --insecure` supervises, so
    each service it starts (`service --topology COPY`) finds the operator's decision in its file."""
    copy = run_dir / "topology-insecure.toml"
    copy.write_text(dataclasses.replace(topology, insecure=True).to_toml())
    return copy


def _ipc_paths(topology: Any, run_dir: Path) -> list[Path]:
    """The ipc:// socket files of a topology that lie in `run_dir`."""
    endpoints = [topology.frontend, topology.backend, *(t.detok for t in topology.tokenizers),
                 *(w.kv for w in topology.workers), *(k.endpoint for k in topology.kvcaches)]
    paths = [Path(e.removeprefix("ipc://")) for e in endpoints if e.startswith("ipc://")]
    return [p for p in paths if p.parent.resolve() == run_dir.resolve()]


def _remove_run_files(run_dir: Path, temporary: bool, made: list[Path]) -> None:
    """`up` leaves nothing behind: a temporary run directory goes whole (its logs too: --log-dir keeps
    them); from a directory the user gave, only the sockets and topology this run made (its logs stay).
    A launcher killed with SIGKILL cannot do this; its directory stays."""
    if temporary:
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    for path in made:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _announce(endpoint: str, extra: str = "", urls: list[str] | None = None) -> None:
    """Two lines (what scripts read: the second is the endpoint), then one per HTTP gateway: its base URL."""
    click.echo(f"deepinfer mesh ready; client endpoint: {endpoint}" + (f" ({extra})" if extra else ""))
    click.echo(endpoint)
    for url in urls or []:
        click.echo(f"OpenAI-compatible HTTP API: {url}/v1")
    sys.stdout.flush()
