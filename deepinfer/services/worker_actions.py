"""What the worker's pure core (`worker_core.WorkerCore`) asks its shell (`worker.WorkerService`) to do: messages
to send and engine commands to run, performed in the order the core returns them. An engine command's result
comes back to the core as an event (`on_prefix_loaded`, `on_exported`, `on_installed`, ...), as each record
names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepinfer.protocol.messages import (
    DetokenizeBatch,
    ErrorReply,
    KvAck,
    KvReserve,
    KvReserveReply,
    KvTransfer,
    PrefillDone,
    PrefillJob,
)


@dataclass(frozen=True)
class ToRouter:
    msg: PrefillDone | ErrorReply


@dataclass(frozen=True)
class ToTokenizer:
    tokenizer: str
    batch: DetokenizeBatch


@dataclass(frozen=True, eq=False)
class ToDecode:
    """Prefill side → decode worker `peer`, on this worker's DEALER to it."""

    peer: str
    msg: KvReserve | KvTransfer


@dataclass(frozen=True)
class ToPrefill:
    """Decode side → the prefill worker whose DEALER has this identity, on the KV ROUTER."""

    identity: bytes
    msg: KvReserveReply | KvAck


@dataclass(frozen=True)
class AddJob:
    """Load the job's cached prefix (with a cache daemon; then ask `on_prefix_loaded`), add it to the engine;
    a failure goes to `on_add_failed`."""

    job: PrefillJob
    prompt: list[int]
    resumed: list[int]
    prefill_only: bool


@dataclass(frozen=True)
class ExportKv:
    """Export a held request's KV; the result goes to `on_exported`, a failure to `on_handoff_error`."""

    request_id: str


@dataclass(frozen=True, eq=False)
class Install:
    """Add a transferred request to the engine under its lease; then `on_installed` or `on_install_failed`."""

    identity: bytes
    transfer: KvTransfer
    prompt: list[int]
    resumed: list[int]


@dataclass(frozen=True)
class Release:
    request_id: str  # free a held (handed-off or failed) request's blocks


@dataclass(frozen=True)
class CancelReservation:
    lease_id: str


@dataclass(frozen=True)
class Abort:
    request_id: str  # whatever the engine holds of it: running, held or reserved


@dataclass(frozen=True)
class AbortAll:
    """Abort everything the engine holds but the requests in `keep` (kept through a router restart)."""

    keep: frozenset[str] = frozenset()


@dataclass(frozen=True, eq=False)
class OfferBlocks:
    """Offer full blocks to the cache daemon (write-behind); `kv` is a handoff's export, else the pool's."""

    request_id: str
    block_hashes: list[bytes]
    kv: Any = None


Action = (ToRouter | ToTokenizer | ToDecode | ToPrefill | AddJob | ExportKv | Install | Release
          | CancelReservation | Abort | AbortAll | OfferBlocks)
