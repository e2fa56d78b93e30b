"""The blocking client: `Client`, safe to share between threads, and the I/O thread that owns its socket."""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import zmq

from deepinfer.protocol import messages as m
from deepinfer.protocol.auth import ClientAuth, KeyPair
from deepinfer.protocol.client_errors import InvalidRequestError, MeshError, RequestTimeoutError, error_from_reply
from deepinfer.protocol.client_requests import build_request, encode_request
from deepinfer.protocol.client_session import (
    CONNECT_TIMEOUT_S,
    HELLO,
    RESUME_WITHIN_S,
    Ids,
    RouterLink,
    Sink,
    client_auth,
    hello,
)
from deepinfer.protocol.framing import encode_frames


class _SocketThread:
    """Owns the RouterLink (the DEALER, its monitor and the session); the only thread that touches any of them.
    Callers hand it work through `_call` (a queue, plus a byte on a socket pair that wakes its poll)."""

    def __init__(self, endpoint: str, connect_timeout_s: float, auth: ClientAuth | None = None,
                 resume_within_s: float = RESUME_WITHIN_S) -> None:
        self._ctx = zmq.Context()
        try:
            self._link = RouterLink(self._ctx, endpoint, connect_timeout_s, auth, resume_within_s)
        except BaseException:
            self._ctx.term()
            raise
        self._session = self._link.session
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

    def submit(self, key: str, frames: list, sink: Sink, request: m.GenerateRequest | None = None) -> None:
        if not self._call(self._session.open, key, frames, sink, time.monotonic(), request):
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
        for s in (self._link.monitor, self._wake_r):
            if s is not None:
                poller.register(s, zmq.POLLIN)
        try:
            while not self._stopping:
                # POLLOUT only while the socket refused something: it is writable almost always.
                poller.register(self._link.sock, zmq.POLLIN | (zmq.POLLOUT if self._session.outbox else 0))
                poller.poll(self._link.poll_timeout_ms())
                with contextlib.suppress(BlockingIOError):
                    while self._wake_r.recv(4096):
                        pass
                self._run_inbox()  # after draining the wake bytes: work queued later wakes the next poll
                self._link.step(time.monotonic())
        finally:
            self._shut_down()

    def _shut_down(self) -> None:
        with self._lock:
            self._accepting = False
        self._run_inbox()  # work queued before close still runs (a submit then fails: the session closes)
        self._link.close()
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


class Client:
    """Blocking client; safe to share between threads, each call waiting for its own requests' replies.
    Requests may also overlap within one thread via `generate_many`. A generation whose connection to the router
    drops is resumed on the next one, from what its caller received, when a router (the same or a restarted
    one) is reachable within `resume_within_s` (`client_session`)."""

    def __init__(self, endpoint: str, timeout_s: float = 300.0, api_key: str | None = None, *,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S, curve_keys: KeyPair | None = None,
                 server_key: bytes | str | None = None, resume_within_s: float = RESUME_WITHIN_S) -> None:
        self.timeout_s = timeout_s
        self.api_key = api_key
        self._ids = Ids()
        self._io = _SocketThread(endpoint, connect_timeout_s, client_auth(curve_keys, server_key), resume_within_s)
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
        self._io.submit(HELLO, encode_frames(hello()), sink)
        try:
            reply = self._next(sink, time.monotonic() + self.timeout_s)
        finally:
            self._io.forget(HELLO, "")
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
        self._io.submit(req.request_id, encode_request(req), sink, req)  # one the router would refuse raises here
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
                try:
                    order.append(self._submit(spec, False, sink))
                except InvalidRequestError as exc:  # refused before sending: its own error, in its place
                    order.append(exc.request_id)
                    results[exc.request_id] = exc
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
