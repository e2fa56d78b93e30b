"""The most a guesser can give on a workload: replay it over the plain run's greedy outputs, verifying for free.

    python -m bench.spec_bound [--workloads agentic,code] [--requests N] [--methods ngram,suffix] [--k 4,16]
                               [--threads 2] [--out bench/results/spec_bound.json]

`bench_spec` measures tokens/s, which mixes three things: how often the guesser is right, what a verification
step costs against a plain one on this machine, and how much of the run is prefill. This separates the first.
For each workload it generates the plain greedy answers once (SmolLM2-135M fp32, the in-process LLMEngine without
speculation, `bench_spec`'s prompts and max_tokens), then for each method and k replays the guesser over them in
request order, as a closed loop at concurrency 1 would see them: every step proposes up to k tokens (no
controller: k every step), accepts the longest prefix that equals the real answer plus one token, and a request's
answer enters the suffix index when it finishes. Reported per (workload, method, k): answer tokens, steps (the
prefill step that makes the first token counts as one), tokens per step, and `decode bound` = plain decode steps
/ replayed steps — the decode speedup if a verification step cost what a plain step does, which on real hardware
it does not (bench_spec's `tok/step` column is the same count under the controller's choices).

Greedy answers are deterministic, so the figures are too (they depend on the build only through the tokens).
See bench/README.md (`spec_bound.py`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from deepinfer.engine.request import SamplingParams
from deepinfer.engine.spec.base import Proposer, SpecContext

GREEDY = SamplingParams(max_tokens=1, temperature=0.0)  # what the contexts carry; guessers here ignore it


@dataclass(frozen=True)
class Replay:
    """One guesser's replay over a list of (prompt, answer) pairs; see the module docstring."""

    tokens: int  # answer tokens
    steps: int  # one per request for its first token, then one per verification step
    proposed: int
    accepted: int

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0


def replay(proposer: Proposer, answers: Sequence[tuple[Sequence[int], Sequence[int]]], k: int,
           tenant: str | None = None) -> Replay:
    """Replay `proposer` over (prompt, answer) pairs in order, up to `k` drafts a step. A step commits the
    longest proposed prefix that matches the answer, then the answer's next token (the target's own)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    tokens = steps = proposed = accepted = 0
    for i, (prompt, answer) in enumerate(answers):
        if not answer:
            continue
        rid = f"replay-{i}"
        ctx = list(prompt) + [answer[0]]
        pos, steps = 1, steps + 1
        while pos < len(answer):
            draft = proposer.propose([SpecContext(rid, ctx, len(prompt), GREEDY, tenant)], [k])[0].token_ids[:k]
            a = 0
            while a < len(draft) and pos + a < len(answer) and draft[a] == answer[pos + a]:
                a += 1
            proposer.observe(rid, len(draft), a)
            take = min(a + 1, len(answer) - pos)
            ctx += answer[pos:pos + take]
            pos, steps = pos + take, steps + 1
            proposed, accepted = proposed + len(draft), accepted + a
        proposer.finished(SpecContext(rid, ctx, len(prompt), GREEDY, tenant))
        tokens += len(answer)
    return Replay(tokens, steps, proposed, accepted)


def make_proposer(method: str) -> Proposer:
    """A fresh guesser as the engine builds it by default (`speculator.build_proposer`'s defaults)."""
    from deepinfer.engine.config import EngineConfig
    from deepinfer.engine.spec.speculator import build_proposer

    if method not in ("ngram", "suffix"):
        raise ValueError(f"spec_bound replays the model-free guessers (ngram, suffix), not {method!r}")
    return build_proposer(EngineConfig(speculative=method))


def plain_answers(workload: str, n: int | None, threads: int) -> tuple[list[list[int]], list[list[int]]]:
    """bench_spec's prompts for `workload` at concurrency 1 and their plain greedy answers."""
    import torch

    from bench.spec_workloads import build, max_tokens_for, requests_for
    from deepinfer.engine.config import EngineConfig
    from deepinfer.engine.engine import LLMEngine
    from deepinfer.engine.fetch import fetch_smollm2
    from deepinfer.engine.tokenizer import Tokenizer
    from deepinfer.engine.weights import load_model_weights

    torch.set_num_threads(threads)
    path = fetch_smollm2()
    tok = Tokenizer.load(path)
    items = build(workload, n if n is not None else requests_for(workload, 1))
    prompts = [tok.encode_chat(it.chat()) for it in items]
    blocks = sum(-(-(len(p) + max_tokens_for(workload) + 1) // 16) for p in prompts) + 16
    engine = LLMEngine(load_model_weights(path), tok,
                       EngineConfig(block_size=16, num_kv_blocks=blocks, num_threads=threads))
    params = SamplingParams(max_tokens=max_tokens_for(workload), temperature=0.0)
    ids = [engine.add_request(None, p, params) for p in prompts]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.token_ids or [])
    return prompts, [done[i] for i in ids]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="code,summary,chat,agentic")
    ap.add_argument("--requests", type=int, default=None, help="requests per workload (default: bench_spec's at c=1)")
    ap.add_argument("--methods", default="ngram,suffix")
    ap.add_argument("--k", default="4,16", help="drafts per step, comma-separated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    ks = [int(x) for x in args.k.split(",") if x.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    rows = []
    print(f"{'workload':<9} {'method':<7} {'k':>3} {'tokens':>7} {'steps':>6} {'tok/step':>9} {'accept':>7} "
          f"{'decode bound':>13}")
    for workload in [w.strip() for w in args.workloads.split(",") if w.strip()]:
        prompts, answers = plain_answers(workload, args.requests, args.threads)
        pairs = list(zip(prompts, answers, strict=True))
        plain_steps = sum(len(a) for a in answers)  # one token a step without speculation
        for method in methods:
            for k in ks:
                r = replay(make_proposer(method), pairs, k)
                bound = plain_steps / r.steps if r.steps else 0.0
                accept = r.accepted / r.proposed if r.proposed else 0.0
                rows.append({"workload": workload, "method": method, "k": k, "requests": len(pairs),
                             "tokens": r.tokens, "steps": r.steps, "tokens_per_step": r.tokens_per_step,
                             "proposed": r.proposed, "accepted": r.accepted, "decode_bound": bound})
                print(f"{workload:<9} {method:<7} {k:>3} {r.tokens:>7} {r.steps:>6} {r.tokens_per_step:>9.2f} "
                      f"{accept:>7.0%} {bound:>12.2f}x", flush=True)
    print("reproduce: python -m bench.spec_bound " + " ".join(sys.argv[1:] if argv is None else argv))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
