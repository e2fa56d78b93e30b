"""CURVE authentication for tcp:// endpoints: key files, one allow-list per bound socket, and a ZAP handler.

* A **key pair** is two Z85 strings (40 characters each). On disk it is pyzmq's certificate format: `NAME.key`
  holds the public key, `NAME.key_secret` both keys; a secret file must be private (no group or other bits).
* Every bound socket that CURVE protects has its own ZAP domain and `AllowList`: the public keys that may connect,
  each mapped to the **identity rule** it authenticates: an instance name (the peer's routing id must be exactly
  that) or a prefix ending in "*" (the routing id must start with it: a supervisor's `supervisor-<pid>`, a
  client's `client-<key prefix>-<random>`).
* One `ZapHandler` thread per ZeroMQ context answers libzmq's authentication requests for every domain of that
  context. Its reply's user id is the identity rule, which libzmq attaches to every message of that connection
  ("User-Id"); `identity_allowed` checks it against the routing id a ROUTER saw (libzmq passes the *server's*
  routing id to ZAP, not the peer's, so the peer's claim can only be checked per message, in `sockets`).

Refusals are counted on the allow-list: ZAP's (a key not listed) by the handler, handshakes that never reach ZAP
(no CURVE at all, a wrong server key) from a socket monitor the handler thread reads, and routing ids a key does
not own by `sockets`. Logging is throttled per domain: a refused peer reconnects every 100 ms.

Invariants: a secured socket sets ZAP_ENFORCE_DOMAIN, so if no handler answers, libzmq refuses the connection
instead of letting any key in; a refused peer is counted on its allow-list and logged, never raised.
Only tcp:// is secured: ipc:// relies on its 0700 run directory, inproc:// never leaves the process.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import zmq
import zmq.auth
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

log = structlog.get_logger("deepinfer.auth")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by RFC 27: libzmq sends every context's ZAP requests here
CLIENT_IDENTITY_PREFIX = "client-"
_KEY_PREFIX_HEX = 16  # hex digits of a client's public key in its routing id (64 bits: not forgeable by search)
# The layout `deepinfer-launch keys` writes (see launch.keys); tenants' keys are kept apart from services' keys.
SERVICES_DIR, CLIENTS_DIR, CLIENTS_ALLOWED, CLIENT_KEY_NAME = "services", "clients", "allowed", "client"
ROUTER_KEY_NAME = "router"
REFUSAL_LOG_PERIOD_S = 1.0  # at most one "peer refused" line per domain per period (the count is in each line)
# Handshake failures that never reach ZAP (ZAP's own refusals, EVENT_HANDSHAKE_FAILED_AUTH, are counted there).
_FAILED_BEFORE_ZAP = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
_POLL_MS = 100  # how soon the handler thread takes up a newly watched socket's monitor


def secured(endpoint: str) -> bool:
    """Whether an endpoint is one CURVE protects (tcp only)."""
    return endpoint.startswith("tcp://")


@dataclass(frozen=True)
class KeyPair:
    """A CURVE key pair, both halves Z85-encoded (40 bytes)."""

    public: bytes
    secret: bytes = field(repr=False)

    @classmethod
    def generate(cls) -> KeyPair:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    @classmethod
    def load(cls, secret_file: str | os.PathLike[str]) -> KeyPair:
        """Read `NAME.key_secret`; refuses a file others may read (it would let them impersonate us)."""
        mode = os.stat(secret_file).st_mode
        if mode & 0o077:
            raise PermissionError(f"{secret_file}: a secret key file must be private (chmod 600), mode is {mode:o}")
        public, secret = zmq.auth.load_certificate(secret_file)
        if secret is None:
            raise ValueError(f"{secret_file}: no secret key in it")
        return cls(public, secret)

    def save(self, directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
        """Write `NAME.key` (0644) and `NAME.key_secret` (0600, created private: never readable by others)."""
        base = Path(directory) / name
        public_file, secret_file = base.with_name(name + ".key"), base.with_name(name + ".key_secret")
        _write_private(secret_file, _certificate(self.public, self.secret), 0o600)
        _write_private(public_file, _certificate(self.public, None), 0o644)
        return public_file, secret_file


def load_public_key(path: str | os.PathLike[str]) -> bytes:
    """The public key of a `NAME.key` (or `NAME.key_secret`) file."""
    public, _ = zmq.auth.load_certificate(path)
    return public


def _certificate(public: bytes, secret: bytes | None) -> str:
    lines = ["#   ZeroMQ CURVE certificate (deepinfer-launch keys)", "metadata", "curve",
             f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def _write_private(path: Path, text: str, mode: int) -> None:
    """Write a file through a temporary created with `mode` (never a moment world-readable), then rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)  # the umask may have cleared bits of `mode`
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def client_identity_prefix(public_key: bytes) -> str:
    """The routing-id prefix a client with this key must use: ties its replies to its key (see module doc)."""
    return CLIENT_IDENTITY_PREFIX + z85.decode(public_key).hex()[:_KEY_PREFIX_HEX] + "-"


