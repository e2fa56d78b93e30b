"""A really small filesystem for disk-full tests: writes past its size fail with a real ENOSPC from the kernel.

`small_tmpfs(where, size_bytes, max_inodes)` mounts a size-limited tmpfs at `where` for the duration of a
`with` block (`max_inodes` also limits files and directories; the root directory is one):

1. `mount -t tmpfs` directly (root, or CAP_SYS_ADMIN);
2. else inside a new user and mount namespace (`unshare --user --map-root-user --mount`, allowed to
   unprivileged users where the kernel permits it): a helper process holds the namespace, and the tmpfs
   is reached from here through `/proc/<helper>/root/...`;
3. else the test is skipped, saying why. Never faked: a test that needs ENOSPC gets the kernel's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def _capacity(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


def _options(size_bytes: int, max_inodes: int | None) -> str:
    return f"size={size_bytes}" + (f",nr_inodes={max_inodes}" if max_inodes is not None else "")


def _mount(where: Path, options: str) -> bool:
    if shutil.which("mount") is None:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"{options},mode=0700", "tmpfs", str(where)],
                          capture_output=True)
    return done.returncode == 0


def _unmount(where: Path) -> None:
    if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)  # busy: detach now, freed when closed


_HOLD_NAMESPACE = 'mount -t tmpfs -o "$1" tmpfs "$2" && echo ready && exec cat'


def _namespaced(where: Path, options: str) -> subprocess.Popen[str] | None:
    if shutil.which("unshare") is None:
        return None
    helper = subprocess.Popen(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", _HOLD_NAMESPACE,
                               "sh", options, str(where)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert helper.stdout is not None
    if helper.stdout.readline().strip() == "ready":
        return helper
    helper.kill()
    helper.wait()
    return None


@contextlib.contextmanager
def small_tmpfs(where: Path, size_bytes: int, max_inodes: int | None = None) -> Iterator[Path]:
    """A directory on a filesystem of about `size_bytes` (checked), gone after the block."""
    where.mkdir(parents=True, exist_ok=True)
    options = _options(size_bytes, max_inodes)
    if _mount(where, options):
        try:
            assert _capacity(where) <= size_bytes, "the tmpfs is not size-limited"
            yield where
        finally:
            _unmount(where)
        return
    helper = _namespaced(where, options)
    if helper is not None:
        inside = Path(f"/proc/{helper.pid}/root") / where.relative_to(where.anchor)
        try:
            if not os.access(inside, os.W_OK):
                pytest.skip("a tmpfs mounted in a user namespace is not writable from outside it here")
            assert _capacity(inside) <= size_bytes, "the tmpfs is not size-limited"
            yield inside
        finally:
            assert helper.stdin is not None
            helper.stdin.close()  # cat exits; the namespace and its tmpfs go with it
            helper.wait()
        return
    pytest.skip("cannot mount a size-limited tmpfs here (not root, and no unprivileged user namespaces): "
                "a full disk cannot be produced without faking it")
