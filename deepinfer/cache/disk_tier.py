"""The NVMe tier: a directory of block files, one per KV block, with an in-memory index in front of it.

Layout under `root` (any directory or mount; a shared filesystem pools the cache across hosts):

    <root>/<namespace id>/<hash hex[:2]>/<hash hex>.kvb     one block (format: block_file.py)
    <root>/<namespace id>/<hash hex[:2]>/.<hash hex>.*.tmp  a write in progress (or left by a crash)
    <root>/quarantine/<hash hex>.<reason>.<n>.kvb           a file that failed verification, kept for a look

The disk tier is a cache: losing a block is fine, serving a wrong one is not. Hence:

* **Data before the entry that makes it visible.** A block is written to a temp file in its final
  directory, flushed and fsynced, renamed over its final name (atomic), and the directory fsynced; only then
  is the index entry added. A crash at any point leaves either no file, a stray temp file, or a complete
  file under its final name, never a torn one. `open()` deletes stray temp files.
* **Every read verifies** the checksum, the namespace and the hash the file name says (block_file.verify).
  A file that fails is moved to quarantine, counted by reason, dropped from the index (an "evicted"
  change), and its bytes are never returned. A file that vanished is a miss.
* **Warm restart.** `open()` rebuilds the index from the files of this namespace (a header check per
  file; the full check happens on read), last use from each file's mtime (reads refresh it), and deletes
  the directories of other namespaces: blocks hashed under another model, tokenizer or layout can never
  be hit again.
* **Capacity** counts whole files. When a write would take usage above `high_watermark` of capacity,
  least recently used unpinned blocks are deleted first, down to `low_watermark`. A write that still does
  not fit (everything pinned), hits a full disk (ENOSPC / EDQUOT: some space is freed too) or any other
  OSError is dropped and counted; `put` never raises for these.

Concurrency: one lock guards the index, usage and counters; file I/O runs outside it. A reader pins the
block for the duration of its read, and only unpinned blocks are evicted, so a file is never deleted under
a reader. A hash whose file is being written or deleted is "busy": a second write of it is skipped rather
than racing the first. Index changes are reported to `on_change(kind, hashes)` ("stored" / "evicted")
while the lock is held, so a listener sees them in exactly the order they happened.
"""

from __future__ import annotations

import errno
import itertools
import os
import shutil
import tempfile
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
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
from deepinfer.cache.hashing import HASH_BYTES, BlockHash

BLOCK_SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"
QUARANTINE_DIR = "quarantine"

# DiskRead.reason values besides the block_file corruption reasons ("" is a hit).
MISS = "miss"  # not in the index
VANISHED = "vanished"  # in the index, but the file was gone
READ_ERROR = "read_error"  # an OSError while reading; the file is quarantined like a corrupt one

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
_quarantine_seq = itertools.count()


@dataclass(frozen=True)
class RebuildReport:
    """What `open()` found on disk."""

    loaded: int = 0  # blocks of this namespace now in the index
    loaded_bytes: int = 0
    dropped_other_namespace: int = 0  # block files deleted with other namespaces' directories
    temp_removed: int = 0  # temp files of interrupted writes
    quarantined: int = 0  # files of this namespace whose header did not check out
    evicted: int = 0  # loaded, then evicted because they exceeded the capacity (now smaller than before)


@dataclass(frozen=True)
class DiskPut:
    stored: bool
    reason: str = ""  # why not stored: EXISTS, BUSY, WRONG_SIZE, NO_ROOM, DISK_FULL, IO_ERROR, CLOSED
    evicted: list[BlockHash] = field(default_factory=list)  # deleted to make room (even if not stored)


@dataclass(frozen=True)
class DiskRead:
    payload: memoryview | None  # verified, read-only; None unless reason == ""
    reason: str = ""  # "", MISS, VANISHED, READ_ERROR or a block_file corruption reason
    removed: bool = False  # this read dropped the block from the tier (corrupt, vanished, unreadable)


@dataclass
class _Entry:
    nbytes: int  # the whole file
    pins: int = 0


