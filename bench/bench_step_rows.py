"""What one engine step costs by its query rows: a decode step that verifies k drafts (rows = k + 1) against a plain
decode step, on packed (native GGUF Q4_1) and fp32 weights.

    python -m bench.bench_step_rows [--rows 1,2,3,5,9,17] [--weights native,fp32] [--context 256] [--steps 32]
                                    [--repeats 3] [--threads 2] [--json out.json]

What is timed: `LLMEngine.step()` in this process (SmolLM2-135M-Instruct, batch 1, greedy), for one request whose
`--context`-token prompt has been prefilled. Each step verifies exactly rows - 1 drafts: this bench's guesser
(`RowsProposer`, put in place of the n-gram one) proposes that many every step, the controller off. It proposes the
tokens that followed the last token's previous occurrence in the context, so some are accepted, as in a real run.
rows = 1 is plain decoding (speculation off). Each arm's figure is the median step over `--steps` steps; arms are
interleaved `--repeats` times, and the median of those medians is printed with its ratio to the 1-row step of the
same weights. Issue 34's targets: 5 rows <= 1.3x and 9 rows <= 1.6x a 1-row step.

Also printed, per row count: the step's path (the one-call decode loop of kernels/decode_layers.py, or the per-op
path) and the floor a step's fp32 products set on this machine: rows x the model's multiply-adds / the FMA peak
measured here (torch's fp32 matmul on a large square), beside the 1-row step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Sequence

import torch

from bench.bench_engine import matmul_gflops
from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import SamplingParams
from deepinfer.engine.speculative.base import Proposal, Proposer, SpecContext
from deepinfer.loading.fetch import fetch_smollm2


class RowsProposer(Proposer):
    """Always exactly ks[i] tokens: what followed the last token's previous occurrence, padded with it."""

    def propose(self, batch: Sequence[SpecContext], ks: Sequence[int]) -> list[Proposal]:
        out = []
        for ctx, k in zip(batch, ks, strict=True):
            ids = list(ctx.token_ids)
            last = ids[-1]
            at = max((i for i in range(len(ids) - 1) if ids[i] == last), default=None)
            follow = ids[at + 1: at + 1 + k] if at is not None else []
            out.append(Proposal(token_ids=(follow + [last] * k)[:k]))
        return out


def engine_for(path: str, weights: str, rows: int, threads: int) -> LLMEngine:
    spec = {} if rows == 1 else {"speculative": "ngram", "num_speculative_tokens": rows - 1,
                                 "adaptive_speculation": False}
    engine = LLMEngine.load(path, EngineConfig(kv_cache_bytes=256 << 20, num_threads=threads, weights=weights, **spec))
    if engine.speculator is not None:
        engine.speculator.proposer = RowsProposer()
    return engine


def step_seconds(engine: LLMEngine, prompt: list[int], steps: int) -> list[float]:
    """Seconds of each of `steps` decode steps of one request after its prefill."""
    rid = f"r{time.monotonic_ns()}"
    engine.add_request(rid, prompt, SamplingParams(max_tokens=steps * 32 + 1, ignore_eos=True))
    engine.step()  # the prefill
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return times


def macs_per_row(engine: LLMEngine) -> int:
    """The projections' and LM head's multiply-adds for one query row (attention's own are left out)."""
    c = engine.model_config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    return c.num_layers * per_layer + c.vocab_size * c.hidden_size


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,3,5,9,17")
    ap.add_argument("--weights", default="native,fp32")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    if 1 not in rows:
        rows = [1, *rows]
    path = str(fetch_smollm2(progress=False))
    report: dict[str, object] = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                                 "torch": torch.__version__, "args": vars(args), "arms": []}
    torch.set_num_threads(args.threads)
    peak = matmul_gflops() * 1e9
    print(f"fp32 matmul peak here: {peak / 1e9:.0f} GFLOP/s ({args.threads} threads)")
    for weights in args.weights.split(","):
        engines = {r: engine_for(path, weights, r, args.threads) for r in rows}
        tok = engines[1].tokenizer
        assert tok is not None
        text = "def rename(items):\n    return [item.strip().lower() for item in items if item]\n" * 40
        prompt = tok.encode(text)[: args.context]
        macs = macs_per_row(engines[1])
        stack = engines[1].runner.model.decode_stack()
        paths = {r: "loop" if stack is not None and r <= stack.max_rows() else "per-op" for r in rows}
        for e in engines.values():  # warm-up: kernels, pages
            step_seconds(e, prompt, 4)
        medians: dict[int, list[float]] = {r: [] for r in rows}
        for _ in range(args.repeats):
            for r, e in engines.items():
                medians[r].append(statistics.median(step_seconds(e, prompt, args.steps)))
        base = statistics.median(medians[1])
        print(f"weights {weights}: one request, {args.context}-token context, median step of {args.steps}, "
              f"medians of {args.repeats}")
        for r in rows:
            ms = statistics.median(medians[r])
            floor = r * 2 * macs / peak
            print(f"  rows {r:>3}: {1e3 * ms:7.2f} ms  x{ms / base:5.2f} of 1 row  path {paths[r]:>6}  "
                  f"fp32 FMA floor {1e3 * floor:6.2f} ms", flush=True)
            report["arms"].append({"weights": weights, "rows": r, "step_s": ms, "ratio": ms / base,  # type: ignore[union-attr]
                                   "path": paths[r], "fma_floor_s": floor})
    print("reproduce: python -m bench.bench_step_rows " + " ".join(argv or []))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
