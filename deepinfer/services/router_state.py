"""The router's records: its configuration, metrics, the per-request state the core keeps, the
`Outbound` messages it returns, and the checks made on a request at arrival. Pure data, no logic
beyond validation; `router_core` drives them."""

from __future__ import annotations

import enum
import math
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from deepinfer.config.engine import DEFAULT_BLOCK_SIZE
from deepinfer.engine.request import InvalidRequestError
from deepinfer.protocol.messages import (
    FinishReason,
    GenerateRequest,
    LogprobWire,
    PrefillDone,
    RequestFinished,
    SamplingParamsWire,
    Timings,
    UsageWire,
)
from deepinfer.services.router_placement import Assignment
from deepinfer.services.wire import to_engine_params

ClientId = bytes
CACHE_AWARE, LEAST_LOADED = "cache_aware", "least_loaded"
PLACEMENTS = (CACHE_AWARE, LEAST_LOADED)
# RouterConfig.prefill_site: "conditional" (per request, local_prefill_max_tokens below) or "local" (every request
# of a P/D pair prefilled on its decode worker: the always-local baseline conditional disaggregation is measured
# against, bench/replay_sweep.py).
PREFILL_SITES = ("conditional", "local")
ANONYMOUS = ""  # the tenant of every request whose api_key the configuration does not name


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

    rid: str  # ours, as the services know it now (a new one each time the request moves)
    seq: int  # admission order
    client: ClientId
    req: GenerateRequest
    arrival: float
    deadline: float
    where: Assignment
    phase: Phase = Phase.TOKENIZING
    queued: bool = False  # counted in the router's queue (from admission until decoding starts or it ends)
    queued_charge: int = 0  # prompt tokens it counts for in the queue: estimated, then exact
    cache_salt: str | None = None  # the tenant's, from the api_key
    prompt_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    predicted_blocks: dict[str, int] = field(default_factory=dict)  # by tier, on the prefill worker it was sent to
    parked_since: float = 0.0
    attempts: int = 0  # prefill jobs sent
    job_sent_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    text: list[str] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobWire] = field(default_factory=list)
    # Asked for with params.prompt_logprobs: from the first text item that had them; sent to a streaming
    # client (with prompt_ids) on its first delta, and in the RequestFinished.
    prompt_logprobs: list[LogprobWire | None] | None = None
    streamed: bool = False  # a StreamDelta went to the client
    prefill_done: PrefillDone | None = None
    # Speculative decoding's counts for this request, the latest totals its decode worker reported.
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    finish_reason: FinishReason | None = None
    stop_string: str | None = None
    client_gone: bool = False
    tenant: str = ""  # its api_key if configured, else ANONYMOUS: whose policy and quotas it falls under
    priority: int = 0  # the client's, raised to the tenant's floor
    moves: int = 0  # times it continued elsewhere after losing a worker or its tokenizer
    resumed: bool = False  # admitted again after its client lost the router that held it (router_resume)
    # Reclaimed from the worker that kept it through a router restart (router_resume): that worker, until
    # the request moves or ends; a refusal from it before any new token sends the request to be computed.
    reclaim_from: str | None = None
    job_output: int = 0  # output tokens it had when its current prefill job was sent (the job's resume point)
    handoff_retries: int = 0  # times it was placed anew after its prefill or KV handoff failed
    avoid: frozenset[str] = frozenset()  # workers its next placement avoids (where its handoff failed)
    ttft_slo_s: float | None = None  # its tenant's, tightened by its own
    predicted_ttft_s: float | None = None  # at its first placement: its wait then plus the predicted prefill
    tpot_slo_s: float | None = None  # its tenant's, tightened by its own
    predicted_tpot_s: float | None = None  # at its first placement: its decode worker's, with it added

    @property
    def params(self) -> SamplingParamsWire:
        return self.req.params

    @property
    def order(self) -> tuple[int, int]:
        return (self.priority, self.seq)

    @property
    def job_tokens(self) -> list[int]:
        """What a prefill worker computes: the prompt, and the output so far of a request that moved."""
        return self.prompt_ids + self.output_ids

    @property
    def tpot_s(self) -> float | None:
        """Its time per output token so far: from its first token to its last, over the tokens between."""
        first, last, n = self.first_token_at, self.last_token_at, len(self.output_ids)
        return None if first is None or last is None or n < 2 else (last - first) / (n - 1)

    def result(self, reason: FinishReason, now: float) -> RequestFinished:
        """The client's RequestFinished for it, ending now for `reason`."""
        done = self.prefill_done
        usage = UsageWire(
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.output_ids),
            cached_tokens=done.num_cached_tokens if done else 0,
            cached_by_tier=dict(done.cached_by_tier) if done else {},
            spec_proposed_tokens=self.spec_proposed_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens,
        )
        first = self.first_token_at
        timings = Timings(
            e2e_s=now - self.arrival,
            ttft_s=None if first is None else first - self.arrival,
            tpot_s=self.tpot_s,
            queue_s=None if self.job_sent_at is None else self.job_sent_at - self.arrival,
            prefill_s=done.prefill_s if done else None,
        )
        stop = self.stop_string if reason == "stop" else None
        logprobs: list[LogprobWire] | None = self.logprobs or None
        prompt_ids = list(self.prompt_ids) if self.params.prompt_logprobs is not None and self.prompt_ids else None
        return RequestFinished(self.req.request_id, "".join(self.text), self.output_ids, reason, usage, timings, stop,
                               logprobs, prompt_ids, self.prompt_logprobs)


