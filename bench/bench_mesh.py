"""Mesh benchmark on SmolLM2-135M (held as --weights says; by default the GGUF's blocks): what the ZeroMQ
service mesh costs over the bare engine, what the prefill/decode split costs on the same cores, how a KV
move compares with recomputing, and TTFT under load.

    python -m bench.bench_mesh [--quick] [--threads N] [--seed S] [--out report.json]
    python -m bench.bench_mesh --batch1 200 [--threads N] [--weights native|fp32]

1. messaging overhead: one workload through the in-process engine (step loop), the in-process mesh (every
   service a task, inproc://) and the co-located mesh as processes (Supervisor, ipc://), same worker threads;
2. the disaggregated mesh (prefill + decode worker processes, the threads split between them), same workload;
3. KV transfer vs prefill: one long prompt prefilled by an engine, its KV moved to a second engine over real
   ipc:// sockets (KvReserve → KvTransfer → install → KvAck), each part timed;
4. TTFT p50/p99 against the disaggregated mesh under Poisson arrivals at several rates.
With `--batch1 N`, only batch-1 decode instead: one prompt, N greedy tokens, through the engine, the
co-located and the disaggregated mesh as processes, every worker with all the threads as `up --threads N` gives
them (the engine before and after), each twice after a warm-up, then llama.cpp on the same GGUF, prompt and threads
(when llama-cpp-python is installed: `pip install -e '.[bench]'`).
Every ratio is against a baseline measured in the same run. See bench/README.md for what each figure means.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import math
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import zmq

from deepinfer.config.engine import DEFAULT_WEIGHTS, WEIGHTS_MODES, EngineConfig
from deepinfer.config.kv import KvSpec
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import SamplingParams
from deepinfer.launch.mesh import InprocMesh, engine_config
from deepinfer.launch.supervisor import Supervisor
from deepinfer.launch.topology import Topology
from deepinfer.loading.fetch import fetch_smollm2
from deepinfer.loading.weights import LoadedModel, load_model_weights
from deepinfer.protocol import messages as m
from deepinfer.protocol.client import AsyncClient, Client, MeshError
from deepinfer.protocol.sockets import make_dealer, make_router, recv_msg, recv_routed, send_msg
from deepinfer.services.wire import to_engine_params
from deepinfer.text.tokenizer import Tokenizer

FULL = {"requests": 32, "prompt_len": (128, 512), "new_tokens": 64, "kv_prompt": 2048, "kv_repeats": 5,
        "rates": [0.5, 1.0, 2.0], "rate_requests": 30, "rate_prompt_len": (128, 512), "rate_new_tokens": 32}
QUICK = {"requests": 8, "prompt_len": (64, 128), "new_tokens": 16, "kv_prompt": 1024, "kv_repeats": 2,
         "rates": [1.0, 2.0], "rate_requests": 6, "rate_prompt_len": (64, 128), "rate_new_tokens": 16}
BLOCK = 16
ENGINE, ENGINE_AGAIN, INPROC = "engine", "engine, after the meshes", "in-process mesh"
PROCS, DISAGG = "co-located mesh (processes)", "disaggregated mesh (processes)"


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))] if s else float("nan")


def kv_mb(prompts: list[list[int]], new_tokens: int, kv_bytes_per_token: int) -> int:
    """KV budget (MiB) that holds the whole workload at once, so nothing is preempted anywhere."""
    tokens = sum(-(-(len(p) + new_tokens) // BLOCK) * BLOCK for p in prompts) + 64 * BLOCK
    return -(-tokens * kv_bytes_per_token // (1024 * 1024))


def summarize(token_counts: list[int], ttfts: list[float], wall: float, new_tokens: int) -> dict[str, float]:
    assert all(n == new_tokens for n in token_counts), token_counts
    return {"aggregate_tok_s": sum(token_counts) / wall, "wall_s": wall,
            "p50_ttft_s": statistics.median(ttfts), "p99_ttft_s": pct(ttfts, 99)}


def run_engine(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    rids = [engine.add_request(None, p, params) for p in prompts]
    first: dict[str, float] = {}
    count = dict.fromkeys(rids, 0)
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.new_token_ids:
                first.setdefault(o.request_id, now - t0)
                count[o.request_id] += len(o.new_token_ids)
    return summarize(list(count.values()), list(first.values()), time.perf_counter() - t0, new_tokens)


def engine_phase(loaded: LoadedModel, tok: Tokenizer, cfg: EngineConfig, prompts: list[list[int]],
                 warm: list[list[int]], new_tokens: int) -> dict[str, float]:
    engine = LLMEngine(loaded, tok, cfg)  # exactly what a worker process builds (LLMEngine.load)
    run_engine(engine, warm, 4)
    return run_engine(engine, prompts, new_tokens)


def finished(results: list[Any], new_tokens: int, wall: float) -> dict[str, float]:
    errors = [x for x in results if isinstance(x, BaseException)]
    if errors:
        raise errors[0]
    return summarize([len(x.token_ids) for x in results], [x.timings.ttft_s for x in results], wall, new_tokens)


def run_client(endpoint: str, prompts: list[list[int]], warm: list[list[int]], new_tokens: int) -> dict[str, float]:
    spec = lambda ps, n: [dict(prompt_token_ids=p, max_tokens=n, ignore_eos=True) for p in ps]
    with Client(endpoint, timeout_s=900) as c:
        c.generate_many(spec(warm, 4))
        t0 = time.perf_counter()
        results = c.generate_many(spec(prompts, new_tokens))
        return finished(results, new_tokens, time.perf_counter() - t0)


def run_inproc_mesh(model: str, threads: int, kv_cache_mb: int, prompts: list[list[int]],
                    warm: list[list[int]], new_tokens: int, weights: str) -> dict[str, float]:
    async def main() -> dict[str, float]:
        topo = Topology.local(model, "inproc", disaggregated=False, threads=threads, kv_cache_mb=kv_cache_mb,
                              kvcache=False, weights=weights)
        mesh = InprocMesh(topo)
        await mesh.start()
        try:
            async with AsyncClient(topo.frontend, timeout_s=900, ctx=mesh.ctx) as c:
                gen = lambda ps, n: asyncio.gather(
                    *(c.generate(prompt_token_ids=p, max_tokens=n, ignore_eos=True) for p in ps),
                    return_exceptions=True)
                await gen(warm, 4)
                t0 = time.perf_counter()
                results = await gen(prompts, new_tokens)
                return finished(results, new_tokens, time.perf_counter() - t0)
        finally:
            await mesh.stop()

    return asyncio.run(main())


@contextlib.contextmanager
def supervised(topo: Topology, run_dir: Path) -> Iterator[None]:
    """`topo` as one process per service under a Supervisor, serving; stopped on the way out, with the last
    lines of every service's log shown if something failed."""
    (run_dir / "topology.toml").write_text(topo.to_toml())
    sup = Supervisor(run_dir / "topology.toml", log_dir=run_dir)
    ok = False
    try:
        sup.start()
        sup.wait_ready(timeout_s=300)
        yield
        ok = True
    finally:
        sup.stop()
        if not ok:
            for log in sorted(run_dir.glob("*.log")):
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
                print(f"--- {log.name} (last lines)\n{tail}", file=sys.stderr)


