"""Preemption on SmolLM2-135M, in process: a KV pool too small for every stream at once, victims swapped to host
memory and back (the default policy) against victims always recomputed, with an ample pool as the floor.

    python -m bench.bench_preemption [--model smollm2] [--threads N] [--streams 16] [--prompt-tokens 256]
                                     [--new-tokens 128] [--pool-share 0.5] [--repeats 3]

All streams are submitted at once (greedy, EOS ignored) and the engine steps until every one has finished. Arms,
one engine each, the same prompts in every arm:

* ample: a pool that holds every stream to its end (no preemption);
* swap: a pool of `--pool-share` of that, `swap_space_mb` at its default (engine/preemption.py decides per victim
  from measured rates: copy seconds per block against step seconds per token);
* recompute: the same pool, `swap_space_bytes = 0` (every victim recomputes, less what the pool still caches).

Each repeat runs the arms interleaved under a cache salt of its own (no arm or repeat reuses another's blocks);
figures are medians over repeats. Printed per arm: wall seconds, generated tokens per second and its ratio to the
recompute arm's, preemptions (swapped), the tokens the model computed over the tokens a run without preemption
computes, and whether every stream's tokens equal the ample arm's.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import random
import statistics
import sys
import time

import structlog
import torch

from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import SamplingParams
from deepinfer.launch.tuning import tune_malloc

BLOCK = 16
ARMS = ("ample", "swap", "recompute")


def run(engine: LLMEngine, prompts: list[list[int]], new_tokens: int, salt: str) -> dict[str, object]:
    """Every prompt at once, stepped to the end: wall time, the engine's counters' growth, the outputs."""
    before = dataclasses.asdict(engine.stats)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    ids = [engine.add_request(f"{salt}-{i}", p, params, cache_salt=salt) for i, p in enumerate(prompts)]
    outputs: dict[str, list[int]] = {}
    started = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
    wall = time.perf_counter() - started
    grown = {k: v - before[k] for k, v in dataclasses.asdict(engine.stats).items()}
    return {"wall_s": wall, "outputs": [outputs[i] for i in ids], **grown}


def main(argv: list[str] | None = None) -> None:
    tune_malloc()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))  # no per-step debug
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--pool-share", type=float, default=0.5, help="the small pool, as a share of the ample one")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    per_stream = -(-(args.prompt_tokens + args.new_tokens) // BLOCK)
    ample_blocks = args.streams * per_stream
    small_blocks = max(per_stream + 1, int(ample_blocks * args.pool_share))
    base = dict(block_size=BLOCK, max_num_batched_tokens=2048, max_num_seqs=args.streams, num_threads=args.threads)
    configs = {"ample": EngineConfig(num_kv_blocks=ample_blocks, **base),
               "swap": EngineConfig(num_kv_blocks=small_blocks, **base),
               "recompute": EngineConfig(num_kv_blocks=small_blocks, swap_space_bytes=0, **base)}
    engines = {arm: LLMEngine.load(args.model, cfg) for arm, cfg in configs.items()}
    rng = random.Random(args.seed)
    vocab = engines["ample"].model_config.vocab_size
    prompts = [[rng.randrange(256, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.streams)]
    print(f"{args.streams} streams x ({args.prompt_tokens} prompt + {args.new_tokens} new) tokens, blocks of {BLOCK}: "
          f"ample pool {ample_blocks} blocks, small pool {small_blocks}; {args.threads} threads")
    runs: dict[str, list[dict[str, object]]] = {arm: [] for arm in ARMS}
    for r in range(args.repeats + 1):  # round 0 warms up
        for arm in ARMS:
            result = run(engines[arm], prompts, args.new_tokens, f"r{r}-{arm}")
            if r:
                runs[arm].append(result)
    needed = args.streams * (args.prompt_tokens + args.new_tokens - 1)
    generated = args.streams * args.new_tokens
    medians = {arm: statistics.median(x["wall_s"] for x in runs[arm]) for arm in ARMS}
    print(f"{'arm':<10} {'wall s':>7} {'tok/s':>7} {'vs recompute':>12} {'preempted':>9} {'swapped':>7} "
          f"{'computed/needed':>15}  same tokens as ample")
    for arm in ARMS:
        last = runs[arm][-1]
        same = all(x["outputs"] == runs["ample"][0]["outputs"] for x in runs[arm])
        print(f"{arm:<10} {medians[arm]:>7.2f} {generated / medians[arm]:>7.1f} "
              f"{medians['recompute'] / medians[arm]:>11.2f}x {last['num_preemptions']:>9} "
              f"{last['num_swapped_preemptions']:>7} {last['tokens_computed'] / needed:>15.2f}  "
              f"{'yes' if same else 'NO'}")
    print(f"swap policy's measured rates (swap arm): {engines['swap'].swap_policy.copy_s_per_block * 1e6:.1f} us per "
          f"block copied, {engines['swap'].swap_policy.compute_s_per_token * 1e6:.1f} us per token computed")
    print("reproduce: python -m bench.bench_preemption " + " ".join(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
