"""Files in a directory that several processes write at once, on one host or on several (a shared mount).

The disk tier's directory may be shared by several cache daemons (and several models). Three rules keep
them from hurting each other; each is a function here:

* **Temp files are named by their writer**: `.<stem>.<scope>.<pid>.<nonce><seq>.tmp`, where `scope`
  names the kernel boot and pid namespace the writer's pid belongs to (TempNames). No two writers ever
  share a temp file, and a stray one can be judged by who left it (`temp_is_abandoned`): a writer that is
  provably dead (same boot and pid namespace as us, pid gone), or anyone's after a day. Nothing else: a
  pid on another host, or in another container on this host, means nothing here.
* **A file is deleted only if it is still the exact file we meant** (`unlink_if_same`): another daemon may
  have replaced it (atomic rename) with its own copy since we indexed ours, and that copy is not ours to
  delete.
* **A bad file is moved away only if it is still the exact file that was read** (`move_if_same`): another
  daemon may have just written a good copy under the same name. The caller holds the bad file open, so its
  inode number cannot be reused by a new file meanwhile, and (st_dev, st_ino) identifies it exactly.

File identity is (st_dev, st_ino); a shared filesystem (NFS, CephFS, Lustre) keeps it stable per file.
"""

from __future__ import annotations

import itertools
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

TEMP_SUFFIX = ".tmp"
UNKNOWN_SCOPE = "unknown"  # where the boot or pid namespace cannot be told: no pid is ever checked
ABANDONED_AFTER_S = 24 * 3600.0  # a write takes seconds: any temp file this old is junk, whoever left it

FileId = tuple[int, int]  # (st_dev, st_ino)

_rename: Callable[[Path | str, Path | str], None] = os.rename  # tests inject a racing writer here


def file_id(st: os.stat_result) -> FileId:
    return st.st_dev, st.st_ino


def _id_at(path: Path | str) -> FileId | None:
    try:
        return file_id(os.lstat(path))
    except OSError:
        return None


def unlink_if_same(path: Path | str, expected: FileId) -> bool:
    """Delete `path` if it is the file `expected` names; True if deleted. A file another writer put there
    since is left alone. (A replace landing between the check and the unlink can still lose that copy: a
    cache may lose a block, never serve a wrong one.)"""
    if _id_at(path) != expected:
        return False
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def move_if_same(path: Path | str, dest: Path | str, expected: FileId) -> bool:
    """Rename `path` to `dest` if it is the file `expected` names; True if that file is now at `dest`.

    The caller holds the `expected` file open (its inode cannot be freed and reused meanwhile). Checked
    before the rename, and again after it: if another writer's rename landed in between, the file we took
    is theirs, so it goes back under its name (replacing at most a newer complete copy of the same block;
    every writer only ever puts complete files under a final name)."""
    if _id_at(path) != expected:
        return False
    _rename(path, dest)
    if _id_at(dest) == expected:
        return True
    try:
        os.replace(dest, path)
    except OSError:
        _unlink_quietly(dest)
    return False


def _unlink_quietly(path: Path | str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


# --- temp files ------------------------------------------------------------------------------------------


def process_scope() -> str:
    """The scope in which this process's pid means something: the kernel boot (boot_id, shared by every
    container on the host) and the pid namespace. UNKNOWN_SCOPE where /proc does not tell."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return UNKNOWN_SCOPE
    if not boot.isalnum():
        return UNKNOWN_SCOPE
    return f"{boot}-{pid_ns:x}"


@dataclass(frozen=True)
class TempOwner:
    scope: str
    pid: int


class TempNames:
    """Temp file names unique to this writer (this object in this process): the name carries the writer's
    scope and pid, so a later sweep can tell whether the writer is still alive."""

    def __init__(self, scope: str | None = None, pid: int | None = None) -> None:
        self.scope = process_scope() if scope is None else scope
        self.pid = os.getpid() if pid is None else pid
        self._nonce = secrets.token_hex(4)  # two writers with one pid (two tiers in one process) differ
        self._seq = itertools.count()

    def name_for(self, stem: str) -> str:
        return f".{stem}.{self.scope}.{self.pid}.{self._nonce}{next(self._seq)}{TEMP_SUFFIX}"


def parse_temp_name(name: str) -> TempOwner | None:
    """Who wrote a temp file named by TempNames; None for any other name (an older format, a stranger)."""
    if not (name.startswith(".") and name.endswith(TEMP_SUFFIX)):
        return None
    parts = name[1:-len(TEMP_SUFFIX)].split(".")
    if len(parts) != 4 or not parts[2].isdigit() or not parts[1]:
        return None
    return TempOwner(parts[1], int(parts[2]))


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists in our pid namespace (a zombie or another user's counts)."""
    if pid <= 0:
        return True  # never "dead": kill(0 or -n) would address groups
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # EPERM: it exists, someone else's
    return True


def temp_is_abandoned(name: str, mtime_s: float, *, scope: str, now_s: float | None = None,
                      abandoned_after_s: float = ABANDONED_AFTER_S,
                      alive: Callable[[int], bool] = pid_alive) -> bool:
    """May a sweep delete this temp file? Yes when its writer is provably dead — it wrote in our scope
    (same boot, same pid namespace) and its pid is gone — or when it is older than `abandoned_after_s`
    by its mtime (a margin far above any write and any clock skew between hosts). Everything else may be
    a write in progress on another host or in another container: kept."""
    owner = parse_temp_name(name)
    if owner is not None and owner.scope == scope and scope != UNKNOWN_SCOPE and not alive(owner.pid):
        return True
    age_s = (time.time() if now_s is None else now_s) - mtime_s
    return age_s >= abandoned_after_s
