"""The clients against a fake router over real ZeroMQ sockets (ipc://): one `Client` shared by 16 threads, a
client that stays usable after a timeout or a cancelled stream, and a router that goes away (socket closed, or
process stopped so only heartbeats tell) while requests are in flight, then comes back."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import zmq

from deepinfer import AsyncClient, Client, MeshError, RequestTimeoutError, RouterLostError
from deepinfer.protocol import messages as m
from deepinfer.protocol.sockets import make_router, recv_routed, send_msg

pytestmark = pytest.mark.timeout(180)

WAIT_S = 30.0  # bounds every wait, only so that a broken client fails instead of hanging
REPO = Path(__file__).resolve().parents[2]


class FakeRouter:
    """The router's client front, reduced to what a client sees: Hello → Welcome, and each GenerateRequest
    answered after a random 0-20 ms (so answers leave out of order), echoing prompt_token_ids as token_ids
    (streamed: one StreamDelta per token, then RequestFinished). Prompts steer it:
      "hold"    answered only when the next GenerateRequest arrives, just before that one's answer;
      "ignore"  never answered;
      "trickle" (streamed) one delta now, the rest never (also asked for by the stop string "trickle").
    A ResumeRequest is answered with Resumed and the echo's rest (past the tokens the client had); `resumed`
    queues its (request id, tokens the client had).
    `received` and `aborted` queue the ids of GenerateRequests and AbortRequests as they arrive."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.received: queue.Queue[str] = queue.Queue()
        self.aborted: queue.Queue[str] = queue.Queue()
        self.resumed: queue.Queue[tuple[str, list[int]]] = queue.Queue()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self.serve, name="fake-router", daemon=True)

    def start(self) -> FakeRouter:
        self._thread.start()
        assert self._ready.wait(WAIT_S)
        return self

    def stop(self) -> None:
        """Closes the socket: connected clients see the connection drop."""
        self._stop.set()
        self._thread.join(WAIT_S)
        assert not self._thread.is_alive()

    def serve(self) -> None:
        ctx = zmq.Context()
        sock = make_router(ctx, self.endpoint)
        self._ready.set()
        rng = random.Random()
        due: list[tuple[float, int, bytes, m.GenerateRequest | m.StreamDelta | m.RequestFinished]] = []
        held: list[tuple[bytes, list]] = []
        order = itertools.count()  # ties in `due` leave in the order they were queued

        def answer(client: bytes, msgs: list, at: float) -> None:
            for msg in msgs:
                heapq.heappush(due, (at, next(order), client, msg))

        try:
            while not self._stop.is_set():
                now = time.monotonic()
                timeout_ms = 10 if not due else max(0, min(10, int((due[0][0] - now) * 1000)))
                if sock.poll(timeout_ms):
                    client, msg = recv_routed(sock)
                    now = time.monotonic()
                    if isinstance(msg, m.Hello):
                        send_msg(sock, m.Welcome(m.PROTOCOL_VERSION, True, service="router"), client)
                    elif isinstance(msg, m.AbortRequest):
                        self.aborted.put(msg.request_id)
                    elif isinstance(msg, m.ResumeRequest):
                        n = len(msg.output_token_ids)
                        self.resumed.put((msg.request_id, msg.output_token_ids))
                        rest = [r for r in echo(msg.request) if not isinstance(r, m.StreamDelta) or r.offset >= n]
                        answer(client, [m.Resumed(msg.request_id, n), *rest], now)
                    elif isinstance(msg, m.GenerateRequest):
                        self.received.put(msg.request_id)
                        for held_client, msgs in held:
                            answer(held_client, msgs, now)
                        held.clear()
                        reply = echo(msg)
                        if msg.prompt == "hold":
                            held.append((client, reply))
                        elif msg.prompt == "trickle" or "trickle" in msg.params.stop:
                            answer(client, reply[:1], now)
                        elif msg.prompt != "ignore":
                            answer(client, reply, now + rng.uniform(0.0, 0.02))
                while due and due[0][0] <= time.monotonic():
                    _, _, client, msg = heapq.heappop(due)
                    try:
                        send_msg(sock, msg, client)
                    except zmq.ZMQError:
                        pass  # that client is gone
        finally:
            sock.close(linger=0)
            ctx.term()


