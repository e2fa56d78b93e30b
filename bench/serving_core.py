"""The pure parts of `bench/bench_serving.py`: workloads, arrival times, SSE parsing and the statistics.

No sockets, no model: `tests/unit/test_bench_serving.py` tests everything here directly.

- A workload is a list of `ServingRequest` (a text prompt or token ids, `max_tokens`, the arrival offset in
  seconds). `synthetic_workload` builds one from a text file's words with Poisson arrivals; `trace_workload`
  from a Mooncake-format trace (via `bench.trace`, so prefix sharing survives), replaying its arrival times.
- `SseParser` turns the bytes of a `text/event-stream` body into the `data:` payloads of its events, whatever
  the chunking of the body.
- `RequestRecord` is what one request measured (send, first token, each chunk's arrival, end, output tokens);
  `summarise` turns a run's records into the figures the bench prints (percentiles, throughputs, goodput).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.trace import ScaleConfig, load_trace, sample_groups, scale_trace

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class ServingRequest:
    """One request of a workload: exactly one of `prompt` (text) and `prompt_token_ids`."""

    index: int
    arrival_s: float  # offset from the start of the run
    max_tokens: int
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """`n` arrival offsets (seconds, from 0, non-decreasing) of a Poisson process of `rate` requests per second:
    gaps are exponential with mean 1/rate. `rate` = inf: every request at 0 (a burst; a concurrency bound then
    shapes the load). The first request arrives at 0 in both cases, so a run starts with work."""
    if not rate > 0:
        raise ValueError(f"rate must be positive (or inf), got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


def word_prompts(words: Sequence[str], n: int, min_words: int, max_words: int, seed: int = 0) -> list[str]:
    """`n` prompts, each a window of consecutive `words` of a length uniform in [min_words, max_words] at a
    seeded random place (wrapping around), so prompts read as text but share no long prefix."""
    if not words:
        raise ValueError("no words to build prompts from")
    if not 1 <= min_words <= max_words:
        raise ValueError(f"need 1 <= min_words <= max_words, got {min_words}, {max_words}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length, start = rng.randint(min_words, max_words), rng.randrange(len(words))
        out.append(" ".join(words[(start + k) % len(words)] for k in range(length)))
    return out


def synthetic_workload(text: str, n: int, rate: float, max_tokens: int, min_words: int, max_words: int,
                       seed: int = 0) -> list[ServingRequest]:
    """`n` text prompts cut from `text` (see `word_prompts`), each asking for `max_tokens`, arriving as a
    Poisson process of `rate` (seeded by `seed` too, so one seed gives one workload)."""
    prompts = word_prompts(text.split(), n, min_words, max_words, seed)
    arrivals = poisson_arrivals(n, rate, seed)
    return [ServingRequest(i, a, max_tokens, prompt=p) for i, (p, a) in enumerate(zip(prompts, arrivals))]


def trace_workload(path: str | Path, config: ScaleConfig, sample: float = 1.0, sample_seed: int = 0,
                   limit: int | None = None) -> list[ServingRequest]:
    """A Mooncake-format trace as a workload: whole prefix groups sampled (`sample` < 1, see
    `bench.trace.sample_groups`), scaled by `config` (token ids per block, lengths, arrivals / time_scale),
    then the first `limit` requests. Arrival offsets are the trace's (scaled), from its first request."""
    requests = load_trace(path)
    if sample < 1:
        requests = sample_groups(requests, sample, sample_seed)
    scaled = scale_trace(requests, config).requests
    if limit is not None:
        scaled = scaled[:limit]
    return [ServingRequest(i, r.arrival_s, r.max_tokens, prompt_token_ids=tuple(r.prompt))
            for i, r in enumerate(scaled)]


