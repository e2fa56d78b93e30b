"""The expert-parallel executor's bookkeeping around its all-to-alls (`ep_route.c`), with a torch path.

A MoE layer call of one rank (deepinfer/engine/ep/experts.py) splits its assignments by where they are
computed, packs the rows it sends, unpacks the rows it receives and orders the terms it adds back.
As torch ops that is ~80 small ops per layer call (~0.5 ms of a decode step's layer at 32 concurrent on
the 2-core VM measured, more than the exchanges themselves); the C functions do each in one call. Both
paths give the same values: the same indices in the same order, the same bytes on the wire; the C path
also refuses out-of-range tokens, experts and received ids (IndexError / ValueError) where torch would
index out of range or treat a bad id as padding. The C path is taken for fp32 CPU tensors; anything
else, or no compiler, takes the torch path.

Row layout on the wire (dense and sparse layouts alike): the token's hidden state (H values of the
executor's dtype), then `width` int32 expert ids (-1 = padding), then `width` fp32 weights.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.kernels import build
from deepinfer.kernels.routing import Routing, count_assignments

__all__ = ["ID_DTYPE", "WEIGHT_DTYPE", "Split", "as_bytes", "columns", "combine_order", "itemsize", "native_available",
           "order_of", "pack_dense", "row_bytes", "split", "unpack"]

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("ep_route.c")
_ERR_INDEX, _ERR_TABLE, _ERR_WIDTH, _ERR_ID, _ERR_ROWS = -2, -3, -4, -5, -6
ID_DTYPE = torch.int32  # expert ids on the wire
WEIGHT_DTYPE = torch.float32  # routing weights on the wire
_I64 = torch.int64


def _load(path: Path) -> tuple[ctypes.CDLL, dict[str, object]]:
    lib = build.dlopen_checked(path)
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    fns = {
        "split": (lib.ep_split, [vp, vp, i64, i64, vp, vp, vp, i64, i64, i64, i64, vp, vp, vp, vp, vp, vp]),
        "pack_dense": (lib.ep_pack_dense_f32,
                       [vp, i64, i64, i64, vp, vp, vp, vp, i64, vp, i64, i64, i64, i64, vp, vp, vp, vp, vp]),
        "unpack": (lib.ep_unpack_f32, [vp, i64, i64, i64, i64, vp, i64, vp, vp, vp, vp, vp]),
        "combine_order": (lib.ep_combine_order,
                          [vp, vp, i64, i64, vp, vp, i64, vp, vp, i64, vp, vp, i64, vp, vp, vp, vp]),
    }
    for fn, argtypes in fns.values():
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return lib, {name: fn for name, (fn, _) in fns.items()}


_loader = build.KernelLoader(_SOURCE, "ep_route", "expert-parallel routing kernel", _load, probe_prefix="ep",
                             log=logger, simd=())
_fns = _loader.fns


def native_available() -> bool:
    """Build (cached on disk) and load the kernel; False, with the reason logged once, if it cannot."""
    return bool(_fns) or _loader.available()


def _fn(name: str, *tensors: torch.Tensor) -> object | None:
    """The C function `name` if it is loaded and every tensor is on the CPU, else None (the torch path)."""
    if not (_fns or _loader.available()) or not all(t.is_cpu for t in tensors):
        return None
    return _fns[name]


def _check(rc: int, what: str) -> None:
    if rc == _ERR_INDEX:
        raise IndexError(f"{what}: a token, expert or rank outside its range")
    if rc == _ERR_TABLE:
        raise ValueError(f"{what}: the placement's replica table or this rank's slots do not fit the routing")
    if rc == _ERR_WIDTH:
        raise ValueError(f"{what}: a token has more assignments on one rank than a row's width")
    if rc == _ERR_ID:
        raise ValueError(f"{what}: a received row names an expert id outside [-1, num_experts)")
    if rc:
        raise ValueError(f"{what}: the assignments' term positions do not cover each assignment once (code {rc})")


@dataclass
class Split:
    """A layer call's assignments by where they are computed (indices into its routing, ascending)."""

    dest: torch.Tensor  # [A] each assignment's rank
    at_early: torch.Tensor  # computed here, on the first half of this rank's slots
    at_late: torch.Tensor  # computed here, on the rest
    at_far: torch.Tensor  # computed on other ranks


