"""Serving benchmark over HTTP: the OpenAI-compatible gateway under load, and the same load through ZeroMQ.

    python -m bench.bench_serving                                  # starts a mesh + gateway on SmolLM2
    python -m bench.bench_serving --streams 32 --rates 1,2,inf --num-prompts 64 --max-tokens 64
    python -m bench.bench_serving --rates none --load 0.5,1,2,4 --slo-ttft-ms 2000 --slo-tpot-ms 200 [--admission]
    python -m bench.bench_serving --trace bench/data/mooncake-fast25/<file>.jsonl --sample 1/48 --time-scale 10
    python -m bench.bench_serving --url http://127.0.0.1:8000 --zmq-endpoint ipc:///run/.../router-frontend.sock

What is timed: a client in this process. HTTP path: `POST /v1/completions` (or `/v1/chat/completions` with
`--api chat`) with `stream: true` and `stream_options.include_usage`, over one httpx connection pool sized to the
concurrency; TTFT = request sent → first SSE event carrying text, ITL = gaps between the arrivals of SSE events
carrying text, e2e = sent → end of the body, output tokens = the final chunk's `usage.completion_tokens`. ZeroMQ
path: `deepinfer.AsyncClient.stream` on the router's frontend of the same mesh, the same requests; TTFT = sent →
first `StreamDelta` with tokens, ITL = gaps between such deltas, output tokens from `RequestFinished.usage`. Both
ask greedy decoding with `ignore_eos`, so they generate the same number of tokens and the ratio of their output
tokens/s is the cost of the HTTP front (parsing, JSON, SSE framing, one more hop).

Load: each scenario sends the same workload — `--num-prompts` prompts of `--min-words`..`--max-words` words cut
from `deepinfer/data/moe_eval.txt` (or a Mooncake-format `--trace`, token-id prompts and the trace's arrival
times, scaled by `bench.trace`), `--max-tokens` each — with Poisson arrivals at the scenario's rate (`inf`: all at
once), at most `--max-concurrency` in flight. Scenarios: `--streams N` (rate inf, N in flight: the issue's "HTTP vs
ZeroMQ tokens/s at 32 concurrent streams"), then one per `--rates` entry, then one per `--load` entry (a multiple of
the capacity the `--streams` scenario measured: its HTTP requests/s). HTTP runs first, then ZeroMQ, each after
two warm-up requests; `--repeats 2` runs the pair again in the other order and keeps the median.

Goodput: requests per second meeting both `--slo-ttft-ms` and `--slo-tpot-ms` (TPOT = (e2e − TTFT)/(tokens − 1)).
With `--admission` each `--load` runs twice, first with every request carrying those SLOs (`ttft_slo_s`,
`tpot_slo_s`: the router refuses at once, 429 / OverloadedError, what it predicts would miss them; counted as
`refused`, not as a failed run), then without.
Percentiles interpolate linearly (numpy's default). Writes `bench/results/serving.json` (`--out`) and, unless
`--no-plots`, PNGs beside it: TTFT CDFs per scenario and output tokens/s HTTP vs ZeroMQ. Without `--url` the bench
starts `deepinfer-launch up --http 127.0.0.1:PORT` (co-located worker unless `--disaggregated`) and stops it at
the end; process start and model load are not timed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from bench.serving_core import (
    RequestRecord,
    ServingRequest,
    Slo,
    SseParser,
    parse_rates,
    run_duration,
    summarise,
    synthetic_workload,
    trace_workload,
)
from bench.trace import ScaleConfig

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "deepinfer" / "data" / "moe_eval.txt"
Send = Callable[[ServingRequest, RequestRecord], Awaitable[None]]


# --- the two clients ---------------------------------------------------------------------------------------


class HttpPath:
    """Streams each request through the gateway's OpenAI API and fills its RequestRecord."""

    name = "http"

    def __init__(self, url: str, model: str, concurrency: int, api: str = "completions",
                 api_key: str | None = None, transport: httpx.AsyncBaseTransport | None = None) -> None:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(base_url=url.rstrip("/"), limits=limits, timeout=None, headers=headers,
                                        transport=transport)
        self.model, self.api = model, api
        self.extra: dict[str, Any] = {}  # more body keys for every request (the SLOs of --admission)

    def body(self, req: ServingRequest) -> tuple[str, dict[str, Any]]:
        common = {"model": self.model, "max_tokens": req.max_tokens, "temperature": 0.0, "ignore_eos": True,
                  "stream": True, "stream_options": {"include_usage": True}, **self.extra}
        if self.api == "chat":
            if req.prompt is None:
                raise ValueError("--api chat needs text prompts (not a token-id trace)")
            return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": req.prompt}]}
        prompt: Any = req.prompt if req.prompt is not None else list(req.prompt_token_ids or ())
        return "/v1/completions", {**common, "prompt": prompt}

    async def send(self, req: ServingRequest, rec: RequestRecord) -> None:
        path, body = self.body(req)
        parser, chunks_with_text = SseParser(), 0
        rec.send_s = time.perf_counter()
        async with self.client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {text[:200]}"
                return
            async for raw in resp.aiter_bytes():
                now = time.perf_counter()
                for data in parser.feed(raw):
                    if data == "[DONE]":
                        continue
                    event = json.loads(data)
                    if "error" in event:
                        rec.error = f"stream error: {str(event['error'])[:200]}"
                    if _event_text(event):
                        chunks_with_text += 1
                        rec.chunk_times.append(now)
                        if rec.first_token_s is None:
                            rec.first_token_s = now
                    if usage := event.get("usage"):
                        rec.output_tokens = int(usage.get("completion_tokens") or 0)
                        rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        rec.end_s = time.perf_counter()
        if rec.output_tokens == 0 and chunks_with_text:
            rec.error = "no usage in the stream (stream_options.include_usage ignored?)"

    async def close(self) -> None:
        await self.client.aclose()


