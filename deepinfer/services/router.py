"""The router service: the mesh's front door. A thin shell around `RouterCore`.

Sockets: a bound ROUTER for clients (`frontend`) and a bound ROUTER every service connects to (`backend`),
both with ROUTER_MANDATORY, so a send to a vanished peer raises instead of disappearing: a vanished
client's requests are aborted, a vanished service is left to the heartbeat liveness. A timer ticks the
core (deadlines, dead workers, parked requests).

Isolation by request at the front (DESIGN §9): no limit is enforced by dropping a client's connection, which
may carry many callers' requests (the HTTP gateway's carries every HTTP user's). The front socket's libzmq
ceiling (MAXMSGSIZE, `limits.CLIENT_SOCKET_CEILING`, 16 MiB) sits well above the client limits (2 MiB); a
message between the two, or one that is malformed, is received, refused by the decoder, and answered by its
own request id when a bounded look at its first bytes finds one: "request_too_large" (over CLIENT_LIMITS) or
"invalid_request" (malformed), each counted (`deepinfer_router_refused_messages`). Without a readable id the
answer is "bad_message" with an empty id. Only a frame over the ceiling, which no client of ours sends (they
refuse an over-limit request before sending it), costs its connection: libzmq drops it unread. Receive loops
are fair (`BaseService.dispatch_forever`): a flood at the front cannot starve the services' heartbeats or the
tick that judges liveness. The front has no ZMTP heartbeats of its own (TCP keepalive, and our clients' PINGs
with a TTL, drop dead clients): with them, a client that floods the front and disconnects could make libzmq
abort the router (protocol.sockets).

Handshake: every connection starts with Hello; the router answers Welcome, refusing a protocol version
other than its own and, once the first service has named the mesh's model fingerprint or block-hash
scheme (`MeshPins`), any service with another one: blocks hashed under two namespaces could never be
shared, and the router's prefix index would compare unrelated hashes.

Expert balancing: the router relays between worker groups and the expert balancer (a service whose Hello
says "balancer"; the last one welcomed is the mesh's). Each ExpertLoad is kept (`expert_status`: per
group, the placement version and the tokens per rank) and forwarded to the balancer; a PlacementUpdate
goes to the worker it names only when the balancer sent it (from anyone else it is refused and counted as
forged); a PlacementResult goes to the balancer only from the worker it names. The balancer holds no
requests and is no worker: losing it changes nothing for them (they keep their last placement).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import zmq
import zmq.asyncio

from deepinfer.metrics.recorders.router import RouterExport
from deepinfer.protocol import messages as m
from deepinfer.protocol.auth import NO_AUTH, ServiceAuth
from deepinfer.protocol.errors import ProtocolError
from deepinfer.protocol.handshake import SAY_HELLO, check_hello
from deepinfer.protocol.limits import CLIENT_LIMITS
from deepinfer.protocol.sockets import arecv_routed, asend_msg, make_router
from deepinfer.services.balancer_config import BALANCER_NAME
from deepinfer.services.base import DRAIN_TIMEOUT_S, BaseService, Handler
from deepinfer.services.router_core import Outbound, RouterConfig, RouterCore
from deepinfer.services.router_drain import DrainDesk
from deepinfer.services.router_state import Phase

__all__ = ["ExpertStatus", "MeshPins", "RouterConfig", "RouterService"]

TICK_S = 0.1
SUPERVISOR_PREFIX = "supervisor"  # the backend identities of supervisors' exit notes and operators' drains
REHELLO_ASK_S = 1.0
MAX_ASKED = 4096
STATE_LOG_S = 10.0  # how often the router logs the mesh's state
METRICS_EVERY_TICKS = 5  # the router's gauges and event counters are refreshed every this many ticks
MAX_BACKLOG = 4096  # messages kept for one slow client, in order; past that they are dropped
EXIT_GRACE_S = 0.3  # a supervisor's exit note is acted on this long after it arrived (see _service_exited)
# The field naming the instance a message speaks for: it must be the sender's own identity.
SPEAKS_FOR: dict[type, str] = {m.Heartbeat: "instance", m.TextDeltas: "tokenizer", m.PrefillDone: "prefill_worker",
                               m.KvEvents: "publisher", m.ExpertLoad: "worker", m.PlacementResult: "worker",
                               m.HeldRequests: "instance"}
BALANCER_ROLE = "balancer"  # the Hello service name of the expert balancer


@dataclasses.dataclass(frozen=True)
class ExpertStatus:
    """One worker group's latest load report as the router shows it: the placement version the ranks
    ran, the tokens each rank computed over the report's period (its attention load: the group places
    requests), and per MoE layer the assignments each rank's experts computed (its expert load)."""

    placement_version: int
    rank_tokens: tuple[int, ...]
    rank_expert_tokens: tuple[tuple[int, ...], ...] = ()

    @property
    def max_over_mean(self) -> float:
        """The busiest rank's tokens over the mean (1.0 when idle)."""
        return _max_over_mean(self.rank_tokens)

    @property
    def expert_max_over_mean(self) -> float:
        """Mean over MoE layers of the busiest rank's expert load over the mean rank's (1.0 when idle or
        dense): what the balancer lowers, since each layer's exchange waits for its busiest rank."""
        busy = [layer for layer in self.rank_expert_tokens if sum(layer) > 0]
        return sum(map(_max_over_mean, busy)) / len(busy) if busy else 1.0


