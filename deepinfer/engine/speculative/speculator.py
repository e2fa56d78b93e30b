"""The engine's side of speculative decoding: one object between the scheduler and the model runner.

Per step, on the engine thread:
1. `plan(running, budget)` — before scheduling: for each running request in its decode phase, the
   most drafts it may take (the cap, what `max_tokens` and the context limit leave), the guess itself
   for a cheap guesser, then the controller's k; sets `Request.num_spec_tokens` (and keeps the guesses).
2. the scheduler grants drafts where blocks and budget allow (`ScheduledChunk.num_spec`);
3. `draft(sched)` — fills each granted chunk's `draft_token_ids` (running a draft model for a costly
   guesser), shrinking a chunk whose guesser proposed fewer; a tree's chosen nodes go with their
   `draft_parents` (tree.py; a request with an output constraint is offered its tree's main chain only);
4. the runner computes 1 + k rows per speculating chunk; `verify` picks the committed tokens;
5. `record_step` / `record(chunk, accepted)` feed the controller's cost curve and acceptance.
`finished(req)` ends a request's speculation state (and lets a learning guesser learn from it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import structlog
import torch

from deepinfer.config.engine import EngineConfig, parse_speculative
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import ScheduledChunk, SchedulerOutput
from deepinfer.engine.speculative import tree
from deepinfer.engine.speculative.base import Proposal, Proposer, SpecContext
from deepinfer.engine.speculative.controller import Offer, SpecController
from deepinfer.engine.speculative.registry import ProposerArgs, registration

log = structlog.get_logger("deepinfer.engine")


def context_of(req: Request) -> SpecContext:
    return SpecContext(req.request_id, req.all_token_ids, len(req.prompt_token_ids), req.params, req.tenant,
                       req.block_ids, req.num_preemptions)


class Speculator:
    def __init__(self, config: EngineConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.controller = SpecController(self.max_k, adaptive=config.adaptive_speculation)
        self._probs: dict[str, torch.Tensor] = {}  # request id -> q rows of this step's sampled drafts
        self._planned: list[Request] = []
        # A cheap guesser's drafts planned for this step: tokens and a tree's parents (None: a chain).
        self._guesses: dict[str, tuple[list[int], list[int] | None]] = {}

    def plan(self, running: Sequence[Request], budget: int) -> None:
        candidates = [r for r in running if r.num_tokens - r.num_computed_tokens == 1 and not r.prefill_only]
        caps = [self._cap(r) for r in candidates]
        candidates = [r for r, c in zip(candidates, caps) if c > 0]
        caps = [c for c in caps if c > 0]
        if not candidates:
            return
        # Rows of the step without any drafts: every running request's next chunk, up to the budget.
        base_rows = min(budget, sum(r.num_tokens - r.num_computed_tokens for r in running))
        proposals: list[Proposal] = []
        offers: list[Offer]
        if self.proposer.cheap:
            proposals = self.proposer.propose([context_of(r) for r in candidates], caps)
            proposals = [_checked_tree(p, self.proposer) if p.parents is not None else p for p in proposals]
            proposals = [p if p.parents is None or r.params.constraint is None else _main_chain(p)
                         for r, p in zip(candidates, proposals)]
            offers = [(r.request_id, len(p.token_ids), p.confidence) if p.parents is None else
                      (r.request_id, len(p.token_ids), p.confidence, (p.parents, p.shares or [1.0] * len(p.parents)))
                      for r, p in zip(candidates, proposals)]
        else:
            offers = [(r.request_id, c, None) for r, c in zip(candidates, caps)]
        ks = self.controller.choose(offers, base_rows, costly=not self.proposer.cheap)
        for i, (req, k) in enumerate(zip(candidates, ks)):
            req.num_spec_tokens = k
            if proposals and k:
                self._guesses[req.request_id] = self._chosen(proposals[i], i, k)
        self._planned = candidates

    def _chosen(self, proposal: Proposal, index: int, k: int) -> tuple[list[int], list[int] | None]:
        """The k tokens of offer `index` to verify: a chain's first k; a tree's k most valuable nodes by the
        controller's ranking (its first k where it ranked none), renumbered in node order."""
        if proposal.parents is None:
            return proposal.token_ids[:k], None
        order = self.controller.tree_order(index)
        keep = sorted(order[:k]) if order is not None else list(range(k))
        parents = tree.subtree(proposal.parents, keep)
        return [proposal.token_ids[n] for n in keep], None if tree.is_chain(parents) else parents

    def clear_plan(self) -> None:
        """After scheduling: plans are for one step only."""
        for req in self._planned:
            req.num_spec_tokens = 0
        self._planned = []

    def draft(self, sched: SchedulerOutput) -> None:
        self._probs.clear()
        chunks = [c for c in sched.chunks if c.num_spec]
        guesses, self._guesses = self._guesses, {}
        if not chunks:
            return
        if self.proposer.cheap:
            proposals = []
            for c in chunks:
                tokens, parents = guesses.get(c.request.request_id, ([], None))
                proposals.append(Proposal(tokens[: c.num_spec], parents=None if parents is None
                                          else parents[: c.num_spec]))
        else:
            started = time.perf_counter()
            proposals = self.proposer.propose([context_of(c.request) for c in chunks], [c.num_spec for c in chunks])
            steps = max(c.num_spec for c in chunks)
            self.controller.record_draft(len(chunks), (time.perf_counter() - started) / steps)
        for chunk, proposal in zip(chunks, proposals):
            drafts = proposal.token_ids[: chunk.num_spec]
            # A guesser may offer fewer than granted; the spare blocks go back at update.
            chunk.num_new_tokens -= chunk.num_spec - len(drafts)
            chunk.num_spec = len(drafts)
            chunk.draft_token_ids = list(drafts)
            parents = proposal.parents
            chunk.draft_parents = None if parents is None or tree.is_chain(parents) else list(parents)
            if drafts and proposal.probs is not None:
                self._probs[chunk.request.request_id] = proposal.probs[: len(drafts)]

    def draft_probs(self, chunk: ScheduledChunk) -> torch.Tensor | None:
        return self._probs.get(chunk.request.request_id) if chunk.num_spec else None

    def record_step(self, rows: int, seconds: float) -> None:
        self.controller.record_step(rows, seconds)

    def record(self, chunk: ScheduledChunk, accepted: int, committed: int,
               walked: Sequence[int] | None = None) -> None:
        """A verified chunk: `accepted` drafts agreed with the target, `committed` of them were kept
        (fewer when a stop ended the request inside the run). For a tree, `walked` is the path verification
        took; acceptance is learned on the tree's main chain (tree.py)."""
        req = chunk.request
        proposed = chunk.num_spec
        if chunk.draft_parents is not None:
            proposed, accepted = tree.main_chain_acceptance(chunk.draft_parents, walked or ())
        self.controller.record_acceptance(req.request_id, proposed, accepted)
        self.proposer.observe(req.request_id, proposed, accepted)
        req.spec_proposed_tokens += chunk.num_spec
        req.spec_accepted_tokens += committed

    def finished(self, req: Request) -> None:
        self.controller.forget(req.request_id)
        self.proposer.finished(context_of(req))

    def _cap(self, req: Request) -> int:
        # The step commits up to k + 1 tokens: never draft past max_tokens or the context limit.
        left = req.params.max_tokens - len(req.output_token_ids) - 1
        return max(0, min(self.max_k, left, self.max_model_len - req.num_tokens))


