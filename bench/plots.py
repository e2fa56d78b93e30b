"""PNG figures from the benchmarks' JSON results, written beside the JSON (`bench/results/`, git-ignored).

    python -m bench.plots bench/results/serving.json          # (re)draw the figures of any result file
    python -m bench.plots bench/results/*.json

Each bench calls `write(kind, report, json_path)` after writing its JSON (skipped with `--no-plots`); the
figures are `<json stem>-<figure>.png`. matplotlib runs with the Agg backend (no screen); without matplotlib a
bench prints one line saying the figures were skipped and carries on. Kinds, and what each draws:

| kind | figures |
|---|---|
| serving (bench_serving) | TTFT CDF per scenario, HTTP vs ZeroMQ; output tokens/s HTTP vs ZeroMQ per scenario |
| engine (bench_engine) | tokens/s vs concurrency: engine vs transformers, with the linear-layer cap |
| mesh (bench_mesh) | tokens/s by arrangement against the engine; TTFT p50/p99 vs request rate |
| replay (bench_replay) | TTFT CDF cache on vs off (or per placement); TTFT CDF by the tier that served the prefix |
| sweep (bench.replay_sweep) | goodput, hits over reusable, TTFT p50 and p99 against load, a line per policy arm |
| prefix (bench_prefix) | TTFT of a miss vs a prefix hit from the device, DRAM, DRAM over ZeroMQ, disk |
| soak (bench.soak) | tokens/s over time with every kill -9 marked |
| eplb_mesh (bench_eplb_mesh) | tokens/s over time with the balancer's start and every expert move marked |
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

Report = dict[str, Any]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png_path(json_path: Path, name: str) -> Path:
    return json_path.with_name(f"{json_path.stem}-{name}.png")


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def _ecdf(ax: Any, values: Sequence[float], label: str, **kw: Any) -> None:
    """An empirical CDF as a step line: the fraction of requests at or below each value."""
    xs = sorted(v for v in values if v is not None and not math.isnan(v))
    if not xs:
        return
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step([xs[0], *xs], [0.0, *ys], where="post", label=f"{label} (n={len(xs)})", **kw)


def _log_x(ax: Any) -> None:
    """A log x axis labelled with plain numbers at 1, 2 and 5 times the powers of ten, none at the minor ticks."""
    from matplotlib import ticker

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())


def _cdf_axes(ax: Any, title: str, xlabel: str, log: bool = False) -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests ≤ x")
    ax.set_ylim(0, 1.02)
    for q in (0.5, 0.99):
        ax.axhline(q, color="0.8", lw=0.8, ls=":", zorder=0)
    if log:
        _log_x(ax)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")


# --- bench_serving -----------------------------------------------------------------------------------------


def serving(report: Report, out: Path) -> list[Path]:
    plt = _pyplot()
    scenarios = report["scenarios"]
    n = len(scenarios)
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(max(6.5, 4.6 * cols), 3.6 * rows), squeeze=False)
    for ax, sc in zip(axes.flat, scenarios):
        for name, label, color in (("http", "HTTP gateway", "tab:blue"), ("zmq", "ZeroMQ client", "tab:orange")):
            if name in sc:
                _ecdf(ax, sc[name]["ttft_ms_all"], label, color=color)
        _cdf_axes(ax, f"TTFT, {sc['label']}", "time to first token (ms)", log=True)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    fig.suptitle("bench_serving: TTFT CDF, HTTP vs ZeroMQ on the same mesh and load", fontsize=10)
    paths = [_save(fig, png_path(out, "ttft-cdf"))]

    fig, ax = plt.subplots(figsize=(max(6.5, 1.6 * n + 2), 3.8))
    width = 0.38
    for k, (name, label, color) in enumerate((("http", "HTTP gateway", "tab:blue"),
                                               ("zmq", "ZeroMQ client (baseline)", "tab:orange"))):
        xs = [i + (k - 0.5) * width for i in range(n)]
        ys = [sc[name]["output_throughput"] if name in sc else 0.0 for sc in scenarios]
        ax.bar(xs, ys, width, label=label, color=color)
        for x, sc in zip(xs, scenarios):  # every run when repeated (the bar is the median run)
            runs = [r["output_throughput"] for r in sc.get("runs", {}).get(name, [])]
            if len(runs) > 1:
                ax.scatter([x] * len(runs), runs, color="k", s=10, zorder=3)
    for i, sc in enumerate(scenarios):
        r = sc.get("ratio_http_zmq", {}).get("output_throughput")
        if r is not None and not math.isnan(r):
            top = max(sc[p]["output_throughput"] for p in ("http", "zmq"))
            ax.annotate(f"{r:.3f}×", (i, top), ha="center", va="bottom", fontsize=9, xytext=(0, 3),
                        textcoords="offset points")
    ax.set_xticks(range(n), [sc["label"] for sc in scenarios])
    ax.set_ylabel("output tokens/s")
    ax.set_title("bench_serving: output tokens/s, HTTP vs ZeroMQ\n(bars: median run, dots: runs, label: HTTP / ZeroMQ)",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, frameon=False)
    ax.grid(axis="y", alpha=0.3)
    ax.margins(y=0.15)
    paths.append(_save(fig, png_path(out, "throughput")))
    return paths


# --- bench_engine, bench_mesh ------------------------------------------------------------------------------


def engine(report: Report, out: Path) -> list[Path]:
    plt = _pyplot()
    conc = report["concurrency"]
    cs = sorted(conc, key=int)
    x = [int(c) for c in cs]
    fig, ax = plt.subplots(figsize=(6.0, 4.0))

    def line(get: Callable[[dict[str, Any]], Any], label: str, **kw: Any) -> None:
        pts = [(xi, get(conc[c])) for xi, c in zip(x, cs)]
        pts = [(a, b) for a, b in pts if b is not None and b == b]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label, **kw)

    line(lambda r: r["engine"].get("aggregate_tok_s"), "engine, aggregate", color="tab:blue")
    line(lambda r: r["engine"].get("decode_only_tok_s"), "engine, decode-only", color="tab:blue", ls="--")
    line(lambda r: r["transformers"].get("aggregate_tok_s"), "transformers (baseline), aggregate", color="tab:gray")
    line(lambda r: r["transformers"].get("decode_only_tok_s"), "transformers, decode-only", color="tab:gray",
         ls="--")
    caps = {int(k): v for k, v in report.get("caps", {}).get("linear_tok_s", {}).items()}
    if caps:
        ks = sorted(caps)
        ax.plot(ks, [caps[k] for k in ks], color="tab:red", ls=":", marker="x", label="linear-layer cap")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(c) for c in x])
    ax.xaxis.set_minor_locator(__import__("matplotlib").ticker.NullLocator())
    ax.set_yscale("log")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("generated tokens/s")
    ax.set_title(f"bench_engine: SmolLM2-135M fp32, {report['env']['threads']} threads", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return [_save(fig, png_path(out, "throughput-vs-concurrency"))]


def mesh(report: Report, out: Path) -> list[Path]:
    plt = _pyplot()
    tp = report["throughput"]
    names = list(tp)
    fig, ax = plt.subplots(figsize=(7.0, 3.8))
    vals = [tp[n].get("aggregate_tok_s") or 0.0 for n in names]
    ax.barh(range(len(names)), vals, color=["tab:gray" if n.startswith("engine") else "tab:blue" for n in names])
    engine_best = max([v for n, v in zip(names, vals) if n.startswith("engine")] or [0.0])
    if engine_best:
        ax.axvline(engine_best, color="tab:red", ls="--", lw=1, label="engine (baseline)")
        ax.axvline(0.9 * engine_best, color="tab:red", ls=":", lw=1, label="0.9 × engine (target)")
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, frameon=False)
    ax.set_yticks(range(len(names)), [f"{n} ({tp[n].get('threads')} thr)" for n in names], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("aggregate generated tokens/s")
    w = report["workload"]
    ax.set_title(f"bench_mesh: {w['requests']} requests at once, {w['new_tokens']} new tokens each", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    paths = [_save(fig, png_path(out, "throughput"))]
    if report.get("ttft"):
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        rates = [x["rate_req_s"] for x in report["ttft"]]
        for key, label, style in (("client_ttft_p50_s", "client p50", "-"), ("client_ttft_p99_s", "client p99", "--"),
                                  ("router_ttft_p50_s", "router p50", "-"), ("router_ttft_p99_s", "router p99", "--")):
            color = "tab:blue" if key.startswith("client") else "tab:orange"
            ax.plot(rates, [x[key] for x in report["ttft"]], marker="o", ls=style, color=color, label=label)
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel("TTFT (s)")
        ax.set_yscale("log")
        ax.set_title("bench_mesh: TTFT under load, disaggregated mesh", fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        paths.append(_save(fig, png_path(out, "ttft-vs-rate")))
    return paths


# --- cache benches -----------------------------------------------------------------------------------------

TIER_COLORS = {"miss": "tab:gray", "device": "tab:green", "host": "tab:blue", "disk": "tab:purple"}


def main_tier(row: dict[str, Any]) -> str:
    """The tier that supplied most of a request's cached prompt tokens ('miss' when none was cached)."""
    by_tier = {k: v for k, v in (row.get("cached_by_tier") or {}).items() if v}
    return max(by_tier, key=by_tier.__getitem__) if by_tier else "miss"