def identity_allowed(rule: str, identity: bytes) -> bool:
    """Whether a routing id is one the authenticated key may claim (`rule` is the ZAP user id)."""
    if rule.endswith("*"):
        return identity.startswith(rule[:-1].encode())
    return identity == rule.encode()


class AllowList:
    """Who may connect to one bound socket: public key (Z85) → identity rule. Counts whom it refused."""

    def __init__(self, domain: str, rules: Mapping[bytes, str] | None = None) -> None:
        self.domain = domain
        self.rules: dict[bytes, str] = dict(rules or {})
        # The exact rules: instance names, which a secured ROUTER addresses only by the connection a key spoke
        # from (see `sockets`); prefix rules are clients' own key-bound ids.
        self.instances: set[bytes] = {r.encode() for r in self.rules.values() if not r.endswith("*")}
        # Connections refused (no CURVE, or a key not on the list) plus messages whose sender claimed a
        # routing id its key does not own.
        self.refused = 0
        self._lock = threading.Lock()
        self._logged_at = -REFUSAL_LOG_PERIOD_S

    def allow(self, public_key: bytes, rule: str) -> None:
        self.rules[public_key] = rule
        if not rule.endswith("*"):
            self.instances.add(rule.encode())

    def rule_for(self, public_key: bytes) -> str | None:
        return self.rules.get(public_key)

    def refuse(self, reason: str, **fields: Any) -> None:
        now = time.monotonic()
        with self._lock:
            self.refused += 1
            quiet = now - self._logged_at < REFUSAL_LOG_PERIOD_S
            if not quiet:
                self._logged_at = now
        if not quiet:
            log.warning("peer refused", domain=self.domain, reason=reason, refused=self.refused, **fields)


@dataclass(frozen=True)
class ServerAuth:
    """A bound socket's side: its key pair and who may connect."""

    keypair: KeyPair
    allow: AllowList


@dataclass(frozen=True)
class ClientAuth:
    """A connecting socket's side: its own key pair and the public key of the server it connects to."""

    keypair: KeyPair
    server_key: bytes


@dataclass(frozen=True)
class ServiceAuth:
    """Everything one service instance needs: its key pair, the public keys of the servers it connects to (by
    instance name) and the allow-list of each socket it binds (by socket name: "frontend", "backend", "kv",
    "detok", "cache"). `NO_AUTH` (keypair None) secures nothing: today's behaviour."""

    keypair: KeyPair | None = None
    server_keys: Mapping[str, bytes] = field(default_factory=dict)
    allow: Mapping[str, AllowList] = field(default_factory=dict)

    def for_bind(self, endpoint: str, socket_name: str) -> ServerAuth | None:
        if self.keypair is None or not secured(endpoint):
            return None
        return ServerAuth(self.keypair, self.allow[socket_name])

    def for_connect(self, endpoint: str, server: str) -> ClientAuth | None:
        if self.keypair is None or not secured(endpoint):
            return None
        if server not in self.server_keys:
            raise KeyError(f"no public key for {server!r}: run `deepinfer-launch keys` for this topology")
        return ClientAuth(self.keypair, self.server_keys[server])

    @property
    def refused(self) -> int:
        """Peers refused on every socket this instance binds."""
        return sum(a.refused for a in self.allow.values())


