"""The connection both clients share: `Session`, which knows which request waits where and what the router
connection's ups and downs mean for each (no I/O of its own), and `RouterLink`, the DEALER, its monitor and the
session, whose non-blocking `step` `Client`'s I/O thread and `AsyncClient`'s task both drive.

The rule for a dropped connection lives in `Session.on_disconnected`: replies that reached the socket before the
drop still count, and a generation whose answer had not arrived is resumed, not failed: the session keeps what
each one received, and once a router is connected again (the same one, or its successor) asks it to go on from
there (`ResumeRequest`). The caller sees one stream, contiguous and unchanged. Only a generation that finds no
router within `resume_within_s` of the drop fails (`RouterLostError`), as does a request that finds none within
`connect_timeout_s` of being sent."""

from __future__ import annotations

import itertools
import secrets
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq
from zmq.utils.monitor import parse_monitor_message

from deepinfer.protocol import messages as m
from deepinfer.protocol.auth import ClientAuth, KeyPair, client_identity_prefix
from deepinfer.protocol.client_errors import MeshError, RouterLostError
from deepinfer.protocol.client_requests import encode_request
from deepinfer.protocol.errors import ProtocolError
from deepinfer.protocol.framing import encode_frames
from deepinfer.protocol.sockets import make_dealer, recv_msg

HEARTBEAT_IVL_MS = 1000  # a PING to the router this often
HEARTBEAT_TIMEOUT_MS = 3000  # no traffic from the router for this long: the connection is dropped
HEARTBEAT_TTL_MS = 10000  # the router may drop this client after this long without traffic from it
CONNECT_TIMEOUT_S = 10.0  # how long a request waits for a connection to the router
# How long a generation whose connection dropped waits for a router to resume it on: a restarted router's
# process start (systemd's RestartSec=2 included) on a loaded host, with room to spare.
RESUME_WITHIN_S = 30.0
_CONNECTION_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
TICK_S = 0.2  # how often requests waiting for a connection are checked against their bound
CLOSE_LINGER_MS = 100  # closing gives the aborts of in-flight requests this long to leave
HELLO = ""  # the route of the Hello: its Welcome carries no request id (nor does a refusal of a bad message)


class Ids:
    def __init__(self) -> None:
        self._prefix = secrets.token_hex(4)
        self._n = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}-{next(self._n)}"


def hello() -> m.Hello:
    return m.Hello(m.PROTOCOL_VERSION, "client", "client")


def client_auth(curve_keys: KeyPair | None, server_key: bytes | str | None) -> ClientAuth | None:
    if (curve_keys is None) != (server_key is None):
        raise ValueError("give both curve_keys= and server_key= (or neither)")
    if curve_keys is None or server_key is None:
        return None
    return ClientAuth(curve_keys, server_key.encode() if isinstance(server_key, str) else bytes(server_key))


def open_dealer(ctx: zmq.Context, endpoint: str, auth: ClientAuth | None = None) -> tuple[Any, Any | None]:
    """The client's DEALER and, except on inproc:// (no connection events there), its monitor socket. With
    `auth` (tcp:// only) it authenticates with CURVE under a routing id that starts with its key's prefix."""
    if auth is not None and endpoint.startswith("tcp://"):
        identity = client_identity_prefix(auth.keypair.public) + secrets.token_hex(6)
    else:
        auth, identity = None, f"client-{secrets.token_hex(6)}"
    sock = make_dealer(ctx, [], identity.encode(), auth=auth)  # connected below
    # Options are copied into a connection when it is made, and the monitor must see the first handshake:
    # both are set before connect.
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TTL_MS)
    monitor = None if endpoint.startswith("inproc://") else sock.get_monitor_socket(_CONNECTION_EVENTS)
    try:
        sock.connect(endpoint)
    except BaseException:  # a bad endpoint: leave no socket behind to block the context's term()
        if monitor is not None:
            sock.disable_monitor()
            monitor.close(linger=0)
        sock.close(linger=0)
        raise
    return sock, monitor


