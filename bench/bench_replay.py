"""Replay the Mooncake FAST'25 trace (multi-turn, prefix-sharing) against the mesh, cache on vs cache off.

    python -m bench.bench_replay [--trace PATH] [--block-tokens 16] [--sample 0.03125] [--requests N]
                                 [--time-scale 10] [--model smollm2] [--threads 2] [--placement] [--out PATH]

The trace (bench/data/mooncake-fast25/) has arrival times, lengths and one hash id per 512-token block;
bench/trace.py turns each block id into a fixed run of --block-tokens token ids, so requests that share
leading ids share exactly that prefix. Whole prefix groups are sampled (--sample), arrivals compressed
(--time-scale), and every request is sent at its arrival time through AsyncClient with prompt_token_ids,
greedy, EOS ignored, max_tokens = the scaled output length.

Default mode: the same replay against a fresh mesh with the KV cache (device pool + cache daemon's host and
disk tiers) and one without; prints the token hit rate per tier next to the trace's own reusable fraction,
TTFT p50/p99 and throughput, and the off/on ratios. --placement: two prefill workers, cache on, router
placement "cache_aware" vs "least_loaded". --lookup: prefixes looked up as jobs start vs as they arrive.
--disagg N: conditional disaggregation (the router may prefill up to N tokens on the decode worker) vs every
prompt on the prefill worker. See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from fractions import Fraction
from pathlib import Path
from typing import Any

from bench.bench_mesh import pct, supervised, table
from bench.trace import (
    TRACE_BLOCK_TOKENS,
    ScaleConfig,
    ScaledRequest,
    ScaledTrace,
    load_trace,
    reusable_fraction,
    sample_groups,
    scale_trace,
    scaled_items,
    trace_items,
)
from deepinfer.launch.mesh import InprocMesh
from deepinfer.launch.topology import RouterConfig, Topology
from deepinfer.loading.fetch import resolve_model
from deepinfer.loading.identity import model_config_at
from deepinfer.protocol.client import AsyncClient, MeshError

DEFAULT_TRACE = Path(__file__).parent / "data" / "mooncake-fast25" / "synthetic_trace.jsonl"
RESULTS = Path(__file__).parent / "results"
TIERS = ("device", "host", "disk")
KV_BLOCK = 16  # the mesh's KV block size (Topology.block_size default): what a block cache can hit
# The default workload: 1/48 of the prefix groups, seed 8 — 77 requests, 35.6k prompt tokens at b = 16, 65.5%
# of them reusable, as in the whole trace (65.1%; samples vary from ~45% to ~80%, big groups dominate) —
# arriving over ~100 s, about what the P/D pair on 2 cores prefills in that time without the cache.
DEFAULT_SAMPLE, DEFAULT_SAMPLE_SEED, DEFAULT_TIME_SCALE = "1/48", 8, 10.0


@dataclasses.dataclass(frozen=True)
class Arm:
    """One mesh configuration the workload runs against."""

    name: str
    cache: bool
    num_prefill: int = 1
    router_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    worker_options: dict[str, Any] = dataclasses.field(default_factory=dict)  # on every worker (WorkerSpec keys)


@dataclasses.dataclass(frozen=True)
class MeshSettings:
    model: str
    transport: str  # "ipc" (a process per service) or "inproc" (one process)
    colocated: bool
    threads: int  # torch threads per worker
    kv_cache_mb: int
    host_cache_mb: int
    disk_cache_mb: int
    router_options: dict[str, Any]  # for every arm (queue limits), before the arm's own


def mesh_topology(s: MeshSettings, arm: Arm, run_dir: Path) -> Topology:
    """The mesh of one arm: cache on = a cache daemon with a fresh disk tier (the default directory outlives
    runs and would serve hits from the last one) and prefix caching in the workers; cache off = neither."""
    topo = Topology.local(s.model, s.transport, run_dir if s.transport == "ipc" else None,
                          disaggregated=not s.colocated, num_prefill=arm.num_prefill, threads=s.threads,
                          kv_cache_mb=s.kv_cache_mb, kvcache=arm.cache, prefix_caching=arm.cache,
                          cache_dir=run_dir / "kvcache", host_cache_mb=s.host_cache_mb,
                          disk_cache_mb=s.disk_cache_mb)
    workers = tuple(dataclasses.replace(w, **arm.worker_options) for w in topo.workers)
    return dataclasses.replace(topo, router=RouterConfig(**{**s.router_options, **arm.router_options}),
                               workers=workers)


# -- running one arm ------------------------------------------------------------------------------------------


async def replay(endpoint: str, ctx: Any, requests: list[ScaledRequest], warm: list[list[int]], timeout_s: float,
                 label: str) -> list[dict[str, Any]]:
    """Send each request at its arrival time; one row per request (an `error` code instead of figures if
    the mesh refused or failed it). Times in the rows are from the first arrival."""
    async with AsyncClient(endpoint, timeout_s=timeout_s, ctx=ctx) as c:
        await asyncio.gather(*(c.generate(prompt_token_ids=p, max_tokens=2, ignore_eos=True) for p in warm))
        start = time.perf_counter()
        done = 0

        async def one(r: ScaledRequest) -> dict[str, Any]:
            nonlocal done
            await asyncio.sleep(max(0.0, start + r.arrival_s - time.perf_counter()))
            sent = time.perf_counter() - start
            row: dict[str, Any] = {"index": r.index, "arrival_s": r.arrival_s, "late_s": sent - r.arrival_s,
                                   "prompt_tokens": len(r.prompt), "max_tokens": r.max_tokens}
            try:
                res = await c.generate(prompt_token_ids=list(r.prompt), max_tokens=r.max_tokens, ignore_eos=True)
            except MeshError as exc:
                row.update(error=exc.code, message=str(exc))
            else:
                u, t = res.usage, res.timings
                row.update(completion_tokens=u.completion_tokens, cached_tokens=u.cached_tokens,
                           cached_by_tier=dict(u.cached_by_tier), ttft_s=t.ttft_s, e2e_s=t.e2e_s, queue_s=t.queue_s,
                           prefill_s=t.prefill_s)
            row["finished_s"] = time.perf_counter() - start
            done += 1
            if done % max(1, len(requests) // 10) == 0 or done == len(requests):
                print(f"  {label}: {done}/{len(requests)} done at {row['finished_s']:.0f} s", file=sys.stderr)
            return row

        return list(await asyncio.gather(*(one(r) for r in requests)))


def run_arm(s: MeshSettings, arm: Arm, requests: list[ScaledRequest], warm: list[list[int]],
            timeout_s: float) -> list[dict[str, Any]]:
    """A fresh mesh (fresh cache) for this arm, the replay, the mesh stopped."""
    run_dir = Path(tempfile.mkdtemp(prefix="direplay-"))
    try:
        topo = mesh_topology(s, arm, run_dir)
        if s.transport == "inproc":
            async def main() -> list[dict[str, Any]]:
                mesh = InprocMesh(topo)
                await mesh.start()
                try:
                    return await replay(topo.frontend, mesh.ctx, requests, warm, timeout_s, arm.name)
                finally:
                    await mesh.stop()

            return asyncio.run(main())
        with supervised(topo, run_dir):
            return asyncio.run(replay(topo.frontend, None, requests, warm, timeout_s, arm.name))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


# -- figures ------------------------------------------------------------------------------------------------


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if "error" not in r]
    prompt = sum(r["prompt_tokens"] for r in ok)
    cached = sum(r["cached_tokens"] for r in ok)
    by_tier = Counter[str]()
    for r in ok:
        by_tier.update(r["cached_by_tier"])
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    wall = max((r["finished_s"] for r in rows), default=0.0)
    per_s = lambda n: n / wall if wall else None
    return {
        "requests": len(rows), "ok": len(ok), "errors": dict(Counter(r["error"] for r in rows if "error" in r)),
        "prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt if prompt else None,
        "hit_rate_by_tier": {t: by_tier[t] / prompt if prompt else None for t in sorted({*TIERS, *by_tier})},
        "ttft_p50_s": pct(ttft, 50) if ttft else None, "ttft_p99_s": pct(ttft, 99) if ttft else None,
        "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
        "wall_s": wall, "req_s": per_s(len(ok)), "prompt_tok_s": per_s(prompt),
        "computed_prompt_tok_s": per_s(prompt - cached),
        "output_tok_s": per_s(sum(r["completion_tokens"] for r in ok)),
        "max_send_late_s": max((r["late_s"] for r in rows), default=0.0),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(arms: dict[str, dict[str, Any]], reusable_kv: float, mode: str) -> dict[str, float | None]:
    if mode == "lookup":
        start, arrival = arms["lookup at start"], arms["lookup at arrival"]
        return {"TTFT p50, at arrival / at start": ratio(arrival["ttft_p50_s"], start["ttft_p50_s"]),
                "TTFT p99, at arrival / at start": ratio(arrival["ttft_p99_s"], start["ttft_p99_s"]),
                "hit rate at start / reusable (KV blocks)": ratio(start["hit_rate"], reusable_kv),
                "hit rate at arrival / reusable (KV blocks)": ratio(arrival["hit_rate"], reusable_kv)}
    if mode == "disagg":
        cond, remote = arms["conditional"], arms["always remote"]
        return {"TTFT p50, always remote / conditional": ratio(remote["ttft_p50_s"], cond["ttft_p50_s"]),
                "TTFT p99, always remote / conditional": ratio(remote["ttft_p99_s"], cond["ttft_p99_s"]),
                "throughput (req/s), conditional / always remote": ratio(cond["req_s"], remote["req_s"]),
                "hit rate conditional / reusable (KV blocks)": ratio(cond["hit_rate"], reusable_kv)}
    if mode == "placement":
        ca, ll = arms["cache_aware"], arms["least_loaded"]
        return {"TTFT p50, least_loaded / cache_aware": ratio(ll["ttft_p50_s"], ca["ttft_p50_s"]),
                "TTFT p99, least_loaded / cache_aware": ratio(ll["ttft_p99_s"], ca["ttft_p99_s"]),
                "hit rate, cache_aware / least_loaded": ratio(ca["hit_rate"], ll["hit_rate"]),
                "hit rate cache_aware / reusable (KV blocks)": ratio(ca["hit_rate"], reusable_kv)}
    on, off = arms["cache on"], arms["cache off"]
    return {"TTFT p50, off / on": ratio(off["ttft_p50_s"], on["ttft_p50_s"]),
            "TTFT p99, off / on": ratio(off["ttft_p99_s"], on["ttft_p99_s"]),
            "throughput (req/s), on / off": ratio(on["req_s"], off["req_s"]),
            "wall, off / on": ratio(off["wall_s"], on["wall_s"]),
            "hit rate on / reusable (KV blocks)": ratio(on["hit_rate"], reusable_kv)}


def print_report(r: dict[str, Any]) -> None:
    f = lambda v, spec=".3f": "-" if v is None else format(v, spec)
    pc = lambda v: "-" if v is None else f"{100 * v:.1f}%"
    w = r["workload"]
    print(f"\nMooncake FAST'25 replay, {r['model_name']}, {r['mesh']['transport']} mesh, {r['mode']} mode; "
          f"{w['requests']} requests over {w['span_s']:.0f} s (time / {w['time_scale']:g}), "
          f"{w['prompt_tokens']} prompt tokens (mean {w['mean_prompt']:.0f}, max {w['max_prompt']}), "
          f"{w['output_tokens']} output tokens, b = {w['block_tokens']}")
    print(f"reusable with an unbounded cache: {pc(w['reusable_scaled'])} of scaled prompt tokens, "
          f"{pc(w['reusable_kv_blocks'])} in full {KV_BLOCK}-token KV blocks (this sample unscaled: "
          f"{pc(w['reusable_unscaled'])}; whole trace unscaled: {pc(w['reusable_whole_trace'])})")
    if w["skipped"] or w["truncated"]:
        print(f"prompts over {w['max_input_tokens']} tokens: {w['skipped']} skipped, {w['truncated']} truncated")
    arms = r["arms"]
    table(["arm", "ok", "errors", "hit", *TIERS, "TTFT p50 s", "TTFT p99 s", "wall s", "req/s", "prompt tok/s"],
          [[name, str(a["ok"]), str(sum(a["errors"].values())), pc(a["hit_rate"]),
            *(pc(a["hit_rate_by_tier"].get(t)) for t in TIERS), f(a["ttft_p50_s"]), f(a["ttft_p99_s"]),
            f(a["wall_s"], ".1f"), f(a["req_s"], ".2f"), f(a["prompt_tok_s"], ".0f")] for name, a in arms.items()])
    for name, a in arms.items():
        if a["errors"]:
            print(f"  {name}: errors {a['errors']}")
        if a["max_send_late_s"] > 0.5:
            print(f"  {name}: the client sent a request up to {a['max_send_late_s']:.1f} s late")
    print("\nratios:")
    for name, v in r["ratios"].items():
        print(f"  {name:<45} {f(v, '.2f'):>6}")
    for n in r["notes"]:
        print(f"note: {n}")
    print(f"\nreproduce: {r['command']}")


# -- main ---------------------------------------------------------------------------------------------------


def build_workload(args: argparse.Namespace, vocab: int, context: int) -> tuple[ScaledTrace, dict[str, Any]]:
    whole = load_trace(args.trace)
    picked = sample_groups(whole, float(Fraction(args.sample)), args.sample_seed)[: args.requests]
    max_input = args.max_input_tokens or context - args.max_output_tokens - 1  # prompt + output fit the context
    cfg = ScaleConfig(block_tokens=args.block_tokens, low=args.low, vocab=vocab, seed=args.seed,
                      time_scale=args.time_scale, max_output_tokens=args.max_output_tokens,
                      max_input_tokens=max_input, long_prompts=args.long_prompts)
    st = scale_trace(picked, cfg)
    if not st.requests:
        raise SystemExit("no requests left after sampling and filtering")
    prompts = [len(x.prompt) for x in st.requests]
    kept = [picked[x.index] for x in st.requests]
    return st, {
        "trace": str(args.trace), "sample": args.sample, "sample_seed": args.sample_seed, "seed": args.seed,
        "requests": len(st.requests),
        "block_tokens": args.block_tokens, "time_scale": args.time_scale, "span_s": st.requests[-1].arrival_s,
        "prompt_tokens": sum(prompts), "mean_prompt": statistics.fmean(prompts), "max_prompt": max(prompts),
        "output_tokens": sum(x.max_tokens for x in st.requests), "max_input_tokens": max_input,
        "long_prompts": args.long_prompts, "skipped": len(st.skipped), "truncated": len(st.truncated),
        "token_range": [args.low, vocab],
        "reusable_scaled": reusable_fraction(scaled_items(st.requests), args.block_tokens),
        "reusable_kv_blocks": reusable_fraction(scaled_items(st.requests), args.block_tokens, KV_BLOCK),
        "reusable_unscaled": reusable_fraction(trace_items(kept), TRACE_BLOCK_TOKENS),
        "reusable_whole_trace": reusable_fraction(trace_items(whole), TRACE_BLOCK_TOKENS),
    }


def mesh_settings(args: argparse.Namespace, model: str, workload: dict[str, Any]) -> MeshSettings:
    # Queue limits sized to the whole workload: a replay measures latency, not the queue's limits.
    queue = {"max_queued_requests": workload["requests"] + 16,
             "max_queued_prompt_tokens": workload["prompt_tokens"] + 4096}
    return MeshSettings(model, args.transport, args.colocated,
                        args.threads if args.colocated else max(1, args.threads // 2),
                        args.kv_cache_mb, args.host_cache_mb, args.disk_cache_mb, queue)


def warm_prompts(seed: int, low: int, vocab: int) -> list[list[int]]:
    """Two short prompts sent before the clock starts; they share no block with the trace's."""
    rng = random.Random(f"warm:{seed}")
    return [[rng.randrange(low, vocab) for _ in range(32)] for _ in range(2)]


