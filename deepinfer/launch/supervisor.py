"""A process supervisor for the one-host mesh: one child process per service, restarted with
exponential backoff when it dies, drained and stopped in order (HTTP gateways, router, workers, tokenizers,
the expert balancer and cache daemons). A child that exits 0 (drained: `deepinfer-launch drain`) is started
again too, so under `up` a drain is a graceful restart.

Each child is `python -m deepinfer.launch.cli service ROLE --topology F --name NAME`, the same command a
systemd unit runs. CPU threads are a budget: every worker gets its share of the host's cores (torch's
OpenMP threads spin while waiting, and oversubscribed they slow matmuls by orders of magnitude);
router, tokenizers, cache daemons, the expert balancer and HTTP gateways get one.

Metrics: children inherit the supervisor's environment, `PROMETHEUS_MULTIPROC_DIR` included (`up` sets it to
`<run dir>/metrics`, emptied first), so every process of the host writes its
samples there and a gateway's GET /metrics aggregates them; when a child exits its live gauges are dropped
(`metrics.process_exited`).

Children live in groups that die and restart together. A service is a group of one; an expert-parallel
worker (`ep = N`) is a group of N ranks: child NAME is rank 0 (started as any worker is), children
NAME.rank1 .. NAME.rank{N-1} its followers (`--rank R`), each rank one share of the cores. A collective
cannot go on without every rank, so when any rank exits the others are stopped (SIGTERM, SIGKILL after
GROUP_STOP_GRACE_S) and the whole group starts again once every rank is gone, after the group's backoff.

Children never outlive the supervisor's process, however it dies (even SIGKILL mid-shutdown), by two means:
* Linux: a parent-death signal (`prctl(PR_SET_PDEATHSIG, SIGTERM)`), set only for children spawned from the
  main thread, because the kernel sends it when the spawning *thread* exits, not the process;
* everywhere: a lifeline pipe. Every child inherits its read end (fd in `$DEEPINFER_LIFELINE_FD`); only the
  supervisor holds the write end, so the child reads EOF once the supervisor's process is gone
  (`watch_lifeline`, installed by `mesh.run_service`).
Either way the child drains as on SIGTERM, so it stops within its drain timeout.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import dataclasses
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from deepinfer.launch.topology import Topology, TopologyError
from deepinfer.launch.tuning import MALLOC_ENV
from deepinfer.services.balancer_config import BALANCER_NAME
from deepinfer.services.base import DRAIN_TIMEOUT_S

log = structlog.get_logger("deepinfer.supervisor")

LIFELINE_ENV = "DEEPINFER_LIFELINE_FD"
STOP_GRACE_S = 10.0  # a stopping child gets its drain timeout plus this before SIGKILL
# The rest of a broken group gets this long after SIGTERM before SIGKILL: it cannot finish its work
# without the rank that died, so a full drain would only delay the restart.
GROUP_STOP_GRACE_S = STOP_GRACE_S
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

# Called once per child exit seen by `Supervisor.poll`: (child name, role, pid, return code; negative = signal).
OnExit = Callable[[str, str, int, int], None]


def _load_prctl() -> Callable[..., int] | None:
    """libc's prctl, resolved once in the parent: the child between fork and exec should only call it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_prctl = _load_prctl()


def _die_with(launcher_pid: int) -> Callable[[], None]:
    """A `preexec_fn` (runs in the child between fork and exec) asking the kernel for SIGTERM when the
    parent goes. The parent may have died before the call took effect: then the child was already
    reparented, and it exits at once instead of starting an orphan."""

    def preexec() -> None:
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != launcher_pid:
            os._exit(1)

    return preexec


def watch_lifeline(loop: asyncio.AbstractEventLoop, on_lost: Callable[[], None]) -> bool:
    """In a supervised child: call `on_lost()` once the supervisor's process is gone (EOF on the lifeline
    pipe whose fd `$DEEPINFER_LIFELINE_FD` names). Returns False when this process has no lifeline (not
    started by a Supervisor). The variable is removed so nothing this process starts inherits it."""
    value = os.environ.pop(LIFELINE_ENV, None)
    if value is None:
        return False
    try:
        fd = int(value)
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            raise OSError(f"fd {fd} is not a pipe")
    except (ValueError, OSError) as exc:
        log.warning("no lifeline to the supervisor", fd=value, error=str(exc))
        return False

    def readable() -> None:
        try:
            if os.read(fd, 4096):
                return  # nobody writes to it; ignore anything that comes
        except BlockingIOError:
            return
        except OSError:
            pass
        loop.remove_reader(fd)  # EOF stays readable: stop watching, then act once
        os.close(fd)
        log.warning("the supervisor is gone: stopping")
        on_lost()

    os.set_blocking(fd, False)
    loop.add_reader(fd, readable)
    return True


