"""A router that answers and then leaves at once (a drain, a crash right after its last token): the reply that
reached the client's socket before the connection dropped is delivered, by `Client` and `AsyncClient` alike, and
only a request whose answer never came is lost: a generation waits for a router to resume it on (here none comes
within resume_within_s, so it fails with RouterLostError), anything else fails at once. The rule lives in
`Session.on_disconnected`;
`RouterLink` is the socket side both clients drive. Real ZeroMQ sockets over ipc://; the fake router closes under
control (its socket lingers until the reply has left), and every wait is on a condition."""

from __future__ import annotations

import asyncio
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from deepinfer import AsyncClient, Client, RouterLostError
from deepinfer.protocol import messages as m
from deepinfer.protocol.client_session import RouterLink, Session
from deepinfer.protocol.framing import decode_frames, encode_frames
from deepinfer.protocol.sockets import recv_routed, send_msg

pytestmark = pytest.mark.timeout(120)

WAIT_S = 30.0  # bounds every wait, only so that a broken client fails instead of hanging


def finished(req_id: str) -> m.RequestFinished:
    return m.RequestFinished(req_id, "done", [7], "stop", m.UsageWire(1, 1), m.Timings(0.0))


def request(req_id: str, prompt: str) -> m.GenerateRequest:
    return m.GenerateRequest(req_id, prompt=prompt)


@pytest.fixture
def endpoint() -> Iterator[str]:
    short = tempfile.mkdtemp(prefix="di-drop-")  # ipc paths are limited to ~100 bytes: not under tmp_path
    yield f"ipc://{short}/router.sock"
    shutil.rmtree(short, ignore_errors=True)


class AnswerOneAndLeave:
    """A router thread: Hello → Welcome; once it holds `held` GenerateRequests (then `holding` is set) and `go` is
    set, it answers the one whose prompt is "answer", leaves the others unanswered and closes. Its socket lingers
    until that reply has left (its context's term() returns only then), so the reply is on the client's side of
    the connection before the drop; a client that went away first has no pipe left, so nothing waits for it."""

    def __init__(self, endpoint: str, held: int) -> None:
        self.endpoint, self.held = endpoint, held
        self.holding = threading.Event()
        self.go = threading.Event()
        self._bound = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="answer-one-and-leave", daemon=True)
        self.thread.start()
        assert self._bound.wait(WAIT_S)

    def gone(self) -> bool:
        """Wait until the router has answered and closed."""
        self.thread.join(WAIT_S)
        return not self.thread.is_alive()

    def _serve(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, -1)
        sock.setsockopt(zmq.RCVTIMEO, int(WAIT_S * 1000))  # a client that never sends ends this thread
        sock.bind(self.endpoint)
        self._bound.set()
        requests: list[tuple[bytes, m.GenerateRequest]] = []
        try:
            while len(requests) < self.held:
                client, msg = recv_routed(sock)
                if isinstance(msg, m.Hello):
                    send_msg(sock, m.Welcome(m.PROTOCOL_VERSION, True, service="router"), client)
                elif isinstance(msg, m.GenerateRequest):
                    requests.append((client, msg))
            self.holding.set()
            if self.go.wait(WAIT_S):
                for client, req in requests:
                    if req.prompt == "answer":
                        send_msg(sock, finished(req.request_id), client)
        finally:
            sock.close()
            ctx.term()


def test_a_drop_fails_only_the_requests_whose_answer_never_came() -> None:
    """The rule itself: the replies the socket holds at the drop are delivered first; the rest fail as lost and
    are aborted (in case the same router comes back), the answered one is not; a late answer is dropped."""
    s = Session("ipc://router", connect_timeout_s=WAIT_S, connected=True)
    answered: queue.SimpleQueue = queue.SimpleQueue()
    lost: queue.SimpleQueue = queue.SimpleQueue()
    s.open("a", [], answered, 0.0)
    s.open("b", [], lost, 0.0)
    s.outbox.clear()  # as if sent
    s.on_disconnected([finished("a")])
    assert answered.get_nowait() == finished("a") and answered.empty()
    error = lost.get_nowait()
    assert isinstance(error, RouterLostError) and error.request_id == "b"
    assert not s.routes and not s.connected
    assert [decode_frames(frames) for _, frames in s.outbox] == [m.AbortRequest("b", "client lost the router")]
    s.deliver(finished("b"))  # its answer after the verdict: nobody waits for it
    assert lost.empty()