# --- the bookkeeping both clients share ------------------------------------------------------------------


@dataclass
class Received:
    """What the caller of one generation has received so far, enough to resume it on another connection.

    `tokens` grows only by contiguous deltas (offset == len(tokens)); while `awaiting` (a ResumeRequest sent,
    its Resumed not yet here) deltas are stale and dropped: the router's catch-up after Resumed covers them."""

    request: m.GenerateRequest
    sent_at: float
    tokens: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[m.LogprobWire] = field(default_factory=list)
    prompt_logprobs: list[m.LogprobWire | None] | None = None
    streamed: bool = False
    awaiting: bool = False

    def accept(self, delta: m.StreamDelta) -> bool:
        """Whether `delta` goes to the caller (and is counted as received)."""
        if self.awaiting or delta.offset != len(self.tokens):
            return False
        self.tokens.extend(delta.token_ids)
        self.text.append(delta.text)
        self.logprobs.extend(delta.logprobs or ())
        if delta.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.streamed = True
        return True

    def resume(self, now: float) -> m.ResumeRequest:
        req = self.request
        return m.ResumeRequest(req.request_id, req, list(self.tokens), "".join(self.text),
                               list(self.logprobs) if req.params.logprobs is not None else None,
                               self.prompt_logprobs, self.streamed, max(0.0, now - self.sent_at))


class Sink(Protocol):
    """Where a request's replies go: a queue.SimpleQueue (Client) or an asyncio.Queue (AsyncClient)."""

    def put_nowait(self, item: Any) -> None: ...


