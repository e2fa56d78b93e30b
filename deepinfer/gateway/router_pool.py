"""The gateway's connections to the router: a few AsyncClients on one ZeroMQ context, each (re)connecting by
itself, requests spread over them a POST at a time.

Why several: the router ends every request of a connection whose socket fills (`on_client_slow`), and a
connection-level failure (a dropped peer) ends every request on it. With `size` connections each such event
reaches only the POSTs placed on that one, and the router's per-peer queue is `size` times as deep before it
fills. What keeps a socket from filling in the first place is the clients' readers: each moves every reply
into its request's queue at once, whatever the HTTP side does with it (see `app`'s per-stream backlog).
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


class RouterPool:
    def __init__(self, endpoint: str, size: int, request_timeout_s: float, client_options: dict[str, Any]) -> None:
        self.endpoint, self.size = endpoint, size
        self.request_timeout_s = request_timeout_s
        self.client_options = client_options
        self.clients: list[AsyncClient] = []
        self._ctx: zmq.asyncio.Context | None = None
        self._next = 0

    @property
    def ready(self) -> bool:
        """A router answered at least one connection's Hello and that connection is up."""
        return any(c.connected for c in self.clients)

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