@contextlib.contextmanager
def process_mesh(model: str, disaggregated: bool, threads: int, kv_cache_mb: int,
                 weights: str) -> Iterator[Topology]:
    """The mesh as one process per service, without a cache daemon: this benchmark measures what the mesh
    costs against the engine, which has no daemon to write behind to."""
    run_dir = Path(tempfile.mkdtemp(prefix="dimesh-"))
    topo = Topology.local(model, "ipc", run_dir, disaggregated=disaggregated, threads=threads,
                          kv_cache_mb=kv_cache_mb, kvcache=False, weights=weights)
    with supervised(topo, run_dir):
        yield topo
        shutil.rmtree(run_dir, ignore_errors=True)


def kv_transfer(loaded: LoadedModel, threads: int, plen: int, repeats: int, seed: int) -> dict[str, Any]:
    """Prefill engine → decode engine over ipc://, as the worker does it: KvReserve → KvReserveReply →
    KvTransfer (export_kv as one zero-copy frame) → add_prefilled_request (copy into the pool) → KvAck.
    The first of repeats + 1 rounds is a warm-up; medians of the rest."""
    n_blocks = -(-(plen + 1) // BLOCK)
    cfg = EngineConfig(block_size=BLOCK, num_kv_blocks=n_blocks + 8, num_threads=threads)
    prefill, decode = LLMEngine(loaded, None, cfg), LLMEngine(loaded, None, cfg)
    wire = m.SamplingParamsWire(max_tokens=2, ignore_eos=True)
    ctx, run_dir = zmq.Context(), tempfile.mkdtemp(prefix="dikv-")
    rx = make_router(ctx, f"ipc://{run_dir}/kv.sock")
    tx = make_dealer(ctx, f"ipc://{run_dir}/kv.sock", b"prefill-0")
    rows: list[dict[str, float]] = []
    nbytes = 0
    try:
        for i, p in enumerate(make_prompts(repeats + 1, plen, plen, loaded.config.vocab_size, seed)):
            rid = f"kv-{i}"
            t0 = time.perf_counter()
            prefill.add_request(rid, p, to_engine_params(wire), prefill_only=True)
            out = None
            while out is None:
                out = next((o for o in prefill.step() if o.handoff), None)
            t1 = time.perf_counter()
            send_msg(tx, m.KvReserve(rid, n_blocks, plen, wire.max_tokens, "prefill-0"))
            peer, req = recv_routed(rx)
            assert decode.reserve(req.request_id, req.num_blocks, req.lease_s)
            send_msg(rx, m.KvReserveReply(rid, rid, True, "", req.lease_s), peer)
            reply = recv_msg(tx)
            t2 = time.perf_counter()
            kv = prefill.export_kv(rid)
            t3 = time.perf_counter()
            send_msg(tx, m.KvTransfer(rid, reply.lease_id, out.new_token_ids[0], p, [], wire, BLOCK,
                                      prefill.kv_spec.layout, kv, "tokenizer-0"))
            peer, t = recv_routed(rx)
            t4 = time.perf_counter()
            decode.add_prefilled_request(t.request_id, t.token_ids, t.first_token, to_engine_params(t.params), t.kv,
                                         reservation_id=t.lease_id)
            t5 = time.perf_counter()
            send_msg(rx, m.KvAck(rid, t.lease_id, True), peer)
            assert recv_msg(tx).ok
            t6 = time.perf_counter()
            nbytes = kv.numel() * kv.element_size()
            prefill.release(rid)
            decode.abort(rid)
            decode.step()
            if i:
                rows.append({"prefill_s": t1 - t0, "reserve_rpc_s": t2 - t1, "export_s": t3 - t2,
                             "send_recv_s": t4 - t3, "install_s": t5 - t4, "ack_s": t6 - t5, "move_s": t6 - t1})
    finally:
        tx.close(linger=0)
        rx.close(linger=0)
        ctx.term()
        shutil.rmtree(run_dir, ignore_errors=True)
    r: dict[str, Any] = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    r.update(prompt_tokens=plen, bytes=nbytes, wire_gb_s=nbytes / r["send_recv_s"] / 1e9,
             move_gb_s=nbytes / r["move_s"] / 1e9, rounds=len(rows))
    return r


def run_rate(endpoint: str, rate: float, prompts: list[list[int]], new_tokens: int, seed: int) -> dict[str, float]:
    """Requests arrive at exponential gaps (mean 1/rate), streamed; client-side TTFT = send → first
    StreamDelta with tokens; router-side = RequestFinished.timings.ttft_s."""
    rng = random.Random(seed)
    arrivals = list(itertools.accumulate(rng.expovariate(rate) for _ in prompts))

    async def one(c: AsyncClient, start: float, at: float, p: list[int]) -> tuple[float, float]:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        sent, first, done = time.perf_counter(), float("nan"), None
        # Read the stream to its end: leaving it early would abort the request.
        async for msg in c.stream(prompt_token_ids=p, max_tokens=new_tokens, ignore_eos=True):
            if isinstance(msg, m.StreamDelta) and msg.token_ids and math.isnan(first):
                first = time.perf_counter() - sent
            done = msg if isinstance(msg, m.RequestFinished) else done
        if done is None or len(done.token_ids) != new_tokens:
            raise MeshError(f"stream ended without {new_tokens} tokens: {done}")
        return first, done.timings.ttft_s or float("nan")

    async def main() -> tuple[list[tuple[float, float]], float]:
        async with AsyncClient(endpoint, timeout_s=900) as c:
            start = time.perf_counter()
            res = await asyncio.gather(*(one(c, start, at, p) for at, p in zip(arrivals, prompts)))
            return res, time.perf_counter() - start

    res, wall = asyncio.run(main())
    client, router = [x[0] for x in res], [x[1] for x in res]
    return {"rate_req_s": rate, "requests": len(prompts), "offered_over_s": arrivals[-1], "wall_s": wall,
            "client_ttft_p50_s": pct(client, 50), "client_ttft_p99_s": pct(client, 99),
            "router_ttft_p50_s": pct(router, 50), "router_ttft_p99_s": pct(router, 99)}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def ratios(r: dict[str, Any]) -> dict[str, tuple[float | None, str]]:
    t, k = r["throughput"], r["kv_transfer"]
    agg = lambda name: t.get(name, {}).get("aggregate_tok_s")
    engine = max(agg(ENGINE) or 0, agg(ENGINE_AGAIN) or 0)  # the better of the two brackets
    return {f"{PROCS} / engine": (ratio(agg(PROCS), engine), ">= 0.9"),
            f"{INPROC} / engine": (ratio(agg(INPROC), engine), ">= 0.9"),
            f"{DISAGG} / {PROCS}": (ratio(agg(DISAGG), agg(PROCS)), ""),
            f"KV move / prefill, {k['prompt_tokens']} tokens": (ratio(k["move_s"], k["prefill_s"]), "<= 0.1")}


def table(head: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    for row in [head, *rows]:
        print("  ".join(x.rjust(wd) if i else x.ljust(wd) for i, (x, wd) in enumerate(zip(row, widths))))


def print_report(r: dict[str, Any], command: str) -> None:
    f = lambda v, spec=".2f": "-" if v is None or v != v else format(v, spec)
    w, k = r["workload"], r["kv_transfer"]
    print(f"\nSmolLM2-135M ({r['weights']} weights), {r['env']['threads']} worker threads ({r['env']['cpus']} CPUs); "
          f"workload: "
          f"{w['requests']} requests, prompts {w['prompt_len'][0]}-{w['prompt_len'][1]} tokens, "
          f"{w['new_tokens']} new tokens, all at once")
    table(["arrangement", "threads", "agg tok/s", "wall s", "p50 TTFT s", "p99 TTFT s"],
          [[name, x["threads"], f(x["aggregate_tok_s"], ".1f"), f(x["wall_s"]), f(x["p50_ttft_s"], ".3f"),
            f(x["p99_ttft_s"], ".3f")] for name, x in r["throughput"].items()])
    ms = lambda key: f(k[key] * 1e3)
    print(f"\nKV of a {k['prompt_tokens']}-token prompt: {k['bytes'] / 1e6:.1f} MB; prefill {f(k['prefill_s'], '.3f')} "
          f"s; move {ms('move_s')} ms = reserve RPC {ms('reserve_rpc_s')} + export {ms('export_s')} + send/recv "
          f"{ms('send_recv_s')} + install {ms('install_s')} + ack {ms('ack_s')} ms; wire {f(k['wire_gb_s'])} GB/s, "
          f"whole move {f(k['move_gb_s'])} GB/s (medians of {k['rounds']})")
    print(f"\nTTFT, disaggregated mesh, Poisson arrivals, {w['rate_new_tokens']} new tokens "
          "(client: send -> first delta; router: timings.ttft_s)")
    table(["req/s", "n", "client p50 s", "client p99 s", "router p50 s", "router p99 s", "wall s"],
          [[str(x["rate_req_s"]), str(x["requests"]), *(f(x[key], ".3f") for key in (
              "client_ttft_p50_s", "client_ttft_p99_s", "router_ttft_p50_s", "router_ttft_p99_s")),
            f(x["wall_s"], ".1f")] for x in r["ttft"]])
    print("\nratios:")
    for name, (v, target) in r["ratios"].items():
        print(f"  {name:<60} {f(v):>6}  {('target ' + target) if target else ''}")
    print(f"\nreproduce: {command}")


def batch1(model: str, loaded: LoadedModel, tok: Tokenizer, threads: int, new_tokens: int, seed: int,
           weights: str) -> None:
    """Batch-1 decode through the engine and the meshes: one 128-token prompt, `new_tokens` greedy tokens,
    the better of two runs after a warm-up (the engine before and after the meshes)."""
    prompt = make_prompts(1, 128, 128, loaded.config.vocab_size, seed)
    warm = make_prompts(1, 16, 16, loaded.config.vocab_size, seed + 1)
    mb = kv_mb(prompt, new_tokens, KvSpec.for_model(loaded.config, BLOCK).bytes_per_token)
    cfg = engine_config(Topology.local(model, "inproc", disaggregated=False, threads=threads,
                                       kv_cache_mb=mb, weights=weights).worker("worker-0"))
    best = lambda runs: max(x["aggregate_tok_s"] for x in runs)
    rates: dict[str, float] = {}
    rates[ENGINE] = best([engine_phase(loaded, tok, cfg, prompt, warm, new_tokens) for _ in range(2)])
    for name, disaggregated in ((PROCS, False), (DISAGG, True)):
        gc.collect()
        with process_mesh(model, disaggregated, threads, mb, weights) as topo:  # every worker all threads, as `up`
            rates[name] = best([run_client(topo.frontend, prompt, warm, new_tokens) for _ in range(2)])
    rates[ENGINE_AGAIN] = best([engine_phase(loaded, tok, cfg, prompt, warm, new_tokens) for _ in range(2)])
    peer = llama_cpp_batch1(Path(model), threads, prompt[0], warm[0], new_tokens) if Path(model).is_file() else None
    engine = max(rates[ENGINE], rates[ENGINE_AGAIN])
    print(f"\nbatch-1 decode, SmolLM2-135M ({loaded.weights} weights), {threads} threads, {new_tokens} greedy tokens "
          f"(prompt and decode: new tokens / wall):")
    for name, rate in rates.items():
        vs_peer = f", {rate / peer:.2f}x llama.cpp" if isinstance(peer, float) else ""
        print(f"  {name:>32}: {rate:6.1f} tok/s  ({rate / engine:.2f} of the engine's better run{vs_peer})")
    if isinstance(peer, float):
        print(f"  {'llama.cpp, same GGUF and threads':>32}: {peer:6.1f} tok/s  (after the engine's second run)")
    elif isinstance(peer, str):
        print(f"  llama.cpp: {peer}")
    print(f"reproduce: python -m bench.bench_mesh --batch1 {new_tokens} --threads {threads} --weights {weights}")


def llama_cpp_batch1(gguf: Path, threads: int, prompt: list[int], warm: list[int], new_tokens: int) -> float | str:
    """llama.cpp's batch-1 rate on the same GGUF, prompt and threads, measured as the meshes are (new tokens /
    wall, the prompt included; the better of two runs after a warm-up), or why it was skipped."""
    from bench.bench_engine import LlamaCpp, import_llama_cpp

    lc, why = import_llama_cpp()
    if lc is None:
        return str(why)
    peer = LlamaCpp(lc, gguf, threads)
    try:
        peer.open(1, len(prompt) + new_tokens)
        peer.generate([warm], 4)
        return max(peer.generate([prompt], new_tokens)["aggregate_tok_s"] for _ in range(2))
    finally:
        peer.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run (~2 min): 8 requests, 16 new tokens, short prompts")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads of the engine and "
                    "the co-located worker; the disaggregated workers get half each (at least 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-inproc", action="store_true", help="skip the in-process mesh")
    ap.add_argument("--out", type=Path, help="write the JSON report here")
    ap.add_argument("--no-plots", action="store_true", help="no PNG figures beside the JSON (bench/plots.py)")
    ap.add_argument("--batch1", type=int, metavar="N", help="only batch-1 decode of N tokens: engine vs meshes")
    ap.add_argument("--weights", choices=WEIGHTS_MODES, default=DEFAULT_WEIGHTS,
                    help="how the engine and every worker hold the weights (EngineConfig.weights)")
    args = ap.parse_args(argv)
    w = dict(QUICK if args.quick else FULL)
    command = (f"python -m bench.bench_mesh{' --quick' if args.quick else ''} --threads {args.threads} "
               f"--seed {args.seed} --weights {args.weights}" + (" --no-inproc" if args.no_inproc else "")
               + (f" --out {args.out}" if args.out else ""))
    torch.set_num_threads(args.threads)
    split = max(1, args.threads // 2)

    path = fetch_smollm2()
    model = str(path)
    loaded, tok = load_model_weights(path, args.weights), Tokenizer.load(path)
    if args.batch1:
        batch1(model, loaded, tok, args.threads, args.batch1, args.seed * 1000 + 6, args.weights)
        return
    vocab = loaded.config.vocab_size
    prompts = make_prompts(w["requests"], *w["prompt_len"], vocab, args.seed * 1000 + 1)
    warm = make_prompts(2, 16, 32, vocab, args.seed * 1000 + 2)
    rate_prompts = make_prompts(w["rate_requests"], *w["rate_prompt_len"], vocab, args.seed * 1000 + 3)
    per_token = KvSpec.for_model(loaded.config, BLOCK).bytes_per_token
    mb = kv_mb(prompts + rate_prompts, max(w["new_tokens"], w["rate_new_tokens"]), per_token)
    cfg = engine_config(Topology.local(model, "inproc", disaggregated=False, threads=args.threads,
                                       kv_cache_mb=mb, weights=args.weights).worker("worker-0"))
    r: dict[str, Any] = {
        "model": model, "fingerprint": loaded.fingerprint, "weights": loaded.weights, "command": command,
        "throughput": {},
        "workload": {k: list(v) if isinstance(v, tuple) else v for k, v in w.items()} | {"kv_cache_mb": mb},
        "env": {"threads": args.threads, "torch": torch.__version__, "python": platform.python_version(),
                "machine": platform.machine(), "cpus": os.cpu_count(), "loadavg": os.getloadavg()}}
    tp, n_new = r["throughput"], w["new_tokens"]

    def step(name: str) -> None:
        gc.collect()  # the last phase's engines and sockets go before the next is measured
        print(f"{name} ...", file=sys.stderr)

    step(ENGINE)
    tp[ENGINE] = engine_phase(loaded, tok, cfg, prompts, warm, n_new) | {"threads": str(args.threads)}
    step("KV transfer")
    r["kv_transfer"] = kv_transfer(loaded, args.threads, w["kv_prompt"], w["kv_repeats"], args.seed * 1000 + 4)
    if not args.no_inproc:
        step(INPROC)
        tp[INPROC] = run_inproc_mesh(model, args.threads, mb, prompts, warm, n_new, args.weights) | {
            "threads": str(args.threads)}
    step(PROCS)
    with process_mesh(model, False, args.threads, mb, args.weights) as topo:
        tp[PROCS] = run_client(topo.frontend, prompts, warm, n_new) | {"threads": str(args.threads)}
    step(DISAGG)
    with process_mesh(model, True, split, mb, args.weights) as topo:
        tp[DISAGG] = run_client(topo.frontend, prompts, warm, n_new) | {"threads": f"{split}+{split}"}
        r["ttft"] = []
        for i, rate in enumerate(w["rates"]):
            step(f"  {rate} req/s")
            seed = args.seed * 1000 + 5 + i
            r["ttft"].append(run_rate(topo.frontend, rate, rate_prompts, w["rate_new_tokens"], seed))
    step(ENGINE_AGAIN)  # brackets the meshes: on a noisy machine the two engine runs show how much it moved
    tp[ENGINE_AGAIN] = engine_phase(loaded, tok, cfg, prompts, warm, n_new) | {"threads": str(args.threads)}
    r["ratios"] = ratios(r)
    print_report(r, command)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(r, indent=2, default=str))
        print(f"wrote {args.out}")
        if not args.no_plots:
            from bench import plots

            plots.write("mesh", json.loads(json.dumps(r, default=str)), args.out)


if __name__ == "__main__":
    main()