def split(routing: Routing, num_tokens: int, replica_ranks: torch.Tensor, num_replicas: torch.Tensor,
          slot_of: torch.Tensor, half: int, rank: int, counts: torch.Tensor) -> Split:
    """Assignment a goes to rank replica_ranks[e, (token + rank) % num_replicas[e]] (e = its expert);
    this rank's own are early when slot_of[e] < half. `counts` [E] gains every assignment's expert."""
    token, expert = routing.token, routing.expert
    fn = _fn("split", token, expert, replica_ranks, num_replicas, slot_of, counts)
    if (fn is None or token.dtype is not _I64 or expert.dtype is not _I64 or replica_ranks.dtype is not _I64
            or num_replicas.dtype is not _I64 or slot_of.dtype is not _I64 or counts.dtype is not _I64):
        return _split_reference(routing, replica_ranks, num_replicas, slot_of, half, rank, counts)
    token, expert = token.contiguous(), expert.contiguous()
    replica_ranks, num_replicas = replica_ranks.contiguous(), num_replicas.contiguous()
    a, n = token.numel(), replica_ranks.shape[1]
    out = torch.empty(4 * a + 3, dtype=_I64)
    p = out.data_ptr()
    rc = fn(token.data_ptr(), expert.data_ptr(), a, num_tokens, replica_ranks.data_ptr(),  # type: ignore[operator]
            num_replicas.data_ptr(), slot_of.contiguous().data_ptr(), num_replicas.numel(), n, rank, half, p,
            p + 8 * a, p + 16 * a, p + 24 * a, p + 32 * a, counts.data_ptr())
    _check(rc, "ep split")
    ne, nl, nf = out[4 * a:].tolist()
    return Split(out[:a], out[a:a + ne], out[2 * a:2 * a + nl], out[3 * a:3 * a + nf])


def _split_reference(routing: Routing, replica_ranks: torch.Tensor, num_replicas: torch.Tensor,
                     slot_of: torch.Tensor, half: int, rank: int, counts: torch.Tensor) -> Split:
    expert = routing.expert
    counts += count_assignments(routing, counts.shape[0])
    dest = replica_ranks[expert, (routing.token + rank) % num_replicas[expert]]
    here = dest == rank
    early = here & (slot_of[expert] < half)
    at_far, at_early, at_late = [m.nonzero().squeeze(1) for m in (~here, early, here & ~early)]
    return Split(dest, at_early, at_late, at_far)


def pack_dense(x: torch.Tensor, routing: Routing, s: Split, rank: int, num_ranks: int, width: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, list[int], int]:
    """The dense layout's send rows [(num_ranks - 1) · T, row bytes] uint8: every peer (ascending rank)
    gets one row per token of x [T, H], its far assignments to that peer in its columns in `s.at_far`
    order. Returns (rows, each far assignment's place in the order its terms come back, far assignments
    per rank, rows that carry any)."""
    fn = _fn("pack_dense", x, routing.token, routing.expert, routing.weight, s.dest, s.at_far)
    if (fn is None or x.dtype is not torch.float32 or dtype is not torch.float32 or x.dim() != 2
            or x.stride(1) != 1 or routing.weight.dtype is not torch.float32):
        return _pack_dense_reference(x, routing, s, rank, num_ranks, width, dtype)
    t, h = x.shape
    peers = num_ranks - 1
    send = torch.empty((peers * t, 4 * h + 8 * width), dtype=torch.uint8)
    f = s.at_far.numel()
    scratch = torch.empty(peers * t + f + num_ranks + 1, dtype=_I64)
    p = scratch.data_ptr()
    token, expert, weight = routing.token.contiguous(), routing.expert.contiguous(), routing.weight.contiguous()
    rc = fn(x.data_ptr(), x.stride(0), t, h, token.data_ptr(), expert.data_ptr(), weight.data_ptr(),  # type: ignore[operator]
            s.dest.data_ptr(), token.numel(), s.at_far.contiguous().data_ptr(), f, num_ranks, rank, width,
            send.data_ptr(), p, p + 8 * peers * t, p + 8 * (peers * t + f), p + 8 * (peers * t + f + num_ranks))
    _check(rc, "ep dense pack")
    tail = scratch[peers * t + f:].tolist()
    return send, scratch[peers * t:peers * t + f], tail[:num_ranks], tail[num_ranks]


