"""One socket kind per edge (DESIGN §3), configured alike, plus send/receive of whole messages.

* RPC: DEALER (connects, identity = instance name) → ROUTER (binds). ROUTER_MANDATORY makes a send to an
  identity that is not connected raise EHOSTUNREACH instead of dropping the message silently;
  ROUTER_HANDOVER: on ipc:// and inproc:// (peers are this user's processes) a restarted peer takes its
  routing id over at once. On a CURVE-secured ROUTER it is off, so no other key can take a connected peer's
  id (and the replies meant for it); the price is that libzmq parks a newcomer whose id is still held, unread,
  until it reconnects — a service whose old connection outlives it (a crashed host, a half-open TCP) times out
  its handshake and is restarted; the restart's new connection gets the id once the bound side has dropped
  the dead one, which its ZMTP heartbeats (below) do within BOUND_HEARTBEAT_TIMEOUT_MS of the peer going silent.
* pipelines: PUSH → PULL; broadcasts that may be lost: PUB → SUB (subscribe with `type_frame(Cls)` to get
  one message type). The long-lived side binds.
* every bound socket: ZMTP heartbeats (HEARTBEAT_IVL / HEARTBEAT_TIMEOUT). libzmq's I/O thread PINGs each
  connected peer and closes a connection that sends nothing back (not even the PONG, which the peer's I/O
  thread answers whatever its Python is doing) for BOUND_HEARTBEAT_TIMEOUT_MS. Without them nothing on the
  bound side ever drops a dead TCP peer (a crashed host, a half-open connection): TCP itself may never give
  up when nothing is sent, and with handover off the dead connection would hold its routing id for good.
* ... except a bound socket whose peers are untrusted (`bound_heartbeats=False`: the router's client front).
  libzmq 4.3.5 aborts the whole process (`Assertion failed: !_io_error (stream_engine_base.cpp:310)`) when a
  bound socket's heartbeat timer fires on a connection whose peer went away while its receive pipe was full
  (RCVHWM messages unread: the engine had stopped reading): the timer writes a PING on an engine already
  marked broken. Any client could do that at will: flood the front faster than the router reads, then
  disconnect. Without bound heartbeats the broken engine waits for the router to drain the pipe and then
  closes cleanly. Dead clients are dropped all the same: our clients send their own PINGs with a TTL
  (client_session.HEARTBEAT_TTL_MS), and TCP keepalive (FRONT_KEEPALIVE_*) drops a dead host's connection
  whoever the client is. Sockets whose peers are mesh members keep their heartbeats (they drop a dead
  member's connection, above); there the abort needs a member that falls RCVHWM messages behind and dies.
* every socket: LINGER 0 (closing never blocks on unsent messages: request-level deadlines recover them),
  SNDHWM/RCVHWM, and MAXMSGSIZE = limits.socket_frame_limit (libzmq applies it per frame and drops a peer
  that exceeds it, before we ever see the data). That is max_frame, except where one connection carries
  several callers' requests (the client front): there it is a higher memory ceiling, and the decoder refuses
  what is between the two per message (see `protocol.limits`).
* a message a ROUTER cannot decode raises ProtocolError carrying the sender (`peer`) and, when a bounded look
  at the payload's first bytes finds one, the message's `request_id` (`framing.peek_request_id`): the
  service answers that request with a typed error and nothing else on the connection is touched.

* CURVE (tcp:// only, see `protocol.auth`): a bound socket given `auth=ServerAuth` authenticates every peer
  against its allow-list; a connecting one given `auth=ClientAuth` proves its key to the server. On a secured
  ROUTER, `recv_routed` also refuses a message whose routing id is not one the sender's key may claim
  (ProtocolError "unauthenticated", counted on the allow-list), so the identity a service sees is authenticated.
  libzmq shows ZAP the server's routing id, not the peer's, so a routing id cannot be bound to a key when a
  peer connects: a key may hold any id nobody holds. So on a secured edge an instance is never *addressed* by
  an id it chose: its DEALER's id is its name plus a random suffix (`make_dealer`: no other key can occupy
  it), the ROUTER learns from each authenticated message which connection speaks for which instance, and a
  send to an instance's name goes to that connection — or raises EHOSTUNREACH if the instance has not spoken
  on this socket, never to a connection another key opened under its name.

The factories take either a `zmq.Context` or a `zmq.asyncio.Context` and return that context's socket kind.
A socket belongs to the task or thread that made it. Sync helpers (`send_msg`, `recv_msg`, `recv_routed`)
work on sync sockets, the `a*` coroutines on asyncio sockets; all receive with copy=False so buffer frames
(tensors) arrive without a copy.
"""

