"""Request records: what a caller asks for (`SamplingParams`), what the engine tracks (`Request`) and
what it hands back (`RequestOutput`)."""

from __future__ import annotations

import enum
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from deepinfer.cache.hashing import BlockHash, ChainHasher
from deepinfer.grammar import ConstraintSpec

if TYPE_CHECKING:
    from deepinfer.grammar import Constraint


class InvalidRequestError(ValueError):
    """The request cannot be served as asked; the message says which field and why."""


class FinishReason(str, enum.Enum):
    STOP = "stop"  # a stop token id or stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # failed inside the engine


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; recomputes its KV, or copies it back (swapped out)
    # A prefill-only request that sampled its first token: out of the queues, its prompt's blocks
    # kept for export until released. FINISHED with finish_reason None once released.
    HELD = "held"
    FINISHED = "finished"


@dataclass
class SamplingParams:
    """How to pick tokens. Defaults are greedy with no limits but `max_tokens`.

    temperature 0 means greedy; top_k 0 (or -1) and top_p 1 and min_p 0 disable those filters;
    repetition_penalty 1 and presence/frequency penalties 0 disable penalties. `seed` makes sampling
    reproducible for this request whatever else shares the batch. `logprobs` asks for the chosen
    token's log-probability plus that many top alternatives (0: only the chosen token's; None: none).
    `prompt_logprobs` asks the same for every prompt token given the tokens before it (the first prompt
    token has none: its entry is None); a request asking for them never reuses cached prefix blocks.

    `logit_bias` maps token id → a bias in [-100, 100] added to that token's logit before penalties,
    temperature and filters (so it steers greedy choices too), on every sampling path including
    speculative verification. Reported logprobs (both kinds) are the model's raw log-softmax, before
    bias, penalties and temperature (vLLM's default).
    """

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
    # Also stop on the model's end-of-sequence tokens.
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Structured output: the output must match this (JSON schema, any JSON object, regex or grammar); each
    # token is picked among those the constraint allows, and the request stops when the match is complete.
    constraint: ConstraintSpec | None = None

    MAX_LOGPROBS = 20
    MAX_CONSTRAINT_CHARS = 64 * 1024  # a schema, regex or grammar's text
    MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
    MAX_BIAS = 100.0
    MAX_STOP_STRINGS = 16  # each is searched for after every token: their number and length are bounded
    MAX_STOP_LEN = 256
    MAX_STOP_TOKEN_IDS = 64

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequestError naming the first bad field."""

        def bad(name: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid sampling parameter {name}={getattr(self, name)!r}: {why}")

        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise bad("max_tokens", "must be a positive integer")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                raise bad(name, "must be a finite number")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "must be -1, 0 (disabled) or a positive integer")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        if not -2 <= self.presence_penalty <= 2 or not -2 <= self.frequency_penalty <= 2:
            raise InvalidRequestError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise bad("seed", "must be an integer in [0, 2**63)")
        if self.logprobs is not None and not (
            isinstance(self.logprobs, int) and 0 <= self.logprobs <= self.MAX_LOGPROBS
        ):
            raise bad("logprobs", f"must be an integer in [0, {self.MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and not (
            isinstance(self.prompt_logprobs, int) and not isinstance(self.prompt_logprobs, bool)
            and 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS
        ):
            raise bad("prompt_logprobs", f"must be an integer in [0, {self.MAX_LOGPROBS}]")
        self._validate_logit_bias(vocab_size)
        if len(self.stop) > self.MAX_STOP_STRINGS or len(self.stop_token_ids) > self.MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(f"at most {self.MAX_STOP_STRINGS} stop strings and {self.MAX_STOP_TOKEN_IDS} "
                                      f"stop token ids (got {len(self.stop)} and {len(self.stop_token_ids)})")
        if any(isinstance(s, str) and len(s) > self.MAX_STOP_LEN for s in self.stop):
            raise InvalidRequestError(f"stop strings may have at most {self.MAX_STOP_LEN} characters")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
                raise InvalidRequestError(f"stop token id {t!r} is outside the vocabulary")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings")
        if self.constraint is not None:
            if not isinstance(self.constraint, ConstraintSpec):
                raise InvalidRequestError("constraint must be a ConstraintSpec")
            if len(self.constraint.text) > self.MAX_CONSTRAINT_CHARS:
                raise InvalidRequestError(f"a constraint's text may have at most {self.MAX_CONSTRAINT_CHARS} "
                                          f"characters (got {len(self.constraint.text)})")

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        if not isinstance(self.logit_bias, dict):
            raise InvalidRequestError("logit_bias must map token ids to biases")
        if len(self.logit_bias) > self.MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"logit_bias may have at most {self.MAX_LOGIT_BIAS} entries "
                                      f"(got {len(self.logit_bias)})")
        for t, b in self.logit_bias.items():
            if not isinstance(t, int) or isinstance(t, bool) or t < 0 or (vocab_size is not None and t >= vocab_size):
                size = "" if vocab_size is None else f" (size {vocab_size})"
                raise InvalidRequestError(f"logit_bias token id {t!r} is outside the vocabulary{size}")
            if not isinstance(b, (int, float)) or isinstance(b, bool) or not math.isfinite(b) or abs(b) > self.MAX_BIAS:
                raise InvalidRequestError(f"logit_bias[{t}]={b!r}: a bias must be a finite number in "
                                          f"[-{self.MAX_BIAS:g}, {self.MAX_BIAS:g}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Logprob:
    token_id: int
    logprob: float
    # The top-n alternatives at this position, best first: (token_id, logprob).
    top: list[tuple[int, float]] = field(default_factory=list)


_request_counter = itertools.count()


@dataclass(eq=False)
class Request:
    """Engine-side state of one request. The scheduler advances `num_computed_tokens` towards
    `num_tokens`; when it catches up, the sampled token is appended to `output_token_ids`."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower is served first; ties by arrival
    arrival_time: float = field(default_factory=time.monotonic)
    eos_token_ids: tuple[int, ...] = ()

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[Logprob] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Leading prompt tokens whose KV came from a cache instead of being computed (first admission),
    # and the same split by the tier each block came from ("device", "host", "disk"); sums agree.
    num_cached_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    block_ids: list[int] = field(default_factory=list)
    # The chain naming this request's full blocks (with its cache salt); None: the request is never
    # looked up in nor added to the prefix cache.
    hasher: ChainHasher | None = None
    # How many leading `block_ids` have already been offered to the pool's hash map (named, or found
    # to duplicate a block cached before); reset with `block_ids`.
    num_registered_blocks: int = 0
    num_preemptions: int = 0
    # Swapped out at its last preemption (scheduler.py, preemption.py): its first `swapped_tokens` tokens' KV is
    # in `swapped_kv`, the engine's host copy of its blocks [n, *block_shape]; 0 and None otherwise.
    swapped_tokens: int = 0
    swapped_kv: Any = None
    # Stop after the first token and hand the prompt's KV to a decode engine (see LLMEngine.add_request).
    prefill_only: bool = False
    # The tenant's cache salt: also scopes what a cross-request guesser may propose to it.
    tenant: str | None = None
    # Speculative decoding. Set by the engine before each schedule: how many draft tokens this request
    # would verify in the step (0: none); the scheduler may grant fewer (see Scheduler.schedule).
    num_spec_tokens: int = 0
    # Draft tokens verified for this request so far, and how many of those were committed.
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    # Prompt logprobs (params.prompt_logprobs set): entry i for prompt token i given the tokens before it,
    # filled chunk by chunk as the prompt is computed; entry 0 stays None. `prompt_logprobs_done` once every
    # entry is filled (or they were computed elsewhere: a handoff); until then the request computes its whole
    # prompt itself, never reusing cached prefix blocks (they have KV but no logits). `prompt_logprobs_sent`
    # once an output carried them.
    prompt_logprobs: list[Logprob | None] | None = None
    prompt_logprobs_done: bool = True
    prompt_logprobs_sent: bool = False
    # None on a FINISHED request means it ended by handoff rather than by finishing.
    finish_reason: FinishReason | None = None
    error: str | None = None
    seq_no: int = field(default_factory=lambda: next(_request_counter))
    # params.constraint's state over this request's output (deepinfer.grammar.Constraint), set by the engine.
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
            self.prompt_logprobs_done = len(self.prompt_token_ids) <= 1

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Still collecting prompt logprobs: its prompt must be computed here, every position's logits kept."""
        return not self.prompt_logprobs_done

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def sort_key(self) -> tuple[int, float, int]:
        return (self.priority, self.arrival_time, self.seq_no)

    def block_hashes(self, num_blocks: int) -> list[BlockHash]:
        """The hashes of the first `num_blocks` blocks of its tokens (each must be full of tokens).
        Extends the chain only when it is short, so the token list is built once per new block."""
        if self.hasher is None:
            raise ValueError(f"request {self.request_id!r} has no hash chain")
        if len(self.hasher.hashes) < num_blocks:
            self.hasher.extend(self.all_token_ids)
        if len(self.hasher.hashes) < num_blocks:
            raise ValueError(f"request {self.request_id!r} has fewer than {num_blocks} full blocks")
        return self.hasher.hashes[:num_blocks]


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    # cached_tokens split by the tier the prefix KV came from ("device", "host", "disk"); only tiers
    # that served tokens appear.
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    # Speculative decoding: draft tokens proposed for this request and how many of them the model
    # accepted (each accepted one is a completion token that cost no step of its own).
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0

    def to_dict(self) -> dict[str, int | dict[str, int]]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "cached_by_tier": dict(self.cached_by_tier),
            "spec_proposed_tokens": self.spec_proposed_tokens,
            "spec_accepted_tokens": self.spec_accepted_tokens,
        }


