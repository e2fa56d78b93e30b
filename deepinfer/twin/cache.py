"""A simulated cache daemon: the real `TieredStore` (host LRU, disk tier with watermarks, write-behind queue,
promotion on read, exact events) on the twin's clock, its I/O a cost model.

The store holds tiny stand-in payloads (`STAND_IN_NBYTES` per block) instead of the model's KV, and its
capacities are scaled so that it holds the same number of blocks as the real daemon would with the real
block size: host exactly (floor(capacity / block bytes) blocks either way); disk to within a block at
each watermark (a disk file is a header plus the payload, and the header does not scale). The disk tier is
real too, files and all, in a temporary directory (prefer a tmpfs: /dev/shm), so the twin runs the same
eviction, write-visibility and verification code as the daemon.

Timing, following services/kvcache.py:
* a lookup (CacheLookup → CacheLookupReply) is answered from memory: a hop each way;
* a fetch (CacheFetch → CacheBlocks) reads the longest prefix by its deadline. The store's own deadline
  check decides where it stops: its clock, during a read, stands at the fetch's start plus the cost of the
  blocks read so far (each by the tier `lookup` says it is in). The blocks then travel on the transport;
* a prefetch (CachePrefetch) reads the disk-held head of a prefix into host, at most
  MAX_PREFETCHES_IN_FLIGHT at once (past that, dropped), taking effect when its reads would be done;
* a store (CacheStore → CacheStoreAck) lands in host (and the disk queue) when its KV has arrived;
* the disk queue drains one block at a time, each visible on disk once its write would be done;
* events are published every EVENTS_PERIOD_S, as the daemon does.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deepinfer.cache.block_file import HEADER_BYTES
from deepinfer.cache.store import DISK, HOST, TieredStore
from deepinfer.protocol import messages as m
from deepinfer.services.kv_events import KvEventPublisher
from deepinfer.services.kvcache import EVENTS_PERIOD_S, MAX_PREFETCHES_IN_FLIGHT, PREFETCH_DEADLINE_S, TIERS
from deepinfer.twin.costs import CostModel
from deepinfer.twin.events import EventLoop

__all__ = ["SimCacheDaemon", "STAND_IN_NBYTES", "scaled_capacities"]

STAND_IN_NBYTES = 8
Send = Callable[[str, str, Any], None]


def scaled_capacities(real_block_nbytes: int, host_bytes: int, disk_bytes: int) -> tuple[int, int]:
    """The stand-in store's (host, disk) capacities that hold as many blocks as the real ones."""
    host = host_bytes // real_block_nbytes * STAND_IN_NBYTES
    disk = round(disk_bytes * (HEADER_BYTES + STAND_IN_NBYTES) / (HEADER_BYTES + real_block_nbytes))
    return host, disk


def _tmpfs() -> str | None:
    """/dev/shm where there is one: the disk tier's files then cost memory, not a disk's fsyncs."""
    return "/dev/shm" if Path("/dev/shm").is_dir() else None


class _ReadClock:
    """The store's clock during one read: the fetch's start plus the cost of each block asked so far. The
    store reads the clock once before each block, so the k-th reading is the start plus k blocks' cost."""

    def __init__(self, start: float, per_block: list[float]) -> None:
        self.t = start
        self.costs = iter(per_block)
        self.first = True

    def __call__(self) -> float:
        if self.first:
            self.first = False
        else:
            self.t += next(self.costs, 0.0)
        return self.t