def command_line(args: argparse.Namespace) -> str:
    parts = ["python -m bench.bench_replay"] + ([f"--trace {args.trace}"] if args.trace != DEFAULT_TRACE else [])
    parts += [f"--block-tokens {args.block_tokens}", f"--sample {args.sample}", f"--sample-seed {args.sample_seed}",
             f"--time-scale {args.time_scale:g}", f"--model {args.model}",
             f"--threads {args.threads}", f"--transport {args.transport}", f"--seed {args.seed}",
             f"--kv-cache-mb {args.kv_cache_mb}", f"--host-cache-mb {args.host_cache_mb}",
             f"--disk-cache-mb {args.disk_cache_mb}", f"--max-output-tokens {args.max_output_tokens}",
             f"--long-prompts {args.long_prompts}", f"--low {args.low}"]
    parts += [f"--requests {args.requests}"] if args.requests else []
    parts += [f"--max-input-tokens {args.max_input_tokens}"] if args.max_input_tokens else []
    parts += ["--colocated"] if args.colocated else []
    parts += ["--placement"] if getattr(args, "placement", False) else []
    parts += ["--lookup"] if getattr(args, "lookup", False) else []
    parts += [f"--disagg {args.disagg}"] if getattr(args, "disagg", 0) else []
    return " ".join(parts)


