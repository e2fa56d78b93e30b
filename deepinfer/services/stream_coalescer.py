"""How often a worker streams new tokens to the tokenizers: at most once per `interval_s`, except what
must not wait.

Every DetokenizeBatch wakes the tokenizer, then the router, then the client. At batch 1 a step takes
~10 ms on two cores, and those three wake-ups per token took the cores from the step's own threads: the
mesh decoded at 0.84 of the in-process engine (STREAM_INTERVAL_S has the figures). Holding a fast
request's tokens for a few steps sends the same tokens in fewer, larger messages. What is never held: a
request's first tokens (time to first token) and its finish (the end of the stream, and the blocks it
frees); either sends everything held with it.

Pure: the worker core calls `add` with each step's items and `take` when it flushes; time comes in as
`now` (monotonic seconds). Invariant: a request's held items are merged in order into one item, so
offsets stay contiguous and the tokenizer sees exactly the tokens it would have seen step by step.
"""

from __future__ import annotations

from dataclasses import replace

from deepinfer.protocol.messages import DetokenizeItem

__all__ = ["STREAM_INTERVAL_S", "StreamCoalescer"]

# 50 ms: text arriving in 20 chunks a second reads as a smooth stream, and at batch 1 (~10 ms steps) a
# message carries ~5 tokens. Measured (`python -m bench.bench_mesh --batch1 200 --threads 2`, mesh / engine):
# every step 0.84 co-located, 0.85 P/D; 20 ms 0.89, 0.99; 50 ms 1.07, 0.96 (runs vary by ~10%). At 32+
# concurrent a step takes longer than this, so every step still sends.
STREAM_INTERVAL_S = 0.05


class StreamCoalescer:
    """Items held per tokenizer until the interval since the last send has passed (0: never hold)."""

    def __init__(self, interval_s: float = STREAM_INTERVAL_S) -> None:
        if interval_s < 0:
            raise ValueError(f"stream interval must be >= 0, got {interval_s}")
        self.interval_s = interval_s
        self._held: dict[str, dict[str, DetokenizeItem]] = {}  # tokenizer -> request id -> merged item
        self._last_sent = float("-inf")

    def __bool__(self) -> bool:
        return bool(self._held)

    def add(self, tokenizer: str, item: DetokenizeItem) -> None:
        """Hold `item`, merged after any held item of the same request."""
        held = self._held.setdefault(tokenizer, {})
        prev = held.get(item.request_id)
        held[item.request_id] = item if prev is None else _merge(prev, item)

    def due(self, now: float) -> bool:
        """Whether the interval since the last send has passed."""
        return now - self._last_sent >= self.interval_s

    def take(self, now: float) -> dict[str, list[DetokenizeItem]]:
        """Everything held, per tokenizer, and the interval restarts at `now`."""
        out = {tok: list(items.values()) for tok, items in self._held.items()}
        self._held.clear()
        self._last_sent = now
        return out

    def drop(self, request_id: str) -> None:
        """Forget a request's held items (it ended without a finished item: aborted, failed)."""
        for held in self._held.values():
            held.pop(request_id, None)
        self._held = {tok: held for tok, held in self._held.items() if held}


def _merge(a: DetokenizeItem, b: DetokenizeItem) -> DetokenizeItem:
    """`a` then `b` (b.offset == a.offset + len(a.token_ids)) as one item."""
    logprobs = None if a.logprobs is None and b.logprobs is None else (a.logprobs or []) + (b.logprobs or [])
    return replace(b, offset=a.offset, token_ids=a.token_ids + b.token_ids, logprobs=logprobs,
                   prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs)
