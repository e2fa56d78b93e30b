"""Structured output's cost in the engine: decode time per token, constrained against free, at batch 1 and 32, with and
without speculation; and the compile time of tests/structured_schemas.py's 50 schemas.

    .venv/bin/python -m bench.bench_structured [--batches 1,32] [--tokens 96] [--repeats 3] [--threads 2]

What is timed: `LLMEngine.step()` in this process (SmolLM2-135M, native Q4_1 weights), the decode steps only (steps
that compute no prompt token), per output token. Both arms generate exactly `--tokens` tokens per request from the
same prompts: the free arm with `ignore_eos`, the constrained one under a JSON schema whose one string must be
longer than that (`{"text": <string of minLength 4096>}`), so every step of it computes a mask, applies it and
advances the grammar, and neither arm stops early. The arms alternate, `--repeats` times each, fresh engines, a
warm-up round first; medians. The ratio constrained / free is the overhead (target <= 1.05). Speculation: the same
with `--speculative ngram` (k = 4, controller off), where each step also masks the drafts' rows.

Compile: each of the 50 schemas compiled from its text to a usable grammar with no cache (`deepinfer.grammar.
compile_grammar`), `--repeats` times; p50 and p99 over all compiles. (bench/bench_grammar.py compares grammar
engines; this is the one the project uses, on the test set.)
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

from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import SamplingParams
from deepinfer.grammar import ConstraintSpec, compile_grammar, grammar_vocab
from deepinfer.loading.fetch import fetch_smollm2
from tests.structured_schemas import SCHEMAS

LONG_STRING = ConstraintSpec.json_schema({"type": "object", "properties": {"text": {
    "type": "string", "minLength": 4096}}, "required": ["text"]})


def decode_s_per_token(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> float:
    """Seconds of decode steps per generated token for `prompts` run together to the end."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}-{time.monotonic_ns()}", p, params)
    seconds, tokens = 0.0, 0
    while engine.has_unfinished():
        computed, generated = engine.stats.tokens_computed, engine.stats.tokens_generated
        started = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - started
        rows = engine.stats.tokens_generated - generated
        # A decode step computes one token per running request (plus drafts): none of a prompt.
        if rows and engine.stats.tokens_computed - computed <= rows * (1 + (engine.config.num_speculative_tokens
                                                                            if engine.config.speculative else 0)):
            seconds += elapsed
            tokens += rows
    return seconds / tokens


def measure(path: str, prompts: list[list[int]], tokens: int, repeats: int, threads: int,
            speculative: str | None) -> dict[str, float]:
    config = EngineConfig(kv_cache_bytes=512 << 20, num_threads=threads, speculative=speculative,
                          num_speculative_tokens=4, adaptive_speculation=False)
    free = SamplingParams(max_tokens=tokens, ignore_eos=True)
    constrained = SamplingParams(max_tokens=tokens, ignore_eos=True, constraint=LONG_STRING)
    engine = LLMEngine.load(path, config)
    decode_s_per_token(engine, prompts[:2], constrained)  # warm-up: kernels, the grammar's compile, pages
    decode_s_per_token(engine, prompts[:2], free)
    runs: dict[str, list[float]] = {"free": [], "constrained": []}
    for _ in range(repeats):
        for arm, params in (("free", free), ("constrained", constrained)):
            runs[arm].append(decode_s_per_token(engine, prompts, params))
    out = {arm: statistics.median(v) for arm, v in runs.items()}
    out["ratio"] = out["constrained"] / out["free"]
    return out


def compile_times(path: str, repeats: int) -> list[float]:
    engine_tok = LLMEngine.load(path, EngineConfig(kv_cache_bytes=16 << 20)).tokenizer
    assert engine_tok is not None
    vocab = grammar_vocab(engine_tok, n_vocab=49152)
    times = []
    for _ in range(repeats):
        for _, schema in SCHEMAS:
            started = time.perf_counter()
            compile_grammar(ConstraintSpec.json_schema(schema, strict=False), vocab)
            times.append(time.perf_counter() - started)
    return times


def percentile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    path = str(fetch_smollm2(progress=False))
    tok = LLMEngine.load(path, EngineConfig(kv_cache_bytes=16 << 20)).tokenizer
    assert tok is not None
    prompts = [tok.encode_chat([{"role": "user", "content": f"Write a long text about {what}, as JSON."}])
               for what, _ in SCHEMAS]
    report: dict[str, object] = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                                 "torch": torch.__version__, "args": vars(args), "decode": []}
    print(f"decode ms per token, constrained (JSON string) vs free, {args.tokens} tokens per request, medians of "
          f"{args.repeats}")
    for speculative in (None, "ngram"):
        for batch in (int(b) for b in args.batches.split(",")):
            r = measure(path, (prompts * 2)[:batch], args.tokens, args.repeats, args.threads, speculative)
            print(f"  batch {batch:>3}, speculation {speculative or 'off':>5}: free {1e3 * r['free']:7.2f}  "
                  f"constrained {1e3 * r['constrained']:7.2f}  ratio {r['ratio']:.3f}", flush=True)
            report["decode"].append({"batch": batch, "speculative": speculative, **r})  # type: ignore[union-attr]
    times = compile_times(path, args.repeats)
    report["compile_s"] = {"p50": percentile(times, 50), "p99": percentile(times, 99), "max": max(times),
                           "n": len(times)}
    print(f"compile, {len(SCHEMAS)} schemas x {args.repeats}: p50 {1e3 * percentile(times, 50):.2f} ms, p99 "
          f"{1e3 * percentile(times, 99):.2f} ms, max {1e3 * max(times):.2f} ms")
    print("reproduce: python -m bench.bench_structured " + " ".join(argv or []))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
