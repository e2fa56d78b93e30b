"""What every service records: that it serves, its progress, malformed messages, and (from a worker's
heartbeat) its batch and KV pool. Fed at heartbeat rate, so it costs nothing per message or step."""

from __future__ import annotations

from typing import Any

from deepinfer.metrics import definitions as d
from deepinfer.metrics.bind import TotalsFeed, bind


class ServiceMetrics:
    """One service process's own metrics, labelled (service, instance)."""

    def __init__(self, service: str, instance: str) -> None:
        self.who = (service, instance)
        self._up = bind(d.SERVICE_UP, *self.who)
        feeds = {"progress": d.SERVICE_PROGRESS, "malformed": d.MALFORMED_MESSAGES,
                 "spec_proposed_tokens": d.SPEC_DRAFT_TOKENS, "spec_accepted_tokens": d.SPEC_ACCEPTED_TOKENS}
        self._totals = TotalsFeed(lambda key: bind(feeds[key], *self.who) if key in feeds else None)
        self._pool: tuple[Any, ...] | None = None  # bound at the first heartbeat that shows a KV pool

    def serving(self, up: bool) -> None:
        self._up.set(1 if up else 0)

    def on_totals(self, **totals: float) -> None:
        """Monotonic totals of this process (progress, malformed, ...): their growth is counted."""
        self._totals.update(totals)

    def on_heartbeat(self, beat: Any, malformed: int) -> None:
        """A heartbeat just sent: its progress, and for a worker (a KV pool) its batch and pool."""
        self._totals.update({"progress": beat.progress, "malformed": malformed,
                             "spec_proposed_tokens": beat.spec_proposed_tokens,
                             "spec_accepted_tokens": beat.spec_accepted_tokens})
        if beat.total_blocks <= 0:
            return
        if self._pool is None:
            self._pool = tuple(bind(g, *self.who) for g in (
                d.NUM_REQUESTS_RUNNING, d.NUM_REQUESTS_WAITING, d.QUEUED_PROMPT_TOKENS, d.KV_BLOCKS_USED,
                d.KV_BLOCKS_FREE, d.KV_CACHE_USAGE))
        running, waiting, queued, used, free, usage = self._pool
        running.set(beat.running)
        waiting.set(beat.waiting)
        queued.set(beat.queued_prompt_tokens)
        used.set(beat.total_blocks - beat.free_blocks)
        free.set(beat.free_blocks)
        usage.set((beat.total_blocks - beat.free_blocks) / beat.total_blocks)
