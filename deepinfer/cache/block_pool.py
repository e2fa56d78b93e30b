"""The device block pool: which KV blocks are free and who holds the rest.

The pool only does bookkeeping; the KV tensors themselves live with the model runner, indexed by
block id. Invariants (checked by `check_integrity`):

* every block id in [0, num_blocks) is either in the free queue with ref_cnt 0, or held with
  ref_cnt >= 1 — never both, never neither;
* the free queue has no duplicates and its order is the eviction order: blocks freed earlier are
  reused first (least recently used first).

The free queue is an ordered map rather than a stack so that the prefix cache can later keep freed
blocks addressable by content and pull one out of the middle of the queue when a new request hits it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class NoFreeBlocksError(RuntimeError):
    """Raised by `allocate` when the pool cannot satisfy the request; callers check `num_free` first."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_cnt = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_cnt(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks from the head of the free queue, each with ref_cnt 1."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            self._ref_cnt[block_id] = 1
            out.append(block_id)
        return out

    def incref(self, block_ids: Iterable[int]) -> None:
        """Share already-held blocks with one more holder."""
        for b in block_ids:
            if self._ref_cnt[b] <= 0:
                raise ValueError(f"block {b} is free; only held blocks can be shared")
            self._ref_cnt[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 go to the tail of the free queue.

        Callers free a sequence's blocks in reverse order, so that its tail blocks (least likely to be
        shared by a later prompt) are evicted before its head blocks.
        """
        for b in block_ids:
            cnt = self._ref_cnt[b]
            if cnt <= 0:
                raise ValueError(f"double free of block {b}")
            self._ref_cnt[b] = cnt - 1
            if cnt == 1:
                self._free[b] = None

    def check_integrity(self) -> None:
        """Raise AssertionError describing the first broken invariant."""
        assert len(self._free) <= self.num_blocks, "free queue longer than the pool"
        for b in self._free:
            assert 0 <= b < self.num_blocks, f"free queue holds unknown block {b}"
            assert self._ref_cnt[b] == 0, f"block {b} is in the free queue with ref_cnt {self._ref_cnt[b]}"
        for b, cnt in enumerate(self._ref_cnt):
            assert cnt >= 0, f"block {b} has negative ref_cnt {cnt}"
            if cnt == 0:
                assert b in self._free, f"block {b} has ref_cnt 0 but is not free (leaked)"
