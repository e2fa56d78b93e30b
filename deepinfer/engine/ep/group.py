"""The torch.distributed side of an expert-parallel group: one process per rank.

    group = init_ep_group(size=2, rank=r, master="127.0.0.1:29500")   # every rank, same size and master
    ...                                                              # engines step in lockstep
    group.close()

`init_ep_group` joins the tcp:// rendezvous at `master` (rank 0 hosts it) and makes:

* the process's default group — torch.distributed only creates explicit groups once one exists, so
  this module makes it, and nothing else here communicates over it;
* `group.data`: the expert traffic (all-to-all of token rows): gloo on CPU, NCCL on a cuda device;
* `group.cpu_group`: gloo, for host-side messages beside the data — a leader broadcasting commands,
  a termination vote. Its traffic never interleaves with `data`'s, so a control message cannot get
  in line behind (or between) an expert exchange.

More groups: `group.new_subgroup(backend)`. Creating a group is itself a collective over every rank,
so all ranks must create the same groups in the same order.

A rank that dies makes its peers' next collective raise (gloo: the connection closes, or the group's
`timeout_s` runs out) instead of waiting forever; the group is then unusable and every rank should close
it and exit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0


class ExpertParallelError(RuntimeError):
    """The group failed (a peer died, a collective timed out, a rank's forward raised mid-step): the
    ranks are no longer in lockstep and this engine cannot step again. `outputs`: the terminal outputs
    (finish reason error) of the requests the failed step was computing, for the caller to deliver."""

    def __init__(self, message: str, outputs: list[Any] | None = None) -> None:
        super().__init__(message)
        self.outputs: list[Any] = list(outputs or [])


@dataclass(frozen=True)
class EpGroup:
    """This process's membership of an expert-parallel group of `size` ranks."""

    size: int
    rank: int
    device: torch.device  # where this rank's experts and tensors live (cuda:rank on a GPU group)
    data: dist.ProcessGroup  # expert all-to-alls
    cpu_group: dist.ProcessGroup  # gloo, host-side control messages
    timeout_s: float = DEFAULT_TIMEOUT_S
    _extra: list[dist.ProcessGroup] = field(default_factory=list, repr=False, compare=False)

    def new_subgroup(self, backend: str = "gloo") -> dist.ProcessGroup:
        """Another group over all ranks (collective: every rank calls it, in the same order); `close`
        destroys it with the rest."""
        pg = dist.new_group(backend=backend, timeout=timedelta(seconds=self.timeout_s))
        self._extra.append(pg)
        return pg

    def close(self) -> None:
        """Destroy every group of this process (the default one too): after this the process may join
        another group. Safe to call twice, and after a peer died."""
        if not dist.is_initialized():
            return
        for pg in [*self._extra, self.cpu_group, self.data]:
            try:
                dist.destroy_process_group(pg)
            except (RuntimeError, ValueError):  # already gone, or broken by a dead peer
                pass
        self._extra.clear()
        dist.destroy_process_group()


def init_ep_group(size: int, rank: int, master: str, device: str = "cpu",
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> EpGroup:
    """Join group of `size` ranks as `rank` through the rendezvous at `master` ("host:port"). On
    `device` "cuda" rank r uses cuda:r and NCCL for the data; on "cpu" gloo carries everything.
    Blocks until every rank has joined (or `timeout_s` passes)."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside a group of {size}")
    host, sep, port = master.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"master must be host:port, got {master!r}")
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group; close it first")
    kind = torch.device(device).type
    if kind == "cuda":
        dev = torch.device("cuda", rank)
        torch.cuda.set_device(dev)
        backend, data_backend = "cpu:gloo,cuda:nccl", "nccl"
    elif kind == "cpu":
        dev, backend, data_backend = torch.device("cpu"), "gloo", "gloo"
    else:
        raise ValueError(f"expert parallelism runs on cpu or cuda, not {device!r}")
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=f"tcp://{master}", world_size=size, rank=rank, timeout=timeout)
    data = dist.new_group(backend=data_backend, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)
    return EpGroup(size, rank, dev, data, control, timeout_s)


def cpu_threads_per_rank(size: int, cores: int | None = None) -> int:
    """A CPU rank's share of the machine's cores when `size` ranks share it: cores // size, at least 1."""
    if cores is None:
        # The cores this process may run on (a cgroup or taskset may allow fewer than the machine has).
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // size)


def share_cpu_cores(size: int, cores: int | None = None) -> int:
    """Limit this process's torch threads to its share (`cpu_threads_per_rank`); returns the count."""
    n = cpu_threads_per_rank(size, cores)
    torch.set_num_threads(n)
    return n
