"""Property-based fuzzing of the decoder: whatever a peer sends, decoding either yields a well-typed message
or raises ProtocolError with the right code — never another exception, never a crash."""

from __future__ import annotations

import os
import struct
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from deepinfer.protocol import ERROR_CODES, ProtocolError
from deepinfer.protocol.framing import decode_frames, encode_frames, type_frame
from deepinfer.protocol.limits import Limits
from deepinfer.protocol.messages import AbortRequest, GenerateRequest, Heartbeat, KvTransfer, SamplingParamsWire
from deepinfer.protocol.records import message, registered_messages
from deepinfer.protocol.tensors import Tensor
from deepinfer.protocol.testing import strategy_for

# DEEPINFER_FUZZ_EXAMPLES=5000 for a deeper run; the default keeps the protocol suite well under 30 s.
FUZZ = settings(
    max_examples=int(os.environ.get("DEEPINFER_FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@message(0xF1)
class TwoTensors:
    """Test-only: two buffer frames, to forge duplicate and missing references."""

    a: Tensor
    b: Tensor


def outcome(frames: list, limits: Limits | None = None) -> str:
    """'ok' or the ProtocolError code; any other exception fails the test."""
    try:
        msg = decode_frames(frames) if limits is None else decode_frames(frames, limits)
    except ProtocolError as e:
        assert e.code in ERROR_CODES
        str(e)  # the message renders
        return e.code
    assert type(msg) in registered_messages().values()
    return "ok"


def messages() -> st.SearchStrategy[Any]:
    return st.sampled_from(sorted(registered_messages())).flatmap(lambda i: strategy_for(registered_messages()[i]))


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


# --- arbitrary input --------------------------------------------------------------------------------------------


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=6))
def test_random_frames(frames: list[bytes]) -> None:
    outcome(frames)


@FUZZ
@given(
    st.sampled_from(sorted(registered_messages())),
    st.binary(max_size=200),
    st.lists(st.binary(max_size=16), max_size=3),
)
def test_random_payload_for_a_valid_type(type_id: int, payload: bytes, buffers: list[bytes]) -> None:
    outcome([bytes([type_id]), payload, *buffers])


@FUZZ
@given(st.sampled_from(sorted(registered_messages())), msgpack_values)
def test_random_msgpack_values_for_a_valid_type(type_id: int, value: Any) -> None:
    code = outcome([bytes([type_id]), msgpack.packb(value)])
    if not isinstance(value, dict):
        assert code == "bad_field"  # every message is a map


@FUZZ
@given(messages(), st.data())
def test_truncated_payloads(msg: Any, data: st.DataObject) -> None:
    frames = encode_frames(msg)
    payload = bytes(frames[1])
    cut = data.draw(st.integers(0, len(payload) - 1))
    assert outcome([frames[0], payload[:cut], *frames[2:]]) == "truncated"


@FUZZ
@given(messages(), st.data())
def test_corrupted_payloads(msg: Any, data: st.DataObject) -> None:
    frames = encode_frames(msg)
    payload = bytearray(frames[1])
    for _ in range(data.draw(st.integers(1, 4))):
        payload[data.draw(st.integers(0, len(payload) - 1))] = data.draw(st.integers(0, 255))
    outcome([frames[0], bytes(payload), *frames[2:]])


@FUZZ
@given(messages(), st.data())
def test_field_replaced_by_a_random_value(msg: Any, data: st.DataObject) -> None:
    frames = encode_frames(msg)
    raw = msgpack.unpackb(frames[1])
    name = data.draw(st.sampled_from(sorted(raw)))
    raw[name] = data.draw(msgpack_values)
    outcome([frames[0], msgpack.packb(raw), *frames[2:]])


@FUZZ
@given(messages(), st.text(min_size=1, max_size=10), msgpack_values)
def test_unknown_field_is_refused(msg: Any, name: str, value: Any) -> None:
    frames = encode_frames(msg)
    raw = msgpack.unpackb(frames[1])
    assume(name not in raw)
    raw[name] = value
    assert outcome([frames[0], msgpack.packb(raw), *frames[2:]]) == "bad_field"


@FUZZ
@given(messages(), st.data())
def test_missing_required_field_is_refused(msg: Any, data: st.DataObject) -> None:
    from deepinfer.protocol.records import fields_of

    required = [f.name for f in fields_of(type(msg)) if f.required]
    assume(required)
    frames = encode_frames(msg)
    raw = msgpack.unpackb(frames[1])
    del raw[data.draw(st.sampled_from(required))]
    assert outcome([frames[0], msgpack.packb(raw), *frames[2:]]) in ("bad_field", "bad_frames")


# --- specific attacks ---------------------------------------------------------------------------------------------


def test_unknown_type_bytes() -> None:
    payload = msgpack.packb({"request_id": "r"})
    for type_id in range(256):
        code = outcome([bytes([type_id]), payload])
        if type_id in registered_messages():
            assert code != "unknown_type"
        else:
            assert code == "unknown_type"


def test_type_frame_shape() -> None:
    payload = msgpack.packb({"request_id": "r"})
    assert outcome([b"", payload]) == "bad_frames"
    assert outcome([type_frame(AbortRequest) * 2, payload]) == "bad_frames"
    assert outcome([type_frame(AbortRequest)]) == "truncated"
    assert outcome([]) == "truncated"
    assert outcome([type_frame(AbortRequest), payload]) == "ok"


def test_frames_that_are_not_buffers() -> None:
    assert outcome([type_frame(AbortRequest), "not bytes"]) == "bad_frames"
    assert outcome([type_frame(AbortRequest), msgpack.packb({"request_id": "r"}), 5]) == "bad_frames"


def test_huge_length_headers() -> None:
    head = b"\x81" + msgpack.packb("request_id")  # {"request_id": <value>}
    t = type_frame(AbortRequest)
    # A bin32 / str32 claiming 4 GB with a few bytes behind it: the payload ends early.
    assert outcome([t, head + b"\xc6" + struct.pack(">I", 2**32 - 1) + b"xx"]) == "truncated"
    assert outcome([t, head + b"\xdb" + struct.pack(">I", 2**32 - 1) + b"xx"]) == "truncated"
    assert outcome([t, b"\xc6\xff\xff\xff\xff"]) == "truncated"
    # Arrays and maps claiming 4G entries exceed the count limits before anything is allocated.
    assert outcome([t, head + b"\xdd" + struct.pack(">I", 2**32 - 1)]) == "too_large"
    assert outcome([t, head + b"\xdf" + struct.pack(">I", 2**32 - 1)]) == "too_large"
    # A bin that is really there but over max_bin_len.
    small = Limits(max_bin_len=16)
    assert outcome([t, head + msgpack.packb(b"x" * 17)], small) == "too_large"


@pytest.mark.parametrize("opener", [b"\x91", b"\x81\xa1k"], ids=["arrays", "maps"])
def test_deep_nesting(opener: bytes) -> None:
    head = b"\x81" + msgpack.packb("request_id")
    t = type_frame(AbortRequest)
    assert outcome([t, head + opener * 10_000 + b"\x01"]) == "too_deep"
    assert outcome([t, opener * 10_000 + b"\xc0"]) == "too_deep"
    # Shallower than msgpack's own stack: the schema refuses it at the first level.
    assert outcome([t, head + opener * 200 + b"\x01"]) == "bad_field"


def test_buffer_frame_references() -> None:
    msg = TwoTensors(torch.arange(3, dtype=torch.int32), torch.ones(3, dtype=torch.int32))
    frames = encode_frames(msg)
    assert len(frames) == 4 and outcome(frames) == "ok"
    assert outcome(frames[:3]) == "bad_frames"  # b's frame missing
    assert outcome([*frames, bytes(12)]) == "bad_frames"  # one frame nobody references
    raw = msgpack.unpackb(frames[1])
    raw["b"]["frame"] = 0
    assert outcome([frames[0], msgpack.packb(raw), frames[2], frames[3]]) == "bad_frames"  # duplicate
    assert outcome([frames[0], msgpack.packb(raw), frames[2]]) == "bad_frames"  # one frame, referenced twice


def test_extra_buffer_frame_on_a_message_without_tensors() -> None:
    frames = encode_frames(Heartbeat("decode", "d0", "i", 1, 2))
    assert outcome([*frames, b"stray"]) == "bad_frames"
    frames = encode_frames(GenerateRequest("r", params=SamplingParamsWire()))
    assert outcome([*frames, b""]) == "bad_frames"


@FUZZ
@given(st.integers(0, 5), st.integers(0, 5), st.binary(max_size=40))
def test_tensor_frame_sizes(rows: int, cols: int, data: bytes) -> None:
    kv_msg = KvTransfer("r", "l", 1, [1], [], SamplingParamsWire(), 16, "x", torch.zeros(rows, cols), "tok")
    frames = encode_frames(kv_msg)
    code = outcome([frames[0], frames[1], data])
    assert code == ("ok" if len(data) == rows * cols * 4 else "bad_tensor")


def test_over_limit_frame_counts() -> None:
    frames = encode_frames(AbortRequest("r"))
    assert outcome([*frames, *([b""] * 300)]) == "too_large"


@FUZZ
@given(
    st.sampled_from(["float32", "float16", "bfloat16", "int32", "int64", "uint8", "float64", ""]),
    st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(0, 4), max_size=10),
    st.binary(max_size=64),
)
def test_forged_tensor_refs(dtype: str, shape: list[int], data: bytes) -> None:
    raw = msgpack.unpackb(encode_frames(TwoTensors(torch.zeros(1), torch.zeros(1)))[1])
    raw["a"] = {"dtype": dtype, "shape": shape, "frame": 0}
    raw["b"] = {"dtype": "uint8", "shape": [3], "frame": 1}
    outcome([type_frame(TwoTensors), msgpack.packb(raw), data, b"abc"])
    # Empty frames with huge other dimensions must not overflow torch's stride arithmetic.
    raw["a"]["shape"] = [0, *shape]
    outcome([type_frame(TwoTensors), msgpack.packb(raw), b"", b"abc"])
