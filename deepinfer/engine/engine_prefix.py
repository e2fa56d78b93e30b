"""The prefix cache between steps: `LLMEngine`'s calls on its device tier (`PrefixCacheMixin`).

The device tier of the prefix cache (DESIGN §4) lives in the block pool: a block full of computed KV
is named by its chain hash (`block_hashes`, salted per tenant with `cache_salt`) and stays cached after
its request ends, until the pool reuses it (LRU). A new request takes the longest cached prefix of its
prompt instead of computing it. Between steps the worker moves named blocks to and from the cache
daemon's tiers with `export_cached_blocks` and `import_cached_blocks`; `pool.drain_events()` and
`pool.cached_hashes()` feed the router's prefix index.

Inside the step loop the scheduler looks prompts up and names blocks as they fill; these calls are what the
worker and its cache client make between steps, over `prefix_cache.DevicePrefixCache`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Self

import torch

from deepinfer.cache.hashing import BlockHash

if TYPE_CHECKING:
    from deepinfer.cache.block_pool import BlockPool
    from deepinfer.engine.engine import EngineStats
    from deepinfer.engine.prefix_cache import DevicePrefixCache


class PrefixCacheMixin:
    """The prefix-cache calls of `LLMEngine` (module docstring)."""

    # The engine's state this part uses, set by `LLMEngine.__init__`.
    pool: BlockPool
    prefix_cache: DevicePrefixCache
    stats: EngineStats

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[BlockHash]:
        """The chain hashes of the full blocks of `token_ids`, as a request with this salt names them."""
        return self.prefix_cache.block_hashes(token_ids, cache_salt)

    def cached_prefix_blocks(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading `hashes` are device-resident now (takes nothing: a later step may evict them)."""
        return self.prefix_cache.cached_prefix_blocks(hashes)

    def cache_route(self, request_id: str, hashes: Sequence[BlockHash]) -> Self:
        """Where request `request_id`'s cached-prefix lookup and import go (a `PrefixTarget`): this engine (a
        worker group answers with the one rank it places the request on)."""
        return self

    def export_cached_blocks(self, hashes: Sequence[BlockHash]) -> tuple[list[BlockHash], torch.Tensor | None]:
        """The KV of those of `hashes` that are device-resident, in order, as one contiguous copy
        [n, *kv_spec.block_shape] (None when none is): for write-behind."""
        return self.prefix_cache.export_blocks(hashes)

    def import_cached_blocks(self, hashes: Sequence[BlockHash], kv: torch.Tensor | Sequence[torch.Tensor], tier: str,
                             keep_resident: Sequence[BlockHash] = ()) -> int:
        """Cache KV fetched from `tier` ("host" or "disk"): block i of `kv` (one tensor [n,
        *kv_spec.block_shape], or n per-block tensors) is named hashes[i]. Fills
        free blocks only (evicting least recently used cached ones, never a referenced block); returns
        how many blocks were imported. A later hit on one counts under `tier` in `Usage.cached_by_tier`.

        `keep_resident`: the chain's blocks before `hashes` that are already here (a device-resident
        head, an earlier import of another tier); they are held through the import so it cannot evict
        them, and if one is gone nothing is imported (0). Raises HandoffError for KV of the wrong shape
        or dtype, ValueError for a bad tier or hash."""
        n = self.prefix_cache.import_blocks(hashes, kv, tier, keep_resident)
        self.stats.blocks_imported += n
        return n

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds (an operator's reset, and how tests empty the device
        tier to reach the cache daemon's). Returns how many were forgotten."""
        return self.pool.forget_free()
