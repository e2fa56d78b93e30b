"""The wire contract: every message round-trips, fields are type-checked, tensors travel zero-copy,
limits hold, the handshake explains refusals, and the package keeps its dependency rule."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import deepinfer.protocol as proto
from deepinfer.protocol import records
from deepinfer.protocol.framing import decode_frames, encode_frames, type_frame
from deepinfer.protocol.handshake import check_hello
from deepinfer.protocol.limits import Limits
from deepinfer.protocol.messages import (
    PROTOCOL_VERSION,
    DetokenizeBatch,
    DetokenizeItem,
    ErrorReply,
    ExpertLoad,
    GenerateRequest,
    Heartbeat,
    Hello,
    KvTransfer,
    PlacementResult,
    PlacementTable,
    PlacementUpdate,
    RequestFinished,
    SamplingParamsWire,
    Shutdown,
    TextDeltaItem,
    TextDeltas,
    Timings,
    UsageWire,
)
from deepinfer.protocol.records import message, record, registered_messages
from deepinfer.protocol.tensors import TENSOR_DTYPES, Tensor, TensorRef, frame_to_tensor, tensor_to_frame
from deepinfer.protocol.testing import same, strategy_for

PROTOCOL_DIR = Path(proto.__file__).parent


@record
class Inner:
    n: int
    tags: tuple[str, ...] = ()


@message(0xF0)
class Everything:
    """Test-only: one field of every supported annotation kind, two tensors."""

    i: int
    f: float
    b: bool
    s: str
    raw: bytes
    maybe: int | None
    ints: list[int]
    nested: list[Inner]
    table: dict[str, Inner]
    pair: tuple[int, float]
    kind: str | None
    a: Tensor
    t: Tensor
    opt_tensor: Tensor | None = None


def wire(msg: object) -> dict:
    """The plain msgpack value of a message (for hand-made corruptions)."""
    return msgpack.unpackb(encode_frames(msg)[1], raw=False)


def frames_for(type_cls: type, value: object, buffers: tuple = ()) -> list:
    return [type_frame(type_cls), msgpack.packb(value, use_bin_type=True), *buffers]


def code_of(frames: list, limits: Limits = proto.DEFAULT_LIMITS) -> str:
    with pytest.raises(proto.ProtocolError) as info:
        decode_frames(frames, limits)
    return info.value.code


# --- round trips --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("type_id", sorted(registered_messages()), ids=lambda i: registered_messages()[i].__name__)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_every_message_round_trips(type_id: int, data: st.DataObject) -> None:
    cls = registered_messages()[type_id]
    msg = data.draw(strategy_for(cls))
    frames = encode_frames(msg)
    assert bytes(frames[0]) == bytes([type_id])
    back = decode_frames(frames)
    assert same(msg, back), (msg, back)
    # Also through bytes, as a copy=True receive would hand them over.
    assert same(msg, decode_frames([bytes(f) for f in frames]))


def test_every_message_has_a_docstring_and_a_distinct_id() -> None:
    mesh = {i: c for i, c in registered_messages().items() if i < 0xF0}
    assert len(mesh) >= 19
    for cls in mesh.values():
        assert cls.__doc__ and "→" in cls.__doc__, f"{cls.__name__} must say who sends it to whom"
        assert cls.__module__ == "deepinfer.protocol.messages"


def test_defaults_fill_missing_optional_fields() -> None:
    msg = decode_frames(frames_for(GenerateRequest, {"request_id": "r1", "prompt": "hi"}))
    assert msg == GenerateRequest("r1", prompt="hi")
    assert msg.params == SamplingParamsWire()


SPEC = {"spec_proposed_tokens": 12, "spec_accepted_tokens": 7}


def _speculating_messages() -> list[object]:
    """Every message that carries speculative decoding's counts, with them set."""
    usage = UsageWire(30, 9, cached_tokens=16, cached_by_tier={"host": 16}, **SPEC)
    return [
        RequestFinished("r1", "text", [1, 2], "length", usage, Timings(1.0)),
        DetokenizeBatch("decode-0", 3, [DetokenizeItem("r1", 2, [5, 6, 7], **SPEC)]),
        TextDeltas("tokenizer-0", [TextDeltaItem("r1", 2, "abc", [5, 6, 7], **SPEC)]),
        dataclasses.replace(_heartbeat(), **SPEC),
    ]


