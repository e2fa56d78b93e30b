"""Fetch or recompute: how much of a cached prefix a worker loads from its cache daemon, and how long it waits
for it, so that a hit is never expected to cost more than computing the same tokens. Pure: plain values in,
a plan out; the caller measures time.

Rates are measured online, never configured:

* compute: the worker engine's prefill throughput (tokens per second of engine step, `EngineThread`), so one
  block costs `block_size / tokens_per_s` to compute;
* fetch: per daemon tier ("host", "disk"), an EWMA of the seconds one fetched block cost — each fetch's wall
  time (the daemon's queue, its read, the wire, the copy) split over the tiers its blocks came from in
  proportion to the current estimates.

A plan for the daemon's leading run of blocks (the part of the prompt the device pool does not hold) takes the
k leading blocks that maximise Σ (compute − fetch) over them: all of them where every tier is faster than
computing, none where none is, and a split — load the head, compute the rest — where a fast tier (host) leads a
slow one (disk). A tier not measured yet counts as free, so it gets fetched and measured. Its `deadline_s` is
DEADLINE_SLACK times what computing those k blocks would take (within [MIN_DEADLINE_S, max_deadline_s]): the
daemon sends what it has read by then and the rest is computed. The deadline is a guard, not the decision: it
bounds what a misprediction (a daemon slower than its estimate) costs, and its slack and floor keep a daemon that
was merely descheduled for a moment (two busy cores) from losing a hit that the estimate rightly predicted.

A prefix judged slower to fetch than to compute is computed; every `probe_every`-th such decision fetches it
anyway (to that same deadline), so an estimate that went stale — a disk busy for a while — is measured again.

`always=True` (a worker's `fetch_policy = "always"`) fetches every hit, to the longest deadline, as a cache that
always loads a hit does: the baseline the plan is measured against (bench/replay_sweep.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

MIN_DEADLINE_S = 0.1  # below this a daemon's reply is lost in scheduling noise: never ask for less
DEADLINE_SLACK = 2.0  # a fetch may take this many times the compute time of its blocks before it is cut
DEFAULT_MAX_DEADLINE_S = 1.0  # the longest any fetch waits (also the deadline before the compute rate is known)

FASTER, UNMEASURED, SLOWER, PROBE, MISS, ALWAYS = "faster", "unmeasured", "slower", "probe", "miss", "always"
DECISIONS = (FASTER, UNMEASURED, SLOWER, PROBE, MISS, ALWAYS)
FETCH_POLICIES = ("plan", "always")  # WorkerSpec.fetch_policy: plan per hit, or fetch every hit


@dataclass(frozen=True)
class FetchPlan:
    """Fetch the `blocks` leading blocks within `deadline_s` (0 blocks: compute them all); `decision` says why:
    FASTER (predicted faster than computing), UNMEASURED (the compute rate is not known yet: fetch all),
    SLOWER (computed), PROBE (slower, fetched to measure again), MISS (the daemon holds none), ALWAYS (fetched
    without a plan: `FetchPlanner.always`)."""

    blocks: int
    deadline_s: float
    decision: str
    first_tier: str = ""  # where the first block to fetch is


def leading_run(tiers: Sequence[str]) -> int:
    """How many leading entries name a tier ("" is a block the daemon does not hold)."""
    n = 0
    for tier in tiers:
        if not tier:
            break
        n += 1
    return n


@dataclass
class FetchPlanner:
    """The measured rates and the plans made from them (`decisions` counts plans by decision)."""

    block_size: int
    alpha: float = 0.25
    probe_every: int = 16
    max_deadline_s: float = DEFAULT_MAX_DEADLINE_S
    always: bool = False  # fetch every hit to max_deadline_s, without planning (rates are still measured)
    fetch_s_per_block: dict[str, float] = field(default_factory=dict)  # tier → EWMA seconds per fetched block
    decisions: Counter[str] = field(default_factory=Counter)
    computed_blocks: int = 0  # blocks a plan left to compute although the daemon held them
    _slower_plans: int = 0

    def plan(self, tiers: Sequence[str], tokens_per_s: float) -> FetchPlan:
        """A plan for the blocks past the device-held head: `tiers[i]` is where the daemon holds the i-th ("" for
        not at all; only the leading run counts); `tokens_per_s` the worker's measured prefill rate (0: unknown)."""
        n = leading_run(tiers)
        if n == 0:
            return self._decided(FetchPlan(0, 0.0, MISS))
        if self.always:
            return self._decided(FetchPlan(n, self.max_deadline_s, ALWAYS, tiers[0]))
        if tokens_per_s <= 0:
            return self._decided(FetchPlan(n, self.max_deadline_s, UNMEASURED, tiers[0]))
        compute_s = self.block_size / tokens_per_s
        gain = best = 0.0
        best_k = 0
        for i, tier in enumerate(tiers[:n]):
            gain += compute_s - self.fetch_s_per_block.get(tier, 0.0)
            if gain > best:
                best, best_k = gain, i + 1
        if best_k == 0:
            self._slower_plans += 1
            if self._slower_plans % self.probe_every == 0:
                return self._decided(FetchPlan(n, self._deadline(n * compute_s), PROBE, tiers[0]))
            self.computed_blocks += n
            return self._decided(FetchPlan(0, 0.0, SLOWER))
        self.computed_blocks += n - best_k
        return self._decided(FetchPlan(best_k, self._deadline(best_k * compute_s), FASTER, tiers[0]))

    def observe(self, tiers: Sequence[str], seconds: float, first_asked: str = "") -> None:
        """One fetch: the tiers its blocks came from, in order, and its wall time. One that brought nothing
        although the daemon said it held `first_asked` counts as one block of that tier taking all of it (a lower
        bound: the deadline passed before its first block), so a daemon slower than believed is believed slow."""
        counts = Counter(t for t in tiers if t)
        if not counts and first_asked:
            counts[first_asked] = 1
        if not counts or seconds < 0:
            return
        # Split the time over tiers in proportion to what each is believed to cost (equally where unknown).
        weights = {t: self.fetch_s_per_block.get(t, 0.0) or 1.0 for t in counts}
        total = sum(weights[t] * c for t, c in counts.items())
        for tier in counts:
            sample = seconds * weights[tier] / total  # seconds per block of this tier
            old = self.fetch_s_per_block.get(tier)
            self.fetch_s_per_block[tier] = sample if old is None else old + self.alpha * (sample - old)

    def _deadline(self, compute_s: float) -> float:
        return min(self.max_deadline_s, max(MIN_DEADLINE_S, DEADLINE_SLACK * compute_s))

    def _decided(self, plan: FetchPlan) -> FetchPlan:
        self.decisions[plan.decision] += 1
        return plan
