"""The control channel of a worker group: bytes and KV tensors between the leader (rank 0) and its
followers over a gloo process group, and how a rank joins that group.

Everything crosses as uint8 tensors (msgpack bytes, KV bytes), never as pickled objects:
* `broadcast(payload)`: the leader's round to every rank — its length (int64), then the bytes;
* `report(payload)` / `collect()`: each follower's answer to the leader, point to point (lengths differ);
* `send_kv` / `recv_kv`: one KV tensor between the leader and one rank, as its raw bytes.

Failure: a rank that died closes its sockets, and the next operation of every peer raises at once; a rank
that hangs is noticed after the group's timeout (`EngineConfig.ep_timeout_s`). Either way the operation
raises `GroupBroken` and the group is over: the leader exits nonzero and the supervisor restarts every rank.

The timeout bounds how long any rank waits for another, so it must exceed the longest engine step (a
follower waits for the leader's next round while the leader steps) and the idle leader's keep-alive
period (`group_engine.KEEPALIVE_S`); 300 s does both with room to spare.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from deepinfer.config.engine import DEFAULT_EP_TIMEOUT_S
from deepinfer.engine.ep.group import EpGroup, init_ep_group


class GroupBroken(RuntimeError):
    """A collective of the group failed or timed out: a rank is gone, and so is the group."""


class ControlChannel:
    """Bytes and tensors between rank 0 and the other ranks of `group` (one gloo group, all ranks)."""

    def __init__(self, rank: int, size: int, group: Any = None, ep_group: EpGroup | None = None) -> None:
        self.rank = rank
        self.size = size
        self.group = group  # None: the default (world) group
        self.ep_group = ep_group  # closed with the channel: the channel's group is one of its groups

    def broadcast(self, payload: bytes | None = None) -> bytes:
        """Leader: send `payload` to every rank; follower: the leader's payload."""
        def run() -> bytes:
            n = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
            dist.broadcast(n, 0, group=self.group)
            buf = _bytes_tensor(payload) if self.rank == 0 else torch.empty(int(n.item()), dtype=torch.uint8)
            if buf.numel():
                dist.broadcast(buf, 0, group=self.group)
            return payload if payload is not None else buf.numpy().tobytes()
        return self._guard(run, "broadcast")

    def report(self, payload: bytes) -> None:
        """Follower → leader."""
        def run() -> None:
            dist.send(torch.tensor([len(payload)], dtype=torch.int64), 0, group=self.group)
            if payload:
                dist.send(_bytes_tensor(payload), 0, group=self.group)
        self._guard(run, "report")

    def collect(self, src: int) -> bytes:
        """Leader: follower `src`'s report."""
        def run() -> bytes:
            n = torch.zeros(1, dtype=torch.int64)
            dist.recv(n, src, group=self.group)
            buf = torch.empty(int(n.item()), dtype=torch.uint8)
            if buf.numel():
                dist.recv(buf, src, group=self.group)
            return buf.numpy().tobytes()
        return self._guard(run, f"collect from rank {src}")

    def send_kv(self, kv: torch.Tensor, dst: int) -> None:
        data = kv.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1)
        if data.numel():
            self._guard(lambda: dist.send(data, dst, group=self.group), f"send KV to rank {dst}")

    def recv_kv(self, src: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        kv = torch.empty(shape, dtype=dtype)
        if kv.numel():
            data = kv.view(torch.uint8).reshape(-1)
            self._guard(lambda: dist.recv(data, src, group=self.group), f"receive KV from rank {src}")
        return kv

    def _guard(self, fn: Any, what: str) -> Any:
        try:
            return fn()
        except GroupBroken:
            raise
        except Exception as exc:  # gloo raises RuntimeError for a closed peer and for a timeout alike
            raise GroupBroken(f"rank {self.rank}: {what} failed: {exc}") from exc

    def close(self) -> None:
        """Leave the group (every process group of this process). Safe after a peer died."""
        if self.ep_group is not None:
            self.ep_group.close()
        elif dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a broken group may not tear down cleanly; the process is ending anyway
                pass


def _bytes_tensor(payload: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)


def join_group(size: int, rank: int, master: str, device: str = "cpu",
               timeout_s: float = DEFAULT_EP_TIMEOUT_S) -> tuple[ControlChannel, EpGroup]:
    """Join the group of `size` ranks whose rendezvous is `master` ("host:port", served by rank 0); returns
    the control channel and the expert-parallel group the engine of an MoE model runs over. The channel
    uses the group's gloo control group (`EpGroup.cpu_group`), apart from the expert traffic, and closing
    it leaves the whole group. `timeout_s` bounds the rendezvous and every later operation."""
    ep_group = init_ep_group(size, rank, master, device, timeout_s=timeout_s)
    return ControlChannel(rank, size, ep_group.cpu_group, ep_group), ep_group
