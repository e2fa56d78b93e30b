"""Soak: the mesh under mixed valid load with a fault every ~30 s, watched for lost requests and leaks.

    python -m bench.soak                    # 20 minutes (issue 30's soak)
    python -m bench.soak --minutes 3        # a short run
    python -m bench.soak --out bench/results/soak-faults-DATE.json [--keep]
    python -m bench.soak --minutes 3 --faults kill,drain --fault-every-s 20     # some faults only

The mesh runs as `deepinfer-launch up` runs it: one process per service over ipc:// under the supervisor
(one prefill worker, two decode workers, two tokenizers, a cache daemon), the router hearing of a dead
child at once. First each prompt's greedy answer is taken on the quiet mesh (the undisturbed answers).
Then `--clients` threads share one `deepinfer.Client` and loop over a mix (`soak_load`): greedy streams
and non-streamed requests run to the end, streams abandoned after a few tokens (aborts), requests with a
deadline too short to meet. Every `--fault-every-s` the next fault of a rotation starts (`soak_faults`):
kill -9 of a worker or tokenizer, oversized requests, a graceful drain (`deepinfer-launch drain`), garbage
frames at the front, a slow client.

It prints, and writes to `--out` as JSON:

* requests lost, which must be 0: a load request is lost when it neither finished (or was abandoned by its
  client) nor ended with a typed error expected for it: "timeout" for a deadline request, "overloaded" or
  "unavailable" (a retryable refusal, counted apart) for any. No answer within the client's 120 s timeout,
  a lost router connection, or any other error ("worker_lost", "internal", ...) is lost. A fault's own
  requests (oversized, malformed with a readable id, slow streams) are lost when they did not end exactly
  once as the fault expects (see soak_faults).
* TTFT p50/p99 of streams sent within `--fault-window-s` after a fault (all, and per fault kind) and of
  the others.
* RSS and open fds per service, sampled every 10 s: the first minute after warm-up against the last
  minute, per incarnation (a killed or drained service restarts and starts over; restarts are named).
* free KV blocks per worker (from the router's "mesh state" line) under load, first against last minute,
  and at idle after the load (all should be free, nothing in flight).
* greedy outputs that differ from the undisturbed answers.

It exits 1 when a request was lost, an output differed, a fault did not go as expected, or blocks or
requests were still held at idle.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.soak_faults import Faults
from bench.soak_load import Load, undisturbed_answers
from bench.soak_report import (
    free_blocks_drift,
    mesh_state,
    print_summary,
    proc_stat,
    refused_windows,
    rss_growth,
    ttft_around_faults,
)
from deepinfer import Client
from deepinfer.launch.exit_notes import ExitNotifier
from deepinfer.launch.supervisor import Supervisor
from deepinfer.launch.topology import Topology
from deepinfer.loading.fetch import fetch_smollm2

SAMPLE_S = 10.0
# Per worker: 182 blocks of 16 tokens. The slow client's unread streams hold ~120 of them until the router ends
# them; with half as much, the load's own requests were refused ("overloaded: KV blocks not free") meanwhile.
KV_CACHE_MB = 128
IDLE_S = 25.0  # after the load: handoff leases of abandoned requests expire in 10 s, the router logs every 10 s


def sample(sup: Supervisor, t: float, run: Path, load: Load) -> dict[str, Any]:
    pids = {c.name: c.proc.pid for c in sup.children if c.proc is not None and c.proc.poll() is None}
    pids["bench (client, supervisor)"] = os.getpid()
    procs = {name: {"pid": pid, "rss_kib": st[0], "fds": st[1]} for name, pid in pids.items()
             if (st := proc_stat(pid)) is not None}
    state = mesh_state(run / "router.log")
    return {"t": round(t, 1), "procs": procs, "free_blocks": {n: f for n, (f, _) in state.get("blocks", {}).items()},
            "outcomes": dict(load.outcomes()), "tokens": load.tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--fault-every-s", type=float, default=30.0)
    ap.add_argument("--fault-window-s", type=float, default=10.0, help="TTFT counts as 'during a fault' this long")
    ap.add_argument("--drain-timeout-s", type=float, default=10.0, help="the drains' --timeout")
    ap.add_argument("--slow-pause-s", type=float, default=10.0,
                    help="how long the slow client stops reading (every other time 4x as long)")
    ap.add_argument("--slow-streams", type=int, default=6, help="the slow client's streams ...")
    ap.add_argument("--slow-tokens", type=int, default=320, help="... of this many tokens each")
    ap.add_argument("--faults", default=",".join(Faults.ROTATION), help="the rotation (comma-separated kinds)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--keep", action="store_true", help="keep the run directory (logs, sockets, KV files)")
    ap.add_argument("--no-plots", action="store_true", help="no PNG beside --out (bench/plots.py)")
    args = ap.parse_args()
    if unknown := set(args.faults.split(",")) - set(Faults.ROTATION):
        ap.error(f"unknown fault kinds {sorted(unknown)}; the kinds are {', '.join(Faults.ROTATION)}")
    run = Path(tempfile.mkdtemp(prefix="deepinfer-soak-"))
    topo = Topology.local(str(fetch_smollm2(progress=False)), "ipc", run, disaggregated=True, num_decode=2,
                          num_tokenizers=2, threads=1, kv_cache_mb=KV_CACHE_MB, cache_dir=run / "kv")
    (run / "topology.toml").write_text(topo.to_toml())
    sup = Supervisor(run / "topology.toml", log_dir=run)
    sup.on_exit = notes = ExitNotifier(topo.backend)
    sup.start()
    print(f"run directory {run}", flush=True)
    samples: list[dict[str, Any]] = []
    try:
        sup.wait_ready(timeout_s=600)
        client = Client(topo.frontend, timeout_s=120)
        answers = undisturbed_answers(client)
        load = Load(client, args.clients, args.seed, answers)
        faults = Faults(sup, topo.frontend, run, load, args.seed, args.drain_timeout_s, args.slow_pause_s,
                        tuple(args.faults.split(",")), args.slow_streams, args.slow_tokens)
        load.start()
        next_fault, next_sample = args.fault_every_s, 0.0
        while (t := time.monotonic() - load.t0) < args.minutes * 60:
            sup.poll()
            if t >= next_fault:
                next_fault += args.fault_every_s
                rec = faults.inject(t)
                print(f"{t:6.0f}s  fault {rec.kind} {rec.target}", flush=True)
            if t >= next_sample:
                next_sample += SAMPLE_S
                samples.append(sample(sup, t, run, load))
                print(f"{t:6.0f}s  {dict(load.outcomes())}  free {samples[-1]['free_blocks']}", flush=True)
            time.sleep(0.2)
        load.stop.set()
        for thread in load.threads:
            thread.join(timeout=180)
        end = time.monotonic()
        while faults.running() and time.monotonic() - end < 600:  # a drain waits for its successor
            sup.poll()
            time.sleep(0.5)
        client.close()
        end = time.monotonic()
        while time.monotonic() - end < IDLE_S:  # idle: what the load held is released
            sup.poll()
            time.sleep(0.5)
        idle = mesh_state(run / "router.log")
        report = build_report(args, load, faults, samples, idle, {c.name: c.restarts for c in sup.children})
    finally:
        sup.stop()
        notes.close()
        if not args.keep:
            shutil.rmtree(run, ignore_errors=True)
    print_summary(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, default=str))
        if not args.no_plots:
            from bench import plots

            plots.write("soak", report, args.out)
    sys.exit(1 if report["failures"] else 0)


def build_report(args: argparse.Namespace, load: Load, faults: Faults, samples: list[dict[str, Any]],
                 idle: dict[str, Any], restarts: dict[str, int]) -> dict[str, Any]:
    lost_load = [r for r in load.records if r.outcome.startswith("lost")]
    lost_faults = sum(f.lost for f in faults.records)
    bad_faults = [f for f in faults.records if f.ok is not True or f.lost]
    refused = Counter(r.outcome for r in load.records if r.outcome.startswith("refused"))
    held = {n: fb for n, fb in idle.get("blocks", {}).items() if fb[0] != fb[1]}
    failures = []
    if lost_load or lost_faults:
        failures.append(f"{len(lost_load) + lost_faults} request(s) lost")
    if load.mismatches:
        failures.append(f"{len(load.mismatches)} greedy output(s) differ from the undisturbed answers")
    if bad_faults:
        failures.append(f"{len(bad_faults)} fault(s) not as expected")
    if held or idle.get("inflight"):
        failures.append(f"at idle: blocks held {held}, requests in flight {idle.get('inflight')}")
    return {
        "command": " ".join(["python -m bench.soak", *sys.argv[1:]]),
        "machine": f"{os.cpu_count()} cores, load average at the end {os.getloadavg()[0]:.1f}",
        "fault_counts": dict(Counter(f.kind for f in faults.records)),
        "outcomes": dict(load.outcomes()),
        "lost": {"total": len(lost_load) + lost_faults, "load": len(lost_load), "fault_requests": lost_faults},
        "lost_requests": [vars(r) for r in lost_load],
        "refused": dict(refused),
        "refused_why": dict(Counter(re.sub(r"request_id=\S+ ", "", r.detail) for r in load.records
                                    if r.outcome.startswith("refused"))),
        "refused_windows": refused_windows(load.records, faults.records),
        "ttft": ttft_around_faults(load.records, faults.records, args.fault_window_s),
        "greedy_mismatches": load.mismatches,
        "faults": [vars(f) for f in faults.records],
        "faults_not_as_expected": [vars(f) for f in bad_faults],
        "kills": [(f.t, f.target) for f in faults.records if f.kind == "kill"],  # for bench/plots.py
        "restarts": restarts,
        "rss": rss_growth(samples),
        "free_blocks_drift": free_blocks_drift(samples),
        "idle": idle,
        "failures": failures,
        "samples": samples,
    }


if __name__ == "__main__":
    main()
