"""Where each MoE layer's experts live across an expert-parallel group: a pure table, no torch.

Vocabulary:

* a *logical* expert is expert e of a layer's router (0 <= e < num_experts);
* a *physical slot* is one place on one rank that holds one expert's weights. Every rank has
  `slots_per_rank` slots; global slot g sits on rank g // slots_per_rank. A slot may be empty (-1).
* a logical expert held by several slots has *replicas*. Replicas have identical weights, so which
  one computes a token never changes the output, only the load.

Invariants (checked on construction, so a table received from a balancer is checked too):

* every layer lists num_ranks * slots_per_rank slots, each a logical id or -1 (empty);
* every logical expert has at least one replica in every layer;
* no rank holds two replicas of one expert in one layer: a rank names a held expert by its logical
  id alone, and a second copy on the same rank could never share its load anyway.

The default (`ExpertPlacement.static`) puts logical experts in contiguous, balanced blocks over the
ranks (rank r holds experts [r·E//N, (r+1)·E//N)), then `redundant` extra replicas (at most E·(N-1)):
the k-th extra copy of an expert goes to the rank k after its home rank, experts taken first of each
block, then second of each, and so on — so the replicas spread over all ranks. Without load data nothing
tells which experts are hot; a balancer that has measured the load sends its own table (`to_dict` /
`from_dict`, version bumped) with replicas of the hot ones.

The replica rule (`replica_index`): a token's assignment to an expert with n replicas goes to replica
(token + rank) mod n, token being its row in the rank's batch. It spreads one batch's tokens round
robin over the replicas, and the rank offset keeps single-token batches on different ranks from all
picking replica 0. Any deterministic rule would give the same outputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

EMPTY = -1  # an empty physical slot


def replica_index(token: int, rank: int, num_replicas: int) -> int:
    """Which of an expert's `num_replicas` replicas (in slot order) computes batch row `token` of `rank`."""
    return (token + rank) % num_replicas


@dataclass(frozen=True)
class ExpertPlacement:
    """Per MoE layer (in model order, dense layers not counted), the logical expert in each global slot."""

    num_ranks: int
    num_experts: int
    slots_per_rank: int
    layers: tuple[tuple[int, ...], ...]
    version: int = 0

    def __post_init__(self) -> None:
        if self.num_ranks < 1 or self.num_experts < 1 or self.slots_per_rank < 1:
            raise ValueError("num_ranks, num_experts and slots_per_rank must be positive")
        if self.num_ranks * self.slots_per_rank < self.num_experts:
            raise ValueError(f"{self.num_ranks} ranks of {self.slots_per_rank} slots cannot hold "
                             f"{self.num_experts} experts")
        width = self.num_ranks * self.slots_per_rank
        for i, slots in enumerate(self.layers):
            if len(slots) != width:
                raise ValueError(f"MoE layer {i} lists {len(slots)} slots; the group has {width}")
            bad = [e for e in slots if not (e == EMPTY or 0 <= e < self.num_experts)]
            if bad:
                raise ValueError(f"MoE layer {i} names expert ids {bad} outside [0, {self.num_experts}) (or -1)")
            missing = set(range(self.num_experts)) - set(slots)
            if missing:
                raise ValueError(f"MoE layer {i} places no replica of experts {sorted(missing)}")
            for r in range(self.num_ranks):
                held = [e for e in self._rank_slots(i, r) if e != EMPTY]
                if len(set(held)) != len(held):
                    raise ValueError(f"MoE layer {i}: rank {r} holds an expert twice ({held})")

    @classmethod
    def static(cls, num_layers: int, num_experts: int, num_ranks: int, redundant: int = 0) -> ExpertPlacement:
        """The default table (see the module docstring), the same for every layer: contiguous balanced
        blocks, then `redundant` extra replicas in total per layer. slots_per_rank is the fullest rank's
        count (ceil((num_experts + redundant) / num_ranks), or one more when blocks and rounds do not
        divide evenly); the others' spare slots are empty."""
        if num_layers < 0 or redundant < 0:
            raise ValueError("num_layers and redundant must not be negative")
        if redundant > num_experts * (num_ranks - 1):
            raise ValueError(f"{redundant} redundant replicas of {num_experts} experts need more than "
                             f"{num_ranks} ranks: a rank holds at most one replica of an expert")
        blocks = [list(range(r * num_experts // num_ranks, (r + 1) * num_experts // num_ranks))
                  for r in range(num_ranks)]
        home = {e: r for r, block in enumerate(blocks) for e in block}
        # Replicas in rounds: round k (1 <= k < num_ranks) puts one more copy of each expert on the rank k
        # after its home, so an expert's copies are on distinct ranks. Within a round the experts come
        # interleaved across the blocks (first of each block, then second, ...), so a partial last round
        # still spreads its copies over every rank.
        order = [b[j] for j in range(max(map(len, blocks))) for b in blocks if j < len(b)]
        per_rank = [list(b) for b in blocks]
        for i in range(redundant):
            e = order[i % num_experts]
            per_rank[(home[e] + i // num_experts + 1) % num_ranks].append(e)
        spr = max(1, max(map(len, per_rank)))
        slots = tuple(e for held in per_rank for e in held + [EMPTY] * (spr - len(held)))
        return cls(num_ranks, num_experts, spr, (slots,) * num_layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def _rank_slots(self, layer: int, rank: int) -> tuple[int, ...]:
        s = self.slots_per_rank
        return self.layers[layer][rank * s : (rank + 1) * s]

    def experts_on(self, layer: int, rank: int) -> list[int]:
        """The logical experts `rank` holds in MoE layer `layer`, in its slot order (empty slots skipped)."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank {rank} is outside a group of {self.num_ranks}")
        return [e for e in self._rank_slots(layer, rank) if e != EMPTY]

    def replica_ranks(self, layer: int) -> list[list[int]]:
        """Per logical expert of MoE layer `layer`, the ranks holding a replica, in global slot order
        (the order `replica_index` counts in)."""
        ranks: list[list[int]] = [[] for _ in range(self.num_experts)]
        for g, e in enumerate(self.layers[layer]):
            if e != EMPTY:
                ranks[e].append(g // self.slots_per_rank)
        return ranks

    def destination(self, layer: int, expert: int, token: int, rank: int) -> int:
        """The rank that computes `rank`'s batch row `token` for `expert` (the scalar form of what the
        executor does for a whole batch at once)."""
        replicas = self.replica_ranks(layer)[expert]
        return replicas[replica_index(token, rank, len(replicas))]

    def with_layers(self, layers: Sequence[Sequence[int]]) -> ExpertPlacement:
        """A new table for the same group, its version one higher."""
        return ExpertPlacement(self.num_ranks, self.num_experts, self.slots_per_rank,
                               tuple(tuple(s) for s in layers), self.version + 1)

    def to_dict(self) -> dict[str, Any]:
        """Plain ints and lists (msgpack- and JSON-able)."""
        return {"version": self.version, "num_ranks": self.num_ranks, "num_experts": self.num_experts,
                "slots_per_rank": self.slots_per_rank, "layers": [list(s) for s in self.layers]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ExpertPlacement:
        """The inverse of `to_dict`; raises ValueError for a missing field or a table that breaks the
        invariants."""
        try:
            return cls(int(d["num_ranks"]), int(d["num_experts"]), int(d["slots_per_rank"]),
                       tuple(tuple(int(e) for e in s) for s in d["layers"]), int(d["version"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not an expert placement: {exc}") from exc