def _pack_dense_reference(x: torch.Tensor, routing: Routing, s: Split, rank: int, num_ranks: int, width: int,
                          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, list[int], int]:
    t, hidden = x.shape
    peers, w = num_ranks - 1, width
    far_token = routing.token.index_select(0, s.at_far)
    far_dest = s.dest.index_select(0, s.at_far)
    key = (far_dest - (far_dest > rank).long()) * t + far_token  # the row: peer-major (rank order), then token
    place, per_row = columns(key, peers * t)
    cell = key * w + place
    ids = torch.full((peers * t * w,), -1, dtype=ID_DTYPE, device=x.device)
    ids[cell] = routing.expert.index_select(0, s.at_far).to(ID_DTYPE)
    weights = torch.zeros((peers * t * w,), dtype=WEIGHT_DTYPE, device=x.device)
    weights[cell] = routing.weight.index_select(0, s.at_far).to(WEIGHT_DTYPE)
    states = x.to(dtype).expand(peers, t, hidden).reshape(-1, hidden)
    send = torch.cat([as_bytes(states), as_bytes(ids.view(-1, w)), as_bytes(weights.view(-1, w))], dim=1)
    sent_terms = torch.bincount(far_dest, minlength=num_ranks).tolist()
    return send, order_of(cell), sent_terms, int((per_row > 0).sum())


