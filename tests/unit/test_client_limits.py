"""Isolation by request, the pure parts (issue 30, F1/F2): the client refuses a request the router's front
would refuse before sending it, with that request's typed error (never a ProtocolError); the router's reply
codes map to the same errors; a refused message's request id is found by a bounded look at its first bytes;
and the client front's socket ceiling sits above its decoder limits (so libzmq never drops a connection for
an ordinary too-large request). Also the sync client's `generate_many` against a fake router: a refused
request takes its error in its place and the others are answered."""

from __future__ import annotations

import tempfile

import pytest
import zmq

from deepinfer.protocol import messages as m
from deepinfer.protocol.client import (
    Client,
    InvalidRequestError,
    MeshError,
    RequestTooLargeError,
    build_request,
    encode_request,
    error_from_reply,
)
from deepinfer.protocol.errors import ProtocolError
from deepinfer.protocol.framing import PEEK_BYTES, decode_frames, encode_frames, peek_request_id
from deepinfer.protocol.limits import CLIENT_LIMITS, CLIENT_SOCKET_CEILING, DEFAULT_LIMITS, Limits, MiB
from deepinfer.protocol.sockets import make_router
from tests.unit.test_client_threads import FakeRouter

BIG = Limits(max_payload=64 * MiB, max_frame=64 * MiB, max_str_len=64 * MiB)  # what a careless sender might use


def request(rid: str = "r", prompt: str | None = "hi", token_ids: list[int] | None = None,
            **params: object) -> m.GenerateRequest:
    return build_request(rid, prompt if token_ids is None else None, None, token_ids, False, 0, None, None,
                         dict(params))


@pytest.mark.parametrize("req", [
    request("3mib", "x" * (3 * MiB)),
    request("9mib", "x" * (9 * MiB)),  # past even the services' 8 MiB payload limit: was a ProtocolError
    request("ids", token_ids=[1000] * (CLIENT_LIMITS.max_array_len + 1)),  # under 2 MiB, over the array bound
], ids=["3MiB-prompt", "9MiB-prompt", "too-many-token-ids"])
def test_an_oversized_request_is_refused_before_sending_with_its_own_typed_error(req):
    with pytest.raises(RequestTooLargeError) as exc:
        encode_request(req)
    assert isinstance(exc.value, InvalidRequestError) and exc.value.code == "request_too_large"
    assert exc.value.request_id == req.request_id
    assert str(exc.value).startswith("request_too_large:")


@pytest.mark.parametrize("params, where", [
    (dict(max_tokens=2**64), "params.max_tokens = 18446744073709551616"),
    (dict(max_tokens=2**63), "params.max_tokens = 9223372036854775808"),  # fits msgpack, not int64
    (dict(stop_token_ids=[1, -(2**64)]), "params.stop_token_ids[1]"),
    (dict(logit_bias={2**64: 1.0}), "params.logit_bias[0][0]"),
    (dict(seed=10**5000), "params.seed = an integer of 16610 bits"),  # str() of it would raise
])
def test_an_integer_the_wire_cannot_carry_is_an_invalid_request_naming_the_field(params, where):
    with pytest.raises(InvalidRequestError) as exc:
        encode_request(request("big-int", **params))
    assert not isinstance(exc.value, RequestTooLargeError)
    assert exc.value.code == "invalid_request" and exc.value.request_id == "big-int"
    assert where in str(exc.value) and "64-bit integer" in str(exc.value)


def test_a_request_at_the_limits_is_sent_as_the_router_decodes_it():
    # The largest prompt that fits: the payload limit minus the record's other fields.
    overhead = len(encode_frames(request("edge", ""), CLIENT_LIMITS)[1])
    req = request("edge", "x" * (CLIENT_LIMITS.max_payload - overhead - 8))
    frames = encode_request(req)
    assert decode_frames(frames, CLIENT_LIMITS) == req
    with pytest.raises(RequestTooLargeError):
        encode_request(request("edge", "x" * (CLIENT_LIMITS.max_payload - overhead + 8)))
    assert decode_frames(encode_request(m.AbortRequest("a")), CLIENT_LIMITS) == m.AbortRequest("a")