def fraction(text: str) -> str:
    """argparse type: a fraction in (0, 1] as a decimal or p/q, kept as written (the report repeats it)."""
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError) as exc:
        raise argparse.ArgumentTypeError(f"not a fraction: {text!r}") from exc
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return text


def workload_parser(description: str | None) -> argparse.ArgumentParser:
    """The options that pick the workload and the mesh (bench.replay_sweep adds its own to these)."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="a Mooncake-format JSONL trace")
    ap.add_argument("--block-tokens", type=int, default=16, help="tokens per 512-token trace block (b)")
    ap.add_argument("--sample", type=fraction, default=DEFAULT_SAMPLE, help="fraction of prefix groups (requests "
                    f"sharing a first block) kept, as 0.02 or 1/48; 1 = all (default {DEFAULT_SAMPLE})")
    ap.add_argument("--sample-seed", type=int, default=DEFAULT_SAMPLE_SEED, help="which groups are kept")
    ap.add_argument("--requests", type=int, default=None, help="then keep only the first N requests")
    ap.add_argument("--time-scale", type=float, default=DEFAULT_TIME_SCALE,
                    help="replay the trace's clock this many times faster")
    ap.add_argument("--model", default="smollm2", help="'smollm2', a .gguf file or a Hugging Face directory")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads in all: a disaggregated mesh gives each "
                    "worker half (at least 1), a co-located worker gets all")
    ap.add_argument("--transport", choices=("ipc", "inproc"), default="ipc",
                    help="ipc: one process per service; inproc: the whole mesh in this process")
    ap.add_argument("--colocated", action="store_true", help="one prefill+decode worker instead of a P/D pair")
    ap.add_argument("--kv-cache-mb", type=int, default=512, help="device KV pool per worker")
    ap.add_argument("--host-cache-mb", type=int, default=256, help="cache daemon DRAM tier")
    ap.add_argument("--disk-cache-mb", type=int, default=2048, help="cache daemon disk tier")
    ap.add_argument("--max-output-tokens", type=int, default=64, help="cap on a scaled output length")
    ap.add_argument("--max-input-tokens", type=int, default=None,
                    help="longer prompts are skipped or truncated (default: the model context - max output - 1)")
    ap.add_argument("--long-prompts", choices=("skip", "truncate"), default="skip")
    ap.add_argument("--low", type=int, default=256, help="token ids are drawn from [low, vocab): above the "
                    "model's special tokens")
    ap.add_argument("--seed", type=int, default=0, help="the token ids each block id stands for")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="client wait per request")
    ap.add_argument("--no-plots", action="store_true", help="no PNG figures beside the JSON (bench/plots.py)")
    return ap


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = workload_parser(__doc__)
    ap.add_argument("--placement", action="store_true",
                    help="two prefill workers, cache on: router placement cache_aware vs least_loaded")
    ap.add_argument("--lookup", action="store_true",
                    help="cache on, a job's prefix looked up as it enters the engine's queue (the default) vs as "
                         "it arrives at the worker (lookup_ahead_steps = 0)")
    ap.add_argument("--disagg", type=int, default=0, metavar="N",
                    help="conditional disaggregation: the P/D pair with the router's local_prefill_max_tokens = N "
                         "against N = 0 (every prompt on the prefill worker), cache on")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON report (default: bench/results/replay[-mode].json)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    path = resolve_model(args.model)
    mc = model_config_at(path)
    st, workload = build_workload(args, mc.vocab_size, mc.max_position_embeddings)
    settings = mesh_settings(args, str(path), workload)
    mode = "placement" if args.placement else "lookup" if args.lookup else "disagg" if args.disagg else "cache"
    if args.disagg and args.colocated:
        raise SystemExit("--disagg compares placements on a P/D pair: not with --colocated")
    if args.disagg:
        arms = [Arm("conditional", True, router_options={"local_prefill_max_tokens": args.disagg}),
                Arm("always remote", True)]
    elif args.placement:
        arms = [Arm(p, True, 2, {"placement": p}) for p in ("cache_aware", "least_loaded")]
    elif args.lookup:
        arms = [Arm("lookup at start", True), Arm("lookup at arrival", True, worker_options={"lookup_ahead_steps": 0})]
    else:
        arms = [Arm("cache on", True), Arm("cache off", False)]
    warm = warm_prompts(args.seed, args.low, mc.vocab_size)
    print(f"{workload['requests']} requests, {workload['prompt_tokens']} prompt tokens over "
          f"{workload['span_s']:.0f} s; arms: {', '.join(a.name for a in arms)}", file=sys.stderr)

    r: dict[str, Any] = {
        "mode": mode, "command": command_line(args), "model": str(path),
        "model_name": Path(path).stem, "workload": workload, "arms": {}, "rows": {}, "notes": [],
        "mesh": dataclasses.asdict(settings) | {"kv_block": KV_BLOCK},
        "env": {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
                "loadavg": os.getloadavg()}}
    for arm in arms:
        print(f"{arm.name} ...", file=sys.stderr)
        rows = run_arm(settings, arm, st.requests, warm, args.timeout_s)
        r["rows"][arm.name], r["arms"][arm.name] = rows, summarize(rows)
    r["ratios"] = ratios(r["arms"], workload["reusable_kv_blocks"], mode)
    print_report(r)
    out = args.out or RESULTS / f"replay{'' if mode == 'cache' else '-' + mode}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(r, indent=2))
    print(f"wrote {out}")
    if not args.no_plots:
        from bench import plots

        plots.write("replay", r, out)


if __name__ == "__main__":
    main()
