"""The Starlette application: HTTP in, a few AsyncClients to the router's frontend out (`router_pool`). Thin:
every decision about a body or a response is `json_body` / `openai_requests` / `openai_responses` /
`errors`; the connection-level bounds are `http_protocol`'s.

The clients are made in the app's lifespan, on the event loop that serves requests, and (re)connect in the
background: `/health` answers from the start (the process is up), `/ready` is 200 only while a request sent now
is served: the gateway is not draining and the router, asked at each probe (`RouterPool.servable`), has a
tokenizer and the workers a request needs alive; until then generation requests may get 503.

No request can harm another's:
* bodies are read under `limits.max_body_bytes` (413 as soon as passed) and parsed within JSON depth and
  64-bit integers (400); a POST asks for at most `max_sequences` choices; prompts are bounded before any
  tokenising; big bodies are parsed, templated, tokenised and answered on `offload`'s bounded threads, so
  the loop that reads every stream's replies never stalls on one request;
* every error of a request's producers reaches its consumer: a stream's pump forwards any exception (a
  request the wire cannot carry is a 400, never a hang), a non-streamed request maps it (never a 500);
* a stream whose HTTP client stops reading holds at most `max_stream_backlog` records (the consumer takes
  each before the next is queued, so only a write waiting on the client lets them pile up): past that its
  mesh requests are aborted alone (counted as `slow_client`), and the connection is reset once writes
  stall for `write_stall_timeout_s` (`http_protocol`);
* a client that disconnects aborts its mesh requests: a stream is cancelled when the connection drops
  (leaving `AsyncClient.stream` aborts), a non-streamed request races its work against `http.disconnect`;
* when the mesh requires API keys, every route but the probes (`/health`, `/ready`) requires a known key
  (checked here against the topology's tenants: a stranger never reaches the router or the tokenizer);
* draining (SIGTERM to the gateway process): new generation requests get 503 with Retry-After, `/ready`
  says 503, the streams in flight finish, then `on_drained` stops the server.
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
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from deepinfer.gateway import openai_responses as out
from deepinfer.gateway.errors import ApiError, from_exception, invalid, unavailable
from deepinfer.gateway.json_body import parse_json, read_body
from deepinfer.gateway.limits import HttpLimits
from deepinfer.gateway.offload import Offload
from deepinfer.gateway.openai_requests import (
    GenerationPlan,
    ParseContext,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
)
from deepinfer.gateway.router_pool import RouterPool
from deepinfer.gateway.text_work import TextWork
from deepinfer.gateway.tool_formats import tool_format_for
from deepinfer.protocol import messages as m
from deepinfer.protocol.client import AsyncClient

log = structlog.get_logger("deepinfer.gateway")

OFFLOAD_BYTES = 16 * 1024  # bodies up to this are parsed on the loop (well under a millisecond)
OFFLOAD_RESPONSE_ENTRIES = 8192  # non-streamed responses with more tokens (× logprobs) are built off the loop
PROBES = ("/health", "/ready")  # open without an API key: load balancers probe them
DRAIN_RETRY_AFTER_S = 5


@dataclass
class Gateway:
    """Everything one gateway process holds: the served model's name, tokenizer and context length, its
    bounds, the mesh's API keys when it knows them, and the connections to the router. No per-request
    state outlives a request."""

    endpoint: str
    model: str  # the served name clients must give
    tokenizer: Any  # deepinfer.text.tokenizer.Tokenizer (or anything with encode, decode, encode_chat)
    max_model_len: int
    client_options: dict[str, Any] = field(default_factory=dict)  # AsyncClient keyword arguments (CURVE keys)
    request_timeout_s: float = 600.0
    limits: HttpLimits = field(default_factory=HttpLimits)
    # With `require_api_key` (the mesh requires keys) every route but the probes needs a key, one of
    # `tenant_keys` (the topology's router tenants) when known. Without, keys go to the router as given.
    tenant_keys: frozenset[str] | None = None
    require_api_key: bool = False
    created: int = field(default_factory=out.now)

    def __post_init__(self) -> None:
        self.text = TextWork(self.tokenizer, self.max_model_len)
        self.decode_one: Callable[[int], str] = lru_cache(maxsize=1 << 17)(lambda t: self.tokenizer.decode([t]))
        self.parse_context = ParseContext(self.model, self.max_model_len, self._count_chat_tokens,
                                          self.limits.max_sequences, self.text.max_prompt_chars,
                                          tool_format_for(getattr(self.tokenizer, "chat_template", None)),
                                          self._render_chat)
        self.routers = RouterPool(self.endpoint, self.limits.router_connections, self.request_timeout_s,
                                  self.client_options)
        self.offload = Offload(self.limits.offload_threads, self.limits.max_offload_waiting)
        self.draining = False
        self._active = 0  # generation requests answering (a stream until its last event)
        self._idle = asyncio.Event()
        self._idle.set()

    def _count_chat_tokens(self, messages: list[dict[str, str]]) -> int:
        try:
            return len(self.text.encode_chat(messages))
        except Exception:  # the mesh's tokenizer gives the real reason; here it only sizes max_tokens
            return 0

    def _render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        return self.text.encode_chat(messages, tools=tools)

    def decode_all(self, ids: list[int]) -> str:
        return self.text.decode(ids)

    def require_client(self) -> AsyncClient:
        client = self.routers.pick()
        if client is None:
            raise unavailable("the gateway is not connected to the mesh's router yet")
        return client

    # --- API keys ---

    def tenant_key(self, request: Request) -> str | None:
        """The key a request's mesh requests carry, after the gateway's own check (401 when refused)."""
        key = api_key(request)
        if self.require_api_key and (key is None or (self.tenant_keys is not None and key not in self.tenant_keys)):
            raise ApiError(401, "a valid API key is required (Authorization: Bearer KEY)", "authentication_error",
                           None, "unauthorized", {"WWW-Authenticate": "Bearer"}, cause="unauthorized")
        return key

    # --- draining ---

    def lease(self) -> Callable[[], None]:
        """Count a generation request as answering until the returned release (idempotent) is called."""
        if self.draining:
            raise unavailable("the gateway is shutting down: retry on another", "draining", DRAIN_RETRY_AFTER_S)
        self._active += 1
        self._idle.clear()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._active -= 1
                if not self._active:
                    self._idle.set()

        return release

    def begin_drain(self, on_drained: Callable[[], None], timeout_s: float) -> None:
        """Refuse new generation requests and say not ready; once those answering are done (or after
        `timeout_s`), call `on_drained`. Call on the serving loop."""
        if self.draining:
            return
        self.draining = True
        log.info("draining", answering=self._active)

        async def drain() -> None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), timeout_s)
            on_drained()

        self._drain_task = asyncio.ensure_future(drain())

    async def run_cpu(self, big: bool, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the offload threads when `big`, else here."""
        return await self.offload.run(fn, *args) if big else fn(*args)