from __future__ import annotations

import secrets
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import zmq

from deepinfer.protocol.auth import (
    AllowList,
    ClientAuth,
    ServerAuth,
    identity_allowed,
    secure_client,
    secure_server,
    sender_rule,
)
from deepinfer.protocol.errors import ProtocolError
from deepinfer.protocol.framing import decode_frames, encode_frames, peek_request_id
from deepinfer.protocol.limits import DEFAULT_LIMITS, Limits

DEFAULT_HWM = 1000  # messages queued per peer before send blocks (or PUB drops)
# ZMTP heartbeats on bound sockets (see the module docstring). A PING each second, like the client's
# (protocol.client.HEARTBEAT_IVL_MS); a peer silent for 5 s, the router's own default `heartbeat_timeout_s`
# after which it declares the instance dead anyway, loses its connection and so its routing id. No TTL: the
# connecting side keeps its own choice (the client sets one; services rely on the router's heartbeats).
BOUND_HEARTBEAT_IVL_MS = 1000
BOUND_HEARTBEAT_TIMEOUT_MS = 5000
# TCP keepalive on a bound socket without ZMTP heartbeats (see the module docstring): a connection silent for
# IDLE seconds is probed every INTVL seconds and dropped by the kernel after CNT unanswered probes.
FRONT_KEEPALIVE_IDLE_S, FRONT_KEEPALIVE_INTVL_S, FRONT_KEEPALIVE_CNT = 30, 5, 3


def _new(ctx: zmq.Context, kind: int, hwm: int, limits: Limits) -> Any:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, limits.socket_frame_limit)
    return sock


def _attach(sock: Any, bind: str | None, connect: str | Sequence[str] | None,
            auth: ServerAuth | ClientAuth | None = None, *, bound_heartbeats: bool = True) -> Any:
    """Secure (with `auth`: ServerAuth to bind, ClientAuth to connect), then bind or connect (exactly one);
    closes the socket if that fails so no half-made socket leaks. A bound socket gets ZMTP heartbeats, or
    with bound_heartbeats=False TCP keepalive instead (see the module docstring)."""
    if (bind is None) == (connect is None):
        sock.close()
        raise ValueError("give exactly one of bind= or connect=")
    try:
        if isinstance(auth, ServerAuth):
            if bind is None:
                raise ValueError("ServerAuth secures a bound socket")
            secure_server(sock, auth)
            _ALLOW_LISTS[sock] = auth.allow
            if sock.type == zmq.ROUTER:
                _ROUTES[sock] = {}
        elif isinstance(auth, ClientAuth):
            if connect is None:
                raise ValueError("ClientAuth secures a connecting socket")
            secure_client(sock, auth)
        if bind is not None:
            # Copied into each connection when it is made: set before bind.
            if bound_heartbeats:
                sock.setsockopt(zmq.HEARTBEAT_IVL, BOUND_HEARTBEAT_IVL_MS)
                sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, BOUND_HEARTBEAT_TIMEOUT_MS)
            else:
                sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
                sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, FRONT_KEEPALIVE_IDLE_S)
                sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, FRONT_KEEPALIVE_INTVL_S)
                sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, FRONT_KEEPALIVE_CNT)
            sock.bind(bind)
        else:
            for endpoint in [connect] if isinstance(connect, str) else connect:
                sock.connect(endpoint)
    except BaseException:
        sock.close()
        raise
    return sock


def make_router(ctx: zmq.Context, bind: str, *, hwm: int = DEFAULT_HWM, limits: Limits = DEFAULT_LIMITS,
                auth: ServerAuth | None = None, bound_heartbeats: bool = True) -> Any:
    """The bound side of an RPC edge. Sends need the peer's identity; see `recv_routed`. Secured (`auth`),
    handover is off and a routing id is also checked per message against the key that authenticated it.
    bound_heartbeats=False for untrusted peers (the client front): TCP keepalive instead of ZMTP heartbeats,
    which libzmq 4.3.5 can turn into an abort (see the module docstring)."""
    sock = _new(ctx, zmq.ROUTER, hwm, limits)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # secure_server turns it off
    return _attach(sock, bind, None, auth, bound_heartbeats=bound_heartbeats)


