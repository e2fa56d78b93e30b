"""The mesh's messages: every record that crosses a socket, in one place.

Type bytes are grouped by edge; a range is reserved for each part still to come:

  0x01–0x0F  session and control (handshake, heartbeats, abort, errors, shutdown, drain)
  0x10–0x1F  client ↔ router
  0x20–0x2F  router ↔ tokenizer ↔ decode worker
  0x30–0x3F  router → prefill worker ↔ decode worker (P/D handoff), held requests after a router restart
  0x40–0x4F  KV cache: worker ↔ cache daemon (lookup, fetch, store), KV events → router
  0x50–0x5F  expert parallelism: load reports, the expert balancer's placements and their results
  0xF0–0xFF  reserved: tests and experiments

Conventions: request ids are the router's strings, unique per router incarnation. Times named `*_time`
are Unix seconds from the sender's clock (for logs and metrics only: hosts' clocks may differ); durations
are `*_s` seconds measured on one host. Token ids are ints; block hashes are the raw digest bytes.
Sequences are lists on the wire and in Python (records are frozen; their lists are never mutated after
sending). Changing any record's meaning or fields bumps PROTOCOL_VERSION: a decoder refuses fields it does
not know, so even an added optional field would break an older peer mid-stream instead of at the handshake.
A field added with a default still decodes when a message lacks it.

Version history: 3 added speculative decoding's counts (UsageWire, DetokenizeItem, TextDeltaItem,
Heartbeat); 6 added ExpertLoad; 7 added the expert balancer's messages (PlacementTable in ExpertLoad,
PlacementUpdate, PlacementResult); 8 added prompt logprobs (SamplingParamsWire.prompt_logprobs, the
prompt_logprobs of DetokenizeItem, TextDeltaItem, KvTransfer, StreamDelta and RequestFinished, the latter two
with prompt_token_ids), logit_bias, per-item logprobs on every DetokenizeItem, and the error codes
"unauthorized" and "unavailable"; 9 added the error code "request_too_large" (the router refuses an oversized
request by its id instead of dropping the connection it came on), graceful drain (DrainService,
ServiceQuery, ServiceStatus and Shutdown.timeout_s), and the namespace of CacheLookup and CacheFetch; 10 added
a client's readiness question (MeshQuery, MeshStatus); 13 added stream resumption across a lost router connection
(ResumeRequest, Resumed) and ServiceStatus's restarts, load and cached blocks (the `status` command); 15 added
TPOT SLOs (GenerateRequest.tpot_slo_s, Heartbeat.tpot_by_batch); 16 structured output
(SamplingParamsWire.constraint).
"""

from __future__ import annotations

from dataclasses import field
from typing import Literal

from deepinfer.protocol.records import compile_all, message, record
from deepinfer.protocol.tensors import Tensor

__all__ = [
    "PROTOCOL_VERSION",
    "AbortRequest",
    "CacheBlocks",
    "CacheFetch",
    "CacheLookup",
    "CacheLookupReply",
    "CachePrefetch",
    "CacheStore",
    "CacheStoreAck",
    "ConstraintWire",
    "DetokenizeBatch",
    "DetokenizeItem",
    "DrainService",
    "EncodeRequest",
    "EncodeResult",
    "ErrorCode",
    "ErrorReply",
    "ExpertLoad",
    "FinishReason",
    "GenerateRequest",
    "Heartbeat",
    "HeldRequest",
    "HeldRequests",
    "Hello",
    "KvAck",
    "KvEvents",
    "KvReserve",
    "KvReserveReply",
    "KvResync",
    "KvTransfer",
    "LogprobWire",
    "MeshQuery",
    "MeshStatus",
    "PlacementResult",
    "PlacementTable",
    "PlacementUpdate",
    "PrefillDone",
    "PrefillJob",
    "Reclaim",
    "RequestFinished",
    "ResumeRequest",
    "Resumed",
    "SamplingParamsWire",
    "ServiceExited",
    "ServiceQuery",
    "ServiceStatus",
    "Shutdown",
    "StreamDelta",
    "TextDeltaItem",
    "TextDeltas",
    "Timings",
    "UsageWire",
    "Welcome",
]

