"""Paged attention for decode rows (one query token per sequence) on CPU.

`paged_decode_attention` reads K/V in place through the block tables with a small C kernel
(`paged_attention.c`), compiled on first use with the system C compiler into a per-user cache
and loaded with ctypes (build.py: a cached build is used only from a directory and file that this user
owns and nobody else can write; anything else is refused with a warning and the kernel is rebuilt
in a fresh private directory).
`paged_decode_attention_reference` is the pure-torch version (gather + softmax): the oracle for
tests, and what `paged_decode_attention` falls back to when the kernel cannot be built or loaded.

`rope_write_decode_attention` is one layer's whole decode step in one call: it rotates the rows' q
and k in place (rotary embedding), stores k and v into the paged cache, then runs the same decode
attention. Its rotation and store are bit-identical to `rope.apply_rotary` and `rope_write.write_kv`,
so its output is bit-identical to those followed by `paged_decode_attention`;
`rope_write_decode_attention_reference` is those steps in torch (the fallback, and the oracle).

Shapes:
    q             [B, num_heads, head_dim] float32, head_dim contiguous
    k, v          [num_blocks, block_size, num_kv_heads, head_dim], both float32 or both float16 (the
                  KV dtypes in `KV_COMPUTE_DTYPES`), the inner three dims contiguous; dim 0 may have any
                  stride (layer views of the engine's KV tensor
                  [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim])
    block_tables  [B, max_blocks] int32, innermost dim contiguous; entries past a row's
                  ceil(context_len / block_size) blocks are ignored
    context_lens  [B] int32, tokens of context including the current one (0 gives a zero row)
    out           [B, num_heads, head_dim] float32, head_dim contiguous
GQA: query head h reads kv head h // (num_heads // num_kv_heads).

The fused entry point takes a whole step's rows, positions, slots and out (decode rows first) and
uses the first B = len(block_tables) of each:
    qkv           [n >= B, (num_heads + 2 * num_kv_heads) * head_dim] float32, rows of q, k, v heads,
                  last dim contiguous; q and k of rows [0, B) are rotated in place
    cos, sin      [max_positions, head_dim] float32, contiguous (`RotaryTable.cos` / `.sin`), head_dim even
    positions     [n >= B] int64, each row's position (< max_positions)
    slot_blocks, slot_offsets  [n >= B] int64, where each row's k and v are stored
    out           [n >= B, num_heads, head_dim] float32, head_dim contiguous; rows [0, B) are written
Results do not depend on the thread count.

fp16 K/V are widened to fp32 as they are read (the kernel with F16C, the reference with `.float()`);
every product, sum and the softmax are fp32, so both paths compute attention over exactly the
fp16-rounded values, and the result is fp32.
"""

from __future__ import annotations

import ctypes
import logging
import struct
from pathlib import Path
from typing import NoReturn

import torch

from deepinfer.kernels import build

__all__ = [
    "KV_COMPUTE_DTYPES",
    "native_available",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "rope_write_decode_attention",
    "rope_write_decode_attention_reference",
    "kernel_cache_dir",
    "native_unavailable_reason",
    "native_info",
]

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_attention.c")
_LIB_STEM = "paged_attention"
# AVX2 + FMA for the loops, F16C for reading fp16 K/V (a CPU lacking any of them gets the plain C build).
_SIMD = ("avx2", "fma", "f16c")
# The K/V dtypes these entry points read (queries and outputs are always float32).
KV_COMPUTE_DTYPES = (torch.float32, torch.float16)
_ERR_CONTEXT_LEN = -1
_ERR_BLOCK_ID = -2
_ERR_NOMEM = -3
_ERR_POSITION = -4
_ERR_SLOT = -5

# ---------------------------------------------------------------------------------------------
# Build and load


# The shared machinery lives in build.py; these names stay here (the tests patch and call them).
UnsafeKernelPath = build.UnsafeKernelPath
kernel_cache_dir = build.kernel_cache_dir
_check_private = build.check_private
_find_compiler = build.find_compiler


