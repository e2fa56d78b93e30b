"""The Mooncake trace replayed at several loads against each scheduling policy: does each one pay under load?

    python -m bench.replay_sweep [--loads 0.5,1,2,4] [--slo-s 5] [--requests N] [--capacity REQ_S]
                                 [--arms full,cache-off,...] [--repeats N] [bench_replay's workload options]

Load is relative to the mesh's measured capacity: first the whole workload is sent at once to the mesh without
its cache and without admission control, and the requests it completes per second are 1x (or give it, from an
earlier run, with --capacity). At load L the trace's arrivals are stretched or compressed so requests arrive at
L times that rate. Each load then runs every arm on a fresh mesh (fresh cache):

| arm | what differs from the full policy |
|---|---|
| full | nothing: cache on (device pool, host and disk tiers), fetch-or-recompute, conditional |
|      | disaggregation (--local-prefill N), the TTFT SLO at admission |
| cache off | no prefix caching, no cache daemon |
| always fetch | every cached prefix loaded (worker fetch_policy = "always") |
| always remote | every prompt prefilled on the prefill worker (local_prefill_max_tokens = 0) |
| always local | every prompt prefilled on its decode worker (the router's prefill_site = "local") |
| no admission | no TTFT SLO at the router and no queue-wait shedding: every request is queued |

Per arm and load it prints the hit rate by tier over the reusable fraction (KV blocks) — of the whole trace (the
target's measure), and of what the answered requests could reuse ("servable": a refused request computes nothing
for its conversation's later turns to hit) — TTFT p50/p99 of the
admitted requests, refusals, admitted requests over the SLO, and goodput: requests answered within the SLO per
second of the run. Then the issue's targets, each marked met or not. A 2-core machine's noise between identical
runs is ~2x in TTFT p50 (bench/results): `--repeats N` runs every arm N times at each load (arms interleaved) and
pools them — percentiles and hit rates over every request of every run, counts summed, goodput over the summed
wall time, each run's goodput printed beside it.
Figures (goodput, TTFT p50/p99 and hit rate against load, a line per arm) go beside the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.bench_mesh import table
from bench.bench_replay import (
    KV_BLOCK,
    RESULTS,
    TIERS,
    Arm,
    build_workload,
    command_line,
    mesh_settings,
    run_arm,
    summarize,
    warm_prompts,
    workload_parser,
)
from bench.trace import ScaledRequest, reusable_fraction, scaled_items
from deepinfer.loading.fetch import resolve_model
from deepinfer.loading.identity import model_config_at

ARMS = ("full", "cache off", "always fetch", "always remote", "always local", "no admission")
# Router options: no shedding by the backlog's predicted wait (a topology file cannot say None, TOML has no null).
UNLIMITED = {"max_queue_wait_s": 1e9}


def arms_for(slo_s: float, local_prefill: int) -> dict[str, Arm]:
    policy = {"default_ttft_slo_s": slo_s, "local_prefill_max_tokens": local_prefill}
    return {
        "full": Arm("full", True, router_options=policy),
        "cache off": Arm("cache off", False, router_options=policy),
        "always fetch": Arm("always fetch", True, router_options=policy, worker_options={"fetch_policy": "always"}),
        "always remote": Arm("always remote", True, router_options={**policy, "local_prefill_max_tokens": 0}),
        "always local": Arm("always local", True, router_options={**policy, "prefill_site": "local"}),
        "no admission": Arm("no admission", True, router_options={"local_prefill_max_tokens": local_prefill,
                                                                  **UNLIMITED}),
    }


def at_rate(requests: list[ScaledRequest], req_s: float) -> list[ScaledRequest]:
    """The same requests with their arrivals scaled so that they come at `req_s` on average."""
    span = requests[-1].arrival_s
    if span <= 0:
        return requests
    factor = (len(requests) / span) / req_s
    return [dataclasses.replace(r, arrival_s=r.arrival_s * factor) for r in requests]


def servable_reusable(requests: list[ScaledRequest], rows: list[dict[str, Any]], block_tokens: int) -> float:
    """The reusable fraction (in KV blocks) of the requests the mesh answered, counting only prefixes that an
    earlier answered request had: a refused request computes nothing, so its conversation's later turns have
    nothing to hit. The trace's reusable fraction counts reuse from every request, refused or not."""
    answered = {r["index"] for r in rows if "error" not in r}
    return reusable_fraction(scaled_items([q for q in requests if q.index in answered]), block_tokens, KV_BLOCK)


