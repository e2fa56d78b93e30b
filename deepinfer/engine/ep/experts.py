"""The expert-parallel expert executor: a sparse block's routed experts spread over a group of ranks.

Each rank holds its share of every MoE layer's experts (`ExpertPlacement`) and runs the layers on its own
batch. At a sparse block, `ExpertParallelExperts(x, routing)` does, on every rank at once:

1. **route to ranks.** Each assignment (token t, logical expert e, weight w) goes to the rank of replica
   `replica_index(t, rank, n_e)` of e. Assignments of one token to the same rank share one *row*: the
   token's hidden state is sent once per destination rank, not once per expert (top-k picks often land
   on one rank). A row carries the hidden state and `width` (expert id, weight) pairs, padded with
   expert -1. Assignments to this rank's own experts stay home.
2. **dispatch**: all_to_all_single of the packed rows as raw bytes (hidden state in its own dtype, int32
   ids, fp32 weights: exact whatever the activations' dtype), split by destination, posted without
   waiting; while it is in flight the rank computes its own tokens on the first half of its slots.
3. **compute**: `expert_outputs` over the received assignments with this rank's bank: weight · expert(x)
   for each (row, expert).
4. **combine**: all_to_all_single of those outputs back to their senders (in the order they came),
   posted, and while it is in flight the rank's own tokens on the rest of its slots. The sender then adds
   each token's outputs in ascending expert id from zero (`ordered_add`, straight from the three tensors
   holding them) — exactly what `run_experts` over one bank of every expert computes (transformers' order
   too), so the result does not depend on which rank computed which expert: not on the placement, nor on
   a move between two steps, nor on how the rows of an expert were split between calls (`expert_linear`
   gives a row the same bits in any call; tests/engine/test_ep_exact.py checks the bits over shuffled
   placements, with experts past 64 rows). (Returning one partial
   sum per rank would move fewer bytes when a token has several experts on a rank, but its rounding would
   follow the placement, and a near-tie in a later layer's routing could then change a greedy output.)

The receiver must know the sizes before the dispatch. Two wire layouts, chosen once per group from its
shape (`dense_rows`), so every rank uses the same one:

* **dense** — when most tokens reach most ranks (few ranks, large top-k: smollm2-moe's top-12 of 16 on
  two ranks sends nearly every token everywhere). Every rank sends every peer one row per token of its
  batch, `width` = the placement's slots per rank (no token has more assignments on one rank); a token
  with nothing for that peer is a row of expert -1 that no expert computes.
  The sizes are then the batch sizes, which the first MoE layer of each forward gathers (one all_gather
  per forward), so each layer costs **two** collectives.
* **sparse** — when a token reaches few of many ranks (DeepSeek-V3's top-8 of 256 over 32 ranks). Rows
  go only where a token has assignments; `width` is this rank's most assignments to one rank in this
  batch; a **header** all-to-all ([rows, width] per destination) precedes the dispatch: three
  collectives per layer.

Both layouts carry the same assignments and return the same outputs, so the result is bit-identical
whichever a group uses. An idle rank joins with zero rows, and a rank
with nothing to receive still takes part. Counts (per-expert assignments of this rank's own tokens) and
timings are kept for the benchmark and a balancer: dispatch and combine time what the rank did not hide
behind its own experts (routing, packing, waiting, adding), compute all its expert work. The bookkeeping
around the exchanges (the split by where an assignment is computed, the dense rows, the unpacking, the
combine's order) is one C call each (`kernels/ep_route.c`, its torch path beside it): as tens of small torch
ops per layer it cost more than the exchanges themselves.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from deepinfer.config.model import ConfigError
from deepinfer.engine.ep.group import EpGroup
from deepinfer.engine.ep.placement import EMPTY, ExpertPlacement
from deepinfer.engine.models.moe import (
    ExpertBank,
    LocalExperts,
    Routing,
    expert_outputs,
    expert_outputs_sorted,
    moe_blocks,
)
from deepinfer.kernels import ep_route
from deepinfer.kernels.ordered_add import ordered_add

# How long `finish` polls a posted collective before blocking on it.
POLL_S = 0.002


def finish(work: dist.Work) -> None:
    """Wait for a posted collective, polling it (yielding the core between polls) for up to POLL_S before
    blocking. On the 2-core VM measured, a blocked wait's wake-up cost more than the exchange itself: a
    74 KB gloo all-to-all between two ranks took 0.18 ms back to back but ~0.9 ms when each rank had
    computed for 1 ms first, and 1 ms of compute overlapped with it took 1.45 ms blocking against 1.25 ms
    polling (two spawned ranks, 200 rounds each). A peer far behind (in its prefill) is waited for
    blocking, not spun on."""
    deadline = time.perf_counter() + POLL_S
    while not work.is_completed() and time.perf_counter() < deadline:
        os.sched_yield()
    work.wait()


@dataclass
class EpStats:
    """Accumulated over every MoE layer call since the last `take`. Seconds are host wall time; on a
    cuda group with `sync` False they time the launch of the work, not the work (set `sync` to make each
    phase wait for the device: exact, and slower)."""

    exchanges: int = 0  # MoE layer calls (two collectives each in the dense layout, three in the sparse)
    # routing to ranks, the batch-size gather or the header, posting the dispatch and waiting for what the
    # rank's own first experts did not cover, unpacking
    dispatch_s: float = 0.0
    compute_s: float = 0.0  # this rank's experts: on its own tokens and on the rows it received
    combine_s: float = 0.0  # posting the return, waiting for what the rest of its own experts did not cover, the sums
    dispatch_bytes: int = 0  # header and rows (padding rows included) this rank sent to other ranks
    combine_bytes: int = 0  # expert outputs this rank sent back to other ranks
    rows_sent: int = 0  # rows with assignments for other ranks (a row: one token's hidden state for one rank)
    rows_received: int = 0  # rows from other ranks (padding rows included)
    sync: bool = False

    def take(self) -> EpStats:
        """A copy of the counters, which start again from zero."""
        taken = EpStats(**{f.name: getattr(self, f.name) for f in fields(self)})
        for f in fields(self):
            if f.name != "sync":
                setattr(self, f.name, type(getattr(self, f.name))())
        return taken


@dataclass
class _Rows:
    """This rank's send rows for one layer call: one per (destination rank, token) pair that has an
    assignment, destination-major then token order."""

    token: torch.Tensor  # [R] the token each row carries
    per_dest: torch.Tensor  # [n] rows for each rank
    of: torch.Tensor  # [A] each assignment's row
    place: torch.Tensor  # [A] each assignment's column among its row's (expert, weight) pairs
    width: torch.Tensor  # () int64, the most assignments in one row


class BatchSizes:
    """Every rank's batch rows in the current forward, shared by the executors of one model's MoE layers
    in the dense layout: MoE layer 0 gathers them (every forward runs its MoE layers in order from the
    first), the later layers of the forward read them."""

    def __init__(self) -> None:
        self.rows: list[int] | None = None

    def gather(self, rows: int, group: EpGroup) -> None:
        mine = torch.tensor([rows], dtype=torch.int64, device=group.device)
        every = torch.empty(group.size, dtype=torch.int64, device=group.device)
        finish(dist.all_gather_single(every, mine, group=group.data, async_op=True))
        self.rows = every.tolist()

    def of(self, rank: int, rows: int) -> list[int]:
        """The gathered sizes; RuntimeError if this rank's own batch is not the size it gathered (a forward
        that skipped MoE layer 0 would otherwise exchange with stale sizes)."""
        if self.rows is None or self.rows[rank] != rows:
            raise RuntimeError(f"rank {rank}: a batch of {rows} rows at a MoE layer, but {self.rows} were "
                               "gathered at the forward's first MoE layer")
        return self.rows


class ExpertParallelExperts:
    """An `ExpertExecutor` (x [T, hidden], routing) -> [T, hidden] for MoE layer `layer` of `placement`,
    holding `bank`: this rank's rows of that layer, row i = local slot i of the placement (an empty slot
    is an empty row). Every rank of `group` must call it for the same layers in the same order, each with
    its own batch (T may be 0). `sizes` (shared by every layer of the model) selects the dense wire layout,
    None the sparse one; every rank must choose alike (`dense_rows`). `switch` moves it to another
    placement of the same group shape."""

    def __init__(self, bank: ExpertBank, placement: ExpertPlacement, layer: int, group: EpGroup,
                 stats: EpStats | None = None, sizes: BatchSizes | None = None) -> None:
        check_bank(bank, placement, layer, group.rank)
        self.bank = bank
        self.layer = layer
        self.group = group
        self.num_experts = placement.num_experts
        self.dtype = bank.down.dtype
        self.stats = stats if stats is not None else EpStats()
        self.sizes = sizes
        # A token's assignments on one rank are distinct experts that rank holds: at most its slots.
        self.width = placement.slots_per_rank
        # [E, num_ranks]: the ranks of each expert's replicas in slot order, padded with -1 (never indexed:
        # replica_index stays below the expert's own count). A fixed width (an expert has at most one replica
        # per rank) lets `switch` rewrite the tables in place.
        self._replica_ranks, self._num_replicas = _replica_tables(placement, layer, group.device)
        self.counts = torch.zeros(self.num_experts, dtype=torch.int64, device=group.device)
        self.computed = 0  # assignments this rank's experts computed (any sender's tokens): its measured load

    @classmethod
    def from_state(cls, sd: dict[str, torch.Tensor], prefix: str, placement: ExpertPlacement, layer: int,
                   group: EpGroup, stats: EpStats | None = None,
                   sizes: BatchSizes | None = None) -> ExpertParallelExperts:
        """This rank's share of `{prefix}experts.{e}.*` (see `ExpertBank.from_state`)."""
        slots = local_slots(placement, layer, group.rank)
        held = [e for e in slots if e != EMPTY]
        # A rank holding nothing of the layer still needs the rows' shapes: read expert 0 for them.
        source = ExpertBank.from_state(sd, prefix, placement.num_experts, held or [0])
        return cls(source.slotted(slots), placement, layer, group, stats, sizes)

    @classmethod
    def from_bank(cls, full: ExpertBank, placement: ExpertPlacement, layer: int, group: EpGroup,
                  stats: EpStats | None = None, sizes: BatchSizes | None = None) -> ExpertParallelExperts:
        """This rank's share copied out of a bank holding (at least) its experts."""
        return cls(full.slotted(local_slots(placement, layer, group.rank)), placement, layer, group, stats, sizes)

    def switch(self, placement: ExpertPlacement) -> None:
        """Route by `placement` from now on. The bank's rows must already hold this rank's slots of it
        (`ExpertBank.install`); the replica tables are rewritten in place."""
        check_bank(self.bank, placement, self.layer, self.group.rank)
        ranks, counts = _replica_tables(placement, self.layer, self.group.device)
        self._replica_ranks.copy_(ranks)
        self._num_replicas.copy_(counts)

    def take_counts(self) -> torch.Tensor:
        """Assignments of this rank's tokens per logical expert since the last take (host), then zero."""
        taken = self.counts.cpu().clone()
        self.counts.zero_()
        return taken

    def take_computed(self) -> int:
        """Assignments this rank's experts computed since the last take, then zero."""
        taken, self.computed = self.computed, 0
        return taken

    def __call__(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        started = self._now()
        n, (t, hidden) = self.group.size, x.shape
        # This rank's own assignments to its own experts never travel. They are computed while the
        # all-to-alls are in flight: the first half of its slots' during the dispatch, the rest during
        # the combine (split by expert, so no expert's local rows are split between two calls).
        parts = ep_route.split(routing, t, self._replica_ranks, self._num_replicas, self.bank.slot_of,
                               self.bank.slots.shape[0] // 2, self.group.rank, self.counts)
        if self.sizes is not None:
            sent_at, sent_terms, arriving = self._dispatch_dense(x, routing, parts)
        else:
            sent_at, sent_terms, arriving = self._dispatch_sparse(x, routing, parts)
        posted = self._now()
        early_order, near_early = expert_outputs_sorted(x, _subset(routing, parts.at_early), self.bank)
        computed_early = self._now()
        (recv_x, recv_routing, recv_terms), recv_rows = arriving()
        self.computed += recv_routing.expert.numel() + parts.at_early.numel() + parts.at_late.numel()
        dispatched = self._now()

        terms = expert_outputs(recv_x, recv_routing, self.bank)
        computed = self._now()

        # Combine: every term back to its sender, in the order it came; the sender adds a token's terms in
        # ascending expert id from zero, as `run_experts` over one bank of every expert does. So the output
        # does not depend on which rank computed which expert: not on the placement, not on a move.
        back = torch.empty((parts.at_far.numel(), hidden), dtype=self.dtype, device=x.device)
        returning = dist.all_to_all_single(back, terms.contiguous(), output_split_sizes=sent_terms,
                                           input_split_sizes=recv_terms, group=self.group.data, async_op=True)
        posted_back = self._now()
        late_order, near_late = expert_outputs_sorted(x, _subset(routing, parts.at_late), self.bank)
        computed_late = self._now()
        finish(returning)
        out = torch.zeros_like(x)
        if routing.token.numel():
            # Token-major, each token's experts ascending: every element gets its additions in ascending
            # expert id as in `run_experts`' expert-major order (the same bits), and a token's output row
            # stays in cache while its terms are added (a 1,536-token prefill layer: 12 ms against 16
            # expert-major); each term straight from the tensor holding it, not gathered first.
            token, row = ep_route.combine_order(routing, t, parts, early_order, late_order, sent_at)
            ordered_add(out, token, row, (near_early, near_late, back))
        combined = self._now()

        st, others = self.stats, [r for r in range(n) if r != self.group.rank]
        st.exchanges += 1
        st.dispatch_s += (posted - started) + (dispatched - computed_early)
        st.compute_s += (computed_early - posted) + (computed - dispatched) + (computed_late - posted_back)
        st.combine_s += (posted_back - computed) + (combined - computed_late)
        st.combine_bytes += sum(recv_terms[r] for r in others) * hidden * ep_route.itemsize(self.dtype)
        st.rows_received += sum(recv_rows[r] for r in others)
        return out

    def _dispatch_dense(self, x: torch.Tensor, routing: Routing,
                        parts: ep_route.Split) -> tuple[torch.Tensor, list[int], _Arriving]:
        """Every peer gets one row per token of this batch, `width` = slots per rank, padded with -1 experts;
        the batch sizes, gathered at MoE layer 0, size the receive. Returns (each far assignment's position
        in the return order, far assignments per rank, the posted dispatch's wait-and-unpack)."""
        n, (t, hidden), w, me = self.group.size, x.shape, self.width, self.group.rank
        if self.layer == 0:
            self.sizes.gather(t, self.group)  # type: ignore[union-attr]
        sizes = self.sizes.of(me, t)  # type: ignore[union-attr]
        recv_sizes = [0 if r == me else s for r, s in enumerate(sizes)]
        send, sent_at, sent_terms, rows_sent = ep_route.pack_dense(x, routing, parts, me, n, w, self.dtype)
        got = torch.empty((sum(recv_sizes), send.shape[1]), dtype=torch.uint8, device=x.device)
        work = dist.all_to_all_single(got, send, output_split_sizes=recv_sizes,
                                      input_split_sizes=[0 if r == me else t for r in range(n)],
                                      group=self.group.data, async_op=True)
        self.stats.dispatch_bytes += send.numel()
        self.stats.rows_sent += rows_sent

        def arriving() -> tuple[_Received, list[int]]:
            finish(work)
            return ep_route.unpack(got, recv_sizes, hidden, self.dtype, w, self.num_experts), recv_sizes

        return sent_at, sent_terms, arriving

    def _dispatch_sparse(self, x: torch.Tensor, routing: Routing,
                         parts: ep_route.Split) -> tuple[torch.Tensor, list[int], _Arriving]:
        """Rows only where a token has assignments, this batch's own width; a header all-to-all first tells
        each rank its sizes. Returns as `_dispatch_dense`."""
        n, hidden = self.group.size, x.shape[1]
        far, dest = _subset(routing, parts.at_far), parts.dest.index_select(0, parts.at_far)
        rows = self._rows(far, dest, x.shape[0])

        # Header: rows and width per destination; what comes back sizes the dispatch (one host sync).
        header = torch.stack([rows.per_dest, rows.width.expand(n)], dim=1)  # [n, 2]
        header_in = torch.empty_like(header)
        finish(dist.all_to_all_single(header_in, header, group=self.group.data, async_op=True))
        (send_rows, widths), (recv_rows, recv_widths) = torch.stack([header, header_in]).transpose(1, 2).tolist()
        w = widths[0]

        send_bytes = [r * ep_route.row_bytes(hidden, self.dtype, w) for r in send_rows]
        recv_bytes = [r * ep_route.row_bytes(hidden, self.dtype, rw) for r, rw in zip(recv_rows, recv_widths)]
        got = torch.empty(sum(recv_bytes), dtype=torch.uint8, device=x.device)
        work = dist.all_to_all_single(got, self._pack(x, far, rows, w), output_split_sizes=recv_bytes,
                                      input_split_sizes=send_bytes, group=self.group.data, async_op=True)
        others = [r for r in range(n) if r != self.group.rank]
        self.stats.dispatch_bytes += sum(header[r].numel() * header.element_size() + send_bytes[r] for r in others)
        self.stats.rows_sent += sum(send_rows[r] for r in others)

        def arriving() -> tuple[_Received, list[int]]:
            finish(work)
            return self._unpack(got, recv_rows, recv_widths, hidden), recv_rows

        return ep_route.order_of(rows.of * w + rows.place), torch.bincount(dest, minlength=n).tolist(), arriving

    def _rows(self, routing: Routing, dest: torch.Tensor, num_tokens: int) -> _Rows:
        """Group the assignments into send rows by (destination rank, token)."""
        token = routing.token
        stride = max(num_tokens, 1)
        # Sorted unique keys are destination-major, token-minor: the send order.
        keys, row_of = torch.unique(dest * stride + token, sorted=True, return_inverse=True)
        place, per_row = ep_route.columns(row_of, keys.shape[0])
        width = per_row.max() if per_row.numel() else torch.zeros((), dtype=torch.int64, device=token.device)
        return _Rows(keys % stride, torch.bincount(keys // stride, minlength=self.group.size), row_of, place, width)

    def _pack(self, x: torch.Tensor, routing: Routing, rows: _Rows, width: int) -> torch.Tensor:
        """The send rows as one flat byte tensor: per row the token's hidden state, then `width` expert
        ids (int32, -1 = padding), then `width` weights (fp32)."""
        r = rows.token.shape[0]
        ids = torch.full((r, width), -1, dtype=ep_route.ID_DTYPE, device=x.device)
        ids[rows.of, rows.place] = routing.expert.to(ep_route.ID_DTYPE)
        weights = torch.zeros((r, width), dtype=ep_route.WEIGHT_DTYPE, device=x.device)
        weights[rows.of, rows.place] = routing.weight.to(ep_route.WEIGHT_DTYPE)
        states = x[rows.token].to(self.dtype)
        return torch.cat([ep_route.as_bytes(states), ep_route.as_bytes(ids), ep_route.as_bytes(weights)],
                         dim=1).reshape(-1)

    def _unpack(self, got: torch.Tensor, rows: list[int], widths: list[int], hidden: int) -> _Received:
        """The received rows, one width per sender (see `ep_route.unpack`)."""
        parts, offset = [], 0
        for r, w in zip(rows, widths):
            size = ep_route.row_bytes(hidden, self.dtype, w)
            parts.append(ep_route.unpack(got[offset : offset + r * size].view(r, size), [r], hidden, self.dtype, w,
                                         self.num_experts))
            offset += r * size
        base = torch.tensor([0, *rows[:-1]], device=got.device).cumsum(0).tolist()
        return (torch.cat([p[0] for p in parts]),
                Routing(torch.cat([p[1].token + b for p, b in zip(parts, base)]),
                        torch.cat([p[1].expert for p in parts]), torch.cat([p[1].weight for p in parts])),
                [p[2][0] for p in parts])

    def _now(self) -> float:
        if self.stats.sync and self.group.device.type == "cuda":
            torch.cuda.synchronize(self.group.device)
        return time.perf_counter()


# What a rank received: ([R, hidden] row states, their assignments with token = received row in row
# order, assignments received from each rank).
_Received = tuple[torch.Tensor, Routing, list[int]]
# A posted dispatch: waits for it, then returns (what was received, rows received from each rank).
_Arriving = Callable[[], tuple[_Received, list[int]]]


def _subset(routing: Routing, at: torch.Tensor) -> Routing:
    """The assignments at indices `at`, in that order."""
    return Routing(routing.token.index_select(0, at), routing.expert.index_select(0, at),
                   routing.weight.index_select(0, at))


def dense_rows(num_ranks: int, top_k: int | None) -> bool:
    """Whether a group of `num_ranks` uses the dense layout for a router choosing `top_k` experts: when a
    token is expected to reach at least half the ranks (uniform routing: 1 - (1 - 1/n)^k >= 1/2), padding
    rows cost less than the header all-to-all saves. None (top-k unknown): the sparse layout."""
    if top_k is None:
        return False
    return 1.0 - (1.0 - 1.0 / num_ranks) ** top_k >= 0.5


def local_slots(placement: ExpertPlacement, layer: int, rank: int) -> list[int]:
    """The logical expert in each of `rank`'s slots of MoE layer `layer` (-1 = empty), in slot order."""
    s = placement.slots_per_rank
    return list(placement.layers[layer][rank * s : (rank + 1) * s])


def check_bank(bank: ExpertBank, placement: ExpertPlacement, layer: int, rank: int) -> None:
    """ValueError unless `bank`'s rows are `rank`'s slots of MoE layer `layer`, slot by slot."""
    slots = local_slots(placement, layer, rank)
    if bank.slots.tolist() != slots:
        raise ValueError(f"rank {rank} of MoE layer {layer} must hold slots {slots}, not {bank.slots.tolist()}")


def _replica_tables(placement: ExpertPlacement, layer: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """([E, num_ranks] replica ranks padded with -1, [E] replica counts) of MoE layer `layer`."""
    ranks = placement.replica_ranks(layer)
    width = placement.num_ranks
    table = torch.tensor([r + [-1] * (width - len(r)) for r in ranks], dtype=torch.int64, device=device)
    return table, torch.tensor([len(r) for r in ranks], dtype=torch.int64, device=device)


def redundant_replicas(requested: int | None, num_experts: int, num_ranks: int) -> int:
    """The static placement's extra replicas per layer for `EngineConfig.redundant_experts`: None picks
    max(1, num_experts // 8), capped at what the group can hold (num_experts · (num_ranks - 1): a rank
    holds at most one replica of an expert); ConfigError for a negative or too large request."""
    most = num_experts * (num_ranks - 1)
    if requested is None:
        return min(max(1, num_experts // 8), most)
    if requested < 0:
        raise ConfigError(f"redundant_experts must not be negative, got {requested}")
    if requested > most:
        raise ConfigError(f"redundant_experts={requested} is more than {num_ranks} ranks can hold for "
                          f"{num_experts} experts (at most {most}: one replica of an expert per rank)")
    return requested


def shard_experts(model: object, group: EpGroup, placement: ExpertPlacement | None = None,
                  stats: EpStats | None = None, redundant: int = 0) -> tuple[ExpertPlacement, EpStats]:
    """Replace the executor of every sparse block of `model` (`moe_blocks` order) by this rank's
    `ExpertParallelExperts`, its share copied out of the block's `LocalExperts` bank (the full bank is
    then free to go). `placement` defaults to `ExpertPlacement.static` over the group with `redundant`
    extra replicas per layer. Works for any model whose sparse blocks are `SparseMoE`s with
    `LocalExperts`, whatever their router."""
    blocks = moe_blocks(model)
    if not blocks:
        raise ConfigError("expert parallelism needs a mixture-of-experts model; this one has no sparse blocks")
    local = [b.experts for b in blocks]
    if not all(isinstance(e, LocalExperts) for e in local):
        raise ConfigError("expert parallelism shards LocalExperts executors; a sparse block has "
                          f"{sorted({type(e).__name__ for e in local})}")
    num_experts = {e.bank.num_experts for e in local}  # type: ignore[union-attr]
    if len(num_experts) != 1:
        raise ConfigError(f"the sparse blocks disagree on the number of experts: {sorted(num_experts)}")
    (experts,) = num_experts
    if placement is None:
        placement = ExpertPlacement.static(len(blocks), experts, group.size, redundant)
    if (placement.num_ranks, placement.num_layers, placement.num_experts) != (group.size, len(blocks), experts):
        raise ConfigError(f"placement for {placement.num_ranks} ranks, {placement.num_layers} MoE layers of "
                          f"{placement.num_experts} experts; the group has {group.size} ranks and the model "
                          f"{len(blocks)} MoE layers of {experts}")
    stats = stats if stats is not None else EpStats()
    top_k = {getattr(b.route, "top_k", None) for b in blocks}
    sizes = BatchSizes() if len(top_k) == 1 and dense_rows(group.size, top_k.pop()) else None
    for i, block in enumerate(blocks):
        block.experts = ExpertParallelExperts.from_bank(block.experts.bank, placement, i, group, stats, sizes)  # type: ignore[union-attr]
    return placement, stats
