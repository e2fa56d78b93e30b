"""Numbered KV events, publisher side: what a worker (its device tier) or a cache daemon (host and disk
tiers) tells the router's prefix index.

Every KvEvents message of one publisher incarnation gets the next `seq` (0, 1, 2, ...), whatever its
tier, so the router can tell a lost message from a quiet publisher and ask for a snapshot (KvResync).
A snapshot may be larger than one message may carry: it is split into a first part with
`snapshot=True` (replacing the router's set for that tier) and further parts that only add.
"""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer.protocol.messages import KvEvents

SNAPSHOT_CHUNK = 50_000  # hashes per message: ~1.7 MB of msgpack, far inside the payload bound


class KvEventPublisher:
    def __init__(self, publisher: str, incarnation: str) -> None:
        self.publisher = publisher
        self.incarnation = incarnation
        self.seq = 0

    def _next(self, tier: str, stored: list[bytes], evicted: list[bytes], snapshot: bool) -> KvEvents:
        msg = KvEvents(self.publisher, self.incarnation, self.seq, tier, stored, evicted, snapshot)
        self.seq += 1
        return msg

    def changes(self, tier: str, stored: Sequence[bytes], evicted: Sequence[bytes]) -> list[KvEvents]:
        """Messages for blocks that entered and left `tier` (none when nothing changed)."""
        out = []
        stored, evicted = list(stored), list(evicted)
        while stored or evicted:
            out.append(self._next(tier, stored[:SNAPSHOT_CHUNK], evicted[:SNAPSHOT_CHUNK], False))
            stored, evicted = stored[SNAPSHOT_CHUNK:], evicted[SNAPSHOT_CHUNK:]
        return out

    def snapshot(self, tier: str, hashes: Sequence[bytes]) -> list[KvEvents]:
        """Everything `tier` holds now: the first message replaces the router's view, the rest add to it."""
        hashes = list(hashes)
        out = [self._next(tier, hashes[:SNAPSHOT_CHUNK], [], True)]
        for i in range(SNAPSHOT_CHUNK, len(hashes), SNAPSHOT_CHUNK):
            out.append(self._next(tier, hashes[i:i + SNAPSHOT_CHUNK], [], False))
        return out
