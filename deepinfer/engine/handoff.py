"""Prefill/decode handoff, engine side: block reservations under leases, and KV block export/import.

The prefill engine computes a prompt, samples the first token and keeps the prompt's blocks *held*
until the caller has sent them (`export_kv`, then `release`). The decode engine *reserves* blocks
when it accepts a handoff, before the KV arrives, so the transfer can never fail for lack of memory;
a reservation that is not used before its lease runs out is reclaimed (`Reservations.expire`), so a
lost transfer cannot leak blocks. Everything here is bookkeeping over a `BlockPool` plus two tensor
copies; no sockets, no clocks of its own (callers pass `now`).

Both engines must agree on the KV description (`KvSpec`: dtype and block layout; the P/D handshake's
namespace and KvTransfer.kv_layout cover this); `check_kv` refuses anything else with a message
naming the mismatch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from deepinfer.cache.block_pool import BlockPool
from deepinfer.config.kv import KvSpec
from deepinfer.engine.request import InvalidRequestError


class HandoffError(InvalidRequestError):
    """A handoff call that cannot be honoured as asked: unknown held request or reservation, KV of
    the wrong shape or dtype, a reservation too small for the prompt. Nothing was changed."""


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass
class Reservation:
    reservation_id: str
    block_ids: list[int]
    expires_at: float


class Reservations:
    """Blocks taken out of a pool for KV that has not arrived yet, each set under a lease.

    Invariant: every block id in a reservation is held (ref_cnt 1) by that reservation alone, and
    the reservation sets are disjoint from every request's blocks. A reservation ends exactly once:
    `take` (its blocks become a request's), `cancel`, or `expire`.
    """

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self._by_id: dict[str, Reservation] = {}

    def __contains__(self, reservation_id: object) -> bool:
        return reservation_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    @property
    def ids(self) -> list[str]:
        return list(self._by_id)

    @property
    def num_blocks(self) -> int:
        """Blocks currently set aside by all reservations."""
        return sum(len(r.block_ids) for r in self._by_id.values())

    def get(self, reservation_id: str) -> Reservation | None:
        return self._by_id.get(reservation_id)

    def reserve(self, reservation_id: str, num_blocks: int, lease_s: float, now: float) -> bool:
        """Take `num_blocks` free blocks now, until `now + lease_s`. Returns False, changing nothing,
        if fewer are free. Never preempts: running requests keep what they have."""
        if reservation_id in self._by_id:
            raise HandoffError(f"reservation id {reservation_id!r} is already in use")
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise HandoffError(f"a reservation needs a positive number of blocks, got {num_blocks!r}")
        if not isinstance(lease_s, (int, float)) or not math.isfinite(lease_s) or lease_s <= 0:
            raise HandoffError(f"a reservation needs a positive, finite lease, got {lease_s!r}")
        if num_blocks > self.pool.num_free:
            return False
        self._by_id[reservation_id] = Reservation(reservation_id, self.pool.allocate(num_blocks), now + lease_s)
        return True

    def expire(self, now: float) -> list[str]:
        """Free every reservation whose lease has run out (expires_at <= now); their ids, oldest
        deadline first."""
        gone = sorted((r for r in self._by_id.values() if r.expires_at <= now), key=lambda r: r.expires_at)
        for r in gone:
            self._drop(r.reservation_id)
        return [r.reservation_id for r in gone]

    def cancel(self, reservation_id: str) -> bool:
        """Free a reservation now; False if it is unknown (never made, used, cancelled or expired)."""
        if reservation_id not in self._by_id:
            return False
        self._drop(reservation_id)
        return True

    def take(self, reservation_id: str) -> list[int]:
        """End the reservation and hand its blocks, still held, to the caller (who now owns them)."""
        r = self._by_id.pop(reservation_id, None)
        if r is None:
            raise HandoffError(f"unknown or expired reservation {reservation_id!r}")
        return r.block_ids

    def _drop(self, reservation_id: str) -> None:
        # Reverse order, like a sequence's blocks: the pool's LRU reuses the tail first.
        self.pool.free(reversed(self._by_id.pop(reservation_id).block_ids))


def export_blocks(spec: KvSpec, kv: torch.Tensor, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """A contiguous copy of `block_ids`' slabs of the pool `kv` (one index_select on dim 0), covering
    `num_tokens` tokens. Slots past `num_tokens` in the last block are zeroed: they hold stale KV
    of whichever sequence used the block before, which must not travel (and the copy is then a
    deterministic function of the prompt)."""
    block_size = spec.block_size
    if len(block_ids) != blocks_for(num_tokens, block_size):
        raise ValueError(f"{len(block_ids)} blocks do not cover exactly {num_tokens} tokens of {block_size}")
    out = kv.index_select(0, torch.tensor(block_ids, dtype=torch.int64, device=kv.device))
    used = num_tokens - (len(block_ids) - 1) * block_size
    out[-1, :, :, used:].zero_()  # a block is [layers, components, block_size, ...] whatever the spec
    return out


def check_kv(data: object, spec: KvSpec, num_tokens: int) -> None:
    """Raise HandoffError unless `data` is KV for `num_tokens` tokens of `spec`:
    [ceil(num_tokens / block_size), *spec.block_shape] of spec.dtype."""
    problem = spec.problem(data, spec.blocks_for(num_tokens))
    if problem is not None:
        raise HandoffError(problem)


def import_blocks(kv: torch.Tensor, block_ids: list[int], data: torch.Tensor) -> None:
    """Write `data` (already checked) into `block_ids`' slabs: one index_copy_ on dim 0."""
    index = torch.tensor(block_ids, dtype=torch.int64, device=kv.device)
    kv.index_copy_(0, index, data.to(kv.device, non_blocking=False))
