"""Verification: from the target's logits at a request's 1 + k rows, the tokens the step commits.

Row j of a request that proposed drafts d_1..d_k holds the target's logits for the token after
d_1..d_j (row 0: after the last committed token). Each row is a `SamplingRow` whose output already
contains the drafts before it, so penalties, filters and the seeded stream of that position are
exactly those of plain decoding at that position.

* Point-mass proposals (n-gram, suffix, a draft model proposing its argmax): the target samples
  every row as plain decoding would; d_j is accepted while it equals the target's token of row
  j - 1; the first mismatch (or row k) contributes the target's own token. For greedy rows this is
  "longest agreeing prefix plus the target's next token". For sampled rows it is the standard
  rejection rule specialised to a one-hot q: d is accepted with probability p(d) (the chance the
  target's sample is d) and on rejection the token is distributed as p with d removed, which is
  norm(max(0, p - q)). Realised through the row's own seeded noise, the committed tokens are the
  very tokens plain decoding draws: speculation cannot change a seeded request's output.
* Proposals with a distribution q (a draft model sampling at temperature > 0): the standard rule of
  Leviathan et al. / Chen et al.: accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first
  rejection draw from norm(max(0, p_j - q_j)) and stop; if all k are accepted draw a bonus token from
  p_k. The committed tokens are distributed exactly as the target's; the draws come from the row's
  seeded streams (ACCEPT and RESIDUAL purposes), so a seeded request repeats itself for the same drafts.

* Draft trees (point mass only, tree.py): row 0 is the root's, row 1 + i node i's, each a `SamplingRow` whose
  output holds that node's path; every row samples as plain decoding would there, and the walk from the root
  follows the child equal to each row's token (`tree.accepted_path`). The committed tokens are the walked
  nodes' and the last walked row's own; `VerifyResult.walked` names the nodes, whose K/V the engine moves to
  their chain positions.

Every row's logits get the request's logit_bias, penalties and output constraint's mask first, exactly as in
plain decoding, so greedy output with speculation equals output without it (a draft the constraint forbids is
never accepted: its row's masked pick, or p(d) = 0, rejects it). Logprobs of committed tokens are the target's
raw log-softmax (before bias, penalties, temperature and filters), as plain decoding reports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from deepinfer.engine.request import Logprob, SamplingParams
from deepinfer.engine.sampler import ACCEPT, RESIDUAL, Sampler, SamplingRow, exponential_noise
from deepinfer.engine.speculative import tree


@dataclass
class VerifyGroup:
    """One request's rows in the step's logits: 1 + len(draft_token_ids) consecutive rows."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None
    draft_token_ids: Sequence[int] = ()
    draft_probs: torch.Tensor | None = None  # [k, vocab], None for a point-mass proposal
    # An output constraint's bitmask rows: row j allows the tokens after drafts[:j]; rows past the first draft
    # the constraint forbids are not needed (that draft is rejected: its row's pick or p(d) never allows it).
    masks: torch.Tensor | None = None
    num_masked: int = 0  # rows of `masks` that were written
    draft_parents: Sequence[int] | None = None  # a draft tree's (tree.py); None: a chain

    def rows(self) -> list[SamplingRow]:
        out = list(self.output_token_ids)
        drafts = list(self.draft_token_ids)
        if self.draft_parents is not None:
            if self.masks is not None or self.draft_probs is not None:
                raise ValueError("a draft tree is verified as a point mass, without output constraints")
            paths = [tree.path(self.draft_parents, j - 1) for j in range(len(drafts) + 1)]
            return [SamplingRow(self.params, self.prompt_token_ids, out + [drafts[n] for n in p], self.generator)
                    for p in paths]
        return [SamplingRow(self.params, self.prompt_token_ids, out + drafts[:j], self.generator,
                            self.masks[j] if self.masks is not None and j < self.num_masked else None)
                for j in range(len(drafts) + 1)]


@dataclass
class VerifyResult:
    token_ids: list[int]  # accepted drafts, then one token of the target's own
    logprobs: list[Logprob | None]
    num_accepted: int
    walked: list[int] | None = None  # a draft tree's accepted nodes, in path order


