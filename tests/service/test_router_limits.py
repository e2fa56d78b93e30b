"""The router's front door under abuse, with real sockets: a 1 GiB message (refused by libzmq before it is
buffered: the router process does not grow), a client that stops reading its stream (its requests end
with an explicit error; another client is served meanwhile), and a wall-clock step of an hour (nothing in
the router looks at the wall clock)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from deepinfer.protocol import messages as m
from deepinfer.protocol.sockets import arecv_msg, asend_msg, make_dealer, recv_msg, send_msg
from deepinfer.services.router import RouterService
from deepinfer.services.router_core import RouterConfig

ROUTER_SCRIPT = """
import asyncio, sys, zmq.asyncio
from deepinfer.services.router import RouterService
asyncio.run(RouterService("router", sys.argv[1], sys.argv[2], zmq.asyncio.Context()).run())
"""


def rss_peak_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the router's peak RSS from /proc")
def test_a_1_gib_message_at_the_front_is_refused_without_the_router_growing(tmp_path):
    front, back = f"ipc://{tmp_path}/front.sock", f"ipc://{tmp_path}/back.sock"
    proc = subprocess.Popen([sys.executable, "-c", ROUTER_SCRIPT, front, back])
    ctx = zmq.Context()
    try:
        hello = m.Hello(m.PROTOCOL_VERSION, "client", "client")

        def greeted(sock: zmq.Socket) -> bool:
            send_msg(sock, hello)
            return bool(sock.poll(20_000)) and recv_msg(sock).accepted

        probe = make_dealer(ctx, front, b"probe")
        assert greeted(probe)
        before = rss_peak_kib(proc.pid)
        big = make_dealer(ctx, front, b"big")
        big.setsockopt(zmq.SNDTIMEO, 60_000)
        payload = bytearray(1 << 30)
        big.send_multipart([bytes([0x10]), payload], copy=False)
        del payload
        # The router is still there, still answers, and never held the gigabyte.
        assert greeted(probe)
        assert proc.poll() is None
        assert rss_peak_kib(proc.pid) - before < 64 * 1024, "the router buffered the message"
        big.close(linger=0)
        probe.close(linger=0)
    finally:
        proc.terminate()
        proc.wait(30)
        ctx.term()


class FakeServices:
    """A tokenizer and a co-located worker in one fake: they say Hello, heartbeat, encode prompts as they
    are, take prefill jobs, and then stream `tokens_per_request` one-token deltas for every job."""

    def __init__(self, ctx: zmq.asyncio.Context, backend: str, tokens_per_request: int) -> None:
        self.tok = make_dealer(ctx, backend, b"tok0")
        self.wrk = make_dealer(ctx, backend, b"w0")
        self.n = tokens_per_request
        self.tasks = [asyncio.ensure_future(self._serve(self.tok, "tokenizer")),
                      asyncio.ensure_future(self._serve(self.wrk, "worker")),
                      asyncio.ensure_future(self._beat())]

    async def _beat(self) -> None:
        seq = 0
        while True:
            seq += 1
            for sock, role, name in ((self.tok, "tokenizer", "tok0"), (self.wrk, "worker", "w0")):
                await asend_msg(sock, m.Heartbeat(role, name, "i0", seq, seq, free_blocks=1000, total_blocks=1000))
            await asyncio.sleep(0.2)

    async def _serve(self, sock, role: str) -> None:  # type: ignore[no-untyped-def]
        name = "tok0" if role == "tokenizer" else "w0"
        await asend_msg(sock, m.Hello(m.PROTOCOL_VERSION, role, name, capabilities={"incarnation": "i0"}))
        while True:
            msg = await arecv_msg(sock)
            if isinstance(msg, m.EncodeRequest):
                await asend_msg(sock, m.EncodeResult(msg.request_id, msg.prompt_token_ids or [1], []))
            elif isinstance(msg, m.PrefillJob):
                await asend_msg(sock, m.PrefillDone(msg.request_id, "w0", len(msg.token_ids), 0))
                asyncio.ensure_future(self._stream(msg))

    async def _stream(self, job: m.PrefillJob) -> None:
        for i in range(self.n):
            last = i == self.n - 1
            item = m.TextDeltaItem(job.request_id, i, "x", [7], last, "length" if last else None)
            await asend_msg(self.tok, m.TextDeltas("tok0", [item]))
            if i % 256 == 0:
                await asyncio.sleep(0)

    def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        self.tok.close(linger=0)
        self.wrk.close(linger=0)


def test_a_client_that_stops_reading_gets_an_explicit_error_and_never_slows_others(tmp_path):
    async def run() -> None:
        ctx = zmq.asyncio.Context()
        front, back = f"ipc://{tmp_path}/front.sock", f"ipc://{tmp_path}/back.sock"
        router = RouterService("router", front, back, ctx, RouterConfig(heartbeat_timeout_s=30.0))
        task = asyncio.ensure_future(router.run())
        fakes = FakeServices(ctx, back, tokens_per_request=30_000)
        await asyncio.sleep(0.5)
        slow = make_dealer(ctx, front, b"slow")
        slow.setsockopt(zmq.RCVHWM, 1)
        req = m.GenerateRequest("s1", prompt_token_ids=[5, 6], params=m.SamplingParamsWire(max_tokens=30_000),
                                stream=True)
        await asend_msg(slow, req)
        # A second client, reading, is served in full while the first one reads nothing.
        fast = make_dealer(ctx, front, b"fast")
        await asend_msg(fast, m.GenerateRequest("f1", prompt_token_ids=[5], stream=False,
                                                params=m.SamplingParamsWire(max_tokens=30_000)))
        assert await fast.poll(120_000)
        done = await arecv_msg(fast)
        assert isinstance(done, m.RequestFinished) and len(done.token_ids) == 30_000
        # The slow client now reads: what the router still owed it ends in an explicit error.
        last = None
        for _ in range(40_000):
            if not await slow.poll(10_000):
                break
            last = await arecv_msg(slow)
            if not isinstance(last, m.StreamDelta):
                break
        assert isinstance(last, m.ErrorReply) and last.code == "overloaded" and "too slowly" in last.message
        assert router.core.num_inflight == 0
        for s in (slow, fast):
            s.close(linger=0)
        fakes.close()
        router.stop()
        await task
        ctx.destroy(linger=0)

    asyncio.run(run())


def test_a_wall_clock_step_of_an_hour_changes_nothing(tmp_path, monkeypatch):
    """Workers stay alive and requests keep their deadlines while time.time() jumps by ±1 h."""
    async def run() -> None:
        ctx = zmq.asyncio.Context()
        front, back = f"ipc://{tmp_path}/front.sock", f"ipc://{tmp_path}/back.sock"
        router = RouterService("router", front, back, ctx, RouterConfig(heartbeat_timeout_s=2.0))
        task = asyncio.ensure_future(router.run())
        fakes = FakeServices(ctx, back, tokens_per_request=3)
        client = make_dealer(ctx, front, b"c")
        real = time.time
        for step in (3600.0, -3600.0):
            monkeypatch.setattr(time, "time", lambda step=step: real() + step)
            await asyncio.sleep(0.6)  # several ticks and heartbeats under the stepped clock
            assert all(i.alive for i in router.core.table.instances.values())
            await asend_msg(client, m.GenerateRequest(f"r{step}", prompt_token_ids=[4], timeout_s=30.0))
            assert await client.poll(30_000)
            assert isinstance(await arecv_msg(client), m.RequestFinished)
        monkeypatch.setattr(time, "time", real)
        client.close(linger=0)
        fakes.close()
        router.stop()
        await task
        ctx.destroy(linger=0)

    asyncio.run(run())
