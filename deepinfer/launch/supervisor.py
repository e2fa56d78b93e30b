"""A process supervisor for the one-host mesh: one child process per service, restarted with
exponential backoff when it dies, drained and stopped in order (router, workers, tokenizers).

Each child is `python -m deepinfer.launch.cli service ROLE --topology F --name NAME`, the same command a
systemd unit runs. CPU threads are a budget: every worker gets its share of the host's cores (torch's
OpenMP threads spin while waiting, and oversubscribed they slow matmuls by orders of magnitude);
router and tokenizers get one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from deepinfer.launch.topology import Topology
from deepinfer.launch.tuning import MALLOC_ENV

log = structlog.get_logger("deepinfer.supervisor")


@dataclass
class Child:
    role: str  # "router", "tokenizer", "worker" or "kvcache"
    name: str
    threads: int
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    next_start: float = 0.0
    backoff_s: float = 0.5
    started_at: float = field(default=0.0)


def thread_shares(topology: Topology, cores: int | None = None) -> dict[str, int]:
    """Threads per worker: the topology's value, or an equal share of the cores left after one core's worth
    for the router and tokenizers on hosts with more than two cores."""
    cores = cores or os.cpu_count() or 1
    workers = topology.workers
    spare = cores - 1 if cores > 2 else cores
    share = max(1, spare // max(1, len(workers)))
    return {w.name: w.threads or share for w in workers}


class Supervisor:
    MAX_BACKOFF_S = 8.0
    STABLE_AFTER_S = 30.0  # a child that ran this long resets its backoff

    def __init__(self, topology_path: Path, log_dir: Path | None = None) -> None:
        self.topology_path = topology_path
        self.topology = Topology.load(topology_path)
        self.log_dir = log_dir
        shares = thread_shares(self.topology)
        self.children = [Child("router", "router", 1)]
        self.children += [Child("kvcache", k.name, 1) for k in self.topology.kvcaches]
        self.children += [Child("tokenizer", t.name, 1) for t in self.topology.tokenizers]
        self.children += [Child("worker", w.name, shares[w.name]) for w in self.topology.workers]

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def _spawn(self, c: Child) -> None:
        env = dict(MALLOC_ENV, **os.environ)  # (a MALLOC_* the operator set wins)
        env.update(OMP_NUM_THREADS=str(c.threads), MKL_NUM_THREADS=str(c.threads),
                   DEEPINFER_THREADS=str(c.threads), PYTHONUNBUFFERED="1",
                   DEEPINFER_LOG_LEVEL=os.environ.get("DEEPINFER_LOG_LEVEL", "info"))
        cmd = [sys.executable, "-m", "deepinfer.launch.cli", "service", c.role, "--topology",
               str(self.topology_path), "--name", c.name]
        out = open(self.log_dir / f"{c.name}.log", "ab") if self.log_dir else subprocess.DEVNULL  # noqa: SIM115
        c.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        c.started_at = time.monotonic()
        log.info("started", service=c.name, pid=c.proc.pid, threads=c.threads, restarts=c.restarts)

    def start(self) -> None:
        for c in self.children:
            self._spawn(c)

    def poll(self) -> list[str]:
        """Restart dead children whose backoff has passed; returns the names restarted now."""
        now = time.monotonic()
        restarted = []
        for c in self.children:
            if c.proc is None or c.proc.poll() is None:
                continue
            if c.next_start == 0.0:
                if now - c.started_at > self.STABLE_AFTER_S:
                    c.backoff_s = 0.5
                c.next_start = now + c.backoff_s
                log.warning("exited", service=c.name, code=c.proc.returncode, restart_in_s=c.backoff_s)
                c.backoff_s = min(self.MAX_BACKOFF_S, c.backoff_s * 2)
            if now >= c.next_start:
                c.restarts += 1
                c.next_start = 0.0
                self._spawn(c)
                restarted.append(c.name)
        return restarted

    def stop(self, timeout_s: float = 60.0) -> None:
        """Drain and stop in order, waiting for each group: the router first (it refuses new requests and
        waits for admitted ones to finish, which needs everyone else still up), then the workers and the
        tokenizers and cache daemons (idle by then; a daemon finishes its queued disk writes). SIGTERM
        means drain to every service; SIGKILL after `timeout_s`."""
        for group in ("router", "worker", "tokenizer", "kvcache"):
            procs = [c.proc for c in self.children if c.role == group and c.proc and c.proc.poll() is None]
            for p in procs:
                p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for p in procs:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        log.info("stopped")

    def wait_ready(self, should_stop: Callable[[], bool] = lambda: False, timeout_s: float = 600.0) -> None:
        """Block until a two-token request makes it through the mesh (router, a tokenizer, prefill and
        decode): the mesh is serving. Dead children are restarted meanwhile; raises TimeoutError."""
        from deepinfer.protocol.client import Client, MeshError

        deadline = time.monotonic() + timeout_s
        while not should_stop():
            self.poll()
            try:
                with Client(self.topology.frontend, timeout_s=10.0) as client:
                    client.generate(prompt_token_ids=[1, 2, 3], max_tokens=2, ignore_eos=True)
                    return
            except MeshError as exc:
                log.info("waiting for the mesh", reason=str(exc))
            if time.monotonic() > deadline:
                raise TimeoutError(f"the mesh was not ready after {timeout_s}s")
            time.sleep(0.5)
