"""Mixture-of-experts decoders (Mixtral, Qwen2-MoE): Llama attention, sparse MLP blocks.

A sparse block routes each token to `num_experts_per_tok` experts (softmax over the router's logits,
top-k, optionally renormalised) and adds their SwiGLU outputs weighted by the routing weights; a
Qwen2-MoE block adds a shared expert every token passes through, scaled by a sigmoid gate.

The block is split where expert parallelism cuts it:

* `route_softmax_topk` turns router logits into a `Routing`: flat (token, expert, weight)
  assignments, T·k of them.
* `run_experts` computes the assignments whose expert an `ExpertBank` holds and returns their
  weighted sum per token, zero for tokens with nothing routed there. A bank may hold any subset of
  the logical experts; with all of them (the single-process case) the result is the whole routed
  output. `expert_outputs` returns each assignment's weighted output instead: what an expert-parallel
  rank computes for its peers, who add a token's outputs in ascending expert id, as `run_experts` does.

`LocalExperts` runs one bank of every expert; `deepinfer.engine.ep.experts.ExpertParallelExperts` (installed
by `shard_experts` on every block `moe_blocks` finds) spreads them over ranks. Both count assignments per
expert (`take_counts`).

`run_experts` sorts the assignments by expert, gathers each expert's tokens into one contiguous
batch and runs that expert's SwiGLU over it (two matmuls), so the cost is one loop over the experts
that got tokens — never a loop over tokens — and every expert's weights are read once per step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from deepinfer.config.model import MoEConfig
from deepinfer.engine.models.linear import linear
from deepinfer.engine.models.llama import DenseMLP, FeedForward, LlamaModel
from deepinfer.kernels.decode_layers import silu_mul
from deepinfer.kernels.dense_linear import MAX_ROWS as DENSE_MAX_ROWS
from deepinfer.kernels.dense_linear import dense_linear
from deepinfer.kernels.routing import Routing, count_assignments


def route_softmax_topk(router_logits: torch.Tensor, top_k: int, normalize: bool) -> Routing:
    """Mixtral / Qwen2-MoE routing of router logits [T, E]: softmax in fp32 over all E experts, the
    top_k probabilities (exact ties broken by torch.topk, the call transformers makes too), divided
    by their sum when `normalize`. Assignments are token-major: token t's are t·k .. t·k+k-1."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    tokens = torch.arange(router_logits.shape[0], device=router_logits.device).repeat_interleave(top_k)
    return Routing(tokens, experts.reshape(-1), weights.reshape(-1))


