"""Real ZeroMQ sockets over inproc:// and ipc://: messages and tensors cross intact and zero-copy,
malformed input is refused without desynchronising the socket, and ROUTER_MANDATORY reports dead peers."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq
import zmq.asyncio

from deepinfer.protocol import ProtocolError
from deepinfer.protocol.framing import decode_frames, encode_frames, type_frame
from deepinfer.protocol.handshake import check_hello
from deepinfer.protocol.limits import Limits
from deepinfer.protocol.messages import (
    PROTOCOL_VERSION,
    AbortRequest,
    Heartbeat,
    Hello,
    KvTransfer,
    SamplingParamsWire,
    Shutdown,
    Welcome,
)
from deepinfer.protocol.sockets import (
    arecv_msg,
    arecv_routed,
    asend_msg,
    make_dealer,
    make_pub,
    make_pull,
    make_push,
    make_router,
    make_sub,
    recv_msg,
    recv_routed,
    send_msg,
)

TIMEOUT_MS = 5000


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture(params=["inproc", "ipc"])
def endpoint(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "inproc":
        return f"inproc://protocol-test-{id(request)}"
    return f"ipc://{tmp_path}/sock"


def wait_readable(sock: zmq.Socket) -> None:
    assert sock.poll(TIMEOUT_MS), "timed out waiting for a message"


def kv_transfer(kv: torch.Tensor) -> KvTransfer:
    return KvTransfer(
        request_id="r1",
        lease_id="lease-1",
        first_token=42,
        token_ids=list(range(64)),
        block_hashes=[bytes([i]) * 32 for i in range(4)],
        params=SamplingParamsWire(max_tokens=8, temperature=0.7, seed=1),
        block_size=16,
        kv_layout="layers,kv,blocks,block_size,heads,head_dim",
        kv=kv,
        detokenizer="tokenizer-0",
    )


def test_dealer_router_handshake_and_reply(ctx: zmq.Context, endpoint: str) -> None:
    router = make_router(ctx, endpoint)
    dealer = make_dealer(ctx, endpoint, "decode-0")
    send_msg(dealer, Hello(PROTOCOL_VERSION, "decode", "decode-0", "fp", "sha256-v1", {"spec": "ngram"}))
    wait_readable(router)
    identity, hello = recv_routed(router)
    assert identity == b"decode-0" and isinstance(hello, Hello) and hello.capabilities == {"spec": "ngram"}
    send_msg(router, check_hello(hello, PROTOCOL_VERSION, "fp", "sha256-v1", service="router"), identity)
    wait_readable(dealer)
    welcome = recv_msg(dealer)
    assert isinstance(welcome, Welcome) and welcome.accepted and welcome.service == "router"
    with pytest.raises(TypeError, match="recv_routed"):
        recv_msg(router)


def test_tensor_crosses_zero_copy(ctx: zmq.Context, endpoint: str) -> None:
    push = make_push(ctx, connect=endpoint)
    pull = make_pull(ctx, bind=endpoint)
    kv = torch.randn(2, 2, 4, 16, 2, 32).to(torch.bfloat16)  # 64 KiB+: above pyzmq's copy threshold
    tracker = send_msg(push, kv_transfer(kv), track=True)
    wait_readable(pull)
    frames = pull.recv_multipart(copy=False)
    tracker.wait(TIMEOUT_MS / 1000)  # libzmq is done with the sender's tensor memory
    msg = decode_frames(frames)
    assert torch.equal(msg.kv, kv) and msg.kv.dtype == torch.bfloat16
    assert msg.params == SamplingParamsWire(max_tokens=8, temperature=0.7, seed=1)
    # The decoded tensor is the received zmq frame's memory, not a copy of it.
    assert msg.kv.data_ptr() == np.frombuffer(frames[2].buffer, dtype=np.uint8).ctypes.data
    del frames
    assert torch.equal(msg.kv, kv)  # the tensor keeps its frame alive


def test_malformed_message_is_refused_and_the_socket_stays_in_step(ctx: zmq.Context, endpoint: str) -> None:
    router = make_router(ctx, endpoint)
    dealer = make_dealer(ctx, endpoint, "tokenizer-0")
    dealer.send_multipart([type_frame(AbortRequest), b"\xc1"])  # 0xc1 is never valid msgpack
    dealer.send_multipart([b"\xee", b"\x80"])  # unknown type
    send_msg(dealer, AbortRequest("r7", "client went away"))
    wait_readable(router)
    with pytest.raises(ProtocolError) as info:
        recv_routed(router)
    assert (info.value.code, info.value.peer) == ("bad_payload", b"tokenizer-0")
    wait_readable(router)
    with pytest.raises(ProtocolError) as info:
        recv_routed(router)
    assert info.value.code == "unknown_type"
    wait_readable(router)
    assert recv_routed(router) == (b"tokenizer-0", AbortRequest("r7", "client went away"))


def test_router_mandatory_send_to_unknown_identity_raises(ctx: zmq.Context, endpoint: str) -> None:
    router = make_router(ctx, endpoint)
    with pytest.raises(zmq.ZMQError) as info:
        send_msg(router, Shutdown(drain=False), b"nobody")
    assert info.value.errno == zmq.EHOSTUNREACH


def test_pub_sub_filters_by_message_type(ctx: zmq.Context, endpoint: str) -> None:
    pub = make_pub(ctx, bind=endpoint)
    sub = make_sub(ctx, connect=endpoint, topics=[type_frame(Heartbeat)])
    beat = Heartbeat("decode", "decode-0", "inc", 0, 0)
    # PUB drops until the subscription has arrived: publish until the first heartbeat gets through.
    for _ in range(500):
        send_msg(pub, Shutdown())
        send_msg(pub, beat)
        if sub.poll(10):
            break
    else:
        pytest.fail("subscription never took effect")
    for _ in range(3):
        send_msg(pub, Shutdown())
    send_msg(pub, Heartbeat("decode", "decode-0", "inc", 1, 5))
    while sub.poll(200):
        got = recv_msg(sub)
        assert isinstance(got, Heartbeat)  # never a Shutdown
        if got.seq == 1:
            break
    else:
        pytest.fail("second heartbeat lost")


def test_socket_options(ctx: zmq.Context) -> None:
    limits = Limits(max_frame=12345)
    router = make_router(ctx, "inproc://options", hwm=77, limits=limits)
    dealer = make_dealer(ctx, "inproc://options", b"d", hwm=77, limits=limits)
    sub = make_sub(ctx, connect="inproc://options-pub", hwm=77, limits=limits)
    for sock in (router, dealer, sub):
        assert sock.getsockopt(zmq.LINGER) == 0
        assert sock.getsockopt(zmq.SNDHWM) == 77
        assert sock.getsockopt(zmq.RCVHWM) == 77
        assert sock.getsockopt(zmq.MAXMSGSIZE) == 12345
    assert dealer.getsockopt(zmq.ROUTING_ID) == b"d"
    with pytest.raises(ValueError):
        make_push(ctx)
    with pytest.raises(ValueError):
        make_pull(ctx, bind="inproc://a", connect="inproc://a")
    for bad in ("", b"\x00abc", "x" * 256):
        with pytest.raises(ValueError):
            make_dealer(ctx, "inproc://options", bad)


def test_maxmsgsize_drops_oversized_frames_in_libzmq(ctx: zmq.Context, tmp_path: Path) -> None:
    # libzmq enforces MAXMSGSIZE on connections (not inproc): the oversized message never arrives.
    endpoint = f"ipc://{tmp_path}/small"
    pull = make_pull(ctx, bind=endpoint, limits=Limits(max_frame=1024))
    push = make_push(ctx, connect=endpoint)
    send_msg(push, AbortRequest("small"))
    wait_readable(pull)
    assert recv_msg(pull) == AbortRequest("small")
    push.send_multipart([type_frame(AbortRequest), b"\x00" * 4096])
    assert not pull.poll(300)


def test_asyncio_sockets(endpoint: str) -> None:
    async def main() -> None:
        actx = zmq.asyncio.Context()
        try:
            router = make_router(actx, endpoint)
            dealer = make_dealer(actx, endpoint, "prefill-0")
            kv = torch.arange(40_000, dtype=torch.float32).reshape(2, 20_000)
            await asend_msg(dealer, kv_transfer(kv))
            identity, msg = await asyncio.wait_for(arecv_routed(router), TIMEOUT_MS / 1000)
            assert identity == b"prefill-0" and torch.equal(msg.kv, kv)
            await asend_msg(router, AbortRequest("r1"), identity)
            assert await asyncio.wait_for(arecv_msg(dealer), TIMEOUT_MS / 1000) == AbortRequest("r1")
            with pytest.raises(zmq.ZMQError):
                await asend_msg(router, AbortRequest("r1"), b"gone")
            await dealer.send_multipart([b"\x05", b"\x80", b"stray"])
            with pytest.raises(ProtocolError) as info:
                await asyncio.wait_for(arecv_routed(router), TIMEOUT_MS / 1000)
            assert (info.value.code, info.value.peer) == ("bad_field", b"prefill-0")
        finally:
            actx.destroy(linger=0)

    asyncio.run(main())


@pytest.mark.parametrize("kind", [zmq.PULL, zmq.ROUTER])
def test_a_secured_bound_socket_waits_through_a_peers_handshake_and_heartbeats(
    kind: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bound CURVE socket with ZMTP heartbeats is reported readable, with nothing to read, as a peer connects
    and its heartbeats begin (libzmq 4.3.5). pyzmq's asyncio receive handed that to the waiter as zmq.Again,
    which ended the tokenizer's detokenize loop the moment a worker connected (issue 32). The wait must go on
    until a message comes. Heartbeats every 50 ms: several rounds pass before the peer sends anything."""
    from deepinfer.protocol import sockets
    from deepinfer.protocol.auth import ClientAuth, KeyPair, ServerAuth, allow_list

    monkeypatch.setattr(sockets, "BOUND_HEARTBEAT_IVL_MS", 50)
    server, peer = KeyPair.generate(), KeyPair.generate()
    port = _free_port()
    endpoint = f"tcp://127.0.0.1:{port}"

    async def main() -> None:
        actx, sctx = zmq.asyncio.Context(), zmq.Context()
        try:
            auth = ServerAuth(server, allow_list("detok", [(peer.public, "worker-0")]))
            if kind == zmq.PULL:
                bound = make_pull(actx, bind=endpoint, auth=auth)
                sender = make_push(sctx, connect=endpoint, auth=ClientAuth(peer, server.public))
            else:
                bound = make_router(actx, endpoint, auth=auth)
                sender = make_dealer(sctx, endpoint, "worker-0", auth=ClientAuth(peer, server.public))
            waiting = asyncio.ensure_future(arecv_msg(bound) if kind == zmq.PULL else arecv_routed(bound))
            await asyncio.sleep(0.6)  # the handshake and a dozen heartbeat rounds, nothing sent
            assert not waiting.done() or waiting.exception() is None, repr(waiting.exception())
            send_msg(sender, AbortRequest("r1"))
            got = await asyncio.wait_for(waiting, TIMEOUT_MS / 1000)
            assert got == AbortRequest("r1") if kind == zmq.PULL else got == (b"worker-0", AbortRequest("r1"))
        finally:
            actx.destroy(linger=0)
            sctx.destroy(linger=0)

    asyncio.run(main())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_encode_frames_keeps_tensor_memory_referenced() -> None:
    # The frames hold the tensor's memory even when the caller drops its own reference.
    frames = encode_frames(kv_transfer(torch.full((1000,), 3.0)))
    assert torch.equal(decode_frames(frames).kv, torch.full((1000,), 3.0))