NO_AUTH = ServiceAuth()


# --- applying it to sockets -----------------------------------------------------------------------------------


def secure_server(sock: Any, auth: ServerAuth) -> None:
    """Make a socket (before bind) a CURVE server under `auth.allow`'s ZAP domain, answered by its context's
    handler (started here if needed)."""
    handler = ZapHandler.for_context(sock.context)
    handler.add(auth.allow)
    handler.watch(sock, auth.allow)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, auth.keypair.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, auth.keypair.public)
    sock.setsockopt(zmq.ZAP_DOMAIN, auth.allow.domain.encode())
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no handler → refuse, never "encrypted but anyone"
    if sock.type == zmq.ROUTER:
        # A peer's key is checked at the handshake, its routing id only per message: without handover an
        # impostor cannot take over the routing id of a connected peer (and receive what is sent to it).
        sock.setsockopt(zmq.ROUTER_HANDOVER, 0)


def secure_client(sock: Any, auth: ClientAuth) -> None:
    """Make a socket (before connect) a CURVE client of the server whose public key `auth` names."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, auth.server_key)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, auth.keypair.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, auth.keypair.secret)


def sender_rule(frame: Any) -> str | None:
    """The identity rule ZAP attached to a received frame's connection, or None if it has none."""
    try:
        return frame.get("User-Id")
    except zmq.ZMQError:  # no metadata (inproc) or no such property
        return None


