"""The block pool's prefix-cache side: names, lookups, LRU eviction of free named blocks, origins,
integrity checks and the exactness of the add/evict events a router's prefix index is built from."""

from __future__ import annotations

import random

import pytest

from deepinfer.cache.block_pool import BlockPool


def h(i: int) -> bytes:
    return i.to_bytes(2, "little") * 16


def named_pool(num_blocks: int, names: dict[int, int]) -> BlockPool:
    """A pool whose blocks `names` (block id -> hash index) are named, all blocks free again, freed in
    ascending block order."""
    pool = BlockPool(num_blocks)
    held = pool.allocate(num_blocks)
    for b, i in names.items():
        assert pool.register(b, h(i))
    pool.free(held)
    pool.drain_events()
    return pool


def test_lookup_returns_the_longest_cached_prefix():
    pool = BlockPool(8)
    a, b, c = pool.allocate(3)
    assert pool.register(a, h(1)) and pool.register(b, h(2)) and pool.register(c, h(4))
    assert pool.lookup([h(1), h(2), h(3), h(4)]) == [a, b]  # h(3) missing: h(4) after it does not count
    assert pool.lookup([h(2), h(1)]) == [b, a]
    assert pool.lookup([h(3), h(1)]) == []
    assert pool.lookup([]) == []
    assert (pool.block_of(h(4)), pool.block_of(h(3)), pool.name_of(c), pool.name_of(3)) == (c, None, h(4), None)
    assert [pool.ref_cnt(x) for x in (a, b, c)] == [1, 1, 1]  # lookup takes nothing
    pool.check_integrity()


def test_a_hash_names_one_block_and_a_block_has_one_name():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.register(a, h(1))
    assert not pool.register(b, h(1))  # the first copy stays cached; b remains a plain block
    assert pool.name_of(b) is None and pool.block_of(h(1)) == a
    assert not pool.register(a, h(2))  # a block's KV has one name
    assert pool.block_of(h(2)) is None
    pool.free([a, b])
    with pytest.raises(ValueError, match="only a held block"):
        pool.register(b, h(3))  # a free block's KV is not known to be fresh
    assert pool.num_cached == 1
    pool.check_integrity()


def test_freed_named_blocks_stay_cached_and_are_evicted_in_lru_order():
    pool = named_pool(4, {0: 10, 1: 11, 2: 12})
    assert pool.num_free == 4 and pool.num_cached == 3
    assert pool.lookup([h(10), h(11), h(12)]) == [0, 1, 2]
    assert pool.allocate(1) == [0]  # the head of the free queue: its name goes with it
    assert pool.lookup([h(10)]) == [] and pool.lookup([h(11)]) == [1]
    assert pool.drain_events() == ([], [h(10)])
    assert pool.allocate(2) == [1, 2]
    assert pool.cached_hashes() == []
    assert pool.drain_events() == ([], [h(11), h(12)])
    assert pool.allocate(1) == [3]  # never named: no event
    assert pool.drain_events() == ([], [])
    pool.check_integrity()


def test_acquire_pulls_a_free_named_block_out_of_the_queue_keeping_its_name():
    pool = named_pool(4, {0: 10, 1: 11, 2: 12, 3: 13})
    pool.acquire([2])  # a hit on a block in the middle of the free queue
    assert pool.ref_cnt(2) == 1 and pool.num_free == 3 and pool.name_of(2) == h(12)
    pool.acquire([2])  # a second holder of a held block
    assert pool.ref_cnt(2) == 2
    assert pool.allocate(3) == [0, 1, 3]  # the held block is never evicted
    assert pool.cached_hashes() == [h(12)]
    pool.free([2, 2])
    pool.free([3, 1, 0])
    # Free order is the eviction order: 2 (freed first) goes first.
    assert pool.allocate(4) == [2, 3, 1, 0]
    pool.check_integrity()


def test_freeing_after_a_hit_moves_the_block_to_the_most_recently_used_end():
    pool = named_pool(3, {0: 10, 1: 11, 2: 12})
    pool.acquire([0])
    pool.free([0])
    assert pool.allocate(2) == [1, 2] and pool.lookup([h(10)]) == [0]
    pool.check_integrity()


