"""The two layers every service is built from.

`BaseService` is a service's life in one process: open its sockets, serve with its loops until `stop()`,
close the sockets. Every service derives from it, the router included.

`Service` adds membership of the mesh: a DEALER to the router's backend opened with a Hello/Welcome
handshake (said again when the router restarts), heartbeats that carry a progress counter, and a receive
loop that dispatches the router's messages by type. The tokenizer, the workers and the cache daemon are
`Service`s.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ClassVar

import structlog
import zmq
import zmq.asyncio

from deepinfer.metrics.recorders.service import ServiceMetrics
from deepinfer.protocol import messages as m
from deepinfer.protocol.auth import NO_AUTH, ServiceAuth
from deepinfer.protocol.errors import ProtocolError
from deepinfer.protocol.handshake import SAY_HELLO
from deepinfer.protocol.sockets import arecv_msg, asend_msg, make_dealer

# A message handler: called with what the receive function returned (the message, or peer and message).
Handler = Callable[..., Awaitable[None]]

DRAIN_TIMEOUT_S = 60.0  # a draining service stops after this even with work in flight (units wait longer)
DRAIN_POLL_S = 0.05  # how often a draining service asks idle()
# The most a send on the way out waits: with the router gone the DEALER's queue fills (SNDHWM), and a plain
# send would then wait for it forever.
SHUTDOWN_SEND_S = 1.0
REHELLO_INTERVAL_S = 1.0  # least time between Hellos to a restarted router that has not answered yet
# Fairness: a receive loop hands the event loop back after this many messages in a row. pyzmq's asyncio recv
# completes at once while messages wait (its future is already done, so awaiting it never suspends): a loop
# flooded on one socket would otherwise never let the service's other sockets, timers (heartbeats, the
# router's liveness tick) or spawned tasks run until the flood stopped. 64 messages at the router's ~15k/s are
# a few milliseconds; a yield costs a few microseconds.
FAIR_BATCH = 64
MALFORMED_LOG_PERIOD_S = 1.0  # a flood of malformed messages is logged once per period, with the count skipped


class BaseService:
    """The lifecycle every service shares: `run()` opens, serves until `stop()`, and closes.

    A subclass provides:
    * `open()`: opens its sockets, each registered with `socket()`, and whatever must precede serving;
      returns False if stopped before it could serve. `run(ready)` sets `ready` once it returned True.
    * `tasks()`: the coroutines it serves with (receive loops, timers). A receive loop is usually
      `dispatch_forever(sock, recv, table)`, its handler table mapping a message type to a coroutine.
    * `idle()`: nothing in flight, so a draining service may stop now.
    * optionally `on_drain()` (announce the drain; bounded), `drained()` (more than idle() before a drain
      may end), `on_drain_end()` (say goodbye; bounded) and `on_stop()` (take down what `open()` started
      besides sockets).

    Invariants:
    * `drain()` sets `draining` (the subclass refuses new work while it is set) and ends in `stop()` once
      `drained()`, or at its deadline whatever the peers do.
    * Handlers never raise into the loop: a failing handler is logged and the service keeps serving; a
      malformed message is counted (`malformed`), logged and skipped.
    * Receive loops are fair: `dispatch_forever` yields to the event loop after every FAIR_BATCH messages,
      so under a flood on one socket the others, the timers and the heartbeats keep their turns.
    * A task from `spawn()` is kept until done (the event loop holds tasks only weakly, so a fire-and-
      forget one could vanish mid-flight), its failure logged, and it is cancelled at stop.
    * A loop that raises ends `run()` with that exception; one that returns ends `run()` too.
    * However `run()` ends, once `open()` began: spawned tasks are cancelled and every registered socket is
      closed with linger 0 (a message nobody will read cannot hold the exit).
    """

    role: ClassVar[str] = "service"

    def __init__(self, instance: str, ctx: zmq.asyncio.Context | None = None, auth: ServiceAuth = NO_AUTH) -> None:
        self.instance = instance
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.auth = auth  # CURVE keys and allow-lists for its tcp:// sockets (NO_AUTH: none)
        self.log = structlog.get_logger("deepinfer").bind(service=self.role, instance=instance, pid=os.getpid())
        self.malformed = 0
        self._malformed_logged_at = -MALFORMED_LOG_PERIOD_S
        self._malformed_unlogged = 0  # malformed messages counted but not logged since the last line
        self.draining = False
        self._stopping = asyncio.Event()
        self._sockets: list[Any] = []
        self._spawned: set[asyncio.Task[Any]] = set()
        self.exported: ServiceMetrics | None = None  # its Prometheus metrics, bound once it serves

    # -- to override ------------------------------------------------------------------------

    async def open(self) -> bool:
        """Open and register the sockets; False if stopped before serving could begin."""
        return True

    def tasks(self) -> list[Awaitable[None]]:
        return []

    def loops(self) -> list[Awaitable[None]]:
        """Everything `run()` serves with. A layer between this class and a concrete service (`Service`)
        adds its own loops here, leaving `tasks()` to the concrete service."""
        return self.tasks()

    def idle(self) -> bool:
        """Nothing in flight: a draining service may stop. Subclasses holding requests override it."""
        return True

    async def on_drain(self, timeout_s: float) -> None:
        """When a drain begins, before waiting for idle(): e.g. tell peers. Cut off after `timeout_s`."""

    async def drained(self) -> bool:
        """Whether a draining service may stop now (polled every DRAIN_POLL_S): by default once idle()."""
        return self.idle()

    async def on_drain_end(self, timed_out: bool) -> None:
        """As a drain ends (`timed_out`: with work still in flight), just before stop(): e.g. say goodbye.
        It must bound its own sends: the peers may be gone."""

    async def on_stop(self) -> None:
        """After serving ends (also by a loop's failure), before the sockets close."""

    # -- lifecycle --------------------------------------------------------------------------

    def socket(self, sock: Any) -> Any:
        """Register a socket to be closed (linger 0) when the service stops."""
        self._sockets.append(sock)
        return sock

    async def run(self, ready: asyncio.Event | None = None) -> None:
        """Open, serve until `stop()` or a loop ends, then close every socket."""
        try:
            if not await self.open():
                return  # stopped before serving: nothing started, nothing to drain
            self.log.info("serving")
            self.exported = ServiceMetrics(self.role, self.instance)  # the role is final by now (workers')
            self.exported.serving(True)
            if ready is not None:
                ready.set()
            try:
                await self._serve()
            finally:
                await self.on_stop()
        finally:
            for t in list(self._spawned):
                t.cancel()
            for s in self._sockets:
                s.close(linger=0)
            if self.exported is not None:
                self.exported.serving(False)
            self.log.info("stopped")

    async def _serve(self) -> None:
        """Run the loops until `stop()` or one of them ends; re-raise a loop's failure."""
        loops = [asyncio.ensure_future(c) for c in self.loops()]
        stop = asyncio.ensure_future(self._stopping.wait())
        done, _ = await asyncio.wait([*loops, stop], return_when=asyncio.FIRST_COMPLETED)
        for t in [*loops, stop]:
            t.cancel()
        for t in done:
            if t is not stop and not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]

    async def _unless_stopped(self, step: Awaitable[Any]) -> bool:
        """Await `step` unless `stop()` comes first (then cancel it); False if stopped."""
        work, stop = asyncio.ensure_future(step), asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait([work, stop], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not work.done():
                work.cancel()
                await asyncio.wait([work])  # let it unwind
        if work.cancelled():
            return False
        work.result()  # raises what the step raised
        return True

    def stop(self) -> None:
        self._stopping.set()

    def spawn(self, coro: Coroutine[Any, Any, Any], what: str) -> asyncio.Task[Any]:
        """Run `coro` beside the loops: kept until done, its failure logged, cancelled at stop."""
        task = asyncio.ensure_future(coro)
        self._spawned.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._spawned.discard(t)
            if not t.cancelled() and t.exception() is not None:
                self.log.error("task failed", task=what, error=repr(t.exception()))

        task.add_done_callback(done)
        return task

    def drain(self, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Take no new work, finish what is in flight, then stop — or stop anyway after `timeout_s`."""
        if not self.draining:
            self.draining = True
            self.spawn(self._drain(timeout_s), "drain")

    async def _drain(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        self.log.info("draining", timeout_s=timeout_s)
        try:
            try:
                await asyncio.wait_for(self.on_drain(timeout_s), timeout_s)  # bounded whatever the hook does
            except TimeoutError:
                self.log.warning("the drain's announcement was cut off at the drain's deadline")
            while not (done := await self.drained()) and time.monotonic() < deadline:
                await asyncio.sleep(DRAIN_POLL_S)
            if not done:
                self.log.warning("drain timed out with work in flight", timeout_s=timeout_s)
            await self.on_drain_end(timed_out=not done)
        except Exception:
            self.log.exception("drain failed; stopping now")
        finally:  # invariant: a drain ends in stop() by its deadline
            self.stop()

    # -- receiving --------------------------------------------------------------------------

    async def dispatch_forever(self, sock: Any, recv: Callable[[Any], Awaitable[Any]], table: dict[type, Handler],
                               *, otherwise: Handler | None = None,
                               on_malformed: Callable[[ProtocolError], Awaitable[None]] | None = None) -> None:
        """Receive from `sock` forever and run the handler for each message's type: `table`'s, else
        `otherwise` (default: log it as unexpected). A malformed message is counted, logged, then given to
        `on_malformed` (e.g. to answer it). Fair (FAIR_BATCH): every FAIR_BATCH messages, malformed ones
        included, it yields to the event loop once, whether or not a receive had to wait."""
        turn = 0
        while True:
            turn += 1
            if turn >= FAIR_BATCH:
                turn = 0
                await asyncio.sleep(0)  # the other sockets, timers and tasks get their turn
            try:
                msg = await recv(sock)
            except ProtocolError as exc:
                self._count_malformed(exc)
                if on_malformed is not None:
                    await self._handle(on_malformed, (exc,), "malformed")
                continue
            args = msg if isinstance(msg, tuple) else (msg,)
            name = type(args[-1]).__name__
            handler = table.get(type(args[-1]), otherwise)
            if handler is None:
                self.log.warning("unexpected message", type=name)
                continue
            await self._handle(handler, args, name)

    def _count_malformed(self, exc: ProtocolError) -> None:
        """Count a malformed message; log it unless one was logged within MALFORMED_LOG_PERIOD_S (a flood
        must not turn into a flood of log lines): the next line says how many went unlogged meanwhile."""
        self.malformed += 1
        now = time.monotonic()
        if now - self._malformed_logged_at < MALFORMED_LOG_PERIOD_S:
            self._malformed_unlogged += 1
            return
        self.log.warning("malformed message", code=exc.code, detail=exc.detail, peer=exc.peer,
                         unlogged_before=self._malformed_unlogged, malformed=self.malformed)
        self._malformed_logged_at, self._malformed_unlogged = now, 0

    async def _handle(self, handler: Handler, args: tuple[Any, ...], name: str) -> None:
        try:
            await handler(*args)
        except Exception:  # a handler bug must not take the service down
            self.log.exception("handler failed", type=name)


class HandshakeRefused(RuntimeError):
    """The router refused this service's Hello; the message carries the router's reason."""


class Service(BaseService):
    """A member of the mesh, connected to the router's backend.

    A subclass provides `handlers()` (the router's messages: type → coroutine), `heartbeat_fields()`,
    optionally `tasks()` (extra loops such as a second socket's receive loop), `on_start()` (open those
    sockets, after the handshake) and `on_router_restart()`.

    Draining (the router's side: `router_drain`): a drain starts on SIGTERM or on the router's
    `Shutdown(drain=True)` (an operator's `drain` command), and first sends a heartbeat saying `draining`
    (so the router stops placing here), bounded as the router may be gone. Once the router has said it
    knows (that Shutdown), the service, idle, waits for the router's release (`Shutdown(drain=False)`: the
    router holds none of its requests, so none is on its way here or still being finished elsewhere)
    before it stops; a drain the router never acknowledged ends once idle. Either way, as it stops it says
    goodbye (a ServiceExited about itself), so the router moves at once what it still held at a timeout.
    `Shutdown(drain=False)` to a service that is not draining stops it.
    """

    def __init__(self, instance: str, backend: str, ctx: zmq.asyncio.Context | None = None,
                 heartbeat_s: float = 0.5, model_fingerprint: str | None = None,
                 block_hash_scheme: str | None = None, auth: ServiceAuth = NO_AUTH) -> None:
        super().__init__(instance, ctx, auth)
        self.backend = backend
        self.heartbeat_s = heartbeat_s
        self.model_fingerprint = model_fingerprint
        self.block_hash_scheme = block_hash_scheme
        self.incarnation = secrets.token_hex(6)
        self.progress = 0  # subclasses advance it when they do work (engine steps, messages handled)
        self.router: Any = None
        self._seq = 0
        self._rehello_at: float | None = None  # when we last said Hello to a restarted router, until welcomed
        self._drain_acked = False  # the router knows this service drains: once idle, it waits for the release
        self._released = False  # the router's release: it holds none of this service's requests
        self._asked_release = False

    # -- to override ------------------------------------------------------------------------

    def handlers(self) -> dict[type, Handler]:
        return {}

    def heartbeat_fields(self) -> dict[str, Any]:
        return {}

    def capabilities(self) -> dict[str, str]:
        """Extra Hello capabilities (the incarnation is always sent), e.g. which cache daemon a worker uses."""
        return {}

    async def on_start(self) -> None:
        """After the handshake, before serving."""

    async def on_router_restart(self) -> None:
        """The router restarted: every request this service holds was the old router's. Subclasses holding
        requests drop them here (before the new Hello), or keep those a client may resume on the new router
        (a worker's decoding requests: `WorkerCore.on_router_restart`)."""

    async def on_rejoined(self) -> None:
        """The restarted router accepted this service's Hello: a worker reports what it kept (HeldRequests)."""

    # -- lifecycle --------------------------------------------------------------------------

    async def open(self) -> bool:
        """Connect, handshake (unless stopped first), then `on_start()`."""
        self.router = self.socket(make_dealer(self.ctx, self.backend, self.instance.encode(),
                                              auth=self.auth.for_connect(self.backend, "router")))
        if not await self._unless_stopped(self.handshake()):
            return False  # stopped (SIGTERM) before the router answered
        await self.on_start()
        return True

    def loops(self) -> list[Awaitable[None]]:
        return [self._recv_loop(), self._heartbeat_loop(), *self.tasks()]

    async def on_drain(self, timeout_s: float) -> None:
        # Tell the router now, not at the next period; bounded, as the router may be gone.
        await self._beat(timeout_s=min(SHUTDOWN_SEND_S, timeout_s))

    async def drained(self) -> bool:
        """Idle and, once the router acknowledged the drain, released by it. Idle but not released yet, it
        asks at once (a heartbeat: the router releases at a draining heartbeat), not at the next period."""
        if not self.idle():
            return False
        if self._released or not self._drain_acked:
            return True
        if not self._asked_release:
            self._asked_release = True
            await self._beat(timeout_s=SHUTDOWN_SEND_S)
        return False

    async def on_drain_end(self, timed_out: bool) -> None:
        # The goodbye: the router retires this process now, and moves what it still holds (after a timeout)
        # at once rather than at the supervisor's exit note or the heartbeat timeout.
        await self.send_router_within(m.ServiceExited(self.instance, os.getpid(), 0), SHUTDOWN_SEND_S)

    async def _on_shutdown(self, msg: m.Shutdown) -> None:
        """The router's word: drain (within `msg.timeout_s`, else the default), or stop; to a draining
        service, `drain=False` is the release."""
        if msg.drain:
            self._drain_acked = True
            self.drain(DRAIN_TIMEOUT_S if msg.timeout_s is None else msg.timeout_s)
        elif self.draining:
            self.log.info("released by the router", reason=msg.reason)
            self._released = True
        else:
            self.log.info("stopped by the router", reason=msg.reason)
            self.stop()

    def hello(self) -> m.Hello:
        # The pid lets a supervisor's exit note (ServiceExited) name this very process.
        caps = {**self.capabilities(), "incarnation": self.incarnation, "pid": str(os.getpid())}
        return m.Hello(m.PROTOCOL_VERSION, self.role, self.instance, self.model_fingerprint,
                       self.block_hash_scheme, caps)

    async def handshake(self, timeout_s: float = 30.0) -> m.Welcome:
        """Say Hello until the router answers; raise HandshakeRefused with its reason if it refuses."""
        hello = self.hello()
        deadline = time.monotonic() + timeout_s
        while True:
            await asend_msg(self.router, hello)
            if await self.router.poll(timeout=500):
                reply = await arecv_msg(self.router)
                if isinstance(reply, m.Welcome):
                    if not reply.accepted:
                        raise HandshakeRefused(f"router refused {self.instance}: {reply.reason}")
                    return reply
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.instance}: no Welcome from the router at {self.backend} in {timeout_s}s")

    # -- the router ---------------------------------------------------------------------------

    async def send_router(self, msg: Any) -> None:
        await asend_msg(self.router, msg)

    async def send_router_within(self, msg: Any, timeout_s: float) -> bool:
        """Send to the router unless that takes longer than `timeout_s`: for the way out, where the router may
        be gone. A message not sent is logged, not raised; returns whether it was sent."""
        if self.router is None:
            return False
        try:
            await asyncio.wait_for(self.send_router(msg), timeout_s)
            return True
        except (TimeoutError, zmq.ZMQError) as exc:
            self.log.warning("router unreachable; not sent", type=type(msg).__name__,
                             error=str(exc) or f"no room to send in {timeout_s}s")
            return False

    async def _recv_loop(self) -> None:
        await self.dispatch_forever(self.router, arecv_msg, {**self.handlers(), m.Welcome: self._on_welcome,
                                                             m.Shutdown: self._on_shutdown})

    async def _on_welcome(self, welcome: m.Welcome) -> None:
        """After the handshake a Welcome is news: a router that asks for a Hello has restarted (drop the old
        one's work, say Hello again); an accepted one answers that Hello; a refusal ends this service."""
        if welcome.accepted:
            if self._rehello_at is not None:
                self.log.info("rejoined the restarted router")
                self._rehello_at = None
                await self._beat()  # placeable now, not at the next period: it carries the load
                await self.on_rejoined()
            return
        if welcome.reason != SAY_HELLO:
            self.log.error("the router refused this service", reason=welcome.reason)
            self.stop()
            return
        now = time.monotonic()
        if self._rehello_at is None:
            self.log.warning("the router restarted: dropping its requests and saying Hello again")
            await self.on_router_restart()
        elif now - self._rehello_at < REHELLO_INTERVAL_S:
            return  # a Hello is on its way: the router asks once per message it drops meanwhile
        self._rehello_at = now
        await self.send_router(self.hello())

    async def _beat(self, timeout_s: float | None = None) -> None:
        """Send a heartbeat; with `timeout_s`, give up after that long (see `send_router_within`)."""
        self._seq += 1
        beat = m.Heartbeat(service=self.role, instance=self.instance, incarnation=self.incarnation, seq=self._seq,
                           progress=self.progress, draining=self.draining, sent_time=time.time(),
                           **self.heartbeat_fields())
        try:
            self.record_metrics(beat)
        except Exception:  # metrics never take a service down
            self.log.exception("recording metrics failed")
        if timeout_s is None:
            await self.send_router(beat)
        else:
            await self.send_router_within(beat, timeout_s)

    def record_metrics(self, beat: m.Heartbeat) -> None:
        """Refresh this process's exported metrics, at heartbeat rate; a subclass adds its own."""
        if self.exported is not None:
            self.exported.on_heartbeat(beat, self.malformed)

    async def _heartbeat_loop(self) -> None:
        while True:
            await self._beat()
            await asyncio.sleep(self.heartbeat_s)
