"""The twin's virtual clock: a discrete-event loop. Pure: no wall clock, no threads, no I/O.

Contract:
* `now` only moves forward; it is the time of the event being run (0.0 before the first).
* Events run in (time, insertion order): two events at the same instant run in the order they were
  scheduled. That order is what makes a twin run deterministic — the same inputs give the same outputs,
  bit for bit — so nothing here ever looks at a wall clock, a hash seed or an id().
* An event scheduled in the past (`at < now`) runs at `now`, after those already due: the clock never
  goes back.
* `cancel` is lazy: a cancelled event stays in the heap and is skipped when it comes up.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Event", "EventLoop"]


@dataclass(order=True)
class Event:
    at: float
    seq: int
    fn: Callable[[], None] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)

    def cancel(self) -> None:
        self.cancelled = True


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[Event] = []
        self._seq = itertools.count()
        self.events_run = 0

    def at(self, when: float, fn: Callable[[], None]) -> Event:
        """Run `fn()` at virtual time `when` (not before now)."""
        ev = Event(max(when, self.now), next(self._seq), fn)
        heapq.heappush(self._heap, ev)
        return ev

    def after(self, delay_s: float, fn: Callable[[], None]) -> Event:
        """Run `fn()` `delay_s` seconds of virtual time from now."""
        return self.at(self.now + max(delay_s, 0.0), fn)

    def __len__(self) -> int:
        return len(self._heap)

    def run(self, until: float | None = None, stop: Callable[[], bool] | None = None) -> None:
        """Run events in order until none is left, the next is past `until` (the clock then stands at
        `until`), or `stop()` is true after an event."""
        heap = self._heap
        while heap:
            ev = heap[0]
            if until is not None and ev.at > until:
                self.now = until
                return
            heapq.heappop(heap)
            if ev.cancelled:
                continue
            self.now = ev.at
            self.events_run += 1
            ev.fn()
            if stop is not None and stop():
                return
        if until is not None:
            self.now = max(self.now, until)