def _compile_flags(openmp: bool = True, simd: bool = True) -> list[str]:
    return build.compile_flags(openmp, simd, _SIMD)


def _lib_name(compiler: str, flags: list[str]) -> str:
    return build.lib_name(_SOURCE, _LIB_STEM, compiler, flags)


def _build(compiler: str, flags: list[str]) -> Path:
    return _loader.build_one(compiler, flags)


def _compile(compiler: str, flags: list[str], target: Path) -> None:
    build.compile_source(_SOURCE, compiler, flags, target)


_NUM_PARAMS = 16
_pack_params = struct.Struct(f"<{_NUM_PARAMS}q").pack
# The fused entry point's: the same 16, then max_positions.
_NUM_FUSED_PARAMS = _NUM_PARAMS + 1
_pack_fused_params = struct.Struct(f"<{_NUM_FUSED_PARAMS}q").pack


def _load(path: Path) -> tuple[ctypes.CDLL, dict[str, object]]:
    """Load the checked library at `path`; returns (lib, fns): fns maps a K/V dtype to the decode
    attention function and ("rope", K/V dtype) to the fused one. Raises on a refused path or a
    library built for other parameter blocks."""
    lib = build.dlopen_checked(path)
    if lib.pa_num_params() != _NUM_PARAMS or lib.pa_num_fused_params() != _NUM_FUSED_PARAMS:
        raise RuntimeError(f"{path} expects {lib.pa_num_params()}/{lib.pa_num_fused_params()} parameters, "
                           f"this wrapper passes {_NUM_PARAMS}/{_NUM_FUSED_PARAMS}")
    vp = ctypes.c_void_p
    fns: dict[object, object] = {}
    for dtype, name in ((torch.float32, "pa_paged_decode_attention_f32"),
                        (torch.float16, "pa_paged_decode_attention_f16")):
        fn = getattr(lib, name)
        # q, k, v, block_tables, context_lens, out, packed int64 params, scale, num_threads
        fn.argtypes = [vp, vp, vp, vp, vp, vp, ctypes.c_char_p, ctypes.c_float, ctypes.c_int]
        fn.restype = ctypes.c_int
        fns[dtype] = fn
    for dtype, name in ((torch.float32, "pa_rope_write_decode_attention_f32"),
                        (torch.float16, "pa_rope_write_decode_attention_f16")):
        fn = getattr(lib, name)
        # qkv, cos, sin, positions, slot_blocks, slot_offsets, k, v, block_tables, context_lens, out,
        # packed int64 params, scale, num_threads
        fn.argtypes = [vp] * 11 + [ctypes.c_char_p, ctypes.c_float, ctypes.c_int]
        fn.restype = ctypes.c_int
        fns["rope", dtype] = fn
    return lib, fns


def _new_loader() -> build.KernelLoader:
    """A loader that has not tried yet (the module holds one; tests swap in fresh ones)."""
    return build.KernelLoader(_SOURCE, _LIB_STEM, "paged attention kernel", _load, probe_prefix="pa",
                              log=logger, simd=_SIMD)


_loader = _new_loader()


def native_available() -> bool:
    """Build (once per source/flags, cached on disk) and load the native kernel. False, with the
    reason logged once, when there is no C compiler or the build or load fails."""
    return _loader.available()


def native_info() -> dict[str, object] | None:
    """Where the loaded kernel came from and how it was built (None when not loaded); `f16c` says
    whether fp16 K/V are widened with F16C vector loads (else with the scalar conversion)."""
    info = _loader.info()
    if info is not None and _loader.lib is not None:
        info["f16c"] = bool(_loader.lib.pa_has_f16c())
    return info


def native_unavailable_reason() -> str | None:
    """Why `native_available()` returned False (None if it was not tried or succeeded)."""
    return _loader.unavailable_reason()


