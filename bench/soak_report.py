"""The soak's measurements and its report: process samples, the router's mesh state, TTFT around faults, and
RSS growth per service incarnation."""

from __future__ import annotations

import os
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.soak_faults import FaultRecord
from bench.soak_load import Outcome

WARMUP_S = 60.0  # RSS is compared from this long after the load (or a restarted service) started
WINDOW_S = 60.0  # ... over its first and its last this many seconds


def proc_stat(pid: int) -> tuple[int, int] | None:
    """(RSS KiB, open fds) of a live process, None if it is gone."""
    try:
        rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                   if line.startswith("VmRSS:"))
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return None


def mesh_state(router_log: Path) -> dict[str, Any]:
    """The router's latest "mesh state" log line: each worker's (free, total) KV blocks, requests in flight,
    and the line itself."""
    lines = [ln for ln in router_log.read_text(errors="replace").splitlines() if "mesh state" in ln]
    if not lines:
        return {}
    inflight = re.search(r"inflight\W+(\d+)", lines[-1])
    return {"blocks": {name: (int(free), int(total))
                       for name, free, total in re.findall(r"'([\w-]+)': '(\d+)/(\d+)'", lines[-1])},
            "inflight": int(inflight.group(1)) if inflight else None, "line": lines[-1][-400:]}


def percentiles(values: list[float]) -> dict[str, Any]:
    """n, p50 and p99 (nearest rank), in seconds."""
    if not values:
        return {"n": 0}
    v = sorted(values)
    rank = lambda q: v[min(len(v) - 1, int(q * len(v)))]  # noqa: E731
    return {"n": len(v), "p50_s": round(rank(0.50), 3), "p99_s": round(rank(0.99), 3)}


def ttft_around_faults(records: list[Outcome], faults: list[FaultRecord], window_s: float) -> dict[str, Any]:
    """TTFT of streams sent within `window_s` after a fault ("during", and per fault kind) and of the others
    ("outside")."""
    def fault_of(t: float) -> FaultRecord | None:
        return next((f for f in reversed(faults) if f.t <= t < f.t + window_s), None)

    during: dict[str, list[float]] = defaultdict(list)
    outside: list[float] = []
    for r in records:
        if r.ttft_s is None:
            continue
        f = fault_of(r.t)
        if f is None:
            outside.append(r.ttft_s)
        else:
            during["all"].append(r.ttft_s)
            during[f.kind].append(r.ttft_s)
    return {"window_s": window_s, "outside": percentiles(outside),
            "during": {kind: percentiles(v) for kind, v in sorted(during.items())}}


def refused_windows(records: list[Outcome], faults: list[FaultRecord], gap_s: float = 2.0) -> list[dict[str, Any]]:
    """When the load's requests were refused: refusals less than `gap_s` apart merged into one window, with
    its refusals by outcome and the last fault that started before it. (The clients retry 0.1 s after a
    refusal, so a window's length says more than its count.)"""
    windows: list[dict[str, Any]] = []
    for r in sorted((r for r in records if r.outcome.startswith("refused")), key=lambda r: r.t):
        if windows and r.t - windows[-1]["to_t"] <= gap_s:
            w = windows[-1]
        else:
            before = [f for f in faults if f.t <= r.t]
            w = {"from_t": r.t, "to_t": r.t, "refused": {},
                 "after_fault": f"{before[-1].kind} {before[-1].target} at {before[-1].t:.0f}s" if before else None}
            windows.append(w)
        w["to_t"] = r.t
        w["refused"][r.outcome] = w["refused"].get(r.outcome, 0) + 1
    for w in windows:
        w["from_t"], w["to_t"] = round(w["from_t"], 1), round(w["to_t"], 1)
    return windows


