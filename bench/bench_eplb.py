"""The expert balancer's core alone at DeepSeek's scale: max/mean rank load before and after, and the time
to compute a placement.

    python -m bench.bench_eplb                      # every load, every group shape
    python -m bench.bench_eplb --max-moves 32       # also: plan/adopt rounds of at most 32 moves per layer

256 routed experts, 58 MoE layers, 32 redundant replicas per layer (288 in all), on EP 32, 64 and 144 ranks.
A group shape is (ranks, slots per rank): 32x9 (all full), 64x5 (288 of 320 slots used, as the static table
has it), 144x3 (the static table's shape: 288 of 432) and 144x2 (all full, 2 per rank).

Loads (per layer, tokens per logical expert; seeded):
* zipf-s: expert popularity proportional to 1/k^s over a random permutation of the experts (one per layer),
  then 16,384 tokens x top-8 = 131,072 assignments drawn multinomially;
* smollm2: bench/data/smollm2-moe/expert_load.json (16 experts x 30 layers, measured by bench.moe_skew):
  synthetic layer l takes measured layer l mod 30 and draws its 256 experts' loads with replacement from
  that layer's 16 (so each layer keeps its measured spread of loads, not a tiled copy that would balance
  trivially).

Figures, mean over the 58 layers (and the worst layer): max/mean of the rank loads under the static table
(`ExpertPlacement.static`: contiguous blocks, replicas of the first experts of each block, blind to load),
under `balancer_placement.rebalance` (global policy), and the lower bound the loads allow with 288 replicas
(`balancer_placement.lower_bound` with the slots per rank: the mean, the heaviest replica under the best replica
counts, and with few slots per rank the whole experts that must share a rank; a bound, not necessarily
reachable). Time: wall seconds of one `rebalance` for all 58 layers
(pure Python and numpy on one core); printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from deepinfer.engine.ep.placement import ExpertPlacement
from deepinfer.services.balancer_core import BalancerCore
from deepinfer.services.balancer_placement import lower_bound, max_over_mean, rank_loads, rebalance

EXPERTS, LAYERS, REDUNDANT = 256, 58, 32
SHAPES = ((32, 9), (64, 5), (144, 3), (144, 2))
TOKENS, TOP_K = 16_384, 8
SMOLLM2 = Path(__file__).parent / "data" / "smollm2-moe" / "expert_load.json"


def zipf_loads(s: float, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, EXPERTS + 1) ** s
    p /= p.sum()
    return [rng.multinomial(TOKENS * TOP_K, p[rng.permutation(EXPERTS)]).tolist() for _ in range(LAYERS)]


def smollm2_loads(seed: int) -> list[list[int]]:
    measured = json.loads(SMOLLM2.read_text())["load"]
    rng = np.random.default_rng(seed)
    return [rng.choice(measured[layer % len(measured)], size=EXPERTS, replace=True).tolist()
            for layer in range(LAYERS)]


def summary(values: list[float]) -> str:
    return f"{statistics.fmean(values):6.3f} ({max(values):5.3f})"


def rounds(loads: list[list[int]], ranks: int, slots: int, max_moves: int) -> tuple[int, float, float]:
    """Plan/adopt from the static table with at most `max_moves` moves per layer per decision, until the
    core has nothing worth a move: (decisions, their total seconds, final mean max/mean)."""
    static = ExpertPlacement.static(LAYERS, EXPERTS, ranks, REDUNDANT)
    start = static if static.slots_per_rank == slots else rebalance(
        [[1] * EXPERTS] * LAYERS, ranks, slots, redundant=REDUNDANT)
    core = BalancerCore(start, window_s=60.0, threshold=0.05, max_moves=max_moves, redundant=REDUNDANT)
    core.observe(loads, version=start.version, now=0.0)
    n, took = 0, 0.0
    while True:
        t0 = time.perf_counter()
        decision = core.plan(1.0)
        took += time.perf_counter() - t0
        if decision is None:
            break
        core.adopt(decision.placement)
        n += 1
    return n, took, statistics.fmean(max_over_mean(r) for r in rank_loads(core.current, loads))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--zipf", default="0.6,1.0", help="comma-separated Zipf exponents")
    parser.add_argument("--max-moves", type=int, default=None,
                        help="also run the core's plan/adopt rounds with this many moves per layer at most")
    args = parser.parse_args()

    sources = {f"zipf-{s}": zipf_loads(float(s), args.seed) for s in args.zipf.split(",") if s}
    sources["smollm2"] = smollm2_loads(args.seed)
    print(f"{EXPERTS} experts x {LAYERS} MoE layers, {REDUNDANT} redundant; max/mean mean over layers (worst)")
    head = f"{'load':>9} {'ranks':>5} {'slots':>5} {'static':>15} {'balanced':>15} {'bound':>15} {'time s':>7}"
    if args.max_moves:
        head += f" {'rounds':>6} {'plan s':>7} {'after rounds':>12}"
    print(head)
    for name, loads in sources.items():
        for ranks, slots in SHAPES:
            static = ExpertPlacement.static(LAYERS, EXPERTS, ranks, REDUNDANT)
            before = [max_over_mean(r) for r in rank_loads(static, loads)]
            t0 = time.perf_counter()
            placed = rebalance(loads, ranks, slots, redundant=REDUNDANT)
            took = time.perf_counter() - t0
            after = [max_over_mean(r) for r in rank_loads(placed, loads)]
            bound = [lower_bound(w, ranks, EXPERTS + REDUNDANT, slots) for w in loads]
            line = (f"{name:>9} {ranks:>5} {slots:>5} {summary(before):>15} {summary(after):>15} "
                    f"{summary(bound):>15} {took:>7.2f}")
            if args.max_moves:
                n, plan_s, final = rounds(loads, ranks, slots, args.max_moves)
                line += f" {n:>6} {plan_s / max(n, 1):>7.2f} {final:>12.3f}"
            print(line, flush=True)
    print("reproduce: python -m bench.bench_eplb " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
