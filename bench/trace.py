"""Load a Mooncake-format request trace and scale it down to a workload a small model can replay.

A trace is JSON Lines, one request per line::

    {"timestamp": 40, "input_length": 23769, "output_length": 3, "hash_ids": [151, 152, ...]}

`timestamp` is the arrival in ms from the trace's start; `hash_ids` has one id per 512-token block of the
input, and two requests whose lists start with the same ids share that many blocks of prefix. The trace
carries no tokens, so scaling invents them: every block id becomes a fixed run of `b` token ids drawn from
a generator seeded by the id, so equal ids give equal tokens in every request and every run, and the
prefix-sharing structure survives exactly (k shared leading ids → k·b shared leading tokens).

Pure: no model, no sockets. `bench/bench_replay.py` drives a mesh with the result.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

TRACE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake traces


class TraceError(ValueError):
    """A trace line (or a scaling setting) that cannot be used; the message says where and why."""


@dataclass(frozen=True)
class TraceRequest:
    """One line of the trace, validated."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class ScaleConfig:
    """How to shrink the trace. `block_tokens` (b) tokens stand for each 512-token trace block, so lengths
    scale by b/512; arrival times are divided by `time_scale` (2.0 replays twice as fast). Token ids are
    drawn from [low, vocab): keep `low` above the model's special tokens."""

    block_tokens: int = 16
    low: int = 256
    vocab: int = 49152
    seed: int = 0
    time_scale: float = 1.0
    max_output_tokens: int | None = None  # cap on the scaled output length
    max_input_tokens: int | None = None  # longer prompts are skipped or truncated, see `long_prompts`
    long_prompts: str = "skip"  # "skip" or "truncate"

    def validate(self) -> None:
        if self.block_tokens < 1:
            raise TraceError(f"block_tokens must be at least 1, got {self.block_tokens}")
        if not 0 <= self.low < self.vocab:
            raise TraceError(f"need 0 <= low < vocab, got low={self.low}, vocab={self.vocab}")
        if not self.time_scale > 0:
            raise TraceError(f"time_scale must be positive, got {self.time_scale}")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise TraceError(f"max_output_tokens must be at least 1, got {self.max_output_tokens}")
        if self.max_input_tokens is not None and self.max_input_tokens < 1:
            raise TraceError(f"max_input_tokens must be at least 1, got {self.max_input_tokens}")
        if self.long_prompts not in ("skip", "truncate"):
            raise TraceError(f"long_prompts must be 'skip' or 'truncate', got {self.long_prompts!r}")


@dataclass(frozen=True)
class ScaledRequest:
    """A replayable request. `hash_ids` are the trace blocks actually present in `prompt` (fewer than the
    trace's when truncated; the last one may be partial)."""

    index: int  # position in the list given to scale_trace
    arrival_s: float  # from the first request's arrival, after time compression
    prompt: tuple[int, ...]
    max_tokens: int
    hash_ids: tuple[int, ...]
    truncated: bool = False


@dataclass(frozen=True)
class ScaledTrace:
    config: ScaleConfig
    requests: list[ScaledRequest]
    skipped: list[int] = field(default_factory=list)  # indices left out as too long
    truncated: list[int] = field(default_factory=list)  # indices cut to max_input_tokens


# -- loading -----------------------------------------------------------------------------------------------


def _int_field(obj: dict[str, object], key: str, minimum: int, where: str) -> int:
    v = obj.get(key)
    # bool is an int subclass; a trace with true/false in a length is broken, not lengths of 1 and 0.
    if isinstance(v, bool) or not isinstance(v, int):
        raise TraceError(f"{where}: {key!r} must be an integer, got {v!r}")
    if v < minimum:
        raise TraceError(f"{where}: {key!r} must be >= {minimum}, got {v}")
    return v


