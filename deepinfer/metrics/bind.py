"""Binding a metric's labels once, and feeding a counter from a total that only grows."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

from deepinfer.metrics.env import sync_value_class


def bind(metric: Any, *labelvalues: str) -> Any:
    """The child of `metric` for these label values, its storage chosen per the multiprocess variable now.

    Bind once and keep the child: `.labels()` looks the values up under a lock, a cached child does not.
    """
    sync_value_class()
    return metric.labels(*labelvalues)


class TotalsFeed:
    """Turns monotonic totals a component keeps (engine stats, store counters) into counter increments.

    Each `update(totals)` adds the growth since the previous one to the key's counter; a total that went
    down (its owner restarted) counts from zero again. Keys without a counter are ignored, and children
    are made on first sight with `child_of(key)` (return None to skip a key).
    """

    def __init__(self, child_of: Any) -> None:
        self._child_of = child_of
        self._children: dict[Hashable, Any] = {}
        self._last: dict[Hashable, float] = {}

    def update(self, totals: Mapping[Hashable, float]) -> None:
        for key, total in totals.items():
            child = self._children.get(key)
            if child is None:
                if key in self._children or (child := self._child_of(key)) is None:
                    self._children[key] = None
                    continue
                self._children[key] = child
            last = self._last.get(key, 0.0)
            grown = total - last if total >= last else total
            self._last[key] = total
            if grown > 0:
                child.inc(grown)
