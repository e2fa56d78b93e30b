"""The router's front door, isolation by request (issue 30, F1/F4), with real sockets over ipc:// (where libzmq
applies MAXMSGSIZE) and fake services:

* on ONE client connection, innocent streams run while the same connection sends a 3 MiB and a 9 MiB request,
  one with an integer past int64, one malformed past its request id, and garbage: each refused request gets
  its own typed error by its id, the garbage a "bad_message", and every innocent stream ends with all its
  tokens; the connection is never dropped (only a frame over the socket ceiling would be);
* a flood of garbage frames plus valid requests at the front, from another connection: the router's timer
  keeps ticking during the flood (its receive loops are fair), no live worker is declared dead, and an
  innocent client is served throughout. The heartbeat gaps the router saw are printed;
* a client that floods the front past its receive queue and disconnects does not abort the process: with
  ZMTP heartbeats on a bound socket, libzmq 4.3.5 asserts in that case (protocol.sockets), so the front has
  none.

Every wait is bounded only so that a regression fails instead of hanging; nothing asserts on wall time."""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from deepinfer import metrics
from deepinfer.protocol import messages as m
from deepinfer.protocol.framing import encode_frames
from deepinfer.protocol.limits import CLIENT_LIMITS, CLIENT_SOCKET_CEILING, Limits, MiB
from deepinfer.protocol.sockets import arecv_msg, asend_msg, make_dealer
from deepinfer.services.router import RouterService
from deepinfer.services.router_core import RouterConfig
from tests.service.test_router_limits import FakeServices

pytestmark = [pytest.mark.mesh, pytest.mark.timeout(300)]

WAIT_S = 60.0
TOKENS = 40  # per innocent stream
_routers = itertools.count()  # each test's router has its own name, so its metrics are its own
UNBOUNDED = Limits(max_payload=64 * MiB, max_frame=64 * MiB, max_total=64 * MiB, max_str_len=64 * MiB)


class RouterUnderTest:
    """A RouterService in this event loop with the fake tokenizer + worker of test_router_limits."""

    def __init__(self, tmp_path: Any, tokens_per_request: int = TOKENS) -> None:
        self.ctx = zmq.asyncio.Context()
        self.front, back = f"ipc://{tmp_path}/front.sock", f"ipc://{tmp_path}/back.sock"
        self.router = RouterService(f"router-{next(_routers)}", self.front, back, self.ctx,
                                    RouterConfig(heartbeat_timeout_s=5.0))
        self.task = asyncio.ensure_future(self.router.run())
        self.fakes = FakeServices(self.ctx, back, tokens_per_request=tokens_per_request)

    async def until_workers_live(self) -> None:
        deadline = time.monotonic() + WAIT_S
        while not (len(self.router.core.table.instances) == 2
                   and all(i.alive for i in self.router.core.table.instances.values())):
            assert time.monotonic() < deadline, "the fake services never joined"
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        self.fakes.close()
        self.router.stop()
        await asyncio.wait([self.task], timeout=WAIT_S)
        self.ctx.destroy(linger=0)


async def collect(sock: Any, ends_expected: int) -> dict[str, list[Any]]:
    """Read replies on a raw client DEALER until `ends_expected` requests ended (RequestFinished/ErrorReply),
    grouped by request id."""
    got: dict[str, list[Any]] = {}
    ended = 0
    while ended < ends_expected:
        assert await sock.poll(WAIT_S * 1000), f"only {ended} of {ends_expected} requests ended: {sorted(got)}"
        msg = await arecv_msg(sock)
        got.setdefault(msg.request_id, []).append(msg)
        ended += isinstance(msg, (m.RequestFinished, m.ErrorReply))
    return got


def stream_request(rid: str) -> m.GenerateRequest:
    return m.GenerateRequest(rid, prompt_token_ids=[5, 6], params=m.SamplingParamsWire(max_tokens=TOKENS),
                             stream=True)


