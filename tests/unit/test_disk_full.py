"""The disk tier and the store on a really full disk: a size-limited tmpfs, where the kernel answers ENOSPC.
Writes fail and are counted, never raised; nothing half-written is left; what is held keeps being served."""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from deepinfer.cache import block_file as bf
from deepinfer.cache import disk_tier as dt
from deepinfer.cache.disk_tier import DiskTier
from deepinfer.cache.store import HOST, TieredStore
from tests.small_fs import small_tmpfs

NS_ID = hashlib.sha256(b"full disk namespace").hexdigest()
N = 64 << 10  # payload bytes per block: about 15 block files fit in 1 MiB
FILE = bf.HEADER_BYTES + N
FS_BYTES = 1 << 20


def h(i: int) -> bytes:
    return hashlib.sha256(b"full disk block %d" % i).digest()


def payload_for(block_hash: bytes) -> bytes:
    return hashlib.shake_256(block_hash).digest(N)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "mnt", FS_BYTES) as root:
        yield root


def leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith(dt.TEMP_SUFFIX)]


def check_files_match_index(tier: DiskTier) -> None:
    """Every file under a final name is whole and valid, and is exactly what the index holds."""
    files = {bytes.fromhex(p.stem): p for p in tier.dir.rglob("*.kvb")}
    assert set(files) == set(tier.hashes())
    for block_hash, path in files.items():
        assert bytes(bf.verify(path.read_bytes(), NS_ID, block_hash, N)) == payload_for(block_hash)


def test_a_full_disk_drops_writes_and_keeps_serving(small_disk: Path) -> None:
    tier = DiskTier(small_disk, NS_ID, N, 1000 * FILE)  # the capacity says "plenty": only the disk says no
    tier.open()
    results = [tier.put(h(i), payload_for(h(i))) for i in range(40)]  # never raises
    full = [r for r in results if r.reason == dt.DISK_FULL]
    assert full, "a 1 MiB filesystem cannot take 40 blocks of 64 KiB"
    assert all(r.stored or r.reason == dt.DISK_FULL for r in results)
    stats = tier.stats()
    assert stats["write_errors_no_space"] == len(full) and stats["write_errors"] == len(full)
    assert stats["evictions"] >= 1  # each full write gave some room back...
    assert results[-1].stored or results[-2].stored  # ... so writes keep landing
    assert leftovers(small_disk) == []  # no half-written temp file survives a failed write
    check_files_match_index(tier)
    for block_hash in tier.hashes():
        got = tier.get(block_hash)
        assert got.payload is not None and bytes(got.payload) == payload_for(block_hash)


def test_a_disk_filled_by_someone_else(small_disk: Path) -> None:
    tier = DiskTier(small_disk, NS_ID, N, 1000 * FILE)
    tier.open()
    for i in range(4):
        assert tier.put(h(i), payload_for(h(i))).stored
    filler = small_disk / "another tenant"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:  # fill every byte that is left
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    results = [tier.put(h(i), payload_for(h(i))) for i in range(4, 10)]
    assert results[0].reason == dt.DISK_FULL
    # Only its own blocks are evicted to make room; the other tenant's file is not the tier's to touch.
    assert filler.exists() and leftovers(small_disk) == []
    check_files_match_index(tier)
    filler.unlink()  # the other tenant frees its space: writes land again
    assert tier.put(h(20), payload_for(h(20))).stored
    check_files_match_index(tier)


def test_the_store_serves_every_block_from_host_while_the_disk_is_full(small_disk: Path) -> None:
    store = TieredStore(NS_ID, N, 100 * N, small_disk, 1000 * FILE)
    store.open()
    hashes = [h(i) for i in range(30)]
    assert store.write(hashes, [payload_for(x) for x in hashes]) == (30, 0)
    written = store.flush()  # never raises
    stats = store.stats()
    assert 0 < written < 30 and stats["disk_write_errors_no_space"] >= 1
    assert store.lookup(hashes) == [HOST] * 30
    result = store.read(hashes)
    assert result.reason == "" and result.hashes == hashes
    assert all(bytes(p) == payload_for(x) for x, p in zip(result.hashes, result.payloads))
    assert leftovers(small_disk) == []


def test_a_disk_too_full_to_open_leaves_the_store_host_only(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "mnt", FS_BYTES, max_inodes=1) as root:  # not even a directory fits
        store = TieredStore(NS_ID, N, 10 * N, root / "kv", 1000 * FILE)
        store.open()  # never raises
        assert store.disk is None and "No space left" in store.disk_error
        assert store.write([h(1)], [payload_for(h(1))]) == (1, 0) and store.flush() == 0
        assert store.read([h(1)]).hashes == [h(1)] and store.tiers == [HOST]
