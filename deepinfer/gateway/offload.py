"""A bounded pool of threads for the gateway's CPU work (parsing big bodies, chat templates, tokenising,
building big responses), so the event loop that serves every HTTP client and reads the router's replies
never stalls on one request. Bounded twice: `threads` run at once, at most `max_waiting` more wait; past
that a request is refused with 503 (Retry-After) at once rather than queued behind minutes of work.

Only work that releases the GIL (the tokenizer's batch calls, see `text_work`) or runs Python bytecode (the
GIL then passes to the loop at the interpreter's switch interval) keeps the loop responsive; the bounds on
bodies and prompts keep the rest short.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from deepinfer.gateway.errors import unavailable

T = TypeVar("T")


class Offload:
    def __init__(self, threads: int, max_waiting: int) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="gateway-cpu")
        self._capacity = threads + max_waiting
        self._pending = 0  # submitted and not finished (a job whose caller left still counts until it ends)

    async def run(self, fn: Callable[..., T], *args: Any, refuse_when_busy: bool = True) -> T:
        """fn(*args) on a thread; 503 at once when too much waits (unless `refuse_when_busy` is False: work
        whose refusal would waste what is done, such as answering a finished generation)."""
        if refuse_when_busy and self._pending >= self._capacity:
            raise unavailable("the gateway is busy: too much parsing and tokenising is waiting", "busy")
        loop = asyncio.get_running_loop()
        self._pending += 1
        future = self._pool.submit(fn, *args)

        def finished(_: Any) -> None:
            try:
                loop.call_soon_threadsafe(self._finished)
            except RuntimeError:  # the loop closed first: nothing counts any more
                pass

        future.add_done_callback(finished)
        return await asyncio.wrap_future(future)

    def _finished(self) -> None:
        self._pending -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
