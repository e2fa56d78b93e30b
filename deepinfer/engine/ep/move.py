"""Moving an expert-parallel group to a new `ExpertPlacement` while it serves.

A move has three parts, and each rank's old placement keeps serving until the last one:

1. **stage** (`PlacementStager.stage`, one per rank's engine): the rank works out which of its local slots
   change (`changed_rows`) and a background thread loads the incoming experts' weights from the model
   files (`ExpertSource`), checks each against the digest this rank recorded when it loaded the model
   (`expert_digests`), and converts them to the bank's dtype. An expert the rank already holds in another
   row is copied from that row instead (snapshotted at stage time).
2. **agree** (`PlacementMoves` in deepinfer.services.group.moves, on rank 0): the leader sends `Op.STAGE` to
   every follower and stages its own engine; every report carries the rank's staging state (`Report.staged`).
   When every rank reports the version ready, the next round carries `Round.switch`; when any reports an
   error, everyone gets `Op.UNSTAGE` and the move ends failed (the old placement stays).
3. **switch** (`PlacementStager.switch`, on the engine thread between steps, before the round's step on
   every rank): the staged rows are copied into the banks in place, every MoE layer's executor gets the
   new replica tables in the same call, and the engine's `ep_placement` becomes the new table.

Why outputs never change: replicas hold identical weights (the digest check refuses anything else), and
every rank switches before the same step, so at every step all ranks route with one table; only which
rank computes an assignment changes, and the executor returns every assignment's output to its token's
rank, which adds them in ascending expert id whoever computed them (`ep_moe`), so the sums are bit-identical
under any placement.

The background thread never calls `torch.set_num_threads` (under OpenMP that is process-wide: it would
shrink the step's threads too). It keeps each conversion below ATen's parallel grain (`_CHUNK`
elements), so every op it runs stays on one core; file reads and hashing are outside torch.

A GGUF model has no per-tensor access here: staging loads the whole file (`load_model_weights`) for the
experts it needs — slow (the whole model is read and dequantised) but correct.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors import safe_open

from deepinfer.config.model import ConfigError, ModelConfig
from deepinfer.engine.ep.experts import EpStats, ExpertParallelExperts, local_slots, redundant_replicas, shard_experts
from deepinfer.engine.ep.group import EpGroup
from deepinfer.engine.ep.placement import EMPTY, ExpertPlacement
from deepinfer.engine.models.moe import moe_blocks
from deepinfer.loading.gguf import UnsupportedWeightError
from deepinfer.loading.weights import (
    _HF_FUSED_EXPERTS,
    LoadedModel,
    _safetensors_files,
    hf_to_our_name,
    load_model_weights,
)

log = structlog.get_logger("deepinfer.expert_move")

_CHUNK = 16384  # elements per conversion op: below ATen's grain (32768), so one thread does it
# The staging thread works at most this share of the wall time (it sleeps after each layer in proportion),
# so on a CPU rank, whose step uses every core it has, a move costs the step little: a longer move instead.
STAGING_DUTY = 0.25
_PROJS = ("gate_proj", "up_proj", "down_proj")


class PlacementRefused(ValueError):
    """A placement this group or engine will not move to; the message says why."""


@dataclass(frozen=True)
class MoveResult:
    version: int
    ok: bool  # True: every rank switched to `version`; False: the move was dropped, old placement kept
    reason: str = ""


# -- what a rank was loaded with --------------------------------------------------------------------------


def moe_layer_indices(config: ModelConfig) -> list[int]:
    """The model layer of each MoE layer, in placement order (the sparse layers, in model order)."""
    moe = config.moe
    return [] if moe is None else [i for i in range(config.num_layers) if moe.is_sparse_layer(i)]


def expert_digest(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> bytes:
    """blake2b over one expert's fp32 gate, up and down projections (shapes and bytes)."""
    h = hashlib.blake2b(digest_size=16)
    for t in (gate, up, down):
        t = t.detach().to("cpu", torch.float32).contiguous()
        h.update(repr(tuple(t.shape)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.digest()


def expert_digests(state_dict: Mapping[str, torch.Tensor], config: ModelConfig) -> list[list[bytes]]:
    """Per MoE layer, per logical expert, `expert_digest` of the weights in `state_dict` (our names)."""
    moe = config.moe
    if moe is None:
        return []
    return [[expert_digest(*(state_dict[f"layers.{layer}.experts.{e}.{p}"] for p in _PROJS))
             for e in range(moe.num_experts)] for layer in moe_layer_indices(config)]


# -- reading experts from the model files ---------------------------------------------------------------


class ExpertSource:
    """Reads given experts of one model layer from the model files (a Hugging Face directory or a GGUF
    file) as fp32 (gate, up, down), without loading the rest of a Hugging Face model."""

    def __init__(self, path: Path, config: ModelConfig) -> None:
        self.path = Path(path)
        self.config = config

    def read(self, layer: int, experts: Sequence[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Experts `experts` of model layer `layer`; raises (FileNotFoundError, KeyError, ...) when the
        files no longer hold them."""
        if self.path.is_file() and self.path.suffix == ".gguf":
            state = load_model_weights(self.path).state_dict  # the whole file: see the module docstring
            return {e: tuple(state[f"layers.{layer}.experts.{e}.{p}"] for p in _PROJS)  # type: ignore[misc]
                    for e in experts}
        names, fused = self._index(layer)
        with contextlib.ExitStack() as stack:
            opened: dict[Path, Any] = {}

            def file(path: Path) -> Any:
                if path not in opened:
                    opened[path] = stack.enter_context(safe_open(str(path), framework="pt"))
                return opened[path]

            out = {}
            for e in experts:
                got: dict[str, torch.Tensor] = {}
                for p in _PROJS:
                    ours = f"layers.{layer}.experts.{e}.{p}"
                    if ours in names:
                        shard, hf = names[ours]
                        got[p] = _fp32(file(shard).get_tensor(hf))
                        continue
                    kind = "down_proj" if p == "down_proj" else "gate_up_proj"
                    if kind not in fused:
                        raise KeyError(f"the model files hold no {ours}")
                    shard, hf = fused[kind]
                    row = _fp32(file(shard).get_slice(hf)[e])
                    got[p] = row if kind == "down_proj" else row.chunk(2, dim=0)[p == "up_proj"]
                out[e] = (got["gate_proj"], got["up_proj"], got["down_proj"])
            return out

    def _index(self, layer: int) -> tuple[dict[str, tuple[Path, str]], dict[str, tuple[Path, str]]]:
        """Where layer `layer`'s expert tensors are: per-expert names (ours) and fused kinds, to (file, HF name)."""
        names: dict[str, tuple[Path, str]] = {}
        fused: dict[str, tuple[Path, str]] = {}
        mla = self.config.mla is not None
        shards = _safetensors_files(self.path)
        if not shards:
            raise FileNotFoundError(f"no *.safetensors files in {str(self.path)!r} any more")
        for shard in shards:
            with safe_open(str(shard), framework="pt") as f:
                for hf in f.keys():
                    m = _HF_FUSED_EXPERTS.fullmatch(hf)
                    if m:
                        if int(m.group(1)) == layer:
                            fused[m.group(2)] = (shard, hf)
                        continue
                    if f"layers.{layer}." not in hf or ".experts." not in hf:
                        continue
                    try:
                        names[hf_to_our_name(hf, mla)] = (shard, hf)
                    except UnsupportedWeightError:
                        continue
        return names, fused


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for a contiguous `dst`, `_CHUNK` elements per op (one thread each)."""
    flat_dst, flat_src = dst.view(-1), src.reshape(-1)
    for i in range(0, flat_src.numel(), _CHUNK):
        flat_dst[i : i + _CHUNK].copy_(flat_src[i : i + _CHUNK])


def _convert(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` as a contiguous host `dtype` copy, converted a chunk per op."""
    out = torch.empty(t.shape, dtype=dtype)
    _copy_into(out, t)
    return out


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 and t.is_contiguous() else _convert(t, torch.float32)


# -- one rank: stage, then switch -------------------------------------------------------------------------


def changed_rows(current: ExpertPlacement, new: ExpertPlacement, layer: int, rank: int) -> dict[int, int]:
    """`rank`'s local slots of MoE layer `layer` whose expert changes: row -> its new expert (-1: emptied)."""
    old, now = local_slots(current, layer, rank), local_slots(new, layer, rank)
    return {row: e for row, (before, e) in enumerate(zip(old, now)) if before != e}


def same_shape(a: ExpertPlacement, b: ExpertPlacement) -> bool:
    return (a.num_ranks, a.num_experts, a.slots_per_rank, a.num_layers) == \
        (b.num_ranks, b.num_experts, b.slots_per_rank, b.num_layers)


def check_successor(current: ExpertPlacement | None, new: ExpertPlacement) -> None:
    """PlacementRefused unless `new` can replace `current`: same group shape, a newer version."""
    if current is None:
        raise PlacementRefused("this is not an expert-parallel group of a mixture-of-experts model")
    if not same_shape(current, new):
        raise PlacementRefused(
            f"placement for {new.num_ranks} ranks of {new.slots_per_rank} slots, {new.num_layers} MoE layers of "
            f"{new.num_experts} experts; the group runs {current.num_ranks} ranks of {current.slots_per_rank} "
            f"slots, {current.num_layers} MoE layers of {current.num_experts} experts")
    if new.version <= current.version:
        raise PlacementRefused(f"placement version {new.version} is not newer than the current {current.version}")


Row = tuple[int, torch.Tensor | None, torch.Tensor | None]  # (expert, gate_up, down), or (-1, None, None)


@dataclass
class _Staging:
    """One placement being staged. The thread writes `rows`/`error` then sets `done`; the engine thread
    reads them only after `done` (the Event orders the accesses)."""

    placement: ExpertPlacement
    base_version: int  # the placement it was staged against
    rows: list[dict[int, Row]]  # per MoE layer
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    thread: threading.Thread | None = None  # the loading thread (joined by PlacementStager.close)


class PlacementStager:
    """A rank's side of a move (see the module docstring): `stage` in the background, then `switch` on
    the engine thread. Every method is called on the engine thread."""

    def __init__(self, executors: Sequence[ExpertParallelExperts], placement: ExpertPlacement, source: ExpertSource,
                 digests: Sequence[Sequence[bytes]], rank: int) -> None:
        layers = moe_layer_indices(source.config)
        if len(layers) != len(executors) or len(digests) != len(executors):
            raise ConfigError(f"{len(executors)} sparse blocks, but the config has {len(layers)} MoE layers")
        self.executors = list(executors)
        self.placement = placement
        self.source = source
        self.digests = digests
        self.rank = rank
        self._model_layers = layers
        self._staging: _Staging | None = None
        self._loading: list[_Staging] = []  # stagings whose thread may still run (dropped ones included)

    def stage(self, placement: ExpertPlacement) -> None:
        """Start loading `placement`'s new experts for this rank (any earlier staging is dropped);
        PlacementRefused for a table of another group shape or not newer than the current one."""
        check_successor(self.placement, placement)
        self.drop()
        rows: list[dict[int, Row]] = []
        wanted: list[dict[int, int]] = []  # per layer: row -> expert to read from the files
        for i, ex in enumerate(self.executors):
            changes = changed_rows(self.placement, placement, i, self.rank)
            bank_rows = ex.bank.slot_of.tolist()
            layer_rows: dict[int, Row] = {}
            from_files: dict[int, int] = {}
            for row, e in changes.items():
                if e == EMPTY:
                    layer_rows[row] = (EMPTY, None, None)
                elif bank_rows[e] >= 0:  # already here, in a row this move rewrites: snapshot it now
                    src = bank_rows[e]
                    layer_rows[row] = (e, ex.bank.gate_up[src].clone(), ex.bank.down[src].clone())
                else:
                    from_files[row] = e
            rows.append(layer_rows)
            wanted.append(from_files)
        staging = _Staging(placement, self.placement.version, rows)
        self._staging = staging
        self._loading = [s for s in self._loading if s.thread is not None and s.thread.is_alive()] + [staging]
        dtypes = [(ex.bank.gate_up.dtype, ex.bank.gate_up.device) for ex in self.executors]
        staging.thread = threading.Thread(target=self._load, args=(staging, wanted, dtypes), daemon=True,
                                          name=f"stage-placement-v{placement.version}")
        staging.thread.start()

    def _load(self, staging: _Staging, wanted: list[dict[int, int]],
              dtypes: list[tuple[torch.dtype, torch.device]]) -> None:
        """The background thread: read, check and convert every expert `wanted` into `staging.rows`."""
        try:
            stream = torch.cuda.Stream(dtypes[0][1]) if dtypes and dtypes[0][1].type == "cuda" else None
            for i, from_files in enumerate(wanted):
                if staging.cancelled.is_set():
                    return
                if not from_files:
                    continue
                began = time.monotonic()
                layer = self._model_layers[i]
                read = self.source.read(layer, sorted(set(from_files.values())))
                for row, e in from_files.items():
                    gate, up, down = read[e]
                    if expert_digest(gate, up, down) != self.digests[i][e]:
                        raise PlacementRefused(
                            f"expert {e} of model layer {layer} in the model files differs from the weights this "
                            "rank was loaded with (the files changed on disk); not serving different weights")
                    dtype, device = dtypes[i]
                    gate_up = torch.empty((gate.shape[0] + up.shape[0], *gate.shape[1:]), dtype=dtype)
                    _copy_into(gate_up[: gate.shape[0]], gate)
                    _copy_into(gate_up[gate.shape[0] :], up)
                    down_t = _convert(down, dtype)
                    if stream is not None:
                        with torch.cuda.stream(stream):
                            gate_up, down_t = gate_up.to(device), down_t.to(device)
                    staging.rows[i][row] = (e, gate_up, down_t)
                if stream is None:
                    staging.cancelled.wait((time.monotonic() - began) * (1 / STAGING_DUTY - 1))
            if stream is not None:
                stream.synchronize()
        except Exception as exc:  # any failure fails the staging, never the engine
            staging.error = f"staging placement version {staging.placement.version} failed on rank " \
                            f"{self.rank}: {type(exc).__name__}: {exc}"
            log.warning("placement staging failed", version=staging.placement.version, error=staging.error)
        finally:
            staging.done.set()

    def status(self) -> tuple[int | None, str | None]:
        """(the staged version when every expert is loaded and checked, else None; the staging's error)."""
        s = self._staging
        if s is None or not s.done.is_set():
            return None, None
        return (None, s.error) if s.error is not None else (s.placement.version, None)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the current staging has finished (ready or failed); False on timeout or when
        nothing is staged. For tests and tools: the engine never waits."""
        s = self._staging
        return s is not None and s.done.wait(timeout)

    def switch(self, version: int) -> ExpertPlacement:
        """Move every MoE layer to the staged placement `version` (its rows copied into the banks in
        place, the executors' tables rewritten); the new current placement. RuntimeError when that
        version is not staged and ready here: a group that asked for it is out of step."""
        s = self._staging
        if s is None or self.status() != (version, None) or s.base_version != self.placement.version:
            raise RuntimeError(f"rank {self.rank} has no placement version {version} staged and ready "
                               f"(status {self.status()}, current version {self.placement.version})")
        for ex, rows in zip(self.executors, s.rows):
            ex.bank.install(rows)
            ex.switch(s.placement)
        device = self.executors[0].bank.down.device if self.executors else None
        if device is not None and device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # the staged rows may be freed after this
        self._staging = None
        self.placement = s.placement
        return s.placement

    def drop(self) -> None:
        """Forget any staging (a thread still loading stops at its next layer; its result is discarded)."""
        if self._staging is not None:
            self._staging.cancelled.set()
            self._staging = None

    def close(self, timeout_s: float = 30.0) -> bool:
        """Drop any staging and wait for every loading thread to end; True if all did. A process must
        call it before it exits: a thread still inside torch or safetensors when the interpreter
        finalises is torn down mid C++ call, and the process aborts ("exception not rethrown")."""
        self.drop()
        loading, self._loading = self._loading, []
        deadline = time.monotonic() + timeout_s
        for s in loading:
            if s.thread is not None:
                s.thread.join(max(0.0, deadline - time.monotonic()))
        return not any(s.thread is not None and s.thread.is_alive() for s in loading)


def shard_movable(model: object, loaded: LoadedModel, group: EpGroup, placement: ExpertPlacement | None,
                  redundant: int | None) -> tuple[ExpertPlacement, EpStats, PlacementStager]:
    """`shard_experts` for an engine that can move (the default placement with
    `redundant_replicas(redundant, ...)` extra replicas), and its stager, holding the digests of the
    experts as loaded."""
    moe = loaded.config.moe
    if moe is None:
        shard_experts(model, group, placement)  # raises the ConfigError that says why (no sparse blocks)
        raise ConfigError("expert parallelism needs a mixture-of-experts model")
    extra = redundant_replicas(redundant, moe.num_experts, group.size) if placement is None else 0
    digests = expert_digests(loaded.state_dict, loaded.config)
    placement, stats = shard_experts(model, group, placement, redundant=extra)
    executors = [b.experts for b in moe_blocks(model)]
    assert all(isinstance(e, ExpertParallelExperts) for e in executors)
    stager = PlacementStager(executors, placement, ExpertSource(loaded.source, loaded.config),  # type: ignore[arg-type]
                             digests, group.rank)
    return placement, stats, stager
