"""Runs an engine's step loop on its own thread so the worker's event loop keeps moving sockets.

The engine is not thread-safe, so it is touched only on this thread: the event loop hands work over
with `call(fn)` (run between two steps, in submission order) and receives each step's outputs through
`on_outputs`, scheduled onto the event loop. A step takes tens to hundreds of milliseconds; commands
wait at most one step.

The engine is any `ServingEngine` (an LLMEngine, or a worker group's `GroupEngine`). A group needs two
more things of this loop, which its worker passes in: `keepalive` to call while idle (it sends queued
commands to follower ranks and keeps them from timing out), and `fatal`, the exceptions that end the loop
(a broken group). Failure is fatal here: an exception out of `step()` or `keepalive`, or of a command when
it is one of `fatal`, ends the loop; every command still queued, and every later `call`, fails with it,
and `on_failure` is told on the event loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch

from deepinfer.engine.interface import ServingEngine
from deepinfer.engine.request import RequestOutput
from deepinfer.services.token_cadence import CadenceMeter

T = TypeVar("T")


class StepRecorder(Protocol):
    def step(self, seconds: float, batch: int, tokens: int) -> None: ...


COALESCE_GAP_S = 0.003  # a burst has ended when no command came for this long
COALESCE_MAX_S = 0.03  # never hold an idle engine back longer than this
RATE_MIN_TOKENS = 16  # steps computing fewer tokens (decode only) say little about prefill throughput
RATE_ALPHA = 0.2


def load_on_a_passing_thread(load: Callable[[], T], name: str = "engine-load") -> T:
    """`load()` run on a thread that ends with it; its result or exception. Load the engine this way in a
    process whose engine then steps on an `EngineThread`: a thread that runs torch ops keeps its OpenMP pool
    for life, and while two threads own one, every GEMM is ~20% slower in both (measured:
    `python -m bench.bench_openmp_masters`). Loaded on a thread that has ended, the model leaves no pool
    behind, so the engine thread's is the only one."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(load())
        except BaseException as exc:  # re-raised on the caller's thread
            error.append(exc)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


class EngineThread:
    def __init__(self, engine: ServingEngine, loop: asyncio.AbstractEventLoop,
                 on_outputs: Callable[[list[RequestOutput]], None], name: str = "engine", *,
                 on_failure: Callable[[BaseException], None] | None = None,
                 fatal: tuple[type[BaseException], ...] = (), step_metrics: StepRecorder | None = None,
                 keepalive: Callable[[], None] | None = None) -> None:
        """`keepalive`: called at every idle turn of the loop (no unfinished work), e.g. a group's."""
        self.engine = engine
        self.step_metrics = step_metrics  # told each step's wall time, requests with output and tokens
        self.loop = loop
        self.on_outputs = on_outputs
        self.on_failure = on_failure
        self.fatal = fatal
        self.failure: BaseException | None = None
        self._keepalive = keepalive
        self.steps = 0
        # Tokens computed per second of step, an EWMA over steps of at least RATE_MIN_TOKENS tokens: what
        # the router divides a prompt's uncached tokens by to predict its prefill time.
        self.tokens_per_s = 0.0
        # Seconds per output token by batch size, over back-to-back steps: what the router predicts a
        # stream's TPOT from (token_cadence). `_previous`: the last step's start, streams and tokens given
        # out, while the loop has not idled since.
        self.cadence = CadenceMeter()
        self._previous: tuple[float, int, int] | None = None
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

    @property
    def pending(self) -> int:
        """Commands queued for the next step boundary."""
        return len(self._commands)

    def call(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Run `fn()` on the engine thread before the next step; the future resolves on the event loop."""
        fut: asyncio.Future[T] = self.loop.create_future()
        if self.failure is not None:
            fut.set_exception(self.failure)
            return fut
        self._commands.append((fn, fut))
        if self.failure is not None:  # failed meanwhile: the loop may have drained the queue already
            self._fail_queued(self.failure)
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
            except Exception as e:  # the caller gets the exception; the loop goes on unless it is fatal
                result, exc = None, e
            if fut is not None:
                self.loop.call_soon_threadsafe(self._resolve, fut, result, exc)
            if isinstance(exc, self.fatal):
                raise exc
        return n

    def _measure(self, tokens: int, seconds: float) -> None:
        if tokens >= RATE_MIN_TOKENS and seconds > 0:
            sample = tokens / seconds
            self.tokens_per_s = sample if not self.tokens_per_s else self.tokens_per_s + RATE_ALPHA * (
                sample - self.tokens_per_s)

    def _run(self) -> None:
        try:
            if self.engine.config.num_threads:
                torch.set_num_threads(self.engine.config.num_threads)  # OpenMP's count is per thread
            self._loop()
        except Exception as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        """The loop is over: fail what is queued and what comes later, and tell the service."""
        self.failure = exc
        self._fail_queued(exc)
        if self.on_failure is not None:
            self.loop.call_soon_threadsafe(self.on_failure, exc)

    def _fail_queued(self, exc: BaseException) -> None:
        while True:
            try:
                _, fut = self._commands.popleft()  # deque pops are atomic: each command is failed once
            except IndexError:
                return
            if fut is not None:
                self.loop.call_soon_threadsafe(self._resolve, fut, None, exc)

    def _loop(self) -> None:
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
                stats = self.engine.stats
                computed, generated, t0 = stats.tokens_computed, stats.tokens_generated, time.monotonic()
                if self._previous is not None:
                    start, streams, given = self._previous
                    self.cadence.record(streams, given, t0 - start)
                outputs = self.engine.step()
                self.steps += 1
                stats = self.engine.stats  # a group engine's is a fresh sum each time
                seconds, tokens = time.monotonic() - t0, stats.tokens_computed - computed
                self._measure(tokens, seconds)
                self._previous = (t0, sum(1 for o in outputs if o.new_token_ids), stats.tokens_generated - generated)
                if self.step_metrics is not None:
                    self.step_metrics.step(seconds, len(outputs), tokens)
                if outputs:
                    self.loop.call_soon_threadsafe(self.on_outputs, outputs)
            else:
                self._previous = None  # an idle wait is no stream's cadence
                if self._keepalive is not None:
                    self._keepalive()
                self._wake.wait(timeout=0.05)
                self._wake.clear()
