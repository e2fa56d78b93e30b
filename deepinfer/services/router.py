"""The router service: the mesh's front door. A thin shell around `RouterCore`.

Sockets: a bound ROUTER for clients (`frontend`) and a bound ROUTER every service connects to (`backend`),
both with ROUTER_MANDATORY, so a send to a vanished peer raises instead of disappearing: a vanished
client's requests are aborted, a vanished service is left to the heartbeat liveness. A timer ticks the
core (deadlines, dead workers, parked requests).

Handshake: every connection starts with Hello; the router answers Welcome, refusing a protocol version
other than its own and, once the first service has named the mesh's model fingerprint or block-hash
scheme (`MeshPins`), any service with another one: blocks hashed under two namespaces could never be
shared, and the router's prefix index would compare unrelated hashes.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import secrets
import time
from typing import Any

import structlog
import zmq
import zmq.asyncio

from deepinfer.protocol import messages as m
from deepinfer.protocol.auth import NO_AUTH, ServiceAuth
from deepinfer.protocol.errors import ProtocolError
from deepinfer.protocol.handshake import SAY_HELLO, check_hello
from deepinfer.protocol.limits import CLIENT_LIMITS
from deepinfer.protocol.sockets import arecv_routed, asend_msg, make_router
from deepinfer.services.base import DRAIN_TIMEOUT_S
from deepinfer.services.router_core import Outbound, RouterConfig, RouterCore

__all__ = ["MeshPins", "RouterConfig", "RouterService"]

TICK_S = 0.1
SUPERVISOR_PREFIX = "supervisor"  # the backend identities a supervisor's exit notes come from
REHELLO_ASK_S = 1.0
MAX_ASKED = 4096
STATE_LOG_S = 10.0  # how often the router logs the mesh's state
MAX_BACKLOG = 4096  # messages kept for one slow client, in order; past that they are dropped
# The field naming the instance a message speaks for: it must be the sender's own identity.
SPEAKS_FOR: dict[type, str] = {m.Heartbeat: "instance", m.TextDeltas: "tokenizer", m.PrefillDone: "prefill_worker",
                               m.KvEvents: "publisher"}


class MeshPins:
    """What every model-holding service of the mesh must agree on, each pinned by the first accepted Hello
    that names it: the model fingerprint and the block-hash scheme (which covers the KV namespace: model
    and tokenizer fingerprints, KV dtype and layout, block size). Pure."""

    def __init__(self) -> None:
        self.fingerprint: str | None = None
        self.scheme: str | None = None
        self.scheme_from = ""  # the instance that pinned the scheme, for refusal reasons

    def check(self, hello: m.Hello, instance: str) -> m.Welcome:
        """Welcome or refuse a service's Hello; an accepted one pins what is not pinned yet."""
        expected = self.fingerprint if hello.model_fingerprint is not None else None
        welcome = check_hello(hello, m.PROTOCOL_VERSION, expected, self.scheme, service="router", instance=instance)
        if not welcome.accepted:
            if hello.block_hash_scheme is not None and self.scheme not in (None, hello.block_hash_scheme):
                why = (f"{welcome.reason} (the mesh's block hash scheme was set by {self.scheme_from}; every "
                       f"tokenizer, worker and cache daemon must hash under the same model, tokenizer, KV dtype "
                       f"and layout and block size)")
                welcome = dataclasses.replace(welcome, reason=why)
            return welcome
        if self.fingerprint is None and hello.model_fingerprint is not None:
            self.fingerprint = hello.model_fingerprint
        if self.scheme is None and hello.block_hash_scheme is not None:
            self.scheme, self.scheme_from = hello.block_hash_scheme, f"{hello.service} {hello.instance}"
        return welcome