def echo(req: m.GenerateRequest) -> list:
    rid, tokens = req.request_id, list(req.prompt_token_ids or [1, 2, 3])
    done = m.RequestFinished(rid, req.prompt or "", tokens, "stop", m.UsageWire(len(tokens), len(tokens)),
                             m.Timings(0.0))
    if not req.stream:
        return [done]
    return [m.StreamDelta(rid, str(t), [t], offset=i) for i, t in enumerate(tokens)] + [done]


@pytest.fixture
def endpoint() -> Iterator[str]:
    short = tempfile.mkdtemp(prefix="di-client-")  # ipc paths are limited to ~100 bytes: not under tmp_path
    yield f"ipc://{short}/router.sock"
    shutil.rmtree(short, ignore_errors=True)


@pytest.fixture
def router(endpoint: str) -> Iterator[FakeRouter]:
    r = FakeRouter(endpoint).start()
    yield r
    r.stop()


def run_threads(n: int, work) -> None:
    """Run work(i) on n threads started together; re-raise the first failure."""
    errors: list[BaseException] = []
    start = threading.Barrier(n)

    def body(i: int) -> None:
        try:
            start.wait(WAIT_S)
            work(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S * 4)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]


def test_the_package_exports_the_client_without_torch():
    code = ("import sys, deepinfer; deepinfer.Client, deepinfer.AsyncClient, deepinfer.RouterLostError; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=WAIT_S)
    assert issubclass(RouterLostError, MeshError) and RouterLostError.code == "router_lost"


def test_sixteen_threads_share_one_client(router, endpoint):
    rounds = 4
    with Client(endpoint, timeout_s=60) as c:

        def work(t: int) -> None:
            for i in range(rounds):
                base = 1000 * t + 10 * i
                assert c.generate(prompt_token_ids=[base, t]).token_ids == [base, t]
                many = c.generate_many([dict(prompt_token_ids=[base + 1, t, k]) for k in range(4)])
                assert [r.token_ids for r in many] == [[base + 1, t, k] for k in range(4)]
                *deltas, done = c.stream(prompt_token_ids=[base + 2, t, i])
                assert [d.token_ids for d in deltas] == [[base + 2], [t], [i]]
                assert isinstance(done, m.RequestFinished) and done.token_ids == [base + 2, t, i]
                assert {d.request_id for d in deltas} == {done.request_id}

        run_threads(16, work)


def test_bursts_beyond_the_socket_queue_wait_instead_of_failing(router, endpoint):
    """More requests at once than the socket queues (HWM 1000): the rest wait in the client's outbox."""
    n = 2500
    with Client(endpoint, timeout_s=120) as c:
        results = c.generate_many([dict(prompt_token_ids=[k]) for k in range(n)])
        assert [r.token_ids for r in results] == [[k] for k in range(n)]

    async def main() -> None:
        async with AsyncClient(endpoint, timeout_s=120) as c:
            results = await asyncio.gather(*(c.generate(prompt_token_ids=[k]) for k in range(n)))
            assert [r.token_ids for r in results] == [[k] for k in range(n)]
            assert not c._session.routes and not c._session.outbox

    asyncio.run(main())


def test_client_serves_its_next_request_after_a_timeout(router, endpoint):
    with Client(endpoint, timeout_s=60) as c:
        c.timeout_s = 0.3
        with pytest.raises(RequestTimeoutError):
            c.generate(prompt="hold")  # its answer comes back late: just before the next request's
        assert router.aborted.get(timeout=WAIT_S) == router.received.get(timeout=WAIT_S)
        c.timeout_s = 60
        assert [r.token_ids for r in c.generate_many([dict(prompt_token_ids=[4, 5]), dict(prompt_token_ids=[6])])] \
            == [[4, 5], [6]]
        assert c.generate(prompt_token_ids=[7]).token_ids == [7]
        assert [d.token_ids for d in c.stream(prompt_token_ids=[8, 9])][-1] == [8, 9]


def test_async_client_serves_its_next_request_after_a_timeout(router, endpoint):
    async def main() -> None:
        async with AsyncClient(endpoint, timeout_s=60) as c:
            c.timeout_s = 0.3
            with pytest.raises(RequestTimeoutError):
                await c.generate(prompt="hold")
            c.timeout_s = 60
            results = await asyncio.gather(*(c.generate(prompt_token_ids=[k, k + 1]) for k in range(8)))
            assert [r.token_ids for r in results] == [[k, k + 1] for k in range(8)]
            assert not c._session.routes  # nothing kept for requests that ended, the late one included

    asyncio.run(main())


def test_closing_a_stream_early_aborts_it_and_the_client_keeps_working(router, endpoint):
    with Client(endpoint, timeout_s=60) as c:
        stream = c.stream(prompt="trickle", max_tokens=8)
        first = next(stream)
        stream.close()
        assert router.aborted.get(timeout=WAIT_S) == first.request_id
        assert c.generate(prompt_token_ids=[3, 1]).token_ids == [3, 1]


def test_async_stream_left_early_aborts_it(router, endpoint):
    async def main() -> None:
        async with AsyncClient(endpoint, timeout_s=60) as c:
            stream = c.stream(prompt="trickle")
            delta = await anext(stream)
            await stream.aclose()
            assert await asyncio.to_thread(router.aborted.get, timeout=WAIT_S) == delta.request_id
            assert (await c.generate(prompt_token_ids=[2, 2])).token_ids == [2, 2]
            assert not c._session.routes

    asyncio.run(main())


def in_flight_on(c: Client, router: FakeRouter, n: int) -> queue.Queue[BaseException | list]:
    """Start n unanswered requests on c (one stream, the rest in one generate_many); returns where their
    outcomes land once every one of them reached the router."""
    outcomes: queue.Queue[BaseException | list] = queue.Queue()

    def streaming() -> None:
        try:
            outcomes.put(list(c.stream(prompt="ignore")))
        except BaseException as exc:
            outcomes.put(exc)

    def batch() -> None:
        outcomes.put(c.generate_many([dict(prompt="ignore") for _ in range(n - 1)]))

    for fn in (streaming, batch):
        threading.Thread(target=fn, daemon=True).start()
    for _ in range(n):
        router.received.get(timeout=WAIT_S)
    return outcomes


def assert_router_lost(outcomes: queue.Queue[BaseException | list], n: int) -> None:
    got = [outcomes.get(timeout=WAIT_S), outcomes.get(timeout=WAIT_S)]
    flat = [x for o in got for x in (o if isinstance(o, list) else [o])]
    assert len(flat) == n and all(isinstance(x, RouterLostError) for x in flat), flat


def test_requests_fail_when_no_router_comes_back_in_time_and_the_client_reconnects_later(endpoint):
    first = FakeRouter(endpoint).start()
    with Client(endpoint, timeout_s=60, resume_within_s=1.0) as c:
        outcomes = in_flight_on(c, first, 4)
        first.stop()
        assert_router_lost(outcomes, 4)  # long before timeout_s
        second = FakeRouter(endpoint).start()
        try:
            assert c.generate(prompt_token_ids=[9, 9]).token_ids == [9, 9]
            assert [d.token_ids for d in c.stream(prompt_token_ids=[1, 4])][-1] == [1, 4]
        finally:
            second.stop()


def test_a_silent_router_is_noticed_by_heartbeats(endpoint):
    """A stopped process keeps its socket open: only the missing heartbeat replies tell."""
    code = f"from tests.unit.test_client_threads import FakeRouter; FakeRouter({endpoint!r}).serve()"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO)
    try:
        with Client(endpoint, timeout_s=60, connect_timeout_s=2.0, resume_within_s=2.0) as c:
            assert c.generate(prompt_token_ids=[1]).token_ids == [1]
            outcomes: queue.Queue[BaseException | list] = queue.Queue()
            threading.Thread(target=lambda: outcomes.put(c.generate_many([dict(prompt="ignore")] * 3)),
                             daemon=True).start()
            proc.send_signal(signal.SIGSTOP)
            result = outcomes.get(timeout=WAIT_S)
            assert len(result) == 3 and all(isinstance(r, RouterLostError) for r in result), result
            proc.kill()
            proc.wait(WAIT_S)
            router = FakeRouter(endpoint).start()
            try:
                assert c.generate(prompt_token_ids=[5, 3]).token_ids == [5, 3]
            finally:
                router.stop()
    finally:
        proc.kill()
        proc.wait(WAIT_S)