def _write_all(fd: int, chunks: Iterable[bytes | memoryview]) -> None:
    """Write every chunk to `fd` and fsync it. The one place that writes block data (tests inject disk
    errors here)."""
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        while view:
            view = view[os.write(fd, view):]
    os.fsync(fd)


def _fsync_dir(path: Path | str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:
        # Some filesystems (network, FUSE) cannot fsync a directory; their renames are as durable as
        # they get, so that is not a failed write.
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _unlink_quietly(path: Path | str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def _is_hex(name: str, nchars: int) -> bool:
    return len(name) == nchars and all(c in "0123456789abcdef" for c in name)


def _read_file(path: Path, limit: int) -> memoryview:
    """At most `limit` bytes from the start of the file (a bigger file is corrupt anyway; this bounds the
    memory a garbage file can make us allocate)."""
    with open(path, "rb", buffering=0) as f:
        size = min(os.fstat(f.fileno()).st_size, limit)
        buf = memoryview(bytearray(size))
        got = 0
        while got < size:
            n = f.readinto(buf[got:])
            if not n:
                break  # the file shrank under us: verify reports it truncated
            got += n
        return buf[:got]


class DiskTier:
    def __init__(self, root: Path | str, namespace_id: str, block_nbytes: int, capacity_bytes: int, *,
                 high_watermark: float = 0.95, low_watermark: float = 0.85, max_quarantine_files: int = 64,
                 on_change: ChangeListener | None = None) -> None:
        if not 0.0 < low_watermark <= high_watermark <= 1.0:
            raise ValueError(f"need 0 < low_watermark <= high_watermark <= 1, got {low_watermark}, {high_watermark}")
        if block_nbytes <= 0 or capacity_bytes < 0:
            raise ValueError(f"bad sizes: block_nbytes={block_nbytes}, capacity_bytes={capacity_bytes}")
        self._namespace_raw = namespace_bytes(namespace_id)  # validates the id
        self.namespace_id = namespace_id
        self.root = Path(root)
        self.dir = self.root / namespace_id
        self.quarantine_dir = self.root / QUARANTINE_DIR
        self.block_nbytes = block_nbytes
        self.file_nbytes = HEADER_BYTES + block_nbytes
        self.capacity_bytes = capacity_bytes
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.max_quarantine_files = max_quarantine_files
        self._on_change = on_change
        self._lock = threading.Lock()
        self._index: OrderedDict[BlockHash, _Entry] = OrderedDict()  # oldest use first
        self._used = 0  # bytes of the files in the index
        self._reserved = 0  # bytes of writes in flight, counted against capacity before they land
        self._busy: set[BlockHash] = set()  # a write or delete of the block's file is in flight
        self._quarantined: deque[Path] = deque()  # oldest first, bounded by max_quarantine_files
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
        """Create the directories, delete stray temp files and other namespaces, and index this
        namespace's files (blocking; call once, before any put)."""
        with self._lock:
            if self._opened:
                raise RuntimeError("DiskTier.open() was already called")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.quarantine_dir.mkdir(exist_ok=True)
        _fsync_dir(self.root)
        dropped = self._drop_other_namespaces()
        self._load_quarantine_list()
        found, temp_removed, quarantined = self._scan_own_namespace()
        found.sort()  # by mtime: the index order is the eviction order
        with self._lock:
            for _, block_hash, nbytes in found:
                self._index[block_hash] = _Entry(nbytes)
                self._used += nbytes
            self._opened = True
            # Loaded blocks are reported as stored, so every later "evicted" has its "stored" before it.
            if found and self._on_change is not None:
                self._on_change("stored", [h for _, h, _ in found])
            victims: list[BlockHash] = []
            if self._used > self.high_watermark * self.capacity_bytes:  # the capacity shrank since last run
                victims = self._evict_locked(int(self.low_watermark * self.capacity_bytes))
            loaded, loaded_bytes = len(self._index), self._used
        self._delete_files(victims)
        return RebuildReport(loaded=loaded, loaded_bytes=loaded_bytes, dropped_other_namespace=dropped,
                             temp_removed=temp_removed, quarantined=quarantined, evicted=len(victims))

    def _drop_other_namespaces(self) -> int:
        """Delete the directories of other namespaces; returns how many block files they held. Entries that
        are not namespace directories (not 64 hex characters) are not ours and are left alone."""
        dropped = 0
        for entry in os.scandir(self.root):
            if entry.name == self.namespace_id or not _is_hex(entry.name, 2 * HASH_BYTES):
                continue
            if not entry.is_dir(follow_symlinks=False):
                continue
            for _, _, files in os.walk(entry.path):
                dropped += sum(name.endswith(BLOCK_SUFFIX) for name in files)
            shutil.rmtree(entry.path, ignore_errors=True)
        return dropped

    def _load_quarantine_list(self) -> None:
        entries = [(e.stat().st_mtime_ns, Path(e.path)) for e in os.scandir(self.quarantine_dir)
                   if e.name.endswith(BLOCK_SUFFIX)]
        with self._lock:
            self._quarantined.extend(p for _, p in sorted(entries))
        self._trim_quarantine()

    def _scan_own_namespace(self) -> tuple[list[tuple[int, BlockHash, int]], int, int]:
        found: list[tuple[int, BlockHash, int]] = []  # (mtime_ns, hash, file bytes)
        temp_removed = quarantined = 0
        for shard in os.scandir(self.dir):
            if not (_is_hex(shard.name, 2) and shard.is_dir(follow_symlinks=False)):
                continue
            self._shards_made.add(shard.name)
            for entry in os.scandir(shard.path):
                name = entry.name
                if name.endswith(TEMP_SUFFIX):
                    temp_removed += _unlink_quietly(entry.path)
                    continue
                stem = name[:-len(BLOCK_SUFFIX)]
                if not (name.endswith(BLOCK_SUFFIX) and _is_hex(stem, 2 * HASH_BYTES)):
                    continue  # not a file this tier writes
                block_hash = bytes.fromhex(stem)
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                reason = WRONG_HASH if stem[:2] != shard.name else self._header_problem(Path(entry.path),
                                                                                         block_hash, st.st_size)
                if reason:
                    quarantined += self._quarantine_file(Path(entry.path), block_hash, reason)
                else:
                    found.append((st.st_mtime_ns, block_hash, st.st_size))
        return found, temp_removed, quarantined

    def _header_problem(self, path: Path, block_hash: BlockHash, size: int) -> str:
        """Why this file cannot be the block its name says, judging by its header and size ("" if none)."""
        try:
            with open(path, "rb") as f:
                header = parse_header(f.read(HEADER_BYTES))
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

    def _quarantine_file(self, path: Path, block_hash: BlockHash, reason: str) -> bool:
        """Move a bad file out of the namespace (so nothing serves or reloads it) and count it; True if
        this call moved it. Keeps the newest `max_quarantine_files` files: quarantine must not fill a disk
        that is going bad."""
        dest = self.quarantine_dir / f"{block_hash.hex()}.{reason}.{os.getpid()}-{next(_quarantine_seq)}{BLOCK_SUFFIX}"
        try:
            os.replace(path, dest)
        except FileNotFoundError:
            return False  # another reader moved it first
        except OSError:
            if not _unlink_quietly(path):
                return False
            dest = None
        with self._lock:
            self._counters["quarantined"] += 1
            self._counters[f"quarantined_{reason}"] += 1
            if dest is not None:
                self._quarantined.append(dest)
        self._trim_quarantine()
        return True

    def _trim_quarantine(self) -> None:
        with self._lock:
            extra = [self._quarantined.popleft() for _ in range(len(self._quarantined) - self.max_quarantine_files)]
        for path in extra:
            _unlink_quietly(path)

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
            victims: list[BlockHash] = []
            if self._used + self._reserved + nbytes > self.high_watermark * self.capacity_bytes:
                # Evict now rather than after the write: the write then lands at about the low watermark.
                victims = self._evict_locked(int(self.low_watermark * self.capacity_bytes) - nbytes)
            if self._used + self._reserved + nbytes > self.capacity_bytes:
                self._counters["dropped_no_room"] += 1
                reason = NO_ROOM
            else:
                reason = ""
                self._reserved += nbytes
                self._busy.add(block_hash)
        self._delete_files(victims)
        if reason:
            return DiskPut(False, reason, victims)
        try:
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
            return DiskPut(False, DISK_FULL if full else IO_ERROR, victims + more)
        with self._lock:
            self._reserved -= nbytes
            self._busy.discard(block_hash)
            self._index[block_hash] = _Entry(nbytes)
            self._used += nbytes
            self._counters["writes"] += 1
            self._counters["bytes_written"] += nbytes
            if self._on_change is not None:
                self._on_change("stored", [block_hash])
        return DiskPut(True, "", victims)

    def _write_file(self, block_hash: BlockHash, header: bytes, payload: memoryview) -> None:
        """Temp file → fsync → rename over the final name → fsync the directory. Raises OSError; leaves no
        temp file behind when it does."""
        path = self.path_of(block_hash)
        shard = path.parent
        if shard.name not in self._shards_made:
            self._make_shard(shard)
        try:
            fd, tmp = tempfile.mkstemp(dir=shard, prefix=f".{path.stem}.", suffix=TEMP_SUFFIX)
        except FileNotFoundError:  # someone removed the directory (a cache may be wiped by hand): once more
            self._make_shard(shard)
            fd, tmp = tempfile.mkstemp(dir=shard, prefix=f".{path.stem}.", suffix=TEMP_SUFFIX)
        try:
            try:
                _write_all(fd, (header, payload))
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        try:
            _fsync_dir(shard)
        except BaseException:
            _unlink_quietly(path)  # complete but maybe not durable: not indexed, so not kept either
            raise

    def _make_shard(self, shard: Path) -> None:
        shard.mkdir(parents=True, exist_ok=True)
        _fsync_dir(shard.parent)  # the new directory's entry must be durable before the files in it are
        self._shards_made.add(shard.name)

    # --- eviction --------------------------------------------------------------------------------------

    def _evict_locked(self, target_bytes: int) -> list[BlockHash]:
        """With the lock held: drop unpinned blocks, oldest use first, until usage (with writes in flight)
        is at most `target_bytes`. The victims are busy until `_delete_files` has removed their files."""
        victims = []
        projected = self._used + self._reserved
        for block_hash, entry in self._index.items():
            if projected <= target_bytes:
                break
            if entry.pins == 0:
                victims.append(block_hash)
                projected -= entry.nbytes
        for block_hash in victims:
            self._used -= self._index.pop(block_hash).nbytes
        if victims:
            self._busy.update(victims)
            self._counters["evictions"] += len(victims)
            if self._on_change is not None:
                self._on_change("evicted", list(victims))
        return victims

    def _delete_files(self, victims: list[BlockHash]) -> None:
        for block_hash in victims:
            _unlink_quietly(self.path_of(block_hash))
        if victims:
            with self._lock:
                self._busy.difference_update(victims)

    # --- reads -----------------------------------------------------------------------------------------

    def get(self, block_hash: BlockHash) -> DiskRead:
        """Read and verify a block (blocking). A bad file is quarantined and never returned."""
        with self._lock:
            entry = self._index.get(block_hash)
            if entry is None or self._closed:
                self._counters["misses"] += 1
                return DiskRead(None, MISS)
            entry.pins += 1  # the file cannot be evicted while we read it
            self._index.move_to_end(block_hash)
        path = self.path_of(block_hash)
        reason = ""
        try:
            raw = _read_file(path, self.file_nbytes + 1)
            payload = verify(raw, self.namespace_id, block_hash, self.block_nbytes)
        except FileNotFoundError:
            reason = VANISHED
        except CorruptBlock as e:
            reason = e.reason
        except OSError:
            reason = READ_ERROR
        if reason and reason != VANISHED:
            self._quarantine_file(path, block_hash, reason)
        elif not reason:
            try:
                os.utime(path)  # mtime is the last use a warm restart sees
            except OSError:
                pass
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
                       quarantine_files=len(self._quarantined))
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
