"""The device block pool: which KV blocks are free, who holds the rest, and which blocks are cached.

The pool only does bookkeeping; the KV tensors themselves live with the model runner, indexed by
block id. A block whose KV is complete and final can be *named* by its chain hash (see
`deepinfer.cache.hashing`); a named block stays addressable after its last holder frees it, so a
later request with the same prefix takes it back instead of recomputing it. Invariants (checked by
`check_integrity`):

* every block id in [0, num_blocks) is either in the free queue with ref_cnt 0, or held with
  ref_cnt >= 1 — never both, never neither;
* the free queue has no duplicates and its order is the eviction order: blocks freed earlier are
  reused first (least recently used first). Free named blocks sit in the same queue: `allocate`
  reuses the head and drops its name, so cached blocks are evicted in LRU order;
* the hash map is a bijection between names and named blocks: a hash names at most one block, a
  block has at most one name. A second block computed with an already-cached hash stays unnamed;
* only a named block has an origin tier (where its KV was imported from, until a hit uses it);
* the pending events are the exact net change of the set of names since the last `drain_events`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

BlockHash = bytes


class NoFreeBlocksError(RuntimeError):
    """Raised by `allocate` when the pool cannot satisfy the request; callers check `num_free` first."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_cnt = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._name: list[BlockHash | None] = [None] * num_blocks
        self._block_of: dict[BlockHash, int] = {}
        self._origin: dict[int, str] = {}
        # Net change of the name set since the last drain: True = added, False = removed.
        self._pending: dict[BlockHash, bool] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Named blocks, held or free."""
        return len(self._block_of)

    def ref_cnt(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    # -- holding blocks ---------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks from the head of the free queue, each with ref_cnt 1; a named block taken
        loses its name (its KV is about to be overwritten)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self._ref_cnt[block_id] = 1
            out.append(block_id)
        return out

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Take one more reference to each block, free or held (a cache hit): a free one leaves the
        free queue with its KV and name intact."""
        for b in block_ids:
            if self._ref_cnt[b] == 0:
                del self._free[b]
            self._ref_cnt[b] += 1

    def incref(self, block_ids: Iterable[int]) -> None:
        """Share already-held blocks with one more holder."""
        for b in block_ids:
            if self._ref_cnt[b] <= 0:
                raise ValueError(f"block {b} is free; only held blocks can be shared")
            self._ref_cnt[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 go to the tail of the free queue,
        keeping their names.

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

    # -- names ------------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The blocks named by the longest prefix of `hashes` that is cached. Takes no references."""
        out = []
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def block_of(self, block_hash: BlockHash) -> int | None:
        return self._block_of.get(block_hash)

    def name_of(self, block_id: int) -> BlockHash | None:
        return self._name[block_id]

    def register(self, block_id: int, block_hash: BlockHash) -> bool:
        """Name a held block whose KV is complete. Returns False, changing nothing, if the hash already
        names a block (the first copy stays cached; this one remains a plain block) or this block
        already has a name."""
        if self._ref_cnt[block_id] <= 0:
            raise ValueError(f"block {block_id} is free; only a held block with fresh KV can be named")
        if block_hash in self._block_of or self._name[block_id] is not None:
            return False
        self._name[block_id] = block_hash
        self._block_of[block_hash] = block_id
        self._note(block_hash, added=True)
        return True

    def forget_free(self) -> int:
        """Unname every free cached block (held blocks keep their names: their KV is in use). Returns how
        many names were dropped; each is reported as evicted."""
        victims = [b for b in self._free if self._name[b] is not None]
        for b in victims:
            self._evict(b)
        return len(victims)

    def origin(self, block_id: int) -> str | None:
        """The tier a named block's KV was imported from ("host", "disk"), None if computed here or
        already hit since."""
        return self._origin.get(block_id)

    def set_origin(self, block_id: int, tier: str) -> None:
        if self._name[block_id] is None:
            raise ValueError(f"block {block_id} has no name; only a cached block has an origin")
        self._origin[block_id] = tier

    def clear_origin(self, block_id: int) -> None:
        self._origin.pop(block_id, None)

    def cached_hashes(self) -> list[BlockHash]:
        """Every name now in the pool (a snapshot for a router's prefix index)."""
        return list(self._block_of)

    def drain_events(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """(names added, names removed) since the last drain: the exact net change, so applying both
        to the previous snapshot, in either order, gives `cached_hashes()`."""
        stored = [h for h, added in self._pending.items() if added]
        evicted = [h for h, added in self._pending.items() if not added]
        self._pending = {}
        return stored, evicted

    def _evict(self, block_id: int) -> None:
        name = self._name[block_id]
        if name is None:
            return
        self._name[block_id] = None
        del self._block_of[name]
        self._origin.pop(block_id, None)
        self._note(name, added=False)

    def _note(self, block_hash: BlockHash, added: bool) -> None:
        # An entry for the opposite change means the hash was back to its state at the last drain.
        if self._pending.get(block_hash) is (not added):
            del self._pending[block_hash]
        else:
            self._pending[block_hash] = added

    # -- checks -----------------------------------------------------------------------------

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
        for h, b in self._block_of.items():
            assert self._name[b] == h, f"hash {h.hex()[:16]} maps to block {b}, which is named otherwise"
        named = sum(name is not None for name in self._name)
        assert named == len(self._block_of), f"{named} named blocks but {len(self._block_of)} hash map entries"
        for b in self._origin:
            assert self._name[b] is not None, f"block {b} has an origin tier but no name"
        for h, added in self._pending.items():
            assert (h in self._block_of) == added, f"pending event for {h.hex()[:16]} disagrees with the hash map"