class SimCacheDaemon:
    def __init__(self, name: str, loop: EventLoop, send: Send, costs: CostModel, namespace_id: str,
                 real_block_nbytes: int, host_bytes: int, disk_bytes: int, disk_root: Path | None = None) -> None:
        self.name, self.loop, self.send, self.costs = name, loop, send, costs
        self.real_block_nbytes = real_block_nbytes
        self.incarnation = f"{name}-twin"
        host_cap, disk_cap = scaled_capacities(real_block_nbytes, host_bytes, disk_bytes)
        self._own_root = disk_root is None and disk_bytes > 0
        root = (Path(tempfile.mkdtemp(prefix="twin-kvcache-", dir=_tmpfs())) if self._own_root else disk_root)
        self._clock_now: Callable[[], float] = lambda: self.loop.now
        self.store = TieredStore(namespace_id, STAND_IN_NBYTES, host_cap, root if disk_bytes > 0 else None,
                                 disk_cap, clock=lambda: self._clock_now())
        self.store.open()
        self.root = root
        self.publisher = KvEventPublisher(name, self.incarnation)
        self._payload = bytes(STAND_IN_NBYTES)
        self._flushing = False
        self.prefetches_in_flight = 0
        self.prefetches_dropped = 0
        self._seq = itertools.count(1)

    def close(self) -> None:
        self.store.close()
        if self._own_root and self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)

    # -- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> None:
        self.send(self.name, "router", m.Hello(m.PROTOCOL_VERSION, "kvcache", self.name,
                                               capabilities={"incarnation": self.incarnation}))
        self._heartbeat()
        self._publish(snapshot=True)
        self.loop.after(EVENTS_PERIOD_S, self._events_timer)

    def _heartbeat(self) -> None:
        self.send(self.name, "router", m.Heartbeat("kvcache", self.name, self.incarnation, next(self._seq), 0))
        self.loop.after(0.5, self._heartbeat)

    def _events_timer(self) -> None:
        self._publish(snapshot=False)
        self.loop.after(EVENTS_PERIOD_S, self._events_timer)

    def _publish(self, snapshot: bool) -> None:
        for ev in self.store.drain_events():
            for msg in self.publisher.changes(ev.tier, ev.stored, ev.evicted):
                self.send(self.name, "router", msg)
        if snapshot:
            snap = self.store.snapshot()
            for tier in TIERS:
                for msg in self.publisher.snapshot(tier, snap.get(tier, [])):
                    self.send(self.name, "router", msg)

    def receive(self, msg: Any) -> None:
        if isinstance(msg, m.KvResync):
            self._publish(snapshot=True)
        elif not isinstance(msg, m.AbortRequest):
            raise TypeError(f"{self.name}: the twin's cache daemon takes no {type(msg).__name__}")

    # -- the workers' requests ----------------------------------------------------------------------

    def _block_read_s(self, tier: str) -> float:
        link = self.costs.host.read if tier == HOST else self.costs.disk.read
        return link.seconds(self.real_block_nbytes)

    def lookup(self, worker: str, hashes: list[bytes], reply: Callable[[list[str]], None]) -> None:
        hop = self.costs.hop.seconds()

        def answer() -> None:
            tiers = self.store.lookup(hashes)
            if self.store.disk is not None and not all(tiers):
                tiers = self.store.look_through(hashes, tiers)
            self.loop.after(hop, lambda: reply(tiers))

        self.loop.after(hop, answer)

    def fetch(self, worker: str, hashes: list[bytes], deadline: float, transport: str,
              reply: Callable[[list[bytes], list[str]], None]) -> None:
        """Blocks in replies of at most MAX_FETCH_BLOCKS, as cache_client asks for them, each read to the
        fetch's deadline; `reply` gets everything served, in order."""
        hop = self.costs.hop.seconds()
        got: list[bytes] = []
        tiers: list[str] = []

        def ask() -> None:
            want = hashes[len(got):]
            self.loop.after(hop, lambda: read(want[: m.MAX_FETCH_BLOCKS], len(want)))

        def read(want: list[bytes], left: int) -> None:
            start = self.loop.now
            clock = _ReadClock(start, [self._block_read_s(t or DISK) for t in self.store.lookup(want)])
            self._clock_now = clock
            try:
                result = self.store.read(want, deadline)
            finally:
                self._clock_now = lambda: self.loop.now
            n = len(result.hashes)
            read_s = sum(self._block_read_s(t) for t in result.tiers)
            wire_s = self.costs.transfer_s(n * self.real_block_nbytes, transport)

            def arrived() -> None:
                got.extend(result.hashes)
                tiers.extend(result.tiers)
                if n == 0 or n < min(left, m.MAX_FETCH_BLOCKS) or len(got) == len(hashes) or self.loop.now >= deadline:
                    reply(got, tiers)
                else:
                    ask()

            self.loop.after(read_s + wire_s, arrived)

        ask()

    def prefetch(self, hashes: list[bytes]) -> None:
        """services/kvcache._on_prefetch: the leading run's disk-held blocks into host."""
        hashes = hashes[: m.MAX_FETCH_BLOCKS]

        def arrive() -> None:
            tiers = self.store.lookup(hashes)
            run = next((i for i, t in enumerate(tiers) if not t), len(tiers))
            if DISK not in tiers[:run]:
                return
            if self.prefetches_in_flight >= MAX_PREFETCHES_IN_FLIGHT:
                self.prefetches_dropped += 1
                return
            self.prefetches_in_flight += 1
            cost = sum(self._block_read_s(t) for t in tiers[:run])

            def done() -> None:
                self.prefetches_in_flight -= 1
                self.store.read(hashes[:run], self.loop.now + PREFETCH_DEADLINE_S)

            self.loop.after(cost, done)

        self.loop.after(self.costs.hop.seconds(), arrive)

    def store_blocks(self, worker: str, hashes: list[bytes], transport: str, acked: Callable[[], None]) -> None:
        nbytes = len(hashes) * self.real_block_nbytes
        arrive_s = self.costs.transfer_s(nbytes, transport)

        def arrive() -> None:
            self.store.write(hashes, [self._payload] * len(hashes))
            self._kick_flush()
            self.loop.after(self.costs.host.write.seconds(nbytes) + self.costs.hop.seconds(), acked)

        self.loop.after(arrive_s, arrive)

    def _kick_flush(self) -> None:
        if not self._flushing and self.store.disk is not None and self.store.pending_writes():
            self._flushing = True
            self.loop.after(self.costs.disk.write.seconds(self.real_block_nbytes), self._flush_one)

    def _flush_one(self) -> None:
        self.store.flush(1)
        self._flushing = False
        self._kick_flush()