# --- helpers -------------------------------------------------------------------------------------------------


def _count(endpoint: str, status: int, seconds: float) -> None:
    """deepinfer_http_requests_total{endpoint,status} and the request's duration (to its response's start)."""
    from deepinfer.metrics import record_http_request

    try:
        record_http_request(endpoint, status, seconds)
    except Exception:  # metrics never fail a request
        log.exception("recording the request's metrics failed", endpoint=endpoint)


def count_refusal(cause: str) -> None:
    """deepinfer_http_refusals_total{cause}."""
    from deepinfer.metrics import record_http_refusal

    try:
        record_http_refusal(cause)
    except Exception:  # metrics never fail a request
        log.exception("recording a refusal failed", cause=cause)


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _render(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


async def _parsed(gw: Gateway, request: Request, parse: Callable[[Any], Any]) -> Any:
    """The body read under the size limit, parsed as JSON within the depth and integer bounds, then by
    `parse`: off the loop when the body is big."""
    raw = await read_body(request, gw.limits.max_body_bytes)
    depth = gw.limits.max_json_depth
    return await gw.run_cpu(len(raw) > OFFLOAD_BYTES, lambda: parse(parse_json(raw, depth)))


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


async def _generate(gw: Gateway, request: Request, parse: Callable[[Any, ParseContext], GenerationPlan]) \
        -> Response:
    key = gw.tenant_key(request)
    release = gw.lease()
    response: Response | None = None
    try:
        plan = await _parsed(gw, request, lambda body: parse(body, gw.parse_context))
        client = gw.require_client()
        response = await (_stream(gw, request, plan, client, key, release) if plan.stream
                          else _unary(gw, request, plan, client, key))
        return response
    finally:
        if not isinstance(response, _EventStream):  # a stream releases it once its last event is sent
            release()


async def _unary(gw: Gateway, request: Request, plan: GenerationPlan, client: AsyncClient,
                 key: str | None) -> Response:
    work = _all([client.generate(**r.kwargs(), api_key=key) for r in plan.requests])
    try:
        connected, finished = await _unless_disconnected(request, work)
    except Exception as exc:  # the mesh's errors, and a request the wire cannot carry
        raise from_exception(exc) from None
    if not connected:
        return Response(status_code=499)  # nobody reads it: the client left and its requests were aborted

    def build() -> bytes:
        return _render(out.response(plan, out.response_id(plan), out.now(), finished, gw.decode_one,
                                    gw.decode_all))

    entries = sum(len(f.token_ids) + len(f.prompt_token_ids or ()) for f in finished) * (1 + (plan.logprobs or 0))
    big = entries > OFFLOAD_RESPONSE_ENTRIES  # never refused for being busy: the mesh's work is done
    body = await gw.offload.run(build, refuse_when_busy=False) if big else build()
    return Response(body, media_type="application/json")


class _SlowClient:
    """A stream's marker: its client stopped reading and its backlog passed the bound."""


class _EventStream(StreamingResponse):
    """An SSE response that calls `on_close` however it ends: finished, failed, or cancelled before its
    body was ever iterated (a generator that never started would run no `finally`)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _stream(gw: Gateway, request: Request, plan: GenerationPlan, client: AsyncClient, key: str | None,
                  release: Callable[[], None]) -> Response:
    """Start every choice's stream; refuse with a proper status if the mesh fails before the first record
    (an overloaded or invalid request, or one the wire cannot carry), otherwise answer 200 with the SSE
    stream. Every pump forwards whatever ends it to the queue: no stream waits forever on an error."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    backlog = gw.limits.max_stream_backlog
    tasks: list[asyncio.Task[None]] = []
    slow = False  # the backlog passed its bound once: the stream is being ended

    def cancel() -> None:  # no await: this also runs while the stream is being cancelled
        for t in tasks:
            if t is not asyncio.current_task():
                t.cancel()

    async def pump(i: int, req: Any) -> None:
        nonlocal slow
        try:
            async with contextlib.aclosing(client.stream(**req.kwargs(), api_key=key)) as records:
                async for record in records:
                    if queue.qsize() >= backlog:  # the HTTP client is not reading: abort this stream alone
                        if not slow:
                            slow = True
                            count_refusal("slow_client")
                            log.info("a stream's client reads too slowly: its requests are aborted",
                                     backlog=queue.qsize())
                            queue.put_nowait((i, _SlowClient()))
                        cancel()
                        return  # leaving the stream aborts its mesh request
                    queue.put_nowait((i, record))
                    # The consumer runs before the next record is queued: only a consumer blocked on its
                    # client (a write that waits) lets the backlog grow, never a burst of replies.
                    await asyncio.sleep(0)
        except Exception as exc:  # every producer error reaches the consumer
            queue.put_nowait((i, exc))

    tasks += [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(plan.requests)]
    try:
        connected, first = await _unless_disconnected(request, queue.get())
    except BaseException:
        cancel()
        raise
    if not connected:
        cancel()
        return Response(status_code=499)
    if isinstance(first[1], Exception):
        cancel()
        raise from_exception(first[1])

    def close() -> None:
        cancel()
        release()

    return _EventStream(_events(gw, plan, queue, first), close)


async def _events(gw: Gateway, plan: GenerationPlan, queue: asyncio.Queue[tuple[int, Any]],
                  first: tuple[int, Any]) -> AsyncIterator[bytes]:
    rid, created = out.response_id(plan), out.now()
    choices = [out.ChoiceStream(plan, rid, created, i, gw.decode_one, gw.decode_all) for i in range(len(plan.requests))]
    finished: list[m.RequestFinished | None] = [None] * len(plan.requests)
    item: tuple[int, Any] | None = first
    while any(f is None for f in finished):
        i, record = item if item is not None else await queue.get()
        item = None
        if isinstance(record, _SlowClient):
            err = ApiError(503, "the stream was ended: its client read it too slowly", "service_unavailable",
                           None, "slow_client")
            yield out.sse(err.body())
            return
        if isinstance(record, Exception):
            err = from_exception(record)
            if err.cause is not None:
                count_refusal(err.cause)
            yield out.sse(err.body())
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


# --- the application -----------------------------------------------------------------------------------------


def build_app(gw: Gateway, on_startup: Callable[[asyncio.AbstractEventLoop], None] | None = None) -> Starlette:
    """The gateway's ASGI app. `on_startup(loop)` runs in the lifespan, on the serving loop (the launcher
    watches its lifeline there)."""

    def endpoint(name: str, handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Any]:
        async def run(request: Request) -> Response:
            start = time.monotonic()
            try:
                if name not in PROBES:
                    gw.tenant_key(request)
                response = await handler(request)
            except ApiError as err:
                if err.cause is not None:
                    count_refusal(err.cause)
                response = error_response(err)
            except ClientDisconnect:  # gone while its body was read: nobody reads an answer
                response = Response(status_code=499)
            except Exception:
                log.exception("internal error", endpoint=name)
                response = error_response(ApiError(500, "internal error in the gateway", "internal_error",
                                                   None, "internal"))
            _count(name, response.status_code, time.monotonic() - start)
            return response

        return run

    async def completions(request: Request) -> Response:
        return await _generate(gw, request, parse_completion)

    async def chat(request: Request) -> Response:
        return await _generate(gw, request, parse_chat)

    async def models(request: Request) -> Response:
        card = {"id": gw.model, "object": "model", "created": gw.created, "owned_by": "deepinfer",
                "root": gw.model, "max_model_len": gw.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        if gw.draining:
            return JSONResponse({"status": "draining"}, status_code=503, headers={"Retry-After": "1"})
        servable, why = await gw.routers.servable()
        if servable and not gw.draining:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "draining" if gw.draining else "not ready", "reason": why}, status_code=503,
                            headers={"Retry-After": "1"})

    async def tokenize(request: Request) -> Response:
        raw = await read_body(request, gw.limits.max_body_bytes)

        def work() -> bytes:
            req = parse_tokenize(parse_json(raw, gw.limits.max_json_depth), gw.parse_context)
            if req.prompt is not None:
                tokens = gw.text.encode(req.prompt, add_special_tokens=req.add_special_tokens)
            else:
                try:
                    tokens = gw.text.encode_chat(req.messages, add_generation_prompt=req.add_generation_prompt,
                                                 tools=req.tools)
                except Exception as exc:  # no template, or the template refused the messages
                    raise invalid(f"cannot apply the chat template: {str(exc)[:200]}", "messages") from None
            return _render({"tokens": tokens, "count": len(tokens), "max_model_len": gw.max_model_len})

        return Response(await gw.run_cpu(len(raw) > OFFLOAD_BYTES, work), media_type="application/json")

    async def detokenize(request: Request) -> Response:
        raw = await read_body(request, gw.limits.max_body_bytes)

        def work() -> bytes:
            body = parse_json(raw, gw.limits.max_json_depth)
            tokens = parse_detokenize(body, gw.parse_context, gw.tokenizer.vocab_size)
            return _render({"prompt": gw.decode_all(tokens)})

        return Response(await gw.run_cpu(len(raw) > OFFLOAD_BYTES, work), media_type="application/json")

    async def metrics(request: Request) -> Response:
        from deepinfer.metrics import exposition

        body, content_type = exposition()
        return Response(body, media_type=content_type)

    async def not_found(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        _count("other", status, 0.0)
        message = f"{request.method} {request.url.path[:200]} is not a route of this server"
        kind = "invalid_request_error"
        if status == 405:
            message = f"{request.method} is not allowed on {request.url.path[:200]}"
        return error_response(ApiError(status, message, kind, None, "not_found" if status == 404 else None))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if on_startup is not None:
            on_startup(asyncio.get_running_loop())
        connecting = asyncio.create_task(gw.routers.connect_forever())
        try:
            yield
        finally:
            connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await connecting
            await gw.routers.close()
            gw.offload.close()

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
