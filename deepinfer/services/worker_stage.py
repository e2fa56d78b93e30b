"""The worker's stage: jobs wait here, not in the engine's queue, until the engine is about to need them.

Why: a job's cached prefix is looked up (device, then the cache daemon's host and disk tiers) and fetched
just before it is added to the engine. Added at arrival, a job that then queues behind others was looked up
before the prefixes they compute existed: under load, when the cache matters most, it found nothing and
recomputed what the daemon holds by the time it runs. Staged, its lookup runs when work on it is about to
start, so every prefix committed while it waited is found.

The rule: a job enters (its lookup and fetch begin, then it is added) while the engine's queued prompt
tokens plus those of the jobs already entering are below `depth_tokens` (about two steps' worth, so the
engine never runs dry waiting for a lookup), and always when nothing is queued or entering (one prompt may be
longer than the depth). Order is the engine's own: priority (lower first), then arrival.

A pure object: the worker shell pushes jobs, asks `enter` with the engine's queue each time a step may have
drained it, and calls `entered` when a job's add is done (or failed).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["Stage"]

T = TypeVar("T")


@dataclass(order=True)
class _Staged(Generic[T]):
    priority: int
    seq: int
    request_id: str = field(compare=False)
    tokens: int = field(compare=False)
    item: T = field(compare=False)
    dropped: bool = field(default=False, compare=False)  # aborted while staged: skipped when it comes up


class Stage(Generic[T]):
    def __init__(self, depth_tokens: int) -> None:
        if depth_tokens <= 0:
            raise ValueError("depth_tokens must be positive")
        self.depth_tokens = depth_tokens
        self._heap: list[_Staged[T]] = []
        self._staged: dict[str, _Staged[T]] = {}  # request id → its live (not dropped) entry
        self._entering: dict[str, int] = {}  # request id → prompt tokens, from `enter` until `entered`
        self._seq = itertools.count()
        self.staged_tokens = 0

    def __len__(self) -> int:
        return len(self._staged)

    @property
    def entering_tokens(self) -> int:
        return sum(self._entering.values())

    def push(self, request_id: str, tokens: int, priority: int, item: T) -> None:
        self.drop(request_id)  # (a job id is staged once; a repeat replaces the first)
        entry = _Staged(priority, next(self._seq), request_id, tokens, item)
        heapq.heappush(self._heap, entry)
        self._staged[request_id] = entry
        self.staged_tokens += tokens

    def drop(self, request_id: str) -> bool:
        """Forget a staged job (aborted); False if it is not staged (entering, in the engine, or unknown)."""
        entry = self._staged.pop(request_id, None)
        if entry is None:
            return False
        entry.dropped = True
        self.staged_tokens -= entry.tokens
        return True

    def clear(self) -> None:
        self._heap.clear()
        self._staged.clear()
        self.staged_tokens = 0

    def enter(self, engine_queued_tokens: int) -> list[T]:
        """The jobs that enter now, in order, given the prompt tokens the engine has queued (not yet computed
        by its waiting requests). Each stays counted as entering until `entered`."""
        out: list[T] = []
        while self._heap:
            head = self._heap[0]
            if head.dropped:
                heapq.heappop(self._heap)
                continue
            ahead = engine_queued_tokens + self.entering_tokens
            if ahead > 0 and ahead + min(head.tokens, self.depth_tokens) > self.depth_tokens:
                break
            heapq.heappop(self._heap)
            del self._staged[head.request_id]
            self.staged_tokens -= head.tokens
            self._entering[head.request_id] = head.tokens
            out.append(head.item)
        return out

    def entered(self, request_id: str) -> None:
        """Its add is done (or failed, or it was dropped while its prefix loaded): the engine counts it now."""
        self._entering.pop(request_id, None)
