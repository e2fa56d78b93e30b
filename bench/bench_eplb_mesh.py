"""The expert balancer on a live EP=2 mesh serving smollm2-moe (bench_eplb part b): measured max/mean of
the rank expert loads before and after the balancer's moves, and tokens/s while a move is under way
against the steady state around it.

    python -m bench.bench_eplb_mesh                       # 8 closed-loop streams, 90 s, balancer every 2 s
    python -m bench.bench_eplb_mesh --concurrency 4 --seconds 60 --interval 1 --threshold 0.01

The path timed is the mesh a user runs: rank 0 of the worker group, the router and the tokenizer in this
process (as `up --inproc` would run them), rank 1 as `deepinfer-launch service worker --rank 1`, the
balancer as `deepinfer-launch service balancer`, a client streaming over ipc://. The workload is closed
loop: `concurrency` streams, each sending its next prompt (code, which routes unevenly) as soon as its
previous one finished, greedy, `max_tokens` each. The first `--static` seconds run without a balancer
(the static placement); then the balancer starts.

Figures:
* max/mean: per MoE layer, the busiest rank's expert assignments over the mean rank's, averaged over the
  layers, from the group's own counts (`ExpertLoad.rank_expert_tokens`), under the static placement and
  under the placements the balancer chose;
* tokens/s during moves vs steady: a move lasts from the leader's `begin_placement` (staging starts on
  every rank) to the switch; tokens are the stream tokens the client received, by arrival time. Steady
  is every second of the balancer phase outside moves.
Nothing is asserted; figures are printed. The run is also written as JSON (`--out`, default
`bench/results/eplb_mesh.json`: tokens per `--bin-s` bin from the start, the moves, the phases' rates) and, unless
`--no-plots`, as a PNG of tokens/s over time with the balancer's start and every move marked (bench/plots.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from deepinfer.launch.mesh import InprocMesh
from deepinfer.launch.topology import Topology
from deepinfer.loading.fetch import fetch_smollm2_moe
from deepinfer.protocol import messages as m
from deepinfer.protocol.client import AsyncClient
from deepinfer.services.balancer_config import BALANCER_NAME, BalancerConfig
from deepinfer.services.group.engine import GroupEngine

PROMPTS = ["def fibonacci(n):\n    ", "for i in range(10):\n    print(", "import numpy as np\nx = np.",
           "class Stack:\n    def __init__(self):", "def quicksort(xs):\n    ", "while True:\n    line = input(",
           "struct node {\n    int value;", "SELECT name, count(*) FROM"]


def mean_max_over_mean(layers: list[list[int]]) -> float:
    busy = [layer for layer in layers if sum(layer) > 0]
    return sum(max(x) * len(x) / sum(x) for x in busy) / len(busy) if busy else float("nan")


async def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    topo = Topology.local(str(fetch_smollm2_moe()), "ipc", run_dir=work, disaggregated=False, ep=2,
                          threads=args.threads, kv_cache_mb=128,
                          balancer=BalancerConfig(interval_s=args.interval, window_s=args.window,
                                                  threshold=args.threshold, move_timeout_s=120.0))
    path = work / "topology.toml"
    path.write_text(topo.to_toml())
    cli = [sys.executable, "-m", "deepinfer.launch.cli", "--log-level", "warning", "service"]
    procs = [subprocess.Popen([*cli, "worker", "--topology", str(path), "--name", "worker-0", "--rank", "1"])]
    mesh = InprocMesh(topo, skip=[BALANCER_NAME])
    worker, router = mesh.service("worker-0"), mesh.service("router")
    group: GroupEngine = worker.engine
    worker.expert_load_period_s = 0.5
    await mesh.start()
    tokens: list[float] = []  # arrival time of every streamed token
    moves: list[tuple[float, float, int]] = []  # (begun, switched, version)
    by_version: dict[int, list[list[int]]] = {}
    stop = time.monotonic() + args.static + args.seconds
    try:
        async with AsyncClient(topo.frontend, ctx=mesh.ctx, timeout_s=600) as c:

            async def stream(i: int) -> None:
                k = i
                while time.monotonic() < stop:
                    async for msg in c.stream(prompt=PROMPTS[k % len(PROMPTS)], max_tokens=args.max_tokens,
                                              ignore_eos=True):
                        if isinstance(msg, m.StreamDelta):
                            tokens.extend([time.monotonic()] * len(msg.token_ids))
                    k += args.concurrency

            async def watch() -> None:
                seen, begun = None, None
                while time.monotonic() < stop + 5:
                    pending = group._moves.pending
                    if pending is not None and begun is None:
                        begun = (time.monotonic(), pending.version)
                    elif pending is None and begun is not None:
                        moves.append((begun[0], time.monotonic(), begun[1]))
                        begun = None
                    load = router.expert_load.get("worker-0")
                    if load is not None and load is not seen:
                        seen = load
                        acc = by_version.setdefault(load.placement_version, [])
                        for i, layer in enumerate(load.rank_expert_tokens):
                            if i == len(acc):
                                acc.append([0] * len(layer))
                            acc[i] = [a + b for a, b in zip(acc[i], layer)]
                    await asyncio.sleep(0.005)

            async def balancer_later() -> None:
                await asyncio.sleep(args.static)
                procs.append(subprocess.Popen([*cli, "balancer", "--topology", str(path), "--name", BALANCER_NAME]))

            t0 = time.monotonic()
            watcher = asyncio.ensure_future(watch())
            await asyncio.gather(balancer_later(), *[stream(i) for i in range(args.concurrency)])
            await asyncio.sleep(1.0)
            watcher.cancel()
    finally:
        await mesh.stop()
        for p in procs:
            if p.poll() is None:
                p.kill()
    return {"t0": t0, "tokens": tokens, "moves": moves, "by_version": by_version, "end": stop}


def report(args: argparse.Namespace, r: dict[str, Any]) -> dict[str, Any]:
    t0, tokens, moves = r["t0"], r["tokens"], r["moves"]
    start, end = t0 + args.static, r["end"]

    def rate(a: float, b: float) -> float:
        return sum(1 for t in tokens if a <= t < b) / (b - a) if b > a else float("nan")

    in_moves = sum(e - b for b, e, _ in moves if b >= start)
    during = sum(sum(1 for t in tokens if b <= t < e) for b, e, _ in moves if b >= start)
    steady_tokens = sum(1 for t in tokens if start <= t < end) - during
    steady_s = (end - start) - in_moves
    versions = sorted(r["by_version"])
    steady = moving = None
    print(f"EP=2 smollm2-moe, {args.concurrency} streams x {args.max_tokens} tokens, {args.threads} threads; "
          f"balancer every {args.interval:g} s, window {args.window:g} s, threshold {args.threshold:g}")
    print(f"static phase ({args.static:g} s): {rate(t0 + 5, start):.1f} tok/s (after 5 s of warm-up)")
    print(f"moves: {len(moves)} (versions {[v for _, _, v in moves]}), {in_moves:.2f} s in all, "
          f"median {sorted(e - b for b, e, _ in moves)[len(moves) // 2] if moves else float('nan'):.2f} s each")
    if steady_s > 0 and in_moves > 0:
        steady, moving = steady_tokens / steady_s, during / in_moves
        print(f"balancer phase: steady {steady:.1f} tok/s, during moves {moving:.1f} tok/s "
              f"({during} tokens in {in_moves:.2f} s): ratio {moving / steady:.3f}")
    print("measured expert max/mean (mean over MoE layers) by placement version:")
    for v in versions:
        layers = r["by_version"][v]
        print(f"  v{v}: {mean_max_over_mean(layers):.4f}  ({sum(map(sum, layers))} assignments)")
    bins = [0] * max(1, int((end - t0) / args.bin_s) + 1)
    for t in tokens:
        if t0 <= t < end:
            bins[int((t - t0) / args.bin_s)] += 1
    return {"args": vars(args), "bin_s": args.bin_s, "tokens_per_bin": bins, "balancer_start_s": args.static,
            "moves": [(b - t0, e - t0, v) for b, e, v in moves],
            "static_tok_s": rate(t0 + 5, start), "steady_tok_s": steady, "during_moves_tok_s": moving,
            "max_over_mean_by_version": {str(v): mean_max_over_mean(r["by_version"][v]) for v in versions}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--seconds", type=float, default=90.0, help="the balancer phase")
    parser.add_argument("--static", type=float, default=30.0, help="the static phase before the balancer starts")
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--window", type=float, default=30.0)
    parser.add_argument("--threshold", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--bin-s", type=float, default=1.0, help="width of the tokens/s time series' bins")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "eplb_mesh.json")
    parser.add_argument("--no-plots", action="store_true", help="no PNG beside --out (bench/plots.py)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-eplb-") as work:
        result = report(args, asyncio.run(run(args, Path(work))))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {args.out}")
    if not args.no_plots:
        from bench import plots

        plots.write("eplb_mesh", json.loads(json.dumps(result, default=str)), args.out)


if __name__ == "__main__":
    main()
