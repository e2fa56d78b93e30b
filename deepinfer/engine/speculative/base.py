"""The guesser contract of speculative decoding.

A *proposer* (guesser) looks at a request's committed tokens and proposes up to k tokens that might
come next; the target model then checks them all in one forward pass (`verify.py`) and keeps the
longest run it agrees with, plus a token of its own. Output never changes: a proposal only decides
how many tokens one step can commit.

Two kinds of proposer, told apart by `Proposer.cheap`:

* cheap (n-gram lookup, the suffix index): proposing costs microseconds of host time, so the engine
  asks for up to the cap first and the controller then trims each proposal to what pays;
* costly (a draft model, an MTP or EAGLE head): proposing runs a model, so the controller chooses
  each request's k first and the proposer produces at most that many.

A cheap proposer may propose a tree of continuations where the history branches (`Proposal.parents`,
tree.py); the controller then chooses how many of its nodes to verify and the speculator which ones.

A proposal is either a point mass at each proposed token (`Proposal.probs is None`: a lookup, or a
draft model that proposes its argmax) or, for a draft model that samples, the distribution q it drew
each token from; verification applies the matching acceptance rule. A model head that predicts
several tokens (DeepSeek-V3's MTP module, an EAGLE head) fits the same contract as a costly proposer
with access to the target's hidden states; no such weights exist for the models served here, so none
is built.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from deepinfer.engine.request import SamplingParams


@dataclass
class SpecContext:
    """What a proposer sees of one request in one step. `token_ids` are committed tokens only (prompt,
    then output); the last of them has been sampled but not yet run through the model."""

    request_id: str
    token_ids: Sequence[int]
    num_prompt_tokens: int
    params: SamplingParams
    # The tenant's cache salt: a proposer that learns across requests keeps tenants apart by it.
    tenant: str | None = None
    # For proposers that run a model over the request's paged KV: its block table (covering the
    # positions the step may write, drafts included) and an epoch that changes whenever the request's
    # KV was dropped and rebuilt (a preemption), invalidating whatever a draft model computed before.
    block_ids: Sequence[int] = ()
    kv_epoch: int = 0


@dataclass
class Proposal:
    """Up to k proposed tokens for one request, as a chain or a tree.

    `probs` is None for a point-mass proposal (each token proposed with certainty), else
    [len(token_ids), vocab] fp32 rows, each the distribution the token was drawn from. `confidence`
    optionally estimates, per token, the probability that it is accepted given the ones before it
    were (a suffix match's frequency); the controller may use it in place of its own estimate.

    A tree (point mass only) also has `parents` and `shares` (tree.py): token i follows token parents[i] (-1: the
    last committed token), and shares[i] is the fraction of the guesser's evidence behind token i among its
    siblings'. A tree is at most k deep; its main chain is what the chain proposal would have been. None: a
    chain."""

    token_ids: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None
    confidence: list[float] | None = None
    parents: list[int] | None = None
    shares: list[float] | None = None


class Proposer(ABC):
    """A guesser. Instances belong to one engine and are driven from its thread only.

    Contract:
    * `propose(batch, ks)` returns one Proposal per context, in order, with at most ks[i] tokens
      (fewer, or none, when it has nothing worth proposing). It never sees uncommitted tokens and must
      not assume its previous proposal was accepted.
    * `finished(ctx)` tells it a request has ended with `ctx.token_ids` final (an aborted or failed
      request too); per-request state is dropped, and a proposer that learns from earlier requests
      may learn from this one.
    * `observe(request_id, proposed, accepted)` reports each verified step: of the `proposed` tokens of
      its proposal that were verified (a cheap proposal may have been trimmed), the first `accepted`
      agreed with the target. A proposer with several sources may learn which one serves a request.
    * `cheap` tells the engine whether to ask for the cap and trim afterwards (True) or to choose k
      first (False); see the module docstring.
    """

    cheap: bool = True

    @abstractmethod
    def propose(self, batch: Sequence[SpecContext], ks: Sequence[int]) -> list[Proposal]: ...

    def finished(self, ctx: SpecContext) -> None:  # noqa: B027 - optional hook
        """A request ended; drop its state (default: nothing kept)."""

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:  # noqa: B027 - optional hook
        """A verified step of the request (default: ignored)."""
