"""What a worker records beyond its heartbeat: each engine step, the KV it moves (the P/D handoff, the
cache daemon's prefixes) and preemptions.

A step only appends a tuple to a queue on the engine thread (well under a microsecond); the histograms
are fed from it at heartbeat rate on the event loop (`flush`), off the step's path: three observations
cost tens of microseconds, a measurable share of a small model's decode step."""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Mapping

from deepinfer.metrics import definitions as d
from deepinfer.metrics.bind import TotalsFeed, bind

MAX_STEPS_QUEUED = 65536  # steps not yet flushed; past this the oldest are dropped (heartbeats stalled)
MAX_HANDOFFS_TIMED = 4096  # handoffs awaiting their KvAck; past this the oldest go untimed (bounded memory)
PATHS = ("handoff_send", "handoff_recv", "cache_fetch", "cache_store", "swap_out", "swap_in")


class StepMetrics:
    """One engine's steps: wall time, requests given tokens, tokens computed. `step` is called on the
    engine thread, `flush` on the event loop (deque appends and pops are atomic: no lock)."""

    def __init__(self, service: str, instance: str) -> None:
        who = (service, instance)
        self._duration = bind(d.STEP_DURATION, *who)
        self._batch = bind(d.STEP_BATCH_SIZE, *who)
        self._tokens = bind(d.STEP_TOKENS, *who)
        self._queued: deque[tuple[float, int, int]] = deque(maxlen=MAX_STEPS_QUEUED)

    def step(self, seconds: float, batch: int, tokens: int) -> None:
        self._queued.append((seconds, batch, tokens))

    def flush(self) -> None:
        """Observe every step queued since the last flush."""
        queued = self._queued
        while queued:
            try:
                seconds, batch, tokens = queued.popleft()
            except IndexError:
                return
            self._duration.observe(seconds)
            self._batch.observe(batch)
            self._tokens.observe(tokens)


class WorkerExport:
    """A worker's KV movement and preemptions (service: its role, worker / prefill / decode)."""

    def __init__(self, service: str, instance: str) -> None:
        who = self._who = (service, instance)
        self.steps = StepMetrics(service, instance)
        self._bytes = {p: bind(d.KV_TRANSFER_BYTES, *who, p) for p in PATHS}
        self._seconds = {p: bind(d.KV_TRANSFER_SECONDS, *who, p) for p in ("handoff_send", "cache_fetch")}
        self._preemptions = bind(d.NUM_PREEMPTIONS, *who)
        self._swapped = bind(d.NUM_SWAPPED_PREEMPTIONS, *who)
        self._totals = TotalsFeed(self._child)
        self._sent: OrderedDict[str, float] = OrderedDict()  # request id → when its KvTransfer went out

    def _child(self, key: str) -> object | None:
        if key == "preemptions":
            return self._preemptions
        if key == "swapped_preemptions":
            return self._swapped
        if key.startswith("plan:"):  # fetch-or-recompute decisions, bound as they are first seen
            return bind(d.CACHE_FETCH_PLANS, *self._who, key.removeprefix("plan:"))
        return self._bytes.get(key)

    def handoff_sent(self, request_id: str, nbytes: int) -> None:
        """A KvTransfer went to the decode worker: its bytes, and the clock for its KvAck."""
        self._bytes["handoff_send"].inc(nbytes)
        self._sent[request_id] = time.monotonic()
        if len(self._sent) > MAX_HANDOFFS_TIMED:
            self._sent.popitem(last=False)

    def handoff_acked(self, request_id: str) -> None:
        """The decode worker answered a KvTransfer: sent → answered is the transfer's time."""
        sent = self._sent.pop(request_id, None)
        if sent is not None:
            self._seconds["handoff_send"].observe(time.monotonic() - sent)

    def handoff_dropped(self, request_id: str) -> None:
        self._sent.pop(request_id, None)

    def handoff_received(self, nbytes: int) -> None:
        self._bytes["handoff_recv"].inc(nbytes)

    def prefix_fetched(self, seconds: float) -> None:
        """A prompt's cached prefix came from the cache daemon in `seconds`."""
        self._seconds["cache_fetch"].observe(seconds)

    def totals(self, preemptions: int, fetched_bytes: int, stored_bytes: int,
               fetch_plans: Mapping[str, int] | None = None, swapped_preemptions: int = 0,
               swap_out_bytes: int = 0, swap_in_bytes: int = 0) -> None:
        """At heartbeat rate: the steps queued since the last call, and the monotonic totals of the engine
        (preemptions, those swapped and the bytes they copied) and the cache client (`fetch_plans`: its
        fetch-or-recompute decisions so far, by decision)."""
        self.steps.flush()
        self._totals.update({"preemptions": preemptions, "swapped_preemptions": swapped_preemptions,
                             "swap_out": swap_out_bytes, "swap_in": swap_in_bytes,
                             "cache_fetch": fetched_bytes, "cache_store": stored_bytes,
                             **{f"plan:{k}": v for k, v in (fetch_plans or {}).items()}})