def with_goodput(rows: list[dict[str, Any]], slo_s: float, reusable_kv: float,
                 servable_kv: float | None = None) -> dict[str, Any]:
    """Summary figures of one arm at one load, with goodput and the hit rate over the trace's reusable fraction
    (`hit_of_reusable`, the target's measure) and over what the answered requests could reuse (`servable_kv`, see
    `servable_reusable`; `hit_of_servable`)."""
    s = summarize(rows)
    ok = [r for r in rows if "error" not in r]
    met = sum(1 for r in ok if r["ttft_s"] is not None and r["ttft_s"] <= slo_s)
    s.update(met_slo=met, admitted_over_slo=len(ok) - met,
             refused=s["errors"].get("overloaded", 0),
             goodput_req_s=met / s["wall_s"] if s["wall_s"] else None,
             hit_of_reusable=s["hit_rate"] / reusable_kv if s["hit_rate"] is not None and reusable_kv else None,
             hit_of_servable=s["hit_rate"] / servable_kv if s["hit_rate"] is not None and servable_kv else None)
    # No run ends before its last arrival: every request answered within its SLO by then is the most goodput can be.
    last_arrival = max((r.get("arrival_s", 0.0) for r in rows), default=0.0)
    s["goodput_ceiling_req_s"] = len(rows) / last_arrival if last_arrival > 0 else None
    return s


def pooled(runs: list[list[dict[str, Any]]], slo_s: float, reusable_kv: float,
           servable_kv: list[float]) -> dict[str, Any]:
    """One arm at one load over several runs of the same arrivals: percentiles and hit rates over every request of
    every run, counts summed, per-second figures over the runs' summed wall time, and each run's goodput."""
    if len(runs) == 1:
        return with_goodput(runs[0], slo_s, reusable_kv, servable_kv[0])
    s = with_goodput([r for rows in runs for r in rows], slo_s, reusable_kv, statistics.fmean(servable_kv))
    each = [with_goodput(rows, slo_s, reusable_kv) for rows in runs]
    wall = sum(e["wall_s"] for e in each)
    s.update(wall_s=wall, req_s=s["ok"] / wall if wall else None, goodput_req_s=s["met_slo"] / wall if wall else None,
             goodput_runs=[e["goodput_req_s"] for e in each], runs=len(runs),
             goodput_ceiling_req_s=each[0]["goodput_ceiling_req_s"])
    return s


def targets(points: dict[str, dict[str, dict[str, Any]]], reusable_kv: float) -> list[tuple[str, bool | None]]:
    """The issue's targets at every load point: (what, met) with None where an arm needed was not run."""
    out: list[tuple[str, bool | None]] = []
    le = lambda a, b: None if a is None or b is None else a <= b
    for load, arms in points.items():
        full, off = arms.get("full"), arms.get("cache off")
        if full is not None and full["hit_of_reusable"] is not None:
            servable = full.get("hit_of_servable")
            also = f"; {servable:.2f} of what the answered requests could reuse" if servable is not None else ""
            out.append((f"{load}x: hit rate >= 0.95 of reusable (full: {full['hit_of_reusable']:.2f}{also})",
                        full["hit_of_reusable"] >= 0.95))
        if full is not None and off is not None:
            for p in ("p50", "p99"):
                out.append((f"{load}x: cache-on TTFT {p} <= cache-off's ({_s(full[f'ttft_{p}_s'])} vs "
                            f"{_s(off[f'ttft_{p}_s'])})", le(full[f"ttft_{p}_s"], off[f"ttft_{p}_s"])))
            if reusable_kv >= 0.3 and full["ttft_p50_s"] and off["ttft_p50_s"]:
                gain = off["ttft_p50_s"] / full["ttft_p50_s"]
                out.append((f"{load}x: TTFT p50 >= 1.3x better with the cache ({gain:.2f}x)", gain >= 1.3))
        for name in ("always remote", "always local"):
            other = arms.get(name)
            if full is not None and other is not None:
                out.append((f"{load}x: conditional goodput >= {name}'s ({_g(full)} vs {_g(other)})",
                            le(other["goodput_req_s"], full["goodput_req_s"])))
        free = arms.get("no admission")
        if float(load) >= 2 and full is not None and free is not None and free["goodput_req_s"]:
            ratio = (full["goodput_req_s"] or 0.0) / free["goodput_req_s"]
            ceiling = full.get("goodput_ceiling_req_s")
            bound = f"; at most {ceiling / free['goodput_req_s']:.2f}x: every request answered by the last arrival" \
                if ceiling else ""
            out.append((f"{load}x: goodput >= 1.5x no admission's ({ratio:.2f}x{bound})", ratio >= 1.5))
        if full is not None:
            out.append((f"{load}x: every admitted request within its SLO (over: {full['admitted_over_slo']})",
                        full["admitted_over_slo"] == 0))
    return out


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} s"


def _g(a: dict[str, Any]) -> str:
    return "-" if a["goodput_req_s"] is None else f"{a['goodput_req_s']:.3f}/s"