PROTOCOL_VERSION = 16  # 14: HeldRequests, Reclaim, client_key; 15: TPOT SLOs; 16: structured output
MAX_FETCH_BLOCKS = 192  # blocks per CacheBlocks reply: one frame each, inside Limits.max_frames

# Mirrors deepinfer.engine.request.FinishReason values. Engine failures end a request with ErrorReply
# rather than finish_reason "error"; the value exists so the engine's enum maps one to one.
FinishReason = Literal["stop", "length", "abort", "error"]

ErrorCode = Literal[
    "overloaded",  # admission refused: queue full, the tenant's in-flight cap, or draining; retry later (retry_after_s)
    "unauthorized",  # the router requires an api_key and this one is unknown or missing; do not retry
    "unavailable",  # no live worker or tokenizer can take the request now; retry once the mesh recovers
    "invalid_request",  # the request itself is wrong (bad params, prompt too long, no input); do not retry
    "request_too_large",  # the request's message is over the client front's limits (protocol.limits); do not retry
    "bad_message",  # the peer's message broke the wire contract (ProtocolError); request_id may be ""
    "worker_lost",  # a worker holding the request died or stopped making progress
    "timeout",  # the request's deadline passed
    "internal",  # a bug or unexpected failure inside a service
]


# --- nested records --------------------------------------------------------------------------------------


@record
class ConstraintWire:
    """Structured output (deepinfer.grammar.ConstraintSpec's twin): the output must match `text` as `kind` says —
    a JSON schema (`strict`: every keyword enforced, else unenforceable ones ignored), any JSON object (no text),
    a regular expression, or a Lark grammar."""

    kind: Literal["json_schema", "json_object", "regex", "grammar"]
    text: str = ""
    strict: bool = True


@record
class SamplingParamsWire:
    """Wire twin of engine.request.SamplingParams: same names and defaults; services convert.
    Values are type-checked here and range-checked by SamplingParams.validate() at the router (token ids
    against the vocabulary by the worker's engine, which refuses them with "invalid_request").

    `prompt_logprobs` (like vLLM's): the log-probability of every prompt token given the tokens before it,
    plus that many top alternatives (0: only the prompt token's own), at most MAX_LOGPROBS (20).
    `logit_bias` (OpenAI's): (token id, bias) pairs, the bias added to that token's logit before sampling;
    a list of pairs because the codec admits only str map keys (clients may pass a {token id: bias} mapping
    to `build_request`, which turns it into pairs). Each token id at most once, biases finite in [-100, 100],
    at most MAX_LOGIT_BIAS (300) pairs. `constraint`: structured output (ConstraintWire); a text of at most
    MAX_CONSTRAINT_CHARS (64 Ki) characters, compiled by the worker (one that cannot compile is "invalid_request",
    with the reason)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: list[tuple[int, float]] = field(default_factory=list)
    constraint: ConstraintWire | None = None


@record
class LogprobWire:
    """The chosen token's log-probability and the top alternatives (token_id, logprob), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@record
class UsageWire:
    """Token accounting of one finished request; cached_by_tier splits cached_tokens by where the
    prefix KV came from ("device", "host", "disk"). With speculative decoding on the decode worker,
    spec_proposed_tokens draft tokens were checked and spec_accepted_tokens of them accepted (each
    accepted one is a completion token that cost no step of its own)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0


@record
class Timings:
    """Latencies of one request as the router saw them (None where a phase did not happen)."""

    e2e_s: float  # arrival at the router → finished
    ttft_s: float | None = None  # arrival → first text delta sent to the client
    tpot_s: float | None = None  # mean time per output token after the first
    queue_s: float | None = None  # arrival → prefill job sent
    prefill_s: float | None = None  # prefill compute (reported by the prefill worker)


@record
class DetokenizeItem:
    """One request's new tokens from one decode step, or from consecutive steps merged (stream interval)."""

    request_id: str
    offset: int  # generated tokens before token_ids[0]: lets the tokenizer spot gaps and duplicates
    token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    logprobs: list[LogprobWire] | None = None  # one per token id, in order, when the request asked for them
    # Only on a request's first item (offset 0), when it asked for them: one per prompt token, the first None
    # (no context before it). Computed by the engine that prefilled the prompt (KvTransfer carries them).
    prompt_logprobs: list[LogprobWire | None] | None = None
    # The request's speculation totals so far (draft tokens proposed, accepted), not this step's: a lost or
    # duplicated item cannot skew them, and a stream cut short by a stop string still reports its count.
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0


