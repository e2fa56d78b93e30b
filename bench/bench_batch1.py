"""Batch-1 decode, alternated in one process: the engine with its native decode layer loop, the engine per op,
and llama.cpp, round after round on the same prompt.

    python -m bench.bench_batch1 [--rounds 5] [--threads 2] [--new-tokens 128] [--seed 0] [--out report.json]

On a shared VM absolute figures move 10–40% between minutes (bench_engine runs each peer once, minutes
apart); alternating the three in short rounds puts each round's ratio on the same machine state, and the
median of the rounds' ratios is the figure to quote. Same GGUF (SmolLM2-135M-Instruct Q4_1), same threads,
the same prompt as bench_engine's c=1 cell (seed 0: 196 tokens), greedy, EOS ignored, `--new-tokens` each;
tokens/s is decode only (after the first token). The engine's two modes must produce the same tokens (the
loop is bit for bit the per-op step); agreement with llama.cpp is reported, not required (its products
round differently).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from bench.bench_engine import LlamaCpp, import_llama_cpp, load_for, make_prompts, run_engine, same_prefix
from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.loading.fetch import fetch_smollm2


def engine_round(engine: LLMEngine, prompt: list[int], n_new: int, loop: bool) -> dict[str, Any]:
    model = engine.runner.model
    model.use_decode_loop(loop)
    res = run_engine(engine, [prompt], n_new)
    ran = model.decode_stack() is not None
    model.use_decode_loop(True)
    if loop and not ran:
        raise RuntimeError("the native decode loop does not apply to this model here (no compiler?)")
    return {"tok_s": res["decode_only_tok_s"], "tokens": res["tokens"][0]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = fetch_smollm2()
    loaded = load_for(path, "native")
    prompt = make_prompts(1, 128, 512, loaded.config.vocab_size, args.seed * 1000 + 1)[0]
    n_new = args.new_tokens
    engine = LLMEngine(loaded, None, EngineConfig(block_size=16, num_kv_blocks=(len(prompt) + n_new) // 16 + 8,
                                                  max_num_seqs=8, num_threads=args.threads, weights="native"))
    lc, why = import_llama_cpp()
    peer = None
    if lc is None:
        print(why, file=sys.stderr)
    else:
        peer = LlamaCpp(lc, path, args.threads)
        peer.open(1, len(prompt) + n_new)
    warm = make_prompts(1, 16, 32, loaded.config.vocab_size, 12345)[0]
    run_engine(engine, [warm], 4)
    if peer is not None:
        peer.generate([warm], 4)
    rounds: list[dict[str, float]] = []
    tokens: dict[str, list[int]] = {}
    try:
        for i in range(args.rounds):
            row: dict[str, float] = {}
            for name, loop in (("loop", True), ("per_op", False)):
                r = engine_round(engine, prompt, n_new, loop)
                row[name] = r["tok_s"]
                if tokens.setdefault(name, r["tokens"]) != r["tokens"]:
                    raise AssertionError(f"the engine's {name} tokens changed between rounds")
            if peer is not None:
                r = peer.generate([prompt], n_new)
                row["llama_cpp"] = r["decode_only_tok_s"]
                tokens["llama_cpp"] = r["tokens"][0]
            rounds.append(row)
            print(f"round {i + 1}: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in row.items()), file=sys.stderr)
    finally:
        if peer is not None:
            peer.close()
    if tokens["loop"] != tokens["per_op"]:
        raise AssertionError("the native loop's tokens differ from the per-op path's")
    report: dict[str, Any] = {"command": "python -m bench.bench_batch1 " + " ".join(argv or sys.argv[1:]),
                              "prompt_tokens": len(prompt), "new_tokens": n_new, "threads": args.threads,
                              "rounds": rounds, "median_tok_s": {k: statistics.median(r[k] for r in rounds)
                                                                 for k in rounds[0]}}
    ratios = {"loop / per_op": [r["loop"] / r["per_op"] for r in rounds]}
    if peer is not None:
        ratios["loop / llama_cpp"] = [r["loop"] / r["llama_cpp"] for r in rounds]
        ratios["per_op / llama_cpp"] = [r["per_op"] / r["llama_cpp"] for r in rounds]
        report["greedy_shared_with_llama_cpp"] = same_prefix(tokens["loop"], tokens["llama_cpp"]) / n_new
    report["ratios"] = {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in ratios.items()}
    print(f"\nbatch-1 decode, {len(prompt)}-token prompt, {n_new} new tokens, {args.threads} threads, "
          f"{args.rounds} alternated rounds (decode-only tok/s, median):")
    for k, v in report["median_tok_s"].items():
        print(f"  {k:10s} {v:7.1f}")
    for k, v in report["ratios"].items():
        print(f"  {k:22s} median {v['median']:.2f}x (rounds {v['min']:.2f}-{v['max']:.2f})")
    if "greedy_shared_with_llama_cpp" in report:
        print(f"  greedy tokens shared with llama.cpp before the first difference: "
              f"{report['greedy_shared_with_llama_cpp']:.2f}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
