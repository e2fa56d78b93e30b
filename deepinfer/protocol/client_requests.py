"""The client's request building: a GenerateRequest from a caller's keyword arguments, checked before it is sent.

`encode_request` is the one way a client turns a message for the router into frames: it refuses, with the
request's own typed error, anything the router's front would refuse (isolation by request, DESIGN §9). A
request that does not fit the wire never reaches the socket, so it cannot cost the other requests sharing
the connection anything, and its caller gets `RequestTooLargeError` (over CLIENT_LIMITS: a prompt past 2 MiB,
too many token ids) or `InvalidRequestError` (a value the wire cannot carry: an integer outside int64, such as
`max_tokens=2**64`) at once, never a ProtocolError and never a hang.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from dataclasses import fields
from typing import Any

from deepinfer.protocol import messages as m
from deepinfer.protocol.client_errors import InvalidRequestError, RequestTooLargeError
from deepinfer.protocol.errors import ProtocolError
from deepinfer.protocol.framing import OutFrame, decode_frames, encode_frames
from deepinfer.protocol.limits import CLIENT_LIMITS
from deepinfer.protocol.records import INT64_MAX, INT64_MIN

_PARAM_NAMES = {f.name for f in fields(m.SamplingParamsWire)}


def build_request(request_id: str, prompt: str | None, messages: list[dict[str, str]] | None,
                  prompt_token_ids: list[int] | None, stream: bool, priority: int, api_key: str | None,
                  timeout_s: float | None, params: dict[str, Any]) -> m.GenerateRequest:
    """The GenerateRequest for these arguments; `params` are SamplingParamsWire's fields. `logit_bias` may be a
    mapping {token id: bias} (int keys, or str keys of digits as in OpenAI's JSON) or (token id, bias) pairs;
    it goes on the wire as pairs. `params` may also hold `ttft_slo_s` and `tpot_slo_s` (the request's
    time-to-first-token and time-per-output-token SLOs), and structured output as one of `json_schema` (a
    mapping or its JSON text; `strict`, default True), `json_object=True`, `regex` or `grammar` (Lark) — or a
    `constraint` ConstraintWire.
    Values are range-checked by the router, not here."""
    params = dict(params)
    ttft_slo_s, tpot_slo_s = params.pop("ttft_slo_s", None), params.pop("tpot_slo_s", None)
    constraint = constraint_of(params)
    if constraint is not None:
        params["constraint"] = constraint
    unknown = set(params) - _PARAM_NAMES
    if unknown:
        raise TypeError(f"unknown sampling parameters: {sorted(unknown)}")
    if sum(x is not None for x in (prompt, messages, prompt_token_ids)) != 1:
        raise ValueError("give exactly one of prompt, messages or prompt_token_ids")
    if params.get("logit_bias") is not None:
        params = {**params, "logit_bias": logit_bias_pairs(params["logit_bias"])}
    elif "logit_bias" in params:
        params = {k: v for k, v in params.items() if k != "logit_bias"}
    return m.GenerateRequest(request_id, prompt, messages, prompt_token_ids, m.SamplingParamsWire(**params),
                             stream, priority, api_key, timeout_s, ttft_slo_s, tpot_slo_s)


CONSTRAINT_KEYS = ("json_schema", "json_object", "regex", "grammar")


def constraint_of(params: dict[str, Any]) -> m.ConstraintWire | None:
    """Take the structured-output keys out of `params` (`build_request`): the ConstraintWire they ask for."""
    strict = params.pop("strict", True)
    given = {k: params.pop(k) for k in CONSTRAINT_KEYS if params.get(k) not in (None, False)}
    for k in CONSTRAINT_KEYS:
        params.pop(k, None)
    if len(given) + ("constraint" in params and params["constraint"] is not None) > 1:
        raise ValueError(f"give at most one of {', '.join(CONSTRAINT_KEYS)} or constraint")
    if not given:
        return None
    [(kind, value)] = given.items()
    if kind == "json_object":
        return m.ConstraintWire("json_object")
    if kind == "json_schema" and not isinstance(value, str):
        value = json.dumps(value, ensure_ascii=False)
    if not isinstance(value, str):
        raise TypeError(f"{kind} must be a string, got {type(value).__name__}")
    return m.ConstraintWire(kind, value, bool(strict))


def logit_bias_pairs(bias: Mapping[int | str, float] | Iterable[tuple[int, float]]) -> list[tuple[int, float]]:
    """logit_bias as the wire carries it: (token id, bias) pairs. Keys of a mapping may be ints or str of
    digits (OpenAI's JSON); a key that is neither, or a value that is no number, raises ValueError. Ranges are
    the router's to check."""
    items = bias.items() if isinstance(bias, Mapping) else bias
    out: list[tuple[int, float]] = []
    for key, value in items:
        if isinstance(key, str):
            if not key.strip().lstrip("-").isdigit():
                raise ValueError(f"logit_bias key {key!r:.40} is not a token id")
            key = int(key)
        if not isinstance(key, int) or isinstance(key, bool):
            raise ValueError(f"logit_bias key {key!r:.40} is not a token id")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"logit_bias[{key}] = {value!r:.40} is not a number")
        out.append((key, float(value)))
    return out


def encode_request(msg: Any) -> list[OutFrame]:
    """The frames of `msg` (a GenerateRequest, AbortRequest or Hello) for the router's client front, checked as
    the router will check them: encoded under CLIENT_LIMITS and decoded back under them (so a message the
    router would refuse is refused here: sizes, counts, int64 ranges). Raises RequestTooLargeError or
    InvalidRequestError carrying the message's request id; the decode costs about what the encode did."""
    rid = getattr(msg, "request_id", "")
    try:
        frames = encode_frames(msg, CLIENT_LIMITS)
        decode_frames(frames, CLIENT_LIMITS)
    except ProtocolError as exc:
        if exc.code == "too_large":
            raise RequestTooLargeError(f"request_too_large: {exc.detail} (the router's client limit)", rid) from None
        where = _int_out_of_range(msg, type(msg).__name__) if exc.code == "bad_field" else None
        raise InvalidRequestError(f"invalid_request: {where or exc}", rid) from None
    return frames


def _int_out_of_range(value: Any, path: str) -> str | None:
    """Where the first integer outside int64 is in `value` (records, lists, tuples, dicts), or None. Only run
    once encoding failed, to name the field msgpack could not carry."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        if INT64_MIN <= value <= INT64_MAX:
            return None
        # str() of a huge int is slow, and refused past 4,300 digits: name its size instead.
        shown = str(value) if value.bit_length() <= 128 else f"an integer of {value.bit_length()} bits"
        return f"{path} = {shown} does not fit a 64-bit integer"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        items: Iterable[tuple[str, Any]] = ((f"{path}.{f.name}", getattr(value, f.name)) for f in fields(value))
    elif isinstance(value, (list, tuple)):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    elif isinstance(value, dict):
        items = ((f"{path}[{k!r:.40}]", v) for k, v in value.items())
    else:
        return None
    for where, item in items:
        found = _int_out_of_range(item, where)
        if found is not None:
            return found
    return None