@pytest.mark.parametrize("drop_first", [False, True], ids=["replies-read-first", "drop-handled-first"])
def test_the_link_delivers_a_reply_queued_before_the_drop(endpoint: str, drop_first: bool) -> None:
    """RouterLink with both the reply and the drop waiting on its sockets, in either order of handling them: the
    order a loop meets them in is chance, the outcome must not be."""
    ctx = zmq.Context()
    router_ctx = zmq.Context()
    router = router_ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, -1)  # the reply leaves before the connection closes
    router.setsockopt(zmq.RCVTIMEO, int(WAIT_S * 1000))
    router.bind(endpoint)
    link = RouterLink(ctx, endpoint, connect_timeout_s=WAIT_S)
    try:
        answered: queue.SimpleQueue = queue.SimpleQueue()
        lost: queue.SimpleQueue = queue.SimpleQueue()
        link.session.open("a", encode_frames(request("a", "answer")), answered, time.monotonic())
        link.session.open("b", encode_frames(request("b", "hold")), lost, time.monotonic())
        link.step(time.monotonic())
        clients = {recv_routed(router)[0] for _ in range(2)}  # the router holds both
        while not link.session.connected:  # its handshake event is queued by now
            assert link.monitor.poll(WAIT_S * 1000)
            link.step(time.monotonic())
        send_msg(router, finished("a"), clients.pop())
        router.close()
        router_ctx.term()  # returns once the reply has been written and the connection closed
        assert link.monitor.poll(WAIT_S * 1000)  # the drop is queued, after the reply (libzmq reports it last)
        if drop_first:
            link.read_connection_events()
        link.step(time.monotonic())
        assert answered.get_nowait() == finished("a") and answered.empty()
        error = lost.get_nowait()
        assert isinstance(error, RouterLostError) and error.request_id == "b"
        assert not link.session.routes
    finally:
        link.close()
        ctx.term()


def test_client_delivers_the_reply_that_came_before_the_router_left(endpoint: str) -> None:
    router = AnswerOneAndLeave(endpoint, held=2)
    router.go.set()
    with Client(endpoint, timeout_s=WAIT_S, resume_within_s=1.0) as c:
        done, error = c.generate_many([dict(prompt="answer"), dict(prompt="hold")])
        assert isinstance(done, m.RequestFinished) and done.text == "done", done
        assert isinstance(error, RouterLostError), error
    assert router.gone()


def test_async_client_delivers_the_reply_that_came_before_the_router_left(endpoint: str) -> None:
    router = AnswerOneAndLeave(endpoint, held=2)

    async def main() -> None:
        async with AsyncClient(endpoint, timeout_s=WAIT_S, resume_within_s=1.0) as c:
            answered = asyncio.ensure_future(c.generate(prompt="answer"))
            lost = asyncio.ensure_future(c.generate(prompt="hold"))
            assert await asyncio.to_thread(router.holding.wait, WAIT_S)
            # The loop is held (no await) while the router answers and goes: when it runs again the reply and
            # the drop both wait for the client, in whatever order its tasks meet them.
            router.go.set()
            assert router.gone()
            done, error = await asyncio.gather(answered, lost, return_exceptions=True)
            assert isinstance(done, m.RequestFinished) and done.text == "done", done
            assert isinstance(error, RouterLostError), error
            assert not c._session.routes

    asyncio.run(main())