@record
class TextDeltaItem:
    """One request's new text: `text` decodes `token_ids` (a delta never ends inside a UTF-8 character)."""

    request_id: str
    offset: int  # generated tokens before token_ids[0]
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_string: str | None = None  # the stop string that ended it (not included in text)
    logprobs: list[LogprobWire] | None = None  # one per token id (a stop string cuts both alike)
    spec_proposed_tokens: int = 0  # the request's totals so far, as its DetokenizeItem carried them
    spec_accepted_tokens: int = 0
    prompt_logprobs: list[LogprobWire | None] | None = None  # as its DetokenizeItem carried them (first item)


@record
class PlacementTable:
    """Wire twin of parallel.placement.ExpertPlacement (its `to_dict` keys): per MoE layer, the logical
    expert in each global slot (-1: empty), slot g on rank g // slots_per_rank. Checked against the
    placement's invariants where it is turned back into one (`ExpertPlacement.from_dict`), not here."""

    version: int
    num_ranks: int
    num_experts: int
    slots_per_rank: int
    layers: list[list[int]] = field(default_factory=list)


# --- session and control 0x01–0x0F --------------------------------------------------------------------------


@message(0x01)
class Hello:
    """Connecting peer → bound peer, first message on every DEALER → ROUTER connection.
    model_fingerprint / block_hash_scheme are None for peers that hold no model state (clients)."""

    protocol_version: int
    service: str  # "router", "tokenizer", "prefill", "decode", "kvcache", "balancer", "client"
    instance: str  # unique name of this process in the mesh (its DEALER identity)
    model_fingerprint: str | None = None
    block_hash_scheme: str | None = None
    capabilities: dict[str, str] = field(default_factory=dict)


@message(0x02)
class Welcome:
    """Bound peer → connecting peer, reply to Hello. When not accepted, `reason` says why and the bound
    peer ignores everything else from that identity until a new Hello."""

    protocol_version: int
    accepted: bool
    reason: str = ""
    service: str = ""
    instance: str = ""
    model_fingerprint: str | None = None
    block_hash_scheme: str | None = None


@message(0x03)
class Heartbeat:
    """Every service → router, periodically. `progress` (steps done) advancing tells a busy worker from a
    wedged one; a new `incarnation` means the process restarted and lost its in-flight requests."""

    service: str
    instance: str
    incarnation: str  # random per process start
    seq: int  # +1 per heartbeat within an incarnation
    progress: int  # engine steps (or messages handled) so far, monotonic within an incarnation
    free_blocks: int = 0
    total_blocks: int = 0
    running: int = 0  # sequences in the running batch
    waiting: int = 0  # requests queued, not yet running
    queued_prompt_tokens: int = 0  # prompt tokens not yet computed
    tokens_per_s: float = 0.0  # measured compute throughput over recent steps that computed a block or more
    draining: bool = False  # finishing its work, accepts nothing new
    sent_time: float = 0.0
    # Speculative decoding: draft tokens the worker's engine proposed and accepted, monotonic within an
    # incarnation (their ratio is the worker's acceptance rate; zero where it does not speculate).
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    # A worker's seconds per output token by batch size, measured over back-to-back steps: (mean rows, mean
    # seconds) per bucket of batch sizes, fewest rows first (services/token_cadence); what TPOT SLOs use.
    tpot_by_batch: list[tuple[float, float]] = field(default_factory=list)