def make_dealer(
    ctx: zmq.Context,
    connect: str | Sequence[str],
    identity: str | bytes,
    *,
    hwm: int = DEFAULT_HWM,
    limits: Limits = DEFAULT_LIMITS,
    auth: ClientAuth | None = None,
) -> Any:
    """The connecting side of an RPC edge, known to the ROUTER by `identity` (the instance name)."""
    ident = identity.encode() if isinstance(identity, str) else bytes(identity)
    # libzmq reserves identities starting with a zero byte for ones it generates itself.
    if not 0 < len(ident) <= 255 or ident[0] == 0:
        raise ValueError(f"identity must be 1..255 bytes not starting with \\x00, got {ident!r}")
    if auth is not None:
        # Secured, the server names this peer by its key, not by this id (see the module docstring): the id
        # only has to be one no other key can occupy, and a restarted process must not find its old one held.
        ident = ident[: 255 - 1 - 2 * _SUFFIX_BYTES] + b"." + secrets.token_hex(_SUFFIX_BYTES).encode()
    sock = _new(ctx, zmq.DEALER, hwm, limits)
    sock.setsockopt(zmq.ROUTING_ID, ident)
    if auth is not None:  # also when connecting later (connect=[]): the options must precede the connect
        secure_client(sock, auth)
    return _attach(sock, None, connect)


def make_push(
    ctx: zmq.Context,
    *,
    bind: str | None = None,
    connect: str | Sequence[str] | None = None,
    hwm: int = DEFAULT_HWM,
    limits: Limits = DEFAULT_LIMITS,
    auth: ServerAuth | ClientAuth | None = None,
) -> Any:
    return _attach(_new(ctx, zmq.PUSH, hwm, limits), bind, connect, auth)


def make_pull(
    ctx: zmq.Context,
    *,
    bind: str | None = None,
    connect: str | Sequence[str] | None = None,
    hwm: int = DEFAULT_HWM,
    limits: Limits = DEFAULT_LIMITS,
    auth: ServerAuth | ClientAuth | None = None,
) -> Any:
    return _attach(_new(ctx, zmq.PULL, hwm, limits), bind, connect, auth)


def make_pub(
    ctx: zmq.Context,
    *,
    bind: str | None = None,
    connect: str | Sequence[str] | None = None,
    hwm: int = DEFAULT_HWM,
    limits: Limits = DEFAULT_LIMITS,
) -> Any:
    """Messages beyond the HWM are dropped: subscribers detect gaps by sequence numbers and replay."""
    return _attach(_new(ctx, zmq.PUB, hwm, limits), bind, connect)


def make_sub(
    ctx: zmq.Context,
    *,
    bind: str | None = None,
    connect: str | Sequence[str] | None = None,
    topics: Iterable[bytes] = (b"",),
    hwm: int = DEFAULT_HWM,
    limits: Limits = DEFAULT_LIMITS,
) -> Any:
    """`topics` are prefixes of the first frame: b"" for everything, `type_frame(Cls)` for one type."""
    sock = _new(ctx, zmq.SUB, hwm, limits)
    for topic in topics:
        sock.setsockopt(zmq.SUBSCRIBE, topic)
    return _attach(sock, bind, connect)


# --- whole messages -------------------------------------------------------------------------------------------


def _frames(msg: Any, identity: bytes | None, limits: Limits) -> list:
    frames: list = encode_frames(msg, limits)
    if identity is not None:
        frames.insert(0, identity)
    return frames


# The allow-list of each secured bound socket, for the per-message routing-id check (weak: closing and dropping
# a socket forgets it).
_ALLOW_LISTS: weakref.WeakKeyDictionary[Any, AllowList] = weakref.WeakKeyDictionary()
# Each secured ROUTER's routes: instance name -> the routing id of the connection whose key last spoke for it.
_ROUTES: weakref.WeakKeyDictionary[Any, dict[bytes, bytes]] = weakref.WeakKeyDictionary()
_SUFFIX_BYTES = 8  # random bytes (hex) after a secured DEALER's name: 64 bits, not guessed


def _routed(sock: Any, frames: list, limits: Limits) -> tuple[bytes, Any]:
    identity = frames[0].bytes
    allow = _ALLOW_LISTS.get(sock)
    if allow is not None:
        rule = sender_rule(frames[-1])
        routes = _ROUTES.get(sock)
        name = rule.encode() if rule is not None and not rule.endswith("*") else None
        if name is not None and routes is not None and (identity == name or identity.startswith(name + b".")):
            # An instance, known by its key: the application sees its name, and replies go to this connection.
            routes[name] = identity
            identity = name
        elif rule is None or not identity_allowed(rule, identity):
            allow.refuse("routing id not owned by the sender's key", identity=identity.decode(errors="replace"),
                         key_owner=rule)
            # No `peer`: nothing is sent back to an identity the sender does not own.
            raise ProtocolError("unauthenticated", f"routing id {identity!r} is not the sender's ({rule})")
    try:
        return identity, decode_frames(frames[1:], limits)
    except ProtocolError as e:
        e.peer = identity
        e.request_id = peek_request_id(frames[1:])
        raise