def replay(report: Report, out: Path) -> list[Path]:
    plt = _pyplot()
    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    colors = {"cache on": "tab:green", "cache off": "tab:gray"}
    for arm, arm_rows in rows.items():
        _ecdf(ax, [r["ttft_s"] for r in arm_rows if "error" not in r and r.get("ttft_s") is not None],
              arm + (" (baseline)" if arm == "cache off" else ""), color=colors.get(arm))
    w = report["workload"]
    _cdf_axes(ax, f"bench_replay: TTFT, Mooncake trace sample ({w['requests']} requests, "
                  f"{100 * w['reusable_kv_blocks']:.0f}% reusable)", "time to first token (s)", log=True)
    ax.title.set_fontsize(10)
    paths = [_save(fig, png_path(out, "ttft-cdf"))]
    arm = "cache on" if "cache on" in rows else next(iter(rows))
    groups: dict[str, list[float]] = {}
    for r in rows[arm]:
        if "error" not in r and r.get("ttft_s") is not None:
            groups.setdefault(main_tier(r), []).append(r["ttft_s"])
    if groups:
        fig, ax = plt.subplots(figsize=(6.0, 4.0))
        for tier in ("miss", "device", "host", "disk"):
            if tier in groups:
                label = "no prefix cached" if tier == "miss" else f"prefix mostly from {tier}"
                _ecdf(ax, groups[tier], label, color=TIER_COLORS[tier])
        _cdf_axes(ax, f"bench_replay: TTFT by cache tier ({arm})", "time to first token (s)", log=True)
        ax.title.set_fontsize(10)
        paths.append(_save(fig, png_path(out, "ttft-cdf-by-tier")))
    return paths


