"""The ZeroMQ client: `Client` (blocking, safe to share between threads) and `AsyncClient` (asyncio).

    with Client("ipc:///run/deepinfer/router-frontend.sock") as c:
        r = c.generate("Hello", max_tokens=16)
        print(r.text, r.finish_reason, r.usage.cached_tokens, r.timings.ttft_s)

    async with AsyncClient(endpoint) as c:
        async for delta in c.stream(messages=[{"role": "user", "content": "Hi"}], max_tokens=32):
            print(delta.text, end="")

Both talk to the router over one DEALER socket and route replies to their requests by request id. In
`Client` one I/O thread owns that socket; the threads calling `generate`, `generate_many` and `stream`
hand it their requests and each wait on a queue of their own, so any number of threads may share a client.

Cancelling a stream (breaking out of it, or cancelling its task) or closing the client aborts the
request in the mesh. Replies to requests the client gave up on (timed out, aborted) are dropped, so a
client stays usable after any failure. Failures raise a `MeshError` subclass that names what went wrong.

The router's liveness: ZMTP heartbeats on the socket and a socket monitor. When the connection to the router
drops (its process died, or it stopped answering heartbeats for HEARTBEAT_TIMEOUT_MS) every request the router
held ends with `RouterLostError`; a request sent while no router is connected waits `connect_timeout_s` for
one. The socket reconnects by itself, says Hello again, and the same client serves new requests.

A router whose tcp:// front is secured (CURVE, see `protocol.auth`) takes tenants with a listed key only:
pass `curve_keys=` (this tenant's KeyPair) and `server_key=` (the router's public key), e.g. both from
`load_client_keys(keys_dir)`. The client's routing id then starts with its key's prefix, which the router checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import secrets
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import fields
from functools import partial
from typing import Any, Protocol

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from deepinfer.protocol import messages as m
from deepinfer.protocol.auth import ClientAuth, KeyPair, client_identity_prefix
from deepinfer.protocol.errors import ProtocolError
from deepinfer.protocol.framing import encode_frames
from deepinfer.protocol.sockets import arecv_msg, make_dealer, recv_msg

HEARTBEAT_IVL_MS = 1000  # a PING to the router this often
HEARTBEAT_TIMEOUT_MS = 3000  # no traffic from the router for this long: the connection is dropped
HEARTBEAT_TTL_MS = 10000  # the router may drop this client after this long without traffic from it
CONNECT_TIMEOUT_S = 10.0  # how long a request waits for a connection to the router
_CONNECTION_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
_TICK_S = 0.2  # how often requests waiting for a connection are checked against connect_timeout_s
_CLOSE_LINGER_MS = 100  # closing gives the aborts of in-flight requests this long to leave
_HELLO = ""  # the route of the Hello: its Welcome carries no request id (nor does a refusal of a bad message)


class MeshError(RuntimeError):
    """A request ended with an error. `code` is the wire ErrorCode (or "router_lost")."""

    code = "internal"

    def __init__(self, message: str, request_id: str = "", retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.retry_after_s = retry_after_s


class OverloadedError(MeshError):
    code = "overloaded"


class InvalidRequestError(MeshError):
    code = "invalid_request"


class WorkerLostError(MeshError):
    code = "worker_lost"


class UnauthorizedError(MeshError):
    """The router requires an api_key and the request's is unknown or missing."""

    code = "unauthorized"


class UnavailableError(MeshError):
    """No live worker or tokenizer could take the request (the mesh is starting or lost them); retry later."""

    code = "unavailable"


class RequestTimeoutError(MeshError):
    code = "timeout"


class RouterLostError(MeshError):
    """The connection to the router dropped while it held the request, or no router was reachable."""

    code = "router_lost"


_ERRORS = {cls.code: cls for cls in (OverloadedError, InvalidRequestError, WorkerLostError, RequestTimeoutError,
                                      UnauthorizedError, UnavailableError)}


def error_from_reply(reply: m.ErrorReply) -> MeshError:
    cls = _ERRORS.get(reply.code, MeshError)
    return cls(f"{reply.code}: {reply.message}", reply.request_id, reply.retry_after_s)


_PARAM_NAMES = {f.name for f in fields(m.SamplingParamsWire)}