def test_speculation_counts_round_trip() -> None:
    sent = _speculating_messages()
    fin, batch, deltas, hb = back = [decode_frames(encode_frames(x)) for x in sent]
    assert back == sent
    assert (fin.usage.spec_proposed_tokens, fin.usage.spec_accepted_tokens) == (12, 7)
    assert (batch.items[0].spec_proposed_tokens, deltas.items[0].spec_accepted_tokens) == (12, 7)
    assert (hb.spec_proposed_tokens, hb.spec_accepted_tokens) == (12, 7)


def _without_spec(value: object) -> object:
    """`value` (a msgpack map, or lists of them) as a peer that predates speculation encoded it."""
    if isinstance(value, dict):
        return {k: _without_spec(v) for k, v in value.items() if k not in SPEC}
    if isinstance(value, list):
        return [_without_spec(v) for v in value]
    return value


def _zero_spec(msg: object) -> object:
    zero = {k: 0 for k in SPEC}
    if isinstance(msg, RequestFinished):
        return dataclasses.replace(msg, usage=dataclasses.replace(msg.usage, **zero))
    if isinstance(msg, (DetokenizeBatch, TextDeltas)):
        return dataclasses.replace(msg, items=[dataclasses.replace(i, **zero) for i in msg.items])
    return dataclasses.replace(msg, **zero)


def test_speculation_counts_default_to_zero_when_absent() -> None:
    for msg in _speculating_messages():
        old = _without_spec(wire(msg))
        assert "spec_proposed_tokens" not in str(old)
        back = decode_frames(frames_for(type(msg), old))
        assert back == _zero_spec(msg)


def test_speculation_counts_came_with_a_protocol_version_bump() -> None:
    # A version-2 peer refuses fields it does not know: it must be turned away at the handshake, not fail
    # on its first heartbeat or token batch.
    assert PROTOCOL_VERSION >= 3
    welcome = check_hello(Hello(2, "decode", "decode-0"), PROTOCOL_VERSION)
    assert not welcome.accepted and welcome.reason == f"protocol version 2 != {PROTOCOL_VERSION}"
    assert code_of(frames_for(Heartbeat, {**wire(_heartbeat()), "spec_rate": 0.5})) == "bad_field"


def test_float_fields_accept_ints_but_int_fields_refuse_bools_and_floats() -> None:
    msg = decode_frames(frames_for(GenerateRequest, {"request_id": "r", "params": {"temperature": 1}}))
    assert msg.params.temperature == 1.0 and type(msg.params.temperature) is float
    for bad in (True, 1.0, "1", None, 2**63):
        frames = frames_for(GenerateRequest, {"request_id": "r", "params": {"max_tokens": bad}})
        with pytest.raises(proto.ProtocolError) as info:
            decode_frames(frames)
        assert info.value.code == "bad_field"
        assert info.value.where == "GenerateRequest.params.max_tokens"
    frames = frames_for(GenerateRequest, {"request_id": "r", "params": {"temperature": False}})
    assert code_of(frames) == "bad_field"


def test_int64_bounds() -> None:
    ok = frames_for(Heartbeat, {**wire(_heartbeat()), "seq": -(2**63), "progress": 2**63 - 1})
    assert decode_frames(ok).seq == -(2**63)
    for bad in (2**63, 2**64 - 1):  # msgpack's uint64 range
        assert code_of(frames_for(Heartbeat, {**wire(_heartbeat()), "seq": bad})) == "bad_field"


def test_expert_balancer_messages_round_trip() -> None:
    table = PlacementTable(version=3, num_ranks=2, num_experts=4, slots_per_rank=3, layers=[[0, 1, -1, 2, 3, 0]])
    sent = [ExpertLoad("worker-0", 3, 5.0, [[1, 2, 3, 4]], [3, 7], table),
            PlacementUpdate("worker-0", table, before=[1.5], after=[1.1]),
            PlacementResult("worker-0", 3, False, "a move is in flight")]
    back = [decode_frames(encode_frames(msg)) for msg in sent]
    assert back == sent and back[0].placement.layers == [[0, 1, -1, 2, 3, 0]]
    # A report without a table (a dense model) still decodes; a table of anything but ints does not.
    old = decode_frames(frames_for(ExpertLoad, {"worker": "w", "placement_version": 0, "period_s": 1.0}))
    assert old.placement is None and old.expert_tokens == []
    bad = {"worker": "w", "placement": {**wire(sent[1])["placement"], "layers": [[0, "1"]]}}
    with pytest.raises(proto.ProtocolError) as info:
        decode_frames(frames_for(PlacementUpdate, bad))
    assert info.value.where == "PlacementUpdate.placement.layers[0][1]"
    assert PROTOCOL_VERSION >= 7  # the balancer's messages came with a bump


