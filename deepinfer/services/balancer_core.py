"""The expert balancer's pure core: from the ranks' expert load reports, decide when and how far to move
experts (the placement itself is balancer_placement.py's).

No sockets, no clock reads: every call that needs the time gets `now` (seconds, any monotonic origin the
shell likes), and the result is a plain `Decision` the shell sends to the group. Everything here is
deterministic: the same reports and the same current placement give the same decision.

A plan (`BalancerCore.plan`) fits the ideal placement (`rebalance`) to the current one: candidate ranks are
matched to current ranks by the experts they share (greedy, largest overlap first), and an expert kept on
a rank keeps its slot there, so only slots whose expert really changes count as moves (each move loads
one expert's weights). Under the global policy a second candidate is built from the current placement
itself (fix the replica counts in place, then the swap search), and the one needing fewer moves wins
unless the other predicts a max/mean better by `threshold`. A layer changes only when that candidate's
predicted max/mean improves on the current one by at least `threshold` (relative): below it, moving
weights costs more than it gains. When the candidate needs more than `max_moves` moves, a bounded
subset is applied instead (`bounded`): step by step, the change (or pair of changes, for two experts
trading ranks) with the lowest predicted (max, sum of squares) of the rank loads, every intermediate
placement valid, the best prefix kept — a down payment on the whole gain, taken when it is strictly
better; later plans continue from where it left the group. A decision as a whole moves at most
`max_moves_total` slots: the layers' steps are taken in order of predicted max/mean gain, largest first,
and one that does not fit whole gets a smaller bounded step with the budget left.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer.engine.ep.placement import EMPTY, ExpertPlacement
from deepinfer.services.balancer_placement import (
    align,
    bounded,
    check_loads,
    check_shape,
    count_moves,
    hierarchical,
    incremental,
    layer_bins,
    max_over_mean,
    slot_rank_loads,
)

__all__ = ["BalancerCore", "Decision"]


# --- the balancer ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """A new placement for the group and what it is predicted to do, per MoE layer."""

    placement: ExpertPlacement  # version one past any placement this core has issued or seen
    changed: tuple[int, ...]  # the MoE layers whose slots change
    moves: tuple[int, ...]  # per layer, slots that load new weights (0 for an unchanged layer)
    before: tuple[float, ...]  # per layer, predicted max/mean under the current placement
    after: tuple[float, ...]  # per layer, under the new one (equal to before where unchanged)


@dataclass(frozen=True)
class _Report:
    at: float
    version: int
    loads: tuple[tuple[int, ...], ...]


class BalancerCore:
    """Windowed load reports in, placement decisions out (see the module docstring for the policy).

    Invariants: `current` is the placement the group runs as far as this core knows; at most one
    decision is pending (issued by `plan`, not yet adopted or abandoned), and `plan` issues nothing
    while one is; a report counted under a version newer than `current` means the group runs a table
    this core has not seen (it restarted, say), so `plan` waits for `adopt` of that table rather than
    plan moves from a wrong starting point. Versions only grow."""

    def __init__(self, current: ExpertPlacement, *, window_s: float, threshold: float = 0.05,
                 max_moves: int | None = None, max_moves_total: int | None = None, redundant: int | None = None,
                 ranks_per_node: int | None = None, num_groups: int | None = None) -> None:
        if window_s <= 0 or threshold < 0 or any(x is not None and x < 1 for x in (max_moves, max_moves_total)):
            raise ValueError("window_s must be positive, threshold not negative, max_moves and max_moves_total "
                             "at least 1")
        filled = max((sum(1 for e in layer if e != EMPTY) for layer in current.layers), default=0)
        self.redundant = (filled - current.num_experts) if redundant is None else redundant
        self.replicas = current.num_experts + self.redundant
        check_shape(current.num_ranks, current.slots_per_rank, current.num_experts, self.replicas, ranks_per_node)
        self.current = current
        self.window_s = window_s
        self.threshold = threshold
        self.max_moves = max_moves  # per MoE layer and decision (None: no bound)
        self.max_moves_total = max_moves_total  # per decision over all layers (None: no bound)
        self.ranks_per_node = ranks_per_node
        self.num_groups = num_groups
        self.pending: ExpertPlacement | None = None
        self._reports: list[_Report] = []
        self._top_version = current.version  # the highest version issued, adopted or reported
        self._reported_version = current.version  # the highest version a report was counted under

    @classmethod
    def for_group(cls, num_layers: int, num_experts: int, num_ranks: int, redundant: int = 0, *,
                  window_s: float, threshold: float = 0.05, max_moves: int | None = None,
                  max_moves_total: int | None = None, ranks_per_node: int | None = None,
                  num_groups: int | None = None) -> BalancerCore:
        """A core for a group that starts on the static table (`ExpertPlacement.static`)."""
        static = ExpertPlacement.static(num_layers, num_experts, num_ranks, redundant)
        return cls(static, window_s=window_s, threshold=threshold, max_moves=max_moves,
                   max_moves_total=max_moves_total, redundant=redundant, ranks_per_node=ranks_per_node,
                   num_groups=num_groups)

    # -- reports --

    def observe(self, report_layers: Sequence[Sequence[int]], version: int, now: float) -> None:
        """One report: `report_layers[l][e]` tokens routed to logical expert e of MoE layer l since the
        previous report, counted under placement `version`, received at `now`. Logical loads do not
        depend on the placement, so reports of older versions count too."""
        if len(report_layers) != self.current.num_layers:
            raise ValueError(f"a report of {len(report_layers)} MoE layers; the model has {self.current.num_layers}")
        check_loads(report_layers, self.current.num_experts)
        self._reports.append(_Report(now, version, tuple(tuple(int(x) for x in row) for row in report_layers)))
        self._top_version = max(self._top_version, version)
        self._reported_version = max(self._reported_version, version)
        self._expire(now)

    def _expire(self, now: float) -> None:
        """Keep the reports of the last `window_s` seconds (a report exactly window_s old still counts)."""
        self._reports = [r for r in self._reports if now - r.at <= self.window_s]

    @property
    def reports(self) -> int:
        return len(self._reports)

    def window_loads(self, now: float) -> list[list[int]]:
        """Per MoE layer and logical expert, the tokens reported in the window ending at `now`."""
        self._expire(now)
        total = [[0] * self.current.num_experts for _ in range(self.current.num_layers)]
        for rep in self._reports:
            for acc, row in zip(total, rep.loads, strict=True):
                for e, x in enumerate(row):
                    acc[e] += x
        return total

    # -- decisions --

    def plan(self, now: float) -> Decision | None:
        """A new placement when one is predicted to pay (see the module docstring), else None: nothing
        in the window, a decision pending, a report from a placement not adopted here, or no layer
        improving by `threshold`."""
        loads = self.window_loads(now)
        if self.pending is not None or not self._reports or self._reported_version > self.current.version:
            return None
        cur = self.current
        rpn = self.ranks_per_node if hierarchical(cur.num_experts, cur.num_ranks, self.replicas,
                                                   self.ranks_per_node, self.num_groups) else cur.num_ranks
        s = cur.slots_per_rank
        before: list[float] = []
        wanted: dict[int, tuple[float, list[int], int]] = {}  # layer -> (predicted gain, step, moves)
        full: dict[int, list[int]] = {}  # layer -> the whole rebalance the step heads for
        for i, (slots, w) in enumerate(zip(cur.layers, loads, strict=True)):
            old = max_over_mean(slot_rank_loads(slots, w, cur.num_ranks, s))
            before.append(old)
            if sum(w) <= 0:
                continue
            bins = layer_bins(w, cur.num_ranks, s, self.replicas, self.ranks_per_node, self.num_groups)
            target = align(slots, bins, s, rpn)
            if rpn == cur.num_ranks:  # global policy: a layout close to the current one may do
                target = self._nearer(slots, target, w)
            ratio = max_over_mean(slot_rank_loads(target, w, cur.num_ranks, s))
            # The gain weighed against the cost is the whole rebalance's; a bounded step towards it
            # is taken when it predicts a strictly better (max, sum of squares) of the rank loads.
            if old - ratio < self.threshold * old:
                continue
            full[i] = target
            if self.max_moves is not None and count_moves(slots, target) > self.max_moves:
                target = bounded(slots, target, w, cur.num_ranks, s, self.max_moves)
                ratio = max_over_mean(slot_rank_loads(target, w, cur.num_ranks, s))
            if target != list(slots):
                wanted[i] = (old - ratio, target, count_moves(slots, target))
        # The decision's budget goes to the layers whose step gains the most max/mean first (the same
        # tokens pass every MoE layer, so a point of max/mean is worth about as much in each); a layer
        # that no longer fits whole takes a smaller bounded step with what is left.
        left = self.max_moves_total
        chosen: dict[int, list[int]] = {}
        for i in sorted(wanted, key=lambda i: (-wanted[i][0], i)):
            gain, target, n = wanted[i]
            if left is not None and n > left:
                if left < 1:
                    break
                slots, w = cur.layers[i], loads[i]
                target = bounded(slots, full[i], w, cur.num_ranks, s, min(left, self.max_moves or left))
                if target == list(slots):
                    continue
                n = count_moves(slots, target)
            chosen[i] = target
            if left is not None:
                left -= n
        layers, changed, moves, after = [], [], [], []
        for i, (slots, w) in enumerate(zip(cur.layers, loads, strict=True)):
            new_slots = chosen.get(i, list(slots))
            if i in chosen:
                changed.append(i)
            layers.append(tuple(new_slots))
            moves.append(count_moves(slots, new_slots))
            after.append(max_over_mean(slot_rank_loads(new_slots, w, cur.num_ranks, s)) if i in chosen
                         else before[i])
        if not changed:
            return None
        self._top_version += 1
        placement = ExpertPlacement(cur.num_ranks, cur.num_experts, cur.slots_per_rank, tuple(layers),
                                    self._top_version)
        self.pending = placement
        return Decision(placement, tuple(changed), tuple(moves), tuple(before), tuple(after))

    def _nearer(self, slots: Sequence[int], scratch: list[int], weights: Sequence[int]) -> list[int]:
        """Of the layout built from scratch and the one reached from `slots` by `incremental`, the one
        with fewer moves, unless the other predicts a max/mean better by `threshold` (relative)."""
        cur = self.current
        near = incremental(slots, weights, cur.num_ranks, cur.slots_per_rank, self.replicas)
        if near is None:
            return scratch
        ratio = [max_over_mean(slot_rank_loads(t, weights, cur.num_ranks, cur.slots_per_rank))
                 for t in (near, scratch)]
        few, many = (near, scratch) if count_moves(slots, near) <= count_moves(slots, scratch) else (scratch, near)
        r_few, r_many = ratio if few is near else ratio[::-1]
        return many if r_few - r_many > self.threshold * r_few else few

    def adopt(self, placement: ExpertPlacement) -> None:
        """The group now runs `placement` (it confirmed the switch, or reported the table it runs):
        it becomes `current`, and any pending decision is settled."""
        cur = self.current
        if (placement.num_ranks, placement.num_experts, placement.slots_per_rank, placement.num_layers) != (
                cur.num_ranks, cur.num_experts, cur.slots_per_rank, cur.num_layers):
            raise ValueError("the adopted placement is for another group shape")
        if placement.version < cur.version:
            raise ValueError(f"placement version {placement.version} is older than the current {cur.version}")
        self.current = placement
        self.pending = None
        self._top_version = max(self._top_version, placement.version)

    def abandon(self) -> None:
        """The pending decision will not be applied (the group refused it, or it timed out in the shell);
        its version stays used, so the next decision gets a new one."""
        self.pending = None