def test_origin_tier_belongs_to_a_named_block_and_goes_with_its_name():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    assert pool.register(a, h(1))
    pool.set_origin(a, "host")
    with pytest.raises(ValueError, match="no name"):
        pool.set_origin(b, "disk")
    assert (pool.origin(a), pool.origin(b)) == ("host", None)
    pool.clear_origin(a)
    assert pool.origin(a) is None
    pool.set_origin(a, "disk")
    pool.free([b, a])
    assert pool.allocate(3) == [2, 1, 0]  # a is evicted last; its origin leaves with its name
    assert pool.origin(a) is None
    pool.check_integrity()


def test_integrity_check_catches_a_broken_hash_map():
    pool = named_pool(3, {0: 1, 1: 2})
    pool.check_integrity()
    pool._name[1] = h(9)  # simulate a bug: the block's name and the map disagree
    with pytest.raises(AssertionError, match="named otherwise"):
        pool.check_integrity()
    pool._name[1] = h(2)
    pool._name[2] = h(3)  # a name the map does not know
    with pytest.raises(AssertionError, match="hash map entries"):
        pool.check_integrity()
    pool._name[2] = None
    pool._origin[2] = "host"
    with pytest.raises(AssertionError, match="origin tier but no name"):
        pool.check_integrity()


def test_events_register_then_evict_within_a_window_cancel_out():
    pool = BlockPool(2)
    [a] = pool.allocate(1)
    pool.register(a, h(1))
    pool.free([a])
    pool.allocate(2)  # evicts h(1) before anyone drained its registration
    assert pool.drain_events() == ([], [])
    assert pool.cached_hashes() == []


def test_events_evict_then_register_again_within_a_window_cancel_out():
    pool = BlockPool(2)
    [a] = pool.allocate(1)
    pool.register(a, h(1))
    assert pool.drain_events() == ([h(1)], [])
    pool.free([a])
    [x, y] = pool.allocate(2)  # h(1) evicted ...
    assert pool.register(y, h(1))  # ... and cached again, in another block
    assert pool.drain_events() == ([], [])
    assert pool.cached_hashes() == [h(1)] and pool.block_of(h(1)) == y
    pool.free([x, y])
    pool.allocate(1)  # x: unnamed, nothing to report
    assert pool.drain_events() == ([], [])
    pool.allocate(1)
    assert pool.drain_events() == ([], [h(1)])


def test_events_applied_to_a_snapshot_always_give_the_cached_set():
    """A router's index: a snapshot, then only drained events. After any sequence of allocations,
    hits, names and frees it equals the pool's set, applying stored and evicted in either order."""
    rng = random.Random(5)
    pool = BlockPool(10)
    index = set(pool.cached_hashes())
    held: list[int] = []
    for step in range(3000):
        roll = rng.random()
        if roll < 0.3 and pool.num_free:
            held += pool.allocate(rng.randint(1, min(3, pool.num_free)))
        elif roll < 0.5 and held:
            b = rng.choice(held)
            pool.register(b, h(rng.randrange(30)))  # may refuse: a hash or block already named
        elif roll < 0.6:
            hit = pool.lookup([h(rng.randrange(30))])
            pool.acquire(hit)
            held += hit
        elif held:
            pool.free([held.pop(rng.randrange(len(held)))])
        if rng.random() < 0.2:
            stored, evicted = pool.drain_events()
            assert not set(stored) & set(evicted)
            assert not set(stored) & index and set(evicted) <= index
            index = (index - set(evicted)) | set(stored)
            assert index == set(pool.cached_hashes()), step
        pool.check_integrity()


def test_forget_free_unnames_only_free_blocks_and_reports_them():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    ha, hb = bytes([1]) * 32, bytes([2]) * 32
    pool.register(a, ha)
    pool.register(b, hb)
    pool.drain_events()
    pool.free([a])
    assert pool.forget_free() == 1
    assert pool.block_of(ha) is None and pool.block_of(hb) == b  # b is held: its name stays
    assert pool.drain_events() == ([], [ha])
    pool.check_integrity()
