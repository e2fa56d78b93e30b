"""Soak: the mesh under mixed load with aborts and a kill -9 every minute, watched for leaks.

    python -m bench.soak                    # 20 minutes (the issue's soak)
    python -m bench.soak --minutes 3        # a short run
    python -m bench.soak --out bench/results/soak.json

The mesh runs as `deepinfer-launch up` runs it: one process per service over ipc:// under the supervisor
(one prefill worker, two decode workers, two tokenizers, a cache daemon), the router hearing of a dead
child at once. Load: `--clients` threads share one `deepinfer.Client` and loop over a mix — a greedy
request run to the end, a stream abandoned after a few tokens (an abort), a request with a deadline too
short to meet (a timeout) — on a fixed set of prompts with shared prefixes. Every `--kill-every-s` a
random worker or tokenizer gets SIGKILL (the supervisor restarts it; its requests move).

Sampled every 10 s: each service's RSS and open fds (from /proc; a restarted service starts over, so the
report names its restarts), and each worker's free KV blocks (from the router's "mesh state" log line).
The report compares the last minute with the first minute after warm-up: flat means no leak.
Greedy answers are checked against the first answer to the same prompt: a request that moved must
still give the undisturbed output.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from deepinfer import Client, MeshError
from deepinfer.launch.exit_notes import ExitNotifier
from deepinfer.launch.supervisor import Supervisor
from deepinfer.launch.topology import Topology
from deepinfer.loading.fetch import fetch_smollm2
from deepinfer.protocol.messages import StreamDelta

PROMPTS = [list(range(300, 300 + 64)) + [400 + i] * (8 + i % 5) for i in range(24)]  # shared 64-token prefix


def proc_stat(pid: int) -> tuple[int, int] | None:
    """(RSS KiB, open fds) of a live process, None if it is gone."""
    try:
        rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                   if line.startswith("VmRSS:"))
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return None


def free_blocks(router_log: Path) -> dict[str, int]:
    """Each worker's free KV blocks from the router's latest "mesh state" line."""
    lines = [ln for ln in router_log.read_text(errors="replace").splitlines() if "mesh state" in ln]
    if not lines:
        return {}
    return {name: int(free) for name, free, _ in re.findall(r"'([\w-]+)': '(\d+)/(\d+)'", lines[-1])}


class Load:
    """Client threads sharing one Client, each looping over the mix until stopped."""

    def __init__(self, client: Client, threads: int, seed: int) -> None:
        self.client, self.stop = client, threading.Event()
        self.outcomes: Counter[str] = Counter()
        self.tokens = 0  # generated tokens the clients received (for the tokens/s-over-time figure)
        self.answers: dict[int, list[int]] = {}
        self.mismatches = 0
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(seed + i,), daemon=True) for i in range(threads)]

    def _count(self, what: str) -> None:
        with self.lock:
            self.outcomes[what] += 1

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            i = rng.randrange(len(PROMPTS))
            kind = rng.choices(["full", "abandon", "deadline"], [6, 3, 1])[0]
            try:
                if kind == "full":
                    out = self.client.generate(prompt_token_ids=PROMPTS[i], max_tokens=24, ignore_eos=True)
                    with self.lock:
                        self.tokens += len(out.token_ids)
                        want = self.answers.setdefault(i, out.token_ids)
                        self.mismatches += out.token_ids != want
                elif kind == "abandon":
                    stream = self.client.stream(prompt_token_ids=PROMPTS[i], max_tokens=64, ignore_eos=True)
                    for n, msg in enumerate(stream):
                        if isinstance(msg, StreamDelta):
                            with self.lock:
                                self.tokens += len(msg.token_ids)
                        if n >= rng.randrange(1, 6):
                            break
                    stream.close()
                else:
                    self.client.generate(prompt_token_ids=PROMPTS[i], max_tokens=200, ignore_eos=True,
                                         timeout_s=0.3)
                self._count(kind)
            except MeshError as exc:
                self._count(f"{kind}:{type(exc).__name__}")
                time.sleep(0.1)


def summarise(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, Any]:
    """Per service and metric: the mean over the first minute after warm-up and over the last minute."""
    steady = [s for s in samples if s["t"] >= warmup_s]
    if len(steady) < 2:
        return {}
    first = [s for s in steady if s["t"] < steady[0]["t"] + 60]
    last = [s for s in steady if s["t"] > steady[-1]["t"] - 60]
    out: dict[str, Any] = {}
    for metric in ("rss_kib", "fds", "free_blocks"):
        names = sorted({n for s in steady for n in s[metric]})
        for name in names:
            a = [s[metric][name] for s in first if name in s[metric]]
            b = [s[metric][name] for s in last if name in s[metric]]
            if a and b:
                out[f"{metric}:{name}"] = {"first_min": statistics.mean(a), "last_min": statistics.mean(b),
                                           "ratio": statistics.mean(b) / max(1e-9, statistics.mean(a))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--kill-every-s", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--keep", action="store_true", help="keep the run directory (logs, sockets, KV files)")
    ap.add_argument("--no-plots", action="store_true", help="no PNG beside --out (bench/plots.py)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    run = Path(tempfile.mkdtemp(prefix="deepinfer-soak-"))
    topo = Topology.local(str(fetch_smollm2(progress=False)), "ipc", run, disaggregated=True, num_decode=2,
                          num_tokenizers=2, threads=1, kv_cache_mb=64, cache_dir=run / "kv")
    (run / "topology.toml").write_text(topo.to_toml())
    sup = Supervisor(run / "topology.toml", log_dir=run)
    sup.on_exit = notes = ExitNotifier(topo.backend)
    sup.start()
    samples: list[dict[str, Any]] = []
    kills: list[tuple[float, str]] = []
    try:
        sup.wait_ready(timeout_s=600)
        client = Client(topo.frontend, timeout_s=120)
        load = Load(client, args.clients, args.seed)
        for t in load.threads:
            t.start()
        start = last_kill = time.monotonic()
        next_sample = start
        victims = [c.name for c in sup.children if c.role in ("worker", "tokenizer")]
        while (now := time.monotonic()) - start < args.minutes * 60:
            sup.poll()
            if now - last_kill >= args.kill_every_s:
                victim = sup.child(rng.choice(victims))
                if victim.proc is not None and victim.proc.poll() is None:
                    os.kill(victim.proc.pid, signal.SIGKILL)
                    kills.append((now - start, victim.name))
                last_kill = now
            if now >= next_sample:
                next_sample += 10.0
                stats = {c.name: proc_stat(c.proc.pid) for c in sup.children if c.proc is not None}
                samples.append({"t": now - start,
                                "rss_kib": {n: s[0] for n, s in stats.items() if s},
                                "fds": {n: s[1] for n, s in stats.items() if s},
                                "free_blocks": free_blocks(run / "router.log"),
                                "outcomes": dict(load.outcomes), "tokens": load.tokens})
                print(f"{now - start:6.0f}s  outcomes {dict(load.outcomes)}  free {samples[-1]['free_blocks']}",
                      flush=True)
            time.sleep(0.2)
        load.stop.set()
        for t in load.threads:
            t.join(timeout=180)
        client.close()
        # Idle: every worker's blocks should all be free (leases of abandoned handoffs expire in 10 s) in a
        # state line the router logged after that.
        time.sleep(25)
        idle_free = free_blocks(run / "router.log")
        report = {
            "command": f"python -m bench.soak --minutes {args.minutes:g} --clients {args.clients} "
                       f"--kill-every-s {args.kill_every_s:g} --seed {args.seed}",
            "outcomes": dict(load.outcomes), "greedy_mismatches": load.mismatches, "kills": kills,
            "restarts": {c.name: c.restarts for c in sup.children}, "idle_free_blocks": idle_free,
            "drift": summarise(samples, warmup_s=60.0), "samples": samples,
        }
    finally:
        sup.stop()
        notes.close()
        if not args.keep:
            shutil.rmtree(run, ignore_errors=True)
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        if not args.no_plots:
            from bench import plots

            plots.write("soak", report, args.out)


if __name__ == "__main__":
    main()