def test_unknown_missing_and_mistyped_fields() -> None:
    base = wire(_heartbeat())
    assert code_of(frames_for(Heartbeat, {**base, "extra": 1})) == "bad_field"
    del base["incarnation"]
    with pytest.raises(proto.ProtocolError, match="incarnation") as info:
        decode_frames(frames_for(Heartbeat, base))
    assert info.value.code == "bad_field"
    assert code_of(frames_for(Heartbeat, [1, 2, 3])) == "bad_field"  # a record must be a map
    assert code_of(frames_for(Heartbeat, {**wire(_heartbeat()), b"seq": 1})) == "bad_field"  # bytes key


def test_literals_lists_dicts_and_nested_paths() -> None:
    assert code_of(frames_for(ErrorReply, {"request_id": "r", "code": "nope", "message": ""})) == "bad_field"
    assert code_of(frames_for(ErrorReply, {"request_id": "r", "code": 1, "message": ""})) == "bad_field"
    req = {"request_id": "r", "prompt_token_ids": [1, 2, "3"]}
    with pytest.raises(proto.ProtocolError) as info:
        decode_frames(frames_for(GenerateRequest, req))
    assert info.value.where == "GenerateRequest.prompt_token_ids[2]"
    assert "GenerateRequest.prompt_token_ids[2]" in str(info.value)
    req = {"request_id": "r", "messages": [{"role": "user", "content": 5}]}
    with pytest.raises(proto.ProtocolError) as info:
        decode_frames(frames_for(GenerateRequest, req))
    assert info.value.where == "GenerateRequest.messages[0]['content']"
    req = {"request_id": "r", "messages": [{b"role": "user"}]}
    assert code_of(frames_for(GenerateRequest, req)) == "bad_field"


def test_decoded_tuples_and_fixed_tuples() -> None:
    msg = _everything()
    back = decode_frames(encode_frames(msg))
    assert same(msg, back)
    assert type(back.pair) is tuple and type(back.nested[0].tags) is tuple
    raw = wire(msg)
    raw["pair"] = [1, 2.0, 3]
    assert code_of([type_frame(Everything), msgpack.packb(raw), *encode_frames(msg)[2:]]) == "bad_field"


def test_ext_types_and_timestamps_are_refused() -> None:
    for value in (msgpack.ExtType(5, b"xy"), msgpack.ExtType(127, b""), msgpack.Timestamp(1, 2)):
        frames = frames_for(GenerateRequest, {"request_id": "r", "prompt": value})
        assert code_of(frames) == "bad_payload"
    # Negative (reserved) ext types, which msgpack-python will not even build: fixext1 of type -7.
    head = b"\x82" + msgpack.packb("request_id") + msgpack.packb("r") + msgpack.packb("prompt")
    assert code_of([type_frame(GenerateRequest), head + b"\xd4\xf9\x00"]) == "bad_payload"
    # Timestamps are decoded by msgpack itself, so the refusal must hold wherever one can appear.
    frames = frames_for(Hello, {**wire(Hello(1, "s", "i")), "capabilities": {"k": msgpack.Timestamp(0)}})
    assert code_of(frames) == "bad_payload"


def test_encode_refuses_what_cannot_travel() -> None:
    with pytest.raises(proto.ProtocolError) as info:
        encode_frames(Shutdown(drain=np.bool_(True)))  # type: ignore[arg-type]
    assert info.value.code == "bad_field"
    with pytest.raises(proto.ProtocolError) as info:
        encode_frames(GenerateRequest("r", params={"max_tokens": 3}))  # type: ignore[arg-type]
    assert info.value.code == "bad_field" and info.value.where == "GenerateRequest.params"
    with pytest.raises(proto.ProtocolError) as info:
        encode_frames(Inner(1))
    assert info.value.code == "unknown_type"
    with pytest.raises(proto.ProtocolError) as info:
        encode_frames(_kv_transfer(torch.zeros(3, dtype=torch.float64)))
    assert info.value.code == "bad_tensor"