def build_request(request_id: str, prompt: str | None, messages: list[dict[str, str]] | None,
                  prompt_token_ids: list[int] | None, stream: bool, priority: int, api_key: str | None,
                  timeout_s: float | None, params: dict[str, Any]) -> m.GenerateRequest:
    """The GenerateRequest for these arguments; `params` are SamplingParamsWire's fields. `logit_bias` may be a
    mapping {token id: bias} (int keys, or str keys of digits as in OpenAI's JSON) or (token id, bias) pairs;
    it goes on the wire as pairs. Values are range-checked by the router, not here."""
    unknown = set(params) - _PARAM_NAMES
    if unknown:
        raise TypeError(f"unknown sampling parameters: {sorted(unknown)}")
    if sum(x is not None for x in (prompt, messages, prompt_token_ids)) != 1:
        raise ValueError("give exactly one of prompt, messages or prompt_token_ids")
    if params.get("logit_bias") is not None:
        params = {**params, "logit_bias": logit_bias_pairs(params["logit_bias"])}
    elif "logit_bias" in params:
        params = {k: v for k, v in params.items() if k != "logit_bias"}
    return m.GenerateRequest(request_id, prompt, messages, prompt_token_ids, m.SamplingParamsWire(**params),
                             stream, priority, api_key, timeout_s)


def logit_bias_pairs(bias: Mapping[int | str, float] | Iterable[tuple[int, float]]) -> list[tuple[int, float]]:
    """logit_bias as the wire carries it: (token id, bias) pairs. Keys of a mapping may be ints or str of
    digits (OpenAI's JSON); a key that is neither, or a value that is no number, raises ValueError. Ranges are
    the router's to check."""
    items = bias.items() if isinstance(bias, Mapping) else bias
    out: list[tuple[int, float]] = []
    for key, value in items:
        if isinstance(key, str):
            if not key.strip().lstrip("-").isdigit():
                raise ValueError(f"logit_bias key {key!r:.40} is not a token id")
            key = int(key)
        if not isinstance(key, int) or isinstance(key, bool):
            raise ValueError(f"logit_bias key {key!r:.40} is not a token id")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"logit_bias[{key}] = {value!r:.40} is not a number")
        out.append((key, float(value)))
    return out


class _Ids:
    def __init__(self) -> None:
        self._prefix = secrets.token_hex(4)
        self._n = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}-{next(self._n)}"


def _hello() -> m.Hello:
    return m.Hello(m.PROTOCOL_VERSION, "client", "client")


def _client_auth(curve_keys: KeyPair | None, server_key: bytes | str | None) -> ClientAuth | None:
    if (curve_keys is None) != (server_key is None):
        raise ValueError("give both curve_keys= and server_key= (or neither)")
    if curve_keys is None or server_key is None:
        return None
    return ClientAuth(curve_keys, server_key.encode() if isinstance(server_key, str) else bytes(server_key))


def _open_dealer(ctx: zmq.Context, endpoint: str, auth: ClientAuth | None = None) -> tuple[Any, Any | None]:
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


class _Sink(Protocol):
    """Where a request's replies go: a queue.SimpleQueue (Client) or an asyncio.Queue (AsyncClient)."""

    def put_nowait(self, item: Any) -> None: ...


