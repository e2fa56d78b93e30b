"""The expert balancer's settings and name, apart from its service so that the launcher's light modules
(the command line's options, the topology) read them without importing sockets or the planner."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BALANCER_DEFAULTS", "BALANCER_NAME", "BalancerConfig"]

BALANCER_NAME = "balancer"  # the one balancer's instance name (a mesh has at most one)


@dataclass(frozen=True)
class BalancerConfig:
    """The `[balancer]` table of a topology: when the balancer plans and what a move must gain.

    interval_s: how often each group's placement is reconsidered; window_s: the load reports it weighs (the
    last window_s seconds); threshold: the relative max/mean improvement a layer must promise before its
    experts move; max_moves: at most this many slots of one MoE layer load new weights in one decision;
    max_moves_total: at most this many in one decision over all layers, spent on the layers with the largest
    predicted gain first; move_timeout_s: a decision with no PlacementResult by then is given up.

    Why 8 and 64. A move reloads one expert's weights on one rank while the old placement serves, in the
    background at a bounded duty (deepinfer.engine.ep.move), so a decision costs its number of moves
    and risks what changes at one switch. 8 per layer is a few slots per rank on the small groups a host
    runs (EP 2-8); it still converges, over more rounds: `bench.bench_eplb --max-moves 32` reaches the
    threshold in 3-43 rounds at DeepSeek scale, and a bound of 2 still gets there on a 16-expert layer
    (tests/unit/test_balancer_core.py, test_max_moves_converges_over_rounds). 64 per decision caps one
    decision at about 64 experts' weights (smollm2-moe: about an eighth of its 30 layers' slots at EP 2;
    DeepSeek-V3: about 2.8 GB of fp8 expert weights over all ranks), the largest gains first, the rest at
    the next intervals. For the old unbounded behaviour, set max_moves to the group's slots per layer and
    max_moves_total to that times the MoE layers."""

    interval_s: float = 30.0
    window_s: float = 120.0
    threshold: float = 0.05
    max_moves: int = 8
    max_moves_total: int = 64
    move_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.window_s <= 0 or self.move_timeout_s <= 0:
            raise ValueError("interval_s, window_s and move_timeout_s must be positive")
        if self.threshold < 0:
            raise ValueError(f"threshold = {self.threshold}: must not be negative")
        for key in ("max_moves", "max_moves_total"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{key} = {value!r}: must be an integer")
            if value < 1:
                raise ValueError(f"{key} = {value}: must be at least 1")


BALANCER_DEFAULTS = BalancerConfig()
