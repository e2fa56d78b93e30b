"""The Starlette application: HTTP in, one shared AsyncClient to the router's frontend out. Thin: every
decision about a body or a response is `openai_requests` / `openai_responses` / `errors`.

The client is made in the app's lifespan, on the event loop that serves requests, and (re)connects in the
background: `/health` answers from the start, `/ready` is 200 only while the router is connected (its Hello
was answered), and generation requests meanwhile get 503. A client that disconnects aborts its mesh requests:
a stream is cancelled by Starlette when the connection drops (leaving `AsyncClient.stream` aborts), a
non-streamed request races its work against the connection's `http.disconnect`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from deepinfer.gateway import openai_responses as out
from deepinfer.gateway.errors import ApiError, from_mesh_error, invalid
from deepinfer.gateway.openai_requests import (
    GenerationPlan,
    ParseContext,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
)
from deepinfer.protocol import messages as m
from deepinfer.protocol.client import AsyncClient, MeshError

log = structlog.get_logger("deepinfer.gateway")

RECONNECT_S = 1.0  # between attempts to reach a router that did not answer the handshake
HANDSHAKE_TIMEOUT_S = 5.0


@dataclass
class Gateway:
    """Everything one gateway process holds: the served model's name, tokenizer and context length, and the
    connection to the router (`client`, None until the router answered). No per-request state outlives it."""

    endpoint: str
    model: str  # the served name clients must give
    tokenizer: Any  # deepinfer.text.tokenizer.Tokenizer (or anything with encode, decode, encode_chat)
    max_model_len: int
    client_options: dict[str, Any] = field(default_factory=dict)  # AsyncClient keyword arguments (CURVE keys)
    request_timeout_s: float = 600.0
    created: int = field(default_factory=out.now)
    client: AsyncClient | None = None

    def __post_init__(self) -> None:
        self.decode_one: Callable[[int], str] = lru_cache(maxsize=1 << 17)(lambda t: self.tokenizer.decode([t]))
        self.parse_context = ParseContext(self.model, self.max_model_len, self._count_chat_tokens)

    def _count_chat_tokens(self, messages: list[dict[str, str]]) -> int:
        try:
            return len(self.tokenizer.encode_chat(messages))
        except Exception:  # the mesh's tokenizer gives the real reason; here it only sizes max_tokens
            return 0

    def decode_all(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    @property
    def ready(self) -> bool:
        # The session's view of the connection (inproc:// counts as always connected).
        return self.client is not None and self.client.connected

    async def connect_forever(self) -> None:
        """Make the shared client once a router answers its Hello; the client then reconnects by itself."""
        while self.client is None:
            client = AsyncClient(self.endpoint, timeout_s=self.request_timeout_s,
                                 connect_timeout_s=HANDSHAKE_TIMEOUT_S, **self.client_options)
            try:
                await client.connect()
            except MeshError as exc:
                log.info("waiting for the router", endpoint=self.endpoint, reason=str(exc))
                await asyncio.sleep(RECONNECT_S)
                continue
            self.client = client
            log.info("connected to the router", endpoint=self.endpoint)

    def require_client(self) -> AsyncClient:
        if self.client is None:
            raise ApiError(503, "the gateway is not connected to the mesh's router yet", "service_unavailable",
                           None, "unavailable")
        return self.client


# --- helpers -------------------------------------------------------------------------------------------------


def _count(endpoint: str, status: int, seconds: float) -> None:
    """deepinfer_http_requests_total{endpoint,status} and the request's duration (to its response's start)."""
    from deepinfer.metrics import record_http_request

    try:
        record_http_request(endpoint, status, seconds)
    except Exception:  # metrics never fail a request
        log.exception("recording the request's metrics failed", endpoint=endpoint)


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def _json(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid(f"the body is not valid JSON: {exc}") from None


def api_key(request: Request) -> str | None:
    """`Authorization: Bearer KEY` selects the tenant (the router maps the key to its cache salt)."""
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


async def _disconnected(request: Request) -> None:
    """Returns once the client's connection is gone (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, Any]) -> tuple[bool, Any]:
    """(True, result) of `work`, or (False, None) if the client left first: `work` is cancelled then."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    return (True, task.result()) if task.done() and not task.cancelled() else (False, None)


async def _all(coros: list[Awaitable[Any]]) -> list[Any]:
    """Every result in order; the first failure cancels the rest (aborting their mesh requests) and raises."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


# --- generation ----------------------------------------------------------------------------------------------


async def _generate(gw: Gateway, request: Request, plan: GenerationPlan) -> Response:
    client = gw.require_client()
    key = api_key(request)
    if plan.stream:
        return await _stream(gw, request, plan, client, key)
    work = _all([client.generate(**r.kwargs(), api_key=key) for r in plan.requests])
    try:
        connected, finished = await _unless_disconnected(request, work)
    except MeshError as exc:
        raise from_mesh_error(exc) from None
    if not connected:
        return Response(status_code=499)  # nobody reads it: the client left and its requests were aborted
    return JSONResponse(out.response(plan, out.response_id(plan), out.now(), finished, gw.decode_one, gw.decode_all))


