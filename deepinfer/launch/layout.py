"""Which workers `deepinfer-launch up` starts when its command line does not say: one co-located worker or a
prefill/decode pair, chosen from the machine it runs on. Pure: `choose_layout` takes the machine's facts and
the user's explicit choices and returns the layout with the reason `up` prints; `machine_facts` reads the host.

Why co-located on a CPU host: `up` runs its workers on the CPU, and the supervisor gives each worker its share of
the cores (`supervisor.thread_shares`). A prefill/decode pair splits the cores in two; while one side has no work
its cores idle, and the decode side's batch runs on half the machine. One co-located worker batches prefill
chunks with decode steps on every core. Measured on a 2-core host (issue 38, `bench/bench_layouts.py`): the pair
gives 0.62-0.66x of the co-located worker's output tokens/s at 8-64 streams and about twice its TTFT.
Disaggregation pays where prefill and decode have compute of their own (separate devices or hosts): a topology
file places workers there, and `up --topology` runs it unchanged. Accelerators and memory are read and printed,
and they do not change the choice: `up`'s workers run on the CPU whatever else the host has, and a pair holds
the weights and a KV pool twice where one worker holds them once.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

MEASURED = "measured on 2 cores: a P/D pair gives 0.62-0.66x the tok/s, twice the TTFT"


@dataclass(frozen=True)
class MachineFacts:
    """What the layout is chosen from: the cores this process may run on, the accelerators the host has
    (GPUs: their device nodes), and its memory (None where unknown)."""

    cores: int
    accelerators: int = 0
    memory_bytes: int | None = None

    def summary(self) -> str:
        parts = [f"{self.cores} core{'s' if self.cores != 1 else ''}"]
        if self.accelerators:
            parts.append(f"{self.accelerators} accelerator{'s' if self.accelerators != 1 else ''} (unused: "
                         f"`up` runs its workers on the CPU)")
        else:
            parts.append("no accelerator")
        if self.memory_bytes is not None:
            parts.append(f"{self.memory_bytes / 2**30:.1f} GiB memory")
        return ", ".join(parts)


@dataclass(frozen=True)
class Layout:
    """The workers `up` starts: one co-located worker, or `num_prefill` prefill and `num_decode` decode
    workers; `reason` is the line `up` prints about it."""

    disaggregated: bool
    num_prefill: int
    num_decode: int
    reason: str

    def workers(self) -> str:
        if not self.disaggregated:
            return "one co-located worker (prefill and decode)"
        return f"{self.num_prefill} prefill + {self.num_decode} decode worker{'s' if self.num_decode != 1 else ''}"


class LayoutConflict(ValueError):
    """The explicit choices contradict each other (a co-located worker and a P/D pair)."""


def choose_layout(facts: MachineFacts, colocated: bool = False, num_prefill: int | None = None,
                  num_decode: int | None = None) -> Layout:
    """The layout for `facts`; explicit choices win: `colocated` (--colocated), `num_prefill` / `num_decode`
    (--prefill / --decode; either one given asks for a pair, the other side then 1). Both kinds given raise
    LayoutConflict."""
    asked_pair = num_prefill is not None or num_decode is not None
    if colocated and asked_pair:
        raise LayoutConflict("--colocated runs one worker doing prefill and decode, and --prefill/--decode ask for "
                             "a P/D pair: give one or the other")
    if colocated:
        return Layout(False, 0, 0, "as asked (--colocated)")
    if asked_pair:
        p, d = num_prefill if num_prefill is not None else 1, num_decode if num_decode is not None else 1
        if p < 1 or d < 1:
            raise LayoutConflict(f"a P/D pair needs at least one prefill and one decode worker (got --prefill {p} "
                                 f"--decode {d}); --colocated for one worker doing both")
        return Layout(True, p, d, f"as asked (--prefill {p} --decode {d})")
    return Layout(False, 0, 0, f"{facts.summary()}: one worker on every core beats a P/D pair splitting them "
                               f"({MEASURED}); --prefill/--decode ask for a pair")


def machine_facts() -> MachineFacts:
    """This host's facts: the CPUs this process may use (its affinity mask, which containers and taskset
    narrow), the NVIDIA devices under /dev, and the physical memory."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    return MachineFacts(max(1, cores), count_accelerators(Path("/dev")), memory_bytes())


def count_accelerators(dev: Path) -> int:
    """GPUs whose device nodes are in `dev` (nvidia0, nvidia1, ...), without loading a driver library."""
    try:
        return sum(1 for p in dev.iterdir() if re.fullmatch(r"nvidia\d+", p.name))
    except OSError:
        return 0


def memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
