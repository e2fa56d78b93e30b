"""Process-level tuning every DeepInfer service applies at start.

glibc serves allocations above its mmap threshold (128 KiB at first, rising to at most 32 MiB as it adapts)
with fresh mmap'd pages that are unmapped again on free, so each new KV block frame, staging buffer or large
torch temporary is page-faulted in anew: measured on this project's machines, a fetch of 127 cached blocks
(89 MiB) spent more time faulting in pages than copying bytes. Raising the threshold to its maximum keeps
such buffers in the heap, where freed memory is reused; a higher trim threshold stops the heap from being
handed back to the kernel after every burst. Memory is not lost: it stays in the process for the next one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's upper bound for M_MMAP_THRESHOLD on 64-bit
TRIM_THRESHOLD_BYTES = 512 << 20

# The same settings as environment variables, so a child process has them from its first allocation.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD_BYTES)}


def tune_malloc() -> bool:
    """Apply the thresholds to this process (glibc only; elsewhere, or when the user set MALLOC_* already,
    nothing changes). Returns True if they were applied."""
    if any(k in os.environ for k in MALLOC_ENV):
        return False  # the operator's choice wins
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mmap_ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    return bool(mmap_ok) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