@dataclass
class ExpertBank:
    """SwiGLU weights of the experts held here, stacked by row: row s holds logical expert slots[s].

    A row may be empty (slots[s] == -1): its weights are zeros and `slot_of` never points at it, so no
    assignment is ever computed there. An expert-parallel rank's bank has one row per local slot of its
    placement, empty slots included, so a placement change rewrites rows in place (`install`)."""

    gate_up: torch.Tensor  # [S, 2 * expert_intermediate, hidden]: gate rows, then up rows
    down: torch.Tensor  # [S, hidden, expert_intermediate]
    slots: torch.Tensor  # [S] int64, the logical expert of each row, -1 = empty
    slot_of: torch.Tensor  # [num_experts] int64: the row of each logical expert, -1 where not held here

    @classmethod
    def from_state(cls, sd: dict[str, torch.Tensor], prefix: str, num_experts: int,
                   ids: Sequence[int] | None = None) -> ExpertBank:
        """Experts `ids` (default all) from `{prefix}experts.{e}.gate_proj/up_proj/down_proj`."""
        held = list(range(num_experts)) if ids is None else list(ids)
        if not held or len(set(held)) != len(held) or not all(0 <= e < num_experts for e in held):
            raise ValueError(f"expert ids {held} are not one or more distinct ids below {num_experts}")
        gate_up = torch.stack([torch.cat([sd[f"{prefix}experts.{e}.gate_proj"], sd[f"{prefix}experts.{e}.up_proj"]])
                               for e in held])
        down = torch.stack([sd[f"{prefix}experts.{e}.down_proj"] for e in held])
        return cls._of(gate_up, down, held, num_experts)

    @classmethod
    def _of(cls, gate_up: torch.Tensor, down: torch.Tensor, slots: list[int], num_experts: int) -> ExpertBank:
        device = down.device
        slot_of = torch.full((num_experts,), -1, dtype=torch.int64, device=device)
        bank = cls(gate_up, down, torch.tensor(slots, dtype=torch.int64, device=device), slot_of)
        bank._index()
        return bank

    def _index(self) -> None:
        """`slot_of` from `slots`, in place (an executor may hold references to it)."""
        rows = (self.slots >= 0).nonzero().squeeze(1)
        self.slot_of.fill_(-1)
        self.slot_of[self.slots[rows]] = rows

    @property
    def num_experts(self) -> int:
        """The number of logical experts of the layer (held here or not)."""
        return self.slot_of.shape[0]

    @property
    def ids(self) -> torch.Tensor:
        """The logical experts held here, in row order (empty rows skipped)."""
        return self.slots[self.slots >= 0]

    def subset(self, ids: Sequence[int]) -> ExpertBank:
        """A bank of copies of experts `ids` (all held here), slot s holding ids[s]: a rank's share."""
        held = list(ids)
        if not held or len(set(held)) != len(held) or not all(0 <= e < self.num_experts for e in held):
            raise ValueError(f"expert ids {held} are not one or more distinct ids below {self.num_experts}")
        return self.slotted(held)

    def slotted(self, slots: Sequence[int]) -> ExpertBank:
        """A bank of len(slots) rows: row s a copy of expert slots[s] (held here), zeros where slots[s] is
        -1. Distinct experts; all rows may be empty (a rank with nothing of a layer)."""
        wanted = list(slots)
        held = [e for e in wanted if e != -1]
        if len(set(held)) != len(held) or not all(0 <= e < self.num_experts for e in held):
            raise ValueError(f"slots {wanted} are not distinct expert ids below {self.num_experts} (or -1)")
        if not set(held) <= set(self.ids.tolist()):
            raise ValueError(f"expert ids {held} are not all held by this bank ({self.ids.tolist()})")
        # Fresh tensors: the share owns its memory and the full bank can be freed.
        gate_up = self.gate_up.new_zeros((len(wanted), *self.gate_up.shape[1:]))
        down = self.down.new_zeros((len(wanted), *self.down.shape[1:]))
        if held:
            device = self.slot_of.device
            dst = torch.tensor([s for s, e in enumerate(wanted) if e != -1], device=device)
            src = self.slot_of[torch.tensor(held, device=device)]
            gate_up[dst] = self.gate_up[src]
            down[dst] = self.down[src]
        return ExpertBank._of(gate_up, down, wanted, self.num_experts)

    def install(self, rows: dict[int, tuple[int, torch.Tensor | None, torch.Tensor | None]]) -> None:
        """Rewrite rows in place: row -> (expert, gate_up, down), or (-1, None, None) to empty it. The
        bank must be valid afterwards (each expert in at most one row); `slot_of` follows the new rows."""
        slots = self.slots.tolist()
        for row, (expert, _, _) in rows.items():
            slots[row] = expert
        held = [e for e in slots if e != -1]
        if len(set(held)) != len(held) or not all(0 <= e < self.num_experts for e in held):
            raise ValueError(f"rows {slots} would not be distinct expert ids below {self.num_experts} (or -1)")
        for row, (expert, gate_up, down) in rows.items():
            if expert == -1:
                self.gate_up[row].zero_()
                self.down[row].zero_()
            else:
                assert gate_up is not None and down is not None
                self.gate_up[row].copy_(gate_up)
                self.down[row].copy_(down)
            self.slots[row] = expert
        self._index()


def run_experts(x: torch.Tensor, routing: Routing, bank: ExpertBank) -> torch.Tensor:
    """Σ over the assignments to experts `bank` holds of weight · expert(x[token]), per token row:
    [T, hidden]. Assignments to experts held elsewhere contribute nothing here; empty rows are never
    computed (`slot_of` never names them). A token's terms are added in the bank's slot order, starting
    from zero: for a bank of every expert in id order, ascending expert id (transformers' order)."""
    out = torch.zeros_like(x)
    slot = bank.slot_of[routing.expert]
    token, weight = routing.token, routing.weight
    held = slot >= 0
    if not bool(held.all()):
        slot, token, weight = slot[held], token[held], weight[held]
    if slot.numel() == 0:
        return out
    order, terms = _weighted_terms(x, token, slot, weight, bank)
    out.index_add_(0, token[order], terms)
    return out