def _checked_tree(p: Proposal, proposer: Proposer) -> Proposal:
    """`p` if its tree is well formed (tree.validate, one parent and share per token), else no proposal: a guesser's
    malformed tree costs its request this step's drafts, never the step (logged, as it is a guesser's bug)."""
    assert p.parents is not None
    try:
        tree.validate(p.parents)
        if len(p.parents) != len(p.token_ids) or (p.shares is not None and len(p.shares) != len(p.parents)):
            raise ValueError(f"{len(p.token_ids)} tokens, {len(p.parents)} parents, "
                             f"{'no' if p.shares is None else len(p.shares)} shares")
    except ValueError as exc:
        log.error("malformed draft tree dropped", guesser=type(proposer).__name__, error=str(exc))
        return Proposal()
    return p


def _main_chain(p: Proposal) -> Proposal:
    """A tree proposal cut to its main chain (for requests whose constraint masks chains only)."""
    assert p.parents is not None
    nodes = tree.main_chain(p.parents)
    return Proposal([p.token_ids[n] for n in nodes],
                    confidence=None if p.confidence is None else [p.confidence[n] for n in nodes])


def build_proposer(config: EngineConfig, target: object | None = None, kv: torch.Tensor | None = None) -> Proposer:
    """The guesser `config.speculative` names, built by its kind's registration (registry.py; ConfigError
    if none). `target` (the engine's model) and `kv` (its KV tensor) are what a draft model is built from."""
    spec = parse_speculative(config.speculative or "")
    return registration(spec.kind).build(ProposerArgs(spec, config, target, kv))