def _event_text(event: dict[str, Any]) -> str:
    """The text a completions or chat chunk carries ('' for role-only, usage-only and empty chunks)."""
    out = ""
    for choice in event.get("choices") or ():
        out += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return out


class ZmqPath:
    """The same requests through `deepinfer.AsyncClient.stream` on the router's frontend."""

    name = "zmq"

    def __init__(self, endpoint: str, api_key: str | None = None) -> None:
        from deepinfer import AsyncClient

        self.client = AsyncClient(endpoint, api_key=api_key)
        self.extra: dict[str, Any] = {}  # more parameters for every request (the SLOs of --admission)

    async def connect(self) -> None:
        """Before the first request (once: concurrent connects would race for the router's welcome)."""
        await self.client.connect()

    async def send(self, req: ServingRequest, rec: RequestRecord) -> None:
        from deepinfer import MeshError
        from deepinfer.protocol import messages as m

        kw: dict[str, Any] = {"max_tokens": req.max_tokens, "temperature": 0.0, "ignore_eos": True, **self.extra}
        if req.prompt is not None:
            kw["prompt"] = req.prompt
        else:
            kw["prompt_token_ids"] = list(req.prompt_token_ids or ())
        rec.send_s = time.perf_counter()
        try:
            async for msg in self.client.stream(**kw):
                now = time.perf_counter()
                if isinstance(msg, m.StreamDelta) and msg.token_ids:
                    rec.chunk_times.append(now)
                    if rec.first_token_s is None:
                        rec.first_token_s = now
                elif isinstance(msg, m.RequestFinished):
                    rec.output_tokens = msg.usage.completion_tokens
                    rec.prompt_tokens = msg.usage.prompt_tokens
        except MeshError as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
            return
        rec.end_s = time.perf_counter()

    async def close(self) -> None:
        await self.client.close()


# --- one run -----------------------------------------------------------------------------------------------


