"""bench_replay's workload through the cluster twin (deepinfer/twin), writing bench_replay's JSON.

    python -m bench.twin_replay --colocated [bench_replay's workload and mesh options] [--costs NAME|PATH]
                                [--placement] [--real PATH | --validate] [--out PATH]

The same options pick the same requests (bench_replay.workload_parser / build_workload) and the same mesh
sizes (KV pool, host and disk tiers, queue limits), so a replay can be run on both and compared: `--real PATH`
compares with a bench_replay JSON of the same command, `--validate` runs the real mesh now (bench_replay's
run_arm) and compares. The comparison is printed and kept under "validation": hit rate by tier (tokens; the
twin runs the same cache code, so they should be equal), TTFT p50/p99 and throughput (twin / real; the target
is within 15%).

The twin models co-located workers only: without --colocated it runs them anyway and says so in "notes" (the
real default is a P/D pair). --placement runs two co-located workers, cache_aware against least_loaded.

Also reported ("twin"): the cost file used, and the twin's own speed — simulated requests and events per wall
second of its loop.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import structlog

from bench.bench_replay import (
    KV_BLOCK,
    RESULTS,
    TIERS,
    Arm,
    build_workload,
    command_line,
    mesh_settings,
    print_report,
    ratios,
    run_arm,
    summarize,
    warm_prompts,
    workload_parser,
)
from deepinfer.config.kv import KvSpec
from deepinfer.loading.fetch import resolve_model
from deepinfer.loading.identity import model_config_at
from deepinfer.services.router_core import RouterConfig
from deepinfer.twin.cluster import ClusterTwin, TwinConfig, TwinRequest
from deepinfer.twin.costs import COSTS_DIR, CostModel, load_costs
from deepinfer.twin.worker import WorkerSettings

DEFAULT_COSTS = "cpu-smollm2"
TOLERANCE = 0.15  # TTFT p50/p99 and throughput, twin against real


def twin_arm(args: argparse.Namespace, arm: Arm, router_options: dict[str, Any], kv: KvSpec, context: int,
             costs: CostModel, requests: list[TwinRequest],
             warm: list[list[int]]) -> tuple[list[dict[str, Any]], dict[str, float]]:
    num_blocks = kv.blocks_for_budget(args.kv_cache_mb << 20)
    ws = WorkerSettings(num_blocks=num_blocks, block_size=KV_BLOCK, max_num_seqs=128, max_num_batched_tokens=2048,
                        max_model_len=min(context, num_blocks * KV_BLOCK), real_block_nbytes=kv.block_nbytes,
                        prefix_caching=arm.cache, lookup_ahead_steps=arm.worker_options.get("lookup_ahead_steps", 2),
                        fetch_always=arm.worker_options.get("fetch_policy") == "always", transport=args.transport)
    router = RouterConfig(block_size=KV_BLOCK, **{**router_options, **arm.router_options})
    cfg = TwinConfig(ws, num_workers=arm.num_prefill, router=router, kvcache=arm.cache,
                     host_cache_bytes=args.host_cache_mb << 20, disk_cache_bytes=args.disk_cache_mb << 20,
                     timeout_s=args.timeout_s)
    twin = ClusterTwin(cfg, costs)
    try:
        t0 = time.perf_counter()
        rows = twin.replay(requests, warm)
        wall = time.perf_counter() - t0
    finally:
        twin.close()
    return rows, {"wall_s": wall, "requests_per_wall_s": len(requests) / wall if wall else 0.0,
                  "events_per_wall_s": twin.loop.events_run / wall if wall else 0.0,
                  "messages": twin.messages, "virtual_s": twin.loop.now}


def compare(twin: dict[str, dict[str, Any]], real: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per arm both have: hit rate by tier (twin − real, tokens over prompt tokens) and twin / real for TTFT
    p50 / p99 and request throughput, each marked within TOLERANCE or not."""
    out: dict[str, Any] = {}
    for name in twin.keys() & real.keys():
        t, r = twin[name], real[name]
        ratio = {k: (t[k] / r[k] if t.get(k) is not None and r.get(k) else None)
                 for k in ("ttft_p50_s", "ttft_p99_s", "req_s")}
        tiers = {tier: (t["hit_rate_by_tier"].get(tier) or 0.0) - (r["hit_rate_by_tier"].get(tier) or 0.0)
                 for tier in TIERS}
        out[name] = {"twin_over_real": ratio, "hit_rate_by_tier_diff": tiers,
                     "hit_tokens_equal": t["cached_tokens"] == r["cached_tokens"],
                     "within_tolerance": all(v is not None and abs(v - 1) <= TOLERANCE for v in ratio.values())}
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = workload_parser(__doc__)
    ap.add_argument("--costs", default=DEFAULT_COSTS, help=f"a cost file, or its name under {COSTS_DIR}")
    ap.add_argument("--placement", action="store_true", help="two co-located workers: cache_aware vs least_loaded")
    ap.add_argument("--real", type=Path, default=None,
                    help="a bench_replay JSON of the same workload to compare with")
    ap.add_argument("--validate", action="store_true", help="run the real mesh now (bench_replay) and compare")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON report (default: bench/results/twin-replay[-mode].json)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    args = parse_args(argv)
    path = resolve_model(args.model)
    mc = model_config_at(path)
    st, workload = build_workload(args, mc.vocab_size, mc.max_position_embeddings)
    settings = mesh_settings(args, str(path), workload)
    kv = KvSpec.for_model(mc, KV_BLOCK, "float32")
    costs = load_costs(args.costs)
    mode = "placement" if args.placement else "cache"
    arms = ([Arm(p, True, 2, {"placement": p}) for p in ("cache_aware", "least_loaded")] if args.placement
            else [Arm("cache on", True), Arm("cache off", False)])
    requests = [TwinRequest(r.arrival_s, r.prompt, r.max_tokens, r.index) for r in st.requests]
    warm = warm_prompts(args.seed, args.low, mc.vocab_size)
    notes = [] if args.colocated else ["twin: P/D pairs are not modelled yet; co-located workers ran instead"]
    r: dict[str, Any] = {
        "mode": mode, "command": command_line(args).replace("bench.bench_replay", "bench.twin_replay") +
        f" --costs {args.costs}", "model": str(path), "model_name": Path(path).stem, "workload": workload,
        "arms": {}, "rows": {}, "notes": notes,
        "mesh": dataclasses.asdict(settings) | {"kv_block": KV_BLOCK, "transport": f"twin ({args.transport} costs)",
                                                 "colocated": True},
        "twin": {"costs": costs.name, "costs_machine": costs.machine, "speed": {}}}
    for arm in arms:
        rows, speed = twin_arm(args, arm, settings.router_options, kv, mc.max_position_embeddings, costs, requests,
                               warm)
        r["rows"][arm.name], r["arms"][arm.name] = rows, summarize(rows)
        r["twin"]["speed"][arm.name] = speed
    r["ratios"] = ratios(r["arms"], workload["reusable_kv_blocks"], mode)
    print_report(r)
    for name, sp in r["twin"]["speed"].items():
        print(f"twin speed, {name}: {sp['requests_per_wall_s']:.0f} simulated requests / wall s "
              f"({sp['events_per_wall_s']:.0f} events / s, {sp['wall_s']:.2f} s for {sp['virtual_s']:.1f} virtual s)")
    real: dict[str, Any] | None = None
    if args.real is not None:
        real = json.loads(args.real.read_text())["arms"]
    elif args.validate:
        real_settings = dataclasses.replace(settings, colocated=True)
        real = {a.name: summarize(run_arm(real_settings, a, st.requests, warm, args.timeout_s)) for a in arms}
    if real is not None:
        r["validation"] = compare(r["arms"], real)
        print("\nvalidation, twin against the real mesh:")
        for name, v in r["validation"].items():
            f = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
            ratio = v["twin_over_real"]
            print(f"  {name}: hit tokens equal {v['hit_tokens_equal']}, hit rate by tier twin-real "
                  f"{ {k: round(d, 4) for k, d in v['hit_rate_by_tier_diff'].items()} }, "
                  f"TTFT p50 {f(ratio['ttft_p50_s'])}"
                  f", p99 {f(ratio['ttft_p99_s'])}, req/s {f(ratio['req_s'])}; within {TOLERANCE:.0%}: "
                  f"{v['within_tolerance']}")
    out = args.out or RESULTS / f"twin-replay{'' if mode == 'cache' else '-' + mode}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(r, indent=2))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