def verify(sampler: Sampler, logits: torch.Tensor, groups: Sequence[VerifyGroup]) -> list[VerifyResult]:
    """`logits`: [sum(1 + k_g), vocab], the groups' rows in order (written to: penalties in place)."""
    sizes = [len(g.draft_token_ids) + 1 for g in groups]
    if logits.shape[0] != sum(sizes):
        raise ValueError(f"{logits.shape[0]} logits rows for groups of {sum(sizes)} rows")
    results: list[VerifyResult | None] = [None] * len(groups)
    starts = [0, *accumulate(sizes)][:-1]
    point = [i for i, g in enumerate(groups) if g.draft_probs is None]
    dist = [i for i, g in enumerate(groups) if g.draft_probs is not None]
    for kind, members in (("point", point), ("dist", dist)):
        if not members:
            continue
        rows = [row for i in members for row in groups[i].rows()]
        whole = len(members) == len(groups)
        index = torch.tensor([starts[i] + j for i in members for j in range(sizes[i])], dtype=torch.long)
        part = logits if whole else logits.index_select(0, index)
        if kind == "point":
            picks = sampler(part, rows)
            at = 0
            for i in members:
                results[i] = _accept_point_mass(groups[i].draft_token_ids, picks[at : at + sizes[i]],
                                                groups[i].draft_parents)
                at += sizes[i]
        else:
            for i, result in zip(members, _verify_distributions(sampler, part, rows, [groups[i] for i in members])):
                results[i] = result
    return [r for r in results if r is not None]


def _accept_point_mass(drafts: Sequence[int], picks: list[tuple[int, Logprob | None]],
                       parents: Sequence[int] | None = None) -> VerifyResult:
    if parents is not None:
        walked = tree.accepted_path(parents, drafts, [t for t, _ in picks])
        kept = [picks[0]] + [picks[1 + n] for n in walked]
        return VerifyResult([t for t, _ in kept], [lp for _, lp in kept], len(walked), walked)
    accepted = 0
    while accepted < len(drafts) and picks[accepted][0] == drafts[accepted]:
        accepted += 1
    kept = picks[: accepted + 1]
    return VerifyResult([t for t, _ in kept], [lp for _, lp in kept], accepted)


def _verify_distributions(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow],
                          groups: Sequence[VerifyGroup]) -> list[VerifyResult]:
    """The standard rule for groups whose drafts carry q; `logits` and `rows` hold all their rows."""
    raw = sampler.raw_logprobs(logits, rows)  # before penalise writes into the logits
    penalised = sampler.penalise(logits, rows)
    p = sampler.probs(penalised, rows)
    results = []
    at = 0
    for g in groups:
        drafts = list(g.draft_token_ids)
        k = len(drafts)
        assert g.draft_probs is not None
        q = g.draft_probs
        steps = torch.arange(k)
        p_d = p[at : at + k][steps, drafts].tolist()
        q_d = q[steps, drafts].tolist()
        tokens: list[int] = []
        for j, d in enumerate(drafts):
            if accept_draft(p_d[j], q_d[j], _uniform(rows[at + j])):
                tokens.append(d)
                continue
            tokens.append(_draw(residual(p[at + j], q[j]), rows[at + j], RESIDUAL))
            break
        else:
            tokens.append(_draw(p[at + k], rows[at + k], 0))
        used = list(range(at, at + len(tokens)))
        logprobs = sampler.logprobs(None if raw is None else raw[at : at + len(tokens)], [rows[r] for r in used],
                                    tokens)
        results.append(VerifyResult(tokens, logprobs, len(tokens) - 1))
        at += k + 1
    return results


def accept_draft(p_d: float, q_d: float, u: float) -> bool:
    """The acceptance test of the standard rule: u < p(d) / q(d), with u ~ U[0, 1)."""
    return u * q_d < p_d


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The distribution to draw from after a rejection: max(0, p - q), unnormalised. Rejection has
    probability sum(max(0, q - p)) = sum(max(0, p - q)) > 0, so this is never all zero when reached —
    except through rounding when p and q agree; then p itself is the right answer."""
    r = (p - q).clamp_min_(0.0)
    return r if float(r.sum()) > 0.0 else p.clone()


def _uniform(row: SamplingRow) -> float:
    if row.generator is None:
        return float(torch.rand(()))
    return float(torch.rand((), generator=row.seeded(ACCEPT)))


def _draw(weights: torch.Tensor, row: SamplingRow, purpose: int) -> int:
    """A token with probability proportional to `weights` (an exponential race, as the sampler draws)."""
    noise = exponential_noise([row], weights.shape[0], weights.device, purpose)[0]
    return int((weights / noise).argmax())