# ---------------------------------------------------------------------------------------------
# Argument checks


_F32, _F16, _I32 = torch.float32, torch.float16, torch.int32


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_tables: torch.Tensor,
           context_lens: torch.Tensor, out: torch.Tensor | None,
           cpu: bool = True) -> tuple[int, int, int, int, int, int]:
    """Validate everything that does not need to read tensor values; returns
    (B, num_heads, head_dim, num_kv_heads, block_size, max_blocks). One cheap combined test on
    the hot path; `_diagnose` works out the message when it fails. `cpu=False` (the torch
    reference) accepts tensors on any one device."""
    qsh, ksh, bsh = q.shape, k.shape, block_tables.shape
    if len(qsh) == 3 and len(ksh) == 4 and len(bsh) == 2:
        B, H, D = qsh
        bs, kvh = ksh[1], ksh[2]
        ks, vs = k.stride(), v.stride()
        row = kvh * D
        if (q.dtype is _F32 and (k.dtype is _F32 or k.dtype is _F16) and v.dtype is k.dtype
                and block_tables.dtype is _I32
                and context_lens.dtype is _I32 and ksh[3] == D and v.shape == ksh and kvh > 0 and H % kvh == 0
                and q.stride(2) == 1 and ks[3] == 1 and ks[2] == D and ks[1] == row
                and vs[3] == 1 and vs[2] == D and vs[1] == row and bsh[0] == B
                and (block_tables.stride(1) == 1 or bsh[1] <= 1) and context_lens.shape == (B,)
                and (context_lens.stride(0) == 1 or B <= 1)
                and (not cpu or (q.is_cpu and k.is_cpu and v.is_cpu and block_tables.is_cpu
                                 and context_lens.is_cpu and (out is None or out.is_cpu)))
                and (out is None or (out.dtype is _F32 and out.shape == qsh and out.stride(2) == 1))):
            return B, H, D, kvh, bs, bsh[1]
    _diagnose(q, k, v, block_tables, context_lens, out, cpu)
    raise ValueError("invalid arguments to paged_decode_attention")  # not reached


def _diagnose(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_tables: torch.Tensor,
              context_lens: torch.Tensor, out: torch.Tensor | None, cpu: bool = True) -> None:
    """Raise a ValueError that says what is wrong with the arguments."""
    f32 = torch.float32
    if q.dtype != f32:
        raise ValueError(f"q must be float32, got {q.dtype}")
    if k.dtype not in KV_COMPUTE_DTYPES or v.dtype != k.dtype:
        raise ValueError(f"k and v must both be float32 or both float16, got {k.dtype}, {v.dtype}")
    if q.dim() != 3:
        raise ValueError(f"q must be [B, num_heads, head_dim], got shape {tuple(q.shape)}")
    if k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"k and v must be [num_blocks, block_size, num_kv_heads, head_dim], got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    B, H, D = q.shape
    nb, bs, kvh, kd = k.shape
    if v.shape != k.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if kd != D:
        raise ValueError(f"head_dim mismatch: q has {D}, k/v have {kd}")
    if kvh <= 0 or H % kvh:
        raise ValueError(f"num_heads ({H}) must be a positive multiple of num_kv_heads ({kvh})")
    if q.stride(2) != 1:
        raise ValueError("q's last dim must be contiguous")
    ks, vs = k.stride(), v.stride()
    if ks[3] != 1 or ks[2] != D or ks[1] != kvh * D or vs[3] != 1 or vs[2] != D or vs[1] != kvh * D:
        raise ValueError("k and v must have contiguous [block_size, num_kv_heads, head_dim] inner dims, got "
                         f"strides {ks} and {vs}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError(f"block_tables must be a 2-D int32 tensor, got {block_tables.dtype} "
                         f"shape {tuple(block_tables.shape)}")
    if block_tables.shape[0] != B:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows, q has {B}")
    if block_tables.stride(1) != 1 and block_tables.shape[1] > 1:
        raise ValueError("block_tables rows must be contiguous")
    if context_lens.dtype != torch.int32 or context_lens.shape != (B,):
        raise ValueError(f"context_lens must be int32 of shape ({B},), got {context_lens.dtype} "
                         f"shape {tuple(context_lens.shape)}")
    if context_lens.stride(0) != 1 and B > 1:
        raise ValueError("context_lens must be contiguous")
    if cpu and not (q.is_cpu and k.is_cpu and v.is_cpu and block_tables.is_cpu and context_lens.is_cpu
                    and (out is None or out.is_cpu)):
        raise ValueError("paged_decode_attention runs on CPU tensors only")
    if out is not None:
        if out.dtype != f32 or out.shape != q.shape or out.stride(2) != 1:
            raise ValueError(f"out must be a float32 tensor of shape {tuple(q.shape)} with a contiguous "
                             f"last dim, got {out.dtype} shape {tuple(out.shape)} strides {out.stride()}")