class _Session:
    """Which request waits where, and what the connection's ups and downs mean for it. No I/O: the owner
    (Client's I/O thread, AsyncClient's event loop) sends what lands in `outbox`, oldest first.

    Invariant: a route exists exactly while its caller may still get a reply, so a reply without a route (a
    request that finished, timed out, was aborted or failed) is dropped, and nothing outlives its request."""

    def __init__(self, endpoint: str, connect_timeout_s: float, connected: bool) -> None:
        self.endpoint = endpoint
        self.connect_timeout_s = connect_timeout_s
        self.connected = connected  # inproc:// has no connection events: always connected
        self.routes: dict[str, _Sink] = {}
        # Requests sent while no router was connected (their messages wait in the socket), with the
        # monotonic time they were sent: they fail if none connects within connect_timeout_s.
        self.unconnected: dict[str, float] = {}
        # Messages not yet handed to the socket, in order, with the route they belong to (None for aborts and
        # Hellos). They wait here only while the socket refuses more (its HWM reached).
        self.outbox: deque[tuple[str | None, list]] = deque()
        self.refusal: str | None = None  # the reason a router (after a reconnect) refused our Hello
        self.closed = False
        self._was_lost = False

    def send(self, msg: Any) -> None:
        self.outbox.append((None, encode_frames(msg)))

    def open(self, key: str, frames: list, sink: _Sink, now: float) -> None:
        """Send a request (or the Hello) whose replies go to `sink`; when it must not be sent, an error does."""
        if self.closed:
            sink.put_nowait(MeshError("the client is closed", key))
        elif self.refusal is not None and key != _HELLO:
            sink.put_nowait(MeshError(f"router refused the connection: {self.refusal}", key))
        else:
            self.routes[key] = sink
            if not self.connected:
                self.unconnected[key] = now
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
        if self.routes.pop(key, None) is not None and key != _HELLO:
            self.send(m.AbortRequest(key, reason))
        self.unconnected.pop(key, None)

    def fail(self, key: str, error: MeshError, abort_reason: str) -> None:
        """End a request with the client's own verdict (the router may hold it: abort it)."""
        sink = self.routes.get(key)
        if sink is not None:
            self.forget(key, abort_reason)
            sink.put_nowait(error)

    def deliver(self, msg: Any) -> None:
        if isinstance(msg, m.Welcome):
            self.refusal = None if msg.accepted else (msg.reason or "no reason given")
        key = getattr(msg, "request_id", _HELLO)
        sink = self.routes.get(key)
        if sink is None:
            return  # a late reply to a request given up on, or the Welcome of a reconnect's Hello
        if isinstance(msg, (m.Welcome, m.RequestFinished, m.ErrorReply)):  # the last message of its request
            del self.routes[key]
            self.unconnected.pop(key, None)
        sink.put_nowait(msg)

    def on_connected(self) -> None:
        self.connected = True
        self.unconnected.clear()  # their messages are on their way now
        if self._was_lost:
            # A new connection after a lost one may be a new router: introduce ourselves again (it does not
            # require a Hello, but a refusal tells us early that it no longer speaks our protocol).
            self.send(_hello())

    def on_disconnected(self) -> None:
        """The router held every request sent on the dropped connection: they fail now. Their aborts wait in
        the socket for the next connection, in case that is the same router."""
        self.connected = False
        self._was_lost = True
        for key in [key for key in self.routes if key not in self.unconnected]:
            self.fail(key, RouterLostError(f"lost the connection to the router at {self.endpoint}", key),
                      "client lost the router")

    def expire(self, now: float) -> None:
        """Fail requests that waited connect_timeout_s for a router."""
        for key in [key for key, since in self.unconnected.items() if now - since >= self.connect_timeout_s]:
            self.fail(key, RouterLostError(
                f"no router reachable at {self.endpoint} within {self.connect_timeout_s:g}s", key),
                "client found no router")

    def close(self) -> None:
        """Fail every waiting caller and abort what the router may hold."""
        for key in list(self.routes):
            self.fail(key, MeshError("the client was closed", key), "client closed")
        self.closed = True


# --- the blocking client ------------------------------------------------------------------------------------


