"""The cache daemon's storage: a host-DRAM tier in front of an optional NVMe tier, content-addressed by
block hash, for one namespace. The socket shell (services/kvcache.py) calls it, blocking calls from a
thread pool, so every method is thread-safe.

Policy:

* `write` puts each new block into host memory now and queues it for disk (write-behind); `flush` drains
  the queue to disk. A block already held anywhere (host, disk, queued, being flushed) is skipped.
* Host is an LRU cache in front of disk. A host hit counts as a use; a disk hit is promoted into host.
* The write queue holds its own reference to each payload, so a block evicted from host before it was
  flushed still reaches disk. Until then it is in no tier: `lookup` and `read` do not see it and no event
  names it (a write of it is still skipped as held). The queue is bounded in bytes; a write that would
  overflow it is not queued (counted), so a slow disk costs disk hits, never memory or errors.
* Nothing here raises for capacity: what does not fit is dropped and counted. A cache may always forget.
  A disk that fails or fills up costs disk hits only (the disk tier counts the failed writes; the blocks
  stay in host memory). A disk tier that cannot even be opened (say a full disk with no directory yet)
  leaves the store host-only: `disk` becomes None and `disk_error` says why.
* `read` serves the longest prefix it can: it stops at the first block that is absent, fails verification
  (the disk tier quarantines it), or when the deadline passes.

Events: every change of what a tier holds is recorded, in order, while that tier's lock is held, so the
log is exact: a block reported "stored" in a tier and later removed from it (LRU, watermark, quarantine,
vanished file) is reported "evicted" exactly once. `drain_events` returns the log since the last drain;
each TierEvent carries a run of changes of one kind (stored or evicted, never both), so applying the events
in order reproduces the tiers. Blocks found on disk by `open` are reported stored.

Lock order (never reversed): store lock → host lock → event lock; disk lock → event lock. No file I/O
happens under the store lock or a tier lock.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from deepinfer.cache.disk_tier import MISS, READ_ERROR, VANISHED, DiskTier, RebuildReport
from deepinfer.cache.hashing import HASH_BYTES, BlockHash
from deepinfer.cache.host_tier import HostTier, Payload
from deepinfer.cache.pool_share import PoolShare

__all__ = ["TieredStore", "ReadResult", "TierEvent", "RebuildReport", "HOST", "DISK"]

HOST = "host"
DISK = "disk"

# ReadResult.reason: why fewer blocks came than were asked for ("" when all came).
READ_MISS = "miss"
READ_CORRUPT = "corrupt"  # failed verification; quarantined
READ_FAILED = "read_error"
READ_DEADLINE = "deadline"
READ_CLOSED = "closed"


@dataclass(frozen=True)
class ReadResult:
    hashes: list[BlockHash]  # the served prefix of the hashes asked for
    tiers: list[str]  # where each came from: HOST or DISK
    payloads: list[Payload]  # block_nbytes each; immutable
    reason: str = ""


@dataclass(frozen=True)
class TierEvent:
    tier: str
    stored: list[BlockHash] = field(default_factory=list)
    evicted: list[BlockHash] = field(default_factory=list)


class TieredStore:
    def __init__(self, namespace_id: str, block_nbytes: int, host_capacity_bytes: int,
                 disk_root: Path | None, disk_capacity_bytes: int, *, high_watermark: float = 0.95,
                 low_watermark: float = 0.85, max_pending_write_bytes: int = 256 << 20,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if block_nbytes <= 0:
            raise ValueError(f"block_nbytes must be positive, got {block_nbytes}")
        self.namespace_id = namespace_id
        self.block_nbytes = block_nbytes
        self.max_pending_write_bytes = max_pending_write_bytes
        self._clock = clock
        self._lock = threading.Lock()  # the write queue, counters, open/closed
        self._events_lock = threading.Lock()
        self._events: list[tuple[str, str, list[BlockHash]]] = []  # (tier, "stored" | "evicted", hashes)
        self.host = HostTier(host_capacity_bytes, on_change=lambda kind, hs: self._record(HOST, kind, hs))
        self.disk: DiskTier | None = None
        if disk_root is not None:
            self.disk = DiskTier(disk_root, namespace_id, block_nbytes, disk_capacity_bytes,
                                 high_watermark=high_watermark, low_watermark=low_watermark,
                                 on_change=lambda kind, hs: self._record(DISK, kind, hs))
        self._pending: OrderedDict[BlockHash, Payload] = OrderedDict()  # waiting for disk, oldest first
        self._pending_bytes = 0
        self._flushing: set[BlockHash] = set()  # taken off the queue, being written
        self._counters: Counter[str] = Counter()
        self._opened = False
        self._closed = False
        self.disk_error = ""  # why the disk tier could not be opened ("" if it was, or there is none)

    @property
    def tiers(self) -> list[str]:
        return [HOST, DISK] if self.disk is not None else [HOST]

    def open(self) -> RebuildReport:
        """Warm restart of the disk tier (blocking; call once, before `flush`). No-op without disk. A disk
        tier that cannot be opened is dropped (host-only from then on), never an error."""
        report = RebuildReport()
        if self.disk is not None:
            try:
                report = self.disk.open()
            except OSError as e:
                self.disk_error = f"{self.disk.root}: {e}"
                self.disk.close()
                self.disk = None  # nothing was written yet and no event named it: as if configured off
        with self._lock:
            self._opened = True
        return report

    # --- queries ---------------------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes]) -> list[str]:
        """Where each block is: HOST, DISK or "" (memory only, no I/O, no use counted)."""
        disk = self.disk
        return [HOST if self.host.contains(h) else DISK if disk is not None and disk.contains(h) else ""
                for h in hashes]

    def look_through(self, hashes: Sequence[bytes], tiers: Sequence[str]) -> list[str]:
        """`tiers` (a `lookup` of `hashes`) with its leading run extended through the disk: from the first
        block found nowhere, each block another daemon on a shared disk root wrote since this one opened is
        adopted (`DiskTier.adopt`) and counted as DISK, up to the first that is not there. Blocking (a file
        open per block tried, and one for the first absent): run it off the event loop."""
        out = list(tiers)
        disk = self.disk
        if disk is None:
            return out
        first = next((i for i, t in enumerate(out) if not t), len(out))
        for i in range(first, len(out)):
            if out[i]:
                continue
            if not disk.adopt(hashes[i]):
                break
            out[i] = DISK
        return out

    def read(self, hashes: Sequence[bytes], deadline: float | None = None) -> ReadResult:
        """The longest prefix of `hashes` that can be served by `deadline` (clock time), host first, then
        disk (verified, then promoted into host).

        A host payload is immutable, so holding it is as good as a pin; a disk block is pinned by the disk
        tier while its file is read."""
        served: list[BlockHash] = []
        tiers: list[str] = []
        payloads: list[Payload] = []
        reason = ""
        counts: Counter[str] = Counter()
        for h in hashes:
            if self._closed:
                reason = READ_CLOSED
                break
            if deadline is not None and self._clock() >= deadline:
                reason = READ_DEADLINE
                break
            payload = self.host.get(h)
            tier = HOST
            if payload is None:
                if self.disk is None:
                    reason = READ_MISS
                    break
                got = self.disk.get(h)
                if got.payload is None:
                    reason = READ_MISS if got.reason in (MISS, VANISHED) else \
                        READ_FAILED if got.reason == READ_ERROR else READ_CORRUPT
                    break
                payload, tier = got.payload, DISK
                counts["promotions"] += self.host.put(h, payload).stored
            served.append(h)
            tiers.append(tier)
            payloads.append(payload)
        if reason:
            counts[f"read_stopped_{reason}"] += 1
        with self._lock:
            self._counters.update(counts)
        return ReadResult(served, tiers, payloads, reason)

    # --- writes ----------------------------------------------------------------------------------------

    def write(self, hashes: Sequence[bytes], payloads: Sequence[bytes | memoryview]) -> tuple[int, int]:
        """Keep new blocks: into host now, queued for disk. Returns (stored, skipped): stored counts blocks
        that landed in host or the disk queue; skipped counts every other one (held already, not
        block_nbytes long or not a 32-byte hash, no room anywhere). Never raises for capacity."""
        if len(hashes) != len(payloads):
            raise ValueError(f"{len(hashes)} hashes for {len(payloads)} payloads")
        stored = 0
        for h, p in zip(hashes, payloads):
            stored += self._write_one(h, p)
        return stored, len(hashes) - stored

    def _write_one(self, block_hash: bytes, payload: bytes | memoryview) -> bool:
        view = memoryview(payload)
        if len(block_hash) != HASH_BYTES or view.nbytes != self.block_nbytes or not view.contiguous:
            with self._lock:
                self._counters["write_refused_malformed"] += 1
            return False
        if self._held(block_hash):
            with self._lock:
                self._counters["write_skipped_held"] += 1
            return False
        # Our own copy: the caller's buffer (a received frame holding many blocks) may be reused, and a view
        # into it would keep the whole frame alive for as long as any one block is cached.
        data = payload if isinstance(payload, bytes) else view.tobytes()
        with self._lock:
            if self._closed or self._held(block_hash):  # checked again: another thread may have raced us
                self._counters["write_skipped_held"] += 1
                return False
            landed = self.host.put(block_hash, data).stored
            if self.disk is not None:
                if self._pending_bytes + len(data) <= self.max_pending_write_bytes:
                    self._pending[block_hash] = data
                    self._pending_bytes += len(data)
                    landed = True
                else:
                    self._counters["disk_writes_dropped_queue_full"] += 1
            if not landed:
                self._counters["write_dropped_no_room"] += 1
            return landed

    def _held(self, block_hash: BlockHash) -> bool:
        return (self.host.contains(block_hash) or block_hash in self._pending or block_hash in self._flushing
                or (self.disk is not None and self.disk.contains(block_hash)))

    def flush(self, max_blocks: int | None = None) -> int:
        """Write queued blocks to disk, oldest first (blocking). Returns how many were stored there; the
        others (already there, no room, disk error) are dropped and counted by the disk tier."""
        if self.disk is None:
            return 0
        with self._lock:
            if not self._opened:
                raise RuntimeError("TieredStore.flush before open()")
        written = taken = 0
        while max_blocks is None or taken < max_blocks:
            with self._lock:
                if self._closed or not self._pending:
                    break
                block_hash, data = self._pending.popitem(last=False)
                self._pending_bytes -= len(data)
                self._flushing.add(block_hash)
            taken += 1
            try:
                written += self.disk.put(block_hash, data).stored
            finally:
                with self._lock:
                    self._flushing.discard(block_hash)
        return written

    def pending_writes(self) -> int:
        return len(self._pending)

    # --- events and state ------------------------------------------------------------------------------

    def _record(self, tier: str, kind: str, hashes: list[BlockHash]) -> None:
        """Called by a tier with its lock held, so events are logged in the order the changes happened."""
        with self._events_lock:
            if self._events and self._events[-1][:2] == (tier, kind):
                self._events[-1][2].extend(hashes)
            else:
                self._events.append((tier, kind, list(hashes)))

    def drain_events(self) -> list[TierEvent]:
        """Every change since the last drain, in order; each event holds one run of stored or evicted."""
        with self._events_lock:
            log, self._events = self._events, []
        return [TierEvent(tier, stored=hs) if kind == "stored" else TierEvent(tier, evicted=hs)
                for tier, kind, hs in log]

    def snapshot(self) -> dict[str, list[BlockHash]]:
        """Every block each tier holds now (one key per tier this store has)."""
        out = {HOST: self.host.hashes()}
        if self.disk is not None:
            out[DISK] = self.disk.hashes()
        return out

    def stats(self) -> dict[str, int]:
        """Counters and sizes, flat: host_* and disk_* from the tiers (hits, misses, evictions, blocks, bytes,
        disk_quarantined_<reason>, disk_write_errors_no_space, ...), the rest from the store
        (read_stopped_<reason>, promotions, write_skipped_held, disk_writes_dropped_queue_full,
        pending_writes, ...)."""
        out = {f"host_{k}": v for k, v in self.host.stats().items()}
        if self.disk is not None:
            out.update({f"disk_{k}": v for k, v in self.disk.stats().items()})
        with self._lock:
            out.update(self._counters)
            out["pending_writes"] = len(self._pending)
            out["pending_write_bytes"] = self._pending_bytes
        return out

    def balance_pool(self, share: PoolShare) -> int:
        """A round of the pool's shared budget (blocking): this daemon's note written, the others' read, and its
        disk tier shrunk to its share when the pool is over budget. Returns the blocks evicted; a pool that
        cannot be read or written skips the round (counted)."""
        disk = self.disk
        if disk is None:
            return 0
        try:
            target = share.target(disk.used_bytes)
        except OSError:
            with self._lock:
                self._counters["pool_rounds_failed"] += 1
            return 0
        evicted = disk.shrink_to(target) if target is not None else 0
        with self._lock:
            self._counters["pool_evicted"] += evicted
        return evicted

    def drop_page_cache(self) -> int:
        """Drop the kernel's cached pages of every disk block (benchmarks of cold reads); files advised."""
        return self.disk.drop_page_cache() if self.disk is not None else 0

    def close(self) -> None:
        """Stop: queued writes are dropped (counted), host memory released, disk files kept for the next
        open(). Later reads serve nothing and later writes store nothing."""
        with self._lock:
            self._closed = True
            self._counters["disk_writes_dropped_at_close"] += len(self._pending)
            self._pending.clear()
            self._pending_bytes = 0
        self.host.clear()
        if self.disk is not None:
            self.disk.close()
