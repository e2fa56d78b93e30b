"""Were the drafts the speculation controller declined worth verifying? Its choices, checked against what came next.

    python -m bench.spec_declined [--workload code] [--requests 4] [--method ngram] [--k 4] [--weights native]

In process on SmolLM2 at concurrency 1, controller on: every offer the guesser makes is logged with the controller's
choice, the requesting request's acceptance estimate and the learned cost of one more row, c(T + 1) / c(T). After
the run, each offer's drafts are compared with the tokens the request really generated at that position. **Prints**,
for the declined offers and for the taken ones: how many leading drafts would have been (or were) accepted, and
how often the first draft was right; then the deciles of the estimate and of the cost ratio at the declines.
Greedy output does not depend on the choices, so the comparison is exact.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence

from bench.spec_workloads import build, max_tokens_for
from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import SamplingParams
from deepinfer.loading.fetch import fetch_smollm2


def leading_matches(drafts: Sequence[int], actual: Sequence[int]) -> int:
    """How many leading drafts equal the tokens that really came."""
    n = 0
    while n < len(drafts) and n < len(actual) and drafts[n] == actual[n]:
        n += 1
    return n


def deciles(xs: Sequence[float]) -> list[float]:
    s = sorted(xs)
    return [round(s[min(len(s) - 1, i * len(s) // 10)], 2) for i in range(11)] if s else []


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="code")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--method", default="ngram")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--weights", default="native")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    engine = LLMEngine.load(fetch_smollm2(progress=False), EngineConfig(
        kv_cache_bytes=256 << 20, num_threads=args.threads, weights=args.weights, speculative=args.method,
        num_speculative_tokens=args.k))
    assert engine.speculator is not None and engine.tokenizer is not None
    ctrl, proposer = engine.speculator.controller, engine.speculator.proposer
    offers: list[tuple[str, int, list[int]]] = []  # (request, tokens so far, drafts) of every non-empty proposal
    choices: list[tuple[int, float, float]] = []  # (k chosen, acceptance estimate, c(T + 1) / c(T)) per such offer
    propose, choose = proposer.propose, ctrl.choose

    def logged_propose(batch, ks):  # type: ignore[no-untyped-def]
        out = propose(batch, ks)
        offers.extend((ctx.request_id, len(ctx.token_ids), list(p.token_ids)) for ctx, p in zip(batch, out)
                      if p.token_ids)
        return out

    def logged_choose(offered, base_rows, costly=False, base_tokens=None):  # type: ignore[no-untyped-def]
        ks = choose(offered, base_rows, costly, base_tokens)
        rise = ctrl.step_cost(base_rows + 1) / ctrl.step_cost(base_rows)
        choices.extend((k, ctrl.acceptance(rid), rise) for (rid, cap, _), k in zip(offered, ks) if cap)
        return ks

    proposer.propose, ctrl.choose = logged_propose, logged_choose  # type: ignore[method-assign]
    texts: dict[str, list[int]] = {}
    for item in build(args.workload, args.requests):
        prompt = engine.tokenizer.encode_chat(item.chat())
        rid = engine.add_request(None, prompt, SamplingParams(max_tokens=max_tokens_for(args.workload)))
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    texts[rid] = prompt + list(out.token_ids)
    assert len(offers) == len(choices), "every non-empty proposal is offered to the controller once"
    hits = [leading_matches(drafts, texts[rid][at:]) for rid, at, drafts in offers]
    for name, keep in (("declined", lambda k: k == 0), ("taken", lambda k: k > 0)):
        mine = [h for h, (k, _, _) in zip(hits, choices) if keep(k)]
        if mine:
            print(f"{name:>8}: {len(mine)} offers, leading drafts right {statistics.mean(mine):.2f} of "
                  f"{args.k}, first draft right {sum(h > 0 for h in mine) / len(mine):.0%}")
    declined = [(a, r) for k, a, r in choices if k == 0]
    print(f"at the declines, acceptance estimate deciles {deciles([a for a, _ in declined])}")
    print(f"at the declines, c(T + 1) / c(T) deciles {deciles([r for _, r in declined])}")
    print("reproduce: python -m bench.spec_declined " + " ".join(argv or []))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
