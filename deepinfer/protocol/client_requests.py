"""The client's request building: a GenerateRequest from a caller's keyword arguments, checked before it is sent."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import fields
from typing import Any

from deepinfer.protocol import messages as m

_PARAM_NAMES = {f.name for f in fields(m.SamplingParamsWire)}


def build_request(request_id: str, prompt: str | None, messages: list[dict[str, str]] | None,
                  prompt_token_ids: list[int] | None, stream: bool, priority: int, api_key: str | None,
                  timeout_s: float | None, params: dict[str, Any]) -> m.GenerateRequest:
    """The GenerateRequest for these arguments; `params` are SamplingParamsWire's fields. `logit_bias` may be a
    mapping {token id: bias} (int keys, or str keys of digits as in OpenAI's JSON) or (token id, bias) pairs;
    it goes on the wire as pairs. Values are range-checked by the router, not here."""
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
                             stream, priority, api_key, timeout_s)


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
