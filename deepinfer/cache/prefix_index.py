"""The router's prefix index: which publisher holds which KV blocks, in which tier, from numbered KV events.

Pure: no sockets, no clock reads (callers pass `now`).

A publisher is a worker (its "device" tier) or a cache daemon ("host" and "disk"). It numbers its KvEvents
0, 1, 2, ... within one incarnation across all its tiers (DESIGN §4; `services.kv_events`). The index keeps
one set of block hashes per (publisher, tier) and follows each publisher's stream:

* the next seq in order is applied: `stored` is added, then `evicted` removed (a hash in both lists of one
  message ends absent — a predicted miss is the safe side); `snapshot=True` replaces the tier's set;
* an older seq, or any seq of an incarnation it has since replaced, is stale and ignored;
* a gap, a new incarnation that does not start at seq 0, or a first message (for a publisher the index has
  no stream for) that is not seq 0, breaks the stream: the publisher's sets are emptied and the caller is
  asked to send it a KvResync; the publisher answers with a snapshot per tier;
* a new incarnation starting at seq 0 is a fresh stream (a restarted publisher announces itself that
  way): its old sets are dropped and nothing is asked.

Invariant: a set never holds a hash the publisher does not hold, up to the messages still in flight —
after a break the sets restart empty and only in-order messages and snapshots fill them, so the index may
predict a miss that would have hit, never the other way round (short of a publisher evicting between
sending an event and the router reading it).

Memory: a set member is a 32-byte `bytes` plus the set's slot, ~100 bytes per (block, holder); a hash held
by several publishers is stored in each of their sets.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Protocol


class KvEvents(Protocol):
    """One numbered batch of a publisher's KV events, as the index reads it. The wire's
    `deepinfer.protocol.messages.KvEvents` is one; the cache layer knows no wire record."""

    publisher: str
    incarnation: str
    seq: int
    tier: str
    stored: Sequence[bytes]
    evicted: Sequence[bytes]
    snapshot: bool


DEVICE, HOST, DISK = "device", "host", "disk"
TIERS = (DEVICE, HOST, DISK)  # fastest first
DAEMON_TIERS = (HOST, DISK)
RETIRED_INCARNATIONS = 4  # replaced incarnations remembered per publisher, to drop their late messages


@dataclass(frozen=True)
class Applied:
    """What one KvEvents message did to the index."""

    stale: bool = False  # ignored: a duplicate, reordered, or from a replaced incarnation
    resync: str | None = None  # the stream broke (sets emptied): why the publisher must send snapshots


@dataclass(eq=False)
class _Stream:
    incarnation: str
    next_seq: int
    resync_asked_at: float | None = None  # a resync was sent and no snapshot has come since


@dataclass(eq=False)
class _Publisher:
    stream: _Stream | None = None
    retired: deque[str] = field(default_factory=lambda: deque(maxlen=RETIRED_INCARNATIONS))
    tiers: dict[str, set[bytes]] = field(default_factory=dict)


class PrefixIndex:
    """Sets of block hashes by (publisher, tier), kept from each publisher's numbered events.

    `resync_interval_s`: while a resync is unanswered, further breaks of the same stream empty its sets
    again but ask again only after this long (the pending snapshot will replace every tier anyway; a lost
    KvResync is asked for again)."""

    def __init__(self, resync_interval_s: float = 5.0) -> None:
        self.resync_interval_s = resync_interval_s
        self._pubs: dict[str, _Publisher] = {}

    # ----- updates -----

    def apply(self, ev: KvEvents, now: float) -> Applied:
        pub = self._pubs.setdefault(ev.publisher, _Publisher())
        s = pub.stream
        if ev.incarnation in pub.retired or (s is not None and s.incarnation == ev.incarnation and ev.seq < s.next_seq):
            return Applied(stale=True)
        broken: str | None = None
        if s is None:
            if ev.seq != 0:
                broken = f"the router has no state for you and your events start at seq {ev.seq}"
            s = pub.stream = _Stream(ev.incarnation, ev.seq)
        elif s.incarnation != ev.incarnation:
            pub.retired.append(s.incarnation)
            if ev.seq != 0:
                broken = f"new incarnation {ev.incarnation} starts at seq {ev.seq}"
            pub.tiers.clear()
            s = pub.stream = _Stream(ev.incarnation, ev.seq)
        elif ev.seq > s.next_seq:
            broken = f"events {s.next_seq}..{ev.seq - 1} were lost"
        resync = None
        if broken is not None:
            pub.tiers.clear()
            if s.resync_asked_at is None or now - s.resync_asked_at >= self.resync_interval_s:
                s.resync_asked_at, resync = now, broken
        s.next_seq = ev.seq + 1
        self._apply_sets(pub, ev)
        if ev.snapshot and broken is None:  # the answer to a resync has begun: a new break may ask at once
            s.resync_asked_at = None
        return Applied(resync=resync)

    @staticmethod
    def _apply_sets(pub: _Publisher, ev: KvEvents) -> None:
        # Once the stream is in order again, applying a message to an emptied set only adds hashes the
        # publisher really stored: the invariant holds without waiting for the snapshot.
        if ev.tier not in TIERS:
            return  # a tier this router does not place by: the seq still counts
        if ev.snapshot:
            pub.tiers[ev.tier] = set(ev.stored)
            return
        held = pub.tiers.setdefault(ev.tier, set())
        held.update(ev.stored)
        held.difference_update(ev.evicted)

    def forget(self, publisher: str, unless_incarnation: str | None = None) -> bool:
        """Drop what a publisher holds (it died or restarted), unless the index already follows
        `unless_incarnation` — a restarted publisher's fresh stream may arrive before the router learns
        of the restart from a heartbeat. Its next message starts a stream only at seq 0 (or asks for a
        resync). Returns whether anything was dropped."""
        pub = self._pubs.get(publisher)
        if pub is None or (pub.stream is not None and pub.stream.incarnation == unless_incarnation):
            return False
        pub.stream = None
        pub.tiers.clear()
        return True

    # ----- queries -----

    def holds(self, publisher: str, tier: str) -> AbstractSet[bytes]:
        pub = self._pubs.get(publisher)
        return pub.tiers.get(tier, frozenset()) if pub is not None else frozenset()

    def size(self, publisher: str | None = None) -> int:
        """Hashes held, over every tier, of one publisher or of all."""
        pubs = self._pubs.values() if publisher is None else [self._pubs.get(publisher) or _Publisher()]
        return sum(len(s) for p in pubs for s in p.tiers.values())

    def blocks_by_tier(self, publisher: str) -> dict[str, int]:
        """How many block hashes one publisher holds, by tier (its empty tiers left out)."""
        pub = self._pubs.get(publisher)
        return {} if pub is None else {tier: len(s) for tier, s in sorted(pub.tiers.items()) if s}

    def publishers(self) -> list[str]:
        return sorted(name for name, p in self._pubs.items() if p.stream is not None)

    def longest_prefix(self, hashes: Sequence[bytes], publisher: str, tier: str, start: int = 0) -> int:
        """How many of hashes[start:] lead the chain in one publisher's tier."""
        return _run(hashes, start, self.holds(publisher, tier))

    def cached_by_tier(self, hashes: Sequence[bytes], device: str | None, daemon: str | None,
                       computing: Container[bytes] = ()) -> dict[str, int]:
        """Blocks of the chain a worker would find cached, by tier, as it looks them up: the leading run in
        its own device pool (`device`: the worker's name) or being computed there (`computing`: it will be in
        that pool by the time a request placed now gets to it), then, from there on, the run its cache
        daemon holds in host DRAM or on disk; a daemon block in both counts as "host" (the fastest)."""
        out = dict.fromkeys(TIERS, 0)
        n = 0
        if device is not None:
            pool = self.holds(device, DEVICE)
            for h in hashes:
                if h not in pool and h not in computing:
                    break
                n += 1
        out[DEVICE] = n
        if daemon is None:
            return out
        host, disk = self.holds(daemon, HOST), self.holds(daemon, DISK)
        for h in hashes[n:]:
            if h in host:
                out[HOST] += 1
            elif h in disk:
                out[DISK] += 1
            else:
                break
        return out


def _run(hashes: Sequence[bytes], start: int, held: AbstractSet[bytes]) -> int:
    n = 0
    for h in hashes[start:]:
        if h not in held:
            break
        n += 1
    return n
