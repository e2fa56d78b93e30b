"""Where the multiprocess directory is read, and the one place prometheus_client's value class is chosen.

prometheus_client picks how a sample is stored when it is imported (`values.ValueClass`): a float behind
a lock, or an mmap file under `PROMETHEUS_MULTIPROC_DIR` when that variable is set. A process whose variable
was set after that import would silently keep its samples to itself. `sync_value_class()` re-reads the
variable and swaps the class to match; every recorder calls it before it creates a labelled child, which is
when the storage of a sample is made (the parent metrics defined at import hold no value: all of ours carry
labels). So the variable must be set before the first recorder binds, not necessarily before the import.
"""

from __future__ import annotations

import glob
import os
import threading
from pathlib import Path

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

_lock = threading.Lock()
_synced_for: str | None | bool = False  # the directory the value class was last chosen for (False: never)


def multiproc_dir() -> Path | None:
    """The directory every process of this host's mesh writes its samples to, or None (single-process)."""
    value = os.environ.get(MULTIPROC_ENV)
    return Path(value) if value else None


def sync_value_class() -> None:
    """Make prometheus_client store new samples the way the variable says now (idempotent, cheap).

    Samples created before a change keep their old storage; in practice the variable is set once, by the
    launcher, before the process starts, and this only corrects an import that came earlier.
    """
    global _synced_for
    current = os.environ.get(MULTIPROC_ENV) or None
    if current == _synced_for:
        return
    from prometheus_client import values

    with _lock:
        if current == _synced_for:
            return
        multiprocess = bool(getattr(values.ValueClass, "_multiprocess", False))
        if current is not None:
            Path(current).mkdir(parents=True, exist_ok=True)
        if (current is not None) != multiprocess or (current is not None and _synced_for not in (False, None)):
            values.ValueClass = values.get_value_class()
        _synced_for = current


def prepare_dir(path: Path) -> None:
    """Create `path`, or empty it of a previous run's sample files (call before starting the children).

    A file left by a dead process would otherwise be summed into this run's counters.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for stale in glob.glob(str(path / "*.db")):
        try:
            os.remove(stale)
        except FileNotFoundError:
            pass


def process_exited(pid: int) -> None:
    """Drop the live gauges of a child that exited (its counters and histograms stay: they are history).

    A no-op without a multiprocess directory (then nothing of another process is exported anyway).
    """
    directory = multiproc_dir()
    if directory is None or not directory.is_dir():
        return
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, str(directory))
