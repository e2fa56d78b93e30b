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

The JSON string's text is not the free text, and speculation's acceptance depends on the text. So a third arm,
"same text", is constrained by a regex that every text without a NUL matches (`[^\x00]*`: the grammar walks the
whole vocabulary each step, as in a JSON string) and generates exactly the free arm's tokens (checked): with
speculation, its ratio to free is the masking's cost with the same drafts accepted. That holds only for prompts
whose free answer the regex allows whole and that has no EOS in it (the constraint ends a request at EOS, also
with `ignore_eos`), so every arm runs on the prompts whose free greedy answer is such (found first, printed).

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
from deepinfer.grammar import Constraint, ConstraintSpec, GrammarCache, compile_grammar, grammar_vocab
from deepinfer.loading.fetch import fetch_smollm2
from tests.structured_schemas import SCHEMAS

LONG_STRING = ConstraintSpec.json_schema({"type": "object", "properties": {"text": {
    "type": "string", "minLength": 4096}}, "required": ["text"]})
ANY_TEXT = ConstraintSpec.regex("[^\\x00]*")


def decode_s_per_token(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
                       outputs: dict[int, list[int]] | None = None) -> float:
    """Seconds of decode steps per generated token for `prompts` run together to the end (their output ids into
    `outputs` by prompt index, when given)."""
    rids = {f"r{i}-{time.monotonic_ns()}": i for i in range(len(prompts))}
    for rid, i in rids.items():
        engine.add_request(rid, prompts[i], params)
    seconds, tokens = 0.0, 0
    while engine.has_unfinished():
        computed, generated = engine.stats.tokens_computed, engine.stats.tokens_generated
        started = time.perf_counter()
        finished = engine.step()
        elapsed = time.perf_counter() - started
        if outputs is not None:
            outputs.update({rids[o.request_id]: list(o.token_ids) for o in finished if o.finished})
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
    arms = {"free": SamplingParams(max_tokens=tokens, ignore_eos=True),
            "constrained": SamplingParams(max_tokens=tokens, ignore_eos=True, constraint=LONG_STRING),
            "same_text": SamplingParams(max_tokens=tokens, ignore_eos=True, constraint=ANY_TEXT)}
    engine = LLMEngine.load(path, config)
    for params in arms.values():  # warm-up: kernels, the grammars' compiles, pages
        decode_s_per_token(engine, prompts[:2], params)
    runs: dict[str, list[float]] = {arm: [] for arm in arms}
    texts: dict[str, dict[int, list[int]]] = {arm: {} for arm in arms}
    for _ in range(repeats):
        for arm, params in arms.items():
            runs[arm].append(decode_s_per_token(engine, prompts, params, texts[arm]))
    if texts["same_text"] != texts["free"]:
        raise SystemExit("the same-text arm's tokens differ from the free arm's: not like for like")
    out = {arm: statistics.median(v) for arm, v in runs.items()}
    out["ratio"] = out["constrained"] / out["free"]
    out["same_text_ratio"] = out["same_text"] / out["free"]
    return out


def same_text_prompts(path: str, prompts: list[list[int]], tokens: int, threads: int) -> list[list[int]]:
    """The prompts whose free greedy answer of `tokens` tokens ANY_TEXT allows whole, EOS-free (docstring)."""
    engine = LLMEngine.load(path, EngineConfig(kv_cache_bytes=512 << 20, num_threads=threads))
    assert engine.tokenizer is not None
    eos = engine.tokenizer.eos_token_ids
    cache = GrammarCache(grammar_vocab(engine.tokenizer, n_vocab=49152, eos_token_ids=eos))
    answers = engine.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
    kept = []
    for prompt, answer in zip(prompts, answers, strict=True):
        ids = list(answer.token_ids)
        if not set(ids) & set(eos) and Constraint(cache.compile(ANY_TEXT)).accept_many(ids) == len(ids):
            kept.append(prompt)
    return kept


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
    prompts = same_text_prompts(path, prompts, args.tokens, args.threads)
    print(f"{len(prompts)} of {len(SCHEMAS)} prompts have a free answer the same-text arm can give")
    report: dict[str, object] = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                                 "torch": torch.__version__, "args": vars(args), "decode": []}
    print(f"decode ms per token, constrained (JSON string) vs free, {args.tokens} tokens per request, medians of "
          f"{args.repeats}")
    for speculative in (None, "ngram"):
        for batch in (int(b) for b in args.batches.split(",")):
            batch_prompts = (prompts * (batch // len(prompts) + 1))[:batch]
            r = measure(path, batch_prompts, args.tokens, args.repeats, args.threads, speculative)
            print(f"  batch {batch:>3}, speculation {speculative or 'off':>5}: free {1e3 * r['free']:7.2f}  "
                  f"constrained {1e3 * r['constrained']:7.2f}  ratio {r['ratio']:.3f}  same text "
                  f"{1e3 * r['same_text']:7.2f}  ratio {r['same_text_ratio']:.3f}", flush=True)
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
