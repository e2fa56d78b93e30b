"""Writing and reading one block file, on a filesystem other processes (other daemons, other hosts) may be
using at the same time.

`write_atomically` is the only way a block file comes to exist under its final name: the bytes go to a
temp file of this writer's own, are fsynced, and the temp file is renamed over the final name (atomic on
POSIX filesystems, NFS included), then the directory is fsynced. A reader therefore opens either the
previous file or the whole new one, never a mix, however many writers race on one name; the last rename
wins. On any error the temp file is removed and the error raised.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from io import FileIO
from pathlib import Path

from deepinfer.cache.pool_files import FileId, file_id, unlink_if_same

# O_EXCL: a temp name is this writer's alone, so one already there is an error, never a file to share.
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
FILE_MODE = 0o600  # KV derived from prompts: only the daemon's user reads it (its directory says who else may)


def write_all(fd: int, chunks: Sequence[bytes | memoryview]) -> None:
    """Write every chunk to `fd` and fsync it. The one place that writes block data (tests inject disk
    errors here)."""
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        while view:
            view = view[os.write(fd, view):]
    os.fsync(fd)


def fsync_dir(path: Path | str) -> None:
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


def unlink_quietly(path: Path | str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def write_atomically(path: Path, temp_name: str, chunks: Sequence[bytes | memoryview]) -> FileId:
    """Temp file `temp_name` (in `path`'s directory) → fsync → rename over `path` → fsync the directory.
    Returns the identity of the file now at `path` (ours). Raises OSError (FileNotFoundError before any
    file is made if the directory is missing); leaves no temp file behind when it does."""
    tmp = path.parent / temp_name
    fd = os.open(tmp, _CREATE_FLAGS, FILE_MODE)
    try:
        try:
            write_all(fd, chunks)
            written = file_id(os.fstat(fd))
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        unlink_quietly(tmp)
        raise
    try:
        fsync_dir(path.parent)
    except BaseException:
        unlink_if_same(path, written)  # complete but maybe not durable: not indexed, so not kept either
        raise
    return written


def read_open_file(f: FileIO, size: int) -> memoryview:
    """The first `size` bytes of an open file (fewer if it shrank under us: verify reports it truncated)."""
    buf = memoryview(bytearray(size))
    got = 0
    while got < size:
        n = f.readinto(buf[got:])
        if not n:
            break
        got += n
    return buf[:got]