def print_report(r: dict[str, Any]) -> None:
    w, pc = r["workload"], (lambda v: "-" if v is None else f"{100 * v:.1f}%")
    f = lambda v, spec=".2f": "-" if v is None else format(v, spec)
    print(f"\nMooncake trace sweep, {r['model_name']}: {w['requests']} requests, {w['prompt_tokens']} prompt tokens, "
          f"{pc(w['reusable_kv_blocks'])} reusable in KV blocks; TTFT SLO {r['slo_s']:g} s; capacity "
          f"{r['capacity_req_s']:.3f} req/s ({r['capacity_source']})")
    rows = []
    for load, arms in r["points"].items():
        for name, a in arms.items():
            rows.append([f"{load}x", name, str(a["ok"]), str(a["refused"]), str(a["admitted_over_slo"]),
                         pc(a["hit_rate"]), *(pc(a["hit_rate_by_tier"].get(t)) for t in TIERS),
                         f(a["hit_of_reusable"]), f(a.get("hit_of_servable")), f(a["ttft_p50_s"]), f(a["ttft_p99_s"]),
                         f(a["goodput_req_s"], ".3f"),
                         "/".join(f(g, ".3f") for g in a.get("goodput_runs", [a["goodput_req_s"]]))])
    table(["load", "arm", "ok", "refused", "over SLO", "hit", *TIERS, "of reusable", "of servable", "TTFT p50 s",
           "TTFT p99 s", "goodput/s", "each run"], rows)
    print("\ntargets:")
    for what, met in r["targets"]:
        print(f"  [{'met' if met else 'n/a' if met is None else 'NOT met'}] {what}")
    print(f"\nreproduce: {r['command']}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = workload_parser(__doc__)
    ap.add_argument("--loads", default="0.5,1,2,4", help="loads, as multiples of the measured capacity")
    ap.add_argument("--slo-s", type=float, default=5.0, help="the tenants' TTFT SLO, seconds")
    ap.add_argument("--local-prefill", type=int, default=512, metavar="N",
                    help="conditional disaggregation: prompts leaving at most N tokens to compute may prefill on "
                         "the decode worker (the router's local_prefill_max_tokens)")
    ap.add_argument("--capacity", type=float, default=None, metavar="REQ_S",
                    help="1x in requests/s (default: measured first, the workload at once, cache and admission off)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"a subset of: {', '.join(ARMS)}")
    ap.add_argument("--repeats", type=int, default=1, help="runs of every arm at every load, pooled (see pooled)")
    ap.add_argument("--out", type=Path, default=RESULTS / "replay-sweep.json", help="JSON report")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    loads = [x.strip() for x in args.loads.split(",") if x.strip()]
    if not loads or not all(float(x) > 0 for x in loads):
        raise SystemExit(f"--loads: positive multiples, got {args.loads!r}")
    names = [x.strip() for x in args.arms.split(",") if x.strip()]
    if unknown := [n for n in names if n not in ARMS]:
        raise SystemExit(f"--arms: unknown {unknown}; choose from {', '.join(ARMS)}")
    path = resolve_model(args.model)
    mc = model_config_at(path)
    st, workload = build_workload(args, mc.vocab_size, mc.max_position_embeddings)
    settings = mesh_settings(args, str(path), workload)
    warm = warm_prompts(args.seed, args.low, mc.vocab_size)
    all_arms = arms_for(args.slo_s, args.local_prefill)
    reusable = workload["reusable_kv_blocks"]
    r: dict[str, Any] = {"mode": "sweep", "model": str(path), "model_name": Path(path).stem, "workload": workload,
                         "slo_s": args.slo_s, "local_prefill": args.local_prefill, "points": {}, "rows": {},
                         "env": {"python": platform.python_version(), "machine": platform.machine(),
                                 "cpus": os.cpu_count(), "loadavg": os.getloadavg()}}
    if args.capacity is not None:
        r["capacity_req_s"], r["capacity_source"] = args.capacity, "given"
    else:
        print("capacity: the workload at once, cache off, no admission ...", file=sys.stderr)
        burst = [dataclasses.replace(x, arrival_s=0.0) for x in st.requests]
        rows = run_arm(settings, Arm("capacity", False, router_options=UNLIMITED), burst, warm, args.timeout_s)
        cap = summarize(rows)
        r["capacity_req_s"], r["capacity_source"] = cap["req_s"], f"measured: {cap['ok']} in {cap['wall_s']:.0f} s"
        r["capacity"] = cap
    r["command"] = (command_line(args).replace("bench.bench_replay", "bench.replay_sweep") +
                    f" --loads {args.loads} --slo-s {args.slo_s:g} --local-prefill {args.local_prefill} "
                    f"--capacity {r['capacity_req_s']:.4f} --arms '{','.join(names)}' --repeats {args.repeats}")
    for load in loads:
        requests = at_rate(st.requests, float(load) * r["capacity_req_s"])
        r["points"][load], r["rows"][load] = {}, {name: [] for name in names}
        for rep in range(args.repeats):  # arms interleaved, so a slow spell of the machine falls on all of them
            for name in names:
                print(f"{load}x, {name}, run {rep + 1} of {args.repeats} ...", file=sys.stderr)
                r["rows"][load][name].append(run_arm(settings, all_arms[name], requests, warm, args.timeout_s))
        for name, runs in r["rows"][load].items():
            servable = [servable_reusable(requests, rows, args.block_tokens) for rows in runs]
            r["points"][load][name] = pooled(runs, args.slo_s, reusable, servable)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(r, indent=2))  # after each load: a long sweep cut short keeps its points
    r["targets"] = targets(r["points"], reusable)
    print_report(r)
    args.out.write_text(json.dumps(r, indent=2))
    print(f"wrote {args.out}")
    if not args.no_plots:
        from bench import plots

        plots.write("sweep", r, args.out)


if __name__ == "__main__":
    main()