@message(0x04)
class Shutdown:
    """Launcher or router → any service: stop; with drain, finish in-flight work first (within `timeout_s`,
    None: the service's own drain timeout). To a service that is draining, `drain=False` is the router's
    release: it holds none of the service's requests any more, so the service may stop once idle."""

    drain: bool = True
    reason: str = ""
    timeout_s: float | None = None


@message(0x05)
class AbortRequest:
    """Client → router (cancel); router → tokenizer / prefill / decode (drop the request, free its KV).
    Aborting an unknown or finished request is a no-op."""

    request_id: str
    reason: str = ""


@message(0x06)
class ErrorReply:
    """Any service → whoever sent the request: the request ended (or a message was refused) with an error.
    Each request ends exactly once, with RequestFinished or ErrorReply."""

    request_id: str
    code: ErrorCode
    message: str
    retry_after_s: float | None = None  # for "overloaded"


@message(0x07)
class ServiceExited:
    """Supervisor → router, the moment a child process it runs exits: its requests move on at once
    instead of waiting out the heartbeat timeout. `pid` (the Hello's "pid" capability) names the process
    that exited, so a note that arrives after its successor's Hello changes nothing. A draining service
    also sends it about itself as it stops (its goodbye): what it still holds then moves at once."""

    instance: str
    pid: int
    returncode: int


@message(0x08)
class DrainService:
    """Operator (the `drain` command, a supervisor identity) → router: place no new work on `instance` from
    now on and tell it to drain: finish what it holds, move what is left after `timeout_s` (None: the
    service's own drain timeout) to other workers, then exit 0. Answered with a ServiceStatus."""

    instance: str
    timeout_s: float | None = None


@message(0x09)
class ServiceQuery:
    """Operator → router: how is `instance`? Answered with a ServiceStatus."""

    instance: str


@message(0x0A)
class ServiceStatus:
    """Router → operator: one mesh member as the router sees it. `known`: it ever registered; `alive`: its
    process (`incarnation`, `pid`) counts as running; `serving`: it may be given new work now; `held`:
    requests it holds state for; `restarts`: new incarnations this router saw; the load fields are its latest
    heartbeat's (`heartbeat_age_s` ago; None before any); `cached_blocks`: the blocks it published by tier, as
    the router's prefix index holds them; `clock_offset_s`: its wall clock less the router's, as its last
    heartbeat's `sent_time` showed it (transit included: a few milliseconds)."""

    instance: str
    known: bool
    role: str = ""
    incarnation: str = ""
    pid: int = 0
    alive: bool = False
    draining: bool = False
    serving: bool = False
    held: int = 0
    restarts: int = 0
    heartbeat_age_s: float | None = None
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    tokens_per_s: float = 0.0
    cached_blocks: dict[str, int] = field(default_factory=dict)
    clock_offset_s: float | None = None


# --- client ↔ router 0x10–0x1F ---------------------------------------------------------------------------------


@message(0x10)
class GenerateRequest:
    """Client → router: generate from exactly one of prompt (raw text), messages (chat turns, each
    {"role", "content"}; the tokenizer applies the chat template) or prompt_token_ids."""

    request_id: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    prompt_token_ids: list[int] | None = None
    params: SamplingParamsWire = field(default_factory=SamplingParamsWire)
    stream: bool = False
    priority: int = 0  # lower is served first
    api_key: str | None = None  # the router derives the tenant (and its cache salt) from it
    timeout_s: float | None = None  # deadline from arrival; the router ends the request with "timeout"
    # Time-to-first-token SLO from arrival: tightens the tenant's (never loosens it). A request predicted to
    # miss it when it is placed ends with "overloaded" (and retry_after_s) before any prefill is spent on it.
    ttft_slo_s: float | None = None
    # Time-per-output-token SLO (seconds between tokens, on average over the stream): tightens the tenant's.
    # A request whose decode worker is predicted to give tokens slower than this — or, with it added, slower
    # than a stream already there was promised — goes to another, or ends with "overloaded" before any prefill.
    tpot_slo_s: float | None = None