def test_sampling_params_wire_mirrors_the_engine() -> None:
    from deepinfer.engine.request import SamplingParams

    engine = {f.name: f for f in dataclasses.fields(SamplingParams)}
    ours = {f.name: f for f in dataclasses.fields(SamplingParamsWire)}
    assert list(engine) == list(ours)
    # logit_bias is a mapping in the engine and (token id, bias) pairs on the wire (int map keys do not travel).
    engine_defaults, wire_defaults = dataclasses.asdict(SamplingParams()), dataclasses.asdict(SamplingParamsWire())
    assert (engine_defaults.pop("logit_bias"), wire_defaults.pop("logit_bias")) == ({}, [])
    assert engine_defaults == wire_defaults
    # The conversion the services do works both ways.
    from deepinfer.services.wire import to_engine_params, to_wire_params

    wire_params = SamplingParamsWire(max_tokens=5, stop=["x"], seed=3, prompt_logprobs=2,
                                     logit_bias=[(3, 1.5), (7, -100.0)])
    params = to_engine_params(wire_params)
    params.validate()
    assert params.logit_bias == {3: 1.5, 7: -100.0} and params.prompt_logprobs == 2
    assert to_wire_params(params) == wire_params


def roundtrip(msg: object) -> object:
    return decode_frames(encode_frames(msg))


def test_prompt_logprobs_and_logit_bias_round_trip() -> None:
    from deepinfer.protocol.messages import LogprobWire, StreamDelta

    params = SamplingParamsWire(prompt_logprobs=0, logit_bias=[(5, 2), (9, -0.5)])  # an int bias travels as float
    req = GenerateRequest("r", prompt_token_ids=[1, 2], params=params)
    back = roundtrip(req)
    assert back.params.logit_bias == [(5, 2.0), (9, -0.5)] and back.params.prompt_logprobs == 0
    lps = [None, LogprobWire(2, -0.25, [(2, -0.25), (8, -1.5)])]
    delta = StreamDelta("r", "", [], 0, None, [1, 2], lps)
    assert roundtrip(delta) == delta
    done = RequestFinished("r", "x", [4], "stop", UsageWire(2, 1), Timings(0.1), prompt_token_ids=[1, 2],
                           prompt_logprobs=lps)
    assert roundtrip(done) == done
    batch = DetokenizeBatch("w", 1, [DetokenizeItem("r", 0, [4], prompt_logprobs=lps)])
    assert roundtrip(batch) == batch
    assert roundtrip(DetokenizeBatch("w", 1, [DetokenizeItem("r", 0, [4])])).items[0].prompt_logprobs is None
    assert PROTOCOL_VERSION >= 8  # these fields came with a bump


# --- schema declarations --------------------------------------------------------------------------------------


def test_declaration_errors() -> None:
    with pytest.raises(ValueError, match="taken"):
        message(0xF0)(type("Dup", (), {"__annotations__": {"x": int}}))
    with pytest.raises(ValueError):
        message(0)
    with pytest.raises(ValueError):
        message(256)
    for annotation in (set[int], int | str, dict[int, str], list, object):
        cls = record(type("Bad", (), {"__annotations__": {"x": annotation}}))
        with pytest.raises(TypeError):
            records.fields_of(cls)


@record
class Loop:
    next: Loop | None = None


def test_recursive_schema_is_refused() -> None:
    with pytest.raises(TypeError, match="recursive"):
        records.fields_of(Loop)


# --- tensors ---------------------------------------------------------------------------------------------------


def _address(buffer: object) -> int:
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


@pytest.mark.parametrize("dtype", TENSOR_DTYPES)
def test_tensor_round_trip_is_zero_copy_both_ways(dtype: str) -> None:
    t = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4).to(getattr(torch, dtype))
    ref, view = tensor_to_frame(t, 0)
    assert ref == TensorRef(dtype, (2, 3, 4), 0)
    assert _address(view) == t.data_ptr()  # the frame is the tensor's own memory

    frame = bytearray(view)  # what a receiver holds: writable memory of its own
    back = frame_to_tensor(ref, frame)
    assert torch.equal(back, t) and back.dtype == t.dtype
    assert back.data_ptr() == _address(frame)  # aliases the frame, no copy
    frame[:] = bytes(len(frame))
    assert not back.any()  # same memory: zeroing the frame zeroed the tensor