class _SocketThread:
    """Owns the DEALER, its monitor and the session; the only thread that touches any of them. Callers hand it
    work through `_call` (a queue, plus a byte on a socket pair that wakes its poll)."""

    def __init__(self, endpoint: str, connect_timeout_s: float, auth: ClientAuth | None = None) -> None:
        self._ctx = zmq.Context()
        try:
            self._sock, self._monitor = _open_dealer(self._ctx, endpoint, auth)
        except BaseException:
            self._ctx.term()
            raise
        self._session = _Session(endpoint, connect_timeout_s, connected=self._monitor is None)
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._lock = threading.RLock()  # guards _accepting and the write end of the wake pair
        self._accepting = True  # False once the thread is past taking work: _call refuses
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="deepinfer-client-io", daemon=True)
        self._thread.start()

    # -- called from any thread --

    def submit(self, key: str, frames: list, sink: _Sink) -> None:
        if not self._call(self._session.open, key, frames, sink, time.monotonic()):
            sink.put_nowait(MeshError("the client is closed", key))

    def forget(self, key: str, reason: str) -> None:
        self._call(self._session.forget, key, reason)  # refused once closed: closing aborted everything

    def close(self) -> None:
        with self._lock:
            self._stopping = True
            self._wake()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10.0)

    def _call(self, fn: Callable[..., None], *args: Any) -> bool:
        with self._lock:
            if not self._accepting:
                return False
            self._inbox.put(partial(fn, *args))
            self._wake()
            return True

    def _wake(self) -> None:
        if self._accepting:
            with contextlib.suppress(BlockingIOError):  # a full pipe wakes the thread just as well
                self._wake_w.send(b"\0")

    # -- the I/O thread --

    def _run(self) -> None:
        poller = zmq.Poller()
        for s in (self._monitor, self._wake_r):
            if s is not None:
                poller.register(s, zmq.POLLIN)
        try:
            while not self._stopping:
                # POLLOUT only while the socket refused something: it is writable almost always.
                poller.register(self._sock, zmq.POLLIN | (zmq.POLLOUT if self._session.outbox else 0))
                poller.poll(int(_TICK_S * 1000) if self._session.unconnected else None)
                with contextlib.suppress(BlockingIOError):
                    while self._wake_r.recv(4096):
                        pass
                self._run_inbox()  # after draining the wake bytes: work queued later wakes the next poll
                self._read_replies()
                self._read_monitor()
                self._session.expire(time.monotonic())
                self._flush()
        finally:
            self._shut_down()

    def _shut_down(self) -> None:
        with self._lock:
            self._accepting = False
        self._run_inbox()  # work queued before close still runs (a submit then fails: the session closes)
        self._session.close()
        self._flush()
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
        # The aborts just flushed get a moment to leave, but only while a router is connected: closing never
        # waits for one that is gone.
        self._sock.close(linger=_CLOSE_LINGER_MS if self._session.connected else 0)
        self._ctx.term()
        self._wake_r.close()
        self._wake_w.close()

    def _run_inbox(self) -> None:
        while True:
            try:
                fn = self._inbox.get_nowait()
            except queue.Empty:
                return
            fn()

    def _read_monitor(self) -> None:
        while self._monitor is not None:
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_DISCONNECTED:
                self._read_replies()  # replies that arrived before the drop still count
                self._session.on_disconnected()
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._session.on_connected()

    def _read_replies(self) -> None:
        while True:
            try:
                msg = recv_msg(self._sock, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            except ProtocolError:
                continue  # undecodable: no request id to route it by
            self._session.deliver(msg)

    def _flush(self) -> None:
        """Hand the outbox to the socket without blocking; what it refuses waits for POLLOUT. While no router is
        connected the socket still takes messages (up to its HWM) and sends them once one is."""
        while (frames := self._session.next_to_send()) is not None:
            try:
                self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._session.outbox.popleft()


class Client:
    """Blocking client; safe to share between threads, each call waiting for its own requests' replies.
    Requests may also overlap within one thread via `generate_many`."""

    def __init__(self, endpoint: str, timeout_s: float = 300.0, api_key: str | None = None, *,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S, curve_keys: KeyPair | None = None,
                 server_key: bytes | str | None = None) -> None:
        self.timeout_s = timeout_s
        self.api_key = api_key
        self._ids = _Ids()
        self._io = _SocketThread(endpoint, connect_timeout_s, _client_auth(curve_keys, server_key))
        # A client dropped without close() still stops its thread and frees its sockets.
        self._close = weakref.finalize(self, self._io.close)
        try:
            welcome = self._exchange_hello()
        except BaseException:
            self.close()
            raise
        if not welcome.accepted:
            self.close()
            raise MeshError(f"router refused the connection: {welcome.reason}")

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Abort what is in flight (callers waiting get a MeshError) and free the socket; idempotent."""
        self._close()

    def _exchange_hello(self) -> m.Welcome:
        sink: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._io.submit(_HELLO, encode_frames(_hello()), sink)
        try:
            reply = self._next(sink, time.monotonic() + self.timeout_s)
        finally:
            self._io.forget(_HELLO, "")
        if isinstance(reply, MeshError):
            raise reply
        if isinstance(reply, m.ErrorReply):
            raise error_from_reply(reply)
        return reply

    def _next(self, sink: queue.SimpleQueue[Any], deadline: float) -> Any:
        """The next item in the caller's sink: a reply, or a MeshError the client itself decided on (router lost,
        client closed) whose request_id names the request."""
        try:
            return sink.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise RequestTimeoutError(f"no answer from the router within {self.timeout_s}s") from None

    def _submit(self, spec: dict[str, Any], stream: bool, sink: queue.SimpleQueue[Any]) -> str:
        spec = dict(spec)
        api_key = spec.pop("api_key", None) or self.api_key
        req = build_request(self._ids.next(), spec.pop("prompt", None), spec.pop("messages", None),
                            spec.pop("prompt_token_ids", None), stream, spec.pop("priority", 0), api_key,
                            spec.pop("timeout_s", None), spec)
        self._io.submit(req.request_id, encode_frames(req), sink)  # encoded here: a bad request raises here
        return req.request_id

    def generate(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
                 prompt_token_ids: list[int] | None = None, priority: int = 0, api_key: str | None = None,
                 **params: Any) -> m.RequestFinished:
        """One request; `api_key` (this request's tenant) overrides the client's own."""
        [result] = self.generate_many([dict(prompt=prompt, messages=messages, prompt_token_ids=prompt_token_ids,
                                            priority=priority, api_key=api_key, **params)])
        if isinstance(result, MeshError):
            raise result
        return result

    def generate_many(self, requests: list[dict[str, Any]]) -> list[m.RequestFinished | MeshError]:
        """Submit every request at once (served by continuous batching); results in input order, a failed
        request's MeshError in its place. Raises RequestTimeoutError when not all finished within timeout_s.
        Each dict holds generate's keywords (an `api_key` in one overrides the client's for that request)."""
        sink: queue.SimpleQueue[Any] = queue.SimpleQueue()
        order: list[str] = []
        results: dict[str, m.RequestFinished | MeshError] = {}
        try:
            for spec in requests:
                order.append(self._submit(spec, False, sink))
            deadline = time.monotonic() + self.timeout_s
            while len(results) < len(order):
                item = self._next(sink, deadline)
                if isinstance(item, (m.RequestFinished, MeshError)):
                    results[item.request_id] = item
                elif isinstance(item, m.ErrorReply):
                    results[item.request_id] = error_from_reply(item)
        finally:
            for rid in order:
                if rid not in results:
                    self._io.forget(rid, "client gave up")
        return [results[rid] for rid in order]

    def stream(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
               prompt_token_ids: list[int] | None = None, priority: int = 0, api_key: str | None = None,
               **params: Any) -> Iterator[m.StreamDelta | m.RequestFinished]:
        """Yield StreamDelta records, then the RequestFinished. Closing the iterator early aborts. `api_key`
        (this request's tenant) overrides the client's own."""
        sink: queue.SimpleQueue[Any] = queue.SimpleQueue()
        rid = self._submit(dict(prompt=prompt, messages=messages, prompt_token_ids=prompt_token_ids,
                                priority=priority, api_key=api_key, **params), True, sink)
        try:
            deadline = time.monotonic() + self.timeout_s
            while True:
                msg = self._next(sink, deadline)
                if isinstance(msg, MeshError):
                    raise msg
                if isinstance(msg, m.ErrorReply):
                    raise error_from_reply(msg)
                yield msg
                if isinstance(msg, m.RequestFinished):
                    return
        finally:
            # Aborts only if the request is still open: one that finished (even if the caller stopped at its
            # last message) or failed has no route left.
            self._io.forget(rid, "client cancelled the stream")


# --- the asyncio client -------------------------------------------------------------------------------------


class AsyncClient:
    """asyncio client: any number of concurrent requests over one socket, all on one event loop."""

    def __init__(self, endpoint: str, timeout_s: float = 300.0, api_key: str | None = None,
                 ctx: zmq.asyncio.Context | None = None, *, connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 curve_keys: KeyPair | None = None, server_key: bytes | str | None = None) -> None:
        # inproc:// endpoints only connect within one context: pass the mesh's to talk to an in-process mesh.
        auth = _client_auth(curve_keys, server_key)  # before any resource: a bad pair leaves nothing to close
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.asyncio.Context()
        try:
            self._sock, self._monitor = _open_dealer(self._ctx, endpoint, auth)
        except BaseException:
            if self._own_ctx:
                self._ctx.term()
            raise
        self._session = _Session(endpoint, connect_timeout_s, connected=self._monitor is None)
        self._outbox_ready = asyncio.Event()  # set when the session's outbox got something to send
        self.timeout_s = timeout_s
        self.api_key = api_key
        self._ids = _Ids()
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def connected(self) -> bool:
        """A router is connected and accepted our Hello (an inproc:// endpoint counts as always connected).
        Requests sent while this is False wait for a router until their connect timeout."""
        return not self._closed and self._session.connected and self._session.refusal is None

    async def connect(self) -> None:
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._flush())]
        if self._monitor is not None:
            self._tasks += [asyncio.create_task(self._watch_connection()), asyncio.create_task(self._expire())]
        try:
            async with contextlib.aclosing(self._exchange(_HELLO, _hello())) as exchange:
                welcome = await anext(exchange)
            if not welcome.accepted:
                raise MeshError(f"router refused the connection: {welcome.reason}")
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Abort what is in flight (waiting requests get a MeshError) and free the socket; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._session.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        while (frames := self._session.next_to_send()) is not None:  # the aborts, as far as the socket takes them
            try:
                await self._sock.send_multipart(frames, flags=zmq.DONTWAIT, copy=False)
            except zmq.Again:
                break
            self._session.outbox.popleft()
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
        # The aborts get a moment to leave, but only while a router is connected: closing never waits for one
        # that is gone.
        self._sock.close(linger=_CLOSE_LINGER_MS if self._session.connected else 0)
        if self._own_ctx:
            self._ctx.term()

    def _kick(self) -> None:
        """Call after anything that may have put messages in the session's outbox."""
        if self._session.outbox:
            self._outbox_ready.set()

    async def _flush(self) -> None:
        """The one sender: sends wait while the socket refuses more (its HWM reached), as backpressure."""
        while True:
            await self._outbox_ready.wait()
            self._outbox_ready.clear()
            while (frames := self._session.next_to_send()) is not None:
                await self._sock.send_multipart(frames, copy=False)
                self._session.outbox.popleft()

    async def _read(self) -> None:
        while True:
            try:
                msg = await arecv_msg(self._sock)
            except ProtocolError:
                continue  # undecodable: no request id to route it by
            self._session.deliver(msg)

    async def _watch_connection(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self._session.on_disconnected()
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._session.on_connected()
            self._kick()

    async def _expire(self) -> None:
        while True:
            await asyncio.sleep(_TICK_S)
            self._session.expire(time.monotonic())
            self._kick()

    async def stream(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
                     prompt_token_ids: list[int] | None = None, priority: int = 0, api_key: str | None = None,
                     **params: Any) -> AsyncIterator[m.StreamDelta | m.RequestFinished]:
        """Yield StreamDelta records, then the RequestFinished. Leaving early or cancelling aborts. `api_key`
        (this request's tenant) overrides the client's own."""
        req = build_request(self._ids.next(), prompt, messages, prompt_token_ids, True, priority,
                            api_key or self.api_key, params.pop("timeout_s", None), params)
        async with contextlib.aclosing(self._exchange(req.request_id, req)) as exchange:
            async for msg in exchange:
                yield msg

    async def generate(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
                       prompt_token_ids: list[int] | None = None, priority: int = 0, api_key: str | None = None,
                       **params: Any) -> m.RequestFinished:
        """One request; `api_key` (this request's tenant) overrides the client's own."""
        req = build_request(self._ids.next(), prompt, messages, prompt_token_ids, False, priority,
                            api_key or self.api_key, params.pop("timeout_s", None), params)
        async with contextlib.aclosing(self._exchange(req.request_id, req)) as exchange:
            async for msg in exchange:
                if isinstance(msg, m.RequestFinished):
                    return msg
        raise MeshError("the router ended the request without a result", req.request_id)

    async def _exchange(self, key: str, msg: Any) -> AsyncIterator[Any]:
        """Send `msg` and yield its replies until the last; each must come within timeout_s."""
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._session.open(key, encode_frames(msg), q, time.monotonic())  # a request that cannot be encoded raises
        self._kick()
        try:
            while True:
                try:
                    reply = await asyncio.wait_for(q.get(), self.timeout_s)
                except TimeoutError as exc:
                    raise RequestTimeoutError(f"request {key}: no answer within {self.timeout_s}s", key) from exc
                if isinstance(reply, MeshError):
                    raise reply
                if isinstance(reply, m.ErrorReply):
                    raise error_from_reply(reply)
                yield reply
                if isinstance(reply, (m.RequestFinished, m.Welcome)):
                    return
        finally:
            # Aborts only if the request is still open (finished and failed ones have no route left). No await
            # here: this runs on cancellation too.
            self._session.forget(key, "client cancelled the request")
            self._kick()
