"""What the expert balancer records: its placement decisions by outcome (sent, adopted, abandoned)."""

from __future__ import annotations

from deepinfer.metrics import definitions as d
from deepinfer.metrics.bind import TotalsFeed, bind

OUTCOMES = ("sent", "adopted", "abandoned")


class BalancerExport:
    def __init__(self, service: str, instance: str) -> None:
        who = (service, instance)
        self._totals = TotalsFeed(lambda o: bind(d.BALANCER_DECISIONS, *who, o) if o in OUTCOMES else None)

    def decisions(self, sent: int, adopted: int, abandoned: int) -> None:
        """The balancer's totals so far (monotonic)."""
        self._totals.update({"sent": sent, "adopted": adopted, "abandoned": abandoned})
