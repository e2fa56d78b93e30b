"""Where the disk tier puts block files that failed verification: out of the namespace (so nothing serves
or reloads them), kept for a look, at most `max_files` of them (quarantine must not fill a disk that is
going bad).

One directory per namespace, `<root>/quarantine/<namespace id>/`, shared by every daemon of that namespace
on the root: a daemon trims only its own namespace's quarantine, never another model's. A file is taken
only if it is still the exact file that was read (pool_files.move_if_same): a good copy another daemon
wrote under the same name meanwhile stays where it is.
"""

from __future__ import annotations

import itertools
import os
import secrets
import threading
from collections import deque
from pathlib import Path

from deepinfer.cache.hashing import BlockHash
from deepinfer.cache.pool_files import FileId, move_if_same, unlink_if_same

QUARANTINE_DIR = "quarantine"
SUFFIX = ".kvb"


class Quarantine:
    def __init__(self, root: Path, namespace_id: str, max_files: int) -> None:
        self.dir = root / QUARANTINE_DIR / namespace_id
        self.max_files = max_files
        self._lock = threading.Lock()
        self._files: deque[Path] = deque()  # oldest first: what this daemon knows of (its own + found at open)
        self._nonce = secrets.token_hex(4)  # file names unique across daemons and hosts
        self._seq = itertools.count()

    def open(self) -> None:
        """Create the directory and take stock of what earlier runs left (trimmed to `max_files`). Without a
        usable directory (a full disk) bad files are deleted instead of kept: `take` falls back to that."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            listing = list(os.scandir(self.dir))
        except OSError:
            return
        entries = []
        for entry in listing:
            if entry.name.endswith(SUFFIX):
                try:
                    entries.append((entry.stat(follow_symlinks=False).st_mtime_ns, Path(entry.path)))
                except OSError:
                    continue
        with self._lock:
            self._files.extend(p for _, p in sorted(entries))
        self._trim()

    def take(self, path: Path, block_hash: BlockHash, reason: str, held: FileId) -> bool:
        """Move the bad file `held` (the caller has it open) from `path` into quarantine; True if it left the
        namespace (moved, or deleted where it could not be moved). False if it was gone already (another
        reader took it) or `path` now holds another file (another writer's new copy: left alone)."""
        dest = self.dir / f"{block_hash.hex()}.{reason}.{self._nonce}-{next(self._seq)}{SUFFIX}"
        try:
            moved = move_if_same(path, dest, held)
        except OSError:
            # Gone (another reader took it first), or no usable quarantine directory (wiped, permissions):
            # drop the bad file if it is still there.
            return unlink_if_same(path, held)
        if moved:
            with self._lock:
                self._files.append(dest)
            self._trim()
        return moved

    def __len__(self) -> int:
        return len(self._files)

    def _trim(self) -> None:
        with self._lock:
            extra = [self._files.popleft() for _ in range(len(self._files) - self.max_files)]
        for path in extra:
            try:
                os.unlink(path)
            except OSError:
                pass  # another daemon of the namespace trimmed it first
