"""The expert balancer's placement algorithm: replicate and pack experts onto ranks (after DeepSeek's EPLB),
and fit a new placement to the current one. Pure functions; `BalancerCore` (balancer_core.py) decides when.

Everything here is deterministic: the same loads and the same current placement give the same placement, ties
broken by expert id, then rank, then slot.

The load model. A rank's load in an MoE layer is the number of tokens its replicas compute. The replica
rule (`placement.replica_index`) spreads an expert's tokens round robin over its replicas, so a replica of
expert e with load w_e and c_e replicas carries w_e / c_e, and a rank carries the sum over the replicas it
holds. A layer's figure of merit is max/mean of its rank loads: the step waits for the busiest rank.

The policy (per MoE layer), after DeepSeek's EPLB:

1. replicas: every expert starts with one; each further replica goes to the expert with the highest load
   per replica, one at a time (this minimises the heaviest single replica: see `lower_bound`). An expert
   has at most one replica per rank, so at most num_ranks of them (ranks_per_node under the hierarchical
   policy).
2. packing: the replicas, heaviest first, each onto the least-loaded rank that has a free slot and does
   not hold that expert yet. Greedy can corner itself (the last replicas of one expert with only ranks
   that hold it left); it then swaps one replica out of a full rank to make room, which always exists.
3. hierarchical policy, when `num_groups` is given, the nodes (num_ranks / ranks_per_node) divide it and
   the nodes divide the replicas: whole expert groups are packed onto nodes first (equal group count per
   node, heaviest group onto the least-loaded node), then 1 and 2 run inside each node with its share of
   the slots. The replicas of an expert then stay in the node of its group, which is what group-limited
   routing wants. Otherwise the global policy: 1 and 2 over all ranks.

After the greedy packing a swap search (`_refine_slots`) trades replicas between the busiest rank and
the others while that lowers the pair's maximum; replica counts stay as step 1 set them.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from deepinfer.engine.ep.placement import EMPTY, ExpertPlacement

__all__ = [
    "align",
    "bounded",
    "check_loads",
    "check_shape",
    "count_moves",
    "hierarchical",
    "incremental",
    "layer_bins",
    "lower_bound",
    "max_over_mean",
    "rank_loads",
    "rebalance",
    "replica_counts",
    "slot_rank_loads",
]


# --- the load model -------------------------------------------------------------------------------------


def slot_rank_loads(slots: Sequence[int], weights: Sequence[float], num_ranks: int, per_rank: int) -> list[float]:
    """One layer's rank loads: each replica carries its expert's load over the expert's replica count."""
    counts = [0] * len(weights)
    for e in slots:
        if e != EMPTY:
            counts[e] += 1
    loads = [0.0] * num_ranks
    for g, e in enumerate(slots):
        if e != EMPTY:
            loads[g // per_rank] += weights[e] / counts[e]
    return loads


def rank_loads(placement: ExpertPlacement, loads: Sequence[Sequence[float]]) -> list[list[float]]:
    """Per MoE layer, the predicted load of each rank: `loads[l][e]` tokens of logical expert e spread
    evenly over its replicas (the token round robin of `replica_index`)."""
    if len(loads) != placement.num_layers:
        raise ValueError(f"{len(loads)} layers of load for a placement of {placement.num_layers}")
    return [slot_rank_loads(slots, w, placement.num_ranks, placement.slots_per_rank)
            for slots, w in zip(placement.layers, loads, strict=True)]


def max_over_mean(loads: Sequence[float]) -> float:
    """The busiest rank's load over the mean rank load (1.0 for an idle layer: nothing to balance)."""
    total = sum(loads)
    return max(loads) * len(loads) / total if total > 0 else 1.0


def replica_counts(weights: Sequence[float], replicas: int, cap: int) -> list[int]:
    """How many replicas each expert gets out of `replicas` in all (at most `cap` each, at least one):
    every extra one to the expert whose load per replica is highest, lowest id first on a tie. Slots that
    the cap leaves no expert to fill stay unused."""
    n = len(weights)
    if replicas < n or cap < 1:
        raise ValueError(f"{replicas} replicas (at most {cap} per expert) cannot cover {n} experts")
    counts = [1] * n
    heap = [(-float(w), e) for e, w in enumerate(weights) if cap > 1]
    heapq.heapify(heap)
    for _ in range(min(replicas, n * cap) - n):
        _, e = heapq.heappop(heap)
        counts[e] += 1
        if counts[e] < cap:
            heapq.heappush(heap, (-weights[e] / counts[e], e))
    return counts


def lower_bound(weights: Sequence[float], num_ranks: int, replicas: int, slots_per_rank: int | None = None) -> float:
    """The lowest max/mean any placement of `replicas` replicas (at most one per expert per rank, at most
    `slots_per_rank` per rank when given) could reach for one layer's expert loads `weights`.

    Three facts bound the busiest rank from below:
    * it carries at least the mean (total / num_ranks);
    * it carries at least the heaviest replica, which is at least w_e / c_e for every expert; the iterative
      rule of `replica_counts` makes max_e w_e / c_e as small as any choice of counts can (a classic
      exchange argument: giving the extra replica to anyone else leaves the current maximum in place);
    * with s slots per rank, a pigeonhole: at most `replicas - E` experts are split, so of the k heaviest
      experts at least k - (replicas - E) sit whole on one rank each; once that is more than
      num_ranks · (s - 1), some rank holds s of them, at least the s lightest of the k heaviest
      (k = num_ranks · (s - 1) + 1 + replicas - E, when there are that many experts). With few slots per
      rank this is the binding one (two slots at EP 144 for 256 experts and 32 extra replicas)."""
    total = float(sum(weights))
    if total <= 0:
        return 1.0
    counts = replica_counts(weights, replicas, num_ranks)
    busiest = max(total / num_ranks, max(w / c for w, c in zip(weights, counts, strict=True)))
    if slots_per_rank is not None:
        k = num_ranks * (slots_per_rank - 1) + 1 + replicas - len(weights)
        if slots_per_rank <= k <= len(weights):
            heaviest = sorted(weights, reverse=True)
            busiest = max(busiest, float(sum(heaviest[k - slots_per_rank : k])))
    return busiest / (total / num_ranks)


# --- building a placement -------------------------------------------------------------------------------


def _pack(items: Sequence[tuple[float, int]], num_bins: int, capacity: int) -> list[list[int]]:
    """Greedy balanced packing of (load, expert) items, heaviest first (stable: expert id, then input
    order), each onto the least-loaded bin (then the emptiest, then the lowest index) with a free slot
    that does not hold that expert. Returns each bin's experts. Needs len(items) <= num_bins * capacity
    and no expert more often than num_bins."""
    order = sorted(range(len(items)), key=lambda i: (-items[i][0], items[i][1], i))
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    held: list[set[int]] = [set() for _ in range(num_bins)]
    load = [0.0] * num_bins
    heap = [(0.0, 0, b) for b in range(num_bins)]  # (load, items, bin) of bins with a free slot
    for i in order:
        w, e = items[i]
        skipped = []
        while heap and e in held[heap[0][2]]:
            skipped.append(heapq.heappop(heap))
        if heap:
            _, _, b = heapq.heappop(heap)
        else:
            b = _make_room(bins, held, load, items, skipped, e, capacity)
        for entry in skipped:
            if entry[2] != b:
                heapq.heappush(heap, entry)
        bins[b].append(e)
        held[b].add(e)
        load[b] += w
        if len(bins[b]) < capacity:
            heapq.heappush(heap, (load[b], len(bins[b]), b))
    return bins


def _make_room(bins: list[list[int]], held: list[set[int]], load: list[float],
               items: Sequence[tuple[float, int]], open_bins: list[tuple[float, int, int]],
               e: int, capacity: int) -> int:
    """Every bin with a free slot holds `e` already. Move one replica x from a full bin f that lacks e to
    an open bin o that lacks x, and return f (now with a free slot) for e. Such a pair exists: e has a
    replica left to place, so fewer than num_bins bins hold it, and f's `capacity` distinct experts cannot
    all be among o's fewer than `capacity`. Among the candidates, the one leaving the lower max load of
    the two bins wins (then the lowest indices)."""
    weight_of = {ex: w for w, ex in items}  # an expert's replicas all carry the same load
    best: tuple[float, int, int, int] | None = None
    for f, experts in enumerate(bins):
        if len(experts) < capacity or e in held[f]:
            continue
        for _, _, o in open_bins:
            for x in experts:
                if x in held[o]:
                    continue
                peak = max(load[f] - weight_of[x], load[o] + weight_of[x])
                key = (peak, f, o, x)
                if best is None or key < best:
                    best = key
    if best is None:  # unreachable by the argument above; a clear error beats a broken table
        raise RuntimeError(f"no room for expert {e}: packing invariant broken")
    _, f, o, x = best
    bins[f].remove(x)
    held[f].discard(x)
    load[f] -= weight_of[x]
    bins[o].append(x)
    held[o].add(x)
    load[o] += weight_of[x]
    # o may now be full; the caller re-pushes its heap entry only with a free slot left.
    for k, entry in enumerate(open_bins):
        if entry[2] == o:
            open_bins[k] = (load[o], len(bins[o]), o) if len(bins[o]) < capacity else (0.0, -1, -1)
    open_bins[:] = [entry for entry in open_bins if entry[2] >= 0]
    return f


def _replicate_and_pack(weights: Sequence[float], experts: Sequence[int], num_bins: int, capacity: int,
                        replicas: int) -> list[list[int]]:
    """Steps 1 and 2 for `experts` (logical ids) over `num_bins` ranks of `capacity` slots."""
    w = [float(weights[e]) for e in experts]
    counts = replica_counts(w, replicas, num_bins)
    items = [(w[i] / c, e) for i, (e, c) in enumerate(zip(experts, counts, strict=True)) for _ in range(c)]
    share = {e: w[i] / c for i, (e, c) in enumerate(zip(experts, counts, strict=True))}
    return _refine(_pack(items, num_bins, capacity), share, capacity)


def _refine(bins: list[list[int]], share: dict[int, float], capacity: int) -> list[list[int]]:
    """`_refine_slots` on bins laid out in slots; returns each bin's experts."""
    slots = [e for b in bins for e in b + [EMPTY] * (capacity - len(b))]
    slots = _refine_slots(slots, share, len(bins), capacity)
    return [[e for e in slots[b * capacity:(b + 1) * capacity] if e != EMPTY] for b in range(len(bins))]


def _refine_slots(slots: Sequence[int], share: dict[int, float], num_ranks: int, capacity: int,
                  rounds: int = 0) -> list[int]:
    """Local search on a valid layout (`share[e]`: the load of one replica of e): while some swap of a
    replica on the busiest rank with a lighter replica (or an empty slot) elsewhere leaves both ranks
    below the busiest load, make the swap that leaves the lower of the two maxima (then the lowest slot
    indices). Replica counts do not change; slots keep their positions (a swap exchanges two slots'
    contents), so a swap is two moves, one when a slot was empty.

    Each swap replaces the top load with two smaller ones, so the sorted load vector falls
    lexicographically and the search ends; `rounds` (default 8 per rank) caps it anyway. Validity is kept
    throughout: a swap never brings an expert onto a rank that holds it."""
    experts = np.array(slots, dtype=np.int64)
    known = sorted(share)
    column = {e: i for i, e in enumerate(known)}
    load = np.array([share[e] if e != EMPTY else 0.0 for e in slots])
    col = np.array([column[e] if e != EMPTY else -1 for e in slots], dtype=np.int64)
    rank = np.arange(len(slots)) // capacity
    holds = np.zeros((num_ranks, len(known) + 1), dtype=bool)  # last column: "empty", never held
    holds[rank[col >= 0], col[col >= 0]] = True
    rank_load = np.bincount(rank, weights=load, minlength=num_ranks)
    for _ in range(rounds or 8 * num_ranks):
        top = int(np.argmax(rank_load))
        peak = rank_load[top]
        best: tuple[float, int, int] | None = None
        # A slot j on another rank may take slot i's expert if its rank lacks it, and i's rank may take
        # j's expert if it lacks it (an empty slot is always welcome).
        j_ok = (rank != top) & ((col < 0) | ~holds[top, col])
        for i in range(top * capacity, (top + 1) * capacity):
            if col[i] < 0:
                continue
            delta = load[i] - load
            ok = j_ok & (delta > peak * 1e-12) & ~holds[rank, col[i]]
            if not ok.any():
                continue
            pair = np.where(ok, np.maximum(peak - delta, rank_load[rank] + delta), np.inf)
            j = int(np.argmin(pair))
            if pair[j] < peak * (1 - 1e-12) and (best is None or (pair[j], i, j) < best):
                best = (float(pair[j]), i, j)
        if best is None:
            break
        _, i, j = best
        ri, rj = int(rank[i]), int(rank[j])
        holds[ri, col[i]] = False
        if col[j] >= 0:
            holds[rj, col[j]] = False
            holds[ri, col[j]] = True
        holds[rj, col[i]] = True
        rank_load[ri] += load[j] - load[i]
        rank_load[rj] += load[i] - load[j]
        for arr in (experts, load, col):
            arr[i], arr[j] = arr[j], arr[i]
    return experts.tolist()


def incremental(current: Sequence[int], weights: Sequence[float], num_ranks: int, capacity: int,
                 replicas: int) -> list[int] | None:
    """A balanced layout reached from `current` with few changes (global policy): the replica counts of
    `replica_counts`; surplus replicas freed from the busiest ranks first; missing ones, heaviest first,
    into free slots of the least-loaded ranks that lack them; then `_refine_slots`. None when the free
    slots cannot take the missing replicas (the caller then uses the placement built from scratch)."""
    counts = replica_counts([float(w) for w in weights], replicas, num_ranks)
    share = {e: float(w) / c for e, (w, c) in enumerate(zip(weights, counts, strict=True))}
    slots = list(current)
    loads = slot_rank_loads(slots, weights, num_ranks, capacity)
    where: dict[int, list[int]] = {}
    for g, e in enumerate(slots):
        if e != EMPTY:
            where.setdefault(e, []).append(g)
    for e in sorted(where):
        extra = len(where[e]) - counts[e]
        for g in sorted(where[e], key=lambda g: (-loads[g // capacity], g))[:max(extra, 0)]:
            slots[g] = EMPTY
    held = [set(slots[r * capacity:(r + 1) * capacity]) - {EMPTY} for r in range(num_ranks)]
    have = [0] * len(weights)
    for e in slots:
        if e != EMPTY:
            have[e] += 1
    rank_load = [sum(share[e] for e in h) for h in held]
    missing = sorted(((share[e], e) for e in range(len(weights)) for _ in range(counts[e] - have[e])),
                     key=lambda it: (-it[0], it[1]))
    for w, e in missing:
        free = [r for r in range(num_ranks) if e not in held[r] and EMPTY in slots[r * capacity:(r + 1) * capacity]]
        if not free:
            return None
        r = min(free, key=lambda r: (rank_load[r], r))
        slots[slots.index(EMPTY, r * capacity, (r + 1) * capacity)] = e
        held[r].add(e)
        rank_load[r] += w
    return _refine_slots(slots, share, num_ranks, capacity)


def hierarchical(num_experts: int, num_ranks: int, replicas: int, ranks_per_node: int | None,
                  num_groups: int | None) -> bool:
    if num_groups is None or ranks_per_node is None:
        return False
    nodes = num_ranks // ranks_per_node
    return (num_groups % nodes == 0 and num_experts % num_groups == 0 and replicas % nodes == 0
            and nodes > 1)


def layer_bins(weights: Sequence[float], num_ranks: int, slots_per_rank: int, replicas: int,
                ranks_per_node: int | None, num_groups: int | None) -> list[list[int]]:
    """The ideal placement of one layer as each rank's experts (not yet in slots)."""
    num_experts = len(weights)
    if not hierarchical(num_experts, num_ranks, replicas, ranks_per_node, num_groups):
        return _replicate_and_pack(weights, range(num_experts), num_ranks, slots_per_rank, replicas)
    assert ranks_per_node is not None and num_groups is not None
    nodes = num_ranks // ranks_per_node
    size = num_experts // num_groups
    group_load = [(float(sum(weights[g * size:(g + 1) * size])), g) for g in range(num_groups)]
    node_groups = _pack(group_load, nodes, num_groups // nodes)  # groups are distinct: no clash
    bins: list[list[int]] = []
    for groups in node_groups:
        experts = [g * size + i for g in sorted(groups) for i in range(size)]
        bins += _replicate_and_pack(weights, experts, ranks_per_node, slots_per_rank, replicas // nodes)
    return bins


def check_loads(loads: Sequence[Sequence[float]], num_experts: int) -> None:
    for i, row in enumerate(loads):
        if len(row) != num_experts:
            raise ValueError(f"MoE layer {i} reports {len(row)} experts, not {num_experts}")
        if any(x < 0 for x in row):
            raise ValueError(f"MoE layer {i} reports a negative load")


def check_shape(num_ranks: int, slots_per_rank: int, num_experts: int, replicas: int,
                 ranks_per_node: int | None) -> None:
    if not num_experts <= replicas <= num_ranks * slots_per_rank:
        raise ValueError(f"{replicas} replicas for {num_experts} experts in {num_ranks}x{slots_per_rank} slots")
    if replicas > num_experts * num_ranks:
        raise ValueError(f"{replicas} replicas need more than one per rank for some of {num_experts} experts")
    if ranks_per_node is not None and (ranks_per_node < 1 or num_ranks % ranks_per_node):
        raise ValueError(f"{ranks_per_node} ranks per node do not divide {num_ranks} ranks")


def rebalance(loads: Sequence[Sequence[float]], num_ranks: int, slots_per_rank: int, *,
              redundant: int | None = None, ranks_per_node: int | None = None, num_groups: int | None = None,
              version: int = 0) -> ExpertPlacement:
    """The ideal placement for `loads[layer][expert]` (token counts, any scale) on `num_ranks` ranks of
    `slots_per_rank` slots, with num_experts + `redundant` replicas per layer (default: every slot).
    Rank r gets global slots [r·s, (r+1)·s), filled with its experts in packing order, then empty ones."""
    if not loads:
        raise ValueError("no MoE layer to place")
    num_experts = len(loads[0])
    check_loads(loads, num_experts)
    replicas = num_ranks * slots_per_rank if redundant is None else num_experts + redundant
    check_shape(num_ranks, slots_per_rank, num_experts, replicas, ranks_per_node)
    layers = []
    for w in loads:
        bins = layer_bins(w, num_ranks, slots_per_rank, replicas, ranks_per_node, num_groups)
        layers.append(tuple(e for b in bins for e in b + [EMPTY] * (slots_per_rank - len(b))))
    return ExpertPlacement(num_ranks, num_experts, slots_per_rank, tuple(layers), version)


# --- fitting a new placement to the current one ---------------------------------------------------------


def _greedy_match(overlap: dict[tuple[int, int], int], size: int) -> list[int]:
    """A matching of `size` candidates to `size` places, largest overlap first (then lowest indices);
    the unmatched ones paired in index order. Returns place[candidate]."""
    place = [-1] * size
    taken = [False] * size
    for (i, j), _ in sorted(overlap.items(), key=lambda kv: (-kv[1], kv[0])):
        if place[i] < 0 and not taken[j]:
            place[i], taken[j] = j, True
    free = iter(j for j in range(size) if not taken[j])
    return [p if p >= 0 else next(free) for p in place]


def align(current: Sequence[int], bins: list[list[int]], slots_per_rank: int, ranks_per_node: int) -> list[int]:
    """The candidate `bins` (experts per rank, grouped in nodes of `ranks_per_node` ranks) laid into
    global slots so that as few slots as possible change from `current`: candidate nodes onto current
    nodes, then candidate ranks onto current ranks within them, by shared experts; an expert the rank
    already holds stays in its slot, the rest fill the freed slots in order."""
    s = slots_per_rank
    num_ranks = len(bins)
    nodes = num_ranks // ranks_per_node
    held = [set(current[r * s:(r + 1) * s]) - {EMPTY} for r in range(num_ranks)]
    node_of_rank = list(range(num_ranks))  # candidate rank -> current rank
    node_map = list(range(nodes))
    if nodes > 1:
        node_held = [set().union(*held[n * ranks_per_node:(n + 1) * ranks_per_node]) for n in range(nodes)]
        node_cand = [set().union(*map(set, bins[n * ranks_per_node:(n + 1) * ranks_per_node]))
                     for n in range(nodes)]
        node_map = _greedy_match({(i, j): len(node_cand[i] & node_held[j]) for i in range(nodes)
                                  for j in range(nodes)}, nodes)
    for i in range(nodes):
        cand = range(i * ranks_per_node, (i + 1) * ranks_per_node)
        base = node_map[i] * ranks_per_node
        where: dict[int, list[int]] = {}
        for k in range(ranks_per_node):
            for e in held[base + k]:
                where.setdefault(e, []).append(k)
        overlap: dict[tuple[int, int], int] = {}
        for a, c in enumerate(cand):
            for e in bins[c]:
                for k in where.get(e, ()):
                    overlap[a, k] = overlap.get((a, k), 0) + 1
        for a, k in enumerate(_greedy_match(overlap, ranks_per_node)):
            node_of_rank[cand[a]] = base + k
    out = list(current)
    for c, r in enumerate(node_of_rank):
        mine = current[r * s:(r + 1) * s]
        keep = set(bins[c]) & set(mine)
        fresh = iter([e for e in bins[c] if e not in keep] + [EMPTY] * s)
        for g in range(r * s, (r + 1) * s):
            if current[g] not in keep:  # EMPTY never is
                out[g] = next(fresh)
    return out


def count_moves(current: Sequence[int], target: Sequence[int]) -> int:
    """Slots that must load an expert's weights: those whose expert changes to another (not to empty)."""
    return sum(1 for a, b in zip(current, target, strict=True) if a != b and b != EMPTY)


def bounded(current: Sequence[int], target: Sequence[int], weights: Sequence[float], num_ranks: int,
             slots_per_rank: int, max_moves: int) -> list[int]:
    """At most `max_moves` of the slot changes from `current` to `target`, chosen step by step: each step
    one change, or two when the first takes away an expert's last replica and the second gives it one
    back elsewhere (how two single-replica experts trade ranks). Every placement after a step is valid
    (each expert keeps a replica, no rank holds one twice). The step taken is the one with the lowest
    predicted (max rank load, sum of squared rank loads), lowest slots first on a tie; the best
    placement met on the way is returned (possibly `current` itself).

    The pair steps matter when every slot is full: a swap of two single-replica experts has no valid
    one-change order, yet it is most of what a rebalance between full ranks does."""
    s = slots_per_rank
    slots = list(current)
    holders: dict[int, set[int]] = {}  # expert -> ranks holding it (one replica each)
    for g, e in enumerate(slots):
        if e != EMPTY:
            holders.setdefault(e, set()).add(g // s)
    loads = slot_rank_loads(slots, weights, num_ranks, s)
    best_score = (max(loads), sum(x * x for x in loads))
    best = list(slots)
    pending = [g for g in range(len(slots)) if slots[g] != target[g]]
    budget = max_moves
    while budget > 0:
        by_load = sorted(range(num_ranks), key=lambda r: -loads[r])
        sumsq = sum(x * x for x in loads)
        arriving: dict[int, list[int]] = {}  # expert -> pending slots that would receive it
        for g in pending:
            arriving.setdefault(target[g], []).append(g)
        choice: tuple[tuple[float, float], tuple[int, ...], dict[int, float]] | None = None
        for g in pending:
            a = slots[g]
            steps = [(g,)]
            if a != EMPTY and len(holders[a]) < 2 and budget >= 2:
                steps = [(g, h) for h in arriving.get(a, ()) if h // s != g // s]
            for step in steps:
                new = _after_changes([(h, slots[h], target[h]) for h in step], s, holders, weights, loads)
                if new is None:
                    continue
                peak = max(new.values())
                for x in by_load:  # the busiest rank the step leaves alone
                    if x not in new:
                        peak = max(peak, loads[x])
                        break
                key = (peak, sumsq + sum(v * v - loads[x] * loads[x] for x, v in new.items()))
                if choice is None or (key, step) < (choice[0], choice[1]):
                    choice = (key, step, new)
        if choice is None:
            break
        key, step, new = choice
        for g in step:
            a, b, r = slots[g], target[g], g // s
            if a != EMPTY:
                holders[a].discard(r)
            if b != EMPTY:
                holders.setdefault(b, set()).add(r)
            slots[g] = b
            pending.remove(g)
        for x, v in new.items():
            loads[x] = v
        budget -= len(step)
        if key < best_score:
            best_score, best = key, list(slots)
    return best


def _after_changes(changes: Sequence[tuple[int, int, int]], slots_per_rank: int, holders: dict[int, set[int]],
                   weights: Sequence[float], loads: Sequence[float]) -> dict[int, float] | None:
    """The loads of the ranks that change when each (slot, old expert, new expert) of `changes` is made,
    or None when the result would be invalid (an expert left without a replica, a rank holding one
    twice). Each touched expert's load is taken off its old holders and spread over its new ones."""
    touched = {e for _, a, b in changes for e in (a, b) if e != EMPTY}
    after = {e: set(holders.get(e, ())) for e in touched}
    for g, a, b in changes:
        r = g // slots_per_rank
        if a != EMPTY:
            after[a].discard(r)
        if b != EMPTY:
            if r in after[b]:
                return None
            after[b].add(r)
    if any(not after[e] for e in touched):
        return None
    new: dict[int, float] = {}
    for e in sorted(touched):
        before = holders.get(e, set())
        for x in before:
            new[x] = new.get(x, loads[x]) - weights[e] / len(before)
        for x in after[e]:
            new[x] = new.get(x, loads[x]) + weights[e] / len(after[e])
    return new
