"""The gateway's connections to the router: a few AsyncClients on one ZeroMQ context, each (re)connecting by
itself, requests spread over them a POST at a time.

Why several: the router ends every request of a connection whose socket fills (`on_client_slow`), and a
connection-level failure (a dropped peer) ends every request on it. With `size` connections each such event
reaches only the POSTs placed on that one, and the router's per-peer queue is `size` times as deep before it
fills. What keeps a socket from filling in the first place is the clients' readers: each moves every reply
into its request's queue at once, whatever the HTTP side does with it (see `app`'s per-stream backlog).

Readiness (`servable`, the gateway's /ready): a connection being up says only that a router answered; whether a
request sent now is served is the router's to say (a tokenizer and the workers a request needs alive), so each
probe asks it (a MeshQuery on one connection, answered from its liveness table).
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog
import zmq.asyncio

from deepinfer.protocol.client import AsyncClient, MeshError

log = structlog.get_logger("deepinfer.gateway")

RECONNECT_S = 1.0  # between attempts to reach a router that did not answer the handshake
HANDSHAKE_TIMEOUT_S = 5.0
READY_QUERY_TIMEOUT_S = 3.0  # a router that does not answer a readiness question this fast is not ready


class RouterPool:
    def __init__(self, endpoint: str, size: int, request_timeout_s: float, client_options: dict[str, Any]) -> None:
        self.endpoint, self.size = endpoint, size
        self.request_timeout_s = request_timeout_s
        self.client_options = client_options
        self.clients: list[AsyncClient] = []
        self._ctx: zmq.asyncio.Context | None = None
        self._next = 0
        self._asking: asyncio.Future[tuple[bool, str]] | None = None  # the readiness question in flight

    async def servable(self) -> tuple[bool, str]:
        """(True, "") when the router says a request sent now would be served, else (False, why). Concurrent
        callers share one question (a flood of probes costs the router one message at a time); an answer is
        never reused after it arrived, so a mesh that lost its workers is not ready from the next question on."""
        if self._asking is None:
            self._asking = asyncio.ensure_future(self._ask())
            self._asking.add_done_callback(lambda _: setattr(self, "_asking", None))
        return await asyncio.shield(self._asking)

    async def _ask(self) -> tuple[bool, str]:
        client = self.pick()
        if client is None or not client.connected:
            return False, "waiting for the router"
        try:
            async with asyncio.timeout(READY_QUERY_TIMEOUT_S):
                status = await client.mesh_status()
        except TimeoutError:
            return False, f"the router did not answer within {READY_QUERY_TIMEOUT_S:g}s"
        except MeshError as exc:
            return False, f"the router did not answer: {exc}"
        return status.servable, status.reason

    async def connect_forever(self) -> None:
        """Open `size` connections, each once a router answers its Hello; they then reconnect by themselves."""
        self._ctx = zmq.asyncio.Context()
        while len(self.clients) < self.size:
            client = AsyncClient(self.endpoint, timeout_s=self.request_timeout_s, ctx=self._ctx,
                                 connect_timeout_s=HANDSHAKE_TIMEOUT_S, **self.client_options)
            try:
                await client.connect()
            except MeshError as exc:
                log.info("waiting for the router", endpoint=self.endpoint, reason=str(exc))
                await asyncio.sleep(RECONNECT_S)
                continue
            self.clients.append(client)
            if len(self.clients) == 1:
                log.info("connected to the router", endpoint=self.endpoint)

    def pick(self) -> AsyncClient | None:
        """The next connected client, round robin (any client while none is connected; None before the first)."""
        if not self.clients:
            return None
        for _ in range(len(self.clients)):
            self._next = (self._next + 1) % len(self.clients)
            if self.clients[self._next].connected:
                break
        return self.clients[self._next]

    async def close(self) -> None:
        clients, self.clients = self.clients, []
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
