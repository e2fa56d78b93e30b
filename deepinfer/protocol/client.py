"""The ZeroMQ client: `Client` (blocking) and `AsyncClient` (asyncio).

    with Client("ipc:///run/deepinfer/router-frontend.sock") as c:
        r = c.generate("Hello", max_tokens=16)
        print(r.text, r.finish_reason, r.usage.cached_tokens, r.timings.ttft_s)

    async with AsyncClient(endpoint) as c:
        async for delta in c.stream(messages=[{"role": "user", "content": "Hi"}], max_tokens=32):
            print(delta.text, end="")

Cancelling a stream (breaking out of it, or cancelling its task) or closing the client aborts the
request in the mesh. Failures raise a `MeshError` subclass that names what went wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import fields
from typing import Any

import zmq
import zmq.asyncio

from deepinfer.protocol import messages as m
from deepinfer.protocol.sockets import arecv_msg, asend_msg, make_dealer, recv_msg, send_msg


class MeshError(RuntimeError):
    """A request ended with an error. `code` is the wire ErrorCode."""

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


class RequestTimeoutError(MeshError):
    code = "timeout"


_ERRORS = {cls.code: cls for cls in (OverloadedError, InvalidRequestError, WorkerLostError, RequestTimeoutError)}


def error_from_reply(reply: m.ErrorReply) -> MeshError:
    cls = _ERRORS.get(reply.code, MeshError)
    return cls(f"{reply.code}: {reply.message}", reply.request_id, reply.retry_after_s)


_PARAM_NAMES = {f.name for f in fields(m.SamplingParamsWire)}


def build_request(request_id: str, prompt: str | None, messages: list[dict[str, str]] | None,
                  prompt_token_ids: list[int] | None, stream: bool, priority: int, api_key: str | None,
                  timeout_s: float | None, params: dict[str, Any]) -> m.GenerateRequest:
    unknown = set(params) - _PARAM_NAMES
    if unknown:
        raise TypeError(f"unknown sampling parameters: {sorted(unknown)}")
    if sum(x is not None for x in (prompt, messages, prompt_token_ids)) != 1:
        raise ValueError("give exactly one of prompt, messages or prompt_token_ids")
    return m.GenerateRequest(request_id, prompt, messages, prompt_token_ids, m.SamplingParamsWire(**params),
                             stream, priority, api_key, timeout_s)


class _Ids:
    def __init__(self) -> None:
        self._prefix = secrets.token_hex(4)
        self._n = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}-{next(self._n)}"


class Client:
    """Blocking client; one socket, one thread. Requests may overlap via `generate_many`."""

    def __init__(self, endpoint: str, timeout_s: float = 300.0, api_key: str | None = None) -> None:
        self._ctx = zmq.Context()
        self._sock = make_dealer(self._ctx, endpoint, f"client-{secrets.token_hex(6)}".encode())
        self.timeout_s = timeout_s
        self.api_key = api_key
        self._ids = _Ids()
        send_msg(self._sock, m.Hello(m.PROTOCOL_VERSION, "client", "client"))
        welcome = self._recv(time.monotonic() + timeout_s)
        if not isinstance(welcome, m.Welcome) or not welcome.accepted:
            raise MeshError(f"router refused the connection: {getattr(welcome, 'reason', welcome)}")

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()

    def _recv(self, deadline: float) -> Any:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not self._sock.poll(int(remaining * 1000)):
            raise RequestTimeoutError(f"no answer from the router within {self.timeout_s}s")
        return recv_msg(self._sock)

    def generate(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
                 prompt_token_ids: list[int] | None = None, priority: int = 0, **params: Any) -> m.RequestFinished:
        [result] = self.generate_many([dict(prompt=prompt, messages=messages, prompt_token_ids=prompt_token_ids,
                                            priority=priority, **params)])
        if isinstance(result, MeshError):
            raise result
        return result

    def generate_many(self, requests: list[dict[str, Any]]) -> list[m.RequestFinished | MeshError]:
        """Submit every request at once (served by continuous batching); results in input order."""
        order: list[str] = []
        for spec in requests:
            spec = dict(spec)
            rid = self._ids.next()
            req = build_request(rid, spec.pop("prompt", None), spec.pop("messages", None),
                                spec.pop("prompt_token_ids", None), False, spec.pop("priority", 0), self.api_key,
                                spec.pop("timeout_s", None), spec)
            send_msg(self._sock, req)
            order.append(rid)
        results: dict[str, m.RequestFinished | MeshError] = {}
        deadline = time.monotonic() + self.timeout_s
        try:
            while len(results) < len(order):
                msg = self._recv(deadline)
                if isinstance(msg, m.RequestFinished):
                    results[msg.request_id] = msg
                elif isinstance(msg, m.ErrorReply):
                    results[msg.request_id] = error_from_reply(msg)
        except BaseException:
            for rid in order:
                if rid not in results:
                    send_msg(self._sock, m.AbortRequest(rid, "client gave up"))
            raise
        return [results[rid] for rid in order]

    def stream(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
               prompt_token_ids: list[int] | None = None, priority: int = 0,
               **params: Any) -> Iterator[m.StreamDelta | m.RequestFinished]:
        """Yield StreamDelta records, then the RequestFinished. Closing the iterator early aborts."""
        rid = self._ids.next()
        send_msg(self._sock, build_request(rid, prompt, messages, prompt_token_ids, True, priority, self.api_key,
                                           params.pop("timeout_s", None), params))
        done = False
        try:
            deadline = time.monotonic() + self.timeout_s
            while True:
                msg = self._recv(deadline)
                if getattr(msg, "request_id", None) != rid:
                    continue
                if isinstance(msg, m.ErrorReply):
                    done = True
                    raise error_from_reply(msg)
                # Ended before the caller sees the last message: a caller that stops iterating there must
                # not abort a request that already finished.
                done = isinstance(msg, m.RequestFinished)
                yield msg
                if done:
                    return
        finally:
            if not done and not self._sock.closed:
                send_msg(self._sock, m.AbortRequest(rid, "client cancelled the stream"))


class AsyncClient:
    """asyncio client: any number of concurrent requests over one socket."""

    def __init__(self, endpoint: str, timeout_s: float = 300.0, api_key: str | None = None,
                 ctx: zmq.asyncio.Context | None = None) -> None:
        # inproc:// endpoints only connect within one context: pass the mesh's to talk to an in-process mesh.
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.asyncio.Context()
        self._sock = make_dealer(self._ctx, endpoint, f"client-{secrets.token_hex(6)}".encode())
        self.timeout_s = timeout_s
        self.api_key = api_key
        self._ids = _Ids()
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._welcome: asyncio.Future[m.Welcome] | None = None

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        self._welcome = asyncio.get_running_loop().create_future()
        self._reader = asyncio.create_task(self._read())
        await asend_msg(self._sock, m.Hello(m.PROTOCOL_VERSION, "client", "client"))
        welcome = await asyncio.wait_for(self._welcome, self.timeout_s)
        if not welcome.accepted:
            raise MeshError(f"router refused the connection: {welcome.reason}")

    async def close(self) -> None:
        for rid in list(self._queues):
            await asend_msg(self._sock, m.AbortRequest(rid, "client closed"))
        if self._reader is not None:
            self._reader.cancel()
        self._sock.close(linger=0)
        if self._own_ctx:
            self._ctx.term()

    async def _read(self) -> None:
        while True:
            msg = await arecv_msg(self._sock)
            if isinstance(msg, m.Welcome):
                if self._welcome is not None and not self._welcome.done():
                    self._welcome.set_result(msg)
                continue
            q = self._queues.get(getattr(msg, "request_id", ""))
            if q is not None:
                q.put_nowait(msg)

    async def stream(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
                     prompt_token_ids: list[int] | None = None, priority: int = 0,
                     **params: Any) -> AsyncIterator[m.StreamDelta | m.RequestFinished]:
        """Yield StreamDelta records, then the RequestFinished. Leaving early or cancelling aborts."""
        req = build_request(self._ids.next(), prompt, messages, prompt_token_ids, True, priority, self.api_key,
                            params.pop("timeout_s", None), params)
        async with contextlib.aclosing(self._exchange(req)) as exchange:
            async for msg in exchange:
                yield msg

    async def generate(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
                       prompt_token_ids: list[int] | None = None, priority: int = 0,
                       **params: Any) -> m.RequestFinished:
        req = build_request(self._ids.next(), prompt, messages, prompt_token_ids, False, priority, self.api_key,
                            params.pop("timeout_s", None), params)
        async with contextlib.aclosing(self._exchange(req)) as exchange:
            async for msg in exchange:
                if isinstance(msg, m.RequestFinished):
                    return msg
        raise MeshError("the router ended the request without a result", req.request_id)

    async def _exchange(self, req: m.GenerateRequest) -> AsyncIterator[m.StreamDelta | m.RequestFinished]:
        rid = req.request_id
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[rid] = q
        done = False
        try:
            await asend_msg(self._sock, req)
            while True:
                msg = await asyncio.wait_for(q.get(), self.timeout_s)
                if isinstance(msg, m.ErrorReply):
                    done = True
                    raise error_from_reply(msg)
                done = isinstance(msg, m.RequestFinished)  # before the yield: the caller may stop there
                yield msg
                if done:
                    return
        except TimeoutError as exc:
            raise RequestTimeoutError(f"request {rid}: no answer within {self.timeout_s}s", rid) from exc
        finally:
            self._queues.pop(rid, None)
            if not done and not self._sock.closed:
                await asend_msg(self._sock, m.AbortRequest(rid, "client cancelled the request"))
