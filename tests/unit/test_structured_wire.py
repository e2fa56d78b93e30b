"""Structured output on the wire: the clients' keys, the gateway's response_format, and the conversion to the
engine's ConstraintSpec (the worker compiles it; shapes are checked before anything is sent)."""

from __future__ import annotations

import json

import pytest

from deepinfer.gateway.errors import ApiError
from deepinfer.gateway.openai_requests import ParseContext, parse_chat
from deepinfer.grammar import ConstraintSpec
from deepinfer.protocol import messages as m
from deepinfer.protocol.client_requests import build_request, encode_request
from deepinfer.protocol.framing import decode_frames
from deepinfer.services.router_state import input_problem
from deepinfer.services.wire import to_engine_params, to_wire_params

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def request(**params: object) -> m.GenerateRequest:
    return build_request("r", "hi", None, None, False, 0, None, None, params)


def test_the_clients_keys_become_one_constraint_on_the_wire_and_one_spec_in_the_engine() -> None:
    wire = request(json_schema=SCHEMA).params.constraint
    assert wire == m.ConstraintWire("json_schema", json.dumps(SCHEMA), True)
    assert to_engine_params(request(json_schema=SCHEMA, strict=False).params).constraint == ConstraintSpec(
        "json_schema", json.dumps(SCHEMA), False)
    assert request(json_object=True).params.constraint == m.ConstraintWire("json_object")
    assert request(regex="[0-9]+").params.constraint == m.ConstraintWire("regex", "[0-9]+")
    assert request(grammar='start: "a"').params.constraint.kind == "grammar"
    assert request().params.constraint is None and request(json_object=False).params.constraint is None
    with pytest.raises(ValueError, match="at most one"):
        request(json_schema=SCHEMA, regex="x")
    params = to_engine_params(request(regex="[0-9]+").params)
    assert to_wire_params(params).constraint == m.ConstraintWire("regex", "[0-9]+")


def test_a_constraint_crosses_the_wire_and_a_bad_one_is_refused_by_the_router() -> None:
    req = request(json_schema=SCHEMA)
    assert decode_frames(encode_request(req)).params.constraint == req.params.constraint
    assert input_problem(req) is None
    empty_regex = m.GenerateRequest("r", "hi", params=m.SamplingParamsWire(constraint=m.ConstraintWire("regex")))
    assert "regex constraint needs a non-empty text" in input_problem(empty_regex)
    huge = request(regex="a" * (64 * 1024 + 1))
    assert "at most 65536 characters" in input_problem(huge)


def test_the_gateway_reads_response_format() -> None:
    ctx = ParseContext("m", 1000)

    def params(fmt: object) -> dict:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": fmt}
        return parse_chat(body, ctx).requests[0].kwargs()

    kw = params({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}})
    assert json.loads(kw["json_schema"]) == SCHEMA and kw["strict"] is True
    assert params({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})["strict"] is False
    assert params({"type": "json_object"})["json_object"] is True
    assert params({"type": "regex", "regex": "[a-z]+"})["regex"] == "[a-z]+"
    assert "json_schema" not in params({"type": "text"})
    for bad in ({"type": "yaml"}, "json", {"type": "regex"}, {"type": "json_schema", "json_schema": 3},
                {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": "yes"}}):
        with pytest.raises(ApiError):
            params(bad)


def test_an_expert_parallel_groups_control_channel_carries_a_constraint() -> None:
    from deepinfer.engine.request import SamplingParams
    from deepinfer.services.group.control import _pack as pack
    from deepinfer.services.group.control import _unpack as unpack
    from deepinfer.services.group.control import decode_params, encode_params

    params = SamplingParams(max_tokens=7, logit_bias={3: 1.5}, constraint=ConstraintSpec.regex("[0-9]+"))
    assert decode_params(unpack(pack(encode_params(params)))) == params
    plain = SamplingParams(max_tokens=7)
    assert decode_params(unpack(pack(encode_params(plain)))) == plain
