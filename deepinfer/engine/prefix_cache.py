"""The device tier of the prefix cache, as the engine's callers see it: block hashes, residency, and
moving named blocks' KV in (from the cache daemon's host/disk tiers) and out (write-behind to them).

Inside the step loop the scheduler looks prompts up in the pool and names blocks as they fill; this
module only adds what happens between steps. It owns nothing: it works on the engine's pool and KV
tensor. Hashes are always computed here from tokens (`block_hashes`, `new_hasher`), never taken from
a request's sender; `import_blocks` takes hashes only together with the KV the caller fetched under
exactly those names.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.cache.block_pool import BlockHash, BlockPool
from deepinfer.cache.hashing import HASH_BYTES, CacheNamespace, ChainHasher, HashKeys, hash_blocks
from deepinfer.config.kv import KvSpec
from deepinfer.engine.handoff import HandoffError, check_kv

IMPORT_TIERS = ("host", "disk")


class DevicePrefixCache:
    def __init__(self, pool: BlockPool, kv: torch.Tensor, spec: KvSpec, namespace: CacheNamespace,
                 enabled: bool) -> None:
        self.pool = pool
        self.kv = kv  # the engine's pool, [num_blocks, *spec.block_shape]
        self.spec = spec
        self.namespace = namespace
        self.enabled = enabled

    @property
    def block_size(self) -> int:
        return self.namespace.block_size

    def new_hasher(self, cache_salt: str | None) -> ChainHasher:
        return ChainHasher(self.namespace, HashKeys(cache_salt))

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[BlockHash]:
        return hash_blocks(self.namespace, list(token_ids), HashKeys(cache_salt))

    def cached_prefix_blocks(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading `hashes` name device-resident blocks now (no references taken)."""
        return len(self.pool.lookup(hashes))

    def export_blocks(self, hashes: Sequence[BlockHash]) -> tuple[list[BlockHash], torch.Tensor | None]:
        """The KV of those of `hashes` that are device-resident now, in their order, as one contiguous
        copy [n, *spec.block_shape]; (present hashes, None) when none is."""
        present: list[BlockHash] = []
        ids: list[int] = []
        for h in hashes:
            b = self.pool.block_of(h)
            if b is not None:
                present.append(h)
                ids.append(b)
        if not ids:
            return [], None
        return present, self.kv.index_select(0, torch.tensor(ids, dtype=torch.int64, device=self.kv.device))

    def import_blocks(self, hashes: Sequence[BlockHash], data: torch.Tensor | Sequence[torch.Tensor], tier: str,
                      keep_resident: Sequence[BlockHash] = ()) -> int:
        """Copy fetched blocks in (block i of `data` — one tensor [n, *block] or n tensors [*block], as
        they arrived off the wire — is named hashes[i]) and leave them cached and free,
        marked as coming from `tier`. Hashes already resident are skipped; the rest go into free
        blocks, evicting the least recently used cached ones but never a referenced block, in chain
        order until the pool has no free block left. Returns how many blocks were imported.

        The resident blocks among `keep_resident` (the part of the chain before `hashes`, when the
        caller imports only the rest) and `hashes` are held during the import, so the allocations
        cannot evict the very prefix being completed. If one of `keep_resident` is not resident any
        more, nothing is imported: no lookup could reach the blocks past the gap. Everything held is
        freed in reverse chain order: the chain's head ends up most recently used, evicted last."""
        if tier not in IMPORT_TIERS:
            raise ValueError(f"unknown import tier {tier!r}; expected one of {IMPORT_TIERS}")
        for h in (*keep_resident, *hashes):
            if not isinstance(h, bytes) or len(h) != HASH_BYTES:
                raise ValueError(f"a block hash must be {HASH_BYTES} bytes, got {h!r:.80}")
        if isinstance(data, torch.Tensor):
            check_kv(data, self.spec, len(hashes) * self.block_size)
        else:
            check_blocks(data, self.spec, len(hashes))
        if not self.enabled:
            return 0
        head = self.pool.lookup(keep_resident)
        if len(head) < len(keep_resident):
            return 0
        self.pool.acquire(head)
        held: list[int] = list(head)
        fresh: list[tuple[int, int]] = []  # (index into hashes, block id)
        try:
            for i, h in enumerate(hashes):
                b = self.pool.block_of(h)
                if b is None:
                    if self.pool.num_free == 0:
                        break
                    [b] = self.pool.allocate(1)
                    fresh.append((i, b))
                else:
                    self.pool.acquire([b])
                held.append(b)
            if not fresh:
                return 0
            for i, b in fresh:  # straight into each slab: no gathered intermediate copy
                self.kv[b].copy_(data[i])
            imported = 0
            for i, b in fresh:
                # A hash repeated within `hashes` names only its first block; the copy stays plain.
                if self.pool.register(b, hashes[i]):
                    self.pool.set_origin(b, tier)
                    imported += 1
            return imported
        finally:
            self.pool.free(reversed(held))


def check_blocks(blocks: Sequence[torch.Tensor], spec: KvSpec, n: int) -> None:
    """Raise HandoffError unless `blocks` are `n` tensors each one block of `spec`."""
    if len(blocks) != n:
        raise HandoffError(f"{len(blocks)} block tensors for {n} hashes")
    for t in blocks:
        problem = spec.block_problem(t)
        if problem is not None:
            raise HandoffError(problem)