def parse_line(line: str, where: str = "line") -> TraceRequest:
    """One JSON object with timestamp (ms), input_length, output_length and hash_ids — one id per 512-token
    block, so exactly ceil(input_length / 512) of them. Extra keys are ignored."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc.msg})") from exc
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in obj]
    if missing:
        raise TraceError(f"{where}: missing {', '.join(missing)}")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts) or ts < 0:
        raise TraceError(f"{where}: 'timestamp' must be a non-negative number of milliseconds, got {ts!r}")
    n_in = _int_field(obj, "input_length", 1, where)
    n_out = _int_field(obj, "output_length", 0, where)
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in ids):
        raise TraceError(f"{where}: 'hash_ids' must be a list of non-negative integers")
    expected = -(-n_in // TRACE_BLOCK_TOKENS)
    if len(ids) != expected:
        raise TraceError(f"{where}: input_length {n_in} needs {expected} hash_ids "
                         f"(one per {TRACE_BLOCK_TOKENS}-token block), got {len(ids)}")
    return TraceRequest(float(ts), n_in, n_out, tuple(ids))


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Every request of a JSONL trace (blank lines skipped), or the first `limit`. Timestamps must not
    decrease: replay order is file order, and "seen earlier" (prefix reuse) is defined by it."""
    out: list[TraceRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            req = parse_line(line, f"{path}:{lineno}")
            if out and req.timestamp_ms < out[-1].timestamp_ms:
                raise TraceError(f"{path}:{lineno}: timestamp {req.timestamp_ms:g} is before the previous "
                                 f"request's {out[-1].timestamp_ms:g}; the trace must be in arrival order")
            out.append(req)
    return out


def sample_groups(requests: Sequence[TraceRequest], fraction: float, seed: int = 0) -> list[TraceRequest]:
    """Keep whole prefix groups — all requests whose first hash id is the same — each with probability
    `fraction` (decided by the id and `seed`, so repeatable). Reuse only ever happens within a group, so
    every kept request keeps exactly the reusable prefix it had in the whole trace; taking the first N
    requests instead would keep first turns and lose the later turns that reuse them."""
    if not 0 < fraction <= 1:
        raise TraceError(f"fraction must be in (0, 1], got {fraction}")
    if fraction == 1:
        return list(requests)
    keep: dict[int, bool] = {}
    out = []
    for r in requests:
        root = r.hash_ids[0]
        if root not in keep:
            keep[root] = random.Random(f"group:{seed}:{root}").random() < fraction
        if keep[root]:
            out.append(r)
    return out


# -- scaling -----------------------------------------------------------------------------------------------


def scaled_input_length(input_length: int, block_tokens: int) -> int:
    """ceil(input_length · b / 512): rounding up keeps the last, partial trace block at least one token
    long, so every hash id of the request is present in the scaled prompt."""
    return -(-input_length * block_tokens // TRACE_BLOCK_TOKENS)


def scaled_output_length(output_length: int, block_tokens: int, cap: int | None = None) -> int:
    """output_length · b / 512 rounded to nearest (halves up), at least 1, at most `cap`."""
    n = max(1, (2 * output_length * block_tokens + TRACE_BLOCK_TOKENS) // (2 * TRACE_BLOCK_TOKENS))
    return n if cap is None else min(n, cap)


class BlockTokens:
    """The fixed token run of each block id, memoised. A run of n tokens is a prefix of the run of any
    longer n for the same id and seed, so a partial last block is the start of that block's full run."""

    def __init__(self, block_tokens: int, low: int, vocab: int, seed: int = 0) -> None:
        self.block_tokens, self.low, self.vocab, self.seed = block_tokens, low, vocab, seed
        self._runs: dict[int, tuple[int, ...]] = {}

    def run(self, block_id: int) -> tuple[int, ...]:
        r = self._runs.get(block_id)
        if r is None:
            # A string seed is hashed with SHA-512 by `random`: stable across processes and Python versions.
            rng = random.Random(f"block:{self.seed}:{block_id}")
            r = self._runs[block_id] = tuple(rng.randrange(self.low, self.vocab) for _ in range(self.block_tokens))
        return r

    def prompt(self, hash_ids: Sequence[int], length: int) -> tuple[int, ...]:
        """`length` tokens: full runs of the leading ids, the last run cut to what is left."""
        toks: list[int] = []
        for h in hash_ids:
            if len(toks) >= length:
                break
            toks.extend(self.run(h)[: length - len(toks)])
        if len(toks) != length:
            raise TraceError(f"{len(hash_ids)} blocks of {self.block_tokens} tokens cannot make {length} tokens")
        return tuple(toks)


def scale_trace(requests: Sequence[TraceRequest], config: ScaleConfig) -> ScaledTrace:
    """Scaled, replayable requests in trace order; arrivals relative to the first request's timestamp."""
    config.validate()
    b = config.block_tokens
    blocks = BlockTokens(b, config.low, config.vocab, config.seed)
    t0 = requests[0].timestamp_ms if requests else 0.0
    out: list[ScaledRequest] = []
    skipped: list[int] = []
    truncated: list[int] = []
    for i, r in enumerate(requests):
        n = scaled_input_length(r.input_length, b)
        ids = r.hash_ids
        cut = config.max_input_tokens is not None and n > config.max_input_tokens
        if cut:
            if config.long_prompts == "skip":
                skipped.append(i)
                continue
            n = config.max_input_tokens
            ids = ids[: -(-n // b)]
            truncated.append(i)
        out.append(ScaledRequest(
            index=i, arrival_s=(r.timestamp_ms - t0) / 1000.0 / config.time_scale, prompt=blocks.prompt(ids, n),
            max_tokens=scaled_output_length(r.output_length, b, config.max_output_tokens), hash_ids=ids,
            truncated=cut))
    return ScaledTrace(config, out, skipped, truncated)


# -- reuse -------------------------------------------------------------------------------------------------


def _block_lengths(length: int, n_blocks: int, block_tokens: int) -> list[int]:
    full = [block_tokens] * (n_blocks - 1)
    return [*full, length - block_tokens * (n_blocks - 1)] if n_blocks else []


def reusable_tokens(items: Iterable[tuple[Sequence[int], int]], block_tokens: int,
                    kv_block_size: int | None = None) -> tuple[int, int]:
    """(reusable, total) input tokens of a sequence of requests given as (hash_ids, input length), in order.

    A request's reusable tokens are its longest prefix already seen in an earlier request (an unbounded
    cache): whole blocks while the ids match, plus a partial block where an earlier request had only part of
    it or this request has only part. With `kv_block_size`, each request's count is also cut to what a
    block cache could serve: full KV blocks only, and never the last prompt token (it is always computed)."""
    root: dict[int, list] = {}  # block id → [most tokens of it seen, children]
    reusable = total = 0
    for ids, length in items:
        lengths = _block_lengths(length, len(ids), block_tokens)
        covered, node = 0, root
        for h, n in zip(ids, lengths):
            seen = node.get(h)
            if seen is None:
                break
            covered += min(seen[0], n)
            if seen[0] < n:
                break  # the earlier request stopped inside this block
            node = seen[1]
        if kv_block_size is not None:
            covered = min(covered, length - 1) // kv_block_size * kv_block_size
        reusable += covered
        total += length
        node = root
        for h, n in zip(ids, lengths):
            entry = node.setdefault(h, [0, {}])
            entry[0] = max(entry[0], n)
            node = entry[1]
    return reusable, total


def reusable_fraction(items: Iterable[tuple[Sequence[int], int]], block_tokens: int,
                      kv_block_size: int | None = None) -> float:
    """reusable / total input tokens, see `reusable_tokens`; 0.0 for no requests."""
    reusable, total = reusable_tokens(items, block_tokens, kv_block_size)
    return reusable / total if total else 0.0


def trace_items(requests: Iterable[TraceRequest]) -> list[tuple[Sequence[int], int]]:
    """The unscaled trace as reusable_tokens items (use block_tokens=TRACE_BLOCK_TOKENS)."""
    return [(r.hash_ids, r.input_length) for r in requests]


def scaled_items(requests: Iterable[ScaledRequest]) -> list[tuple[Sequence[int], int]]:
    """Scaled requests as reusable_tokens items (use the scale's block_tokens)."""
    return [(r.hash_ids, len(r.prompt)) for r in requests]
