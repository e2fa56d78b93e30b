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
    experts move; max_moves: at most this many slots per layer load new weights in one decision (None: no
    bound); move_timeout_s: a decision with no PlacementResult by then is given up."""

    interval_s: float = 30.0
    window_s: float = 120.0
    threshold: float = 0.05
    max_moves: int | None = None
    move_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.window_s <= 0 or self.move_timeout_s <= 0:
            raise ValueError("interval_s, window_s and move_timeout_s must be positive")
        if self.threshold < 0:
            raise ValueError(f"threshold = {self.threshold}: must not be negative")
        if self.max_moves is not None and self.max_moves < 1:
            raise ValueError(f"max_moves = {self.max_moves}: must be at least 1")


BALANCER_DEFAULTS = BalancerConfig()