def _address(sock: Any, identity: bytes | None) -> bytes | None:
    """The routing id to send `identity`'s messages to: on a secured ROUTER an instance's name becomes the
    connection its key spoke from (EHOSTUNREACH if it has not spoken here); any other id (a client's own
    key-bound one) passes, since only an id a key may claim ever reached the application. O(1): it runs for
    every message a router sends."""
    routes = _ROUTES.get(sock)
    if routes is None or identity is None:
        return identity
    route = routes.get(identity)
    if route is not None:
        return route
    if identity in _ALLOW_LISTS[sock].instances:
        raise zmq.ZMQError(zmq.EHOSTUNREACH)
    return identity


def _not_router(sock: Any) -> None:
    if sock.type == zmq.ROUTER:
        raise TypeError("a ROUTER socket prefixes the sender's identity: use recv_routed / arecv_routed")


def send_msg(
    sock: zmq.Socket,
    msg: Any,
    identity: bytes | None = None,
    *,
    flags: int = 0,
    track: bool = False,
    limits: Limits = DEFAULT_LIMITS,
) -> zmq.MessageTracker | None:
    """Send `msg` (to `identity` on a ROUTER). Buffer frames go zero-copy: with track=True the returned
    tracker tells when their memory may be reused. A ROUTER send to an unknown identity raises
    zmq.ZMQError(EHOSTUNREACH)."""
    return sock.send_multipart(_frames(msg, _address(sock, identity), limits), flags=flags, copy=False, track=track)


def recv_msg(sock: zmq.Socket, *, flags: int = 0, limits: Limits = DEFAULT_LIMITS) -> Any:
    """Receive and decode one message (not on a ROUTER). Raises ProtocolError for a malformed one — the
    whole multipart message is consumed either way, so the socket stays in step."""
    _not_router(sock)
    return decode_frames(sock.recv_multipart(flags=flags, copy=False), limits)


def recv_routed(sock: zmq.Socket, *, flags: int = 0, limits: Limits = DEFAULT_LIMITS) -> tuple[bytes, Any]:
    """Receive (sender identity, message) on a ROUTER; a ProtocolError carries the sender in `.peer` and the
    refused message's request id, when it can be read, in `.request_id`."""
    return _routed(sock, sock.recv_multipart(flags=flags, copy=False), limits)


async def asend_msg(
    sock: Any, msg: Any, identity: bytes | None = None, *, flags: int = 0, track: bool = False,
    limits: Limits = DEFAULT_LIMITS,
) -> zmq.MessageTracker | None:
    """`send_msg` for a zmq.asyncio socket (with flags=zmq.NOBLOCK a full queue raises zmq.Again at once)."""
    return await sock.send_multipart(_frames(msg, _address(sock, identity), limits), flags=flags, copy=False,
                                     track=track)


async def arecv_msg(sock: Any, *, limits: Limits = DEFAULT_LIMITS) -> Any:
    """`recv_msg` for a zmq.asyncio socket."""
    _not_router(sock)
    return decode_frames(await _arecv_frames(sock), limits)


async def arecv_routed(sock: Any, *, limits: Limits = DEFAULT_LIMITS) -> tuple[bytes, Any]:
    """`recv_routed` for a zmq.asyncio socket."""
    return _routed(sock, await _arecv_frames(sock), limits)


async def _arecv_frames(sock: Any) -> list[zmq.Frame]:
    """The next whole message's frames. pyzmq's asyncio receive reads once when libzmq reports the socket
    readable and hands a failed read to the waiter, but a report can come with nothing to read: a bound CURVE
    socket with ZMTP heartbeats reports one as a connecting peer's handshake and heartbeats complete (seen on
    libzmq 4.3.5, pyzmq 27). No socket here has a receive timeout, so zmq.Again only ever means that: wait
    again (each wait re-arms on the socket's next event, so this never spins)."""
    while True:
        try:
            return await sock.recv_multipart(copy=False)
        except zmq.Again:
            continue