async def drive(send: Send, workload: Sequence[ServingRequest], max_concurrency: int | None) -> list[RequestRecord]:
    """Send each request at its arrival offset (open loop), at most `max_concurrency` in flight (a request due
    while the bound is reached waits for a slot; its TTFT counts from when it is actually sent)."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    records = [RequestRecord(r.index, 0.0) for r in workload]
    start = time.perf_counter()

    async def one(req: ServingRequest, rec: RequestRecord) -> None:
        delay = start + req.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if slots is not None:
            await slots.acquire()
        try:
            await send(req, rec)
        except Exception as exc:  # a failed request is counted, not fatal to the run
            rec.error = f"{type(exc).__name__}: {exc}"[:300]
            rec.end_s = rec.end_s or time.perf_counter()
        finally:
            if slots is not None:
                slots.release()

    await asyncio.gather(*(one(r, rec) for r, rec in zip(workload, records)))
    return records


async def run_path(path: HttpPath | ZmqPath, workload: Sequence[ServingRequest], max_concurrency: int | None,
                   slo: Slo) -> dict[str, Any]:
    warm = [ServingRequest(-1 - i, 0.0, 8, prompt="Warm-up request number " + str(i)) for i in range(2)]
    await drive(path.send, warm, None)
    records = await drive(path.send, workload, max_concurrency)
    summary = summarise(records, run_duration(records), slo)
    summary["ttft_ms_all"] = [round(r.ttft_s * 1000, 3) for r in records if r.ok]
    summary["output_tokens_per_request"] = [r.output_tokens for r in records]
    # Refused by admission (HTTP 429, or the client's OverloadedError): answered at once, not a failure of the run.
    summary["refused"] = sum(1 for r in records if r.error and ("HTTP 429" in r.error or "OverloadedError" in r.error))
    return summary


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median output throughput (the lower middle one of an even count)."""
    ordered = sorted(runs, key=lambda r: r["output_throughput"])
    return ordered[(len(ordered) - 1) // 2]


async def run_scenario(label: str, rate: float, max_concurrency: int | None, workload: list[ServingRequest],
                       paths: list[HttpPath | ZmqPath], slo: Slo, repeats: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {p.name: [] for p in paths}
    for rep in range(repeats):
        for p in (paths if rep % 2 == 0 else paths[::-1]):
            summary = await run_path(p, workload, max_concurrency, slo)
            runs[p.name].append(summary)
            print(f"  {label:>12} {p.name:>4} run {rep + 1}: {summary['output_throughput']:8.1f} out tok/s  "
                  f"TTFT p50 {summary['ttft_ms']['p50']:8.1f} ms  failed {summary['failed']}", flush=True)
    out: dict[str, Any] = {"label": label, "rate": rate, "max_concurrency": max_concurrency,
                           "requests": len(workload), "runs": runs}
    for name, rs in runs.items():
        out[name] = median_run(rs)
    if "http" in out and "zmq" in out:
        h, z = out["http"], out["zmq"]
        out["ratio_http_zmq"] = {
            "output_throughput": _ratio(h["output_throughput"], z["output_throughput"]),
            "ttft_p50": _ratio(h["ttft_ms"]["p50"], z["ttft_ms"]["p50"]),
            "ttft_p99": _ratio(h["ttft_ms"]["p99"], z["ttft_ms"]["p99"]),
            "same_output_tokens": h["output_tokens_per_request"] == z["output_tokens_per_request"],
        }
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) else math.nan


# --- the mesh ----------------------------------------------------------------------------------------------


class LaunchedMesh:
    """`deepinfer-launch up --http 127.0.0.1:PORT` as a child process: its ZeroMQ frontend (from the line it
    prints when ready) and its gateway URL (once `/v1/models` answers)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.port = args.port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.run_dir = Path(tempfile.mkdtemp(prefix="deepinfer-bench-serving-"))
        launcher = shutil.which("deepinfer-launch", path=str(Path(sys.executable).parent)) or "deepinfer-launch"
        cmd = [launcher, "up", "--model", args.model, "--http", f"127.0.0.1:{self.port}",
               "--run-dir", str(self.run_dir), "--kv-cache-mb", str(args.kv_cache_mb)]
        cmd += ["--prefill", "1", "--decode", "1"] if args.disaggregated else ["--colocated"]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        cmd += args.launch_arg
        self.command = " ".join(cmd)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.frontend: str | None = None
        self.lines: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if match := re.search(r"client endpoint: (\S+)", line):
                self.frontend = match.group(1)
                self._ready.set()
        self._ready.set()  # exited

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        if not self._ready.wait(timeout_s) or self.frontend is None:
            raise RuntimeError("the mesh did not become ready:\n" + "\n".join(self.lines[-30:]))
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/v1/models", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        raise RuntimeError(f"the gateway at {self.url} did not answer:\n" + "\n".join(self.lines[-30:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: the launcher and its children
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def served_model(url: str, fallback: str) -> str:
    try:
        data = httpx.get(url.rstrip("/") + "/v1/models", timeout=10).json()["data"]
        return str(data[0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return fallback


# --- report ------------------------------------------------------------------------------------------------


def print_report(scenarios: list[dict[str, Any]]) -> None:
    head = (f"{'scenario':>12} {'path':>4} {'req/s':>7} {'out tok/s':>9} {'goodput':>7} "
            f"{'TTFT mean/p50/p90/p99 ms':>28} {'TPOT p50/p99 ms':>16} {'ITL p50/p99 ms':>15} {'e2e p50/p99 s':>14}")
    print(head)
    for sc in scenarios:
        for name in ("http", "zmq"):
            if name not in sc:
                continue
            s = sc[name]
            t, tp, itl, e = s["ttft_ms"], s["tpot_ms"], s["itl_ms"], s["e2e_ms"]
            print(f"{sc['label']:>12} {name:>4} {s['request_throughput']:7.2f} {s['output_throughput']:9.1f} "
                  f"{s['goodput']:7.2f} {t['mean']:6.0f}/{t['p50']:6.0f}/{t['p90']:6.0f}/{t['p99']:6.0f} "
                  f"{tp['p50']:7.1f}/{tp['p99']:7.1f} {itl['p50']:6.1f}/{itl['p99']:7.1f} "
                  f"{e['p50'] / 1000:6.2f}/{e['p99'] / 1000:6.2f}" + (f"  failed {s['failed']}" if s["failed"] else "")
                  + (f" (refused {s['refused']})" if s.get("refused") else ""))
        if r := sc.get("ratio_http_zmq"):
            print(f"{'':>12} HTTP/ZeroMQ: out tok/s {r['output_throughput']:.3f}, TTFT p50 {r['ttft_p50']:.3f}, "
                  f"p99 {r['ttft_p99']:.3f}, same output tokens: {r['same_output_tokens']}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running gateway (otherwise one is started)")
    ap.add_argument("--zmq-endpoint", help="with --url: the router's frontend for the ZeroMQ comparison")
    ap.add_argument("--no-zmq", action="store_true", help="HTTP only")
    ap.add_argument("--api", choices=["completions", "chat"], default="completions")
    ap.add_argument("--api-key")
    ap.add_argument("--model", default="smollm2", help="what the started mesh serves")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per worker of the started mesh")
    ap.add_argument("--disaggregated", action="store_true", help="a prefill and a decode worker")
    ap.add_argument("--kv-cache-mb", type=int, default=512)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--launch-arg", action="append", default=[], help="extra argument for `deepinfer-launch up`")
    ap.add_argument("--streams", type=int, default=32, help="the closed-burst scenario's concurrency (0: none)")
    ap.add_argument("--rates", default="1,2,4", help="request rates (req/s, or inf), one scenario each; none: only "
                    "the --streams scenario")
    ap.add_argument("--request-rate", type=float, default=None, help="one rate (instead of --rates)")
    ap.add_argument("--load", default="", help="loads as multiples of the capacity the --streams scenario measured "
                    "(its HTTP requests/s), e.g. 0.5,1,2,4: one Poisson scenario each, after the --rates ones")
    ap.add_argument("--capacity", type=float, default=None, metavar="REQ_S",
                    help="1x of --load in requests/s (default: the --streams burst's HTTP requests/s)")
    ap.add_argument("--max-concurrency", type=int, default=None, help="bound on in-flight requests at --rates")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--min-words", type=int, default=16)
    ap.add_argument("--max-words", type=int, default=96)
    ap.add_argument("--trace", type=Path, help="a Mooncake-format JSONL trace instead of synthetic prompts")
    ap.add_argument("--sample", default="1", help="trace: keep this fraction of prefix groups, e.g. 1/48")
    ap.add_argument("--sample-seed", type=int, default=0)
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--slo-ttft-ms", type=float, default=None)
    ap.add_argument("--slo-tpot-ms", type=float, default=None)
    ap.add_argument("--admission", action="store_true", help="each --load also with the requests carrying the SLOs, "
                    "so the router refuses those it predicts to miss them (overloaded) instead of queueing them")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "serving.json")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    if args.admission and not (args.load and (args.slo_ttft_ms or args.slo_tpot_ms)):
        ap.error("--admission needs --load and an SLO (--slo-ttft-ms, --slo-tpot-ms)")
    if args.load and not args.capacity and (not args.streams or args.trace is not None):
        ap.error("--load needs the --streams scenario (synthetic prompts) to measure the capacity it multiplies")
    return args


def build_workload(args: argparse.Namespace, rate: float) -> list[ServingRequest]:
    if args.trace is not None:
        num, _, den = args.sample.partition("/")
        config = ScaleConfig(block_tokens=args.block_tokens, time_scale=args.time_scale, seed=args.seed,
                             max_output_tokens=args.max_tokens, max_input_tokens=2048 - args.max_tokens)
        return trace_workload(args.trace, config, float(num) / float(den or 1), args.sample_seed,
                              limit=args.num_prompts)
    return synthetic_workload(TEXT.read_text(), args.num_prompts, rate, args.max_tokens, args.min_words,
                              args.max_words, args.seed)


async def bench(args: argparse.Namespace, url: str, frontend: str | None) -> list[dict[str, Any]]:
    scenarios: list[tuple[str, float, int | None]] = []
    if args.streams and args.trace is None:
        scenarios.append((f"{args.streams} streams", math.inf, args.streams))
    rates = [args.request_rate] if args.request_rate else [] if args.rates in ("", "none") else parse_rates(args.rates)
    if args.trace is not None:
        rates = [math.nan]  # the trace's own arrivals
    scenarios += [(f"rate {r:g}" if not math.isnan(r) else "trace", r, args.max_concurrency) for r in rates]
    pool = max([c for _, _, c in scenarios if c] + [args.num_prompts])
    paths: list[HttpPath | ZmqPath] = [HttpPath(url, served_model(url, args.model), pool, args.api, args.api_key)]
    if frontend and not args.no_zmq:
        zmq_path = ZmqPath(frontend, args.api_key)
        await zmq_path.connect()
        paths.append(zmq_path)
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    out = []
    try:
        for label, rate, conc in scenarios:
            workload = build_workload(args, rate if not math.isnan(rate) else math.inf)
            out.append(await run_scenario(label, rate, conc, workload, paths, slo, args.repeats))
        if args.load:
            # Capacity: given, else the closed burst's HTTP request throughput, the first scenario (parse_args
            # checked it runs). The burst is the mesh's first work, so its kernels and pages are still cold: on a
            # small machine it can measure well under a warm mesh's capacity (--capacity from a warm run).
            capacity = args.capacity or out[0]["http"]["request_throughput"]
            # With --admission each load runs twice, the requests asking the router to admit them against the
            # SLOs (ttft_slo_s, tpot_slo_s: refused at once when predicted to miss) and then not.
            arms = [("admission", slo_fields(slo)), ("no admission", {})] if args.admission else [("", {})]
            for load in parse_rates(args.load):
                rate = load * capacity
                workload = build_workload(args, rate)
                for arm, fields in arms:
                    for p in paths:
                        p.extra = fields
                    label = f"load {load:g}x" + (f" {arm}" if arm else "")
                    out.append(await run_scenario(label, rate, args.max_concurrency, workload, paths, slo,
                                                  args.repeats))
                    out[-1]["load"], out[-1]["capacity_req_s"], out[-1]["arm"] = load, capacity, arm or None
    finally:
        for p in paths:
            await p.close()
    return out


def slo_fields(slo: Slo) -> dict[str, float]:
    """The request fields that ask the router to admit a request against `slo` (seconds)."""
    return {k: v / 1000 for k, v in (("ttft_slo_s", slo.ttft_ms), ("tpot_slo_s", slo.tpot_ms)) if v is not None}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    mesh = None
    command = "python -m bench.bench_serving " + " ".join(sys.argv[1:] if argv is None else argv)
    load_at_start = os.getloadavg()
    try:
        if args.url:
            url, frontend = args.url, args.zmq_endpoint
        else:
            mesh = LaunchedMesh(args)
            print(f"starting: {mesh.command}", flush=True)
            mesh.wait_ready(timeout_s=900)
            url, frontend = mesh.url, mesh.frontend
            print(f"mesh ready: gateway {url}, ZeroMQ frontend {frontend}", flush=True)
        scenarios = asyncio.run(bench(args, url, frontend))
    finally:
        if mesh is not None:
            mesh.stop()
    print_report(scenarios)
    report = {"command": command, "launch": mesh.command if mesh else None, "url": args.url,
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "loadavg_at_start": load_at_start, "loadavg_at_end": os.getloadavg(),
              "python": platform.python_version(), "httpx": httpx.__version__,
              "scenarios": scenarios}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=_json_default))
    print(f"wrote {args.out}")
    if not args.no_plots:
        from bench import plots

        plots.write("serving", report, args.out)
    print(f"reproduce: {command}")
    ok = all(sc[p]["failed"] == sc[p].get("refused", 0) for sc in scenarios for p in ("http", "zmq") if p in sc)
    return 0 if ok else 1


def _json_default(x: object) -> object:
    return str(x)


if __name__ == "__main__":
    raise SystemExit(main())

