"""Conversions between the wire records and the engine's records, in one place for every service."""

from __future__ import annotations

import dataclasses

from deepinfer.engine.request import Logprob, SamplingParams
from deepinfer.protocol.messages import LogprobWire, SamplingParamsWire


def to_engine_params(wire: SamplingParamsWire) -> SamplingParams:
    """The engine's SamplingParams with the same values (lists copied: wire records are shared)."""
    values = {f.name: getattr(wire, f.name) for f in dataclasses.fields(SamplingParamsWire)}
    values["stop_token_ids"], values["stop"] = list(wire.stop_token_ids), list(wire.stop)
    return SamplingParams(**values)


def to_wire_logprobs(lps: list[Logprob] | None) -> list[LogprobWire] | None:
    if lps is None:
        return None
    return [LogprobWire(lp.token_id, lp.logprob, [tuple(t) for t in lp.top]) for lp in lps]


def from_wire_logprob(lp: LogprobWire | None) -> Logprob | None:
    return None if lp is None else Logprob(lp.token_id, lp.logprob, [tuple(t) for t in lp.top])
