"""Layouts of one host under the same OpenAI streaming load (issue 38): `up`'s default, `up --colocated`, the split
`up --prefill 1 --decode 1`, and llama.cpp's `llama-server` on the same GGUF where it is on PATH.

    python -m bench.bench_layouts                                  # 8/32/64 streams, medians of 3
    python -m bench.bench_layouts --streams 8 --repeats 1          # a quick look

Each repeat starts each layout afresh, in an order rotated per repeat (`deepinfer-launch up --model M --http
127.0.0.1:PORT` plus its flags; its start and model load are not timed), and serves it, per stream count N, N
streamed chat requests at once (`/v1/chat/completions`, greedy, `ignore_eos`, `--max-tokens` each, prompts of
`--min-words`..`--max-words` words cut from deepinfer/data/moe_eval.txt, a new seed per repeat so no repeat reuses
an earlier one's prefix), after two warm-up requests. The client is `bench_serving`'s HttpPath: TTFT = request
sent → first SSE event with text, output tokens from the final usage chunk. llama-server runs with `-np N` (a
slot per stream), `-t` the host's cores and a context of N slots × 1024 tokens; it is started once per N and
repeat.

Printed per N: each layout's median (over `--repeats`) output tok/s and TTFT p50/p99, and as ratios: tok/s over
the best layout's, TTFT over the lowest. Then the issue's check: default `up` against the better of --colocated
and the split layout (≥ 0.95× its tok/s, TTFT p50 ≤ 1.1× its). Writes bench/results/layouts.json (`--out`).
Timings are wall clock: on a shared machine they move with its load (the load average is recorded).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from bench.bench_serving import TEXT, HttpPath, run_path
from bench.serving_core import Slo, synthetic_workload

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = {"default": [], "colocated": ["--colocated"], "split": ["--prefill", "1", "--decode", "1"]}
LLAMA = "llama-server"
LLAMA_CTX_PER_SLOT = 1024


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A serving process in its own session, read line by line; `ready` once it can serve."""

    def __init__(self, cmd: list[str], ready_pattern: str) -> None:
        self.command = " ".join(cmd)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        self._pattern = re.compile(ready_pattern)
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if self._pattern.search(line):
                self._ready.set()
        self._ready.set()  # exited

    def wait_ready(self, timeout_s: float) -> None:
        if not self._ready.wait(timeout_s) or self.proc.poll() is not None:
            raise RuntimeError(f"{self.command} did not become ready:\n" + "\n".join(self.lines[-30:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def start_up(args: argparse.Namespace, flags: list[str], port: int, run_dir: Path) -> Server:
    """`up --http` with `flags`; ready at its "OpenAI-compatible HTTP API" line (printed once /ready is 200)."""
    launcher = shutil.which("deepinfer-launch", path=str(Path(sys.executable).parent)) or "deepinfer-launch"
    cmd = [launcher, "up", "--model", args.model, "--http", f"127.0.0.1:{port}", "--run-dir", str(run_dir),
           "--kv-cache-mb", str(args.kv_cache_mb), *flags]
    return Server(cmd, r"OpenAI-compatible HTTP API: ")


def start_llama(gguf: Path, slots: int, port: int) -> Server:
    cmd = [LLAMA, "-m", str(gguf), "-np", str(slots), "-c", str(slots * LLAMA_CTX_PER_SLOT),
           "-t", str(os.cpu_count() or 1), "--host", "127.0.0.1", "--port", str(port)]
    return Server(cmd, r"server is listening|HTTP server listening")


def wait_health(url: str, server: Server, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and server.proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{server.command} did not answer /health:\n" + "\n".join(server.lines[-30:]))


async def load(url: str, model: str, streams: int, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """`streams` streamed chat requests at once; the run's summary (bench_serving's figures)."""
    workload = synthetic_workload(TEXT.read_text(), streams, math.inf, args.max_tokens, args.min_words,
                                  args.max_words, seed)
    path = HttpPath(url, model, streams, api="chat")
    try:
        return await run_path(path, workload, None, Slo())
    finally:
        await path.close()


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the repeats (a failed request in any run is counted)."""
    return {"output_tok_s": statistics.median(r["output_throughput"] for r in runs),
            "ttft_p50_s": statistics.median(r["ttft_ms"]["p50"] for r in runs) / 1000,
            "ttft_p99_s": statistics.median(r["ttft_ms"]["p99"] for r in runs) / 1000,
            "failed": sum(r["failed"] for r in runs), "errors": sorted({e for r in runs for e in r["errors"]}),
            "runs": [{"output_tok_s": r["output_throughput"], "ttft_p50_s": r["ttft_ms"]["p50"] / 1000,
                      "ttft_p99_s": r["ttft_ms"]["p99"] / 1000} for r in runs]}


def run_once(url: str, model: str, args: argparse.Namespace, name: str, rep: int) -> dict[int, dict[str, Any]]:
    """One repeat of every stream count against a started server."""
    out = {}
    for n in args.streams:
        summary = asyncio.run(load(url, model, n, args, seed=1000 * n + rep))
        out[n] = summary
        print(f"  {name:>12} {n:>3} streams run {rep + 1}: {summary['output_throughput']:7.1f} out tok/s, "
              f"TTFT p50 {summary['ttft_ms']['p50'] / 1000:6.2f} s p99 {summary['ttft_ms']['p99'] / 1000:6.2f} s"
              + (f", failed {summary['failed']}" if summary["failed"] else ""), flush=True)
    return out


def served_model(url: str, fallback: str) -> str:
    try:
        return str(httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return fallback


def run_layout(args: argparse.Namespace, name: str, rep: int) -> tuple[str, str, dict[int, dict[str, Any]]]:
    """One repeat on a freshly started `up` of layout `name`: (its command, the layout line it said, figures)."""
    port, run_dir = _free_port(), Path(tempfile.mkdtemp(prefix="deepinfer-bench-layouts-"))
    server = start_up(args, LAYOUTS[name], port, run_dir)
    url = f"http://127.0.0.1:{port}"
    try:
        print(f"{name}: {server.command}", flush=True)
        server.wait_ready(args.start_timeout_s)
        chosen = next((line for line in server.lines if line.startswith("layout: ")), "")
        print(f"  {chosen}", flush=True)
        return server.command, chosen, run_once(url, served_model(url, args.model), args, name, rep)
    finally:
        server.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


def run_llama(args: argparse.Namespace, rep: int) -> tuple[list[str], dict[int, dict[str, Any]]]:
    """One repeat of llama-server (`-np N` for each stream count N) on the model's GGUF."""
    from deepinfer.loading.fetch import resolve_model

    gguf = resolve_model(args.model)
    commands, figures = [], {}
    for n in args.streams:
        port = _free_port()
        server = start_llama(gguf, n, port)
        commands.append(server.command)
        url = f"http://127.0.0.1:{port}"
        try:
            print(f"llama-server: {server.command}", flush=True)
            wait_health(url, server, args.start_timeout_s)
            one = argparse.Namespace(**{**vars(args), "streams": [n]})
            figures.update(run_once(url, served_model(url, gguf.name), one, "llama-server", rep))
        finally:
            server.stop()
    return commands, figures


def llama_absent(args: argparse.Namespace) -> str | None:
    """Why llama-server is not run, or None."""
    if args.no_llama:
        return "skipped: --no-llama"
    if shutil.which(LLAMA) is None:
        return f"absent: {LLAMA} is not on PATH"
    from deepinfer.loading.fetch import resolve_model

    gguf = resolve_model(args.model)
    return None if gguf.suffix == ".gguf" else f"skipped: {args.model} is not a GGUF file ({gguf})"


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    """Every server, `--repeats` times, each repeat in a rotated order (a machine whose load drifts weighs on
    every layout alike), each a fresh start; per server and stream count, the medians."""
    why_not = llama_absent(args)
    names = list(args.layouts) + ([LLAMA] if why_not is None else [])
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {name: {n: [] for n in args.streams} for name in names}
    info: dict[str, dict[str, Any]] = {name: {} for name in names}
    for rep in range(args.repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            if name == LLAMA:
                commands, figures = run_llama(args, rep)
                info[name]["commands"] = commands
            else:
                command, chosen, figures = run_layout(args, name, rep)
                info[name].update(command=command, layout_line=chosen)
            for n, summary in figures.items():
                runs[name][n].append(summary)
    results: dict[str, Any] = {name: {**info[name], "streams": {n: medians(rs) for n, rs in runs[name].items()}}
                               for name in names}
    if why_not is not None:
        results[LLAMA] = why_not
    return results


def report(results: dict[str, Any], streams: Sequence[int]) -> list[str]:
    """The table of figures and ratios, and the issue's check of the default layout, as lines."""
    lines = []
    for n in streams:
        rows = {name: r["streams"][n] for name, r in results.items() if isinstance(r, dict) and n in r["streams"]}
        if not rows:
            continue
        best = max(rows, key=lambda k: rows[k]["output_tok_s"])
        low50 = min(r["ttft_p50_s"] for r in rows.values())
        low99 = min(r["ttft_p99_s"] for r in rows.values())
        lines.append(f"{n} streams (ratios: tok/s over {best}'s, TTFT over the lowest)")
        for name, r in rows.items():
            tok = r["output_tok_s"] / rows[best]["output_tok_s"]
            lines.append(f"  {name:>12}: {r['output_tok_s']:7.1f} out tok/s ({tok:.2f}x)"
                         f"  TTFT p50 {r['ttft_p50_s']:6.2f} s ({r['ttft_p50_s'] / low50:.2f}x)"
                         f"  p99 {r['ttft_p99_s']:6.2f} s ({r['ttft_p99_s'] / low99:.2f}x)"
                         + (f"  failed {r['failed']}" if r["failed"] else ""))
        if {"default", "colocated", "split"} <= rows.keys():
            better = max(("colocated", "split"), key=lambda k: rows[k]["output_tok_s"])
            tok = rows["default"]["output_tok_s"] / rows[better]["output_tok_s"]
            ttft = rows["default"]["ttft_p50_s"] / rows[better]["ttft_p50_s"]
            ok = tok >= 0.95 and ttft <= 1.1
            lines.append(f"  check: default/{better} = {tok:.2f}x tok/s (>= 0.95), TTFT p50 {ttft:.2f}x (<= 1.1): "
                         f"{'ok' if ok else 'NOT MET'}")
    for name, r in results.items():
        if isinstance(r, str):
            lines.append(f"{name}: {r}")
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[8, 32, 64],
                    help="stream counts, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layouts", type=lambda s: s.split(","), default=list(LAYOUTS),
                    help=f"which of {','.join(LAYOUTS)} to run")
    ap.add_argument("--no-llama", action="store_true", help="do not run llama-server even if it is on PATH")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--min-words", type=int, default=16)
    ap.add_argument("--max-words", type=int, default=96)
    ap.add_argument("--kv-cache-mb", type=int, default=1024, help="each worker's KV pool (64 streams fit)")
    ap.add_argument("--start-timeout-s", type=float, default=900.0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "layouts.json")
    args = ap.parse_args(argv)
    unknown = set(args.layouts) - set(LAYOUTS)
    if unknown:
        ap.error(f"unknown layouts {sorted(unknown)}; choose from {sorted(LAYOUTS)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python -m bench.bench_layouts " + " ".join(sys.argv[1:] if argv is None else argv)
    load_at_start = os.getloadavg()
    results = run_all(args)
    lines = report(results, args.streams)
    print("\n".join(lines))
    out = {"command": command, "cores": os.cpu_count(), "loadavg_at_start": load_at_start,
           "loadavg_at_end": os.getloadavg(), "max_tokens": args.max_tokens, "repeats": args.repeats,
           "results": results, "report": lines}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {args.out}; load average {load_at_start[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end")
    print(f"reproduce: {command}")
    failed = any(r["failed"] for v in results.values() if isinstance(v, dict) for r in v["streams"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
