"""Draft trees: several guessed continuations of one request, verified in one forward pass.

Where a request's history branches (the same four tokens were followed by `return x` once and by `raise` another
time), a chain proposal must bet on one continuation; a tree proposes both and the target's own choice picks the
branch. A tree of n draft nodes is its `parents` list:

* `parents[i]` is the node that node i follows: -1 for the root (the request's last committed token), else an
  earlier node (`parents[i] < i`), so every prefix of the node list is itself a tree;
* a node's *first child* (the first node in order whose parent it is) is its main child; the main chain (the root's
  first child, its first child, ...) is the continuation a chain proposal would have made. The controller's
  per-token acceptance alpha is about it (`main_chain_acceptance`);
* `shares[i]` is the fraction of the guesser's evidence (occurrences of the matched context) that continues the
  parent's path with node i: siblings' shares add up to at most 1.

A chain is the tree whose parents are -1, 0, 1, ...; code passes `None` for it and keeps the chain's own paths.

Verification (`accepted_path`): row 0 is the root's, row 1 + i node i's; each row's token is what plain decoding
would pick (or draw) after that node's path. From the root, the walk moves to the child whose token equals the
current row's pick and stops where none does; the committed tokens are the walked nodes' tokens and the pick of the
last row walked. A greedy run is exactly plain greedy decoding; a seeded point-mass run draws exactly plain
decoding's tokens (the same argument as for a chain, verify.py), since each row samples as plain decoding at its
position would.

Layout (attention.py): node i's K/V goes to the slot of position start + 1 + i (rows stay in node order), its rotary
position is start + depth(i), and it attends to the context, the root and its own ancestors (`tree_mask`). After
verification the walked nodes' K/V moves to the chain positions they now hold (`moves`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def validate(parents: Sequence[int]) -> None:
    """ValueError unless every parent is -1 or an earlier node."""
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"draft tree node {i} has parent {p}: a parent is -1 or an earlier node")


def is_chain(parents: Sequence[int]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node: 1 for the root's children."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def path(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from the root's child down to `node`, in order (empty for the root, -1)."""
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def main_chain(parents: Sequence[int]) -> list[int]:
    """The nodes of the main chain (each node's first child, from the root)."""
    first: dict[int, int] = {}
    for i, p in enumerate(parents):
        first.setdefault(p, i)
    out, node = [], first.get(-1)
    while node is not None:
        out.append(node)
        node = first.get(node)
    return out


def accepted_path(parents: Sequence[int], tokens: Sequence[int], picks: Sequence[int]) -> list[int]:
    """The nodes verification accepts: picks[0] is the root row's token, picks[1 + i] node i's (module docstring)."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    walked: list[int] = []
    node = -1
    while True:
        want = picks[node + 1]
        nxt = next((c for c in children.get(node, ()) if tokens[c] == want), None)
        if nxt is None:
            return walked
        walked.append(nxt)
        node = nxt


def main_chain_acceptance(parents: Sequence[int], walked: Sequence[int]) -> tuple[int, int]:
    """(proposed, accepted) of the main chain for the controller's alpha: the main chain's length and how many of
    its nodes the walk took before leaving it."""
    chain = main_chain(parents)
    accepted = 0
    while accepted < len(chain) and accepted < len(walked) and walked[accepted] == chain[accepted]:
        accepted += 1
    return len(chain), accepted


def moves(walked: Sequence[int]) -> list[tuple[int, int]]:
    """(from node, to chain index) for the walked nodes whose K/V is not where the chain puts it: node walked[j]
    was computed at offset 1 + walked[j] and belongs at 1 + j. walked[j] >= j, so copying in order never
    overwrites a source still to be read."""
    return [(node, j) for j, node in enumerate(walked) if node != j]


def node_gains(parents: Sequence[int], shares: Sequence[float], first_p: Sequence[float]) -> list[float]:
    """The probability that verification walks to each node. A first child is reached from its parent with
    probability first_p[i] (the controller's estimate for a chain token there); a later child takes what its
    first sibling leaves, 1 - first_p, in proportion to its share of the evidence the first sibling does not
    have. Never more at a child than at its parent."""
    first: dict[int, int] = {}
    gains: list[float] = []
    for i, p in enumerate(parents):
        f = first.setdefault(p, i)
        if f == i:
            cond = first_p[i]
        else:
            rest = 1.0 - shares[f]
            cond = (1.0 - first_p[f]) * shares[i] / rest if rest > 0.0 else 0.0
        gains.append((1.0 if p < 0 else gains[p]) * min(1.0, max(0.0, cond)))
    return gains


def tree_mask(parents: Sequence[int], context: int) -> torch.Tensor:
    """[1 + n, context + 1 + n] bool: row 0 (the root, at position `context`) and row 1 + i (node i, written at slot
    context + 1 + i) see every earlier position, the root and their own ancestors with themselves."""
    n = len(parents)
    mask = torch.zeros(1 + n, context + 1 + n, dtype=torch.bool)
    mask[:, : context + 1] = True
    for i, p in enumerate(parents):
        row = mask[1 + i]
        if p >= 0:
            row[context + 1 :] = mask[1 + p, context + 1 :]
        row[context + 1 + i] = True
    return mask


def subtree(parents: Sequence[int], keep: Sequence[int]) -> list[int]:
    """The parents list of the nodes `keep` (ascending, closed under parents), renumbered in their order."""
    index = {node: j for j, node in enumerate(keep)}
    return [-1 if parents[node] < 0 else index[parents[node]] for node in keep]


def build(continuations: Sequence[Sequence[int]], max_depth: int, max_leaves: int,
          main: Sequence[int] | None = None) -> tuple[list[int], list[int], list[float]]:
    """(tokens, parents, shares) of the tree of `continuations`, most important first: `main` (else the first
    continuation) is the main chain, cut at max_depth; the continuations add their branches, in order, while the
    tree has at most max_leaves leaves. Each node's share counts the continuations through it (kept as a branch
    or not; `main` is not one) against those through its parent. A tree of one continuation is a chain."""
    tokens: list[int] = []
    parents: list[int] = []
    counts: list[int] = []
    child: dict[tuple[int, int], int] = {}  # (parent, token) -> node of the whole trie
    paths: list[list[int]] = []
    for seq in ([main] if main else []) + list(continuations):
        node, walked = -1, []
        for tok in seq[:max_depth]:
            nxt = child.get((node, tok))
            if nxt is None:
                nxt = child[(node, tok)] = len(tokens)
                tokens.append(tok)
                parents.append(node)
                counts.append(0)
            counts[nxt] += seq is not main
            walked.append(nxt)
            node = nxt
        if walked:
            paths.append(walked)
    kept: set[int] = set()
    leaves: set[int] = set()
    for walked in paths:
        new = [n for n in walked if n not in kept]
        if not new:
            continue
        grows_leaf = parents[new[0]] in leaves  # extends a leaf: the leaf count stays
        if not grows_leaf and len(leaves) >= max_leaves:
            continue
        leaves.discard(parents[new[0]])
        leaves.add(walked[-1])
        kept.update(new)
    keep = sorted(kept)  # trie order: parents first, the first continuation's nodes before any other
    total = len(paths) - bool(main)
    return ([tokens[n] for n in keep], subtree(parents, keep),
            [_share(counts[n], total if parents[n] < 0 else counts[parents[n]]) for n in keep])


def _share(count: int, of: int) -> float:
    return count / of if of else 1.0
