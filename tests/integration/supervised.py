"""A mesh of real processes (one per service over ipc://) under the supervisor, as `deepinfer-launch up` runs
it, for fault tests: dead children are restarted in the background while the test runs."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from deepinfer.launch.exit_notes import ExitNotifier
from deepinfer.launch.supervisor import Supervisor
from deepinfer.launch.topology import Topology


@contextmanager
def supervised_mesh(topo: Topology, run_dir: Path, poll_s: float = 0.2) -> Iterator[Supervisor]:
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
        threading.Thread(target=keep_alive, daemon=True).start()
        yield sup
    finally:
        stop.set()
        sup.stop()
        notes.close()
