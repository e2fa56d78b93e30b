"""One budget for a pool directory that several cache daemons write (`cache.pool_share`): each daemon shrinks itself
in proportion when the live daemons' sum passes the budget, a daemon that stopped stops counting after `stale_s` of
the reader's own clock, and an eviction by one daemon is a plain miss for another that had adopted the block. Real
files on one root stand in for the shared mount."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer.cache.pool_share import NOTES_DIR, PoolShare
from deepinfer.cache.store import TieredStore
from tests.unit.test_disk_shared_pool import FILE, NS_ID, N, h, payload_for, put


def test_each_daemon_shrinks_in_proportion_once_the_live_sum_passes_the_budget(tmp_path: Path) -> None:
    a, b = PoolShare(tmp_path, "kvcache-a", 100), PoolShare(tmp_path, "kvcache-b", 100)
    assert a.target(60, now=0.0) is None  # alone: 60 of 100
    assert b.target(30, now=0.0) is None  # 90: under the high watermark (95)
    assert b.target(60, now=1.0) == int(60 * 0.9 * 100 / 120)  # 120: each to 0.9 x 100 x its part of the sum
    assert a.target(60, now=1.0) == 45
    assert (a.shrinks, b.shrinks) == (1, 1)
    assert sorted(p.name for p in (tmp_path / NOTES_DIR).iterdir()) == ["kvcache-a", "kvcache-b"]


def test_a_daemon_that_stopped_writing_its_note_stops_counting_by_the_readers_clock(tmp_path: Path) -> None:
    a, b = PoolShare(tmp_path, "kvcache-a", 100, stale_s=10.0), PoolShare(tmp_path, "kvcache-b", 100)
    b.target(80, now=0.0)
    assert a.target(50, now=100.0) is not None  # b's note is new to a: it counts
    assert a.target(50, now=109.0) is not None
    assert a.target(50, now=111.0) is None  # unchanged for more than 10 s of a's clock: b stopped
    b.target(80, now=0.0)  # b is back (its counter moved)
    assert a.target(50, now=112.0) is not None
    (tmp_path / NOTES_DIR / "junk").write_text("not a note")  # unreadable notes are skipped
    assert a.target(50, now=113.0) is not None


def test_names_that_cannot_be_note_files_and_empty_budgets_are_refused(tmp_path: Path) -> None:
    for name, budget in (("a/b", 1), (".hidden", 1), ("kvcache-a", 0)):
        with pytest.raises(ValueError):
            PoolShare(tmp_path, name, budget)


def store(root: Path, blocks: int) -> TieredStore:
    s = TieredStore(NS_ID, N, 0, root, blocks * FILE)
    s.open()
    return s


def test_two_daemons_on_one_pool_keep_its_sum_within_the_budget_and_an_eviction_is_a_miss_elsewhere(
        tmp_path: Path) -> None:
    """Each daemon may hold 100 blocks alone; the pool's budget is 100 in all. Both write 80: a round each brings
    the sum under the budget, each evicting its own oldest. A block b adopted from a's files and a then evicted
    is a miss for b, never an error or a quarantine."""
    a, b = store(tmp_path, 100), store(tmp_path, 100)
    assert a.disk is not None and b.disk is not None
    share_a = PoolShare(a.disk.dir, "kvcache-a", 100 * FILE)
    share_b = PoolShare(b.disk.dir, "kvcache-b", 100 * FILE)
    put(a.disk, *range(80))
    put(b.disk, *range(1000, 1080))
    assert b.disk.get(h(0)).payload is not None  # b reads a's oldest block through: adopted into b's index
    assert a.balance_pool(share_a) == 0  # b's note not written yet: a sees only itself
    evicted_b = b.balance_pool(share_b)
    evicted_a = a.balance_pool(share_a)
    assert evicted_a > 0 and evicted_b > 0
    assert a.disk.used_bytes + b.disk.used_bytes <= 0.95 * 100 * FILE
    assert not a.disk.contains(h(0)) and a.disk.contains(h(79))  # oldest use first
    got = b.disk.get(h(0))
    assert got.payload is None  # a deleted the file b had adopted: a miss
    stats = b.stats()
    assert not any(v for k, v in stats.items() if k.startswith("disk_quarantined")), stats
    assert a.stats()["pool_evicted"] == evicted_a
    assert b.disk.get(h(1079)).payload == payload_for(h(1079))
    a.close()
    b.close()


def test_a_pool_that_cannot_be_written_skips_the_round(tmp_path: Path) -> None:
    s = store(tmp_path / "pool", 10)
    assert s.disk is not None
    (s.disk.dir / NOTES_DIR).write_text("a file where the notes' directory should be")
    assert s.balance_pool(PoolShare(s.disk.dir, "kvcache-a", FILE)) == 0
    assert s.stats()["pool_rounds_failed"] == 1
    s.close()
