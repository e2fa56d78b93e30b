"""The codec of a worker group's control channel: what the leader tells each rank per round, and what
each rank reports back, as plain msgpack (never pickle).

A round is one `Round` broadcast by the leader (rank 0) and one `Report` from every follower:

    Round(step, stop, commands)      commands[r]: the commands for rank r, in the order they were issued
    Report(results, outputs, ...)    results[i]: the answer to this rank's i-th command of the round

Commands are small lists `[op, *args]` (see `Op`); KV for an install or an export is not in the msgpack:
its dtype and shape are, and the bytes follow as a uint8 tensor on the channel (`channel.py`). Every rank
of a group runs the same code (one package, one launch), so the codec is positional and unversioned; the
first report (`Hello`) carries what must agree across ranks (model fingerprint, KV layout).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack
import torch

from deepinfer.cache.block_pool import NoFreeBlocksError
from deepinfer.engine.handoff import HandoffError
from deepinfer.engine.request import FinishReason, InvalidRequestError, Logprob, RequestOutput, SamplingParams, Usage
from deepinfer.grammar import ConstraintSpec

if TYPE_CHECKING:
    from deepinfer.engine.engine import LLMEngine


class Op(enum.IntEnum):
    """Command opcodes; each command is `[op, *args]` with the arguments listed beside its opcode."""

    ADD = 1  # request_id, prompt_ids, params, priority, prefill_only, cache_salt, resumed
    ABORT = 2  # request_id
    RELEASE = 3  # request_id
    CANCEL = 4  # reservation_id
    RESERVE = 5  # reservation_id, num_blocks, lease_s
    EXPORT = 6  # request_id                         (result: [dtype, shape]; the KV follows to the leader)
    INSTALL = 7  # request_id, prompt_ids, first_token, params, [dtype, shape], reservation_id, priority,
    #              first_logprob, cache_salt, resumed  (the KV follows from the leader, before it is applied)
    EXPERT_LOAD = 8  # (result: per-layer per-expert token counts since the last EXPERT_LOAD, or None)
    STAGE = 9  # placement dict: start loading that expert placement (expert_move.py); reports say when ready
    UNSTAGE = 10  # drop whatever placement is staged
    # The cache daemon's blocks (group_cache.py):
    IMPORT_CACHED = 11  # hashes, tier, keep_resident, [dtype, shape]   (result: blocks imported; the KV follows
    #                     from the leader, before it is applied)
    EXPORT_CACHED = 12  # hashes   (result: [present hashes, [dtype, shape] or None]; the KV follows to the leader)
    RESET_CACHE = 13  # (result: how many cached names were forgotten)


Command = list[Any]


@dataclass
class Round:
    step: bool  # every rank calls engine.step() once after applying its commands
    stop: bool = False  # followers exit (0) after answering this round
    commands: list[list[Command]] = field(default_factory=list)  # by rank; rank 0's entry is unused
    # The expert placement version every rank (rank 0 too) switches to before this round's commands and
    # step; only ever one every rank reported staged and ready (expert_move.py).
    switch: int | None = None

    def encode(self) -> bytes:
        return _pack([self.step, self.stop, self.commands, self.switch])

    @classmethod
    def decode(cls, data: bytes) -> Round:
        step, stop, commands, switch = _unpack(data)
        return cls(step, stop, commands, switch)


@dataclass
class Load:
    """One rank's engine as the worker's heartbeat reports it; a group's is the sum over ranks."""

    free_blocks: int = 0
    total_blocks: int = 0
    running: int = 0
    waiting: int = 0
    queued_prompt_tokens: int = 0
    num_held: int = 0
    num_reserved_blocks: int = 0
    unfinished: bool = False

    def __add__(self, other: Load) -> Load:
        summed = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)}
        return Load(**{**summed, "unfinished": self.unfinished or other.unfinished})


@dataclass
class Report:
    """One rank's answer to a round."""

    results: list[Any] = field(default_factory=list)  # one per command, in order (see `error_result`)
    outputs: list[RequestOutput] = field(default_factory=list)  # its step's outputs (none without a step)
    stored: list[bytes] = field(default_factory=list)  # prefix-cache names added since the last report
    evicted: list[bytes] = field(default_factory=list)  # … and removed
    expired: list[str] = field(default_factory=list)  # reservations whose lease ran out
    load: Load = field(default_factory=Load)
    stats: dict[str, int] = field(default_factory=dict)  # EngineStats' counters, as totals
    # The rank's expert placement staging after this round: [version staged and ready, or None; the
    # staging's error, or None] (LLMEngine.staged_placement).
    staged: list[Any] = field(default_factory=lambda: [None, None])

    def encode(self) -> bytes:
        return _pack([self.results, [encode_output(o) for o in self.outputs], self.stored, self.evicted,
                      self.expired, dataclasses.astuple(self.load), self.stats, self.staged])

    @classmethod
    def decode(cls, data: bytes) -> Report:
        results, outputs, stored, evicted, expired, load, stats, staged = _unpack(data)
        return cls(results, [decode_output(o) for o in outputs], stored, evicted, expired, Load(*load), stats,
                   staged)