def _check_values(block_tables: torch.Tensor, context_lens: torch.Tensor, num_blocks: int,
                  block_size: int) -> None:
    """Value checks (context lengths, used block ids); raises ValueError naming the first bad row."""
    max_blocks = block_tables.shape[1]
    cap = max_blocks * block_size
    lens = context_lens.long()
    bad = (lens < 0) | (lens > cap)
    if bool(bad.any()):
        b = int(bad.nonzero()[0, 0])
        raise ValueError(f"context_lens[{b}] = {int(lens[b])} is outside [0, max_blocks * block_size = {cap}]")
    used = (torch.arange(max_blocks, device=lens.device).unsqueeze(0)
            < ((lens + block_size - 1) // block_size).unsqueeze(1))
    bad_ids = used & ((block_tables < 0) | (block_tables >= num_blocks))
    if bool(bad_ids.any()):
        b = int(bad_ids.any(dim=1).nonzero()[0, 0])
        raise ValueError(f"block_tables[{b}] uses block ids outside [0, {num_blocks}): "
                         f"{block_tables[b][used[b]].tolist()}")


# ---------------------------------------------------------------------------------------------
# Entry points


def paged_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention (one query token per row) reading K/V through the block tables.

    Uses the native kernel (fp32 or fp16 K/V, see the module docstring); falls back to
    `paged_decode_attention_reference` when it cannot be built. Raises ValueError on bad arguments
    (including context lengths beyond the block table and out-of-range block ids)."""
    fns = _loader.fns
    if not fns and not _loader.available():
        return paged_decode_attention_reference(q, k, v, block_tables, context_lens, scale, out)
    B, H, D, kvh, bs, max_blocks = _check(q, k, v, block_tables, context_lens, out)
    fn = fns[k.dtype]
    if out is None:
        out = torch.empty((B, H, D), dtype=torch.float32)
    if B == 0:
        return out
    ks, vs = k.stride(), v.stride()
    params = _pack_params(B, H, kvh, D, bs, k.shape[0], max_blocks, q.stride(0), q.stride(1),
                          out.stride(0), out.stride(1), block_tables.stride(0), ks[0], ks[1], vs[0], vs[1])
    rc = fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), block_tables.data_ptr(), context_lens.data_ptr(),
            out.data_ptr(), params, scale, torch.get_num_threads())
    if rc != 0:
        if rc in (_ERR_CONTEXT_LEN, _ERR_BLOCK_ID):
            _check_values(block_tables, context_lens, k.shape[0], bs)
        if rc == _ERR_NOMEM:
            raise MemoryError("paged_decode_attention: out of memory for scratch buffers")
        raise ValueError(f"paged_decode_attention: invalid block tables or context lengths (code {rc})")
    return out


def paged_decode_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-torch decode attention: gathers each row's blocks, masks past its context length,
    softmax, weighted sum of V. Same contract as `paged_decode_attention`, but on any one device."""
    B, H, D, kvh, bs, max_blocks = _check(q, k, v, block_tables, context_lens, out, cpu=False)
    if out is None:
        out = torch.empty((B, H, D), dtype=torch.float32, device=q.device)
    if B == 0:
        return out
    num_blocks = k.shape[0]
    _check_values(block_tables, context_lens, num_blocks, bs)
    lens = context_lens.long()
    max_len = int(lens.max())
    if max_len == 0:
        out.zero_()
        return out
    nb = (max_len + bs - 1) // bs
    ids = block_tables[:, :nb].long()
    used = torch.arange(nb, device=lens.device).unsqueeze(0) * bs < lens.unsqueeze(1)  # [B, nb]
    ids = torch.where(used, ids, torch.zeros_like(ids))  # ignored entries may hold anything
    # [B, T, kvh, D]; fp16 K/V are widened here and everything after is fp32 (like the kernel)
    kk = k[ids].reshape(B, nb * bs, kvh, D)[:, :max_len].float()
    vv = v[ids].reshape(B, nb * bs, kvh, D)[:, :max_len].float()
    g = H // kvh
    qg = q.reshape(B, kvh, g, D)
    scores = torch.einsum("bkgd,btkd->bkgt", qg, kk) * scale
    valid = torch.arange(max_len, device=lens.device).unsqueeze(0) < lens.unsqueeze(1)  # [B, T]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # rows with context 0
    out.copy_(torch.einsum("bkgt,btkd->bkgd", probs, vv).reshape(B, H, D))
    return out


# ---------------------------------------------------------------------------------------------
# Rotary + K/V write + decode attention in one call (see the module docstring)


_I64 = torch.int64


def _check_fused(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, out: torch.Tensor | None,
                 cpu: bool = True) -> tuple[int, int, int, int, int, int]:
    """`_check` for `rope_write_decode_attention`: one combined test, `_diagnose_fused` for the
    message; returns (B, num_heads, head_dim, num_kv_heads, block_size, max_blocks)."""
    ksh, bsh, rsh, csh = k.shape, block_tables.shape, qkv.shape, cos.shape
    if len(ksh) == 4 and len(bsh) == 2 and len(rsh) == 2 and len(csh) == 2:
        B, D, kvh, bs = bsh[0], ksh[3], ksh[2], ksh[1]
        width = rsh[1]
        H = width // D - 2 * kvh if D > 0 else 0
        ks, vs, row = k.stride(), v.stride(), kvh * D
        if (qkv.dtype is _F32 and cos.dtype is _F32 and sin.dtype is _F32 and (k.dtype is _F32 or k.dtype is _F16)
                and v.dtype is k.dtype and block_tables.dtype is _I32 and context_lens.dtype is _I32
                and positions.dtype is _I64 and slot_blocks.dtype is _I64 and slot_offsets.dtype is _I64
                and D % 2 == 0 and kvh > 0 and H > 0 and H % kvh == 0 and width == (H + 2 * kvh) * D
                and rsh[0] >= B and qkv.stride(1) == 1
                and sin.shape == csh and csh[1] == D and cos.is_contiguous() and sin.is_contiguous()
                and v.shape == ksh and ks[3] == 1 and ks[2] == D and ks[1] == row
                and vs[3] == 1 and vs[2] == D and vs[1] == row
                and (block_tables.stride(1) == 1 or bsh[1] <= 1) and context_lens.shape == (B,)
                and (context_lens.stride(0) == 1 or B <= 1)
                and positions.dim() == 1 and slot_blocks.dim() == 1 and slot_offsets.dim() == 1
                and positions.shape[0] >= B and slot_blocks.shape[0] >= B and slot_offsets.shape[0] >= B
                and ((positions.stride(0) == 1 and slot_blocks.stride(0) == 1 and slot_offsets.stride(0) == 1)
                     or B <= 1)
                and (out is None or (out.dtype is _F32 and out.dim() == 3 and out.shape[0] >= B
                                     and out.shape[1] == H and out.shape[2] == D and out.stride(2) == 1))
                and (not cpu or (qkv.is_cpu and cos.is_cpu and sin.is_cpu and positions.is_cpu
                                 and slot_blocks.is_cpu and slot_offsets.is_cpu and k.is_cpu and v.is_cpu
                                 and block_tables.is_cpu and context_lens.is_cpu
                                 and (out is None or out.is_cpu)))):
            return B, H, D, kvh, bs, bsh[1]
    _diagnose_fused(qkv, cos, sin, positions, slot_blocks, slot_offsets, k, v, block_tables, context_lens, out, cpu)
    raise ValueError("invalid arguments to rope_write_decode_attention")  # not reached


def _diagnose_fused(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                    slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor, out: torch.Tensor | None,
                    cpu: bool) -> None:
    """Raise a ValueError that says what is wrong with the arguments of the fused entry point."""
    name = "rope_write_decode_attention"
    if qkv.dtype != _F32 or qkv.dim() != 2 or qkv.stride(1) != 1:
        raise ValueError(f"{name}: qkv must be a 2-D float32 tensor with a contiguous last dim, got {qkv.dtype} "
                         f"shape {tuple(qkv.shape)} strides {qkv.stride()}")
    if k.dtype not in KV_COMPUTE_DTYPES or v.dtype != k.dtype:
        raise ValueError(f"{name}: k and v caches must both be float32 or both float16, got {k.dtype}, {v.dtype}")
    if k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"{name}: k and v caches must be [num_blocks, block_size, num_kv_heads, head_dim] of one "
                         f"shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    nb, bs, kvh, D = k.shape
    ks, vs = k.stride(), v.stride()
    if ks[3] != 1 or ks[2] != D or ks[1] != kvh * D or vs[3] != 1 or vs[2] != D or vs[1] != kvh * D:
        raise ValueError(f"{name}: k and v caches must have contiguous [block_size, num_kv_heads, head_dim] inner "
                         f"dims, got strides {ks} and {vs}")
    if kvh <= 0 or D <= 0 or D % 2:
        raise ValueError(f"{name}: need num_kv_heads > 0 and an even head_dim, got {kvh} and {D}")
    width = qkv.shape[1]
    H = width // D - 2 * kvh
    if width % D or H <= 0 or H % kvh:
        raise ValueError(f"{name}: qkv rows of {width} values are not (num_heads + 2 * {kvh}) * {D} with num_heads "
                         f"a positive multiple of num_kv_heads {kvh}")
    if cos.dtype != _F32 or sin.dtype != _F32 or cos.dim() != 2 or sin.shape != cos.shape or cos.shape[1] != D:
        raise ValueError(f"{name}: cos and sin must be float32 [max_positions, {D}], got {cos.dtype} "
                         f"{tuple(cos.shape)} and {sin.dtype} {tuple(sin.shape)}")
    if not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"{name}: cos and sin must be contiguous")
    if block_tables.dtype != _I32 or block_tables.dim() != 2:
        raise ValueError(f"{name}: block_tables must be a 2-D int32 tensor, got {block_tables.dtype} "
                         f"shape {tuple(block_tables.shape)}")
    B = block_tables.shape[0]
    if block_tables.stride(1) != 1 and block_tables.shape[1] > 1:
        raise ValueError(f"{name}: block_tables rows must be contiguous")
    if context_lens.dtype != _I32 or context_lens.shape != (B,) or (context_lens.stride(0) != 1 and B > 1):
        raise ValueError(f"{name}: context_lens must be contiguous int32 of shape ({B},), got {context_lens.dtype} "
                         f"shape {tuple(context_lens.shape)}")
    if qkv.shape[0] < B:
        raise ValueError(f"{name}: qkv has {qkv.shape[0]} rows, block_tables {B}")
    for label, t in (("positions", positions), ("slot_blocks", slot_blocks), ("slot_offsets", slot_offsets)):
        if t.dtype != _I64 or t.dim() != 1 or t.shape[0] < B or (t.stride(0) != 1 and B > 1):
            raise ValueError(f"{name}: {label} must be a contiguous 1-D int64 tensor of at least {B} entries, got "
                             f"{t.dtype} shape {tuple(t.shape)}")
    if out is not None and (out.dtype != _F32 or out.dim() != 3 or out.shape[0] < B or out.shape[1:] != (H, D)
                            or out.stride(2) != 1):
        raise ValueError(f"{name}: out must be float32 [>= {B}, {H}, {D}] with a contiguous last dim, got "
                         f"{out.dtype} shape {tuple(out.shape)} strides {out.stride()}")
    tensors = (qkv, cos, sin, positions, slot_blocks, slot_offsets, k, v, block_tables, context_lens)
    if cpu and not all(t.is_cpu for t in (*tensors, *(() if out is None else (out,)))):
        raise ValueError(f"{name}: the native kernel takes CPU tensors only")


def _check_fused_values(positions: torch.Tensor, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor,
                        max_positions: int, num_blocks: int, block_size: int) -> None:
    """Raise a ValueError naming the first row whose position or slot is out of range ([B] each)."""
    bad = (positions < 0) | (positions >= max_positions)
    if bool(bad.any()):
        b = int(bad.nonzero()[0, 0])
        raise ValueError(f"positions[{b}] = {int(positions[b])} is outside the rotary table [0, {max_positions})")
    bad = (slot_blocks < 0) | (slot_blocks >= num_blocks) | (slot_offsets < 0) | (slot_offsets >= block_size)
    if bool(bad.any()):
        b = int(bad.nonzero()[0, 0])
        raise ValueError(f"slot ({int(slot_blocks[b])}, {int(slot_offsets[b])}) of row {b} is outside "
                         f"[0, {num_blocks}) x [0, {block_size})")


def rope_write_decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                                slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, k: torch.Tensor,
                                v: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                                scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """For the first B = len(block_tables) rows of a step: rotate q and k in place (rotary), store k
    and v into the cache views `k`, `v`, then decode attention; one native call (shapes in the
    module docstring). Every row is stored before any attends, so rows of one sequence see each
    other's K/V. Returns `out` (allocated [B, num_heads, head_dim] when None).

    Falls back to `rope_write_decode_attention_reference` when the kernel cannot be built or qkv is
    not on the CPU. Raises ValueError on bad arguments (out-of-range positions, slots, context
    lengths or block ids included), before anything is written."""
    fns = _loader.fns
    if (not fns and not _loader.available()) or not qkv.is_cpu:
        return rope_write_decode_attention_reference(qkv, cos, sin, positions, slot_blocks, slot_offsets, k, v,
                                                     block_tables, context_lens, scale, out)
    if out is None:
        B, H, D = _check_fused(qkv, cos, sin, positions, slot_blocks, slot_offsets, k, v, block_tables,
                               context_lens, None)[:3]
        out = torch.empty((B, H, D), dtype=torch.float32)
    params = fused_decode_params(qkv, cos, sin, positions, slot_blocks, slot_offsets, k, v, block_tables,
                                 context_lens, out)
    if params is None:
        return out
    rc = fns["rope", k.dtype](qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(),
                              slot_blocks.data_ptr(), slot_offsets.data_ptr(), k.data_ptr(), v.data_ptr(),
                              block_tables.data_ptr(), context_lens.data_ptr(), out.data_ptr(), params, scale,
                              torch.get_num_threads())
    if rc != 0:
        raise_fused_decode_error(rc, "rope_write_decode_attention", positions, slot_blocks, slot_offsets, cos, k,
                                 block_tables, context_lens)
    return out


def fused_decode_entry_point(kv_dtype: torch.dtype) -> int:
    """The address of the fused entry point's C function for a cache of `kv_dtype` (a `KV_COMPUTE_DTYPES`
    member), for native code that calls it directly (`decode_layers.py`); 0 when the kernel is not loaded."""
    return _loader.entry_point(("rope", kv_dtype))


def fused_decode_params(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                        slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: torch.Tensor, out: torch.Tensor) -> bytes | None:
    """The fused entry point's parameter block for these CPU arguments (`out` given), after the checks that
    do not read values (ValueError naming what is wrong); None when there are no rows. Every layer's views
    of one pool share it."""
    B, H, D, kvh, bs, max_blocks = _check_fused(qkv, cos, sin, positions, slot_blocks, slot_offsets, k, v,
                                                block_tables, context_lens, out)
    if B == 0:
        return None
    ks, vs = k.stride(), v.stride()
    return _pack_fused_params(B, H, kvh, D, bs, k.shape[0], max_blocks, qkv.stride(0), D, out.stride(0),
                              out.stride(1), block_tables.stride(0), ks[0], ks[1], vs[0], vs[1], cos.shape[0])


def raise_fused_decode_error(rc: int, what: str, positions: torch.Tensor, slot_blocks: torch.Tensor,
                             slot_offsets: torch.Tensor, cos: torch.Tensor, k: torch.Tensor,
                             block_tables: torch.Tensor, context_lens: torch.Tensor) -> NoReturn:
    """Raise what a non-zero return `rc` of the fused entry point means: a ValueError naming the first bad
    row's context length, block id, position or slot where the values show one, MemoryError for scratch."""
    B, (num_blocks, bs) = block_tables.shape[0], k.shape[:2]
    if rc in (_ERR_CONTEXT_LEN, _ERR_BLOCK_ID):
        _check_values(block_tables, context_lens, num_blocks, bs)
    if rc in (_ERR_POSITION, _ERR_SLOT):
        _check_fused_values(positions[:B], slot_blocks[:B], slot_offsets[:B], cos.shape[0], num_blocks, bs)
    if rc == _ERR_NOMEM:
        raise MemoryError(f"{what}: out of memory for scratch buffers")
    raise ValueError(f"{what}: invalid arguments (code {rc})")


def rope_write_decode_attention_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                          positions: torch.Tensor, slot_blocks: torch.Tensor,
                                          slot_offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                          block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                          out: torch.Tensor | None = None) -> torch.Tensor:
    """`rope_write_decode_attention` in torch, on any one device: the ops of `rope.apply_rotary`,
    those of `rope_write.write_kv`, then `paged_decode_attention_reference`. Same contract."""
    B, H, D, kvh, bs, max_blocks = _check_fused(qkv, cos, sin, positions, slot_blocks, slot_offsets, k, v,
                                                block_tables, context_lens, out, cpu=False)
    if out is None:
        out = torch.empty((B, H, D), dtype=torch.float32, device=qkv.device)
    if B == 0:
        return out
    pos, blocks, offsets = positions[:B], slot_blocks[:B], slot_offsets[:B]
    _check_values(block_tables, context_lens, k.shape[0], bs)
    _check_fused_values(pos, blocks, offsets, cos.shape[0], k.shape[0], bs)
    rows = qkv[:B]
    qk = rows[:, : (H + kvh) * D].view(B, H + kvh, D)
    c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    half = D // 2
    qk.copy_(qk * c + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * s)
    index = (blocks, offsets)
    k.index_put_(index, qk[:, H:].to(k.dtype))
    v.index_put_(index, rows[:, (H + kvh) * D :].view(B, kvh, D).to(v.dtype))
    paged_decode_attention_reference(qk[:, :H], k, v, block_tables, context_lens, scale, out[:B])
    return out