async def _stream(gw: Gateway, request: Request, plan: GenerationPlan, client: AsyncClient,
                  key: str | None) -> Response:
    """Start every choice's stream; refuse with a proper status if the mesh fails before the first record
    (an overloaded or invalid request), otherwise answer 200 with the SSE stream."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, req: Any) -> None:
        try:
            async for record in client.stream(**req.kwargs(), api_key=key):
                queue.put_nowait((i, record))
        except MeshError as exc:
            queue.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(plan.requests)]

    def cancel() -> None:  # no await: this also runs while the stream is being cancelled
        for t in tasks:
            t.cancel()

    try:
        connected, first = await _unless_disconnected(request, queue.get())
    except BaseException:
        cancel()
        raise
    if not connected:
        cancel()
        return Response(status_code=499)
    if isinstance(first[1], MeshError):
        cancel()
        raise from_mesh_error(first[1])
    return StreamingResponse(_events(gw, plan, queue, first, cancel), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _events(gw: Gateway, plan: GenerationPlan, queue: asyncio.Queue[tuple[int, Any]], first: tuple[int, Any],
                  cancel: Callable[[], None]) -> AsyncIterator[bytes]:
    rid, created = out.response_id(plan), out.now()
    choices = [out.ChoiceStream(plan, rid, created, i, gw.decode_one, gw.decode_all) for i in range(len(plan.requests))]
    finished: list[m.RequestFinished | None] = [None] * len(plan.requests)
    item: tuple[int, Any] | None = first
    try:
        while any(f is None for f in finished):
            i, record = item if item is not None else await queue.get()
            item = None
            if isinstance(record, MeshError):
                yield out.sse(from_mesh_error(record).body())
                break
            if isinstance(record, m.RequestFinished):
                finished[i] = record
                chunks = choices[i].on_finished(record)
            else:
                chunks = choices[i].on_delta(record)
            for chunk in chunks:
                yield out.sse(chunk)
        else:
            if plan.include_usage:
                yield out.sse(out.usage_chunk(plan, rid, created, finished))  # type: ignore[arg-type]
        yield out.DONE
    finally:
        cancel()  # a client that left mid-stream: its requests are aborted


# --- the application -----------------------------------------------------------------------------------------


def build_app(gw: Gateway, on_startup: Callable[[asyncio.AbstractEventLoop], None] | None = None) -> Starlette:
    """The gateway's ASGI app. `on_startup(loop)` runs in the lifespan, on the serving loop (the launcher
    watches its lifeline there)."""

    def endpoint(name: str, handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Any]:
        async def run(request: Request) -> Response:
            start = time.monotonic()
            try:
                response = await handler(request)
            except ApiError as err:
                response = error_response(err)
            except Exception:
                log.exception("internal error", endpoint=name)
                response = error_response(ApiError(500, "internal error in the gateway", "internal_error",
                                                   None, "internal"))
            _count(name, response.status_code, time.monotonic() - start)
            return response

        return run

    async def completions(request: Request) -> Response:
        return await _generate(gw, request, parse_completion(await _json(request), gw.parse_context))

    async def chat(request: Request) -> Response:
        return await _generate(gw, request, parse_chat(await _json(request), gw.parse_context))

    async def models(request: Request) -> Response:
        card = {"id": gw.model, "object": "model", "created": gw.created, "owned_by": "deepinfer",
                "root": gw.model, "max_model_len": gw.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        if gw.ready:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "waiting for the router"}, status_code=503)

    async def tokenize(request: Request) -> Response:
        req = parse_tokenize(await _json(request), gw.parse_context)
        if req.prompt is not None:
            tokens = gw.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            try:
                tokens = gw.tokenizer.encode_chat(req.messages, add_generation_prompt=req.add_generation_prompt)
            except Exception as exc:  # no template, or the template refused the messages
                raise invalid(f"cannot apply the chat template: {exc}", "messages") from None
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": gw.max_model_len})

    async def detokenize(request: Request) -> Response:
        tokens = parse_detokenize(await _json(request), gw.parse_context, gw.tokenizer.vocab_size)
        return JSONResponse({"prompt": gw.decode_all(tokens)})

    async def metrics(request: Request) -> Response:
        from deepinfer.metrics import exposition

        body, content_type = exposition()
        return Response(body, media_type=content_type)

    async def not_found(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        _count("other", status, 0.0)
        message = f"{request.method} {request.url.path} is not a route of this server"
        kind = "invalid_request_error"
        if status == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        return error_response(ApiError(status, message, kind, None, "not_found" if status == 404 else None))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if on_startup is not None:
            on_startup(asyncio.get_running_loop())
        connecting = asyncio.create_task(gw.connect_forever())
        try:
            yield
        finally:
            connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await connecting
            if gw.client is not None:
                await gw.client.close()
                gw.client = None

    routes = [
        Route("/v1/completions", endpoint("/v1/completions", completions), methods=["POST"]),
        Route("/v1/chat/completions", endpoint("/v1/chat/completions", chat), methods=["POST"]),
        Route("/v1/models", endpoint("/v1/models", models), methods=["GET"]),
        Route("/health", endpoint("/health", health), methods=["GET"]),
        Route("/ready", endpoint("/ready", ready), methods=["GET"]),
        Route("/tokenize", endpoint("/tokenize", tokenize), methods=["POST"]),
        Route("/detokenize", endpoint("/detokenize", detokenize), methods=["POST"]),
        Route("/metrics", endpoint("/metrics", metrics), methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found, 405: not_found})