def test_the_routers_reply_codes_map_to_the_same_typed_errors():
    too_large = error_from_reply(m.ErrorReply("a", "request_too_large", "payload is 3 MiB"))
    invalid = error_from_reply(m.ErrorReply("b", "invalid_request", "bad"))
    assert type(too_large) is RequestTooLargeError and too_large.request_id == "a"
    assert type(invalid) is InvalidRequestError and invalid.request_id == "b"
    assert type(error_from_reply(m.ErrorReply("", "bad_message", "garbage"))) is MeshError


def test_a_refused_messages_request_id_is_read_from_its_first_bytes_only():
    frames = encode_frames(m.GenerateRequest("rid-7", prompt="x" * (3 * MiB)), BIG)
    assert peek_request_id(frames) == "rid-7"
    assert peek_request_id([frames[0], bytes(frames[1])[:PEEK_BYTES]]) == "rid-7"  # the rest is never read
    assert peek_request_id(encode_frames(m.AbortRequest("ab"))) == "ab"
    for unreadable in ([frames[0], b"\xc1 not msgpack"], [frames[0], bytes(frames[1])[:12]], [frames[0]],
                       [b"\x10\x10", frames[1]], [b"\xfe", frames[1]],  # no such type
                       encode_frames(m.Hello(1, "client", "c")),  # no request id in this type
                       [frames[0], b"\x81\xaarequest_id\xcd\x01\x00"],  # an int, not a str
                       [frames[0], b"\x81\xaarequest_id\xda\x10\x00" + b"a" * 4096]):  # an id past the bound
        assert peek_request_id(unreadable) is None


def test_the_front_socket_ceiling_sits_above_the_client_limits():
    assert CLIENT_LIMITS.socket_frame_limit == CLIENT_SOCKET_CEILING >= 4 * CLIENT_LIMITS.max_frame
    assert CLIENT_SOCKET_CEILING > 9 * MiB  # a 9 MiB prompt is answered by id, not a dropped connection
    assert DEFAULT_LIMITS.socket_frame_limit == DEFAULT_LIMITS.max_frame
    ctx = zmq.Context()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            sock = make_router(ctx, f"ipc://{tmp}/front.sock", limits=CLIENT_LIMITS)
            assert sock.getsockopt(zmq.MAXMSGSIZE) == CLIENT_SOCKET_CEILING
            sock.close(linger=0)
    finally:
        ctx.term()


def test_a_refused_message_raises_protocol_error_with_its_request_id():
    """What the router's front sees: the decoder refuses, the error names the peer and the request."""
    frames = encode_frames(m.GenerateRequest("rid-9", prompt="x" * (3 * MiB)), BIG)
    with pytest.raises(ProtocolError) as exc:
        decode_frames(frames, CLIENT_LIMITS)
    assert exc.value.code == "too_large"


def test_generate_many_puts_a_refused_requests_error_in_its_place(tmp_path):
    router = FakeRouter(f"ipc://{tmp_path}/front.sock").start()
    try:
        with Client(router.endpoint, timeout_s=30) as c:
            results = c.generate_many([dict(prompt_token_ids=[1, 2]), dict(prompt="x" * (3 * MiB)),
                                       dict(prompt_token_ids=[3], max_tokens=2**64), dict(prompt_token_ids=[4])])
            with pytest.raises(RequestTooLargeError):
                c.generate(prompt="y" * (9 * MiB))
            assert c.generate(prompt_token_ids=[5]).token_ids == [5]  # the client serves on
    finally:
        router.stop()
    ok1, too_large, invalid, ok2 = results
    assert ok1.token_ids == [1, 2] and ok2.token_ids == [4]
    assert type(too_large) is RequestTooLargeError and type(invalid) is InvalidRequestError
    sent = []
    while not router.received.empty():
        sent.append(router.received.get())
    assert len(sent) == 3  # the refused ones never left the client
