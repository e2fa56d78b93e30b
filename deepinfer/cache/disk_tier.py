"""The KV cache's disk (NVMe) tier: a directory of block files, one per KV block, with an in-memory index.

Layout under `root` (any directory or mount; a shared filesystem pools the cache across hosts):

    <root>/<namespace id>/<hash hex[:2]>/<hash hex>.kvb           one block (format: block_file.py)
    <root>/<namespace id>/<hash hex[:2]>/.<hash hex>.<writer>.tmp  a write in progress (or left by a crash)
    <root>/quarantine/<namespace id>/<hash hex>.<reason>.<n>.kvb   a file that failed verification

The disk tier is a cache: losing a block is fine, serving a wrong one is not. Hence:

* **Data before the entry that makes it visible.** A block is written to a temp file in its final
  directory, flushed and fsynced, renamed over its final name (atomic), and the directory fsynced; only then
  is the index entry added (block_io.write_atomically). A crash at any point leaves either no file, a
  stray temp file, or a complete file under its final name, never a torn one.
* **Every read verifies** the checksum, the namespace and the hash the file name says (block_file.verify).
  A file that fails is moved to quarantine, counted by reason, dropped from the index (an "evicted"
  change), and its bytes are never returned. A file that vanished is a miss.
* **Warm restart.** `open()` rebuilds the index from the files of this namespace (a header check per
  file; the full check happens on read), last use from each file's mtime (reads refresh it).
* **Capacity** counts whole files. When a write would take usage above `high_watermark` of capacity,
  least recently used unpinned blocks are deleted first, down to `low_watermark`. A write that still does
  not fit (everything pinned), hits a full disk (ENOSPC / EDQUOT: some space is freed too) or any other
  OSError is dropped and counted; `put` never raises for these.

**A shared root** (several daemons, on one host or many, and several models; helpers in pool_files.py):

* Namespaces: a daemon reads and writes only `<root>/<its namespace>/` and its quarantine. Other
  namespaces' directories are counted at open and never touched (another model may be serving from them;
  removing a retired model's directory is the operator's call).
* Writers: a temp file is named by its writer (boot, pid namespace, pid, nonce), so no two writers share
  one, and `open()` deletes only temp files whose writer is provably dead (same boot and pid namespace,
  pid gone) or that are a day old (pool_files.temp_is_abandoned). Two daemons writing the same block each
  rename a complete file over the name; the last rename wins and a reader opens one whole file or the
  other, never a mix.
* Quarantine takes a file only while the reader still holds it open and only if the name still points at
  that exact inode, so a good copy another daemon wrote meanwhile is never taken (quarantine.py).
* Sharing blocks: a daemon sees what others wrote when it opens (the scan) and, after that, on demand: a
  `get` of a block not in its index tries the file (read-through), `adopt` (a lookup's look-through, see
  TieredStore.look_through) takes a file that passes the header check, and a `put` of a block whose file
  already passes the header check adopts that file instead of writing it again. Adopted blocks join the
  index like its own.
* Capacity is per daemon: `used_bytes` counts the files in this daemon's index (written, adopted, or
  found at open), and eviction only ever deletes a file that is still the exact file (inode) it indexed;
  if another daemon replaced it meanwhile, the entry is dropped and their copy stays. So the files on a
  root are bounded by the sum of its daemons' capacities, plus what dead daemons left (the next daemon
  of that namespace to open indexes it, and evicts what exceeds its own capacity, oldest use first), plus
  other namespaces. A file indexed by two daemons counts in both (conservatively), and is deleted by
  whichever evicts it first; the other sees a miss. Size each daemon's capacity as its share of the mount,
  or give the daemons one budget for the whole root (pool_share: each shrinks itself, `shrink_to`, in
  proportion); a mount that fills up anyway (others' files) gives ENOSPC, which frees some of this
  daemon's blocks.

Concurrency: one lock guards the index, usage and counters; file I/O runs outside it. A reader pins the
block for the duration of its read, and only unpinned blocks are evicted, so this tier never deletes a file
under its own reader (a file another daemon deletes is a miss). A hash whose file is being written or
deleted is "busy": a second write of it is skipped rather than racing the first. Index changes are reported
to `on_change(kind, hashes)` ("stored" / "evicted") while the lock is held, so a listener sees them in
exactly the order they happened.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from io import FileIO
from pathlib import Path

from deepinfer.cache.block_file import (
    HEADER_BYTES,
    LENGTH_MISMATCH,
    TRUNCATED,
    WRONG_HASH,
    WRONG_NAMESPACE,
    CorruptBlock,
    encode_header,
    namespace_bytes,
    parse_header,
    verify,
)
from deepinfer.cache.block_io import fsync_dir, read_open_file, unlink_quietly, write_atomically
from deepinfer.cache.hashing import HASH_BYTES, BlockHash
from deepinfer.cache.pool_files import (
    ABANDONED_AFTER_S,
    TEMP_SUFFIX,
    FileId,
    TempNames,
    file_id,
    temp_is_abandoned,
    unlink_if_same,
)
from deepinfer.cache.quarantine import QUARANTINE_DIR, Quarantine

__all__ = ["DiskTier", "DiskPut", "DiskRead", "RebuildReport", "BLOCK_SUFFIX", "TEMP_SUFFIX", "QUARANTINE_DIR"]

BLOCK_SUFFIX = ".kvb"

# DiskRead.reason values besides the block_file corruption reasons ("" is a hit).
MISS = "miss"  # not in the index, and no file either
VANISHED = "vanished"  # in the index, but the file was gone
READ_ERROR = "read_error"  # an OSError on the file; quarantined like a corrupt one if it could be opened

# DiskPut.reason values ("" is stored).
EXISTS = "exists"
BUSY = "busy"  # a write or delete of the same block is in flight
WRONG_SIZE = "wrong_size"
NO_ROOM = "no_room"  # could not evict enough (pinned blocks, or bigger than the whole tier)
DISK_FULL = "disk_full"
IO_ERROR = "io_error"
CLOSED = "closed"

ChangeListener = Callable[[str, list[BlockHash]], None]  # ("stored" | "evicted", hashes)
_DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


@dataclass(frozen=True)
class RebuildReport:
    """What `open()` found on disk."""

    loaded: int = 0  # blocks of this namespace now in the index
    loaded_bytes: int = 0
    other_namespaces: int = 0  # directories of other namespaces on the root (left alone)
    temp_removed: int = 0  # temp files of writes whose writer is gone
    temp_kept: int = 0  # temp files that may be writes in progress (other daemons, other hosts)
    quarantined: int = 0  # files of this namespace whose header did not check out
    evicted: int = 0  # loaded, then evicted because they exceeded the capacity (now smaller than before)


@dataclass(frozen=True)
class DiskPut:
    stored: bool  # held on disk now: written, or an equal file another daemon wrote was adopted
    reason: str = ""  # why not stored: EXISTS, BUSY, WRONG_SIZE, NO_ROOM, DISK_FULL, IO_ERROR, CLOSED
    evicted: list[BlockHash] = field(default_factory=list)  # deleted to make room (even if not stored)


@dataclass(frozen=True)
class DiskRead:
    payload: memoryview | None  # verified, read-only; None unless reason == ""
    reason: str = ""  # "", MISS, VANISHED, READ_ERROR or a block_file corruption reason
    removed: bool = False  # this read dropped the block from the tier (corrupt, vanished, unreadable)


@dataclass(frozen=True)
class _FileInfo:
    """One block file as this tier opened it."""

    mtime_ns: int
    nbytes: int
    file_id: FileId


@dataclass
class _Entry:
    nbytes: int  # the whole file
    file_id: FileId  # the exact file indexed: eviction deletes it only if the name still points at it
    pins: int = 0


_Victim = tuple[BlockHash, FileId]


def _is_hex(name: str, nchars: int) -> bool:
    return len(name) == nchars and all(c in "0123456789abcdef" for c in name)


class DiskTier:
    def __init__(self, root: Path | str, namespace_id: str, block_nbytes: int, capacity_bytes: int, *,
                 high_watermark: float = 0.95, low_watermark: float = 0.85, max_quarantine_files: int = 64,
                 temp_abandoned_after_s: float = ABANDONED_AFTER_S, on_change: ChangeListener | None = None) -> None:
        if not 0.0 < low_watermark <= high_watermark <= 1.0:
            raise ValueError(f"need 0 < low_watermark <= high_watermark <= 1, got {low_watermark}, {high_watermark}")
        if block_nbytes <= 0 or capacity_bytes < 0:
            raise ValueError(f"bad sizes: block_nbytes={block_nbytes}, capacity_bytes={capacity_bytes}")
        self._namespace_raw = namespace_bytes(namespace_id)  # validates the id
        self.namespace_id = namespace_id
        self.root = Path(root)
        self.dir = self.root / namespace_id
        self.quarantine = Quarantine(self.root, namespace_id, max_quarantine_files)
        self.block_nbytes = block_nbytes
        self.file_nbytes = HEADER_BYTES + block_nbytes
        self.capacity_bytes = capacity_bytes
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.temp_abandoned_after_s = temp_abandoned_after_s
        self._temp_names = TempNames()
        self._on_change = on_change
        self._lock = threading.Lock()
        self._index: OrderedDict[BlockHash, _Entry] = OrderedDict()  # oldest use first
        self._used = 0  # bytes of the files in the index
        self._reserved = 0  # bytes of writes in flight, counted against capacity before they land
        self._busy: set[BlockHash] = set()  # a write or delete of the block's file is in flight
        self._shards_made: set[str] = set()
        self._counters: Counter[str] = Counter()
        self._opened = False
        self._closed = False

    # --- paths -----------------------------------------------------------------------------------------

    def path_of(self, block_hash: BlockHash) -> Path:
        name = block_hash.hex()
        return self.dir / name[:2] / (name + BLOCK_SUFFIX)

    # --- warm restart ----------------------------------------------------------------------------------

    def open(self) -> RebuildReport:
        """Create the directories, delete abandoned temp files, and index this namespace's files (blocking;
        call once, before any put). Other namespaces' directories are left alone."""
        with self._lock:
            if self._opened:
                raise RuntimeError("DiskTier.open() was already called")
        self.dir.mkdir(parents=True, exist_ok=True)
        fsync_dir(self.root)
        self.quarantine.open()
        others = self._count_other_namespaces()
        found, temp_removed, temp_kept, quarantined = self._scan_own_namespace()
        found.sort(key=lambda item: item[1].mtime_ns)  # the index order is the eviction order
        with self._lock:
            for block_hash, info in found:
                self._index[block_hash] = _Entry(info.nbytes, info.file_id)
                self._used += info.nbytes
            self._opened = True
            # Loaded blocks are reported as stored, so every later "evicted" has its "stored" before it.
            if found and self._on_change is not None:
                self._on_change("stored", [h for h, _ in found])
            victims: list[_Victim] = []
            if self._used > self.high_watermark * self.capacity_bytes:  # more than this daemon's capacity
                victims = self._evict_locked(int(self.low_watermark * self.capacity_bytes))
            loaded, loaded_bytes = len(self._index), self._used
        self._delete_files(victims)
        return RebuildReport(loaded=loaded, loaded_bytes=loaded_bytes, other_namespaces=others,
                             temp_removed=temp_removed, temp_kept=temp_kept, quarantined=quarantined,
                             evicted=len(victims))

    def _count_other_namespaces(self) -> int:
        return sum(1 for e in os.scandir(self.root)
                   if e.name != self.namespace_id and _is_hex(e.name, 2 * HASH_BYTES) and e.is_dir())

    def _scan_own_namespace(self) -> tuple[list[tuple[BlockHash, _FileInfo]], int, int, int]:
        found: list[tuple[BlockHash, _FileInfo]] = []
        temp_removed = temp_kept = quarantined = 0
        now_s = time.time()  # file ages are wall-clock by nature (mtimes); the margin dwarfs clock steps
        for shard in os.scandir(self.dir):
            if not (_is_hex(shard.name, 2) and shard.is_dir(follow_symlinks=False)):
                continue
            self._shards_made.add(shard.name)
            for entry in os.scandir(shard.path):
                name = entry.name
                if name.endswith(TEMP_SUFFIX):
                    if self._temp_abandoned(entry, now_s):
                        temp_removed += unlink_quietly(entry.path)  # a temp name is its writer's alone
                    else:
                        temp_kept += 1
                    continue
                stem = name[:-len(BLOCK_SUFFIX)]
                if not (name.endswith(BLOCK_SUFFIX) and _is_hex(stem, 2 * HASH_BYTES)):
                    continue  # not a file this tier writes
                block_hash = bytes.fromhex(stem)
                info, was_quarantined = self._inspect_file(Path(entry.path), block_hash,
                                                           misplaced=stem[:2] != shard.name)
                quarantined += was_quarantined
                if info is not None:
                    found.append((block_hash, info))
        return found, temp_removed, temp_kept, quarantined

    def _temp_abandoned(self, entry: os.DirEntry[str], now_s: float) -> bool:
        try:
            mtime_s = entry.stat(follow_symlinks=False).st_mtime
        except OSError:
            return False  # gone already: its writer finished or another sweep took it
        return temp_is_abandoned(entry.name, mtime_s, scope=self._temp_names.scope, now_s=now_s,
                                 abandoned_after_s=self.temp_abandoned_after_s)

    def _inspect_file(self, path: Path, block_hash: BlockHash,
                      misplaced: bool = False) -> tuple[_FileInfo | None, bool]:
        """Check a block file's header and size. Returns (its info, False) if it can be the block its name
        says; (None, True) if it was bad and quarantined; (None, False) if it is gone, cannot be opened
        (not provably bad: left alone), or was replaced while we looked."""
        try:
            f = open(path, "rb", buffering=0)
        except OSError:
            return None, False
        with f:
            try:
                st = os.fstat(f.fileno())
            except OSError:
                return None, False
            reason = WRONG_HASH if misplaced else self._header_problem(f, block_hash, st.st_size)
            if reason:  # quarantined while still open: the exact inode we judged
                return None, self._quarantine_file(path, block_hash, reason, file_id(st))
            return _FileInfo(st.st_mtime_ns, st.st_size, file_id(st)), False

    def _header_problem(self, f: FileIO, block_hash: BlockHash, size: int) -> str:
        """Why this file cannot be the block its name says, judging by its header and size ("" if none)."""
        try:
            header = parse_header(read_open_file(f, HEADER_BYTES))
        except CorruptBlock as e:
            return e.reason
        except OSError:
            return READ_ERROR
        if header.namespace != self._namespace_raw:
            return WRONG_NAMESPACE
        if header.block_hash != block_hash:
            return WRONG_HASH
        if header.payload_nbytes != self.block_nbytes or size > self.file_nbytes:
            return LENGTH_MISMATCH
        if size < self.file_nbytes:
            return TRUNCATED
        return ""

    # --- quarantine ------------------------------------------------------------------------------------

    def _quarantine_file(self, path: Path, block_hash: BlockHash, reason: str, held: FileId) -> bool:
        """Move the bad file `held` (the caller has it open) out of the namespace and count it; True if this
        call moved it. A good copy another daemon put under the name meanwhile is left alone (counted)."""
        taken = self.quarantine.take(path, block_hash, reason, held)
        with self._lock:
            if taken:
                self._counters["quarantined"] += 1
                self._counters[f"quarantined_{reason}"] += 1
            else:
                self._counters["quarantine_skipped"] += 1  # gone, or replaced by another writer's copy
        return taken

    # --- writes ----------------------------------------------------------------------------------------

    def put(self, block_hash: BlockHash, payload: bytes | memoryview) -> DiskPut:
        """Store a block durably (blocking). Never raises for lack of room or a failing disk."""
        view = memoryview(payload).cast("B")
        if view.nbytes != self.block_nbytes or len(block_hash) != HASH_BYTES:
            with self._lock:
                self._counters["refused_wrong_size"] += 1
            return DiskPut(False, WRONG_SIZE)
        nbytes = self.file_nbytes
        with self._lock:
            if not self._opened:
                raise RuntimeError("DiskTier.put before open()")
            if self._closed:
                return DiskPut(False, CLOSED)
            if block_hash in self._index:
                self._index.move_to_end(block_hash)  # offered again: it is in use
                self._counters["skipped_exists"] += 1
                return DiskPut(False, EXISTS)
            if block_hash in self._busy:
                self._counters["skipped_busy"] += 1
                return DiskPut(False, BUSY)
            victims = self._make_room_locked(nbytes)
            if self._used + self._reserved + nbytes > self.capacity_bytes:
                self._counters["dropped_no_room"] += 1
                reason = NO_ROOM
            else:
                reason = ""
                self._reserved += nbytes
                self._busy.add(block_hash)
        self._delete_files(victims)
        evicted = [h for h, _ in victims]
        if reason:
            return DiskPut(False, reason, evicted)
        # Another daemon on this root may have written the block already: take its file, not a second copy.
        info, _ = self._inspect_file(self.path_of(block_hash), block_hash)  # quarantines a bad one
        adopted = info is not None
        try:
            written = info.file_id if info is not None else \
                self._write_file(block_hash, encode_header(self.namespace_id, block_hash, view), view)
        except OSError as e:
            full = e.errno in _DISK_FULL_ERRNOS
            with self._lock:
                self._reserved -= nbytes
                self._busy.discard(block_hash)
                self._counters["write_errors"] += 1
                self._counters["write_errors_no_space" if full else "write_errors_io"] += 1
                # A full disk (perhaps filled by others) gets some room back for the next writes.
                more = self._evict_locked(int(self.low_watermark * self._used)) if full else []
            self._delete_files(more)
            return DiskPut(False, DISK_FULL if full else IO_ERROR, evicted + [h for h, _ in more])
        with self._lock:
            self._reserved -= nbytes
            self._busy.discard(block_hash)
            self._index[block_hash] = _Entry(nbytes, written)
            self._used += nbytes
            if adopted:
                self._counters["adopted"] += 1
            else:
                self._counters["writes"] += 1
                self._counters["bytes_written"] += nbytes
            if self._on_change is not None:
                self._on_change("stored", [block_hash])
        return DiskPut(True, "", evicted)

    def adopt(self, block_hash: BlockHash) -> bool:
        """Whether the block is in this tier, taking into the index a good file another daemon on this root
        wrote since `open()` (a header check, not a read: the full check happens when it is read). Blocking
        (opens a file); False where there is no such file, it is bad (quarantined), or there is no room."""
        if block_hash in self._index:
            return True
        with self._lock:
            if self._closed or not self._opened or block_hash in self._busy:
                return False
        info, _ = self._inspect_file(self.path_of(block_hash), block_hash)
        if info is None:
            return False
        with self._lock:
            victims = self._adopt_locked(block_hash, info)
            found = block_hash in self._index
        self._delete_files(victims)
        return found

    def _adopt_locked(self, block_hash: BlockHash, info: _FileInfo) -> list[_Victim]:
        """Index a good file found on the root (another daemon's write) if there is room; returns the blocks
        evicted to make it, whose files the caller deletes outside the lock."""
        if self._closed or block_hash in self._index or block_hash in self._busy:
            return []
        victims = self._make_room_locked(info.nbytes)
        if self._used + self._reserved + info.nbytes > self.capacity_bytes:
            self._counters["dropped_no_room"] += 1
            return victims
        self._index[block_hash] = _Entry(info.nbytes, info.file_id)
        self._used += info.nbytes
        self._counters["adopted"] += 1
        if self._on_change is not None:
            self._on_change("stored", [block_hash])
        return victims

    def _write_file(self, block_hash: BlockHash, header: bytes, payload: memoryview) -> FileId:
        """Write the block's file atomically (block_io.write_atomically: a reader sees the previous file,
        perhaps another daemon's copy, or this whole one). Raises OSError; leaves no temp file behind."""
        path = self.path_of(block_hash)
        if path.parent.name not in self._shards_made:
            self._make_shard(path.parent)
        try:
            return write_atomically(path, self._temp_names.name_for(path.stem), (header, payload))
        except FileNotFoundError:  # someone removed the directory (a cache may be wiped by hand): once more
            self._make_shard(path.parent)
            return write_atomically(path, self._temp_names.name_for(path.stem), (header, payload))

    def _make_shard(self, shard: Path) -> None:
        shard.mkdir(parents=True, exist_ok=True)
        fsync_dir(shard.parent)  # the new directory's entry must be durable before the files in it are
        self._shards_made.add(shard.name)

    # --- eviction --------------------------------------------------------------------------------------

    def _make_room_locked(self, nbytes: int) -> list[_Victim]:
        """With the lock held, before adding a file of `nbytes`: if that would pass the high watermark,
        evict down to the low one (so the file lands at about the low watermark)."""
        if self._used + self._reserved + nbytes > self.high_watermark * self.capacity_bytes:
            return self._evict_locked(int(self.low_watermark * self.capacity_bytes) - nbytes)
        return []

    def _evict_locked(self, target_bytes: int) -> list[_Victim]:
        """With the lock held: drop unpinned blocks, oldest use first, until usage (with writes in flight)
        is at most `target_bytes`. The victims are busy until `_delete_files` has removed their files."""
        victims: list[_Victim] = []
        projected = self._used + self._reserved
        for block_hash, entry in self._index.items():
            if projected <= target_bytes:
                break
            if entry.pins == 0:
                victims.append((block_hash, entry.file_id))
                projected -= entry.nbytes
        for block_hash, _ in victims:
            self._used -= self._index.pop(block_hash).nbytes
        if victims:
            hashes = [h for h, _ in victims]
            self._busy.update(hashes)
            self._counters["evictions"] += len(victims)
            if self._on_change is not None:
                self._on_change("evicted", hashes)
        return victims

    def shrink_to(self, target_bytes: int) -> int:
        """Evict unpinned blocks, oldest use first, until this tier indexes at most `target_bytes` (a pool's
        shared budget, `pool_share`). Returns the blocks evicted."""
        with self._lock:
            victims = self._evict_locked(target_bytes) if self._opened and not self._closed else []
        self._delete_files(victims)
        return len(victims)

    def _delete_files(self, victims: list[_Victim]) -> None:
        """Delete each victim's file if it is still the file we indexed (another daemon's newer copy under
        the same name stays: it is in their index, not ours)."""
        kept = sum(not unlink_if_same(self.path_of(h), fid) for h, fid in victims)
        if victims:
            with self._lock:
                self._busy.difference_update(h for h, _ in victims)
                self._counters["evicted_files_not_deleted"] += kept  # gone already, or another's copy now

    # --- reads -----------------------------------------------------------------------------------------

    def get(self, block_hash: BlockHash) -> DiskRead:
        """Read and verify a block (blocking). A bad file is quarantined and never returned. A block not in
        the index is looked for on disk too (another daemon sharing the root may have written it) and, if
        good, joins the index."""
        with self._lock:
            entry = self._index.get(block_hash)
            if self._closed or (entry is None and block_hash in self._busy):
                self._counters["misses"] += 1
                return DiskRead(None, MISS)
            if entry is not None:
                entry.pins += 1  # the file cannot be evicted while we read it
                self._index.move_to_end(block_hash)
        payload, reason, info = self._read_verified(block_hash)
        if entry is None:
            return self._read_through(block_hash, payload, reason, info)
        with self._lock:
            entry.pins -= 1
            if not reason:
                self._counters["hits"] += 1
                self._counters["bytes_read"] += self.file_nbytes
                return DiskRead(payload)
            self._counters[VANISHED if reason == VANISHED else "read_failures"] += 1
            removed = self._index.get(block_hash) is entry
            if removed:
                del self._index[block_hash]
                self._used -= entry.nbytes
                if self._on_change is not None:
                    self._on_change("evicted", [block_hash])
            return DiskRead(None, reason, removed)

    def _read_through(self, block_hash: BlockHash, payload: memoryview | None, reason: str,
                      info: _FileInfo | None) -> DiskRead:
        """The end of a `get` of a block that was not in the index: a good file joins it."""
        with self._lock:
            if payload is None or info is None:
                self._counters["misses" if reason == VANISHED else "read_failures"] += 1
                return DiskRead(None, MISS if reason == VANISHED else reason)
            self._counters["hits"] += 1
            self._counters["bytes_read"] += self.file_nbytes
            victims = self._adopt_locked(block_hash, info)
        self._delete_files(victims)
        return DiskRead(payload)

    def _read_verified(self, block_hash: BlockHash) -> tuple[memoryview | None, str, _FileInfo | None]:
        """Open, read and verify the block's file: (payload, "", info), or (None, reason, info or None).
        A bad file is quarantined before it is closed, so exactly the inode judged bad is taken."""
        path = self.path_of(block_hash)
        try:
            f = open(path, "rb", buffering=0)
        except FileNotFoundError:
            return None, VANISHED, None
        except OSError:
            return None, READ_ERROR, None  # not provably bad (permissions on a shared mount?): left alone
        with f:
            try:
                st = os.fstat(f.fileno())
            except OSError:
                return None, READ_ERROR, None
            info = _FileInfo(st.st_mtime_ns, st.st_size, file_id(st))
            try:
                # At most one byte more than a block file: a bigger file is corrupt anyway, and this bounds
                # the memory a garbage file can make us allocate.
                raw = read_open_file(f, min(st.st_size, self.file_nbytes + 1))
                payload = verify(raw, self.namespace_id, block_hash, self.block_nbytes)
            except CorruptBlock as e:
                reason = e.reason
            except OSError:
                reason = READ_ERROR
            else:
                try:
                    os.utime(f.fileno())  # mtime is the last use a warm restart (any daemon's) sees
                except OSError:
                    pass
                return payload, "", info
            self._quarantine_file(path, block_hash, reason, info.file_id)
            return None, reason, info

    # --- index queries ---------------------------------------------------------------------------------

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._index  # a single dict lookup is atomic under the GIL

    def touch(self, block_hash: BlockHash) -> bool:
        with self._lock:
            if block_hash not in self._index:
                return False
            self._index.move_to_end(block_hash)
            return True

    def pin(self, block_hash: BlockHash) -> bool:
        """Keep the block from eviction until a matching `unpin`; False if not held. (A block that fails
        verification is still removed: pins protect readers, not bad data.)"""
        with self._lock:
            entry = self._index.get(block_hash)
            if entry is None:
                return False
            entry.pins += 1
            return True

    def unpin(self, block_hash: BlockHash) -> None:
        with self._lock:
            entry = self._index.get(block_hash)
            if entry is not None and entry.pins > 0:
                entry.pins -= 1

    def hashes(self) -> list[BlockHash]:
        """Every block in the index, oldest use first."""
        with self._lock:
            return list(self._index)

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._index)

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._counters)
            out.update(blocks=len(self._index), bytes=self._used, capacity_bytes=self.capacity_bytes,
                       quarantine_files=len(self.quarantine))
            return out

    # --- maintenance -----------------------------------------------------------------------------------

    def drop_page_cache(self) -> int:
        """Ask the kernel to drop its cached pages of every block file, so the next reads come from the
        device (for benchmarks of cold reads). Returns how many files were advised."""
        if not hasattr(os, "posix_fadvise"):
            return 0
        advised = 0
        for block_hash in self.hashes():
            try:
                fd = os.open(self.path_of(block_hash), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                advised += 1
            except OSError:
                pass
            finally:
                os.close(fd)
        return advised

    def close(self) -> None:
        """Refuse further reads and writes; the files stay for the next open()."""
        with self._lock:
            self._closed = True
