"""Ordered scatter-add of rows from several tensors (`ordered_add.c`).

`ordered_add(out, token, row, sources)` does, for i in order, `out[token[i]] += cat(sources)[row[i]]`:
torch's `index_add_` over the gathered rows, without gathering them. Every element receives its
additions one at a time in entry order on both paths (the C kernel on CPU for fp32, torch elsewhere),
so the two give the same bits. The expert-parallel combine adds each token's expert outputs in
ascending expert id with it; at a 1,536-token prefill of smollm2-moe, gathering the outputs into one
tensor first cost more than the all-to-alls that brought them.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from deepinfer.kernels import build

__all__ = ["MAX_SOURCES", "native_available", "ordered_add", "ordered_add_reference"]

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("ordered_add.c")
MAX_SOURCES = 8  # OA_MAX_SOURCES


def _load(path: Path) -> tuple[ctypes.CDLL, dict[str, object]]:
    lib = build.dlopen_checked(path)
    fn = lib.oa_ordered_add_f32
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    # out, ldo, T, H, src pointers, src row strides, src starts, nsrc, token, row, A, threads
    fn.argtypes = [vp, i64, i64, i64, vp, vp, vp, ctypes.c_int, vp, vp, i64, ctypes.c_int]
    fn.restype = ctypes.c_int
    return lib, {"ordered_add": fn}


_loader = build.KernelLoader(_SOURCE, "ordered_add", "ordered add kernel", _load, probe_prefix="oa", log=logger,
                             simd=())
_fns = _loader.fns


def native_available() -> bool:
    """Build (cached on disk) and load the kernel; False, with the reason logged once, if it cannot."""
    return bool(_fns) or _loader.available()


def ordered_add_reference(out: torch.Tensor, token: torch.Tensor, row: torch.Tensor,
                          sources: Sequence[torch.Tensor]) -> None:
    """The torch path of `ordered_add` (same contract)."""
    rows = sources[0] if len(sources) == 1 else torch.cat(list(sources))
    out.index_add_(0, token, rows.index_select(0, row).to(out.dtype))


def _rows_ok(t: torch.Tensor, h: int) -> bool:
    return t.dtype is torch.float32 and t.is_cpu and t.dim() == 2 and t.shape[1] == h and t.stride(1) == 1 \
        and (t.shape[0] <= 1 or t.stride(0) >= h)


def ordered_add(out: torch.Tensor, token: torch.Tensor, row: torch.Tensor, sources: Sequence[torch.Tensor]) -> None:
    """For i in order: out[token[i]] += (sources end to end)[row[i]], in place. out [T, H]; token and row
    [A] int64; each source [R_s, H]. IndexError for a token or row out of range (nothing is added)."""
    h = out.shape[1]
    if token.shape != row.shape:
        raise ValueError(f"token {tuple(token.shape)} and row {tuple(row.shape)} differ")
    fn = _fns.get("ordered_add") if _fns or _loader.available() else None
    if (fn is None or not 1 <= len(sources) <= MAX_SOURCES or not _rows_ok(out, h)
            or not all(_rows_ok(s, h) for s in sources) or token.dtype is not torch.int64
            or row.dtype is not torch.int64 or not token.is_cpu or not row.is_cpu):
        ordered_add_reference(out, token, row, sources)
        return
    token, row = token.contiguous(), row.contiguous()
    n = len(sources)
    starts = [0]
    for s in sources:
        starts.append(starts[-1] + s.shape[0])
    ptrs = (ctypes.c_void_p * n)(*[s.data_ptr() for s in sources])
    strides = (ctypes.c_int64 * n)(*[s.stride(0) for s in sources])
    start = (ctypes.c_int64 * (n + 1))(*starts)
    rc = fn(out.data_ptr(), out.stride(0), out.shape[0], h, ptrs, strides, start, n, token.data_ptr(),
            row.data_ptr(), token.numel(), torch.get_num_threads())
    if rc == -2:
        raise IndexError(f"ordered_add: a token outside [0, {out.shape[0]}) or a row outside [0, {starts[-1]})")
    if rc:
        raise ValueError(f"ordered_add: bad shapes: out {tuple(out.shape)}, sources "
                         f"{[tuple(s.shape) for s in sources]}")