def test_tensor_message_decodes_without_copy() -> None:
    kv = torch.randn(2, 2, 3, 16, 2, 8)
    frames = encode_frames(_kv_transfer(kv))
    assert len(frames) == 3 and frames[2].nbytes == kv.numel() * 4
    received = [bytes(frames[0]), bytes(frames[1]), bytearray(frames[2])]
    msg = decode_frames(received)
    assert torch.equal(msg.kv, kv)
    assert msg.kv.data_ptr() == _address(received[2])


def test_tensor_edge_cases() -> None:
    for t in (torch.zeros(0, 3), torch.tensor(7, dtype=torch.int64), torch.arange(12).reshape(3, 4).t()):
        back = decode_frames(encode_frames(_kv_transfer(t))).kv
        assert same(back, t.contiguous()), t
    # Read-only frames (bytes) decode without a warning; a misaligned frame is copied into aligned memory.
    ref, view = tensor_to_frame(torch.arange(4, dtype=torch.int64))
    back = frame_to_tensor(ref, bytes(view))
    assert back.tolist() == [0, 1, 2, 3]
    shifted = bytearray(33)
    shifted[1:] = bytes(view)
    back = frame_to_tensor(ref, memoryview(shifted)[1:])
    assert back.tolist() == [0, 1, 2, 3] and back.data_ptr() % 8 == 0


def test_tensor_size_dtype_and_shape_checks() -> None:
    with pytest.raises(proto.ProtocolError) as info:
        frame_to_tensor(TensorRef("float32", (2, 3), 0), bytes(23))
    assert info.value.code == "bad_tensor"
    with pytest.raises(proto.ProtocolError) as info:
        frame_to_tensor(TensorRef("float32", (-2, -3), 0), bytes(24))
    assert info.value.code == "bad_tensor"
    with pytest.raises(proto.ProtocolError) as info:
        frame_to_tensor(TensorRef("float32", (1,) * 9, 0), bytes(4))
    assert info.value.code == "bad_tensor"
    with pytest.raises(proto.ProtocolError) as info:  # empty, but the other dimensions overflow strides
        frame_to_tensor(TensorRef("float32", (0, 2**63 - 1, 2**63 - 1), 0), b"")
    assert info.value.code == "bad_tensor"
    with pytest.raises(proto.ProtocolError) as info:
        tensor_to_frame(torch.zeros((1,) * 9))
    assert info.value.code == "bad_tensor"
    frames = encode_frames(_kv_transfer(torch.zeros(2, 3)))
    raw = msgpack.unpackb(frames[1])
    for kv, code in (
        ({"dtype": "float64", "shape": [2, 3], "frame": 0}, "bad_field"),
        ({"dtype": "float32", "shape": [3, 3], "frame": 0}, "bad_tensor"),
        ({"dtype": "float32", "shape": [2, 3], "frame": 1}, "bad_frames"),
        ({"dtype": "float32", "shape": [2, 3], "frame": -1}, "bad_frames"),
        ({"dtype": "float32", "shape": [2, 3]}, "bad_field"),
    ):
        assert code_of([frames[0], msgpack.packb({**raw, "kv": kv}), frames[2]]) == code, kv


# --- limits ----------------------------------------------------------------------------------------------------


def test_oversized_messages_are_refused_on_both_sides() -> None:
    small = Limits(max_payload=100, max_frame=1000, max_total=1500, max_frames=3)
    big = GenerateRequest("r", prompt="x" * 200)
    with pytest.raises(proto.ProtocolError) as info:
        encode_frames(big, small)
    assert info.value.code == "too_large"
    assert code_of(encode_frames(big), small) == "too_large"
    kv = _kv_transfer(torch.zeros(300))  # 1200-byte frame
    assert code_of(encode_frames(kv), small) == "too_large"
    with pytest.raises(proto.ProtocolError):
        encode_frames(kv, small)
    everything = encode_frames(_everything())  # 4 frames
    assert code_of(everything, Limits(max_frames=3)) == "too_large"
    assert code_of(everything, Limits(max_total=sum(memoryview(f).nbytes for f in everything) - 1)) == "too_large"
    # msgpack-level bounds
    assert code_of(encode_frames(big), Limits(max_str_len=100)) == "too_large"
    assert code_of(encode_frames(GenerateRequest("r", prompt_token_ids=[1] * 50)), Limits(max_array_len=10)) == (
        "too_large"
    )