def unpack(got: torch.Tensor, rows: list[int], hidden: int, dtype: torch.dtype, width: int,
           num_experts: int) -> tuple[torch.Tensor, Routing, list[int]]:
    """Received rows [R, row bytes] of one `width`, `rows[r]` of them from rank r: ([R, hidden] row
    states, their assignments with token = the row, in (row, column) order, assignments from each rank).
    Padding (id -1) is dropped; ValueError for an id outside [-1, num_experts)."""
    fn = _fn("unpack", got)
    xb = hidden * itemsize(dtype)
    if fn is None or dtype is not torch.float32 or not got.is_contiguous():
        return _unpack_reference(got, rows, hidden, dtype, width, num_experts)
    r, n = got.shape[0], len(rows)
    most = r * width
    # int64 words: token [0, most), expert [most, 2 most), per rank [2 most, +n), count, then fp32 weights
    wat = 2 * most + n + 1
    out = torch.empty(wat + (most + 1) // 2, dtype=_I64)
    p = out.data_ptr()
    counts = torch.tensor(rows, dtype=_I64)
    rc = fn(got.data_ptr(), r, hidden, width, num_experts, counts.data_ptr(), n, p, p + 8 * most,  # type: ignore[operator]
            p + 8 * wat, p + 8 * 2 * most, p + 8 * (wat - 1))
    _check(rc, "ep unpack")
    tail = out[2 * most:wat].tolist()
    k = tail[n]
    weights = out[wat:].view(torch.float32)[:k]
    states = got[:, :xb].contiguous().view(dtype) if r else torch.empty((0, hidden), dtype=dtype)
    return states, Routing(out[:k], out[most:most + k], weights), tail[:n]


def _unpack_reference(got: torch.Tensor, rows: list[int], hidden: int, dtype: torch.dtype, width: int,
                      num_experts: int) -> tuple[torch.Tensor, Routing, list[int]]:
    xb = hidden * itemsize(dtype)
    ids = got[:, xb : xb + 4 * width].contiguous().view(ID_DTYPE).long()
    if bool(((ids < -1) | (ids >= num_experts)).any()):
        raise ValueError("ep unpack: a received row names an expert id outside [-1, num_experts)")
    weights = got[:, xb + 4 * width :].contiguous().view(WEIGHT_DTYPE)
    real = ids >= 0
    row = torch.arange(got.shape[0], device=got.device).unsqueeze(1).expand_as(ids)
    per_rank = [int(c.sum()) for c in real.split(rows)] if got.shape[0] else [0] * len(rows)
    return got[:, :xb].contiguous().view(dtype), Routing(row[real], ids[real], weights[real]), per_rank


def combine_order(routing: Routing, num_tokens: int, s: Split, early_order: torch.Tensor,
                  late_order: torch.Tensor, sent_at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, row) for `ordered_add` over (early terms, late terms, returned terms) end to end: every
    assignment, sorted by (token, expert), with the row of its term. `early_order[j]` is the `s.at_early`
    entry of the j-th early term (late alike); far assignment j's term comes back at `sent_at[j]`."""
    fn = _fn("combine_order", routing.token, routing.expert, early_order, late_order, sent_at)
    if fn is None or any(t.dtype is not _I64 for t in (routing.token, routing.expert, early_order, late_order,
                                                        sent_at)):
        return _combine_order_reference(routing, s, early_order, late_order, sent_at)
    a = routing.token.numel()
    out = torch.empty(3 * a + num_tokens + 1, dtype=_I64)  # token, row, then scratch: row, start
    p = out.data_ptr()
    c = [t.contiguous() for t in (routing.token, routing.expert, s.at_early, early_order, s.at_late, late_order,
                                  s.at_far, sent_at)]
    rc = fn(c[0].data_ptr(), c[1].data_ptr(), a, num_tokens, c[2].data_ptr(), c[3].data_ptr(),  # type: ignore[operator]
            c[2].numel(), c[4].data_ptr(), c[5].data_ptr(), c[4].numel(), c[6].data_ptr(), c[7].data_ptr(),
            c[6].numel(), p + 16 * a, p + 24 * a, p, p + 8 * a)
    _check(rc, "ep combine order")
    return out[:a], out[a:2 * a]


def _combine_order_reference(routing: Routing, s: Split, early_order: torch.Tensor, late_order: torch.Tensor,
                             sent_at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    row = torch.empty_like(routing.token)
    e, late = early_order.numel(), late_order.numel()
    row[s.at_early[early_order]] = torch.arange(e, device=row.device)
    row[s.at_late[late_order]] = torch.arange(e, e + late, device=row.device)
    row[s.at_far] = sent_at + (e + late)
    num_experts = int(routing.expert.max()) + 1 if routing.expert.numel() else 1
    order = torch.argsort(routing.token * num_experts + routing.expert)
    return routing.token[order], row[order]


def columns(row_of: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each assignment's column: its rank among its row's assignments in assignment order, [num_rows]
    assignments per row)."""
    order = torch.argsort(row_of, stable=True)
    per_row = torch.bincount(row_of, minlength=num_rows)
    first = torch.cumsum(per_row, 0) - per_row
    place = torch.empty_like(order)
    place[order] = torch.arange(order.shape[0], device=order.device) - first[row_of[order]]
    return place, per_row


def order_of(position: torch.Tensor) -> torch.Tensor:
    """Each element's rank among `position`'s (distinct) values: where it sits in ascending order."""
    order = torch.argsort(position)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def row_bytes(hidden: int, dtype: torch.dtype, width: int) -> int:
    """Bytes of one wire row: a hidden state of `dtype`, `width` ids and `width` weights."""
    return hidden * itemsize(dtype) + width * (itemsize(ID_DTYPE) + itemsize(WEIGHT_DTYPE))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """[R, C] as its raw bytes [R, C · itemsize] (a view of a contiguous copy)."""
    return t.contiguous().view(torch.uint8)