def _max_over_mean(loads: tuple[int, ...]) -> float:
    total = sum(loads)
    return max(loads) * len(loads) / total if total > 0 else 1.0


async def recv_client(sock: Any) -> tuple[bytes, Any]:
    """The next client message, under the client limits (tighter than the services')."""
    return await arecv_routed(sock, limits=CLIENT_LIMITS)


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


class RouterService(BaseService):
    """The mesh's front door (see the module's docstring). Serves with three loops: clients, services, and
    the core's timer. Idle when no request is in flight; draining refuses new requests."""

    role = "router"

    def __init__(self, instance: str, frontend: str, backend: str, ctx: zmq.asyncio.Context,
                 config: RouterConfig | None = None, auth: ServiceAuth = NO_AUTH) -> None:
        # auth: CURVE on tcp:// (frontend: tenant keys only; backend: service keys + the supervisor)
        super().__init__(instance, ctx, auth)
        self.frontend_ep, self.backend_ep = frontend, backend
        # Request ids must not repeat across router restarts: prefix them with this incarnation.
        config = dataclasses.replace(config or RouterConfig(), id_prefix=f"{secrets.token_hex(3)}-")
        self.core = RouterCore(config)
        self.pins = MeshPins()
        self.frontend: Any = None
        self.backend: Any = None
        self.greeted: set[bytes] = set()  # backend identities welcomed by this incarnation
        self._asked: dict[bytes, float] = {}  # identities asked for a Hello, and when (monotonic)
        self.forged = 0
        self.ticks = 0  # the timer's ticks so far (deadlines, liveness): it keeps its period under any flood
        self._backlog: dict[bytes, collections.deque[Any]] = {}  # slow clients: what they are still owed
        self._exits: collections.deque[tuple[float, m.ServiceExited]] = collections.deque()  # (due, note)
        # Each worker group's latest expert-load report, and what it says (see `expert_status`).
        self.expert_load: dict[str, m.ExpertLoad] = {}
        self.balancer: bytes | None = None  # the welcomed expert balancer's identity, if any
        # Prometheus: each request's end, the router's state, expert load
        self.export = RouterExport(instance, [p.value for p in Phase])
        self.drains = DrainDesk(self.core.table)  # graceful drains of members (router_drain)

    async def open(self) -> bool:
        # No ZMTP heartbeats on the front (TCP keepalive instead): with them a client could abort the router
        # at will (a libzmq assertion; see protocol.sockets).
        self.frontend = self.socket(make_router(self.ctx, self.frontend_ep, limits=CLIENT_LIMITS,
                                                auth=self.auth.for_bind(self.frontend_ep, "frontend"),
                                                bound_heartbeats=False))
        self.backend = self.socket(make_router(self.ctx, self.backend_ep,
                                               auth=self.auth.for_bind(self.backend_ep, "backend")))
        self.log.info("bound", frontend=self.frontend_ep, backend=self.backend_ep)
        self.core.started_at = self._now()  # resumes wait a moment for the workers' HeldRequests from here
        return True

    def tasks(self) -> list[Awaitable[None]]:
        return [
            self.dispatch_forever(self.frontend, recv_client, self._client_table(), otherwise=self._client_may_not,
                                  on_malformed=self._answer_malformed),
            self.dispatch_forever(self.backend, arecv_routed, self._service_table(), otherwise=self._from_member(None)),
            self._tick_loop(),
        ]

    def idle(self) -> bool:
        return self.core.num_inflight == 0

    def drain(self, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Refuse new requests from now on (clients get "overloaded"), let admitted ones finish, then stop —
        after `timeout_s` at the latest. The drain sends nothing of its own, so dead peers cannot hold it."""
        self.core.draining = True
        super().drain(timeout_s)

    def stop(self) -> None:
        self.core.draining = True  # what still arrives before the loops end is refused, not admitted
        super().stop()

    # -- sending ----------------------------------------------------------------------------

    async def _send(self, outbound: list[Outbound]) -> None:
        """Never waits on a peer (NOBLOCK): one slow reader must not hold up the mesh."""
        for o in outbound:
            if o.to_client:
                self._record_to_client(o.msg)
                await self._to_client(o.dest, o.msg)  # type: ignore[arg-type]
            else:
                try:
                    await asend_msg(self.backend, o.msg, o.dest.encode(), flags=zmq.NOBLOCK)
                except zmq.ZMQError as exc:  # liveness (missed heartbeats) will fail its requests
                    self.log.warning("service unreachable", dest=o.dest, error=str(exc) or "queue full")

    def _record_to_client(self, msg: Any) -> None:
        try:
            self.export.to_client(msg)
        except Exception:  # a metric never keeps a message from its client
            self.log.exception("recording metrics failed")

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

    # -- clients ----------------------------------------------------------------------------

    def _client_table(self) -> dict[type, Handler]:
        core = self.core
        return {m.Hello: self._welcome_client, m.GenerateRequest: self._by_core(core.on_generate),
                m.AbortRequest: self._by_core(core.on_abort), m.MeshQuery: self._mesh_query,
                m.ResumeRequest: self._by_core(core.on_resume)}

    def _by_core(self, event: Callable[[Any, Any, float], list[Outbound]]) -> Handler:
        """A handler feeding (peer, message) to a core event and sending what it returns."""
        async def handle(peer: Any, msg: Any) -> None:
            await self._send(event(peer, msg, self._now()))
        return handle

    async def _welcome_client(self, client: bytes, hello: m.Hello) -> None:
        welcome = check_hello(hello, m.PROTOCOL_VERSION, None, None, service="router", instance=self.instance)
        await self._send([Outbound(client, welcome)])

    async def _mesh_query(self, client: bytes, query: m.MeshQuery) -> None:
        """A client's readiness question (the gateway's /ready): would a request sent now be admitted and placed?"""
        missing = "the router is shutting down" if self.core.draining else self.core.table.unservable(self._now())
        await self._send([Outbound(client, m.MeshStatus(query.request_id, missing is None, missing or ""))])

    async def _client_may_not(self, client: bytes, msg: Any) -> None:
        await self._send([Outbound(client, m.ErrorReply(getattr(msg, "request_id", ""), "bad_message",
                                                        f"clients may not send {type(msg).__name__}"))])

    async def _answer_malformed(self, exc: ProtocolError) -> None:
        """A client message the front refused: its request (when its id could be read) ends with its own typed
        error; the connection and the other requests on it are untouched."""
        if exc.peer is None:
            return  # nothing is sent to a routing id its sender does not own
        if not exc.request_id:
            reply = m.ErrorReply("", "bad_message", str(exc))
        elif exc.code == "too_large":
            reply = m.ErrorReply(exc.request_id, "request_too_large",
                                 f"{exc} (the router takes client messages up to {CLIENT_LIMITS.max_payload} bytes)")
        else:
            reply = m.ErrorReply(exc.request_id, "invalid_request", f"the request cannot be decoded: {exc}")
        self.export.refused(reply.code)
        await self._send([Outbound(exc.peer, reply)])

    # -- services ---------------------------------------------------------------------------

    def _service_table(self) -> dict[type, Handler]:
        core = self.core
        from_members: dict[type, Callable[[str, Any, float], list[Outbound]]] = {
            m.Heartbeat: self._heartbeat,
            m.EncodeResult: core.on_encode_result,
            m.PrefillDone: lambda _, done, now: core.on_prefill_done(done, now),
            m.KvEvents: self._kv_events,
            m.TextDeltas: core.on_text_deltas,
            m.ErrorReply: core.on_error,
            m.HeldRequests: core.on_held,
            m.ExpertLoad: self._keep_expert_load,
            m.PlacementResult: lambda _, result, now: self._to_balancer(result),
        }
        table = {kind: self._from_member(event) for kind, event in from_members.items()}
        return {**table, m.Hello: self._welcome, m.ServiceExited: self._service_exited,
                m.PlacementUpdate: self._placement_update, m.DrainService: self._operator,
                m.ServiceQuery: self._operator}

    def _from_member(self, event: Callable[[str, Any, float], list[Outbound]] | None) -> Handler:
        """A handler for what only a welcomed service may send, and only about itself, fed to the core
        `event` (None: nothing a service may send)."""
        async def handle(ident: bytes, msg: Any) -> None:
            if ident not in self.greeted:
                await self._ask_hello(ident)
                return
            sender = ident.decode(errors="replace")
            if getattr(msg, SPEAKS_FOR.get(type(msg), ""), sender) != sender:
                self.forged += 1  # a message about another instance than the one sending it
                self.log.warning("message for another instance refused", type=type(msg).__name__, sender=sender)
            elif event is None:
                self.log.warning("unexpected service message", type=type(msg).__name__, sender=sender)
            else:
                await self._send(event(sender, msg, self._now()))
        return handle

    def _heartbeat(self, sender: str, hb: m.Heartbeat, now: float) -> list[Outbound]:
        out = self.core.on_heartbeat(hb, now) + self.drains.on_heartbeat(hb)
        inst = self.core.table.get(sender)
        if inst is not None and inst.incarnation == hb.incarnation and hb.sent_time:
            inst.clock_offset_s = hb.sent_time - time.time()  # for operators: hosts whose clocks are off
        return out

    def _kv_events(self, sender: str, events: m.KvEvents, now: float) -> list[Outbound]:
        out = self.core.on_kv_events(sender, events, now)
        for o in out:
            self.log.info("kv resync asked", publisher=o.dest, reason=o.msg.reason)
        return out

    # -- expert balancing --------------------------------------------------------------------

    def expert_status(self) -> dict[str, ExpertStatus]:
        """Per worker group that reported its expert load: its placement version and rank loads."""
        return {name: ExpertStatus(load.placement_version, tuple(load.rank_tokens),
                                   tuple(tuple(layer) for layer in load.rank_expert_tokens))
                for name, load in self.expert_load.items()}

    def _keep_expert_load(self, sender: str, load: m.ExpertLoad, now: float) -> list[Outbound]:
        self.expert_load[sender] = load
        self._record_expert_load(sender, load)
        return self._to_balancer(load)

    def _record_expert_load(self, sender: str, load: m.ExpertLoad) -> None:
        status = ExpertStatus(load.placement_version, tuple(load.rank_tokens),
                              tuple(tuple(layer) for layer in load.rank_expert_tokens))
        self.export.expert_load(sender, load, status.expert_max_over_mean)

    def _to_balancer(self, msg: Any) -> list[Outbound]:
        """`msg` to the welcomed balancer while it is alive (none, or a dead one: dropped; a balancer
        that comes back resumes from the next reports)."""
        if self.balancer is None:
            return []
        name = self.balancer.decode(errors="replace")
        inst = self.core.table.get(name)
        return [Outbound(name, msg)] if inst is not None and inst.alive else []

    async def _placement_update(self, ident: bytes, update: m.PlacementUpdate) -> None:
        """Only the welcomed balancer may move a group's experts: from anyone else it is forged."""
        if ident not in self.greeted:
            await self._ask_hello(ident)
        elif ident != self.balancer:
            self.forged += 1
            self.log.warning("placement update not from the balancer refused", sender=ident.decode(errors="replace"),
                             worker=update.worker)
        else:
            await self._send([Outbound(update.worker, update)])

    async def _service_exited(self, ident: bytes, note: m.ServiceExited) -> None:
        """A supervisor may say that any service exited; a service, only that it exits itself (a drain's goodbye).

        A goodbye is its sender's last message on its own connection, so all it sent before has been handled:
        it is acted on at once. A supervisor's note arrives on another connection, and the dead process's last
        messages (a final TextDeltas, an EncodeResult) may still be queued behind it on its own: the backend
        reads its connections in turn, and libzmq 4.3.5 without its draft API gives no per-peer disconnect
        notice to wait for. So the note is acted on EXIT_GRACE_S later, while the backend loop goes on reading:
        a request whose answer was already sent is answered, not moved or failed."""
        own = ident in self.greeted and ident == note.instance.encode()
        if own:
            await self._act_on_exit(note, own=True)
        elif ident.startswith(SUPERVISOR_PREFIX.encode()):
            self._exits.append((self._now() + EXIT_GRACE_S, note))

    async def _act_on_exit(self, note: m.ServiceExited, *, own: bool) -> None:
        self.log.info("service exited", instance=note.instance, pid=note.pid, code=note.returncode, own=own)
        cause = self.drains.on_exit(note)  # "drain" for a draining member's leftovers, else a death
        await self._send(self.core.on_service_exited(note, self._now(), cause))

    async def _act_on_due_exits(self) -> None:
        now = self._now()
        while self._exits and self._exits[0][0] <= now:
            await self._act_on_exit(self._exits.popleft()[1], own=False)

    async def _operator(self, ident: bytes, msg: m.DrainService | m.ServiceQuery) -> None:
        """An operator's drain or question (the `drain` command), answered with the member's ServiceStatus.
        Only from a supervisor identity (on a secured backend only the supervisor's key may claim one)."""
        sender = ident.decode(errors="replace")
        if not ident.startswith(SUPERVISOR_PREFIX.encode()):
            self.forged += 1
            self.log.warning("operator message not from a supervisor refused", type=type(msg).__name__,
                             sender=sender)
            return
        now = self._now()
        if isinstance(msg, m.DrainService):
            status, out = self.drains.on_drain_service(msg, now)
            self.log.info("drain asked", instance=msg.instance, timeout_s=msg.timeout_s, alive=status.alive,
                          held=status.held)
        else:
            status, out = self.drains.status(msg.instance, now, self.core.cache.index.blocks_by_tier(msg.instance)), []
        await self._send([*out, Outbound(sender, status)])

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

    async def _welcome(self, ident: bytes, hello: m.Hello) -> None:
        welcome = self.pins.check(hello, self.instance)
        if welcome.accepted and hello.instance.encode() != ident:
            welcome = dataclasses.replace(welcome, accepted=False,
                                          reason=f"Hello names {hello.instance!r}; its socket is {ident!r}")
        elif welcome.accepted and (hello.service == BALANCER_ROLE) != (hello.instance == BALANCER_NAME):
            # The role goes with the one name (which, on a secured backend, only the balancer's key may
            # use): any other service claiming it would receive every group's loads and move their experts.
            welcome = dataclasses.replace(welcome, accepted=False, reason=(
                f"only {BALANCER_NAME!r} is the {BALANCER_ROLE}; {hello.instance!r} says {hello.service!r}"))
        await asend_msg(self.backend, welcome, ident)
        if welcome.accepted:
            self.greeted.add(ident)
            self._asked.pop(ident, None)
            if hello.service == BALANCER_ROLE:
                self.balancer = ident
            elif ident == self.balancer:  # the name came back as something else
                self.balancer = None
            await self._send(self.core.on_hello(hello, self._now()))
        else:
            self.greeted.discard(ident)
            self.log.warning("refused", instance=hello.instance, reason=welcome.reason)

    # -- the timer --------------------------------------------------------------------------

    async def _tick_loop(self) -> None:
        logged = self._now()
        while True:
            await asyncio.sleep(TICK_S)
            await self._act_on_due_exits()
            await self._send(self.core.tick(self._now()))
            await self._flush_backlogs()
            self.ticks += 1
            if self.ticks % METRICS_EVERY_TICKS == 0:
                try:
                    self._record_state()
                except Exception:  # metrics never take the router down
                    self.log.exception("recording metrics failed")
            if self._now() - logged >= STATE_LOG_S:
                logged = self._now()
                self._log_state()

    def _record_state(self) -> None:
        metrics = self.core.metrics
        events = {"admitted": metrics.admitted, "retries": metrics.retries, "moves": metrics.moves,
                  "stale": metrics.stale, "kv_events": metrics.kv_events, "resyncs": metrics.resyncs,
                  "forged": self.forged, "malformed": self.malformed, "refused_deltas": metrics.refused_deltas,
                  "handoffs_adopted": metrics.handoffs_adopted, "drains_begun": self.drains.begun,
                  "drains_finished": self.drains.finished, "drains_timed_out": self.drains.timed_out}
        self.export.state(self.core.phase_counts(), len(self._backlog), events, self.core.table.instances.values())
        self.export.by_cause(metrics.shed, metrics.migrations, metrics.prefill_sites, metrics.resumes)
        self.export.ttft_predictions(metrics.ttft_over_predicted, metrics.tpot_over_predicted)

    def _log_state(self) -> None:
        """One line per period: what an operator (or bench/soak.py) watches for leaks and stalls."""
        workers = {i.name: f"{i.load.free_blocks}/{i.load.total_blocks}" for i in self.core.table.instances.values()
                   if i.load is not None and i.load.total_blocks}
        self.log.info("mesh state", inflight=self.core.num_inflight, free_blocks=workers,
                      live=sorted(i.name for i in self.core.table.instances.values() if i.alive),
                      moves=self.core.metrics.moves, malformed=self.malformed, forged=self.forged,
                      slow_clients=len(self._backlog), experts=self._expert_summary())

    def _expert_summary(self) -> dict[str, str]:
        """Per worker group: "v<placement version> experts max/mean <ratio> ranks <tokens,...>"."""
        return {name: f"v{st.placement_version} experts max/mean {st.expert_max_over_mean:.3f} ranks "
                      f"{','.join(map(str, st.rank_tokens))}" for name, st in self.expert_status().items()}
