"""Runs an engine's step loop on its own thread so the worker's event loop keeps moving sockets.

The engine is not thread-safe, so it is touched only on this thread: the event loop hands work over
with `call(fn)` (run between two steps, in submission order) and receives each step's outputs through
`on_outputs`, scheduled onto the event loop. A step takes tens to hundreds of milliseconds; commands
wait at most one step.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import RequestOutput

T = TypeVar("T")

COALESCE_GAP_S = 0.003  # a burst has ended when no command came for this long
COALESCE_MAX_S = 0.03  # never hold an idle engine back longer than this
RATE_MIN_TOKENS = 16  # steps computing fewer tokens (decode only) say little about prefill throughput
RATE_ALPHA = 0.2


class EngineThread:
    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop,
                 on_outputs: Callable[[list[RequestOutput]], None], name: str = "engine") -> None:
        self.engine = engine
        self.loop = loop
        self.on_outputs = on_outputs
        self.steps = 0
        # Tokens computed per second of step, an EWMA over steps of at least RATE_MIN_TOKENS tokens: what
        # the router divides a prompt's uncached tokens by to predict its prefill time.
        self.tokens_per_s = 0.0
        self._commands: deque[tuple[Callable[[], Any], asyncio.Future[Any] | None]] = deque()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    def call(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Run `fn()` on the engine thread before the next step; the future resolves on the event loop."""
        fut: asyncio.Future[T] = self.loop.create_future()
        self._commands.append((fn, fut))
        self._wake.set()
        return fut

    def _resolve(self, fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def _run_commands(self) -> int:
        n = 0
        while self._commands:
            fn, fut = self._commands.popleft()
            n += 1
            try:
                result, exc = fn(), None
            except Exception as e:  # the caller gets the exception; the loop goes on
                result, exc = None, e
            if fut is not None:
                self.loop.call_soon_threadsafe(self._resolve, fut, result, exc)
        return n

    def _measure(self, tokens: int, seconds: float) -> None:
        if tokens >= RATE_MIN_TOKENS and seconds > 0:
            sample = tokens / seconds
            self.tokens_per_s = sample if not self.tokens_per_s else self.tokens_per_s + RATE_ALPHA * (
                sample - self.tokens_per_s)

    def _run(self) -> None:
        while not self._stop:
            was_idle = not self.engine.has_unfinished()
            if self._run_commands() and was_idle:
                # Work arriving at an idle engine comes in bursts (a client submits many requests; each
                # reaches us a message later): gather the burst so the first step batches it, instead of
                # starting a small step per request.
                deadline = time.monotonic() + COALESCE_MAX_S
                while time.monotonic() < deadline:
                    self._wake.clear()
                    if not self._wake.wait(COALESCE_GAP_S):
                        break
                    self._run_commands()
            if self.engine.has_unfinished():
                computed, t0 = self.engine.stats.tokens_computed, time.monotonic()
                outputs = self.engine.step()
                self.steps += 1
                self._measure(self.engine.stats.tokens_computed - computed, time.monotonic() - t0)
                if outputs:
                    self.loop.call_soon_threadsafe(self.on_outputs, outputs)
            else:
                self._wake.wait(timeout=0.05)
                self._wake.clear()