class RouterService:
    role = "router"

    def __init__(self, instance: str, frontend: str, backend: str, ctx: zmq.asyncio.Context,
                 config: RouterConfig | None = None, auth: ServiceAuth = NO_AUTH) -> None:
        self.instance = instance
        self.frontend_ep, self.backend_ep = frontend, backend
        self.ctx = ctx
        self.auth = auth  # CURVE on tcp:// (frontend: tenant keys only; backend: service keys + the supervisor)
        # Request ids must not repeat across router restarts: prefix them with this incarnation.
        config = dataclasses.replace(config or RouterConfig(), id_prefix=f"{secrets.token_hex(3)}-")
        self.core = RouterCore(config)
        self.pins = MeshPins()
        self.malformed = 0
        self.log = structlog.get_logger("deepinfer").bind(service="router", instance=instance)
        self._stopping = asyncio.Event()
        self.frontend: Any = None
        self.backend: Any = None
        self.greeted: set[bytes] = set()  # backend identities welcomed by this incarnation
        self._asked: dict[bytes, float] = {}  # identities asked for a Hello, and when (monotonic)
        self.forged = 0
        self._backlog: dict[bytes, collections.deque[Any]] = {}  # slow clients: what they are still owed
        self._drain_task: asyncio.Future[None] | None = None

    def stop(self) -> None:
        self.core.draining = True
        self._stopping.set()

    def drain(self, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Refuse new requests (clients get "overloaded"), let admitted ones finish, then stop — after
        `timeout_s` at the latest. The drain itself sends nothing, so dead peers cannot hold it."""
        if not self.core.draining:
            self.core.draining = True
            self._drain_task = asyncio.ensure_future(self._drain(timeout_s))

    async def _drain(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        self.log.info("draining", inflight=self.core.num_inflight, timeout_s=timeout_s)
        try:
            while self.core.num_inflight and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        finally:  # invariant: a drain ends in stop() by its deadline
            self.stop()

    async def run(self, ready: asyncio.Event | None = None) -> None:
        self.frontend = make_router(self.ctx, self.frontend_ep, limits=CLIENT_LIMITS,
                                    auth=self.auth.for_bind(self.frontend_ep, "frontend"))
        self.backend = make_router(self.ctx, self.backend_ep, auth=self.auth.for_bind(self.backend_ep, "backend"))
        try:
            self.log.info("serving", frontend=self.frontend_ep, backend=self.backend_ep)
            if ready is not None:
                ready.set()
            loops = [asyncio.ensure_future(c) for c in (self._client_loop(), self._service_loop(), self._tick_loop())]
            stop = asyncio.ensure_future(self._stopping.wait())
            await asyncio.wait([*loops, stop], return_when=asyncio.FIRST_COMPLETED)
            for t in [*loops, stop]:
                t.cancel()
        finally:
            self.frontend.close(linger=0)
            self.backend.close(linger=0)
            self.log.info("stopped")

    # -- sending ----------------------------------------------------------------------------

    async def _send(self, outbound: list[Outbound]) -> None:
        """Never waits on a peer (NOBLOCK): one slow reader must not hold up the mesh."""
        for o in outbound:
            if o.to_client:
                await self._to_client(o.dest, o.msg)  # type: ignore[arg-type]
            else:
                try:
                    await asend_msg(self.backend, o.msg, o.dest.encode(), flags=zmq.NOBLOCK)
                except zmq.ZMQError as exc:  # liveness (missed heartbeats) will fail its requests
                    self.log.warning("service unreachable", dest=o.dest, error=str(exc) or "queue full")

    async def _to_client(self, client: bytes, msg: Any) -> None:
        """A client whose queue is full reads too slowly: its requests end now with an explicit error, kept
        (with anything else still owed to it) in a bounded backlog that the tick delivers as it reads."""
        backlog = self._backlog.get(client)
        if backlog is not None:
            if len(backlog) < MAX_BACKLOG:
                backlog.append(msg)
            return
        try:
            await asend_msg(self.frontend, msg, client, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.log.warning("client too slow: ending its requests", client=client.hex())
            self._backlog[client] = collections.deque([msg])
            await self._send(self.core.on_client_slow(client, self._now()))
        except zmq.ZMQError as exc:  # the client is gone: abort what it had in flight
            self.log.info("client unreachable", error=str(exc))
            self._backlog.pop(client, None)
            await self._send(self.core.on_client_gone(client, self._now()))

    async def _flush_backlogs(self) -> None:
        for client, backlog in list(self._backlog.items()):
            try:
                while backlog:
                    await asend_msg(self.frontend, backlog[0], client, flags=zmq.NOBLOCK)
                    backlog.popleft()
                del self._backlog[client]
            except zmq.Again:
                continue
            except zmq.ZMQError:  # gone: what it was owed goes with it
                del self._backlog[client]

    @staticmethod
    def _now() -> float:
        # Every deadline and liveness decision runs on this clock: a wall-clock step changes none of them.
        return time.monotonic()

    # -- loops ------------------------------------------------------------------------------

    async def _client_loop(self) -> None:
        while True:
            try:
                client, msg = await arecv_routed(self.frontend, limits=CLIENT_LIMITS)
            except ProtocolError as exc:
                self.malformed += 1
                self.log.warning("malformed client message", code=exc.code, detail=exc.detail)
                if exc.peer is not None:
                    await self._send([Outbound(exc.peer, m.ErrorReply("", "bad_message", f"{exc.code}: {exc.detail}"))])
                continue
            now = self._now()
            if isinstance(msg, m.Hello):
                welcome = check_hello(msg, m.PROTOCOL_VERSION, None, None, service="router", instance=self.instance)
                await self._send([Outbound(client, welcome)])
            elif isinstance(msg, m.GenerateRequest):
                await self._send(self.core.on_generate(client, msg, now))
            elif isinstance(msg, m.AbortRequest):
                await self._send(self.core.on_abort(client, msg, now))
            else:
                await self._send([Outbound(client, m.ErrorReply(getattr(msg, "request_id", ""), "bad_message",
                                                                f"clients may not send {type(msg).__name__}"))])

    async def _service_loop(self) -> None:
        while True:
            try:
                ident, msg = await arecv_routed(self.backend)
            except ProtocolError as exc:
                self.malformed += 1
                self.log.warning("malformed service message", code=exc.code, detail=exc.detail, peer=exc.peer)
                continue
            sender, now = ident.decode(errors="replace"), self._now()
            if isinstance(msg, m.ServiceExited):
                if sender.startswith(SUPERVISOR_PREFIX):
                    self.log.info("service exited", instance=msg.instance, pid=msg.pid, code=msg.returncode)
                    await self._send(self.core.on_service_exited(msg, now))
                continue
            if isinstance(msg, m.Hello):
                await self._welcome(ident, msg, now)
                continue
            if ident not in self.greeted:
                await self._ask_hello(ident)
                continue
            if getattr(msg, SPEAKS_FOR.get(type(msg), ""), sender) != sender:
                self.forged += 1  # a message about another instance than the one sending it
                self.log.warning("message for another instance refused", type=type(msg).__name__, sender=sender)
                continue
            if isinstance(msg, m.Heartbeat):
                await self._send(self.core.on_heartbeat(msg, now))
            elif isinstance(msg, m.EncodeResult):
                await self._send(self.core.on_encode_result(sender, msg, now))
            elif isinstance(msg, m.PrefillDone):
                await self._send(self.core.on_prefill_done(msg, now))
            elif isinstance(msg, m.KvEvents):
                out = self.core.on_kv_events(sender, msg, now)
                for o in out:
                    self.log.info("kv resync asked", publisher=o.dest, reason=o.msg.reason)
                await self._send(out)
            elif isinstance(msg, m.TextDeltas):
                await self._send(self.core.on_text_deltas(msg, now))
            elif isinstance(msg, m.ErrorReply):
                await self._send(self.core.on_error(sender, msg, now))
            else:
                self.log.warning("unexpected service message", type=type(msg).__name__, sender=sender)

    async def _ask_hello(self, ident: bytes) -> None:
        """A service this incarnation has not welcomed: it spoke to the router before this one. Ask it for a
        Hello (at most once a second each), dropping what it sent meanwhile."""
        now = time.monotonic()
        if now - self._asked.get(ident, -REHELLO_ASK_S) < REHELLO_ASK_S:
            return
        if len(self._asked) > MAX_ASKED:
            self._asked.clear()
        self._asked[ident] = now
        refusal = m.Welcome(m.PROTOCOL_VERSION, False, SAY_HELLO, service="router", instance=self.instance)
        await self._send([Outbound(ident.decode(errors="replace"), refusal)])

    async def _welcome(self, ident: bytes, hello: m.Hello, now: float) -> None:
        welcome = self.pins.check(hello, self.instance)
        if welcome.accepted and hello.instance.encode() != ident:
            welcome = dataclasses.replace(welcome, accepted=False,
                                          reason=f"Hello names {hello.instance!r}; its socket is {ident!r}")
        await asend_msg(self.backend, welcome, ident)
        if welcome.accepted:
            self.greeted.add(ident)
            self._asked.pop(ident, None)
            await self._send(self.core.on_hello(hello, now))
        else:
            self.greeted.discard(ident)
            self.log.warning("refused", instance=hello.instance, reason=welcome.reason)

    async def _tick_loop(self) -> None:
        logged = self._now()
        while True:
            await asyncio.sleep(TICK_S)
            await self._send(self.core.tick(self._now()))
            await self._flush_backlogs()
            if self._now() - logged >= STATE_LOG_S:
                logged = self._now()
                self._log_state()

    def _log_state(self) -> None:
        """One line per period: what an operator (or bench/soak.py) watches for leaks and stalls."""
        workers = {i.name: f"{i.load.free_blocks}/{i.load.total_blocks}" for i in self.core.table.instances.values()
                   if i.load is not None and i.load.total_blocks}
        self.log.info("mesh state", inflight=self.core.num_inflight, free_blocks=workers,
                      live=sorted(i.name for i in self.core.table.instances.values() if i.alive),
                      moves=self.core.metrics.moves, malformed=self.malformed, forged=self.forged,
                      slow_clients=len(self._backlog))