def test_async_requests_fail_when_no_router_comes_back_in_time_and_the_client_reconnects_later(endpoint):
    first = FakeRouter(endpoint).start()

    async def main() -> None:
        async with AsyncClient(endpoint, timeout_s=60, resume_within_s=1.0) as c:
            lost = asyncio.ensure_future(asyncio.gather(*(c.generate(prompt="ignore") for _ in range(3)),
                                                        return_exceptions=True))
            for _ in range(3):
                await asyncio.to_thread(first.received.get, timeout=WAIT_S)
            await asyncio.to_thread(first.stop)
            results = await asyncio.wait_for(lost, WAIT_S)
            assert all(isinstance(r, RouterLostError) for r in results), results
            second = await asyncio.to_thread(FakeRouter(endpoint).start)
            try:
                assert (await c.generate(prompt_token_ids=[6, 1])).token_ids == [6, 1]
                assert not c._session.routes
            finally:
                await asyncio.to_thread(second.stop)

    asyncio.run(main())


def test_no_router_at_all_fails_fast():
    with pytest.raises(RouterLostError):
        Client("ipc:///nonexistent-deepinfer-dir/router.sock", timeout_s=60, connect_timeout_s=0.5)


def test_close_is_idempotent_and_returns_with_the_router_gone(endpoint):
    router = FakeRouter(endpoint).start()
    c = Client(endpoint, timeout_s=60, resume_within_s=1.0)
    waiting = in_flight_on(c, router, 2)
    router.stop()
    assert_router_lost(waiting, 2)
    c.close()
    c.close()
    assert not c._io._thread.is_alive()
    with pytest.raises(MeshError):
        c.generate(prompt_token_ids=[1])


