"""A mesh of real processes (one per service over ipc://) under the supervisor, as `deepinfer-launch up` runs
it, for fault tests: dead children are restarted in the background while the test runs."""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from deepinfer.launch.exit_notes import ExitNotifier
from deepinfer.launch.supervisor import Supervisor
from deepinfer.launch.topology import Topology
from deepinfer.metrics.env import MULTIPROC_ENV, prepare_dir


@contextmanager
def supervised_mesh(topo: Topology, run_dir: Path, poll_s: float = 0.2, metrics: bool = False) -> Iterator[Supervisor]:
    """With `metrics`, as `up` does, every child writes its metrics samples to `<run_dir>/metrics` (read them
    with `metric`); the variable is set in this process too (the supervisor drops a dead child's live gauges)."""
    previous = os.environ.get(MULTIPROC_ENV)
    if metrics:
        prepare_dir(run_dir / "metrics")
        os.environ[MULTIPROC_ENV] = str(run_dir / "metrics")
    path = run_dir / "topology.toml"
    path.write_text(topo.to_toml())
    notes = ExitNotifier(topo.backend)  # as `up` does: the router hears of a dead child at once
    sup = Supervisor(path, log_dir=run_dir, on_exit=notes)
    sup.start()
    stop = threading.Event()

    def keep_alive() -> None:  # what `up` does: restart dead children
        while not stop.wait(poll_s):
            sup.poll()

    try:
        sup.wait_ready(timeout_s=300)
        wait_every_child_serving(sup, timeout_s=300)
        threading.Thread(target=keep_alive, daemon=True).start()
        yield sup
    finally:
        stop.set()
        sup.stop()
        notes.close()
        if metrics:
            if previous is None:
                os.environ.pop(MULTIPROC_ENV, None)
            else:
                os.environ[MULTIPROC_ENV] = previous


def wait_every_child_serving(sup: Supervisor, timeout_s: float) -> None:
    """`wait_ready` needs one path through the mesh; a fault test needs every service registered before its
    fault (on a loaded machine a second decode worker may still be loading its weights), or what it checks
    afterwards (e.g. that each service greets a restarted router) is about a service that never met the old
    one. A service logs "serving" once the router has welcomed it, once per incarnation (its log is appended
    to across restarts), so a restarted child counts once its new incarnation has said it too, and a dead one
not yet restarted does not count. A gateway,
    which is no mesh service, and a group's follower ranks, which meet the router through their leader, are
    left out."""
    services = [c for c in sup.children if c.role != "gateway" and c.rank == 0]
    deadline = time.monotonic() + timeout_s
    while True:
        waiting = [c.name for c in services if c.proc is None or c.proc.poll() is not None
                   or len(SERVING.findall((sup.log_dir / f"{c.name}.log").read_text())) < c.restarts + 1]
        if not waiting:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"not serving after {timeout_s}s: {waiting}")
        time.sleep(0.2)


SERVING = re.compile(r"\] serving\b")  # the event itself, not a longer message that mentions serving


def metric(run_dir: Path, name: str, **labels: str) -> float | None:
    """A sample of a `supervised_mesh(metrics=True)`'s directory by name and labels, e.g. the live gauge
    ("deepinfer_num_requests_running", instance="worker-0"; refreshed at the instance's heartbeat rate) or a
    counter ("deepinfer_router_events_total", event="moves"); None before any process wrote it."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(run_dir / "metrics"))
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None
