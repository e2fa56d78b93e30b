"""The supervisor's expert-parallel groups, with real child processes (a small Python command stands in for
each service): a rank's exit stops and restarts its whole group and nothing else, a rank that ignores
SIGTERM is killed when its group's grace ends, every exit is reported once, shutdown stops rank 0 before
its followers, and each rank is one share of the cores.

No timing assertions: every wait is bounded only so that a regression fails instead of hanging."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from deepinfer.launch import supervisor as supervisor_module
from deepinfer.launch.supervisor import Child, Supervisor, thread_shares
from deepinfer.launch.topology import Topology, TopologyError

# Each child: on SIGTERM write its name to the log and exit 0, unless its name is in STUBBORN (then it
# ignores SIGTERM); otherwise wait forever. It says it is ready (pid in NAME.ready) once its handler is set.
CHILD = """
import os, signal, sys, time
name, stubborn, log = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
def on_term(*_):
    with open(log, "a") as f:
        f.write(name + "\\n")
    os._exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN if name in stubborn else on_term)
with open(os.path.join(os.path.dirname(log), name + ".ready"), "a") as f:
    f.write(f"{os.getpid()}\\n")
while True:
    time.sleep(60)
"""


class StandInSupervisor(Supervisor):
    """Children run CHILD instead of a service: no model, no sockets."""

    stubborn: tuple[str, ...] = ()

    def command(self, c: Child) -> list[str]:
        return [sys.executable, "-c", CHILD, c.name, ",".join(self.stubborn), str(self.log_dir / "terms.log")]


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        time.sleep(0.05)


@pytest.fixture
def group_topology(tmp_path: Path) -> Path:
    """A co-located worker of 3 ranks (plus router and tokenizer: groups of one; no cache daemon, which a
    group may use but these tests of ranks as children do not need)."""
    path = tmp_path / "topology.toml"
    path.write_text(Topology.local("smollm2", "ipc", tmp_path, disaggregated=False, ep=3, kvcache=False).to_toml())
    return path


@pytest.fixture
def sup(group_topology: Path, tmp_path: Path) -> Iterator[StandInSupervisor]:
    reports: list[tuple[str, str, int, int]] = []
    s = StandInSupervisor(group_topology, log_dir=tmp_path, on_exit=lambda *r: reports.append(r))
    s.reports = reports  # type: ignore[attr-defined]
    yield s
    s.stop(timeout_s=30)


def start(s: Supervisor) -> None:
    """Start every child and wait until each has its SIGTERM handler (a signal before would kill it)."""
    s.start()

    def ready(c: Child) -> bool:
        path = s.log_dir / f"{c.name}.ready"
        return path.exists() and str(c.proc.pid) in path.read_text().split()

    wait_until(lambda: all(ready(c) for c in s.children), 60, "every child ready")


def pids(s: Supervisor) -> dict[str, int]:
    return {c.name: c.proc.pid for c in s.children if c.proc is not None}


def test_a_group_is_one_child_per_rank_running_the_same_worker(sup):
    assert [c.name for c in sup.children] == ["router", "tokenizer-0", "worker-0", "worker-0.rank1", "worker-0.rank2"]
    ranks = [c for c in sup.children if c.role == "worker"]
    assert [(c.service, c.rank) for c in ranks] == [("worker-0", 0), ("worker-0", 1), ("worker-0", 2)]
    commands = [Supervisor.command(sup, c) for c in ranks]
    assert commands[0][-2:] == ["--name", "worker-0"]  # rank 0 starts as any worker does
    assert commands[2][-4:] == ["--name", "worker-0", "--rank", "2"]
    assert sup.group("worker-0.rank1").members == ranks


def test_every_rank_is_one_share_of_the_cores(tmp_path):
    topo = Topology.local("smollm2", "ipc", tmp_path, ep=2)  # prefill and decode, 2 ranks each: 4 shares
    assert thread_shares(topo, cores=9) == {"prefill-0": 2, "decode-0": 2}  # 8 spare cores
    assert thread_shares(topo, cores=2) == {"prefill-0": 1, "decode-0": 1}  # never below one
    assert thread_shares(Topology.local("smollm2", "ipc", tmp_path), cores=9) == {"prefill-0": 4, "decode-0": 4}
    pinned = Topology.local("smollm2", "ipc", tmp_path, ep=2, threads=6)  # the worker's: shared by its ranks
    assert thread_shares(pinned, cores=9) == {"prefill-0": 3, "decode-0": 3}
    assert thread_shares(Topology.local("smollm2", "ipc", tmp_path, ep=4, threads=2)) == {"prefill-0": 1,
                                                                                          "decode-0": 1}


def test_a_dead_rank_restarts_its_whole_group_and_nothing_else(sup):
    start(sup)
    before = pids(sup)
    sup.child("worker-0.rank1").proc.kill()

    def restarted() -> bool:
        sup.poll()
        return all(c.restarts == 1 for c in sup.group("worker-0").members)

    wait_until(restarted, 60, "the group restarted")
    after = pids(sup)
    ranks = ["worker-0", "worker-0.rank1", "worker-0.rank2"]
    assert all(after[n] != before[n] for n in ranks)
    assert all(after[n] == before[n] and sup.child(n).restarts == 0 for n in after if n not in ranks)
    # Each old rank's exit reported once, naming its own process; the others were asked to stop (exit 0).
    reported = {(name, pid): code for name, _, pid, code in sup.reports}
    assert len(sup.reports) == len(reported) == 3
    assert reported == {("worker-0", before["worker-0"]): 0, ("worker-0.rank1", before["worker-0.rank1"]): -9,
                        ("worker-0.rank2", before["worker-0.rank2"]): 0}
    terms = (sup.log_dir / "terms.log").read_text().split()
    assert sorted(terms) == ["worker-0", "worker-0.rank2"]


def test_a_rank_deaf_to_sigterm_is_killed_when_the_grace_ends_and_only_then_the_group_restarts(
        group_topology, tmp_path, monkeypatch):
    monkeypatch.setattr(supervisor_module, "GROUP_STOP_GRACE_S", 3600.0)
    s = StandInSupervisor(group_topology, log_dir=tmp_path)
    s.stubborn = ("worker-0",)
    start(s)
    try:
        group = s.group("worker-0")
        stubborn = s.child("worker-0").proc
        s.child("worker-0.rank2").proc.kill()
        # Past the backoff, rank 1 stopped, rank 0 still up (SIGTERM ignored): no rank starts again yet.
        wait_until(lambda: s.poll() == [] and group.next_start < time.monotonic()
                   and s.child("worker-0.rank1").proc.poll() is not None, 60, "rank 1 stopped, backoff passed")
        assert stubborn.poll() is None and all(c.restarts == 0 for c in group.members)
        group.kill_at = time.monotonic()  # the grace ends
        wait_until(lambda: bool(s.poll()), 60, "the group restarted")
        assert stubborn.returncode == -signal.SIGKILL
        assert all(c.restarts == 1 and c.proc.poll() is None for c in group.members)
    finally:
        s.stop(timeout_s=2)  # the new rank 0 ignores SIGTERM too: killed after this


def test_shutdown_stops_rank_0_before_its_followers(sup):
    start(sup)
    sup.stop(timeout_s=30)
    assert all(c.proc.poll() is not None for c in sup.children)
    terms = (sup.log_dir / "terms.log").read_text().split()
    assert terms.index("worker-0") < terms.index("worker-0.rank1") and terms.index("worker-0") < terms.index(
        "worker-0.rank2")
    assert terms[0] == "router" and sup.reports == []  # exits stop() causes are not reported


def test_a_service_named_like_a_follower_rank_is_refused(tmp_path):
    topo = Topology.local("smollm2", "ipc", tmp_path, disaggregated=False, ep=2)
    clash = topo.workers[0].__class__("worker-0.rank1", "worker", f"ipc://{tmp_path}/x.sock")
    path = tmp_path / "t.toml"
    path.write_text(Topology(topo.model, topo.frontend, topo.backend, topo.tokenizers, (*topo.workers, clash),
                             kvcaches=topo.kvcaches).to_toml())
    with pytest.raises(TopologyError, match="child names must be unique"):
        Supervisor(path)