class ZapHandler:
    """Answers ZAP requests for one context on a thread of its own (a service's event loop may be busy; the
    handshake must not wait for it). The thread ends when the context is terminated."""

    _by_context: dict[int, ZapHandler] = {}
    _registry_lock = threading.Lock()

    def __init__(self, ctx: zmq.Context) -> None:
        self._address = ctx.underlying
        self._domains: dict[str, AllowList] = {}
        self._new_monitors: queue.SimpleQueue[tuple[Any, AllowList]] = queue.SimpleQueue()
        self._ctx = zmq.Context.shadow(ctx.underlying)  # a sync view of the same context, for this thread
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError:
            self._sock.close()
            raise RuntimeError("another ZAP handler is already bound in this ZeroMQ context") from None
        self._thread = threading.Thread(target=self._serve, name="zap-handler", daemon=True)
        self._thread.start()

    @classmethod
    def for_context(cls, ctx: zmq.Context) -> ZapHandler:
        with cls._registry_lock:
            handler = cls._by_context.get(ctx.underlying)
            if handler is None:
                handler = cls._by_context[ctx.underlying] = cls(ctx)
            return handler

    def add(self, allow: AllowList) -> None:
        known = self._domains.get(allow.domain)
        if known is not None and known is not allow:
            raise ValueError(f"ZAP domain {allow.domain!r} is already taken in this context")
        self._domains[allow.domain] = allow

    _monitor_ids = itertools.count()

    def watch(self, sock: Any, allow: AllowList) -> None:
        """Count `sock`'s handshakes that fail before ZAP on `allow`. The monitor's PAIR is connected here, so no
        event is lost, and handed to the handler thread (the queue is the memory barrier a socket's move needs)."""
        endpoint = f"inproc://deepinfer-auth-monitor-{os.getpid()}-{next(self._monitor_ids)}"
        sock.monitor(endpoint, _FAILED_BEFORE_ZAP | zmq.EVENT_MONITOR_STOPPED)
        pair = self._ctx.socket(zmq.PAIR)
        pair.setsockopt(zmq.LINGER, 0)
        pair.connect(endpoint)
        self._new_monitors.put((pair, allow))

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        monitors: dict[Any, AllowList] = {}
        try:
            while True:
                while not self._new_monitors.empty():
                    pair, allow = self._new_monitors.get()
                    monitors[pair] = allow
                    poller.register(pair, zmq.POLLIN)
                ready = dict(poller.poll(_POLL_MS))
                if self._sock in ready:
                    self._sock.send_multipart(self._answer(self._sock.recv_multipart()))
                for pair in [p for p in monitors if p in ready]:
                    event = parse_monitor_message(pair.recv_multipart())
                    if event["event"] == zmq.EVENT_MONITOR_STOPPED:  # its socket closed
                        poller.unregister(pair)
                        del monitors[pair]
                        pair.close(linger=0)
                    else:
                        monitors[pair].refuse("handshake failed (no CURVE, or not this server's key)",
                                              address=event["endpoint"].decode(errors="replace"))
        except zmq.ContextTerminated:
            pass
        finally:
            with self._registry_lock:  # before the sockets close, hence before term() can return
                if self._by_context.get(self._address) is self:
                    del self._by_context[self._address]
            for pair in monitors:
                pair.close(linger=0)
            while not self._new_monitors.empty():
                self._new_monitors.get()[0].close(linger=0)
            self._sock.close(linger=0)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        """RFC 27: version, request id, domain, address, identity, mechanism, credentials…"""
        if len(request) < 6:
            log.warning("malformed ZAP request", frames=len(request))
            return [b"1.0", request[1] if len(request) > 1 else b"", b"500", b"malformed request", b"", b""]
        request_id, domain, address, mechanism, credentials = request[1], request[2], request[3], request[5], \
            request[6:]

        def reply(code: bytes, text: bytes, user: str = "") -> list[bytes]:
            return [b"1.0", request_id, code, text, user.encode(), b""]

        allow = self._domains.get(domain.decode(errors="replace"))
        if allow is None:
            if not domain and mechanism == b"NULL":
                return reply(b"200", b"OK")  # an unsecured socket (ipc) that shares this context
            log.warning("ZAP request for an unknown domain refused", domain=domain, address=address)
            return reply(b"400", b"unknown domain")
        if mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
            allow.refuse("no CURVE key", mechanism=mechanism.decode(errors="replace"), address=address.decode())
            return reply(b"400", b"CURVE required")
        key = z85.encode(credentials[0])
        rule = allow.rule_for(key)
        if rule is None:
            allow.refuse("key not allowed", key=key.decode(), address=address.decode())
            return reply(b"400", b"key not allowed")
        return reply(b"200", b"OK", rule)


def allow_list(domain: str, entries: Iterable[tuple[bytes, str]]) -> AllowList:
    """An AllowList from (public key, identity rule) pairs."""
    return AllowList(domain, dict(entries))


def read_client_keys(path: str | os.PathLike[str]) -> list[bytes]:
    """A client allow-list file: one Z85 public key per line, optionally followed by a name; comment lines start
    with "# " (a hash and a space: `#` alone is a Z85 digit, a space never is)."""
    keys: list[bytes] = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        text = line.strip()
        if not text or text == "#" or text.startswith("# "):
            continue
        key = text.split()[0].encode()
        if len(key) != 40:
            raise ValueError(f"{path}:{number}: not a Z85 CURVE public key (40 characters)")
        keys.append(key)
    return keys


def client_allow_list(domain: str, client_keys: Iterable[bytes]) -> AllowList:
    """A client front's allow-list: each key may claim only routing ids under its own prefix."""
    return AllowList(domain, {k: client_identity_prefix(k) + "*" for k in client_keys})


def load_client_keys(keys_dir: str | os.PathLike[str], name: str = CLIENT_KEY_NAME) -> tuple[KeyPair, bytes]:
    """A tenant's key pair (`clients/NAME.key_secret`) and the router's public key, from a keys directory:
    `Client(endpoint, curve_keys=pair, server_key=router_key)`."""
    root = Path(keys_dir)
    return (KeyPair.load(root / CLIENTS_DIR / f"{name}.key_secret"),
            load_public_key(root / SERVICES_DIR / f"{ROUTER_KEY_NAME}.key"))