class SseParser:
    """Incremental parser of a `text/event-stream` body: `feed(bytes)` yields the `data` of each event the
    bytes completed. An event ends at a blank line; its `data:` lines are joined with newlines (the SSE rule);
    comment lines (`:`) and other fields are ignored; CRLF, CR and LF all end a line. Bytes after the last
    blank line wait for the next feed, so the chunking of the body does not matter."""

    def __init__(self) -> None:
        self._buf = ""
        self._data: list[str] = []
        self._pending_cr = False

    def feed(self, chunk: bytes | str) -> Iterator[str]:
        text = chunk.decode() if isinstance(chunk, bytes) else chunk
        if self._pending_cr and text.startswith("\n"):
            text = text[1:]  # the LF of a CRLF split across two chunks
        self._pending_cr = text.endswith("\r")
        self._buf += text
        lines = self._buf.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        self._buf = lines.pop()  # an unfinished line
        for line in lines:
            if line == "":
                if self._data:
                    yield "\n".join(self._data)
                self._data = []
            elif line.startswith("data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(" ") else value)

    def close(self) -> Iterator[str]:
        """An event not ended by a blank line at the end of the body still counts (lenient, as browsers)."""
        if self._buf.startswith("data:"):
            value = self._buf[5:]
            self._data.append(value[1:] if value.startswith(" ") else value)
        self._buf = ""
        if self._data:
            yield "\n".join(self._data)
        self._data = []


@dataclass
class RequestRecord:
    """What one request measured; times are `time.perf_counter()` seconds. `chunk_times` holds the arrival of
    every chunk that carried output (SSE event with text, or ZeroMQ delta with tokens), the first one included;
    its gaps are the inter-token latencies as a client sees them."""

    index: int
    send_s: float
    output_tokens: int = 0
    prompt_tokens: int = 0
    first_token_s: float | None = None
    end_s: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.first_token_s is not None and self.end_s is not None

    @property
    def ttft_s(self) -> float:
        assert self.first_token_s is not None
        return self.first_token_s - self.send_s

    @property
    def e2e_s(self) -> float:
        assert self.end_s is not None
        return self.end_s - self.send_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first: (e2e − TTFT) / (tokens − 1); None with one token."""
        if self.output_tokens < 2 or self.first_token_s is None or self.end_s is None:
            return None
        return (self.end_s - self.first_token_s) / (self.output_tokens - 1)

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile with linear interpolation between the closest ranks (numpy's default); nan if
    empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * p / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """mean and PERCENTILES of `values`, each times `scale` (1000 for ms)."""
    out = {"mean": (sum(values) / len(values) * scale) if values else math.nan}
    for p in PERCENTILES:
        out[f"p{p}"] = percentile(values, p) * scale
    return out


@dataclass(frozen=True)
class Slo:
    """A latency SLO: a request meets it when its TTFT and its TPOT are both within bounds (a bound of None is
    no bound; a one-token request has no TPOT and meets that part)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met(self, rec: RequestRecord) -> bool:
        if not rec.ok:
            return False
        if self.ttft_ms is not None and rec.ttft_s * 1000 > self.ttft_ms:
            return False
        tpot = rec.tpot_s
        return self.tpot_ms is None or tpot is None or tpot * 1000 <= self.tpot_ms


def summarise(records: Sequence[RequestRecord], duration_s: float, slo: Slo = Slo()) -> dict[str, object]:
    """The figures of one run: counts, throughputs over `duration_s` (first send to last end), goodput (SLO-
    meeting requests per second) and ms distributions of TTFT, TPOT, ITL and end-to-end over the requests that
    succeeded."""
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    good = sum(slo.met(r) for r in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: math.nan)
    return {
        "completed": len(ok), "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error}),
        "duration_s": duration_s,
        "output_tokens": out_tokens, "prompt_tokens": prompt_tokens,
        "request_throughput": per_s(len(ok)), "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(out_tokens + prompt_tokens),
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms}, "slo_met": good, "goodput": per_s(good),
        "ttft_ms": distribution([r.ttft_s for r in ok], 1000),
        "tpot_ms": distribution([t for r in ok if (t := r.tpot_s) is not None], 1000),
        "itl_ms": distribution([g for r in ok for g in r.itls()], 1000),
        "e2e_ms": distribution([r.e2e_s for r in ok], 1000),
    }


def run_duration(records: Sequence[RequestRecord]) -> float:
    """From the first send to the last end among the records (0 when none ended)."""
    ends = [r.end_s for r in records if r.end_s is not None]
    return max(ends) - min(r.send_s for r in records) if ends else 0.0


def parse_rates(text: str) -> list[float]:
    """`1,2,4,inf` → [1.0, 2.0, 4.0, inf]; each positive."""
    rates = [float(x) for x in text.split(",") if x.strip()]
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"rates must be positive numbers or inf, got {text!r}")
    return rates