class Session:
    """Which request waits where, and what the connection's ups and downs mean for it. No I/O: the owner
    (Client's I/O thread, AsyncClient's event loop) sends what lands in `outbox`, oldest first.

    Invariant: a route exists exactly while its caller may still get a reply, so a reply without a route (a
    request that finished, timed out, was aborted or failed) is dropped, and nothing outlives its request."""

    def __init__(self, endpoint: str, connect_timeout_s: float, connected: bool,
                 resume_within_s: float = RESUME_WITHIN_S) -> None:
        self.endpoint = endpoint
        self.connect_timeout_s = connect_timeout_s
        self.resume_within_s = resume_within_s
        self.connected = connected  # inproc:// has no connection events: always connected
        self.routes: dict[str, Sink] = {}
        # Requests sent while no router was connected (their messages wait in the socket), with the
        # monotonic time they were sent: they fail if none connects within connect_timeout_s.
        self.unconnected: dict[str, float] = {}
        # Generations whose connection dropped, with the monotonic time it did: resumed on the next connection,
        # failed if none comes within resume_within_s.
        self.resuming: dict[str, float] = {}
        # Messages not yet handed to the socket, in order, with the route they belong to (None for aborts and
        # Hellos). They wait here only while the socket refuses more (its HWM reached).
        self.outbox: deque[tuple[str | None, list]] = deque()
        self.refusal: str | None = None  # the reason a router (after a reconnect) refused our Hello
        self.received: dict[str, Received] = {}  # the generations in flight, by route
        self.resumed = 0  # generations resumed on a new connection
        self.closed = False
        self._was_lost = False
        self.now = 0.0  # the owner's latest monotonic time (set before each step's work, and by open)

    def send(self, msg: Any) -> None:
        self.outbox.append((None, encode_frames(msg)))

    def open(self, key: str, frames: list, sink: Sink, now: float, request: m.GenerateRequest | None = None) -> None:
        """Send a request (or the Hello) whose replies go to `sink`; when it must not be sent, an error does.
        `request`: the GenerateRequest the frames encode, which makes it resumable after a dropped connection."""
        self.now = now
        if self.closed:
            sink.put_nowait(MeshError("the client is closed", key))
        elif self.refusal is not None and key != HELLO:
            sink.put_nowait(MeshError(f"router refused the connection: {self.refusal}", key))
        else:
            self.routes[key] = sink
            if not self.connected:
                self.unconnected[key] = now
            if request is not None:
                self.received[key] = Received(request, now)
            self.outbox.append((key, frames))

    def next_to_send(self) -> list | None:
        """The frames of the oldest message still worth sending: requests nobody waits for are dropped."""
        while self.outbox:
            key, frames = self.outbox[0]
            if key is None or key in self.routes:
                return frames
            self.outbox.popleft()
        return None

    def forget(self, key: str, reason: str) -> None:
        """The caller stopped waiting: abort the request if the router may still hold it."""
        if self.routes.pop(key, None) is not None and key != HELLO:
            self.send(m.AbortRequest(key, reason))
        self.unconnected.pop(key, None)
        self.resuming.pop(key, None)
        self.received.pop(key, None)

    def fail(self, key: str, error: MeshError, abort_reason: str) -> None:
        """End a request with the client's own verdict (the router may hold it: abort it)."""
        sink = self.routes.get(key)
        if sink is not None:
            self.forget(key, abort_reason)
            sink.put_nowait(error)

    def deliver(self, msg: Any) -> None:
        if isinstance(msg, m.Welcome):
            self.refusal = None if msg.accepted else (msg.reason or "no reason given")
        key = getattr(msg, "request_id", HELLO)
        sink = self.routes.get(key)
        if sink is None:
            return  # a late reply to a request given up on, or the Welcome of a reconnect's Hello
        received = self.received.get(key)
        if isinstance(msg, m.Resumed):
            if received is not None:
                received.awaiting = False
            return
        if isinstance(msg, m.StreamDelta) and received is not None and not received.accept(msg):
            return  # stale: the old connection's order, covered by the catch-up after Resumed
        if isinstance(msg, (m.Welcome, m.RequestFinished, m.ErrorReply, m.MeshStatus)):  # its request's last
            del self.routes[key]
            self.unconnected.pop(key, None)
            self.resuming.pop(key, None)
            self.received.pop(key, None)
        sink.put_nowait(msg)

    def on_connected(self) -> None:
        self.connected = True
        self.unconnected.clear()  # their messages are on their way now
        if self._was_lost:
            # A new connection after a lost one may be a new router: introduce ourselves again (it does not
            # require a Hello, but a refusal tells us early that it no longer speaks our protocol).
            self.send(hello())
        for key in list(self.resuming):
            self._resume(key, self.received[key])
        self.resuming.clear()

    def _resume(self, key: str, received: Received) -> None:
        try:
            frames = encode_request(received.resume(self.now))
        except MeshError as exc:  # its output outgrew the client limits: it cannot be resumed
            self.fail(key, RouterLostError(f"lost the connection to the router at {self.endpoint}, and the "
                                           f"request cannot be resumed: {exc}", key), "client lost the router")
            return
        received.awaiting = True
        self.resumed += 1
        self.outbox.append((key, frames))

    def on_disconnected(self, queued_replies: Iterable[Any]) -> None:
        """The connection dropped. Replies that reached the socket before the drop still count: `queued_replies`
        (everything the socket holds now; libzmq queues a connection's last messages before it reports the drop)
        are delivered first. A generation still waiting that was sent on the dropped connection is resumed on
        the next one (it waits for it up to resume_within_s, from now); anything else still waiting fails
        now (its abort waits in the socket for the next connection, in case that is the same router)."""
        for msg in queued_replies:
            self.deliver(msg)
        self.connected = False
        self._was_lost = True
        for key in [key for key in self.routes if key not in self.unconnected and key not in self.resuming]:
            received = self.received.get(key)
            if received is None:
                self.fail(key, RouterLostError(f"lost the connection to the router at {self.endpoint}", key),
                          "client lost the router")
            else:
                received.awaiting = False
                self.resuming[key] = self.now

    def expire(self, now: float) -> None:
        """Fail requests that waited connect_timeout_s for a router, and generations resume_within_s."""
        for key in [key for key, since in self.unconnected.items() if now - since >= self.connect_timeout_s]:
            self.fail(key, RouterLostError(
                f"no router reachable at {self.endpoint} within {self.connect_timeout_s:g}s", key),
                "client found no router")
        for key in [key for key, since in self.resuming.items() if now - since >= self.resume_within_s]:
            self.fail(key, RouterLostError(f"lost the connection to the router at {self.endpoint}, and no router "
                                           f"was reachable within {self.resume_within_s:g}s to resume on", key),
                      "client found no router")

    def close(self) -> None:
        """Fail every waiting caller and abort what the router may hold."""
        for key in list(self.routes):
            self.fail(key, MeshError("the client was closed", key), "client closed")
        self.closed = True


