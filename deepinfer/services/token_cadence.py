"""Time per output token by batch size: what a worker measures and the router predicts a stream's TPOT from.

A worker's engine thread records every step that follows another with no idle wait between them: the interval
from the previous step's start to this one's (the cadence a stream sees, with the commands handled between
steps), and what that previous step gave out — the streams that got tokens and how many tokens in all. A
stream's time per token in that step is interval × streams / tokens (speculation's extra tokens make it
shorter). `CadenceMeter` keeps, per bucket of batch sizes (1, 2–3, 4–7, … powers of two), an EWMA of the
batch size and of that time, and reports the buckets with enough samples as (rows, seconds per token) points,
fewest rows first; heartbeats carry them (`Heartbeat.tpot_by_batch`).

The router predicts the time per token of a batch of `rows` from those points (`predict_tpot`): linear
between the two points around it, the first point's time below the first, and past the last in proportion to
the rows. Decode grows less than in proportion to its rows wherever the weights are read once per step for
every row, so that proportion over-predicts: an SLO judged on it refuses a stream early rather than admits
it to be served late. With no point, nothing is predicted (and nothing refused).
"""

from __future__ import annotations

from collections.abc import Sequence

ALPHA = 0.1  # EWMA weight of each step: a bucket follows a change of load within some tens of steps
MIN_SAMPLES = 3  # steps a bucket must have seen before it is reported (one step alone is mostly noise)


def bucket_of(rows: int) -> int:
    """Batch sizes 1, 2–3, 4–7, 8–15, …: bucket 0, 1, 2, 3, …"""
    return max(rows, 1).bit_length() - 1


class CadenceMeter:
    """A worker's time per output token, by batch size (module docstring). Not thread-safe: the engine
    thread records, and a heartbeat reads a copy (`points` builds a new list)."""

    def __init__(self, alpha: float = ALPHA, min_samples: int = MIN_SAMPLES) -> None:
        self.alpha = alpha
        self.min_samples = min_samples
        self._buckets: dict[int, list[float]] = {}  # bucket → [samples, mean rows, mean seconds per token]

    def record(self, streams: int, tokens: int, interval_s: float) -> None:
        """One step's cadence: `streams` got `tokens` in all, `interval_s` after the step before it began."""
        if streams <= 0 or tokens <= 0 or not interval_s > 0:
            return
        per_token = interval_s * streams / tokens
        b = self._buckets.get(bucket_of(streams))
        if b is None:
            self._buckets[bucket_of(streams)] = [1, float(streams), per_token]
            return
        b[0] += 1
        b[1] += self.alpha * (streams - b[1])
        b[2] += self.alpha * (per_token - b[2])

    def points(self) -> list[tuple[float, float]]:
        """(mean rows, mean seconds per token) of each bucket with enough samples, fewest rows first."""
        return [(b[1], b[2]) for _, b in sorted(self._buckets.items()) if b[0] >= self.min_samples]


def predict_tpot(points: Sequence[tuple[float, float]], rows: int) -> float | None:
    """A stream's predicted seconds per token in a batch of `rows`, from `points` sorted by rows (module
    docstring); None without points."""
    if not points:
        return None
    first_rows, first_s = points[0]
    if rows <= first_rows:
        return first_s
    for (r0, s0), (r1, s1) in zip(points, points[1:], strict=False):
        if rows <= r1:
            return s0 + (s1 - s0) * (rows - r0) / (r1 - r0) if r1 > r0 else max(s0, s1)
    last_rows, last_s = points[-1]
    return last_s * rows / last_rows