def expert_outputs(x: torch.Tensor, routing: Routing, bank: ExpertBank) -> torch.Tensor:
    """weight · expert(x[token]) of every assignment, in `routing`'s order: [A, hidden]. Every assignment
    must name an expert `bank` holds. Each term has the bits `run_experts` adds for it, so whoever adds
    a token's terms in ascending expert id from zero gets `run_experts` of a bank of every expert."""
    order, sorted_terms = expert_outputs_sorted(x, routing, bank)
    terms = torch.empty_like(sorted_terms)
    return terms.index_copy_(0, order, sorted_terms)


def expert_outputs_sorted(x: torch.Tensor, routing: Routing, bank: ExpertBank) -> tuple[torch.Tensor, torch.Tensor]:
    """`expert_outputs` in the order they are computed: (order [A], terms [A, hidden]) with terms[j] the
    output of assignment order[j]; each expert's terms are one run (the bank's slot order)."""
    slot = bank.slot_of[routing.expert]
    if bool((slot < 0).any()):
        raise ValueError("an assignment names an expert this bank does not hold")
    if not slot.numel():
        return slot.clone(), torch.empty((0, x.shape[1]), dtype=x.dtype, device=x.device)
    return _weighted_terms(x, routing.token, slot, routing.weight, bank)


def _weighted_terms(x: torch.Tensor, token: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor,
                    bank: ExpertBank) -> tuple[torch.Tensor, torch.Tensor]:
    """(the expert-major order of the assignments, their weighted outputs in that order)."""
    # Expert-major order: each expert's tokens are one contiguous run of the gathered batch.
    order = torch.argsort(slot, stable=True)
    counts = torch.bincount(slot[order], minlength=bank.slots.shape[0]).tolist()
    xs = x.index_select(0, token[order])
    ys = torch.empty_like(xs)
    start = 0
    for s, n in enumerate(counts):
        if n:
            ys[start : start + n] = expert_linear(silu_mul(expert_linear(xs[start : start + n], bank.gate_up[s])),
                                                  bank.down[s])
            start += n
    return order, ys.mul_(weight[order].unsqueeze(1))


# Rows below which torch's CPU GEMM takes another path (a GEMV) whose bits differ from the GEMM's.
EXPERT_GEMM_MIN_ROWS = 4


def expert_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T for one expert's rows, each row's bits independent of the other rows in the call.

    An expert's rows are grouped differently under expert parallelism than in one process (the rows of a
    replicated expert split between its replicas, a rank's own rows computed apart from those it
    received), so a row's product must not follow its call's row count. `linear` does follow it (the
    few-rows kernel up to 64 rows, the GEMM or AMX tiles above, which differ in the last bits), so on
    CPU every call takes the few-rows kernel, 64 rows at a time: batch-invariant by construction, on any
    machine. Against torch's GEMM for smollm2-moe's experts on the 2-core AVX2 VM: about 2x faster at
    one row, 1.6-2.7x slower from 512 rows (bench/bench_moe.py: EP=1 0.91x at concurrency 1 and 32 against
    `linear`, whose bits were not invariant). Without the kernel (no compiler) every call takes torch's
    GEMM, padded to EXPERT_GEMM_MIN_ROWS rows, invariant from there on the BLAS builds seen here. On CUDA,
    cuBLAS may choose its algorithm by shape; equality there is not claimed."""
    rows = x.shape[0]
    if x.is_cpu and x.dtype == torch.float32 and w.dtype == torch.float32:
        threads = torch.get_num_threads()
        parts = [dense_linear(x[i:i + DENSE_MAX_ROWS], w, threads) for i in range(0, rows, DENSE_MAX_ROWS)]
        if parts and all(p is not None for p in parts):
            return parts[0] if len(parts) == 1 else torch.cat(parts)  # type: ignore[arg-type]
    if x.is_cpu and rows < EXPERT_GEMM_MIN_ROWS:
        padded = torch.cat([x, x.new_zeros(EXPERT_GEMM_MIN_ROWS - rows, x.shape[1])])
        return F.linear(padded, w)[:rows]
    return F.linear(x, w)


# The two points a sparse block is pluggable at. A router maps the normed hidden states [T, hidden] to a
# Routing (softmax top-k here; DeepSeek's sigmoid group-limited routing elsewhere). An expert executor
# maps (x [T, hidden], routing) to the weighted sum of every routed expert's output per token [T, hidden]:
# `LocalExperts` when one process holds every expert, an expert-parallel executor when they are spread
# over ranks (it dispatches tokens to the ranks holding their experts and adds the outputs that come back).
Router = Callable[[torch.Tensor], Routing]
ExpertExecutor = Callable[[torch.Tensor, Routing], torch.Tensor]


@dataclass
class SoftmaxTopKRouter:
    """Mixtral / Qwen2-MoE routing: `route_softmax_topk` of the router's logits."""

    weight: torch.Tensor  # [num_experts, hidden]
    top_k: int
    normalize: bool

    def __call__(self, h: torch.Tensor) -> Routing:
        return route_softmax_topk(linear(h, self.weight), self.top_k, self.normalize)