@dataclass(frozen=True)
class RouterConfig:
    """The router's settings (a topology's [router] table, see deepinfer.launch.topology). Frozen all the
    way down: the per-tenant mappings are kept as read-only copies, so a config shared by the topology
    tree and the running router cannot change under either."""

    max_queued_requests: int = 256
    max_queued_prompt_tokens: int = 64 * 1024
    heartbeat_timeout_s: float = 5.0
    progress_timeout_s: float | None = 60.0  # a worker with work whose progress stalls this long is dead
    request_timeout_s: float = 600.0  # when the client gives no timeout_s
    # How long an encoded request waits for a live worker: long enough for a supervised worker to restart
    # and load its model (seconds here, tens of seconds with large weights), e.g. the only prefill worker.
    placement_timeout_s: float = 30.0
    max_moves: int = 3  # times a request may continue elsewhere after losing a worker before worker_lost
    block_size: int = DEFAULT_BLOCK_SIZE  # KV block size of the workers (tokens), for free-block placement
    tenants: Mapping[str, str] = field(default_factory=dict)  # api_key → cache salt
    default_cache_salt: str | None = None
    require_api_key: bool = False
    # Tenant policy, by api_key ("" for requests without one). Priority: lower is served first, and a
    # request's is raised to its tenant's floor (clients choose within what their tenant may have).
    priority_floor: Mapping[str, int] = field(default_factory=dict)
    default_priority_floor: int = 0
    # Requests one tenant may have in flight (admitted, not ended); past it new ones get "overloaded".
    max_inflight_per_tenant: Mapping[str, int] = field(default_factory=dict)
    default_max_inflight_per_tenant: int | None = None
    retry_after_s: float = 1.0  # suggested to clients refused with "overloaded"
    # Load shedding: new requests are refused ("overloaded", with a retry_after_s of the excess) while the
    # prefill backlog's predicted wait (router_cache.PrefillCostModel.backlog_s) is over this; None: never.
    # 60 s is what HTTP proxies commonly wait for a first byte (nginx's proxy_read_timeout): a request
    # predicted to wait longer for its first token would mostly be cut off by one anyway.
    max_queue_wait_s: float | None = 60.0
    # Prompt tokens one tenant may have queued (admitted, not decoding yet), by api_key; past it its new
    # requests get "overloaded" (a lone prompt is never refused for its size). None: only the global limit.
    max_queued_prompt_tokens_per_tenant: Mapping[str, int] = field(default_factory=dict)
    default_max_queued_prompt_tokens_per_tenant: int | None = None
    # Time-to-first-token SLO (seconds from arrival) by api_key, and for keys it does not name; None: none.
    # A request may tighten its tenant's (GenerateRequest.ttft_slo_s), never loosen it. When it is placed,
    # a request whose predicted TTFT — its wait so far plus the chosen worker's predicted queue, fetch and
    # compute (router_cache) — is over its SLO ends with "overloaded" (shed cause ttft_slo) and a retry_after_s
    # of the excess, before any prefill is spent on it: refused early rather than served late.
    ttft_slo_s: Mapping[str, float] = field(default_factory=dict)
    default_ttft_slo_s: float | None = None
    # Time-per-output-token SLO (seconds between a stream's tokens) by api_key, and for keys it does not name;
    # a request may tighten it (GenerateRequest.tpot_slo_s). At its first placement a request goes only to a
    # decode worker whose measured cadence (Heartbeat.tpot_by_batch) predicts, with one more stream, tokens no
    # slower than its SLO and than every SLO already promised there; with none, it ends with "overloaded"
    # (shed cause tpot_slo) before any prefill. A request without one is also kept off a decode worker it
    # would push past a stream's promise. Nothing is refused on a worker that has not measured its cadence.
    tpot_slo_s: Mapping[str, float] = field(default_factory=dict)
    default_tpot_slo_s: float | None = None
    id_prefix: str = ""
    max_ttft_samples: int = 1024
    # Prefill placement: "cache_aware" (least predicted prefill time, from the prefix index and measured
    # rates: router_cache) or "least_loaded" (fewest queued prompt tokens; no cache knowledge, the baseline).
    placement: str = CACHE_AWARE
    prior_prefill_tokens_per_s: float = 600.0  # a worker's prefill rate until it has reported one
    prior_host_fetch_s_per_token: float = 2e-5  # loading a cached token from the daemon's DRAM…
    prior_disk_fetch_s_per_token: float = 6e-5  # …and from its disk, until measured
    estimate_alpha: float = 0.2  # EWMA weight of each new measurement
    # Conditional disaggregation (with cache_aware placement): a request is prefilled on the decode worker
    # it will decode on when that is predicted no slower than a prefill worker plus the KV handoff, and it
    # leaves at most this many prompt tokens to compute there (they share the decode worker's steps with its
    # running streams). 0 (the default: a P/D pair was asked for): always on a prefill worker.
    local_prefill_max_tokens: int = 0
    prefill_site: str = "conditional"  # PREFILL_SITES; "local": every request prefills on its decode worker
    prior_handoff_s_per_block: float = 2e-3  # a KV handoff's time per block of prompt, until measured
    kv_resync_interval_s: float = 5.0  # least time between KvResyncs to one publisher awaiting a snapshot

    def __post_init__(self) -> None:
        for name in ("tenants", "priority_floor", "max_inflight_per_tenant", "max_queued_prompt_tokens_per_tenant",
                     "ttft_slo_s", "tpot_slo_s"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")
        rates = (self.prior_prefill_tokens_per_s, self.prior_host_fetch_s_per_token, self.prior_disk_fetch_s_per_token,
                 self.prior_handoff_s_per_block)
        if not all(math.isfinite(r) and r >= 0 for r in rates) or self.prior_prefill_tokens_per_s <= 0:
            raise ValueError("prior rates must be finite, the prefill rate positive and fetch costs non-negative")
        for kind in ("ttft", "tpot"):
            table, default = getattr(self, f"{kind}_slo_s"), getattr(self, f"default_{kind}_slo_s")
            slos = [*table.values(), *([] if default is None else [default])]
            if not all(isinstance(v, int | float) and math.isfinite(v) and v > 0 for v in slos):
                raise ValueError(f"{kind.upper()} SLOs must be positive numbers of seconds, got {slos}")
        if self.prefill_site not in PREFILL_SITES:
            raise ValueError(f"prefill_site must be one of {', '.join(PREFILL_SITES)}, got {self.prefill_site!r}")
        if self.local_prefill_max_tokens < 0:
            raise ValueError(f"local_prefill_max_tokens must be >= 0, got {self.local_prefill_max_tokens}")
        if not 0 < self.estimate_alpha <= 1:
            raise ValueError(f"estimate_alpha must be in (0, 1], got {self.estimate_alpha}")
        if self.max_queue_wait_s is not None and not (math.isfinite(self.max_queue_wait_s) and
                                                      self.max_queue_wait_s > 0):
            raise ValueError(f"max_queue_wait_s must be a positive number of seconds, got {self.max_queue_wait_s}")

    def ttft_slo(self, tenant: str, asked: float | None) -> float | None:
        """A request's TTFT SLO: its tenant's, tightened by the one it `asked` for."""
        own = self.ttft_slo_s.get(tenant, self.default_ttft_slo_s)
        return asked if own is None else own if asked is None else min(own, asked)

    def tpot_slo(self, tenant: str, asked: float | None) -> float | None:
        """A request's TPOT SLO: its tenant's, tightened by the one it `asked` for."""
        own = self.tpot_slo_s.get(tenant, self.default_tpot_slo_s)
        return asked if own is None else own if asked is None else min(own, asked)

    def known_tenant(self, api_key: str | None) -> str:
        """Whose quota and policy a request falls under: its api_key when the configuration names that key
        (a salt or any per-tenant setting), else the one anonymous tenant "" — every unknown or missing key
        shares it, so rotating made-up keys cannot escape the per-tenant limits."""
        if api_key and any(api_key in table for table in (self.tenants, self.priority_floor,
                                                           self.max_inflight_per_tenant,
                                                           self.max_queued_prompt_tokens_per_tenant,
                                                           self.ttft_slo_s, self.tpot_slo_s)):
            return api_key
        return ANONYMOUS


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
    moves: int = 0  # requests that continued elsewhere after losing a worker or tokenizer
    # Requests placed anew elsewhere, by cause: "<role>_death" (prefill, decode, worker, tokenizer: its
    # process died, restarted or stopped heartbeating), "handoff_failure" (the prefill or its KV handoff
    # failed without a death: moved, or a refused reservation retried), "drain", "router_lost" (its client
    # lost the router that held it and resumed it here: router_resume).
    migrations: Counter[str] = field(default_factory=Counter)
    # ResumeRequests by outcome: "attached" (this router held the request), "readmitted", "refused".
    resumes: Counter[str] = field(default_factory=Counter)
    # Admission refusals with "overloaded", by cause: queue_requests, queue_tokens, predicted_wait,
    # tenant_inflight, tenant_tokens, draining, ttft_slo, tpot_slo (also counted in `rejected`, or in `errors`
    # when the refusal came once the request was encoded: a token limit broken by the exact prompt length, a
    # TTFT or TPOT SLO the placement's prediction misses).
    shed: Counter[str] = field(default_factory=Counter)
    refused_deltas: int = 0  # text deltas of a request from another worker than the one it was placed on
    # Where requests with a prefill/decode pair to choose from were prefilled (conditional disaggregation):
    # "remote" (a prefill worker, then the KV handoff) or "local" (on their decode worker).
    prefill_sites: Counter[str] = field(default_factory=Counter)
    handoffs_adopted: int = 0  # prefill worker lost after its KV reached the decode worker: decoding went on
    kv_events: int = 0  # KvEvents applied to the prefix index
    resyncs: int = 0  # KvResync sent
    # The prefix index's accuracy, over requests whose PrefillDone came: predicted cached blocks × block
    # size (the worker computes at least the last token, so a full hit reports a little less), and reported.
    predicted_cached_tokens: int = 0
    actual_cached_tokens: int = 0
    predicted_cached_by_tier: Counter[str] = field(default_factory=Counter)
    actual_cached_by_tier: Counter[str] = field(default_factory=Counter)
    # Speculative decoding over requests ended by RequestFinished: draft tokens proposed and accepted.
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    ttft_s: deque[float] = field(init=False)  # the latest time-to-first-token samples
    # Actual TTFT over the TTFT predicted at first placement, per request, until the metrics take them.
    ttft_over_predicted: deque[float] = field(init=False)
    # Actual TPOT (over its decode) over the TPOT predicted at first placement, per finished request.
    tpot_over_predicted: deque[float] = field(init=False)

    def __post_init__(self) -> None:
        self.ttft_s = deque(maxlen=self.max_ttft_samples)
        self.ttft_over_predicted = deque(maxlen=self.max_ttft_samples)
        self.tpot_over_predicted = deque(maxlen=self.max_ttft_samples)

    def count_cached(self, predicted_blocks: Mapping[str, int], block_size: int, done: PrefillDone) -> None:
        """One finished prefill's cached tokens: as the prefix index predicted (blocks by tier), as the
        worker found."""
        self.predicted_cached_tokens += sum(predicted_blocks.values()) * block_size
        self.actual_cached_tokens += done.num_cached_tokens
        self.predicted_cached_by_tier.update({t: n * block_size for t, n in predicted_blocks.items() if n > 0})
        self.actual_cached_by_tier.update({t: n for t, n in done.cached_by_tier.items() if n > 0})

    def count_speculation(self, usage: UsageWire) -> None:
        """One finished request's draft tokens: proposed, and accepted by the model."""
        self.spec_proposed_tokens += usage.spec_proposed_tokens
        self.spec_accepted_tokens += usage.spec_accepted_tokens

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted / proposed over the finished requests; None before any draft token was proposed."""
        return self.spec_accepted_tokens / self.spec_proposed_tokens if self.spec_proposed_tokens else None


def input_problem(req: GenerateRequest) -> str | None:
    """Why the request cannot be served as asked, or None. The tokenizer checks what needs the vocabulary."""
    if not req.request_id:
        return "request_id is empty"
    given = [x for x in (req.prompt, req.messages, req.prompt_token_ids) if x is not None]
    if len(given) != 1:
        return "give exactly one of prompt, messages or prompt_token_ids"
    if not given[0]:
        return "the prompt is empty"
    for name in ("timeout_s", "ttft_slo_s", "tpot_slo_s"):
        value = getattr(req, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            return f"{name} must be a positive number of seconds, got {value!r}"
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