@dataclass
class Child:
    role: str  # "router", "tokenizer", "worker", "kvcache", "balancer" or "gateway"
    name: str  # unique among the children: the service's name, NAME.rankR for an expert-parallel follower
    threads: int
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    service: str = ""  # its name in the topology (every rank of a group runs the group's); "" → name
    rank: int = 0  # > 0: an expert-parallel follower, started with --rank
    exit_seen: bool = False  # its current process's exit was reported (reset at every spawn)

    def __post_init__(self) -> None:
        self.service = self.service or self.name


@dataclass
class Group:
    """Children that live and die together: one service, or every rank of an expert-parallel worker.
    Invariant: `next_start == 0.0` exactly while the group is believed up; once a member is seen dead it
    is "breaking" until every member is gone and `next_start` has passed, then it starts whole."""

    members: list[Child]
    next_start: float = 0.0
    backoff_s: float = 0.5
    started_at: float = 0.0
    kill_at: float = 0.0  # while breaking: members still alive then get SIGKILL


def rank_child_name(service: str, rank: int) -> str:
    """A rank's child name, as logs and log files show it: rank 0 is the service itself."""
    return service if rank == 0 else f"{service}.rank{rank}"


def thread_shares(topology: Topology, cores: int | None = None) -> dict[str, int]:
    """Threads per rank of each worker (a plain worker is one rank): an equal share of the topology's
    `threads` for the worker (at least one), or else of the cores left after one core's worth for the router
    and tokenizers on hosts with more than two cores, every rank of a group counting as one share."""
    cores = cores or os.cpu_count() or 1
    ranks = sum(w.ep for w in topology.workers)
    spare = cores - 1 if cores > 2 else cores
    share = max(1, spare // max(1, ranks))
    return {w.name: max(1, w.threads // w.ep) if w.threads else share for w in topology.workers}


def _metrics_process_exited(pid: int) -> None:
    """Drop an exited child's live gauges from the host's metrics directory (a no-op without one)."""
    try:
        from deepinfer.metrics import process_exited

        process_exited(pid)
    except Exception:  # metrics never stop a restart
        log.exception("dropping an exited child's metrics failed", pid=pid)


class UnsafeRunDir(PermissionError):
    """A directory of ipc:// sockets that another user could reach into (and so connect to a service)."""


def check_private_dir(path: Path) -> None:
    """Refuse a directory (an existing `--run-dir`, or one a topology's ipc:// sockets lie in) that is not
    owned by this user or that group/others may access: the sockets in it are only as private as it is."""
    st = os.stat(path)
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.geteuid():
        raise UnsafeRunDir(f"{path}: the directory of ipc:// sockets is owned by uid {st.st_uid}, not this user "
                           f"({os.geteuid()}), mode {mode:o}; use a directory of your own with mode 0700")
    if mode & 0o077:
        raise UnsafeRunDir(f"{path}: the directory of ipc:// sockets has mode {mode:o}, so group/others may reach "
                           f"them; chmod 700 it")


def _strings(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [s for f in dataclasses.fields(value) for s in _strings(getattr(value, f.name))]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    return []


def ipc_dirs(topology: Topology) -> list[Path]:
    """The directories of every ipc:// endpoint a topology names, once each."""
    found = [Path(e.removeprefix("ipc://")).parent for e in _strings(topology) if e.startswith("ipc://")]
    return list(dict.fromkeys(found))


def check_ipc_dirs(topology: Topology) -> None:
    """`check_private_dir` on the directory of each ipc:// endpoint (one not there yet is left to the bind)."""
    for d in ipc_dirs(topology):
        if d.is_dir():
            check_private_dir(d)


class Supervisor:
    """Spawn, restart and stop the children. `on_exit(name, role, pid, returncode)` is called once for every
    child exit that `poll()` sees (not for the exits `stop()` causes), the ranks it stopped because their
    group broke included (rank 0's exit is what the router needs to hear), before any restart, so
    `child(name).proc` is still the process that exited; it runs on the polling thread and must not block.
    Call `start`/`poll` from a thread that lives as long as the children should (the main thread in `up`):
    only children spawned from the main thread get the parent-death signal, the others rely on the
    lifeline pipe."""

    MAX_BACKOFF_S = 8.0
    STABLE_AFTER_S = 30.0  # a group that ran this long resets its backoff

    def __init__(self, topology_path: Path, log_dir: Path | None = None, on_exit: OnExit | None = None) -> None:
        self.topology_path = topology_path
        self.topology = Topology.load(topology_path)
        self.log_dir = log_dir
        self.on_exit = on_exit
        self._lifeline: tuple[int, int] | None = None  # (read end for children, write end only we hold)
        shares = thread_shares(self.topology)
        self.groups = [Group([Child("router", "router", 1)])]
        self.groups += [Group([Child("kvcache", k.name, 1)]) for k in self.topology.kvcaches]
        self.groups += [Group([Child("tokenizer", t.name, 1)]) for t in self.topology.tokenizers]
        if self.topology.balancer is not None:
            self.groups.append(Group([Child("balancer", BALANCER_NAME, 1)]))
        self.groups += [Group([Child("worker", rank_child_name(w.name, r), shares[w.name], service=w.name, rank=r)
                               for r in range(w.ep)]) for w in self.topology.workers]
        self.groups += [Group([Child("gateway", g.name, 1)]) for g in self.topology.gateways]
        self.children = [c for g in self.groups for c in g.members]
        names = [c.name for c in self.children]
        if len(set(names)) != len(names):  # a service named like another's follower rank
            raise TopologyError(f"{topology_path}: child names must be unique: {names}")

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def group(self, name: str) -> Group:
        """The group a child (any rank) belongs to."""
        return next(g for g in self.groups if any(c.name == name for c in g.members))

    def command(self, c: Child) -> list[str]:
        """What a child runs: the same command as a systemd unit (a follower rank adds --rank)."""
        rank = ["--rank", str(c.rank)] if c.rank else []
        return [sys.executable, "-m", "deepinfer.launch.cli", "service", c.role, "--topology",
                str(self.topology_path), "--name", c.service, *rank]

    def _lifeline_fd(self) -> int:
        """The read end every child inherits. Both ends are non-inheritable (Python's default) and Popen
        closes every fd not in pass_fds, so no child ever holds the write end."""
        if self._lifeline is None:
            self._lifeline = os.pipe()
        return self._lifeline[0]

    def _spawn(self, c: Child) -> None:
        lifeline = self._lifeline_fd()
        env = dict(MALLOC_ENV, **os.environ)  # (a MALLOC_* the operator set wins)
        # DEEPINFER_THREADS is the worker's budget, as a topology's `threads` is: engine_config shares it
        # out among the ranks of a group, giving each c.threads back.
        ranks = self.topology.worker(c.service).ep if c.role == "worker" else 1
        env.update(OMP_NUM_THREADS=str(c.threads), MKL_NUM_THREADS=str(c.threads),
                   DEEPINFER_THREADS=str(c.threads * ranks), PYTHONUNBUFFERED="1",
                   DEEPINFER_LOG_LEVEL=os.environ.get("DEEPINFER_LOG_LEVEL", "info"),
                   **{LIFELINE_ENV: str(lifeline)})
        # Its own session (a terminal's Ctrl-C reaches the launcher only, which stops children in order).
        on_main_thread = threading.current_thread() is threading.main_thread()
        preexec = _die_with(os.getpid()) if on_main_thread else None
        out = open(self.log_dir / f"{c.name}.log", "ab") if self.log_dir else subprocess.DEVNULL  # noqa: SIM115
        try:
            c.proc = subprocess.Popen(self.command(c), env=env, stdout=out, stderr=subprocess.STDOUT,
                                      start_new_session=True, pass_fds=(lifeline,), preexec_fn=preexec)
        finally:
            if out is not subprocess.DEVNULL:
                out.close()  # the child has its own copy
        c.exit_seen = False
        log.info("started", service=c.name, pid=c.proc.pid, threads=c.threads, restarts=c.restarts)

    def _start_group(self, g: Group) -> None:
        for c in g.members:
            self._spawn(c)
        g.started_at = time.monotonic()

    def start(self) -> None:
        check_ipc_dirs(self.topology)  # a hand-written topology's socket directories too (UnsafeRunDir)
        for g in self.groups:
            self._start_group(g)

    def poll(self) -> list[str]:
        """Report exits, stop what is left of broken groups, and restart the groups that are gone whole
        and whose backoff has passed; returns the child names restarted now. Never blocks."""
        now = time.monotonic()
        restarted = []
        for g in self.groups:
            dead = [c for c in g.members if c.proc is not None and c.proc.poll() is not None]
            if not dead:
                continue
            if g.next_start == 0.0:  # first seen broken
                self._break(g, dead, now)
            for c in dead:
                if not c.exit_seen:
                    c.exit_seen = True
                    _metrics_process_exited(c.proc.pid)  # type: ignore[union-attr]
                    code = c.proc.returncode  # type: ignore[union-attr]
                    (log.info if code == 0 else log.warning)("exited", service=c.name, pid=c.proc.pid, code=code)  # type: ignore[union-attr]
                    self._report_exit(c)
            alive = [c.proc for c in g.members if c.proc is not None and c.proc.poll() is None]
            if alive and now >= g.kill_at:
                for p in alive:
                    log.warning("killing a rank that outlived its group's grace", pid=p.pid)
                    p.kill()  # reaped by a later poll
            if not alive and now >= g.next_start:
                for c in g.members:
                    c.restarts += 1
                g.next_start = 0.0
                self._start_group(g)
                restarted += [c.name for c in g.members]
        return restarted

    def _break(self, g: Group, dead: list[Child], now: float) -> None:
        """A member of `g` exited: schedule the group's restart and ask its other members to stop."""
        if now - g.started_at > self.STABLE_AFTER_S:
            g.backoff_s = 0.5
        g.next_start = now + g.backoff_s
        g.kill_at = now + GROUP_STOP_GRACE_S
        drained = all(c.proc is not None and c.proc.returncode == 0 for c in dead)  # a drain, not a failure
        (log.info if drained else log.warning)("restarting", services=[c.name for c in g.members],
                                               because=[c.name for c in dead], restart_in_s=g.backoff_s)
        g.backoff_s = min(self.MAX_BACKOFF_S, g.backoff_s * 2)
        for c in g.members:
            if c.proc is not None and c.proc.poll() is None:
                log.warning("stopping the rest of a broken group", service=c.name, pid=c.proc.pid)
                c.proc.send_signal(signal.SIGTERM)

    def _report_exit(self, c: Child) -> None:
        if self.on_exit is None or c.proc is None:
            return
        try:
            self.on_exit(c.name, c.role, c.proc.pid, c.proc.returncode)
        except Exception:  # a failing observer must not stop the restarts
            log.exception("on_exit failed", service=c.name)

    def stop(self, timeout_s: float = DRAIN_TIMEOUT_S + STOP_GRACE_S) -> None:
        """Drain and stop in order, waiting for each stage: the HTTP gateways first (they stop accepting and
        finish their requests, which needs the mesh), then the router (it refuses new requests and
        waits for admitted ones to finish, which needs everyone else still up), then the workers (rank 0
        of a group drains while its followers still compute with it; they stop next) and the tokenizers
        and cache daemons (idle by then; a daemon finishes its queued disk writes). SIGTERM means drain to
        every service; SIGKILL after `timeout_s` (by default a little more than a service's own drain
        timeout, so a drain ends by itself)."""
        log.info("stopping", children=[c.proc.pid for c in self.children if c.proc and c.proc.poll() is None])
        stages: list[Callable[[Child], bool]] = [
            lambda c: c.role == "gateway", lambda c: c.role == "router", lambda c: c.role == "worker" and c.rank == 0,
            lambda c: c.role == "worker" and c.rank > 0, lambda c: c.role in ("tokenizer", "balancer"),
            lambda c: c.role == "kvcache"]
        for stage in stages:
            procs = [c.proc for c in self.children if stage(c) and c.proc and c.proc.poll() is None]
            for p in procs:
                p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for p in procs:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                _metrics_process_exited(p.pid)  # its live gauges (KV blocks, running) end with it
        if self._lifeline is not None:
            for fd in self._lifeline:
                os.close(fd)
            self._lifeline = None
        log.info("stopped")

    def wait_ready(self, should_stop: Callable[[], bool] = lambda: False, timeout_s: float = 600.0) -> None:
        """Block until a two-token request makes it through the mesh (router, a tokenizer, prefill and
        decode) and every HTTP gateway answers GET /ready: the mesh is serving. Dead children are restarted
        meanwhile; raises TimeoutError."""
        from deepinfer.launch.keys import probe_client_keys
        from deepinfer.protocol.client import Client, MeshError

        keys = probe_client_keys(self.topology)  # a secured front refuses a keyless probe forever
        deadline = time.monotonic() + timeout_s
        mesh_ready = False
        while not should_stop():
            self.poll()
            if not mesh_ready:
                try:
                    with Client(self.topology.frontend, timeout_s=10.0, **keys) as client:
                        client.generate(prompt_token_ids=[1, 2, 3], max_tokens=2, ignore_eos=True)
                        mesh_ready = True
                except MeshError as exc:
                    log.info("waiting for the mesh", reason=str(exc))
            if mesh_ready:
                waiting = [g.name for g in self.topology.gateways if not gateway_ready(g.listen)]
                if not waiting:
                    return
                log.info("waiting for the gateways", gateways=waiting)
            if time.monotonic() > deadline:
                raise TimeoutError(f"the mesh was not ready after {timeout_s}s")
            time.sleep(0.5)


def gateway_url(listen: str) -> str:
    """The base URL a client on this host reaches a gateway listening on `listen` at (a wildcard: loopback)."""
    from deepinfer.launch.sections import split_host_port

    host, port = split_host_port(listen)
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "*": "127.0.0.1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def gateway_ready(listen: str) -> bool:
    """Whether the gateway at `listen` answers GET /ready with 200 (its router connected)."""
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy
    try:
        with opener.open(gateway_url(listen) + "/ready", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False