@message(0x11)
class StreamDelta:
    """Router → client, for streaming requests: new text and tokens, in order, before RequestFinished.
    With logprobs asked for, `logprobs` has one entry per token id; their concatenation over the deltas is
    RequestFinished.logprobs. A request that asked for prompt_logprobs gets them, with the prompt's token ids,
    on its first delta only (which may carry no text yet)."""

    request_id: str
    text: str
    token_ids: list[int]
    offset: int = 0  # generated tokens before token_ids[0]
    logprobs: list[LogprobWire] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[LogprobWire | None] | None = None  # one per prompt token, the first None


@message(0x12)
class RequestFinished:
    """Router → client, once per successful request: the whole output (also when streamed), why it ended,
    usage and timings."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: UsageWire
    timings: Timings
    stop_string: str | None = None
    logprobs: list[LogprobWire] | None = None
    # Set when the request asked for prompt_logprobs: one per prompt token, the first None (no context).
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[LogprobWire | None] | None = None



@message(0x13)
class MeshQuery:
    """Client → router: would a request sent now be served? (The HTTP gateway's /ready asks it.) Answered with
    a MeshStatus carrying the same `request_id`; it admits nothing and changes no state."""

    request_id: str


@message(0x14)
class MeshStatus:
    """Router → client, the answer to a MeshQuery. `servable`: a request sent now would be admitted and placed:
    the router is not draining, and a tokenizer and the workers a request needs (a prefill and a decode
    worker, or a co-located one) are alive and take new work. Otherwise `reason` says what is missing, as
    the refusal of a request sent now would. Admission limits (queue bounds, tenants' caps) are per request
    and not part of it."""

    request_id: str
    servable: bool
    reason: str = ""

@message(0x15)
class ResumeRequest:
    """Client → router, once its connection to the router dropped and came back (a restarted router, or the
    same one after a network blip): go on with `request` (the GenerateRequest as first sent; `request_id` is
    its id) from what the client received of it, `output_token_ids` with their `text` (and the logprobs it
    asked for). A router that still holds the request sends what the client missed; one that does not (it
    restarted) admits it again and continues from that output as a moved request does: a worker prefills
    prompt + output and goes on at the next position, so greedy and seeded output are an undisturbed run's.
    Answered with Resumed first, then as any request (StreamDelta..., RequestFinished, or an ErrorReply)."""

    request_id: str
    request: GenerateRequest
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[LogprobWire] | None = None
    prompt_logprobs: list[LogprobWire | None] | None = None  # as the first StreamDelta carried them
    streamed: bool = False  # a StreamDelta of it reached the client
    elapsed_s: float = 0.0  # since the client first sent it: its timeout counts from then


@message(0x16)
class Resumed:
    """Router → client, the first answer to a ResumeRequest: the request's replies go on from `offset` generated
    tokens (what the client said it had). A StreamDelta that reached the client between the drop and this one
    belongs to the old connection's order and is stale; the ones after it are contiguous from `offset`."""

    request_id: str
    offset: int


# --- router ↔ tokenizer ↔ decode 0x20–0x2F ------------------------------------------------------------------


@message(0x20)
class EncodeRequest:
    """Router → tokenizer: tokenize (or take prompt_token_ids as they are), hash the full blocks, and set
    up this request's detokenizer state (stop strings, prompt context) for the decode stream to come."""

    request_id: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    prompt_token_ids: list[int] | None = None
    cache_salt: str | None = None  # per tenant, set by the router, never taken from the client
    stop: list[str] = field(default_factory=list)
    # A request moving off a lost worker: the output its client has seen. The detokenizer state is rebuilt
    # as if those tokens had streamed through here, and the block hashes cover prompt and output.
    resume_output_ids: list[int] | None = None
    # The request's output budget: prompt plus max_tokens must fit the model's context (None: not checked).
    max_tokens: int | None = None


@message(0x21)
class EncodeResult:
    """Tokenizer → router, reply to EncodeRequest (failures are ErrorReply "invalid_request")."""

    request_id: str
    token_ids: list[int]
    block_hashes: list[bytes]  # one per full block of token_ids, chained (DESIGN §4)


@message(0x22)
class DetokenizeBatch:
    """Decode worker → the tokenizer named in each request's KvTransfer: the new tokens of every request
    that gained any, one batch per tokenizer, after each engine step or, for fast steps, at most once per
    the worker's stream interval (first tokens and finishes go at once; services/stream_coalescer.py)."""

    worker: str
    step: int
    items: list[DetokenizeItem]


@message(0x23)
class TextDeltas:
    """Tokenizer → router, batched per received DetokenizeBatch: text deltas, and finishes (including stop
    strings found by the tokenizer, which the router turns into an AbortRequest to the decode worker).
    `worker` names the worker whose DetokenizeBatch the items came from: the router takes a request's items
    only from the worker it placed the request on (None, from a tokenizer that does not say: not checked)."""

    tokenizer: str
    items: list[TextDeltaItem]
    worker: str | None = None


# --- router → prefill ↔ decode 0x30–0x3F ----------------------------------------------------------------------


@message(0x30)
class PrefillJob:
    """Router → prefill worker: compute the prompt's KV (reusing cached blocks), sample the first token and
    hand everything to `decode_worker`; the decode stream goes to tokenizer `detokenizer`."""

    request_id: str
    token_ids: list[int]
    block_hashes: list[bytes]
    params: SamplingParamsWire
    decode_worker: str
    detokenizer: str
    priority: int = 0
    arrival_time: float = 0.0
    expected_cached_blocks: int = 0  # the router's prefix-index estimate, for the worker's metrics
    cache_salt: str | None = None  # the tenant's salt (from the router), for the worker's own hash chain
    # A resumed request (its first worker was lost): the last num_output_tokens of token_ids are output
    # already streamed; the worker continues at that output position (see LLMEngine.add_request).
    num_output_tokens: int = 0
    # Names the request by its client (`router_resume.client_key`): a router that restarts asks the workers
    # what they kept running (HeldRequests), and a client resuming this request reclaims it there.
    client_key: str = ""


@message(0x31)
class PrefillDone:
    """Prefill worker → router, once the decode worker acknowledged the KV (KvAck ok): the handoff is done.
    Failures are ErrorReply instead."""

    request_id: str
    prefill_worker: str
    num_prompt_tokens: int
    num_cached_tokens: int
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    prefill_s: float = 0.0
    fetch_s: float = 0.0  # of prefill_s, the time spent loading cached blocks from the cache daemon
    handoff_s: float = 0.0  # of prefill_s, the KV handoff to the decode worker: the prefill's end to KvAck


@message(0x32)
class KvReserve:
    """Prefill worker → decode worker, before sending KV: reserve room for the prompt's blocks (and the
    first tokens of output) under a lease that expires if no KvTransfer arrives."""

    request_id: str
    num_blocks: int
    num_tokens: int  # prompt tokens whose KV will arrive
    max_tokens: int  # the request's output budget, for the decode worker's admission decision
    prefill_worker: str
    lease_s: float = 10.0


@message(0x33)
class KvReserveReply:
    """Decode worker → prefill worker, reply to KvReserve; when not ok the prefill worker tells the router
    (ErrorReply "overloaded") so it can place the request elsewhere."""

    request_id: str
    lease_id: str
    ok: bool
    reason: str = ""
    lease_s: float = 0.0  # granted lease


@message(0x34)
class KvTransfer:
    """Prefill worker → decode worker, under a granted lease: the prompt's KV as one out-of-band frame
    plus everything the decode worker needs to continue the sequence."""

    request_id: str
    lease_id: str
    first_token: int
    token_ids: list[int]  # the prompt (and a resumed request's output so far), all with KV in `kv`
    block_hashes: list[bytes]  # of the prompt's full blocks, so the decode worker can cache them later
    params: SamplingParamsWire
    block_size: int
    kv_layout: str  # KvSpec.layout: one block's dims named and sized; a receiver refuses a layout or shape not its own
    kv: Tensor
    detokenizer: str
    first_logprob: LogprobWire | None = None
    priority: int = 0
    arrival_time: float = 0.0
    num_cached_tokens: int = 0
    cache_salt: str | None = None  # the tenant's, so the decode side names the blocks as the prefill side did
    num_output_tokens: int = 0  # of token_ids, the trailing output of a resumed request (PrefillJob's field)
    # The prompt's logprobs when params.prompt_logprobs asked for them (the decode worker sends them with
    # the request's first DetokenizeItem): one per prompt token, the first None.
    prompt_logprobs: list[LogprobWire | None] | None = None
    client_key: str = ""  # PrefillJob's


@message(0x35)
class KvAck:
    """Decode worker → prefill worker, reply to KvTransfer: ok means the KV is installed and the request
    is running on the decode worker (the prefill worker may release its pinned blocks either way)."""

    request_id: str
    lease_id: str
    ok: bool
    reason: str = ""


@record
class HeldRequest:
    request_id: str  # the old router's id for it
    client_key: str  # PrefillJob.client_key
    num_output_tokens: int  # generated so far


@message(0x36)
class HeldRequests:
    """Worker → a router that restarted, once it accepted the worker's Hello again: the requests the worker
    kept running for the old router's clients. A client that resumes one of them on this router gets it
    back from there (`Reclaim`) instead of a recomputation."""

    instance: str
    incarnation: str
    requests: list[HeldRequest]


@message(0x37)
class Reclaim:
    """Router → the worker holding `request_id` (HeldRequests): its client resumed it; it goes on there.
    `token_ids` are the prompt and the output the client has (its last `num_output_tokens`): the worker
    checks they begin its own sequence, streams to `detokenizer` every token past them, and goes on as
    with any request. Refused (not held any more, or not that sequence) with ErrorReply worker_lost:
    the router then computes the request again elsewhere."""

    request_id: str
    detokenizer: str
    token_ids: list[int]
    num_output_tokens: int


# --- KV cache 0x40–0x4F ---------------------------------------------------------------------------------------
#
# Tiers are named "device" (a worker's own KV pool), "host" (the cache daemon's DRAM) and "disk" (its
# NVMe directory). Block tensors are [n, *KvSpec.block_shape] (Llama-family: [n, layers, 2, block_size,
# kv_heads, head_dim]), block i holding the KV of the block named block_hashes[i]; `namespace` is the
# CacheNamespace id both sides hash under (it covers the spec's dtype and layout).


@message(0x40)
class CacheLookup:
    """Worker → cache daemon: which of these blocks do you hold, and where? Every cache request names the
    namespace its hashes are under; a daemon answers only for its own (any other, "" included, is all misses,
    counted as refused)."""

    request_id: str
    block_hashes: list[bytes]
    namespace: str = ""


@message(0x41)
class CacheLookupReply:
    """Cache daemon → worker: `tiers[i]` is where block_hashes[i] is ("host", "disk"), or "" if absent.
    The longest cached prefix is the leading run of non-empty entries."""

    request_id: str
    tiers: list[str]


@message(0x42)
class CacheFetch:
    """Worker → cache daemon: send the longest prefix of these blocks that you hold (pinned while read),
    within `deadline_s` of receipt; what is not ready by then is left out."""

    request_id: str
    block_hashes: list[bytes]
    deadline_s: float = 1.0
    namespace: str = ""  # as CacheLookup's: only the daemon's own is served


@message(0x43)
class CacheBlocks:
    """Cache daemon → worker, reply to CacheFetch: the first len(block_hashes) requested blocks, each
    verified (checksum and identity) before sending, one frame per block (KvSpec.block_shape) sent
    straight from the daemon's copy — never gathered into one buffer. At most
    MAX_FETCH_BLOCKS come per reply (the frame limit); the worker asks again for the rest."""

    request_id: str
    block_hashes: list[bytes]
    tiers: list[str]  # where each came from
    blocks: list[Tensor] = field(default_factory=list)
    reason: str = ""  # why fewer blocks came than asked (miss, corrupt block, deadline, reply limit)


@message(0x44)
class CacheStore:
    """Worker → cache daemon, write-behind: keep these full blocks. Blocks already held are skipped; a
    full or slow store drops what it cannot keep (a cache may always forget)."""

    request_id: str
    namespace: str
    block_hashes: list[bytes]
    kv: Tensor


@message(0x45)
class CacheStoreAck:
    """Cache daemon → worker, reply to CacheStore once handled (stored into DRAM; disk follows behind)."""

    request_id: str
    stored: int
    skipped: int
    reason: str = ""


@message(0x46)
class KvEvents:
    """Worker or cache daemon → router: blocks that became present in, or left, one of the publisher's
    tiers. `seq` counts the publisher's KvEvents within its incarnation (0, 1, 2, ...), so the router
    sees a gap or a restart and asks for a snapshot (KvResync). A snapshot (`snapshot=True`) lists
    everything the tier holds now and replaces what the router knew of it."""

    publisher: str
    incarnation: str
    seq: int
    tier: str
    stored: list[bytes] = field(default_factory=list)
    evicted: list[bytes] = field(default_factory=list)
    snapshot: bool = False


@message(0x47)
class KvResync:
    """Router → publisher: your events had a gap (or I restarted); send a snapshot of every tier."""

    reason: str = ""


@message(0x48)
class CachePrefetch:
    """Worker → cache daemon, no reply: these blocks will be fetched soon (their job waits in the worker's
    stage); read the disk-held ones of the leading run into DRAM now, so the fetch costs no disk time. Best
    effort: past the daemon's prefetch limit it is dropped (counted), and a namespace not its own is refused."""

    request_id: str
    block_hashes: list[bytes]
    namespace: str = ""


# --- expert parallelism 0x50–0x5F ----------------------------------------------------------------------------


@message(0x50)
class ExpertLoad:
    """Worker group (its leader, rank 0) → router (→ expert balancer, forwarded), every few seconds: the
    load since the last report, for metrics and the balancer. `expert_tokens[l][e]`: tokens routed to
    logical expert e of the l-th MoE layer, summed over ranks (empty for a dense model); `rank_tokens[r]`:
    tokens rank r computed."""

    worker: str
    placement_version: int  # the expert placement the counts were made under
    period_s: float  # the time the counts cover
    expert_tokens: list[list[int]] = field(default_factory=list)
    rank_tokens: list[int] = field(default_factory=list)
    # The table the ranks run now (None for a dense model): a balancer that restarted resumes from it.
    placement: PlacementTable | None = None
    # rank_expert_tokens[l][r]: assignments rank r's experts computed in MoE layer l (any rank's tokens):
    # the measured expert load per rank, whose per-layer max/mean the balancer lowers.
    rank_expert_tokens: list[list[int]] = field(default_factory=list)


@message(0x51)
class PlacementUpdate:
    """Expert balancer → router → worker group `worker`: switch to `placement` (its version above the
    group's). The router forwards it only from the balancer it welcomed. `before[l]` / `after[l]`: the
    balancer's predicted max/mean rank load of MoE layer l under the current table and under this one,
    over its load window (for logs and metrics; the group does not need them)."""

    worker: str
    placement: PlacementTable
    before: list[float] = field(default_factory=list)
    after: list[float] = field(default_factory=list)


@message(0x52)
class PlacementResult:
    """Worker group → router → expert balancer: how the move to placement `version` ended. ok: the ranks
    run it now; not ok: they still run the table they had, and `reason` says why (refused at once, or
    the move failed). The router forwards it only from the worker it names."""

    worker: str
    version: int
    ok: bool
    reason: str = ""


compile_all(__name__)  # a bad annotation fails at import, not on the first message