@dataclass
class LocalExperts:
    """Every routed expert in this process: `run_experts` over one bank holding all of them.

    `counts` accumulates `count_assignments` of every batch (one bincount, no host sync) until
    `take_counts`; an expert-parallel executor counts the same way, its rank's own tokens."""

    bank: ExpertBank
    counts: torch.Tensor = field(init=False)  # [num_experts] int64

    def __post_init__(self) -> None:
        self.counts = torch.zeros(self.bank.num_experts, dtype=torch.int64, device=self.bank.slots.device)

    def __call__(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        self.counts += count_assignments(routing, self.bank.num_experts)
        return run_experts(x, routing, self.bank)

    def take_counts(self) -> torch.Tensor:
        """The counts since the last take (on the host), and start again from zero."""
        taken = self.counts.cpu().clone()
        self.counts.zero_()
        return taken


@dataclass
class SparseMoE:
    """One sparse MLP block: routed experts, plus an optionally gated shared expert."""

    route: Router
    experts: ExpertExecutor
    shared: DenseMLP | None = None
    shared_gate: torch.Tensor | None = None  # [1, hidden]

    @classmethod
    def from_state(cls, sd: dict[str, torch.Tensor], layer: int, moe: MoEConfig,
                   experts: ExpertExecutor | None = None) -> SparseMoE:
        """Layer `layer`'s block; `experts` defaults to every expert held locally."""
        p = f"layers.{layer}."
        shared = DenseMLP.from_state(sd, p + "shared_expert.") if moe.shared_expert_intermediate_size else None
        gate = sd[p + "shared_expert_gate"] if moe.shared_expert_gated else None
        if experts is None:
            experts = LocalExperts(ExpertBank.from_state(sd, p, moe.num_experts))
        return cls(SoftmaxTopKRouter(sd[p + "router"], moe.num_experts_per_tok, moe.norm_topk_prob),
                   experts, shared, gate)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        out = self.experts(h, self.route(h))
        if self.shared is not None:
            shared = self.shared(h)
            if self.shared_gate is not None:
                shared = torch.sigmoid(linear(h, self.shared_gate)) * shared
            out = out + shared
        return out


class MoEModel(LlamaModel):
    """A Llama-family decoder whose MLPs are sparse blocks in the layers `config.moe` names (Mixtral:
    all; Qwen2-MoE: per `decoder_sparse_step` / `mlp_only_layers`) and dense SwiGLU elsewhere."""

    def build_mlp(self, layer: int, sd: dict[str, torch.Tensor]) -> FeedForward:
        moe = self.config.moe
        if moe is None:
            raise ValueError(f"{self.config.architecture} config has no mixture-of-experts settings")
        if moe.is_sparse_layer(layer):
            return SparseMoE.from_state(sd, layer, moe)
        return super().build_mlp(layer, sd)


def moe_blocks(model: object) -> list[SparseMoE]:
    """The model's sparse blocks in forward order: its `moe_blocks()` when it has one, else every
    `model.layers[i].mlp` that is a `SparseMoE`. Expert parallelism swaps their `experts` and relies on
    this order being the order a forward calls them in (every rank joins the same layer's collectives)."""
    own = getattr(model, "moe_blocks", None)
    if callable(own):
        return list(own())
    return [m for layer in getattr(model, "layers", ()) if isinstance(m := getattr(layer, "mlp", None), SparseMoE)]