def delta(req_id: str, offset: int, *tokens: int) -> m.StreamDelta:
    return m.StreamDelta(req_id, "".join(f"<{t}>" for t in tokens), list(tokens), offset)


def test_a_dropped_generation_is_resumed_on_the_next_connection_from_what_its_caller_received() -> None:
    """A generation (opened with its GenerateRequest) survives the drop: on the next connection the session asks
    for it again with the tokens and text its caller got; deltas are stale until Resumed, then contiguous."""
    s = Session("ipc://router", connect_timeout_s=WAIT_S, connected=True)
    sink: queue.SimpleQueue = queue.SimpleQueue()
    req = m.GenerateRequest("g", prompt="p", stream=True)
    s.open("g", [], sink, 1.0, req)
    s.outbox.clear()
    for d in (delta("g", 0, 5, 6), delta("g", 2, 7)):
        s.deliver(d)
    s.now = 4.0
    s.on_disconnected([delta("g", 3, 8)])  # a reply queued before the drop still counts
    assert [sink.get_nowait() for _ in range(3)] == [delta("g", 0, 5, 6), delta("g", 2, 7), delta("g", 3, 8)]
    assert "g" in s.routes and not s.outbox  # not failed, and nothing to send until a router is there
    s.now = 5.5
    s.on_connected()
    [hello, resume] = [decode_frames(frames) for _, frames in s.outbox]
    assert isinstance(hello, m.Hello)
    assert resume == m.ResumeRequest("g", req, [5, 6, 7, 8], "<5><6><7><8>", None, None, True, 4.5)
    s.deliver(delta("g", 4, 9))  # the old connection's order: stale until Resumed
    s.deliver(m.Resumed("g", 4))
    s.deliver(delta("g", 5, 10))  # a gap: never handed on
    s.deliver(delta("g", 4, 9))
    s.deliver(finished("g"))
    assert [sink.get_nowait() for _ in range(2)] == [delta("g", 4, 9), finished("g")] and sink.empty()
    assert not s.routes and not s.received and s.resumed == 1


def test_a_dropped_generation_fails_when_no_router_comes_within_resume_within_s() -> None:
    s = Session("ipc://router", connect_timeout_s=0.5, connected=True, resume_within_s=2.0)
    sink: queue.SimpleQueue = queue.SimpleQueue()
    s.open("g", [], sink, 0.0, m.GenerateRequest("g", prompt="p"))
    s.outbox.clear()
    s.now = 10.0
    s.on_disconnected([])
    s.expire(11.9)
    assert sink.empty()
    s.expire(12.0)
    error = sink.get_nowait()
    assert isinstance(error, RouterLostError) and "within 2s to resume on" in str(error)
    assert not s.routes and not s.received
    assert [decode_frames(frames) for _, frames in s.outbox] == [m.AbortRequest("g", "client found no router")]


def test_a_resume_over_the_client_limits_fails_its_request_only() -> None:
    """A generation whose output no longer fits a client message cannot be resumed: it fails, typed; the other
    one is resumed."""
    s = Session("ipc://router", connect_timeout_s=WAIT_S, connected=True)
    big, small = queue.SimpleQueue(), queue.SimpleQueue()
    s.open("big", [], big, 0.0, m.GenerateRequest("big", prompt="p", stream=True))
    s.open("small", [], small, 0.0, m.GenerateRequest("small", prompt="p", stream=True))
    s.outbox.clear()
    s.deliver(m.StreamDelta("big", "x" * (3 << 20), [1], 0))
    s.on_disconnected([])
    s.on_connected()
    assert isinstance(big.get_nowait(), m.StreamDelta)
    error = big.get_nowait()
    assert isinstance(error, RouterLostError) and "cannot be resumed" in str(error)
    sent = [decode_frames(frames) for _, frames in s.outbox]
    assert [type(x) for x in sent] == [m.Hello, m.AbortRequest, m.ResumeRequest] and sent[2].request_id == "small"
