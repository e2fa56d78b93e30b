"""What the cache daemon records, from its store's flat stats (`TieredStore.stats()`): per tier (host,
disk) the blocks and bytes held and the capacity, evictions, and reads by result; the disk write queue and the
disk tier's failed writes by cause."""

from __future__ import annotations

from collections.abc import Mapping

from deepinfer.metrics import definitions as d
from deepinfer.metrics.bind import TotalsFeed, bind

TIERS = ("host", "disk")
REFUSALS = ("namespace", "kv")  # why a cache request was refused (services.kvcache)


class CacheExport:
    """A cache daemon's metrics (service "kvcache")."""

    def __init__(self, service: str, instance: str) -> None:
        who = (service, instance)
        self._gauges = {f"{tier}_{key}": bind(gauge, *who, tier) for tier in TIERS
                        for key, gauge in (("blocks", d.CACHE_TIER_BLOCKS), ("bytes", d.CACHE_TIER_BYTES),
                                           ("capacity_bytes", d.CACHE_TIER_CAPACITY))}
        counters = {f"{tier}_evictions": bind(d.CACHE_EVICTIONS, *who, tier) for tier in TIERS}
        for tier in TIERS:
            counters[f"{tier}_hits"] = bind(d.CACHE_LOOKUPS, *who, tier, "hit")
            counters[f"{tier}_misses"] = bind(d.CACHE_LOOKUPS, *who, tier, "miss")
        for cause in ("no_space", "io"):
            counters[f"disk_write_errors_{cause}"] = bind(d.CACHE_DISK_WRITE_ERRORS, *who, cause)
        self._totals = TotalsFeed(counters.get)
        self._pending = bind(d.CACHE_PENDING_WRITES, *who)
        self._refused = TotalsFeed(lambda reason: bind(d.CACHE_REFUSED, *who, reason) if reason in REFUSALS else None)

    def stats(self, stats: Mapping[str, int]) -> None:
        """The store's stats now (a tier without a key, e.g. no disk tier, keeps its gauges at 0)."""
        for key, gauge in self._gauges.items():
            if key in stats:
                gauge.set(stats[key])
        self._totals.update(stats)
        self._pending.set(stats.get("pending_writes", 0))

    def refused(self, totals: Mapping[str, int]) -> None:
        """The daemon's refused requests so far, by reason (monotonic totals)."""
        self._refused.update(totals)