@dataclass
class RequestOutput:
    """What one `step()` reports about one request: the tokens it gained this step (`new_token_ids`)
    and, once finished, the finish reason. `token_ids` (every generated token), `logprobs` and
    `text` are filled on the final output only.

    `new_logprobs`: when the request asks for logprobs, one per token of `new_token_ids` (the final
    `logprobs` is their concatenation over the outputs, for tokens generated by this engine).
    `prompt_logprobs`: when it asks for them, one per prompt token (the first None), on the first output
    that has new tokens (a prefill engine's handoff output included) and again on the final output.

    `handoff=True` marks the final output of a prefill-only request that stopped after its first
    token to continue on a decode engine: `finished` is True (this engine is done with it),
    `finish_reason` is None (the request itself is not), the first token is in `new_token_ids` and
    `token_ids` (its logprob in `logprobs`, if asked), `text` is None (the decode side's detokenizer
    produces the text), and the prompt's KV stays held until `LLMEngine.release`."""

    request_id: str
    new_token_ids: list[int]
    token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    usage: Usage
    logprobs: list[Logprob] | None = None
    error: str | None = None
    text: str | None = None  # filled by callers that detokenize
    handoff: bool = False
    # Final outputs only (finished or handoff), with prefix caching on: the hashes of the request's
    # full blocks whose KV was computed, prompt and output, in order (for write-behind to a cache tier).
    block_hashes: list[BlockHash] = field(default_factory=list)
    new_logprobs: list[Logprob] | None = None
    prompt_logprobs: list[Logprob | None] | None = None