# --- handshake ---------------------------------------------------------------------------------------------------


def test_handshake_accepts_matching_peers() -> None:
    hello = Hello(PROTOCOL_VERSION, "decode", "decode-0", "f" * 64, "sha256-v1", {"kv_layout": "L2BSHD"})
    welcome = check_hello(hello, PROTOCOL_VERSION, "f" * 64, "sha256-v1", service="router", instance="router-0")
    assert welcome.accepted and welcome.reason == ""
    assert (welcome.service, welcome.instance, welcome.model_fingerprint) == ("router", "router-0", "f" * 64)
    # A client holds no model: nothing to compare; a router that does not care compares nothing either.
    assert check_hello(Hello(PROTOCOL_VERSION, "client", "c"), PROTOCOL_VERSION, "f" * 64, "sha256-v1").accepted
    assert check_hello(hello, PROTOCOL_VERSION, None, None).accepted


def test_handshake_refusals_say_why() -> None:
    assert check_hello(Hello(2, "decode", "d"), 1).reason == "protocol version 2 != 1"
    hello = Hello(1, "decode", "d", "abcdef0123456789abcdef", "sha256-v2")
    welcome = check_hello(hello, 1, "0123456789abcdef0123", "sha256-v1")
    assert not welcome.accepted
    assert welcome.reason == (
        "model fingerprint abcdef012345… != 0123456789ab…; block hash scheme 'sha256-v2' != 'sha256-v1'"
    )
    welcome = check_hello(Hello(3, "decode", "d", "short", None), 1, "other", "s")
    assert welcome.reason == "protocol version 3 != 1; model fingerprint short != other"
    assert decode_frames(encode_frames(welcome)) == welcome


# --- package rules -------------------------------------------------------------------------------------------------


def test_protocol_imports_nothing_from_services_engine_launch_nor_torch() -> None:
    code = (
        "import sys, deepinfer.protocol, deepinfer.protocol.sockets;"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('deepinfer.engine', 'deepinfer.services',"
        " 'deepinfer.launch'))];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_no_pickle_or_eval_in_the_protocol_package() -> None:
    unsafe_modules = {"pickle", "cPickle", "dill", "marshal", "shelve", "cloudpickle", "jsonpickle"}
    for path in PROTOCOL_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names = {(node.module or "").split(".")[0]}
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in ("eval", "exec", "compile", "__import__"), (path.name, node.lineno)
                continue
            else:
                continue
            assert not names & unsafe_modules, (path.name, node.lineno)


# --- helpers ----------------------------------------------------------------------------------------------------------


def _heartbeat() -> Heartbeat:
    return Heartbeat("decode", "decode-0", "inc-1", 7, 1234, free_blocks=10, total_blocks=64, running=3)


def _kv_transfer(kv: torch.Tensor) -> KvTransfer:
    return KvTransfer(
        request_id="r1",
        lease_id="lease-1",
        first_token=42,
        token_ids=list(range(40)),
        block_hashes=[bytes([i]) * 32 for i in range(2)],
        params=SamplingParamsWire(max_tokens=8),
        block_size=16,
        kv_layout="layers,kv,blocks,block_size,heads,head_dim",
        kv=kv,
        detokenizer="tokenizer-0",
    )


def _everything() -> Everything:
    return Everything(
        i=-5,
        f=2.5,
        b=True,
        s="héllo",
        raw=b"\x00\xff",
        maybe=None,
        ints=[1, 2, 3],
        nested=[Inner(1, ("a", "b"))],
        table={"x": Inner(2)},
        pair=(1, 0.5),
        kind="k",
        a=torch.arange(6, dtype=torch.int32).reshape(2, 3),
        t=torch.ones(4, dtype=torch.bfloat16),
    )
