"""The host-DRAM tier: byte capacity, LRU eviction, pins, refusals, and the change log."""

from __future__ import annotations

import threading

from deepinfer.cache.host_tier import HostTier

N = 100  # bytes per block in these tests


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def block(i: int) -> bytes:
    return bytes([i % 256]) * N


def filled(n: int, capacity_blocks: int) -> HostTier:
    tier = HostTier(capacity_blocks * N)
    for i in range(n):
        assert tier.put(h(i), block(i)).stored
    return tier


def test_put_get_contains() -> None:
    tier = filled(3, 10)
    assert tier.get(h(1)) == block(1) and tier.contains(h(2)) and not tier.contains(h(7))
    assert tier.get(h(7)) is None
    assert len(tier) == 3 and tier.used_bytes == 3 * N
    again = tier.put(h(1), block(1))
    assert not again.stored and again.evicted == [] and tier.used_bytes == 3 * N
    assert tier.stats()["hits"] == 1 and tier.stats()["misses"] == 1


def test_evicts_least_recently_used_first() -> None:
    tier = filled(4, 4)
    tier.get(h(0))  # a use
    tier.touch(h(1))  # also a use
    result = tier.put(h(4), block(4))
    assert result.stored and result.evicted == [h(2)]
    assert tier.put(h(5), block(5)).evicted == [h(3)]
    assert tier.hashes() == [h(0), h(1), h(4), h(5)]
    assert tier.used_bytes <= tier.capacity_bytes


def test_evicts_as_many_as_needed_for_a_bigger_block() -> None:
    tier = filled(4, 4)
    result = tier.put(h(9), b"x" * (2 * N + 1))
    assert result.stored and result.evicted == [h(0), h(1), h(2)]
    assert tier.used_bytes == N + 2 * N + 1


def test_pinned_blocks_survive_eviction() -> None:
    tier = filled(3, 3)
    assert tier.pin(h(0)) and tier.pins(h(0)) == 1
    assert tier.put(h(3), block(3)).evicted == [h(1)]
    tier.unpin(h(0))
    assert tier.put(h(4), block(4)).evicted == [h(0)]
    assert not tier.pin(h(0))  # gone


def test_put_that_cannot_fit_is_refused_and_evicts_nothing() -> None:
    tier = filled(3, 3)
    for i in range(3):
        tier.pin(h(i))
    result = tier.put(h(3), block(3))
    assert not result.stored and result.evicted == []
    assert tier.hashes() == [h(0), h(1), h(2)] and tier.stats()["refused"] == 1
    tier.unpin(h(1))
    assert tier.put(h(3), block(3)).evicted == [h(1)]
    assert not tier.put(h(9), b"x" * (4 * N)).stored  # bigger than the whole tier


def test_zero_capacity_stores_nothing() -> None:
    tier = HostTier(0)
    assert not tier.put(h(0), block(0)).stored and len(tier) == 0


def test_unpin_is_counted_and_clamped() -> None:
    tier = filled(1, 1)
    tier.pin(h(0))
    tier.pin(h(0))
    tier.unpin(h(0))
    assert tier.pins(h(0)) == 1
    tier.unpin(h(0))
    tier.unpin(h(0))  # an extra unpin does not go negative
    assert tier.pins(h(0)) == 0
    tier.unpin(h(5))  # not held: no-op


def test_change_log_matches_contents() -> None:
    log: list[tuple[str, list[bytes]]] = []
    tier = HostTier(3 * N, on_change=lambda kind, hashes: log.append((kind, list(hashes))))
    for i in range(5):
        tier.put(h(i), block(i))
    tier.put(h(3), block(3))  # already held: no change
    assert log == [("stored", [h(0)]), ("stored", [h(1)]), ("stored", [h(2)]),
                   ("evicted", [h(0)]), ("stored", [h(3)]), ("evicted", [h(1)]), ("stored", [h(4)])]


def test_concurrent_puts_and_gets_keep_the_invariants() -> None:
    live: set[bytes] = set()
    lock = threading.Lock()

    def on_change(kind: str, hashes: list[bytes]) -> None:
        with lock:
            for x in hashes:
                if kind == "stored":
                    assert x not in live
                    live.add(x)
                else:
                    live.remove(x)

    tier = HostTier(50 * N, on_change=on_change)
    wrong: list[int] = []

    def worker(seed: int) -> None:
        for i in range(2000):
            k = (i * 7 + seed * 13) % 200
            tier.put(h(k), block(k))
            got = tier.get(h((k + 3) % 200))
            if got is not None and got != block((k + 3) % 200):
                wrong.append(k)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []
    assert live == set(tier.hashes())
    assert tier.used_bytes == len(tier) * N <= tier.capacity_bytes
