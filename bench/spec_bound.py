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
from deepinfer.engine.speculative.base import Proposer, SpecContext
from deepinfer.engine.speculative.tree import accepted_path, depths, main_chain_acceptance

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


def _walk(parents: Sequence[int], tokens: Sequence[int], rest: Sequence[int]) -> list[int]:
    """The nodes a greedy target whose next tokens are `rest` walks through a draft tree: every node row's pick is
    the answer's token at that node's depth (only nodes on the answer's path are ever reached)."""
    picks = [rest[0]] + [rest[d] if d < len(rest) else -1 for d in depths(parents)]
    return accepted_path(parents, tokens, picks)


def replay(proposer: Proposer, answers: Sequence[tuple[Sequence[int], Sequence[int]]], k: int,
           tenant: str | None = None) -> Replay:
    """Replay `proposer` over (prompt, answer) pairs in order, up to `k` drafts a step. A step commits the
    longest proposed prefix that matches the answer, then the answer's next token (the target's own). A tree
    proposal (`ngram:tree`) is verified whole, every node (at most k deep): its bound is the tree's."""
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
            proposal = proposer.propose([SpecContext(rid, ctx, len(prompt), GREEDY, tenant)], [k])[0]
            if proposal.parents is None:
                draft = proposal.token_ids[:k]
                a = 0
                while a < len(draft) and pos + a < len(answer) and draft[a] == answer[pos + a]:
                    a += 1
                proposer.observe(rid, len(draft), a)
            else:  # a tree, whole: the walk follows the answer through it (tree.accepted_path with its picks)
                draft, walked = proposal.token_ids, _walk(proposal.parents, proposal.token_ids, answer[pos:])
                a = len(walked)
                proposer.observe(rid, *main_chain_acceptance(proposal.parents, walked))
            take = min(a + 1, len(answer) - pos)
            ctx += answer[pos:pos + take]
            pos, steps = pos + take, steps + 1
            proposed, accepted = proposed + len(draft), accepted + a
        proposer.finished(SpecContext(rid, ctx, len(prompt), GREEDY, tenant))
        tokens += len(answer)
    return Replay(tokens, steps, proposed, accepted)


def make_proposer(method: str) -> Proposer:
    """A fresh guesser as the engine builds it by default (`speculator.build_proposer`'s defaults)."""
    from deepinfer.config.engine import EngineConfig, parse_speculative
    from deepinfer.engine.speculative.speculator import build_proposer

    if parse_speculative(method).kind not in ("ngram", "suffix"):
        raise ValueError(f"spec_bound replays the model-free guessers (ngram, suffix, with :tree), not {method!r}")
    return build_proposer(EngineConfig(speculative=method))


def plain_answers(workload: str, n: int | None, threads: int) -> tuple[list[list[int]], list[list[int]]]:
    """bench_spec's prompts for `workload` at concurrency 1 and their plain greedy answers, generated by bench_spec's
    own baseline (its engine configuration and closed loop), all requests in flight at once: the fp32 kernels are
    batch-invariant, so each answer is the one a request alone gets."""
    import torch

    from bench.bench_spec import engine_config, run_closed_loop
    from bench.spec_workloads import build, max_tokens_for, requests_for
    from deepinfer.engine.engine import LLMEngine
    from deepinfer.loading.fetch import fetch_smollm2
    from deepinfer.loading.weights import load_model_weights
    from deepinfer.text.tokenizer import Tokenizer

    torch.set_num_threads(threads)
    path = fetch_smollm2()
    tok = Tokenizer.load(path)
    prompts = [tok.encode_chat(it.chat()) for it in build(workload, n if n is not None else requests_for(workload, 1))]
    max_tokens = max_tokens_for(workload)
    baseline = argparse.Namespace(threads=threads, prefix_caching=False, num_speculative_tokens=4, no_adaptive=False)
    engine = LLMEngine(load_model_weights(path), tok, engine_config(baseline, None, prompts, max_tokens, len(prompts)))
    res = run_closed_loop(engine, prompts, max_tokens, len(prompts))
    return prompts, [res.outputs[i] for i in range(len(prompts))]


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