def test_close_fails_the_callers_still_waiting(router, endpoint):
    c = Client(endpoint, timeout_s=60)
    waiting = in_flight_on(c, router, 3)
    c.close()
    got = [waiting.get(timeout=WAIT_S), waiting.get(timeout=WAIT_S)]
    flat = [x for o in got for x in (o if isinstance(o, list) else [o])]
    assert len(flat) == 3 and all(type(x) is MeshError for x in flat), flat
    assert len({router.aborted.get(timeout=WAIT_S) for _ in range(3)}) == 3  # the router was told


def test_async_close_twice_with_the_router_gone(endpoint):
    router = FakeRouter(endpoint).start()

    async def main() -> None:
        c = AsyncClient(endpoint, timeout_s=60)
        await c.connect()
        await asyncio.to_thread(router.stop)
        await c.close()
        await c.close()

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["Client", "AsyncClient"])
def test_streams_go_on_through_a_router_that_goes_and_a_successor(endpoint, kind):
    """A router that leaves mid-stream and a new one on the same endpoint: each stream's caller sees one contiguous
    stream and its end, as if nothing happened; the successor got a ResumeRequest with what each caller had."""
    first = FakeRouter(endpoint).start()
    want = [list(range(10 * i + 1, 10 * i + 6)) for i in range(3)]

    async def consume_async(c: AsyncClient, tokens: list[int]) -> list:
        return [msg async for msg in c.stream(prompt_token_ids=tokens, stop=["trickle"])]

    def consume(c: Client, tokens: list[int]) -> list:
        return list(c.stream(prompt_token_ids=tokens, stop=["trickle"]))

    def restart() -> None:
        for _ in want:
            first.received.get(timeout=WAIT_S)
        time.sleep(0.2)  # the first delta of each reaches its caller
        first.stop()
        second = FakeRouter(endpoint).start()
        try:
            resumed = sorted(second.resumed.get(timeout=WAIT_S)[1] for _ in want)
            assert resumed == [w[:1] for w in want]  # each had its first token
        finally:
            restarted.put(second)

    restarted: queue.Queue[FakeRouter] = queue.Queue()
    helper = threading.Thread(target=restart, daemon=True)
    helper.start()
    if kind == "Client":
        with Client(endpoint, timeout_s=WAIT_S) as c, ThreadPoolExecutor(3) as pool:
            results = list(pool.map(lambda w: consume(c, w), want))
            assert not c._io._session.routes and not c._io._session.received
    else:
        async def main() -> list:
            async with AsyncClient(endpoint, timeout_s=WAIT_S) as c:
                return await asyncio.gather(*(consume_async(c, w) for w in want))

        results = asyncio.run(main())
    helper.join(WAIT_S)
    restarted.get(timeout=WAIT_S).stop()
    for w, msgs in zip(want, results, strict=True):
        *deltas, end = msgs
        assert [d.offset for d in deltas] == list(range(len(w))) and [t for d in deltas for t in d.token_ids] == w
        assert isinstance(end, m.RequestFinished) and end.token_ids == w
