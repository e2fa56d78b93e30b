"""Conversions between the wire records and the engine's records, in one place for every service."""

from __future__ import annotations

import dataclasses

from deepinfer.engine.request import InvalidRequestError, Logprob, SamplingParams
from deepinfer.grammar import ConstraintSpec, GrammarError
from deepinfer.protocol.messages import ConstraintWire, LogprobWire, SamplingParamsWire


def to_engine_params(wire: SamplingParamsWire) -> SamplingParams:
    """The engine's SamplingParams with the same values (lists copied: wire records are shared). The wire's
    logit_bias pairs become the engine's mapping; a token id given twice is InvalidRequestError."""
    values = {f.name: getattr(wire, f.name) for f in dataclasses.fields(SamplingParamsWire)}
    values["stop_token_ids"], values["stop"] = list(wire.stop_token_ids), list(wire.stop)
    bias: dict[int, float] = {}
    for token_id, value in wire.logit_bias:
        if token_id in bias:
            raise InvalidRequestError(f"logit_bias names token id {token_id} more than once")
        bias[token_id] = value
    values["logit_bias"] = bias
    c = wire.constraint
    try:
        values["constraint"] = None if c is None else ConstraintSpec(c.kind, c.text, c.strict)
    except GrammarError as exc:
        raise InvalidRequestError(f"invalid constraint: {exc.reason}") from None
    return SamplingParams(**values)


def to_wire_params(params: SamplingParams) -> SamplingParamsWire:
    """The wire twin of the engine's SamplingParams (logit_bias as (token id, bias) pairs, by token id)."""
    values = {f.name: getattr(params, f.name) for f in dataclasses.fields(SamplingParamsWire)}
    values["stop_token_ids"], values["stop"] = list(params.stop_token_ids), list(params.stop)
    values["logit_bias"] = sorted((int(t), float(b)) for t, b in params.logit_bias.items())
    c = params.constraint
    values["constraint"] = None if c is None else ConstraintWire(c.kind, c.text, c.strict)
    return SamplingParamsWire(**values)


def to_wire_logprob(lp: Logprob) -> LogprobWire:
    return LogprobWire(lp.token_id, lp.logprob, [tuple(t) for t in lp.top])


def to_wire_logprobs(lps: list[Logprob] | None) -> list[LogprobWire] | None:
    return None if lps is None else [to_wire_logprob(lp) for lp in lps]


def from_wire_logprob(lp: LogprobWire | None) -> Logprob | None:
    return None if lp is None else Logprob(lp.token_id, lp.logprob, [tuple(t) for t in lp.top])


def to_wire_prompt_logprobs(lps: list[Logprob | None] | None) -> list[LogprobWire | None] | None:
    """Prompt logprobs: one per prompt token, the first None (no context before it)."""
    if lps is None:
        return None
    return [None if lp is None else to_wire_logprob(lp) for lp in lps]


def from_wire_prompt_logprobs(lps: list[LogprobWire | None] | None) -> list[Logprob | None] | None:
    return None if lps is None else [from_wire_logprob(lp) for lp in lps]
