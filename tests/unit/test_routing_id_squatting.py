"""On a CURVE-secured ROUTER an instance is addressed by the connection its key speaks from, never by a
routing id a peer chose. A peer holding another service's valid key that connects under the name of an
instance not connected at the moment (libzmq shows ZAP only the server's routing id, so nothing stops the
connection itself) receives nothing meant for that instance, is refused when it speaks, and does not keep
the real instance, which connects later, from being heard and answered."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import zmq

from deepinfer.protocol import ProtocolError
from deepinfer.protocol.auth import ClientAuth, KeyPair, ServerAuth, allow_list, secure_client
from deepinfer.protocol.messages import AbortRequest, Heartbeat
from deepinfer.protocol.sockets import make_dealer, make_router, recv_msg, recv_routed, send_msg

GUARD_MS = 10_000  # waits for what must arrive; nothing here is timed
QUIET_MS = 1_000  # how long "receives nothing" is watched


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def _endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _raw_dealer(ctx: zmq.Context, endpoint: str, routing_id: bytes, keys: KeyPair, server: bytes) -> zmq.Socket:
    """A peer choosing its routing id itself, as an attacker would (make_dealer adds a random suffix)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, routing_id)
    secure_client(sock, ClientAuth(keys, server))
    sock.connect(endpoint)
    return sock


def test_a_valid_key_under_an_absent_instance_name_gets_nothing_and_blocks_nothing(ctx: zmq.Context) -> None:
    endpoint = _endpoint()
    server, real, other = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
    allow = allow_list("test/backend", [(real.public, "tokenizer-0"), (other.public, "kvcache-0")])
    router = make_router(ctx, endpoint, auth=ServerAuth(server, allow))
    squatter = _raw_dealer(ctx, endpoint, b"tokenizer-0", other, server.public)
    # The squatter's connection is up (it can speak: its message is refused below); tokenizer-0 has never
    # spoken here, so a send to it has no route rather than reaching the squatter.
    send_msg(squatter, Heartbeat("kvcache", "tokenizer-0", "forged", 1, 1))
    assert router.poll(GUARD_MS)
    with pytest.raises(ProtocolError, match="not the sender"):
        recv_routed(router)
    assert allow.refused == 1
    with pytest.raises(zmq.ZMQError) as err:
        send_msg(router, AbortRequest("secret", "for tokenizer-0"), b"tokenizer-0")
    assert err.value.errno == zmq.EHOSTUNREACH

    # The real tokenizer-0 connects while the squatter still holds its bare name: heard, and answered.
    real_sock = make_dealer(ctx, endpoint, "tokenizer-0", auth=ClientAuth(real, server.public))
    assert real_sock.getsockopt(zmq.ROUTING_ID).startswith(b"tokenizer-0.")
    send_msg(real_sock, Heartbeat("tokenizer", "tokenizer-0", "real", 1, 1))
    assert router.poll(GUARD_MS)
    ident, msg = recv_routed(router)
    assert ident == b"tokenizer-0" and msg.incarnation == "real"
    send_msg(router, AbortRequest("r1", "for tokenizer-0"), b"tokenizer-0")
    assert real_sock.poll(GUARD_MS) and recv_msg(real_sock).request_id == "r1"
    assert not squatter.poll(QUIET_MS)

    # A restarted tokenizer-0 (a new socket, a new id) takes the route over with its first message.
    real_sock.close()
    again = make_dealer(ctx, endpoint, "tokenizer-0", auth=ClientAuth(real, server.public))
    send_msg(again, Heartbeat("tokenizer", "tokenizer-0", "restarted", 1, 1))
    assert router.poll(GUARD_MS) and recv_routed(router)[0] == b"tokenizer-0"
    send_msg(router, AbortRequest("r2", "for tokenizer-0"), b"tokenizer-0")
    assert again.poll(GUARD_MS) and recv_msg(again).request_id == "r2"
    assert not squatter.poll(QUIET_MS)


def test_an_unsecured_router_addresses_peers_by_the_id_they_chose(ctx: zmq.Context, tmp_path) -> None:
    endpoint = f"ipc://{tmp_path}/r.sock"
    router = make_router(ctx, endpoint)
    dealer = make_dealer(ctx, endpoint, "worker-0")
    assert dealer.getsockopt(zmq.ROUTING_ID) == b"worker-0"
    send_msg(dealer, Heartbeat("worker", "worker-0", "x", 1, 1))
    assert router.poll(GUARD_MS) and recv_routed(router)[0] == b"worker-0"
    send_msg(router, AbortRequest("r", "x"), b"worker-0")
    assert dealer.poll(GUARD_MS) and recv_msg(dealer).request_id == "r"
