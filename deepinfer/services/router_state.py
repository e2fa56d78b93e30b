"""The router's records: its configuration, metrics, the per-request state the core keeps, the
`Outbound` messages it returns, and the checks made on a request at arrival. Pure data, no logic
beyond validation; `router_core` drives them."""

from __future__ import annotations

import enum
import math
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from deepinfer.engine.request import InvalidRequestError
from deepinfer.protocol.messages import (
    FinishReason,
    GenerateRequest,
    LogprobWire,
    PrefillDone,
    SamplingParamsWire,
)
from deepinfer.services.placement import Assignment
from deepinfer.services.wire import to_engine_params

ClientId = bytes


@dataclass(frozen=True)
class Outbound:
    """A message to send: to a client when `dest` is bytes, to a service instance when it is str."""

    dest: ClientId | str
    msg: Any

    @property
    def to_client(self) -> bool:
        return isinstance(self.dest, bytes)


class Phase(enum.Enum):
    """Where a request is; the services holding state for it follow from the phase."""

    TOKENIZING = "tokenizing"  # holders: tokenizer
    PARKED = "parked"  # encoded, waiting for a live worker; holders: tokenizer
    PREFILLING = "prefilling"  # holders: tokenizer, prefill worker, decode worker
    DECODING = "decoding"  # holders: tokenizer, decode worker
    FINISHING = "finishing"  # output complete, PrefillDone awaited; holders: prefill worker


@dataclass(eq=False)
class RouterRequest:
    """One admitted request; exists from admission until its terminal message."""

    rid: str  # ours
    seq: int  # admission order
    client: ClientId
    req: GenerateRequest
    arrival: float
    deadline: float
    where: Assignment
    phase: Phase = Phase.TOKENIZING
    queued: bool = True  # counted in the router's queue (until decoding starts or it ends)
    queued_charge: int = 0  # prompt tokens it counts for in the queue: estimated, then exact
    prompt_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    parked_since: float = 0.0
    attempts: int = 0  # prefill jobs sent
    job_sent_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    text: list[str] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobWire] = field(default_factory=list)
    prefill_done: PrefillDone | None = None
    finish_reason: FinishReason | None = None
    stop_string: str | None = None
    client_gone: bool = False

    @property
    def params(self) -> SamplingParamsWire:
        return self.req.params

    @property
    def order(self) -> tuple[int, int]:
        return (self.req.priority, self.seq)


@dataclass(frozen=True)
class RouterConfig:
    max_queued_requests: int = 256
    max_queued_prompt_tokens: int = 64 * 1024
    heartbeat_timeout_s: float = 5.0
    progress_timeout_s: float | None = 60.0  # a worker with work whose progress stalls this long is dead
    request_timeout_s: float = 600.0  # when the client gives no timeout_s
    placement_timeout_s: float = 10.0  # how long an encoded request waits for a live worker
    block_size: int = 16  # KV block size of the workers (tokens), for free-block placement
    tenants: Mapping[str, str] = field(default_factory=dict)  # api_key → cache salt
    default_cache_salt: str | None = None
    require_api_key: bool = False
    retry_after_s: float = 1.0  # suggested to clients refused with "overloaded"
    id_prefix: str = ""
    max_ttft_samples: int = 1024


@dataclass
class RouterMetrics:
    """Counters. Invariant: admitted == sum(finished) + sum(errors) + the core's num_inflight."""

    max_ttft_samples: int = 1024
    admitted: int = 0
    rejected: Counter[str] = field(default_factory=Counter)  # refused at arrival, by error code
    finished: Counter[str] = field(default_factory=Counter)  # admitted, ended by RequestFinished, by reason
    errors: Counter[str] = field(default_factory=Counter)  # admitted, ended by ErrorReply, by code
    stale: int = 0  # messages dropped as stale
    retries: int = 0  # placements retried after a decode worker refused
    ttft_s: deque[float] = field(init=False)  # the latest time-to-first-token samples

    def __post_init__(self) -> None:
        self.ttft_s = deque(maxlen=self.max_ttft_samples)


def input_problem(req: GenerateRequest) -> str | None:
    """Why the request cannot be served as asked, or None. The tokenizer checks what needs the vocabulary."""
    if not req.request_id:
        return "request_id is empty"
    given = [x for x in (req.prompt, req.messages, req.prompt_token_ids) if x is not None]
    if len(given) != 1:
        return "give exactly one of prompt, messages or prompt_token_ids"
    if not given[0]:
        return "the prompt is empty"
    if req.timeout_s is not None and not (math.isfinite(req.timeout_s) and req.timeout_s > 0):
        return f"timeout_s must be a positive number of seconds, got {req.timeout_s!r}"
    try:
        to_engine_params(req.params).validate()
    except InvalidRequestError as e:
        return str(e)
    return None


def estimate_tokens(req: GenerateRequest) -> int:
    """Prompt tokens before encoding: exact for ids, about four characters a token for text."""
    if req.prompt_token_ids is not None:
        return len(req.prompt_token_ids)
    chars = len(req.prompt) if req.prompt is not None else sum(len(m.get("content", "")) for m in req.messages or [])
    return max(1, chars // 4)
