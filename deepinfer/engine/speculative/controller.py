"""The speculation controller: how many draft tokens k_i (0 = off) each request verifies in one step.

Model:

* Acceptance. Request i's per-token acceptance alpha_i = s / n, discounted counts over its verified
  steps: proposing k and accepting a counts a successes in a + [a < k] trials (verification stops at the
  first rejection, so later tokens were never tested; accepted/proposed would underrate alpha). The
  counts start at W = PRIOR_WEIGHT pseudo-trials at the prior rate, discounted like any evidence, so a
  request that never accepts goes to alpha ~ 0 instead of stopping at a floor. The prior rate is the larger of
  prior_acceptance and the pooled rate: the same discounted counts over every request's verified steps (decay
  pool_decay per record). With prior_acceptance alone, where one more row costs more than the prior's expected
  return (a 2-row step at 1.4x a 1-row one against a prior of 0.5), a request whose estimate once fell below the
  break-even was never retried, since idle requests drift back only to the prior: bench/spec_declined.py found
  282 of 398 n-gram offers on code edits declined at estimates of 0.32-0.48 when 89% of their first drafts were
  right. Never below prior_acceptance, so a pool made low by one kind of text does not stop new requests from
  being tried. Position j's conditional
  acceptance p_j is alpha_i, or, when the proposal carries confidences, w * c_j + (1 - w) * alpha_i
  (w = confidence_weight: 1 trusts the proposer, 0 ignores it). Drafting k tokens then commits
  E_i(k) = 1 + p_1 + p_1 p_2 + ... + p_1...p_k tokens in expectation ((1 - a^(k+1)) / (1 - a) if i.i.d.).
* Step cost. c(T) is the seconds of a step with T query rows (decode + draft + prefill): per row-count
  bucket (1, 2, 3, 4, 6, 8, 12, ...) the lower median of its last SAMPLES steps' seconds, at their mean
  rows, joined by straight lines and made non-decreasing. A median, because step times on a shared
  machine have one-sided outliers (a descheduled thread makes a step several times slower, never
  faster): one such step must not move the curve, since a bucket that looks too dear is left alone and
  only re-measured once stale (below), which would hold speculation off for a hundred steps. Outside
  the measured range c follows the prior c(T) = step_seconds + row_seconds * T, scaled to meet the
  nearest measurement (above it, the steeper of that and the last measured slope).
  A costly proposer adds max_k * d(n_spec): max_k sequential draft forwards over the n_spec requests
  that speculate, d learned the same way from `record_draft`.
* Objective. Maximise (base_tokens + v * sum_i (E_i(k_i) - 1)) / (c(T_base + sum_i k_i) + draft) — useful
  rows per second, a prefill row counting as one (pass base_tokens to count otherwise). v = draft_value
  < 1 shades every draft token's expected value: alpha and c are estimates, and where a batch is large
  enough that a draft row costs about what it is expected to return (32 chat requests: ~1% of a step per
  row against ~0.4 tokens in 32), an unshaded optimum speculates at break-even and loses the estimation
  error (measured: 0.95-0.96x); shaded, those rows go unspent, while drafts that pay several times their
  row (a single request, repetitive text) are unaffected. Each request's
  marginal gains p_1, p_1 p_2, ... never increase, so for a fixed total m the best allocation takes the
  m largest gains; without a draft the cost depends on m only, and scanning m over the gains sorted in
  decreasing order finds the exact optimum whatever the shape of c. With a draft the scan is a heuristic.
* Exploration, deterministic. c is only learned where steps land, so every explore_every-th call checks
  the buckets next to the choice T: if the next bucket up has no measurement in the last STALE_STEPS
  records, it adds draft tokens (the next gains, those >= EXPLORE_MIN_GAIN) to reach it; else if a
  speculating choice left T_base's bucket unmeasured that long, it speculates nothing this once. So a
  pessimistic prior or a stale point gets corrected within explore_every steps, and while the curve
  near T is fresh nothing is explored (at most one step in explore_every pays, and only while stale).
  A request offered tokens but given none, while alpha is below the prior rate, has its counts mixed back
  toward the prior rate's pseudo-trials (weight 1 - idle_decay per step), so it is retried in time (text
  that turned repetitive); the cost curve's equivalent is the exploration above.

* Trees. An offer may be a draft tree (tree.py: its parents and shares). Its nodes' gains are the chances that
  verification walks to them (`tree.node_gains`, each first child's chance the chain's p_j above); sorted in
  decreasing order they are the offer's marginal gains, so the scan above allocates nodes like chain tokens. The
  chosen k_i nodes are the k_i first of `tree_order(i)`: the most valuable nodes, a valid tree (a child never
  outranks its parent). Non-adaptive mode ranks them the same way and takes its cap of them.

Invariants: 0 <= k_i <= min(max_k, offered_i); non-adaptive mode returns exactly that bound; the result
depends only on the calls made (no clocks, no randomness).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque
from collections.abc import Sequence
from itertools import accumulate, repeat
from operator import add, mul, truediv

from deepinfer.engine.speculative.tree import node_gains

PRIOR_WEIGHT = 2.0  # pseudo-trials of the prior: a couple of verified steps outweigh it
MIN_GAIN = 1e-3  # a draft token expected to commit less than this never pays for its row
EXPLORE_MIN_GAIN = 0.05  # exploration spends rows on plausible tokens only
STALE_STEPS = 128  # a bucket not measured in this many records is worth measuring again
SAMPLES = 8  # a bucket's cost is the lower median of its last this many steps
DRAFT_VALUE = 0.75  # a draft token counts as this fraction of its expected value (see Objective)
_BUCKETS = [1] + [b for p in range(1, 21) for b in (1 << p, 3 << (p - 1))]

# (request id, most tokens it can take, per-token confidences or None[, (tree parents, tree shares)])
Offer = tuple[str, int, list[float] | None] | tuple[str, int, list[float] | None, tuple[list[int], list[float]]]


class CostCurve:
    """Seconds of one forward as a function of its rows; see the module docstring."""

    def __init__(self, base: float, per_row: float, samples: int = SAMPLES) -> None:
        if base <= 0 or per_row < 0 or samples < 1:
            raise ValueError("cost prior needs base > 0, per_row >= 0 and samples >= 1")
        self.base, self.per_row = base, per_row
        self.points: dict[int, list[float]] = {}  # bucket -> [knot rows, knot seconds, record number]
        self._samples: dict[int, deque[tuple[int, float]]] = {}  # bucket -> its last (rows, seconds)
        self._window = samples
        self.records = 0
        self._knots: tuple[list[float], list[float]] | None = None

    def record(self, rows: int, seconds: float) -> None:
        if rows <= 0 or not 0 < seconds < math.inf:  # also drops NaN
            return
        self.records += 1
        b = _bucket(rows)
        window = self._samples.setdefault(b, deque(maxlen=self._window))
        window.append((rows, float(seconds)))
        ordered = sorted(s for _, s in window)
        # The knot sits at the rows measured, not at the bucket's edge.
        self.points[b] = [sum(r for r, _ in window) / len(window), ordered[(len(ordered) - 1) // 2], self.records]
        self._knots = None

    def fresh(self, bucket: int) -> bool:
        pt = self.points.get(bucket)
        return pt is not None and self.records - pt[2] < STALE_STEPS

    def _prior(self, t: float) -> float:
        return self.base + self.per_row * t

    def knots(self) -> tuple[list[float], list[float]]:
        if self._knots is None:
            xs: list[float] = []
            ys: list[float] = []
            for b in sorted(self.points):  # buckets are disjoint ranges, so xs strictly increase
                r, s, _ = self.points[b]
                xs.append(r)
                ys.append(max(s, ys[-1]) if ys else s)  # noise must never make more rows look cheaper
            self._knots = (xs, ys)
        return self._knots

    def __call__(self, rows: int) -> float:
        return self.costs(rows, 1)[0]

    def costs(self, t0: int, n: int) -> list[float]:
        """c(t) for t = t0 .. t0 + n - 1: one pass over the knots, each piece a running sum (this runs
        every step over up to ~1000 rows)."""
        xs, ys = self.knots()
        end = t0 + n
        if not xs:
            return _line(self._prior(t0), self.per_row, n)
        out: list[float] = []
        t = t0
        if t < xs[0]:  # the prior's line scaled through the first knot
            scale, stop = ys[0] / self._prior(xs[0]), min(end, math.ceil(xs[0]))
            out += _line(scale * self._prior(t), scale * self.per_row, stop - t)
            t = stop
        for j in range(1, len(xs)):
            if t >= end:
                return out
            if t < xs[j]:
                x0, y0 = xs[j - 1], ys[j - 1]
                slope, stop = (ys[j] - y0) / (xs[j] - x0), min(end, math.ceil(xs[j]))
                out += _line(y0 + slope * (t - x0), slope, stop - t)
                t = stop
        slope = self.per_row * ys[-1] / self._prior(xs[-1])
        if len(xs) > 1:
            slope = max(slope, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
        out += _line(ys[-1] + slope * (t - xs[-1]), slope, end - t)
        return out


def _bucket(rows: int) -> int:
    return bisect_right(_BUCKETS, rows) - 1


def _line(start: float, slope: float, n: int) -> list[float]:
    return list(accumulate(repeat(slope, n - 1), initial=start)) if n > 0 else []


class SpecController:
    """Chooses k per request per step; see the module docstring. Driven from the engine thread only."""

    def __init__(self, max_k: int, adaptive: bool = True, prior_acceptance: float = 0.5, *,
                 step_seconds: float = 0.02, row_seconds: float = 0.0005, draft_step_seconds: float = 0.005,
                 draft_row_seconds: float = 0.0001, confidence_weight: float = 0.5, acceptance_decay: float = 0.9,
                 idle_decay: float = 0.98, explore_every: int = 16, window: int = 256,
                 draft_value: float = DRAFT_VALUE, pool_decay: float = 0.98) -> None:
        if max_k < 1:
            raise ValueError("max_k must be at least 1")
        if not 0.0 < draft_value <= 1.0:
            raise ValueError("draft_value must be in (0, 1]")
        if not 0.0 < pool_decay < 1.0:
            raise ValueError("pool_decay must be in (0, 1)")
        self.draft_value = draft_value
        self.max_k, self.adaptive = max_k, adaptive
        self.prior = min(max(prior_acceptance, 0.0), 1.0)
        self.pool_decay = pool_decay
        self._pool = [self.prior * PRIOR_WEIGHT, PRIOR_WEIGHT]  # every request's evidence, discounted
        self.step_curve = CostCurve(step_seconds, row_seconds)
        self.draft_curve = CostCurve(draft_step_seconds, draft_row_seconds)
        self.confidence_weight = min(max(confidence_weight, 0.0), 1.0)
        self.acceptance_decay, self.idle_decay, self.explore_every = acceptance_decay, idle_decay, explore_every
        self._acc: dict[str, list[float]] = {}  # request id -> [discounted successes, discounted trials]
        self._window: deque[tuple[int, int]] = deque(maxlen=window)
        self._win_proposed = self._win_accepted = 0
        self.steps = self.explorations = self.drafted = self.proposed = self.accepted = 0
        # Chosen k over the offers that proposed something (0: declined); offers of nothing are counted apart.
        self.k_histogram = [0] * (max_k + 1)
        self.unproposed = 0
        self._last: list[int] = []
        self._tree_orders: dict[int, list[int]] = {}  # offer index -> its tree's nodes, most valuable first

    # -- estimates ---------------------------------------------------------------------------------

    def acceptance(self, request_id: str) -> float:
        """The request's per-token acceptance estimate alpha (the prior when nothing is known)."""
        st = self._acc.get(request_id)
        if st is None:
            return self.prior_rate
        return st[0] / st[1]

    @property
    def pooled_acceptance(self) -> float:
        """The rate every request's verified steps give together."""
        return self._pool[0] / self._pool[1]

    @property
    def prior_rate(self) -> float:
        """Where a request's own estimate starts and drifts back to while idle (module docstring)."""
        return max(self.pooled_acceptance, self.prior)

    def step_cost(self, rows: int) -> float:
        return self.step_curve(rows)

    # -- the choice --------------------------------------------------------------------------------

    def choose(self, offers: Sequence[Offer], base_rows: int, costly: bool = False,
               base_tokens: float | None = None) -> list[int]:
        """k per offer, in order. offers: (request id, most tokens it can take this step, optional
        per-token confidences); base_rows: the step's rows without speculation; costly: a draft model
        proposes (its cost counts); base_tokens: useful work of the step without speculation (base_rows)."""
        self.steps += 1
        top = self.max_k
        caps = [(o[1] if o[1] < top else top) if o[1] > 0 else 0 for o in offers]  # min/max calls cost 2x here
        self._tree_orders = {}
        if self.adaptive:
            ks = self._allocate(offers, caps, max(1, base_rows), costly, base_tokens)
        else:
            ks = caps
            for i, offer in enumerate(offers):  # a tree's k nodes are still its most valuable ones
                if caps[i] and len(offer) > 3:
                    self._gains(i, offer, caps[i], self.prior_rate)
        for k, cap in zip(ks, caps):
            if cap:
                self.k_histogram[k] += 1
            else:  # the guesser had nothing to propose: no choice was made
                self.unproposed += 1
        self.drafted += sum(ks)
        self._last = ks
        return list(ks)

    def _allocate(self, offers: Sequence[Offer], caps: list[int], base_rows: int, costly: bool,
                  base_tokens: float | None) -> list[int]:
        gains: list[float] = []
        owners: list[int] = []
        prior, acc = self.prior_rate, self._acc
        for i, cap in enumerate(caps):
            if not cap:
                continue
            gains += self._gains(i, offers[i], cap, prior)
            owners += [i] * cap
        order = sorted(range(len(gains)), key=gains.__getitem__, reverse=True)  # stable: ties keep position order
        g = list(map(gains.__getitem__, order))
        m_max = len(g)
        while m_max and g[m_max - 1] < MIN_GAIN:
            m_max -= 1
        v = self.draft_value
        tokens = list(accumulate((v * x for x in g[:m_max]), initial=float(base_rows if base_tokens is None
                                                                             else base_tokens)))
        cost = self.step_curve.costs(base_rows, m_max + 1)
        if costly:
            dc = self.draft_curve.costs(0, len(offers) + 1)  # d(n) at index n
            extra, kc, n_spec, k_top = [0.0], [0] * len(offers), 0, 0
            for j in order[:m_max]:
                i = owners[j]
                kc[i] += 1
                n_spec += kc[i] == 1
                k_top = max(k_top, kc[i])
                extra.append(k_top * dc[n_spec])
            cost = list(map(add, cost, extra))
        ratios = list(map(truediv, tokens, cost))
        m = ratios.index(max(ratios))  # the first best: more rows only if strictly better
        if self.explore_every and self.steps % self.explore_every == 0:
            m_best, b = m, _bucket(base_rows + m)
            if b + 1 < len(_BUCKETS) and not self.step_curve.fresh(b + 1):
                m = min(m_max, _BUCKETS[b + 1] - base_rows)
                while m > m_best and g[m - 1] < EXPLORE_MIN_GAIN:
                    m -= 1
            if m == m_best and m and b != _bucket(base_rows) and not self.step_curve.fresh(_bucket(base_rows)):
                m = 0
            self.explorations += m != m_best
        ks = [0] * len(offers)
        for j in order[:m]:
            ks[owners[j]] += 1
        d = self.idle_decay
        for i, k in enumerate(ks):
            if not k and caps[i]:
                st = acc.get(offers[i][0])
                if st is not None and st[0] < prior * st[1]:  # pessimism fades while unused: retried later
                    st[0] = d * st[0] + (1.0 - d) * prior * PRIOR_WEIGHT
                    st[1] = d * st[1] + (1.0 - d) * PRIOR_WEIGHT
        return ks

    def _gains(self, i: int, offer: Offer, cap: int, prior: float) -> list[float]:
        """Offer i's cap largest marginal gains, in decreasing order; for a tree, its ranking goes to tree_order."""
        st = self._acc.get(offer[0])  # self.acceptance(rid), inlined: this runs for every request every step
        a = prior if st is None else st[0] / st[1]
        conf, tree = offer[2], offer[3] if len(offer) > 3 else None  # type: ignore[misc]
        n = cap if tree is None else len(tree[0])
        if conf:
            w = self.confidence_weight
            wa = (1.0 - w) * a
            ps = [w * (0.0 if c < 0.0 else 1.0 if c > 1.0 else c) + wa for c in conf[:n]]
            ps += [a] * (n - len(ps))
        else:
            ps = [a] * n
        if tree is None:
            return list(accumulate(ps, mul))  # gain of the j-th token: P(it and all before it are accepted)
        node = node_gains(tree[0], tree[1], ps)
        order = sorted(range(n), key=node.__getitem__, reverse=True)  # stable: parents before children
        self._tree_orders[i] = order
        return [node[j] for j in order[:cap]]

    # -- measurements ------------------------------------------------------------------------------

    def record_step(self, rows: int, seconds: float) -> None:
        """One target forward (a whole step) of `rows` query rows took `seconds`."""
        self.step_curve.record(rows, seconds)

    def record_draft(self, rows: int, seconds: float) -> None:
        """One draft-model forward over `rows` requests took `seconds`."""
        self.draft_curve.record(rows, seconds)

    def record_acceptance(self, request_id: str, proposed: int, accepted: int) -> None:
        """A verified step: `proposed` draft tokens, the first `accepted` of them kept."""
        if proposed <= 0:
            return
        accepted = min(max(accepted, 0), proposed)
        st = self._acc.setdefault(request_id, [self.prior_rate * PRIOR_WEIGHT, PRIOR_WEIGHT])
        d = self.acceptance_decay
        st[0] = d * st[0] + accepted
        st[1] = d * st[1] + accepted + (accepted < proposed)
        pool, d = self._pool, self.pool_decay
        pool[0] = d * pool[0] + accepted
        pool[1] = d * pool[1] + accepted + (accepted < proposed)
        if len(self._window) == self._window.maxlen:
            p, a = self._window[0]
            self._win_proposed -= p
            self._win_accepted -= a
        self._window.append((proposed, accepted))
        self._win_proposed += proposed
        self._win_accepted += accepted
        self.proposed += proposed
        self.accepted += accepted

    def forget(self, request_id: str) -> None:
        """The request ended: drop its estimate."""
        self._acc.pop(request_id, None)

    # -- reporting ---------------------------------------------------------------------------------

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens over the last `window` verified steps (0.0 before any)."""
        return self._win_accepted / self._win_proposed if self._win_proposed else 0.0

    def tree_order(self, index: int) -> list[int] | None:
        """The nodes of the last `choose` call's offer `index`, most valuable first, when it offered a tree; its
        chosen k nodes are the first k."""
        return self._tree_orders.get(index)

    @property
    def last_choices(self) -> list[int]:
        """The k of each offer of the last `choose` call, in order."""
        return list(self._last)

    @property
    def counters(self) -> dict[str, int]:
        return {"steps": self.steps, "explorations": self.explorations, "drafted": self.drafted,
                "proposed": self.proposed, "accepted": self.accepted, "unproposed": self.unproposed}
