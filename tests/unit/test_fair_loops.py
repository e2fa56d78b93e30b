"""Fair receive loops (issue 30, F4): a service whose socket is flooded still gives its other tasks (timers,
heartbeats, other sockets' loops) their turns. pyzmq's asyncio receive completes at once while messages wait,
so without a bound a loop flooded with queued messages would handle all of them before anything else ran.

The flood is queued in full before the service serves (inproc, high-water marks raised), so every receive of
it completes at once: what the other tasks see is decided by the loop's fairness, not by timing."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import structlog
import zmq
import zmq.asyncio

from deepinfer.protocol import messages as m
from deepinfer.protocol.errors import ProtocolError
from deepinfer.protocol.framing import encode_frames
from deepinfer.protocol.sockets import arecv_msg, make_pull, make_push
from deepinfer.services.base import FAIR_BATCH, MALFORMED_LOG_PERIOD_S, BaseService

FLOOD = 40 * FAIR_BATCH
ENDPOINT = "inproc://fair-loops"


class Flooded(BaseService):
    """A PULL socket that finds FLOOD messages (every other one malformed) waiting when it starts serving,
    and two other tasks: a ticker (yields, counting its turns) and a second socket's loop. Each flood message
    handled records how often the others had run by then."""

    role = "flooded"

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        super().__init__("flooded-0", ctx)
        self.ticks = 0
        self.other_seen = 0
        self.seen_at: list[tuple[int, int]] = []  # (ticks, other_seen) when each flood message was handled
        self.done = asyncio.Event()
        self.pull: Any = None
        self.other: Any = None

    async def open(self) -> bool:
        self.pull = self.socket(make_pull(self.ctx, bind=ENDPOINT, hwm=4 * FLOOD))
        self.other = self.socket(make_pull(self.ctx, bind=ENDPOINT + "-other"))
        push = make_push(self.ctx, connect=ENDPOINT, hwm=4 * FLOOD)
        other_push = make_push(self.ctx, connect=ENDPOINT + "-other")
        try:
            for i in range(FLOOD):  # all queued before the loops start
                frames = [b"\x05", b"\xc1not msgpack"] if i % 2 else [b"\x05", _abort(str(i))]
                push.send_multipart(frames, flags=zmq.NOBLOCK)
            for i in range(8):
                other_push.send_multipart([b"\x05", _abort(f"other-{i}")], flags=zmq.NOBLOCK)
        finally:
            push.close(linger=-1)
            other_push.close(linger=-1)
        return True

    def tasks(self) -> list[Awaitable[None]]:
        return [self.dispatch_forever(self.pull, arecv_msg, {m.AbortRequest: self._flood_message},
                                      on_malformed=self._flood_malformed),
                self._ticker(),
                self.dispatch_forever(self.other, arecv_msg, {m.AbortRequest: self._other_message})]

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(0)
            self.ticks += 1

    async def _flood_message(self, msg: m.AbortRequest) -> None:
        self._record()

    async def _flood_malformed(self, exc: ProtocolError) -> None:
        self._record()

    def _record(self) -> None:
        self.seen_at.append((self.ticks, self.other_seen))
        if len(self.seen_at) == FLOOD:
            self.done.set()

    async def _other_message(self, msg: m.AbortRequest) -> None:
        self.other_seen += 1


def _abort(rid: str) -> bytes:
    return bytes(encode_frames(m.AbortRequest(rid))[1])


def test_a_flooded_loop_lets_timers_and_other_sockets_run_during_the_flood():
    async def main() -> Flooded:
        ctx = zmq.asyncio.Context()
        svc = Flooded(ctx)
        task = asyncio.create_task(svc.run())
        try:
            await asyncio.wait_for(svc.done.wait(), 60)
        finally:
            svc.stop()
            await asyncio.wait([task], timeout=10)
            ctx.destroy(linger=0)
        return svc

    with structlog.testing.capture_logs() as logs:
        svc = asyncio.run(main())
    first_ticks, _ = svc.seen_at[0]
    last_ticks, last_other = svc.seen_at[-1]
    # The ticker ran about once per FAIR_BATCH flood messages, while the flood was being handled ...
    assert last_ticks - first_ticks >= FLOOD // FAIR_BATCH - 2, (first_ticks, last_ticks)
    # ... and so did the other socket's loop: its messages were all handled before the flood was.
    assert last_other == 8
    # Half the flood was malformed: each counted, but logged once per period, not once each.
    assert svc.malformed == FLOOD // 2
    lines = [e for e in logs if e["event"] == "malformed message"]
    assert 1 <= len(lines) <= 1 + 60 / MALFORMED_LOG_PERIOD_S
    assert lines[0]["malformed"] == 1