def test_oversized_and_malformed_requests_end_alone_on_a_shared_connection(tmp_path):
    async def run() -> tuple[dict[str, list[Any]], list[int], dict[str, int]]:
        mesh = RouterUnderTest(tmp_path)
        client = make_dealer(mesh.ctx, mesh.front, b"shared-client")
        disconnects: list[int] = []
        monitor = client.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            await mesh.until_workers_live()
            await asend_msg(client, m.Hello(m.PROTOCOL_VERSION, "client", "client"))
            assert await client.poll(WAIT_S * 1000) and (await arecv_msg(client)).accepted
            for i in range(4):  # innocent streams, in flight while the harmful messages arrive
                await asend_msg(client, stream_request(f"innocent-{i}"))
            harmful = [
                m.GenerateRequest("big-3mib", prompt="x" * (3 * MiB)),
                m.GenerateRequest("big-9mib", prompt="x" * (9 * MiB)),
                # 2**64 does not fit msgpack at all (clients refuse it); 2**63 fits msgpack, not the schema.
                m.GenerateRequest("max-tokens-2**63", prompt="hi", params=m.SamplingParamsWire(max_tokens=2**63)),
            ]
            for msg in harmful:
                await client.send_multipart(encode_frames(msg, UNBOUNDED), copy=False)
            malformed = bytes(encode_frames(m.GenerateRequest("malformed", prompt="hi"))[1])
            await client.send_multipart([b"\x10", malformed[:-3] + b"\xc1\xc1\xc1"])  # readable id, broken tail
            await client.send_multipart([b"\x10", b"\xc1 garbage"])  # no request id to be read
            for i in range(4, 6):  # more innocent streams after them, on the same connection
                await asend_msg(client, stream_request(f"innocent-{i}"))
            got = await collect(client, ends_expected=6 + 4 + 1)
            while await monitor.poll(0):
                disconnects.append(1)
                await monitor.recv_multipart()
            body, _ = metrics.exposition()
            refused = {s.labels["code"]: int(s.value) for f in text_string_to_metric_families(body.decode())
                       for s in f.samples if s.name == "deepinfer_router_refused_messages_total"
                       and s.labels["instance"] == mesh.router.instance and s.value}
        finally:
            client.disable_monitor()
            monitor.close(linger=0)
            client.close(linger=0)
            await mesh.close()
        return got, disconnects, refused

    got, disconnects, refused = asyncio.run(run())
    for i in range(6):
        *deltas, final = got[f"innocent-{i}"]
        assert isinstance(final, m.RequestFinished), final
        assert final.token_ids == [7] * TOKENS and [t for d in deltas for t in d.token_ids] == [7] * TOKENS
    for rid in ("big-3mib", "big-9mib"):
        (reply,) = got[rid]
        assert reply.code == "request_too_large" and "payload is" in reply.message, reply
    (reply,) = got["max-tokens-2**63"]
    assert reply.code == "invalid_request" and "max_tokens" in reply.message, reply
    (reply,) = got["malformed"]
    assert reply.code == "invalid_request", reply
    (reply,) = got[""]
    assert reply.code == "bad_message", reply
    assert not disconnects  # the connection, and everything on it, was kept
    assert refused == {"request_too_large": 2, "invalid_request": 2, "bad_message": 1}


def test_a_frame_over_the_socket_ceiling_costs_only_its_own_connection(tmp_path):
    """The memory ceiling: libzmq drops the sender of a frame past CLIENT_SOCKET_CEILING unread (what no client
    of ours sends); another connection's stream is untouched."""
    async def run() -> tuple[dict[str, list[Any]], bool]:
        mesh = RouterUnderTest(tmp_path)
        innocent = make_dealer(mesh.ctx, mesh.front, b"innocent")
        huge = make_dealer(mesh.ctx, mesh.front, b"huge")
        monitor = huge.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            await mesh.until_workers_live()
            await asend_msg(innocent, stream_request("innocent"))
            await huge.send_multipart([b"\x10", bytes(CLIENT_SOCKET_CEILING + 1)], copy=False)
            dropped = bool(await monitor.poll(WAIT_S * 1000))
            got = await collect(innocent, ends_expected=1)
        finally:
            huge.disable_monitor()
            monitor.close(linger=0)
            for s in (innocent, huge):
                s.close(linger=0)
            await mesh.close()
        return got, dropped

    got, dropped = asyncio.run(run())
    assert dropped
    assert got["innocent"][-1].token_ids == [7] * TOKENS


class Flooder(threading.Thread):
    """Its own connection to the front: garbage frames as fast as it can, every 50th message a valid request,
    never reading a reply; until `stop` (or a bound of messages, so a regression cannot spin forever)."""

    MAX_MESSAGES = 2_000_000

    def __init__(self, endpoint: str) -> None:
        super().__init__(name="flooder", daemon=True)
        self.endpoint = endpoint
        self.stop = threading.Event()
        self.sent = 0

    def run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.connect(self.endpoint)
        valid = encode_frames(m.GenerateRequest("flood", prompt_token_ids=[1], params=m.SamplingParamsWire(
            max_tokens=1)), CLIENT_LIMITS)
        garbage = [b"\x10", b"\xc1 not msgpack"]
        try:
            while not self.stop.is_set() and self.sent < self.MAX_MESSAGES:
                sock.send_multipart(valid if self.sent % 50 == 0 else garbage)
                self.sent += 1
        finally:
            sock.close(linger=0)
            ctx.term()


