"""Linear layers and embedding lookups over a weight held either as an fp32 tensor or packed in GGUF
blocks (`PackedWeight`, see deepinfer.loading.packed_weights): the models call these and never look at
which one they hold.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from deepinfer.kernels.dense_linear import AMX_MIN_ROWS as DENSE_AMX_MIN_ROWS
from deepinfer.kernels.dense_linear import MAX_ROWS as DENSE_MAX_ROWS
from deepinfer.kernels.dense_linear import dense_linear, dense_linear_amx
from deepinfer.kernels.huge_pages import huge_page_bytes
from deepinfer.kernels.quant_linear import PackedWeight, quant_linear
from deepinfer.loading.packed_weights import Weight

__all__ = ["SMALL_BATCH_ROWS", "Weight", "embed_rows", "fuse_rows", "in_one_arena", "linear", "to_device"]

# fp32 weights on CPU: up to dense_linear.MAX_ROWS rows the C kernel (kernels/dense_linear.c) streams W once
# for all rows, batch-invariantly; from dense_linear.AMX_MIN_ROWS, on a CPU with AMX-BF16, its tile path
# (dense_amx.h); otherwise F.linear (the BLAS GEMM). Without the kernel (no compiler), up to
# SMALL_BATCH_ROWS rows compute (W @ x.T).T instead of x @ W.T: on an AVX2 VM's MKL that took a multi-threaded
# GEMM where F.linear took a single-threaded GEMV (2.3x/4x/1.07x/1.15x faster at 1/2/32/128 rows of SmolLM2),
# though on the AVX-512 VM of 2026-12-02 it was 2.5x slower at one row: which BLAS path wins is machine-
# dependent, the reason for the kernel.
SMALL_BATCH_ROWS = 256


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias) for x [rows, in], w [out, in]. A packed w is multiplied from its blocks on the
    engine's thread budget (torch.get_num_threads(): the engine thread sets it to config.num_threads)."""
    if isinstance(w, PackedWeight):
        y = quant_linear(x, w, torch.get_num_threads())
        return y + bias if bias is not None else y
    rows = x.shape[0]
    if rows <= DENSE_MAX_ROWS and x.is_cpu:
        y = dense_linear(x, w, torch.get_num_threads())
        if y is not None:
            return y + bias if bias is not None else y
    if rows >= DENSE_AMX_MIN_ROWS and x.is_cpu:
        y = dense_linear_amx(x, w, torch.get_num_threads())
        if y is not None:
            return y + bias if bias is not None else y
    if rows > SMALL_BATCH_ROWS:
        return F.linear(x, w, bias)
    # One row would still take the GEMV path: pad it to two.
    xt = (x.repeat(2, 1) if rows == 1 else x).t()
    y = torch.mm(w, xt).t()[:rows]
    return (y + bias) if bias is not None else y.contiguous()


def fuse_rows(parts: Sequence[Weight]) -> Weight:
    """One weight whose output rows are `parts`' rows in order (Q/K/V into QKV, gate/up into one).
    Packed parts of one format stay packed (rows are whole blocks); a mix is fused in fp32."""
    if all(isinstance(p, PackedWeight) for p in parts) and len({p.format for p in parts}) == 1:  # type: ignore[union-attr]
        blocks = torch.cat([p.blocks for p in parts])  # type: ignore[union-attr]
        first = parts[0]
        assert isinstance(first, PackedWeight)
        return PackedWeight(first.format, blocks, blocks.shape[0], first.in_features)
    return torch.cat([p.dequantize() if isinstance(p, PackedWeight) else p for p in parts])


def embed_rows(ids: torch.Tensor, table: Weight) -> torch.Tensor:
    """Rows `ids` of an embedding table [vocab, hidden] as fp32 [len(ids), hidden]; a packed table
    dequantises only the rows looked up."""
    if isinstance(table, PackedWeight):
        rows = PackedWeight(table.format, table.blocks[ids].contiguous(), ids.numel(), table.in_features)
        return rows.dequantize()
    return F.embedding(ids, table)


def to_device(w: Weight, device: str) -> Weight:
    """`w` on `device`; a tensor also as fp32 (what every model computes in)."""
    return w.to(device) if isinstance(w, PackedWeight) else w.to(device=device, dtype=torch.float32)


_ARENA_ALIGN = 4096


def in_one_arena(weights: Sequence[Weight]) -> list[Weight]:
    """`weights` with every packed CPU weight copied, in order, into one huge-page buffer
    (huge_pages.py); other weights are returned as they are. Batch-1 decode streams every packed
    weight once per token: in 2 MiB pages, laid out in the order a step reads them, the same
    products ran ~10% faster than from separate 4 KiB-page allocations (SmolLM2 Q4_1, 121 products
    per token, 2 threads)."""
    packed = [w for w in weights if isinstance(w, PackedWeight) and w.blocks.is_cpu]
    if not packed:
        return list(weights)
    offsets, total = {}, 0
    for w in packed:
        if id(w) not in offsets:
            offsets[id(w)] = total
            total += -(-w.nbytes // _ARENA_ALIGN) * _ARENA_ALIGN
    flat = huge_page_bytes(total)
    moved: dict[int, PackedWeight] = {}
    for w in packed:
        if id(w) in moved:
            continue
        lo = offsets[id(w)]
        blocks = flat[lo:lo + w.nbytes].view(w.blocks.shape)
        blocks.copy_(w.blocks)
        moved[id(w)] = PackedWeight(w.format, blocks, w.out_features, w.in_features)
    return [moved.get(id(w), w) for w in weights]  # type: ignore[misc]
