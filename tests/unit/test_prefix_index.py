"""PrefixIndex: following publishers' numbered KV event streams (in order, gaps, snapshots, restarts) and
answering which leading blocks of a chain a worker would find on its device or at its cache daemon."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deepinfer.cache.hashing import CacheNamespace, HashKeys, hash_blocks
from deepinfer.cache.prefix_index import PrefixIndex
from deepinfer.protocol.messages import KvEvents

NS = CacheNamespace("model", "tok", "float32", "layers,kv,block_size,kv_heads,head_dim", block_size=4)
CHAIN = hash_blocks(NS, list(range(40)), HashKeys("tenant"))  # 10 chained blocks
A, B, C, D, E, F = CHAIN[:6]


class Publisher:
    """Numbers its messages like a real publisher: one seq per message, across its tiers."""

    def __init__(self, index: PrefixIndex, name: str, incarnation: str = "inc0") -> None:
        self.index, self.name, self.incarnation, self.seq = index, name, incarnation, 0
        self.now = 0.0

    def send(self, tier: str, stored: Sequence[bytes] = (), evicted: Sequence[bytes] = (), snapshot: bool = False,
             seq: int | None = None, **kw: Any) -> Any:
        seq = self.seq if seq is None else seq
        self.seq = seq + 1
        ev = KvEvents(self.name, kw.get("incarnation", self.incarnation), seq, tier, list(stored), list(evicted),
                      snapshot)
        return self.index.apply(ev, self.now)


def test_in_order_events_build_the_sets() -> None:
    index = PrefixIndex()
    w = Publisher(index, "w0")
    assert w.send("device", [A, B, C]).resync is None
    assert w.send("device", evicted=[C]).resync is None
    assert index.holds("w0", "device") == {A, B}
    assert index.longest_prefix(CHAIN, "w0", "device") == 2
    assert index.longest_prefix(CHAIN, "w0", "host") == 0
    assert index.longest_prefix(CHAIN, "nobody", "device") == 0
    assert index.publishers() == ["w0"] and index.size("w0") == 2


def test_duplicates_are_harmless_and_replayed_seqs_are_stale() -> None:
    index = PrefixIndex()
    w = Publisher(index, "w0")
    w.send("device", [A, A, B])
    w.send("device", [A, B])  # storing a block already known changes nothing
    assert index.holds("w0", "device") == {A, B}
    stale = w.send("device", evicted=[A, B], seq=1)  # a replay of seq 1
    assert stale.stale and index.holds("w0", "device") == {A, B}


def test_evicted_then_stored_again_is_present_and_both_in_one_message_is_absent() -> None:
    index = PrefixIndex()
    w = Publisher(index, "w0")
    w.send("device", [A, B])
    w.send("device", evicted=[B])
    w.send("device", [B])
    assert index.longest_prefix(CHAIN, "w0", "device") == 2
    w.send("device", [C], evicted=[C])  # order inside one message is unknown: predict the miss
    assert C not in index.holds("w0", "device")


def test_snapshot_replaces_one_tier_only() -> None:
    index = PrefixIndex()
    d = Publisher(index, "kv0")
    d.send("host", [A, B])
    d.send("disk", [C, D])
    d.send("host", [E], snapshot=True)
    assert index.holds("kv0", "host") == {E} and index.holds("kv0", "disk") == {C, D}


def test_gap_empties_the_publisher_asks_once_and_a_snapshot_restores_it() -> None:
    index = PrefixIndex(resync_interval_s=5.0)
    d = Publisher(index, "kv0")
    d.send("host", [A, B])
    d.send("disk", [C])
    lost = d.send("host", [D], seq=5)  # 2..4 never arrived
    assert lost.resync is not None and "2..4" in lost.resync
    # Only what came in order since the break is known (D): the rest may have been evicted meanwhile.
    assert index.holds("kv0", "host") == {D} and index.holds("kv0", "disk") == set()
    assert d.send("host", [E]).resync is None
    again = d.send("host", [F], seq=9)  # another gap before the snapshot came: no second request yet
    assert again.resync is None and index.holds("kv0", "host") == {F}
    d.now = 5.0
    assert d.send("host", [A], seq=12).resync is not None  # the first KvResync may be lost: ask again
    # The snapshots (seq goes on) replace each tier.
    assert d.send("host", [A, B], snapshot=True).resync is None
    assert d.send("disk", [C], snapshot=True).resync is None
    assert index.longest_prefix(CHAIN, "kv0", "host") == 2 and index.holds("kv0", "disk") == {C}
    d.now = 5.5
    assert d.send("host", seq=20).resync is not None  # snapshot came: a new break asks at once


def test_first_message_past_seq_0_asks_for_a_resync() -> None:
    index = PrefixIndex()
    w = Publisher(index, "w0")
    assert "seq 7" in w.send("device", [A], seq=7).resync
    assert index.holds("w0", "device") == {A}  # a message in hand is still true
    assert w.send("device", [B]).resync is None  # seq 8 follows


def test_new_incarnation_at_seq_0_is_a_fresh_stream() -> None:
    index = PrefixIndex()
    w = Publisher(index, "w0")
    w.send("device", [A, B, C])
    w.incarnation, w.seq = "inc1", 0
    fresh = w.send("device", [D])
    assert fresh.resync is None and not fresh.stale
    assert index.holds("w0", "device") == {D}  # the old process's blocks are gone with it
    # The old incarnation's late messages are stale.
    assert w.send("device", [A], seq=3, incarnation="inc0").stale
    assert index.holds("w0", "device") == {D}


def test_new_incarnation_past_seq_0_asks_for_a_resync() -> None:
    index = PrefixIndex()
    w = Publisher(index, "w0")
    w.send("device", [A])
    w.incarnation = "inc1"
    assert "new incarnation" in w.send("device", [B], seq=4).resync
    assert index.holds("w0", "device") == {B}


def test_unknown_tier_counts_in_the_sequence_but_is_not_kept() -> None:
    index = PrefixIndex()
    w = Publisher(index, "w0")
    w.send("gpu-hbm", [A])
    assert w.send("device", [A]).resync is None
    assert index.size("w0") == 1


def test_forget_drops_sets_and_stream_unless_it_already_follows_the_new_incarnation() -> None:
    index = PrefixIndex()
    w = Publisher(index, "w0")
    w.send("device", [A])
    assert index.forget("w0")
    assert index.size() == 0 and index.publishers() == []
    assert w.send("device", [B]).resync is not None  # seq 1 with no stream: its state was lost
    # A restart seen by the router after the new process's fresh stream began: nothing to drop.
    w.incarnation, w.seq = "inc1", 0
    w.send("device", [C], snapshot=True)
    assert not index.forget("w0", unless_incarnation="inc1")
    assert index.holds("w0", "device") == {C}
    assert index.forget("w0", unless_incarnation="inc2")
    assert not index.forget("never-seen")


def test_cached_by_tier_follows_device_then_daemon_host_then_disk() -> None:
    index = PrefixIndex()
    w, d = Publisher(index, "w0"), Publisher(index, "kv0")
    w.send("device", [A, B, D])  # D is on the device but after a device miss (C)
    d.send("host", [A, C, E])
    d.send("disk", [C, D, F])
    # Device run A,B; then the daemon: C (host and disk: counts as host), D (disk), E (host), F (disk).
    assert index.cached_by_tier(CHAIN, "w0", "kv0") == {"device": 2, "host": 2, "disk": 2}
    assert index.cached_by_tier(CHAIN, "w0", None) == {"device": 2, "host": 0, "disk": 0}
    assert index.cached_by_tier(CHAIN, None, "kv0") == {"device": 0, "host": 1, "disk": 0}
    assert index.cached_by_tier(CHAIN, "other", "kv0") == {"device": 0, "host": 1, "disk": 0}
    assert index.cached_by_tier([], "w0", "kv0") == {"device": 0, "host": 0, "disk": 0}


def test_a_tenants_chain_never_matches_anothers() -> None:
    index = PrefixIndex()
    Publisher(index, "w0").send("device", CHAIN)
    other = hash_blocks(NS, list(range(40)), HashKeys("other-tenant"))
    assert index.longest_prefix(other, "w0", "device") == 0
    assert index.longest_prefix(CHAIN, "w0", "device") == len(CHAIN) == 10