def prefix(report: Report, out: Path) -> list[Path]:
    plt = _pyplot()
    rounds = report["rounds"]
    cases = [c for c in ("miss", "device", "dram", "dram+zmq", "nvme") if c in rounds[0]]
    colors = {"miss": "tab:gray", "device": "tab:green", "dram": "tab:blue", "dram+zmq": "tab:cyan",
              "nvme": "tab:purple"}
    fig, ax = plt.subplots(figsize=(6.0, 3.8))
    for i, case in enumerate(cases):
        ttfts = [row[case]["ttft_s"] * 1000 for row in rounds]
        med = sorted(ttfts)[len(ttfts) // 2]
        ax.bar(i, med, color=colors[case], label=None)
        ax.scatter([i] * len(ttfts), ttfts, color="k", s=10, zorder=3)
        ax.annotate(f"{med:.0f} ms" if case == "miss" else f"{med:.0f} ms\n{rounds and _speedup(rounds, case):.1f}×",
                    (i, med), ha="center", va="bottom", fontsize=8, xytext=(0, 3), textcoords="offset points")
    ax.set_xticks(range(len(cases)), ["miss (baseline)" if c == "miss" else c for c in cases])
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (ms, log)")
    ax.set_title(f"bench_prefix: TTFT, {report['prompt_tokens']}-token prompt, "
                 f"{report['cached_tokens']} tokens cached\nbars: median, dots: rounds, ×: speed-up over the miss",
                 fontsize=9)
    ax.grid(axis="y", alpha=0.3, which="both")
    ax.margins(y=0.25)
    return [_save(fig, png_path(out, "ttft-by-tier"))]


def _speedup(rounds: list[dict[str, Any]], case: str) -> float:
    ratios = sorted(row["miss"]["ttft_s"] / row[case]["ttft_s"] for row in rounds)
    return ratios[len(ratios) // 2]


# --- time series across a fault or a rebalance -------------------------------------------------------------


def soak(report: Report, out: Path) -> list[Path]:
    plt = _pyplot()
    samples = [s for s in report["samples"] if "tokens" in s]
    if len(samples) < 2:
        print("plots: soak report has no token counts (older run); no figure", file=sys.stderr)
        return []
    ts = [s["t"] for s in samples]
    rates = [(b["tokens"] - a["tokens"]) / (b["t"] - a["t"]) for a, b in zip(samples, samples[1:])]
    fig, ax = plt.subplots(figsize=(8.0, 3.8))
    ax.step(ts[1:], rates, where="pre", color="tab:blue", label="tokens/s received by the clients")
    steady = sorted(rates)[len(rates) // 2]
    ax.axhline(steady, color="tab:gray", ls="--", lw=1, label=f"median {steady:.0f} tok/s")
    for i, (t, name) in enumerate(report.get("kills", [])):
        ax.axvline(t, color="tab:red", lw=1, alpha=0.7, label="kill -9" if i == 0 else None)
        ax.annotate(name, (t, 0), rotation=90, fontsize=7, color="tab:red", xytext=(2, 2),
                    textcoords="offset points", va="bottom")
    ax.set_xlabel("time since load started (s)")
    ax.set_ylabel("tokens/s (per 10 s sample)")
    ax.set_ylim(bottom=0)
    ax.set_title("soak: tokens/s across kill -9 of workers and tokenizers", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    return [_save(fig, png_path(out, "tokens-over-time"))]


def eplb_mesh(report: Report, out: Path) -> list[Path]:
    plt = _pyplot()
    bin_s = report["bin_s"]
    counts = report["tokens_per_bin"]
    xs = [(i + 0.5) * bin_s for i in range(len(counts))]
    fig, ax = plt.subplots(figsize=(8.0, 3.8))
    ax.plot(xs, [c / bin_s for c in counts], color="tab:blue", lw=1, label="stream tokens/s")
    for i, (b, e, _v) in enumerate(report["moves"]):
        ax.axvspan(b, e, color="tab:orange", alpha=0.3, lw=0, label="expert move (stage → switch)" if i == 0 else None)
    ax.axvline(report["balancer_start_s"], color="tab:red", ls="--", lw=1, label="balancer starts")
    if report.get("steady_tok_s"):
        ax.axhline(report["steady_tok_s"], color="tab:gray", ls=":", lw=1,
                   label=f"steady (balancer phase, outside moves) {report['steady_tok_s']:.1f}")
    ax.set_xlabel("time (s)")
    ax.set_ylabel(f"tokens/s ({bin_s:g} s bins)")
    ax.set_ylim(bottom=0)
    ax.set_title("bench_eplb_mesh: EP=2 smollm2-moe, tokens/s across expert rebalancing", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return [_save(fig, png_path(out, "tokens-over-time"))]


def sweep(report: Report, out: Path) -> list[Path]:
    plt = _pyplot()
    points = report["points"]
    loads = list(points)
    arms = list(dict.fromkeys(name for arms in points.values() for name in arms))
    fig, axes = plt.subplots(2, 2, figsize=(10.0, 7.0))
    panels = ((axes[0][0], "goodput_req_s", f"goodput (req/s within TTFT {report['slo_s']:g} s)", False),
              (axes[0][1], "hit_of_reusable", "cache hits / reusable tokens", False),
              (axes[1][0], "ttft_p50_s", "TTFT p50 of admitted requests (s)", True),
              (axes[1][1], "ttft_p99_s", "TTFT p99 of admitted requests (s)", True))
    for ax, key, label, log in panels:
        for arm in arms:
            xs = [float(x) for x in loads if points[x].get(arm, {}).get(key) is not None]
            ys = [points[x][arm][key] for x in loads if points[x].get(arm, {}).get(key) is not None]
            if xs:
                ax.plot(xs, ys, marker="o", label=arm)
        ax.set_xscale("log", base=2)
        ax.set_xticks([float(x) for x in loads], [f"{x}x" for x in loads])
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("offered load (x the mesh's capacity without cache)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    w = report["workload"]
    fig.suptitle(f"replay_sweep: Mooncake trace sample ({w['requests']} requests, "
                 f"{100 * w['reusable_kv_blocks']:.0f}% reusable), capacity {report['capacity_req_s']:.2f} req/s",
                 fontsize=10)
    return [_save(fig, png_path(out, "load"))]


KINDS: dict[str, Callable[[Report, Path], list[Path]]] = {
    "serving": serving, "engine": engine, "mesh": mesh, "replay": replay, "prefix": prefix, "soak": soak,
    "eplb_mesh": eplb_mesh, "sweep": sweep,
}


def write(kind: str, report: Report, out: Path) -> list[Path]:
    """Draw `kind`'s figures of `report` beside `out` and print their paths; [] (with a note) without
    matplotlib, or when a figure fails (a figure is never worth losing a bench's results over)."""
    try:
        _pyplot()
    except ImportError:
        print("plots: matplotlib is not installed; no figures (pip install matplotlib)", file=sys.stderr)
        return []
    try:
        paths = KINDS[kind](report, Path(out))
    except Exception as exc:  # noqa: BLE001 - report it and keep the JSON the bench already wrote
        print(f"plots: the {kind} figures failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return []
    for p in paths:
        print(f"wrote {p}")
    return paths


def guess_kind(report: Report) -> str | None:
    keys = set(report)
    for kind, needs in (("sweep", {"points", "capacity_req_s"}), ("serving", {"scenarios"}),
                        ("engine", {"concurrency", "caps"}),
                        ("mesh", {"throughput", "kv_transfer"}), ("replay", {"rows", "arms"}),
                        ("prefix", {"rounds", "cached_blocks"}), ("soak", {"samples", "kills"}),
                        ("eplb_mesh", {"tokens_per_bin", "moves"})):
        if needs <= keys:
            return kind
    return None


def main(argv: Sequence[str] | None = None) -> int:
    paths = [Path(p) for p in (sys.argv[1:] if argv is None else argv)]
    if not paths:
        print(__doc__)
        return 2
    status = 0
    for path in paths:
        report = json.loads(path.read_text())
        kind = guess_kind(report)
        if kind is None:
            print(f"{path}: not a result this module draws", file=sys.stderr)
            status = 1
            continue
        if not write(kind, report, path):
            status = 1
    return status


if __name__ == "__main__":
    raise SystemExit(main())
