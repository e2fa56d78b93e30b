"""The host-DRAM tier: KV block payloads in memory, bounded in bytes, evicted least recently used first.

Invariants, all under one lock:

* `used_bytes` is the sum of the sizes of the blocks held and never exceeds `capacity_bytes`;
* a pinned block (pin count > 0) is never evicted; a `put` that could only fit by evicting pinned blocks
  is refused and evicts nothing;
* the index order is the eviction order: oldest use first; `put`, `get` and `touch` move a block to the end.

Payloads are immutable (bytes, or read-only views nobody else writes), so a reader that holds a payload
keeps reading the right bytes even if the block is evicted meanwhile; pins exist for callers that need the
block to stay *addressable* (e.g. while a fetch that named it is in progress).

Every change to the set of blocks held is reported to `on_change(kind, hashes)` ("stored" / "evicted"),
called while the lock is held, so a listener sees changes in exactly the order they happened.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from deepinfer.cache.hashing import BlockHash

Payload = bytes | memoryview
ChangeListener = Callable[[str, list[BlockHash]], None]  # ("stored" | "evicted", hashes)


@dataclass(frozen=True)
class HostPut:
    stored: bool  # False: already held (then it was touched), or it could not fit
    evicted: list[BlockHash] = field(default_factory=list)  # made room for it


@dataclass
class _Entry:
    payload: Payload
    nbytes: int
    pins: int = 0


class HostTier:
    def __init__(self, capacity_bytes: int, on_change: ChangeListener | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._on_change = on_change
        self._lock = threading.Lock()
        self._blocks: OrderedDict[BlockHash, _Entry] = OrderedDict()
        self._used = 0
        self._evictions = 0
        self._refused = 0
        self._hits = 0
        self._misses = 0

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._blocks)

    def put(self, block_hash: BlockHash, payload: Payload) -> HostPut:
        """Keep `payload` under `block_hash`, evicting unpinned blocks (oldest use first) to make room.
        Never raises for lack of room: returns stored=False instead."""
        nbytes = memoryview(payload).nbytes
        with self._lock:
            entry = self._blocks.get(block_hash)
            if entry is not None:
                self._blocks.move_to_end(block_hash)
                return HostPut(False)
            need = self._used + nbytes - self.capacity_bytes
            victims = self._pick_victims(need) if need > 0 else []
            if victims is None:
                self._refused += 1
                return HostPut(False)
            for h in victims:
                self._used -= self._blocks.pop(h).nbytes
            self._evictions += len(victims)
            self._blocks[block_hash] = _Entry(payload, nbytes)
            self._used += nbytes
            if self._on_change is not None:
                if victims:
                    self._on_change("evicted", list(victims))
                self._on_change("stored", [block_hash])
            return HostPut(True, victims)

    def _pick_victims(self, need: int) -> list[BlockHash] | None:
        """Oldest unpinned blocks whose sizes add up to `need`, or None if the unpinned ones cannot."""
        victims, freed = [], 0
        for h, entry in self._blocks.items():
            if freed >= need:
                break
            if entry.pins == 0:
                victims.append(h)
                freed += entry.nbytes
        return victims if freed >= need else None

    def get(self, block_hash: BlockHash) -> Payload | None:
        """The payload, counted as a use (moves it to the most-recent end); None if not held."""
        with self._lock:
            entry = self._blocks.get(block_hash)
            if entry is None:
                self._misses += 1
                return None
            self._hits += 1
            self._blocks.move_to_end(block_hash)
            return entry.payload

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._blocks  # a single dict lookup is atomic under the GIL

    def touch(self, block_hash: BlockHash) -> bool:
        with self._lock:
            if block_hash not in self._blocks:
                return False
            self._blocks.move_to_end(block_hash)
            return True

    def pin(self, block_hash: BlockHash) -> bool:
        """Keep the block from eviction until a matching `unpin`; False if it is not held."""
        with self._lock:
            entry = self._blocks.get(block_hash)
            if entry is None:
                return False
            entry.pins += 1
            return True

    def unpin(self, block_hash: BlockHash) -> None:
        with self._lock:
            entry = self._blocks.get(block_hash)
            if entry is not None and entry.pins > 0:
                entry.pins -= 1

    def pins(self, block_hash: BlockHash) -> int:
        with self._lock:
            entry = self._blocks.get(block_hash)
            return entry.pins if entry is not None else 0

    def hashes(self) -> list[BlockHash]:
        """Every block held, oldest use first."""
        with self._lock:
            return list(self._blocks)

    def clear(self) -> None:
        """Drop everything without reporting it (for shutdown)."""
        with self._lock:
            self._blocks.clear()
            self._used = 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"blocks": len(self._blocks), "bytes": self._used, "capacity_bytes": self.capacity_bytes,
                    "evictions": self._evictions, "refused": self._refused, "hits": self._hits, "misses": self._misses}
