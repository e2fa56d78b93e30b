"""Shutdown with real processes and sockets: children never outlive the launcher (parent-death signal and
lifeline pipe), SIGTERM stops a service whose router is gone within its drain timeout, `up` leaves no run
directory behind, and the supervisor reports each child exit once.

No performance assertions: every wait is bounded only so that a regression fails instead of hanging; a wait
for a drain is bounded by the drain timeout the test configures plus a stated allowance (EXIT_ALLOWANCE_S,
IN_PROCESS_ALLOWANCE_S), so a drain that overruns its deadline fails."""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from deepinfer.launch.supervisor import LIFELINE_ENV, Child, Supervisor, watch_lifeline
from deepinfer.launch.topology import Topology
from deepinfer.protocol import messages as m
from deepinfer.protocol.sockets import arecv_routed, asend_msg, make_router
from deepinfer.services.base import DRAIN_TIMEOUT_S, Service

# A drain ends by its timeout; the allowances are only for what the timeout does not cover, on a loaded 2-core
# CI machine: a process's exit after its drain (interpreter and torch teardown, a few seconds there) and, in
# process, the event loop's scheduling. A drain that ran past its deadline by more than that fails.
EXIT_ALLOWANCE_S = 15.0
IN_PROCESS_ALLOWANCE_S = 5.0
EXIT_BOUND_S = DRAIN_TIMEOUT_S + EXIT_ALLOWANCE_S  # a process told to drain (DRAIN_TIMEOUT_S) has exited
TEST_DRAIN_S = 5.0  # the drain timeout the in-process tests give
TEST_DRAIN_BOUND_S = TEST_DRAIN_S + IN_PROCESS_ALLOWANCE_S


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        time.sleep(0.1)


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper has exited: it holds no memory and serves nothing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def child_pids(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


def launch(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "deepinfer.launch.cli", "--log-level", "info", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def lines_of(stream: object) -> queue.Queue[str]:
    """The lines of a pipe, read on a thread (so the reader never blocks the test on a silent process)."""
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for line in stream:  # type: ignore[attr-defined]
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def wait_for_line(lines: queue.Queue[str], needle: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no line with {needle!r} within {timeout_s}s") from None
        if needle in line:
            return line


# -- the supervisor's exit hook ---------------------------------------------------------------------------------


class FailingSupervisor(Supervisor):
    """Every child exits at once with code 3: no model, no sockets."""

    def command(self, c: Child) -> list[str]:
        return [sys.executable, "-c", "raise SystemExit(3)"]


def test_supervisor_reports_each_child_exit_once(tmp_path):
    path = tmp_path / "topology.toml"
    path.write_text(Topology.local("smollm2", "ipc", tmp_path).to_toml())
    reports: list[tuple[str, str, int]] = []

    pids: list[int] = []

    def on_exit(name: str, role: str, pid: int, code: int) -> None:
        reports.append((name, role, code))
        pids.append(pid)
        if len(reports) == 1:
            raise RuntimeError("a broken observer")  # logged; restarts go on

    sup = FailingSupervisor(path, on_exit=on_exit)
    sup.start()
    try:
        def every_child_restarted_and_exited_again() -> bool:
            sup.poll()
            return all(sum(r[0] == c.name for r in reports) >= 2 for c in sup.children)

        wait_until(every_child_restarted_and_exited_again, 120, "two exits of every child reported")
    finally:
        sup.stop()
    roles = {c.name: c.role for c in sup.children}
    assert {(n, r) for n, r, _ in reports} == set(roles.items())
    assert all(code == 3 and roles[name] == role for name, role, code in reports)
    assert len(set(pids)) == len(pids)  # each report names the process that exited
    for c in sup.children:  # once per exit: never more reports than processes started
        assert sum(r[0] == c.name for r in reports) <= c.restarts + 1


# -- the lifeline pipe ------------------------------------------------------------------------------------------


def test_lifeline_calls_on_lost_once_at_eof(monkeypatch):
    read_end, write_end = os.pipe()
    monkeypatch.setenv(LIFELINE_ENV, str(read_end))

    async def main() -> int:
        lost = asyncio.Event()
        calls = []
        assert watch_lifeline(asyncio.get_running_loop(), lambda: (calls.append(1), lost.set()))
        assert LIFELINE_ENV not in os.environ  # not passed on to anything this process starts
        await asyncio.sleep(0.2)
        assert not lost.is_set()  # the write end is still open
        os.close(write_end)
        await asyncio.wait_for(lost.wait(), 30)
        await asyncio.sleep(0.2)  # EOF stays readable: it must not call again
        return len(calls)

    assert asyncio.run(main()) == 1


def test_no_lifeline_outside_a_supervisor(monkeypatch):
    monkeypatch.delenv(LIFELINE_ENV, raising=False)
    loop = asyncio.new_event_loop()
    try:
        assert not watch_lifeline(loop, lambda: None)
    finally:
        loop.close()


LIFELINE_CHILD = """
import asyncio
from deepinfer.launch.supervisor import watch_lifeline

async def main():
    lost = asyncio.Event()
    assert watch_lifeline(asyncio.get_running_loop(), lost.set)
    await lost.wait()

asyncio.run(main())
"""

LAUNCHER = """
import sys, threading, time
from pathlib import Path
from deepinfer.launch.supervisor import Supervisor

class LifelineOnly(Supervisor):
    def command(self, c):
        return [sys.executable, "-c", sys.argv[2]]

sup = LifelineOnly(Path(sys.argv[1]))
# Spawned off the main thread: no parent-death signal, so only the lifeline pipe can stop the children.
spawner = threading.Thread(target=sup.start)
spawner.start()
spawner.join()
print("pids", *(c.proc.pid for c in sup.children), flush=True)
time.sleep(600)
"""


def test_children_stop_through_the_lifeline_alone_when_the_launcher_is_killed(tmp_path):
    path = tmp_path / "topology.toml"
    path.write_text(Topology.local("smollm2", "ipc", tmp_path).to_toml())
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(path), LIFELINE_CHILD], stdout=subprocess.PIPE,
                                text=True)
    try:
        pids = [int(p) for p in wait_for_line(lines_of(launcher.stdout), "pids", 60).split()[1:]]
        assert len(pids) == 5
        time.sleep(1.0)  # let them start watching (a child that is not watching yet sees EOF when it starts)
        assert all(alive(p) for p in pids)  # the launcher's thread that spawned them is gone: no signal came
    finally:
        launcher.kill()
        launcher.wait()
    wait_until(lambda: not any(alive(p) for p in pids), 60, "every child stopped after its launcher died")


# -- draining with the router gone --------------------------------------------------------------------------------


async def serve_bare_service(tmp_path: Path) -> tuple[Service, asyncio.Task[None], object]:
    """A plain Service welcomed by a stand-in router (a bound ROUTER socket), which is then closed."""
    ctx = zmq.asyncio.Context()
    endpoint = f"ipc://{tmp_path}/backend.sock"
    router = make_router(ctx, endpoint)
    service = Service("probe", endpoint, ctx)
    ready = asyncio.Event()
    task = asyncio.create_task(service.run(ready))
    ident, hello = await asyncio.wait_for(arecv_routed(router), 30)
    assert isinstance(hello, m.Hello)
    await asend_msg(router, m.Welcome(m.PROTOCOL_VERSION, True, "", "router", "router"), ident)
    await asyncio.wait_for(ready.wait(), 30)
    router.close(linger=0)  # the router is gone
    return service, task, ctx


def fill_send_queue(sock: zmq.asyncio.Socket) -> None:
    """Queue messages until a send would block, and stays blocked once the socket has noticed its peer is
    gone (until then its I/O thread may still move queued messages out): a plain send now waits forever."""
    view = zmq.Socket.shadow(sock.underlying)  # a blocking view, to see EAGAIN at once
    for _ in range(100):
        sent = 0
        while True:
            try:
                view.send(b"filler", flags=zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                break
        if sent == 0:
            return
        time.sleep(0.2)
    raise AssertionError("the send queue never stayed full")


def test_drain_ends_although_the_router_is_gone_and_the_send_queue_is_full(tmp_path):
    async def main() -> None:
        service, task, ctx = await serve_bare_service(tmp_path)
        fill_send_queue(service.router)  # as minutes of heartbeats to a dead router do
        service.drain(timeout_s=TEST_DRAIN_S)
        await asyncio.wait_for(task, TEST_DRAIN_BOUND_S)  # raises TimeoutError if the drain waits for the router
        assert service._stopping.is_set()
        ctx.destroy(linger=0)

    asyncio.run(main())


def test_drain_before_the_router_ever_answered_stops_the_service(tmp_path):
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        service = Service("probe", f"ipc://{tmp_path}/nobody.sock", ctx)
        task = asyncio.create_task(service.run())
        await asyncio.sleep(0.5)  # saying Hello to nobody
        service.drain(timeout_s=TEST_DRAIN_S)
        await asyncio.wait_for(task, TEST_DRAIN_BOUND_S)  # returns, not the handshake's TimeoutError
        ctx.destroy(linger=0)

    asyncio.run(main())


@pytest.mark.smollm2
def test_sigterm_stops_every_service_whose_router_was_killed(smollm2_path, tmp_path):
    topo = Topology.local(str(smollm2_path), "ipc", tmp_path, disaggregated=False, threads=1, kv_cache_mb=64)
    path = tmp_path / "topology.toml"
    path.write_text(topo.to_toml())
    sup = Supervisor(path, log_dir=tmp_path)
    sup.start()
    try:
        sup.wait_ready(timeout_s=300)
        router = sup.child("router").proc
        router.kill()
        router.wait()
        others = [c for c in sup.children if c.role != "router"]
        assert {c.role for c in others} == {"kvcache", "tokenizer", "worker"}
        for c in others:
            c.proc.send_signal(signal.SIGTERM)
        codes = {c.name: c.proc.wait(timeout=EXIT_BOUND_S) for c in others}
    finally:
        sup.stop(timeout_s=5)
    assert codes == {c.name: 0 for c in others}  # a drain that ends is a clean exit


# -- the launcher -------------------------------------------------------------------------------------------------


@pytest.mark.smollm2
def test_launcher_killed_mid_shutdown_leaves_no_process(smollm2_path, tmp_path):
    proc = launch("up", "--model", str(smollm2_path), "--colocated", "--threads", "1", "--kv-cache-mb", "64",
                  "--run-dir", str(tmp_path / "run"))
    stderr = lines_of(proc.stderr)
    try:
        assert "ready" in proc.stdout.readline(), list(stderr.queue)
        children = child_pids(proc.pid)
        assert len(children) == 4  # router, cache daemon, tokenizer, worker
        proc.send_signal(signal.SIGTERM)
        wait_for_line(stderr, "stopping", 60)
    finally:
        proc.kill()
        proc.wait()
    wait_until(lambda: not any(alive(p) for p in children), EXIT_BOUND_S, "every child of the killed launcher gone")


@pytest.mark.smollm2
def test_up_removes_its_run_directory_and_keeps_the_logs_asked_for(smollm2_path, tmp_path):
    # The temporary directory `up` makes its run directory in; short, as socket paths are limited to ~107 bytes.
    with tempfile.TemporaryDirectory(prefix="di-") as tmp:
        proc = launch("up", "--model", str(smollm2_path), "--colocated", "--no-kvcache", "--threads", "1",
                      "--kv-cache-mb", "64", "--log-dir", str(tmp_path / "logs"), env=dict(os.environ, TMPDIR=tmp))
        stderr = lines_of(proc.stderr)
        try:
            assert "ready" in proc.stdout.readline(), list(stderr.queue)
            endpoint = proc.stdout.readline().strip()
            run_dir = Path(endpoint.removeprefix("ipc://")).parent
            assert run_dir.parent == Path(tmp) and (run_dir / "topology.toml").exists()
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=EXIT_BOUND_S)
        assert code == 0
        assert list(Path(tmp).iterdir()) == []  # sockets, generated topology: all gone
    assert {p.name for p in (tmp_path / "logs").iterdir()} == {"router.log", "tokenizer-0.log", "worker-0.log"}


SIGTERM_WHILE_BUILDING = textwrap.dedent("""
    import os, signal, sys
    from deepinfer.launch import mesh
    from deepinfer.launch.topology import Topology

    built = mesh.build_service

    def build_after_a_sigterm(*args, **kwargs):  # the signal lands while the service is still being built
        os.kill(os.getpid(), signal.SIGTERM)
        return built(*args, **kwargs)

    mesh.build_service = build_after_a_sigterm
    mesh.run_service(Topology.local("unused", "ipc", sys.argv[1]), "router", "router")
    print("returned")
""")


def test_a_sigterm_during_start_up_drains_the_service_once_built(tmp_path):
    """systemd or the supervisor may stop a service before it has finished starting (imports, model load): the
    signal is kept and drains the service as soon as it exists, a clean exit, not death by the default action."""
    out = subprocess.run([sys.executable, "-c", SIGTERM_WHILE_BUILDING, str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "returned" in out.stdout and "draining" in out.stderr + out.stdout, out.stderr