def rss_growth(samples: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per service, per incarnation (pid) it was sampled in: mean RSS and fds over the first WINDOW_S after
    its warm-up against the last WINDOW_S it lived. An incarnation whose steady life is under 2 × WINDOW_S
    is listed without figures ("too short")."""
    series: dict[tuple[str, int], list[tuple[float, int, int]]] = defaultdict(list)
    for s in samples:
        for name, p in s["procs"].items():
            series[(name, p["pid"])].append((s["t"], p["rss_kib"], p["fds"]))
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for (name, pid), pts in sorted(series.items(), key=lambda kv: (kv[0][0], kv[1][0][0])):
        born = pts[0][0]
        steady = [p for p in pts if p[0] >= (WARMUP_S if born <= 0 else born + WARMUP_S)]
        row: dict[str, Any] = {"pid": pid, "from_t": round(born), "to_t": round(pts[-1][0])}
        if not steady or steady[-1][0] - steady[0][0] < 2 * WINDOW_S:
            row["too_short"] = True
        else:
            first = [p for p in steady if p[0] < steady[0][0] + WINDOW_S]
            last = [p for p in steady if p[0] > steady[-1][0] - WINDOW_S]
            a, b = statistics.mean(p[1] for p in first), statistics.mean(p[1] for p in last)
            row.update(rss_first_mib=round(a / 1024, 1), rss_last_mib=round(b / 1024, 1),
                       growth_mib=round((b - a) / 1024, 1), growth_pct=round(100 * (b - a) / a, 1),
                       fds_first=round(statistics.mean(p[2] for p in first), 1),
                       fds_last=round(statistics.mean(p[2] for p in last), 1))
        out[name].append(row)
    return dict(out)


def free_blocks_drift(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Per worker: mean free KV blocks over the first minute after warm-up and over the last minute (under
    load, so not all free: flat is what matters)."""
    steady = [s for s in samples if s["t"] >= WARMUP_S and s["free_blocks"]]
    if len(steady) < 2:
        return {}
    first = [s for s in steady if s["t"] < steady[0]["t"] + WINDOW_S]
    last = [s for s in steady if s["t"] > steady[-1]["t"] - WINDOW_S]
    out = {}
    for name in sorted({n for s in steady for n in s["free_blocks"]}):
        a = [s["free_blocks"][name] for s in first if name in s["free_blocks"]]
        b = [s["free_blocks"][name] for s in last if name in s["free_blocks"]]
        if a and b:
            out[name] = {"first_min": round(statistics.mean(a)), "last_min": round(statistics.mean(b))}
    return out


def print_summary(report: dict[str, Any]) -> None:
    print(f"\n=== soak: {report['command']}")
    print(f"faults: {report['fault_counts']}")
    print(f"load requests: {report['outcomes']}")
    print(f"requests lost: {report['lost']['total']} (load {report['lost']['load']}, fault requests "
          f"{report['lost']['fault_requests']}); refused with a typed retryable error: {report['refused']}")
    for why, n in report["refused_why"].items():
        print(f"  refused {n}x: {why}")
    for w in report["refused_windows"]:
        print(f"  refused from {w['from_t']}s to {w['to_t']}s (after {w['after_fault']}): {w['refused']}")
    for r in report["lost_requests"][:20]:
        print(f"  LOST t={r['t']:.1f}s {r['kind']}: {r['outcome']} {r['detail']}")
    t = report["ttft"]
    print(f"TTFT outside faults: {t['outside']}")
    for kind, p in t["during"].items():
        print(f"TTFT within {t['window_s']:g} s after a fault ({kind}): {p}")
    print(f"greedy mismatches: {len(report['greedy_mismatches'])}")
    for f in report["faults_not_as_expected"]:
        print(f"  FAULT NOT AS EXPECTED t={f['t']:.0f}s {f['kind']} {f['target']}: lost {f['lost']} {f['detail']}")
    print("RSS per service (MiB, first minute after warm-up -> last minute; per incarnation):")
    for name, rows in report["rss"].items():
        shown = ", ".join(f"pid {r['pid']} t{r['from_t']}-{r['to_t']}s too short" if r.get("too_short") else
                          f"pid {r['pid']} t{r['from_t']}-{r['to_t']}s {r['rss_first_mib']} -> {r['rss_last_mib']} "
                          f"({r['growth_mib']:+} MiB, {r['growth_pct']:+}%), fds {r['fds_first']:g} -> "
                          f"{r['fds_last']:g}" for r in rows)
        print(f"  {name} (restarts {report['restarts'].get(name, 0)}): {shown}")
    print(f"free KV blocks under load (first -> last minute): {report['free_blocks_drift']}")
    print(f"at idle: free/total {report['idle']['blocks']}, router in flight {report['idle']['inflight']}")
    print(f"RESULT: {'PASS' if not report['failures'] else 'FAIL: ' + '; '.join(report['failures'])}")
