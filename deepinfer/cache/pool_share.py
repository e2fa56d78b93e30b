"""One capacity budget for a pool directory that several cache daemons write (on one host or many): each daemon's
share of it, agreed without locks or a coordinator.

Every daemon keeps a usage note in `<pool>/<namespace>/.usage/<daemon name>`: the bytes its disk tier indexes and a
counter, rewritten (atomically: a temp file renamed over it) at every round, a few seconds apart. In a round a
daemon reads every note, sums the usage of the live ones and, when the sum passes the budget's high watermark,
shrinks its own tier in proportion, to `used × budget × low / sum`. Every daemon applying the same factor to itself
brings the pool under the budget within one round; nobody evicts for another.

* Live notes: a note whose counter has not changed for `stale_s` of this daemon's own clock belongs to a daemon that
  stopped. Its files stay on disk (the next daemon opening under its name indexes them again, and others adopt
  what they look up), but its share no longer counts. No host's clock is compared with another's (file mtimes
  are not read): a host whose clock is off changes nothing.
* A file that two daemons index (one adopted what the other wrote) counts in both sums: the pool errs on the
  small side.
* Between rounds the daemons may write past the budget by what they store in one period: size the budget with
  that margin below what the mount can hold.

Pure apart from the notes' file I/O; `TieredStore.balance_pool` drives it from the daemon's timer.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

NOTES_DIR = ".usage"  # under the namespace directory: not a shard (two hex digits), so the disk tier ignores it
STALE_S = 60.0


@dataclass
class _Seen:
    counter: int
    used: int
    changed_at: float  # this daemon's monotonic time when the counter last changed


@dataclass
class PoolShare:
    """This daemon's part in a pool's budget. `name`: the daemon's instance name (its note's file name)."""

    directory: Path  # the namespace's directory in the pool; the notes live in its NOTES_DIR
    name: str
    budget_bytes: int
    high_watermark: float = 0.95
    low_watermark: float = 0.90
    stale_s: float = STALE_S
    rounds: int = 0
    shrinks: int = 0  # rounds that found the pool over budget
    _seen: dict[str, _Seen] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0:
            raise ValueError(f"a pool budget must be positive, got {self.budget_bytes} bytes")
        if "/" in self.name or self.name.startswith("."):
            raise ValueError(f"a daemon name cannot name a note file: {self.name!r}")

    @property
    def notes(self) -> Path:
        return self.directory / NOTES_DIR

    def target(self, used_bytes: int, now: float | None = None) -> int | None:
        """One round: write this daemon's note (`used_bytes`), read the others'. The bytes this daemon's tier
        must shrink to, or None while the live daemons' sum is within the high watermark. Raises OSError when
        the pool cannot be written or read (the caller skips the round)."""
        now = time.monotonic() if now is None else now
        self.rounds += 1
        self._write(used_bytes)
        total = used_bytes + sum(seen.used for seen in self._read(now).values())
        if total <= self.high_watermark * self.budget_bytes:
            return None
        self.shrinks += 1
        return int(used_bytes * self.low_watermark * self.budget_bytes / total)

    def _write(self, used_bytes: int) -> None:
        self.notes.mkdir(parents=True, exist_ok=True)
        path = self.notes / self.name
        temp = self.notes / f".{self.name}.{os.getpid()}.tmp"
        temp.write_text(json.dumps({"used": used_bytes, "counter": self.rounds}))
        os.replace(temp, path)

    def _read(self, now: float) -> dict[str, _Seen]:
        """The other daemons' notes that changed within `stale_s`."""
        live: dict[str, _Seen] = {}
        for entry in os.scandir(self.notes):
            if entry.name == self.name or entry.name.startswith("."):
                continue
            try:
                note = json.loads(Path(entry.path).read_text())
                counter, used = int(note["counter"]), int(note["used"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # being replaced, or not a note: next round
            seen = self._seen.get(entry.name)
            if seen is None or seen.counter != counter:
                seen = self._seen[entry.name] = _Seen(counter, used, now)
            if now - seen.changed_at <= self.stale_s:
                live[entry.name] = seen
        return live