# --- the socket side both clients share ----------------------------------------------------------------


class RouterLink:
    """The client's end of its connection to the router: the DEALER, its monitor and the `Session`. Every method
    is non-blocking. The owner's loop (Client's I/O thread, AsyncClient's task) is the only code that touches
    the sockets: it waits until one may be ready (POLLIN on both, POLLOUT on `sock` while the outbox holds
    something, or `poll_timeout_ms`), then calls `step`. One reader for replies and drops alike is what lets
    `Session.on_disconnected` see every reply that came before a drop."""

    def __init__(self, ctx: zmq.Context, endpoint: str, connect_timeout_s: float,
                 auth: ClientAuth | None = None, resume_within_s: float = RESUME_WITHIN_S) -> None:
        self.sock, self.monitor = open_dealer(ctx, endpoint, auth)
        self.session = Session(endpoint, connect_timeout_s, connected=self.monitor is None,
                               resume_within_s=resume_within_s)

    def step(self, now: float) -> None:
        """Deliver the replies, handle the connection events, fail requests that waited too long for a router,
        and hand the outbox to the socket."""
        self.session.now = now
        for msg in self._queued_replies():
            self.session.deliver(msg)
        self.read_connection_events()
        self.session.expire(now)
        self.flush()

    def poll_timeout_ms(self) -> int | None:
        """How long the owner may wait for the sockets before the next `step`: forever, unless requests wait for a
        router (they are checked against their bound every TICK_S)."""
        return int(TICK_S * 1000) if self.session.unconnected or self.session.resuming else None

    def ready(self) -> bool:
        """A `step` has work now. For an owner that waits on the sockets' file descriptors: those signal a change
        only (edge-triggered) and a step may consume one, so this is asked after every step before waiting."""
        events = self.sock.getsockopt(zmq.EVENTS)
        if events & zmq.POLLIN or (self.session.outbox and events & zmq.POLLOUT):
            return True
        return self.monitor is not None and bool(self.monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def flush(self) -> None:
        """Hand the outbox to the socket; what it refuses (its HWM reached) waits for POLLOUT. While no router is
        connected the socket still takes messages (up to its HWM) and sends them once one is."""
        while (frames := self.session.next_to_send()) is not None:
            try:
                self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.session.outbox.popleft()

    def close(self) -> None:
        """Fail every waiting caller, hand their aborts to the socket and close both sockets."""
        self.session.close()
        self.flush()
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
        # The aborts get a moment to leave, but only while a router is connected: closing never waits for one
        # that is gone.
        self.sock.close(linger=CLOSE_LINGER_MS if self.session.connected else 0)

    def _queued_replies(self) -> Iterator[Any]:
        """The replies the socket holds now, oldest first."""
        while True:
            try:
                yield recv_msg(self.sock, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            except ProtocolError:
                continue  # undecodable: no request id to route it by

    def read_connection_events(self) -> None:
        """Handle the monitor's events. `step` reads the replies first, but a reply may land between the two
        reads: `Session.on_disconnected` takes what the socket holds at the drop either way."""
        while self.monitor is not None:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_DISCONNECTED:
                self.session.on_disconnected(self._queued_replies())
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.session.on_connected()