def test_a_flood_at_the_front_starves_neither_the_timer_nor_the_heartbeats(tmp_path):
    async def run() -> tuple[list[tuple[int, bool]], dict[str, list[float]], list[m.RequestFinished], int, int]:
        mesh = RouterUnderTest(tmp_path, tokens_per_request=3)
        router = mesh.router
        ticks: list[tuple[int, bool]] = []  # (malformed so far, every worker alive) at each tick
        beats: dict[str, list[float]] = {}
        tick, on_heartbeat = router.core.tick, router.core.on_heartbeat

        def recording_tick(now: float) -> Any:
            out = tick(now)
            ticks.append((router.malformed, all(i.alive for i in router.core.table.instances.values())))
            return out

        def recording_heartbeat(hb: m.Heartbeat, now: float) -> Any:
            beats.setdefault(hb.instance, []).append(now)
            return on_heartbeat(hb, now)

        router.core.tick, router.core.on_heartbeat = recording_tick, recording_heartbeat
        flooder = Flooder(mesh.front)
        innocent = make_dealer(mesh.ctx, mesh.front, b"innocent")
        served: list[m.RequestFinished] = []
        try:
            await mesh.until_workers_live()
            flooder.start()
            deadline = time.monotonic() + WAIT_S
            # The flood goes on until the timer ticked 10 times in it and the innocent client was served.
            while sum(1 for malformed, _ in ticks if malformed > 0) < 10 or len(served) < 5:
                assert time.monotonic() < deadline, f"ticks during the flood: {ticks[-5:]}, served {len(served)}"
                if len(served) < 5:
                    await asend_msg(innocent, m.GenerateRequest(f"i{len(served)}", prompt_token_ids=[2]))
                    (reply,) = (await collect(innocent, ends_expected=1)).values()
                    served.append(reply[-1])
                else:
                    await asyncio.sleep(0.05)
            malformed_at_stop = router.malformed
        finally:
            flooder.stop.set()
            flooder.join(WAIT_S)
            innocent.close(linger=0)
            await mesh.close()
        return ticks, beats, served, malformed_at_stop, flooder.sent

    ticks, beats, served, malformed, sent = asyncio.run(run())
    print(f"\nflood: {sent} messages sent, {malformed} refused as malformed while it ran, {len(ticks)} ticks")
    for instance, times in sorted(beats.items()):
        gaps = [b - a for a, b in zip(times, times[1:])]
        print(f"heartbeats of {instance}: {len(times)}, largest gap {max(gaps):.3f}s (sent every 0.2s)")
    flood_ticks = [alive for malformed, alive in ticks if malformed > 0]
    assert len(flood_ticks) >= 10  # the timer kept ticking while the flood was being read
    assert all(alive for _, alive in ticks)  # no live worker was declared dead
    assert all(isinstance(r, m.RequestFinished) and r.token_ids == [7] * 3 for r in served)


_FLOOD_THEN_LEAVE = textwrap.dedent("""
    import sys, time, zmq
    from deepinfer.protocol.limits import CLIENT_LIMITS
    from deepinfer.protocol.sockets import BOUND_HEARTBEAT_IVL_MS, make_router
    endpoint = sys.argv[1]
    ctx = zmq.Context()
    front = make_router(ctx, endpoint, limits=CLIENT_LIMITS, bound_heartbeats=False)  # as the router's front
    flooder = ctx.socket(zmq.DEALER)
    flooder.setsockopt(zmq.SNDHWM, 0)
    flooder.connect(endpoint)
    for _ in range(5 * front.getsockopt(zmq.RCVHWM)):  # far past the front's receive queue: its reading stops
        flooder.send_multipart([b"\\x10", b"x" * 100])
    while not front.poll(0):
        time.sleep(0.01)
    time.sleep(0.2)  # the rest reaches the stopped connection
    flooder.close(linger=0)  # and the client leaves while the front is behind
    time.sleep(3 * BOUND_HEARTBEAT_IVL_MS / 1000)  # where a heartbeat timer would abort the process
    read = 0
    while front.poll(100):
        front.recv_multipart()
        read += 1
    print("read", read, flush=True)
    front.close(linger=0)
    ctx.term()
""")


def test_a_client_that_floods_the_front_and_leaves_does_not_abort_the_process(tmp_path):
    done = subprocess.run([sys.executable, "-c", _FLOOD_THEN_LEAVE, f"ipc://{tmp_path}/front.sock"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("read ") and int(done.stdout.split()[1]) > 0
