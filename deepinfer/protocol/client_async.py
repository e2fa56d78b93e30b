"""The asyncio client: `AsyncClient`, any number of concurrent requests over one socket on one event loop."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from deepinfer.protocol import messages as m
from deepinfer.protocol.auth import KeyPair
from deepinfer.protocol.client_errors import MeshError, RequestTimeoutError, error_from_reply
from deepinfer.protocol.client_requests import build_request
from deepinfer.protocol.client_session import (
    CLOSE_LINGER_MS,
    CONNECT_TIMEOUT_S,
    HELLO,
    TICK_S,
    Ids,
    Session,
    client_auth,
    hello,
    open_dealer,
)
from deepinfer.protocol.errors import ProtocolError
from deepinfer.protocol.framing import encode_frames
from deepinfer.protocol.sockets import arecv_msg


class AsyncClient:
    """asyncio client: any number of concurrent requests over one socket, all on one event loop."""

    def __init__(self, endpoint: str, timeout_s: float = 300.0, api_key: str | None = None,
                 ctx: zmq.asyncio.Context | None = None, *, connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 curve_keys: KeyPair | None = None, server_key: bytes | str | None = None) -> None:
        # inproc:// endpoints only connect within one context: pass the mesh's to talk to an in-process mesh.
        auth = client_auth(curve_keys, server_key)  # before any resource: a bad pair leaves nothing to close
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.asyncio.Context()
        try:
            self._sock, self._monitor = open_dealer(self._ctx, endpoint, auth)
        except BaseException:
            if self._own_ctx:
                self._ctx.term()
            raise
        self._session = Session(endpoint, connect_timeout_s, connected=self._monitor is None)
        self._outbox_ready = asyncio.Event()  # set when the session's outbox got something to send
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
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._flush())]
        if self._monitor is not None:
            self._tasks += [asyncio.create_task(self._watch_connection()), asyncio.create_task(self._expire())]
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
        self._sock.close(linger=CLOSE_LINGER_MS if self._session.connected else 0)
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
            await asyncio.sleep(TICK_S)
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