@dataclass
class Hello:
    """A follower's first report: what must be the same on every rank of the group."""

    rank: int
    fingerprint: str
    kv_layout: str
    namespace: str
    load: Load

    def encode(self) -> bytes:
        return _pack([self.rank, self.fingerprint, self.kv_layout, self.namespace, dataclasses.astuple(self.load)])

    @classmethod
    def decode(cls, data: bytes) -> Hello:
        rank, fingerprint, layout, namespace, load = _unpack(data)
        return cls(rank, fingerprint, layout, namespace, Load(*load))


# -- command results: a value, or an error that the leader raises again as the engine's own type ---------

_ERRORS: dict[str, type[Exception]] = {
    "HandoffError": HandoffError,
    "InvalidRequestError": InvalidRequestError,
    "NoFreeBlocksError": NoFreeBlocksError,
}
_ERROR_TAG = "__error__"


def error_result(exc: Exception) -> list[str]:
    return [_ERROR_TAG, type(exc).__name__, str(exc)]


def raise_if_error(result: Any) -> Any:
    """The result itself, or the error it carries raised as the engine's type (RuntimeError if unknown)."""
    if isinstance(result, list) and len(result) == 3 and result[0] == _ERROR_TAG:
        raise _ERRORS.get(result[1], RuntimeError)(result[2])
    return result


# -- engine records ----------------------------------------------------------------------------------------


def encode_params(p: SamplingParams) -> list[Any]:
    """The params as msgpack carries them: fields in order, a constraint as [kind, text, strict]."""
    c = p.constraint
    values = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}
    values["constraint"] = None if c is None else [c.kind, c.text, c.strict]
    return list(values.values())


def decode_params(v: list[Any]) -> SamplingParams:
    p = SamplingParams(*v)
    return p if p.constraint is None else dataclasses.replace(p, constraint=ConstraintSpec(*p.constraint))


def encode_logprob(lp: Logprob | None) -> list[Any] | None:
    return None if lp is None else [lp.token_id, lp.logprob, [list(t) for t in lp.top]]


def decode_logprob(v: list[Any] | None) -> Logprob | None:
    return None if v is None else Logprob(v[0], v[1], [(t, x) for t, x in v[2]])


def encode_output(o: RequestOutput) -> list[Any]:
    u = o.usage
    return [o.request_id, o.new_token_ids, o.token_ids, o.finished,
            o.finish_reason.value if o.finish_reason is not None else None,
            [u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.cached_by_tier, u.spec_proposed_tokens,
             u.spec_accepted_tokens],
            None if o.logprobs is None else [encode_logprob(lp) for lp in o.logprobs],
            o.error, o.text, o.handoff, o.block_hashes,
            None if o.new_logprobs is None else [encode_logprob(lp) for lp in o.new_logprobs],
            None if o.prompt_logprobs is None else [encode_logprob(lp) for lp in o.prompt_logprobs]]


def decode_output(v: list[Any]) -> RequestOutput:
    rid, new, ids, finished, reason, usage, logprobs, error, text, handoff, hashes, new_lps, prompt_lps = v
    return RequestOutput(rid, new, ids, finished, FinishReason(reason) if reason is not None else None,
                         Usage(*usage), None if logprobs is None else [decode_logprob(lp) for lp in logprobs],
                         error, text, handoff, hashes,
                         None if new_lps is None else [decode_logprob(lp) for lp in new_lps],
                         None if prompt_lps is None else [decode_logprob(lp) for lp in prompt_lps])


def kv_meta(kv: torch.Tensor) -> list[Any]:
    """What travels in the msgpack for a KV tensor whose bytes follow on the channel."""
    return [str(kv.dtype).removeprefix("torch."), list(kv.shape)]


def kv_from_meta(meta: list[Any]) -> tuple[torch.dtype, tuple[int, ...]]:
    dtype = getattr(torch, meta[0], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown KV dtype {meta[0]!r}")
    return dtype, tuple(meta[1])


def kv_in_meta(command: Command) -> list[Any] | None:
    """The meta of the KV the leader sends after the round for this command (None: it sends none)."""
    if command[0] == Op.INSTALL:
        return command[5]
    if command[0] == Op.IMPORT_CACHED:
        return command[4]
    return None


def kv_out_meta(command: Command, result: Any) -> list[Any] | None:
    """The meta of the KV a follower sends after its report for this command and its result (None: none).
    Both sides decide with this, so each KV frame is sent exactly when it is expected."""
    if isinstance(result, list) and len(result) == 3 and result[0] == _ERROR_TAG:
        return None
    if command[0] == Op.EXPORT:
        return result
    if command[0] == Op.EXPORT_CACHED:
        return result[1]
    return None


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _unpack(data: bytes) -> Any:
    # Ranks of one group trust each other (one launch); the limits still bound a corrupted buffer.
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def engine_load(engine: LLMEngine) -> Load:
    """One engine's `Load`, read between steps on its own thread."""
    sched = engine.scheduler
    waiting = list(sched.waiting)
    return Load(engine.num_free_blocks, engine.pool.num_blocks, len(sched.running), len(waiting),
                sum(r.num_tokens - r.num_computed_tokens for r in waiting), engine.num_held,
                engine.num_reserved_blocks, engine.has_unfinished())


def engine_stats(engine: LLMEngine) -> dict[str, int]:
    return dataclasses.asdict(engine.stats)
