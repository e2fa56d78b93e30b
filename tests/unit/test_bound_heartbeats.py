"""Bound sockets drop a silent peer (ZMTP heartbeats, sockets.BOUND_HEARTBEAT_*): on a CURVE-secured ROUTER,
where handover is off, that is what lets a restarted service reclaim its routing id from a dead connection.

The dead peer is a DEALER in a child process that connects, says one message and is then SIGSTOPped: its
TCP connection stays open (the kernel still acknowledges) but its libzmq I/O thread answers no PING, like
a hung or partitioned host. (A newcomer that connected while the id was held stays parked even after: libzmq
never retries it, so a service's restart, a new connection, is what reclaims the id.) The waits below are
guards, not timings."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from deepinfer.protocol.auth import ClientAuth, KeyPair, ServerAuth, allow_list
from deepinfer.protocol.messages import Heartbeat
from deepinfer.protocol.sockets import (
    BOUND_HEARTBEAT_IVL_MS,
    BOUND_HEARTBEAT_TIMEOUT_MS,
    make_dealer,
    make_pull,
    make_router,
    recv_msg,
    recv_routed,
    send_msg,
)

GUARD_S = 60.0  # far beyond BOUND_HEARTBEAT_TIMEOUT_MS: only a hang fails on it
RETRY_S = 3.0  # a restarted peer not heard this long is restarted again (as a service's handshake times out)

_CHILD = textwrap.dedent("""
    import sys, time
    import zmq
    from deepinfer.protocol.auth import ClientAuth, KeyPair
    from deepinfer.protocol.messages import Heartbeat
    from deepinfer.protocol.sockets import make_dealer, send_msg
    endpoint, public, secret, server = sys.argv[1:5]
    ctx = zmq.Context()
    sock = make_dealer(ctx, endpoint, "worker-0",
                       auth=ClientAuth(KeyPair(public.encode(), secret.encode()), server.encode()))
    send_msg(sock, Heartbeat(service="worker", instance="worker-0", incarnation="old", seq=1, progress=0))
    print("sent", flush=True)
    while True:
        time.sleep(1)
""")


def _free_tcp() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_bound_sockets_carry_zmtp_heartbeats(tmp_path) -> None:
    ctx = zmq.Context()
    try:
        bound = [make_router(ctx, _free_tcp()), make_router(ctx, f"ipc://{tmp_path}/r"),
                 make_pull(ctx, bind=_free_tcp())]
        for sock in bound:
            assert sock.getsockopt(zmq.HEARTBEAT_IVL) == BOUND_HEARTBEAT_IVL_MS
            assert sock.getsockopt(zmq.HEARTBEAT_TIMEOUT) == BOUND_HEARTBEAT_TIMEOUT_MS
        server = KeyPair.generate()
        secured = make_router(ctx, _free_tcp(), auth=ServerAuth(server, allow_list("t/hb", [])))
        assert secured.getsockopt(zmq.HEARTBEAT_IVL) == BOUND_HEARTBEAT_IVL_MS
        assert secured.getsockopt(zmq.HEARTBEAT_TIMEOUT) == BOUND_HEARTBEAT_TIMEOUT_MS
    finally:
        ctx.destroy(linger=0)


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs SIGSTOP")
def test_a_silent_peer_is_dropped_and_its_restart_reclaims_the_routing_id_on_a_secured_router(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from deepinfer.protocol import sockets

    # The mechanism, on shorter heartbeats than the shipped ones (the test above checks those are what binds).
    monkeypatch.setattr(sockets, "BOUND_HEARTBEAT_IVL_MS", 200)
    monkeypatch.setattr(sockets, "BOUND_HEARTBEAT_TIMEOUT_MS", 1000)
    endpoint = _free_tcp()
    server, worker = KeyPair.generate(), KeyPair.generate()
    allow = allow_list("test/backend", [(worker.public, "worker-0")])
    ctx = zmq.Context()
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, endpoint, worker.public.decode(), worker.secret.decode(),
         server.public.decode()], stdout=subprocess.PIPE, text=True)
    try:
        router = make_router(ctx, endpoint, auth=ServerAuth(server, allow))
        monitor = router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        assert router.poll(GUARD_S * 1000), "the first worker-0 never spoke"
        identity, msg = recv_routed(router)
        assert (identity, msg.incarnation) == (b"worker-0", "old")
        child.send_signal(signal.SIGSTOP)  # its connection stays open, its PONGs stop

        # The router's heartbeats close the silent connection...
        deadline = time.monotonic() + GUARD_S
        while True:
            left = deadline - time.monotonic()
            assert left > 0 and monitor.poll(left * 1000), "the silent peer's connection was never closed"
            if recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED:
                break
        # ... so the restarted worker-0 (same key, same routing id, a new connection), which libzmq would park
        # for as long as the dead connection held its id (handover is off), gets through. The router learns of
        # the closed connection a moment after the monitor does; a newcomer that comes in between is parked
        # for good, so, like a service whose handshake timed out, it is restarted: each try is a new connection.
        deadline = time.monotonic() + GUARD_S
        while True:
            assert time.monotonic() < deadline, "the restarted worker-0 was never heard"
            new = make_dealer(ctx, endpoint, "worker-0", auth=ClientAuth(worker, server.public))
            send_msg(new, Heartbeat(service="worker", instance="worker-0", incarnation="new", seq=1, progress=0))
            if router.poll(RETRY_S * 1000):
                break
            new.close()
        identity, msg = recv_routed(router)
        assert (identity, msg.incarnation) == (b"worker-0", "new")
        send_msg(router, Heartbeat(service="router", instance="router", incarnation="r", seq=1, progress=0),
                 b"worker-0")
        assert new.poll(GUARD_S * 1000), "the reply to worker-0 went to the dead connection"
        assert recv_msg(new).instance == "router"
        assert allow.refused == 0
        router.disable_monitor()
        monitor.close()
    finally:
        child.kill()  # SIGKILL ends a stopped process too
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
        ctx.destroy(linger=0)
