"""Preemption by swap or by recompute: which is cheaper for each victim, from rates measured as the engine runs.

When running requests outgrow the KV pool the scheduler preempts the latest request of the lowest class
(scheduler.py). Its KV can come back two ways when it is admitted again:

* recompute: its tokens go through the model again (less the leading blocks still cached in the pool then);
* swap: its blocks are copied to host memory now and copied back at re-admission — two copies of its blocks,
  and its KV comes back bit for bit.

`SwapPolicy` decides per victim, from two rates it measures, never configured:

* compute: seconds per token of a step that computed at least `MIN_RATE_TOKENS` tokens (decode-only steps say
  little about recompute, which runs as prefill), an EWMA;
* copy: seconds per block of the engine's own swap copies (out and in), an EWMA seeded when the engine starts by
  timing a copy of a few blocks out and back (the fastest of three: a descheduled thread must not seed it).

A victim is swapped when the host space has room for its blocks and two copies of them are predicted cheaper
than recomputing its computed tokens (before any step was measured, a swap: a block's copy is a memory copy,
its recompute a forward pass). Every `probe_every`-th victim judged cheaper to recompute is swapped anyway, where
it fits: only swaps measure the copy rate, so one slow copy (a descheduled thread) must not stop swaps for good.

The space is bounded in blocks (`EngineConfig.swap_space_bytes`); 0 turns swapping off and every victim recomputes.
The policy holds counts only: the scheduler reserves space through it when it swaps a victim out and releases it
when the copy comes back or its request ends; the engine holds the copy itself, on the request
(`Request.swapped_kv`), so a request that ends drops its copy with it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

MIN_RATE_TOKENS = 16  # steps computing fewer tokens are decode steps: their per-token cost overstates recompute
RATE_ALPHA = 0.2
SWAP, RECOMPUTE, PROBE = "swap", "recompute", "probe"


@dataclass(frozen=True)
class Decision:
    """One victim's fate and why: `choice` (SWAP or RECOMPUTE) for its tokens and blocks, with the predicted
    seconds of each way (0.0: that rate not measured yet)."""

    choice: str
    num_tokens: int
    num_blocks: int
    swap_s: float
    recompute_s: float
    probe: bool = False  # swapped although predicted slower, to measure the copy rate again


@dataclass
class SwapPolicy:
    """Swap-or-recompute decisions and the host space's accounting (module docstring). `decisions` counts
    victims by choice (the blocks actually copied are the engine's `EngineStats`)."""

    capacity_blocks: int
    used_blocks: int = 0
    compute_s_per_token: float = 0.0  # 0: not measured yet
    copy_s_per_block: float = 0.0  # 0: not measured yet
    probe_every: int = 16
    decisions: Counter[str] = field(default_factory=Counter)  # SWAP, RECOMPUTE, and PROBE (swaps, counted apart)
    _slower: int = 0  # victims that fit but were judged cheaper to recompute, for probing

    def __post_init__(self) -> None:
        if self.capacity_blocks < 0 or self.probe_every < 1:
            raise ValueError(f"capacity_blocks must be >= 0 and probe_every >= 1, got {self.capacity_blocks}, "
                             f"{self.probe_every}")

    def predicted_costs(self, num_tokens: int, num_blocks: int) -> tuple[float, float]:
        """(swap seconds, recompute seconds) for a victim with `num_tokens` computed tokens in `num_blocks` blocks;
        0.0 where the rate is not measured yet."""
        return 2 * num_blocks * self.copy_s_per_block, num_tokens * self.compute_s_per_token

    def choose(self, num_tokens: int, num_blocks: int) -> Decision:
        """Swap or recompute a victim with `num_tokens` computed tokens in `num_blocks` blocks (see the module
        docstring); a swap reserves its blocks' space."""
        swap_s, recompute_s = self.predicted_costs(num_tokens, num_blocks)
        fits = 0 < num_blocks and self.used_blocks + num_blocks <= self.capacity_blocks
        choice = SWAP if fits and (not self.compute_s_per_token or swap_s < recompute_s) else RECOMPUTE
        probe = False
        if fits and choice == RECOMPUTE:
            self._slower += 1
            probe = self._slower % self.probe_every == 0
            choice = SWAP if probe else RECOMPUTE
        self.decisions[PROBE if probe else choice] += 1
        if choice == SWAP:
            self.used_blocks += num_blocks
        return Decision(choice, num_tokens, num_blocks, swap_s, recompute_s, probe)

    def release(self, num_blocks: int) -> None:
        """Give back the space of a copy that came back (or was dropped with its request)."""
        if not 0 <= num_blocks <= self.used_blocks:
            raise ValueError(f"releasing {num_blocks} swap blocks with {self.used_blocks} in use")
        self.used_blocks -= num_blocks

    def record_step(self, num_tokens: int, seconds: float) -> None:
        if num_tokens >= MIN_RATE_TOKENS and seconds > 0:
            self.compute_s_per_token = _ewma(self.compute_s_per_token, seconds / num_tokens)

    def record_copy(self, num_blocks: int, seconds: float) -> None:
        if num_blocks > 0 and seconds > 0:
            self.copy_s_per_block = _ewma(self.copy_s_per_block, seconds / num_blocks)


def _ewma(current: float, sample: float) -> float:
    return sample if not current else current + RATE_ALPHA * (sample - current)
