"""The twin's cost models: what the engines' forward passes, the KV moves and the cache tiers' I/O cost, as
small records read from a versioned JSON file (deepinfer/twin/costs/*.json). Pure: no clock, no I/O but
`load_costs`/`save_costs`.

A cost file is calibrated, not assumed: `python -m bench.twin_calibrate` measures the real engine, the real
TieredStore and a ZeroMQ link on the machine at hand and fits these coefficients; the file records the machine,
the date, the command and, per record, where its figures came from (`sources`). A twin run is only as good as
its file, so bench/twin_replay.py prints which one it used and the validation against the real mesh says how
far off it is.

The shapes (all seconds; linear, so fitting is least squares and evaluation is a few multiply-adds):

* engine step: fixed + Σ_prefill-chunks [n · prefill_token_s + n · (start + n/2) · prefill_attn_s]
  + Σ_decode-rows [decode_row_s + context · decode_context_s], where a chunk of n new tokens starting at
  position `start` (its cached or earlier-computed prefix) attends to about start + n/2 tokens per token;
* a link (a hop between services, a KV transport, a tier read or write): latency_s + bytes / bytes_per_s.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["COSTS_VERSION", "CostModel", "LinkCosts", "StepCosts", "TierCosts", "load_costs", "save_costs",
           "load_figures", "COSTS_DIR"]

COSTS_VERSION = 1
COSTS_DIR = Path(__file__).parent / "costs"


class CostFileError(ValueError):
    """A cost file of another version, or with a missing or ill-typed field; the message names it."""


@dataclass(frozen=True)
class StepCosts:
    """One engine step (schedule, forward, sample), by what it computes."""

    fixed_s: float
    prefill_token_s: float  # per prompt token computed
    prefill_attn_s: float  # per (token computed × token attended)
    decode_row_s: float  # per decode row (one new token of a running stream)
    decode_context_s: float  # per context token a decode row attends to

    def seconds(self, prefill_chunks: Iterable[tuple[int, int]], decode_contexts: Iterable[int]) -> float:
        """`prefill_chunks`: (new tokens, start position) per prompt chunk; `decode_contexts`: the context
        length of each decode row. An empty step costs nothing (the engine does not run one)."""
        s = 0.0
        any_work = False
        for n, start in prefill_chunks:
            any_work = True
            s += n * self.prefill_token_s + n * (start + n / 2) * self.prefill_attn_s
        for ctx in decode_contexts:
            any_work = True
            s += self.decode_row_s + ctx * self.decode_context_s
        return s + self.fixed_s if any_work else 0.0


@dataclass(frozen=True)
class LinkCosts:
    latency_s: float
    bytes_per_s: float

    def seconds(self, nbytes: int = 0) -> float:
        return self.latency_s + (nbytes / self.bytes_per_s if nbytes else 0.0)


@dataclass(frozen=True)
class TierCosts:
    read: LinkCosts
    write: LinkCosts


@dataclass(frozen=True)
class CostModel:
    name: str
    machine: str  # the CPU / GPU the figures were measured on, as the calibration saw it
    block_nbytes: int  # one KV block's bytes in the measured configuration (the model's KV, its dtype)
    step: StepCosts
    hop: LinkCosts  # one small message between two services (a request's way through the mesh: several)
    transports: dict[str, LinkCosts]  # KV transfer by transport: "inproc", "ipc", "tcp", "rdma"…
    host: TierCosts  # the cache daemon's DRAM tier
    disk: TierCosts  # its disk tier
    sources: dict[str, str] = field(default_factory=dict)  # record name → how its figures were obtained
    version: int = COSTS_VERSION

    def transfer_s(self, nbytes: int, transport: str) -> float:
        link = self.transports.get(transport)
        if link is None:
            raise KeyError(f"cost model {self.name!r} has no transport {transport!r} "
                           f"(it has {sorted(self.transports)})")
        return link.seconds(nbytes)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _link(d: Mapping[str, Any], where: str) -> LinkCosts:
    try:
        return LinkCosts(float(d["latency_s"]), float(d["bytes_per_s"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise CostFileError(f"{where}: needs latency_s and bytes_per_s ({exc})") from exc


def _tier(d: Mapping[str, Any], where: str) -> TierCosts:
    return TierCosts(_link(d["read"], f"{where}.read"), _link(d["write"], f"{where}.write"))


def from_json(d: Mapping[str, Any], where: str = "cost file") -> CostModel:
    if d.get("version") != COSTS_VERSION:
        raise CostFileError(f"{where}: version {d.get('version')!r}, this build reads {COSTS_VERSION}")
    try:
        step = StepCosts(**{k: float(v) for k, v in d["step"].items()})
        return CostModel(
            name=str(d["name"]), machine=str(d["machine"]), block_nbytes=int(d["block_nbytes"]), step=step,
            hop=_link(d["hop"], f"{where}: hop"),
            transports={k: _link(v, f"{where}: transports.{k}") for k, v in d["transports"].items()},
            host=_tier(d["host"], f"{where}: host"), disk=_tier(d["disk"], f"{where}: disk"),
            sources={str(k): str(v) for k, v in d.get("sources", {}).items()}, version=COSTS_VERSION)
    except (KeyError, TypeError) as exc:
        raise CostFileError(f"{where}: missing or ill-typed field ({exc!r})") from exc


def load_costs(path: str | Path) -> CostModel:
    """A cost file by path, or by name under deepinfer/twin/costs/ ("cpu-smollm2" → cpu-smollm2.json)."""
    p = Path(path)
    if not p.suffix and not p.exists():
        p = COSTS_DIR / f"{p}.json"
    return from_json(json.loads(p.read_text()), str(p))


def save_costs(model: CostModel, path: str | Path, extra: Mapping[str, Any] | None = None) -> None:
    """Write `model` (plus `extra` keys: the calibration's date, command, raw measurements)."""
    Path(path).write_text(json.dumps({**model.to_json(), **(extra or {})}, indent=2) + "\n")


def load_figures(path: str | Path) -> dict[str, dict[str, Any]]:
    """A published-figures file (costs/h800-deepseek.json): name → {value, unit, source}; every figure
    must name its source."""
    d = json.loads(Path(path).read_text())
    if d.get("version") != COSTS_VERSION:
        raise CostFileError(f"{path}: version {d.get('version')!r}, this build reads {COSTS_VERSION}")
    figures = d.get("figures", {})
    for name, fig in figures.items():
        if not isinstance(fig, dict) or "value" not in fig or not fig.get("source"):
            raise CostFileError(f"{path}: figure {name!r} needs a value and a source")
    return figures
