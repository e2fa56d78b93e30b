"""A worker group's side of the cache daemon: the prefix-cache calls `CacheClient` makes of an engine,
routed to the rank they concern. Only rank 0 talks to the daemon; the KV moves between rank 0 and a
follower on the group's control channel (the same out-of-band frames as a P/D handoff).

Where each call goes:

* Lookup and import for a new request go to the rank the request will be placed on. The placement is
  decided once, by `route(request_id, hashes)`: the group's usual placement (the longest device-cached
  prefix among the ranks near the least loaded, else the least loaded) over the prompt's chain, recorded
  under the request id. The lookup reads that rank's device-resident prefix, the import copies the
  fetched blocks into that rank's pool, and `add_request` then takes the recorded rank instead of placing
  the request again: no block is imported into a rank the request does not go to.
* Write-behind exports go to the rank whose KV events named the block (the leader's exact view of each
  rank's prefix cache, `GroupEngine._hashes`); a chain spread over ranks is exported from each in one round
  and put back in the order asked.
* A reset (an operator's, or a test emptying the device tier) goes to every rank.

Blocks: an import holds blocks only inside the rank's `import_cached_blocks`, which frees what it holds
before it returns (imported blocks stay named and free); an export copies and holds nothing. So no abort or
failure leaves a block taken on any rank. A rank that breaks mid-import or mid-export breaks the round, and
the group ends with GroupBroken like any other round failure.

Routes not taken (the request was aborted while its prefix loaded, or the fetch failed) are dropped by
`abort` or after `ROUTE_TTL_S`; a stale route costs nothing but a placement.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deepinfer.cache.hashing import BlockHash
from deepinfer.services.group.control import Op, kv_meta, raise_if_error

if TYPE_CHECKING:
    from deepinfer.services.group.engine import GroupEngine

ROUTE_TTL_S = 60.0  # far above a fetch's deadline: a route older than this was never followed by its add


@dataclass
class RankCache:
    """One request's `PrefixTarget` (deepinfer.engine.interface): the lookup and import `CacheClient` makes
    for it, on the rank it was routed to."""

    group: GroupEngine
    rank: int

    def cached_prefix_blocks(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading `hashes` are device-resident on this rank now."""
        self.group._check()
        if self.rank == 0:
            return self.group.local.cached_prefix_blocks(hashes)
        return _leading(hashes, self.group._hashes[self.rank])  # exact between rounds: its last report's

    def import_cached_blocks(self, hashes: Sequence[BlockHash], kv: torch.Tensor | Sequence[torch.Tensor],
                             tier: str, keep_resident: Sequence[BlockHash] = ()) -> int:
        """As LLMEngine.import_cached_blocks, on this rank (a follower's in one round, its KV sent along)."""
        g = self.group
        g._check()
        if self.rank == 0:
            return g.local.import_cached_blocks(hashes, kv, tier, keep_resident)
        data = kv if isinstance(kv, torch.Tensor) else torch.stack(list(kv)) if len(kv) else None
        if data is None:
            return 0
        g._kv_out.append((self.rank, data))
        result, _ = g._call(self.rank, [Op.IMPORT_CACHED, list(hashes), tier, list(keep_resident), kv_meta(data)])
        return int(raise_if_error(result))


class GroupCache:
    """The group's routes of prefix-cache calls (see the module docstring)."""

    def __init__(self, group: GroupEngine) -> None:
        self.group = group
        self._routes: dict[str, tuple[int, float]] = {}  # request id → (its rank, when routed)

    def route(self, request_id: str, hashes: Sequence[BlockHash]) -> RankCache:
        """Decide the rank request `request_id` (prompt chain `hashes`) goes to, once: its lookup and import
        use the returned view, and its `add_request` takes the same rank."""
        g = self.group
        g._check()
        self._expire(time.monotonic())
        routed = self._routes.get(request_id)
        rank = routed[0] if routed is not None else g._place_chain(list(hashes))
        self._routes[request_id] = (rank, time.monotonic())
        return RankCache(g, rank)

    def take_route(self, request_id: str) -> int | None:
        """The rank `route` chose for this request (forgotten now), or None: not routed."""
        routed = self._routes.pop(request_id, None)
        return routed[0] if routed is not None else None

    def drop_route(self, request_id: str) -> None:
        self._routes.pop(request_id, None)

    @property
    def num_routes(self) -> int:
        return len(self._routes)

    def routed(self) -> list[int]:
        """Per rank, the requests routed there and not added yet: load placement must count (a burst of
        lookups would otherwise all pick the same least-loaded rank)."""
        counts = [0] * self.group.size
        for rank, _ in self._routes.values():
            counts[rank] += 1
        return counts

    def export(self, hashes: Sequence[BlockHash]) -> tuple[list[BlockHash], torch.Tensor | None]:
        """As LLMEngine.export_cached_blocks over the group: each block from a rank whose KV events named it
        (the one naming most of them first), all followers' in one round; (present hashes in the order
        asked, their KV) or ([], None)."""
        g = self.group
        g._check()
        g._absorb_local_events()  # rank 0's view up to date too
        by_rank = self._holders_of(hashes)
        found: dict[BlockHash, torch.Tensor] = {}
        if 0 in by_rank:
            _collect(found, *g.local.export_cached_blocks(by_rank.pop(0)))
        if by_rank:
            results = g._call_all({r: [Op.EXPORT_CACHED, wanted] for r, wanted in by_rank.items()})
            for result, kv in results.values():
                names, _ = raise_if_error(result)
                _collect(found, names, kv)
        present = [h for h in hashes if h in found]
        if not present:
            return [], None
        return present, torch.stack([found[h] for h in present])

    def reset(self) -> int:
        """Forget every cached block no request holds, on every rank (one round); how many names went."""
        g = self.group
        g._check()
        forgotten = g.local.reset_prefix_cache()
        if g.size > 1:
            results = g._call_all({r: [Op.RESET_CACHE] for r in range(1, g.size)})
            forgotten += sum(int(raise_if_error(result)) for result, _ in results.values())
        g._absorb_local_events()
        return forgotten

    def _holders_of(self, hashes: Sequence[BlockHash]) -> dict[int, list[BlockHash]]:
        """Each named block's rank (of the ranks naming it, the one naming most of `hashes`), in order."""
        named = self.group._hashes
        count = [sum(h in mine for h in hashes) for mine in named]
        by_rank: dict[int, list[BlockHash]] = {}
        for h in hashes:
            holders = [r for r, mine in enumerate(named) if h in mine]
            if holders:
                by_rank.setdefault(max(holders, key=lambda r: (count[r], -r)), []).append(h)
        return by_rank

    def _expire(self, now: float) -> None:
        for rid in [rid for rid, (_, at) in self._routes.items() if now - at > ROUTE_TTL_S]:
            del self._routes[rid]


def _leading(hashes: Sequence[BlockHash], present: set[BlockHash]) -> int:
    n = 0
    for h in hashes:
        if h not in present:
            break
        n += 1
    return n


def _collect(found: dict[BlockHash, torch.Tensor], names: Sequence[BlockHash], kv: torch.Tensor | None) -> None:
    if kv is not None:  # on the CPU: a follower's arrive there, and the daemon takes them from there
        kv = kv.to("cpu")
        for i, h in enumerate(names):
            found[h] = kv[i]
