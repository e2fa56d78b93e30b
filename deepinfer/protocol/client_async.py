"""The asyncio client: `AsyncClient`, any number of concurrent requests over one socket on one event loop."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from deepinfer.protocol import messages as m
from deepinfer.protocol.auth import KeyPair
from deepinfer.protocol.client_errors import MeshError, RequestTimeoutError, error_from_reply
from deepinfer.protocol.client_requests import build_request, encode_request
from deepinfer.protocol.client_session import (
    CONNECT_TIMEOUT_S,
    HELLO,
    RESUME_WITHIN_S,
    Ids,
    RouterLink,
    client_auth,
    hello,
)


class AsyncClient:
    """asyncio client: any number of concurrent requests over one socket, all on one event loop. A generation
    whose connection to the router drops is resumed on the next one, from what its caller received, when a
    router (the same or a restarted one) is reachable within `resume_within_s` (`client_session`)."""

    def __init__(self, endpoint: str, timeout_s: float = 300.0, api_key: str | None = None,
                 ctx: zmq.asyncio.Context | None = None, *, connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 curve_keys: KeyPair | None = None, server_key: bytes | str | None = None,
                 resume_within_s: float = RESUME_WITHIN_S) -> None:
        # inproc:// endpoints only connect within one context: pass the mesh's to talk to an in-process mesh.
        auth = client_auth(curve_keys, server_key)  # before any resource: a bad pair leaves nothing to close
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.asyncio.Context()
        try:
            # Plain (blocking-kind) sockets on the same context, used only non-blocking by one task (`_pump`):
            # one reader for replies and connection events alike, and no asyncio socket futures holding a reply.
            self._link = RouterLink(zmq.Context.shadow(self._ctx.underlying), endpoint, connect_timeout_s, auth,
                                    resume_within_s)
        except BaseException:
            if self._own_ctx:
                self._ctx.term()
            raise
        self._session = self._link.session
        self._wake = asyncio.Event()  # set when the sockets may be ready or the session's outbox got something
        self.timeout_s = timeout_s
        self.api_key = api_key
        self._ids = Ids()
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
        self._tasks = [asyncio.create_task(self._pump())]
        try:
            async with contextlib.aclosing(self._exchange(HELLO, hello())) as exchange:
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
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._link.close()  # fails the waiting requests, hands the socket their aborts (as far as it takes them)
        if self._own_ctx:
            self._ctx.term()

    def _kick(self) -> None:
        """Call after anything that may have put messages in the session's outbox."""
        if self._session.outbox:
            self._wake.set()

    async def _pump(self) -> None:
        """The one task that touches the sockets, as Client's I/O thread does: it steps the link whenever a
        socket's file descriptor signals, `_kick` wakes it, or (while requests wait for a router) a tick passed.
        Sends wait in the outbox while the socket refuses more (its HWM reached), as backpressure."""
        loop = asyncio.get_running_loop()
        fds = [s.getsockopt(zmq.FD) for s in (self._link.sock, self._link.monitor) if s is not None]
        for fd in fds:
            loop.add_reader(fd, self._wake.set)
        try:
            while True:
                self._wake.clear()
                self._link.step(time.monotonic())
                if self._link.ready():  # the descriptors signal changes only: more came during the step
                    await asyncio.sleep(0)  # let the callers take what was delivered
                    continue
                timeout_ms = self._link.poll_timeout_ms()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(None if timeout_ms is None else timeout_ms / 1000):
                        await self._wake.wait()
        finally:
            for fd in fds:
                loop.remove_reader(fd)

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

    async def mesh_status(self) -> m.MeshStatus:
        """Ask the router whether a request sent now would be served (`MeshStatus.servable`, else `reason`).
        Raises MeshError as a request would (no router within the connect timeout, the connection lost)."""
        rid = self._ids.next()
        async with contextlib.aclosing(self._exchange(rid, m.MeshQuery(rid))) as exchange:
            async for msg in exchange:
                if isinstance(msg, m.MeshStatus):
                    return msg
        raise MeshError("the router ended the question without an answer", rid)

    async def _exchange(self, key: str, msg: Any) -> AsyncIterator[Any]:
        """Send `msg` and yield its replies until the last; each must come within timeout_s."""
        q: asyncio.Queue[Any] = asyncio.Queue()
        frames = encode_request(msg)  # refused before sending: a typed error
        self._session.open(key, frames, q, time.monotonic(), msg if isinstance(msg, m.GenerateRequest) else None)
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
                if isinstance(reply, (m.RequestFinished, m.Welcome, m.MeshStatus)):
                    return
        finally:
            # Aborts only if the request is still open (finished and failed ones have no route left). No await
            # here: this runs on cancellation too.
            self._session.forget(key, "client cancelled the request")
            self._kick()
