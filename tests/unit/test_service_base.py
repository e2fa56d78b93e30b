"""`BaseService`'s contract, on a tiny service over inproc sockets: a failing handler or spawned task is
logged and the service keeps serving; a drain ends by its deadline whatever the service and its drain hook
do; stop closes every registered socket; a loop that raises ends run() with that exception.

Waits are bounded only so that a regression fails instead of hanging."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import structlog
import zmq
import zmq.asyncio

from deepinfer.protocol import messages as m
from deepinfer.protocol.errors import ProtocolError
from deepinfer.protocol.sockets import arecv_msg, asend_msg, make_pull, make_push
from deepinfer.services.base import BaseService

WAIT_S = 10.0
_endpoints = itertools.count()


class Recorder(BaseService):
    """Receives AbortRequests on a PULL socket and records their ids; the id "boom" makes the handler raise.
    Busy (never idle) while `busy` is set."""

    role = "recorder"

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        super().__init__("recorder-0", ctx)
        self.endpoint = endpoint
        self.seen: list[str] = []
        self.unexpected: list[Any] = []
        self.refused: list[ProtocolError] = []
        self.busy = False
        self.extra: list[Awaitable[None]] = []
        self.pull: Any = None

    async def open(self) -> bool:
        self.pull = self.socket(make_pull(self.ctx, bind=self.endpoint))
        return True

    def tasks(self) -> list[Awaitable[None]]:
        return [self.dispatch_forever(self.pull, arecv_msg, {m.AbortRequest: self._on_abort},
                                      otherwise=self._on_other, on_malformed=self._on_malformed), *self.extra]

    def idle(self) -> bool:
        return not self.busy

    async def _on_abort(self, req: m.AbortRequest) -> None:
        if req.request_id == "boom":
            raise RuntimeError("handler bug")
        self.seen.append(req.request_id)

    async def _on_other(self, msg: Any) -> None:
        self.unexpected.append(msg)

    async def _on_malformed(self, exc: ProtocolError) -> None:
        self.refused.append(exc)


async def until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {WAIT_S}s: {what}")
        await asyncio.sleep(0.01)


@pytest.fixture
def logs() -> Iterator[list[dict[str, Any]]]:
    with structlog.testing.capture_logs() as captured:
        yield captured


def events(logs: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == event]


def serving(body: Callable[[Recorder, Any, asyncio.Task[None]], Awaitable[None]],
            setup: Callable[[Recorder], None] = lambda svc: None) -> None:
    """Run `body(service, push, run_task)` with a Recorder serving and a PUSH connected to it; then stop it."""
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        endpoint = f"inproc://recorder-{next(_endpoints)}"
        svc = Recorder(ctx, endpoint)
        setup(svc)
        ready = asyncio.Event()
        task = asyncio.create_task(svc.run(ready))
        await asyncio.wait_for(ready.wait(), WAIT_S)
        push = make_push(ctx, connect=endpoint)
        try:
            await body(svc, push, task)
        finally:
            svc.stop()
            await asyncio.wait([task], timeout=WAIT_S)
            push.close(linger=0)
            ctx.destroy(linger=0)

    asyncio.run(main())


def test_a_failing_handler_is_logged_and_the_service_keeps_serving(logs):
    async def body(svc: Recorder, push: Any, task: asyncio.Task[None]) -> None:
        for rid in ("a", "boom", "b"):
            await asend_msg(push, m.AbortRequest(rid))
        await until(lambda: svc.seen == ["a", "b"], "the message after the failing one handled")
        assert not task.done()

    serving(body)
    (failed,) = events(logs, "handler failed")
    assert failed["type"] == "AbortRequest" and failed["log_level"] == "error"


def test_malformed_and_unexpected_messages_are_skipped(logs):
    async def body(svc: Recorder, push: Any, task: asyncio.Task[None]) -> None:
        await push.send_multipart([b"\x44", b"\xc1garbage"])
        await asend_msg(push, m.Shutdown())
        await asend_msg(push, m.AbortRequest("after"))
        await until(lambda: svc.seen == ["after"], "the well-formed message after them handled")
        assert svc.malformed == 1 and len(svc.refused) == 1
        assert svc.unexpected == [m.Shutdown()]

    serving(body)
    assert len(events(logs, "malformed message")) == 1


def test_a_failing_spawned_task_is_logged_and_the_service_keeps_running(logs):
    async def body(svc: Recorder, push: Any, task: asyncio.Task[None]) -> None:
        async def fail() -> None:
            raise RuntimeError("spawned bug")

        failing = svc.spawn(fail(), "failing")
        await until(failing.done, "the spawned task ended")
        await asend_msg(push, m.AbortRequest("still"))
        await until(lambda: svc.seen == ["still"], "a message handled after the failure")
        assert not task.done() and failing not in svc._spawned

    serving(body)
    (failed,) = events(logs, "task failed")
    assert failed["task"] == "failing" and "spawned bug" in failed["error"]


def test_spawned_tasks_are_cancelled_at_stop():
    sleeper: list[asyncio.Task[Any]] = []

    async def body(svc: Recorder, push: Any, task: asyncio.Task[None]) -> None:
        sleeper.append(svc.spawn(asyncio.sleep(3600), "sleeper"))
        svc.stop()
        await asyncio.wait_for(task, WAIT_S)
        await until(sleeper[0].done, "the spawned task ended")
        assert sleeper[0].cancelled() and not svc._spawned

    serving(body)


def test_a_never_idle_service_stops_by_its_drain_deadline(logs):
    timeout_s = 0.5

    async def body(svc: Recorder, push: Any, task: asyncio.Task[None]) -> None:
        svc.busy = True
        began = time.monotonic()
        svc.drain(timeout_s=timeout_s)
        assert svc.draining
        await asyncio.wait_for(task, WAIT_S)
        assert time.monotonic() - began >= timeout_s  # it waited for the work in flight until the deadline
        assert svc._stopping.is_set()

    serving(body)
    assert [e["timeout_s"] for e in events(logs, "draining")] == [timeout_s]


def test_an_idle_service_stops_at_once_when_drained():
    async def body(svc: Recorder, push: Any, task: asyncio.Task[None]) -> None:
        svc.drain(timeout_s=3600)
        await asyncio.wait_for(task, WAIT_S)

    serving(body)


def test_a_drain_hook_that_hangs_is_cut_off_at_the_deadline():
    class Hanging(Recorder):
        async def on_drain(self, timeout_s: float) -> None:
            await asyncio.sleep(3600)  # as a send to a peer that is gone

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        svc = Hanging(ctx, f"inproc://recorder-{next(_endpoints)}")
        ready = asyncio.Event()
        task = asyncio.create_task(svc.run(ready))
        await asyncio.wait_for(ready.wait(), WAIT_S)
        svc.drain(timeout_s=0.3)
        await asyncio.wait_for(task, WAIT_S)
        ctx.destroy(linger=0)

    asyncio.run(main())


def test_stop_closes_every_registered_socket():
    async def body(svc: Recorder, push: Any, task: asyncio.Task[None]) -> None:
        other = svc.socket(make_push(svc.ctx, connect="inproc://nobody"))
        assert not svc.pull.closed and not other.closed
        svc.stop()
        await asyncio.wait_for(task, WAIT_S)
        assert svc.pull.closed and other.closed

    serving(body)


def test_a_loop_that_raises_ends_run_with_that_exception_and_closes_the_sockets():
    class LoopBug(Exception):
        pass

    async def broken() -> None:
        await asyncio.sleep(0.05)
        raise LoopBug("the timer broke")

    async def body(svc: Recorder, push: Any, task: asyncio.Task[None]) -> None:
        with pytest.raises(LoopBug, match="the timer broke"):
            await asyncio.wait_for(task, WAIT_S)
        assert svc.pull.closed

    serving(body, setup=lambda svc: svc.extra.append(broken()))
