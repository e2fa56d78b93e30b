"""Prefill rows' rotary embedding and KV store in one native call, with q, k, v laid out for SDPA.

`rope_write_prefill(qkv, cos, sin, positions, slot_blocks, slot_offsets, k_cache, v_cache)` does for a step's
prefill rows what `rope.apply_rotary`, `write_kv` and `as_cached` (below) do in torch, in one
pass of `paged_attention.c` (`pa_rope_write_prefill_*`): it rotates each row's q and k, stores k and v at
the rows' slots in the cache views, and returns q [heads, T, head_dim], k and v [kv_heads, T, head_dim],
contiguous: head-major, the layout SDPA's fused CPU kernel reads fastest (strided inputs cost it ~8% on a
1,024-token chunk), with k and v as the cache holds them. The rotation rounds every product and sum as
torch's separate ops do, so the values are bit for bit those of the torch steps
(`rope_write_prefill_reference`, the fallback where the kernel cannot be built or the tensors are not on
the CPU). qkv itself is not changed.

Shapes: qkv [T, (heads + 2 * kv_heads) * head_dim] float32, last dim contiguous; cos, sin [max_positions,
head_dim] float32 contiguous; positions, slot_blocks, slot_offsets [T] int64 contiguous; k_cache, v_cache
[num_blocks, block_size, kv_heads, head_dim] float32 or float16, inner three dims contiguous (layer views of
the engine's pool). Bad shapes, dtypes, positions or slots raise ValueError before anything is written.
"""

from __future__ import annotations

import ctypes
import struct

import torch

from deepinfer.kernels import paged_attention as pa

__all__ = ["as_cached", "rope_write_prefill", "rope_write_prefill_reference", "write_kv"]

_NUM_PARAMS = 12
_pack_params = struct.Struct(f"<{_NUM_PARAMS}q").pack
_fns: dict[torch.dtype, object] = {}


def _native(dtype: torch.dtype) -> object | None:
    """The kernel's entry point for a cache of `dtype`, or None when the library cannot be loaded."""
    fn = _fns.get(dtype)
    if fn is not None or not pa.native_available():
        return fn
    lib = pa._loader.lib
    if lib is None or lib.pa_num_prefill_params() != _NUM_PARAMS:
        return None
    for dt, name in ((torch.float32, "pa_rope_write_prefill_f32"), (torch.float16, "pa_rope_write_prefill_f16")):
        f = getattr(lib, name)
        # qkv, cos, sin, positions, slot_blocks, slot_offsets, k, v, q_out, k_out, v_out, params, num_threads
        f.argtypes = [ctypes.c_void_p] * 11 + [ctypes.c_char_p, ctypes.c_int]
        f.restype = ctypes.c_int
        _fns[dt] = f
    return _fns[dtype]


def _check(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
           slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, ...]:
    """(T, heads, kv_heads, head_dim), or ValueError naming what is wrong."""
    if k.dim() != 4 or v.shape != k.shape or k.dtype not in (torch.float32, torch.float16) or v.dtype != k.dtype:
        raise ValueError(f"k, v caches must be [blocks, block_size, kv_heads, head_dim] float32/float16, got "
                         f"{k.dtype} {tuple(k.shape)} and {v.dtype} {tuple(v.shape)}")
    kvh, d = k.shape[2], k.shape[3]
    for name, c in (("k", k), ("v", v)):
        if c.stride(3) != 1 or c.stride(2) != d or c.stride(1) != kvh * d:
            raise ValueError(f"{name} cache's inner three dims must be contiguous")
    if qkv.dtype != torch.float32 or qkv.dim() != 2 or qkv.stride(1) != 1 or d % 2 or qkv.shape[1] % d:
        raise ValueError(f"qkv must be float32 [T, (heads + 2 * kv_heads) * {d}] with rows contiguous, got "
                         f"{qkv.dtype} {tuple(qkv.shape)}")
    t, heads = qkv.shape[0], qkv.shape[1] // d - 2 * kvh
    if heads <= 0 or heads % kvh:
        raise ValueError(f"qkv's {qkv.shape[1] // d} heads do not split into q heads and {kvh} kv heads each of k, v")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != d or cos.dtype != torch.float32 \
            or sin.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"cos, sin must be contiguous float32 [max_positions, {d}]")
    for name, x in (("positions", positions), ("slot_blocks", slot_blocks), ("slot_offsets", slot_offsets)):
        if x.dtype != torch.int64 or x.shape != (t,) or (t > 1 and x.stride(0) != 1):
            raise ValueError(f"{name} must be contiguous int64 [{t}], got {x.dtype} {tuple(x.shape)}")
    return t, heads, kvh, d


def rope_write_prefill(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                       slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotate, store and lay out the prefill rows (see the module docstring); returns (q, k, v) head-major."""
    t, heads, kvh, d = _check(qkv, cos, sin, positions, slot_blocks, slot_offsets, k_cache, v_cache)
    tensors = (qkv, cos, sin, positions, slot_blocks, slot_offsets, k_cache, v_cache)
    fn = _native(k_cache.dtype) if all(x.is_cpu for x in tensors) else None
    if fn is None:
        return rope_write_prefill_reference(qkv, cos, sin, positions, slot_blocks, slot_offsets, k_cache, v_cache)
    q = torch.empty((heads, t, d), dtype=torch.float32)
    k = torch.empty((kvh, t, d), dtype=torch.float32)
    v = torch.empty((kvh, t, d), dtype=torch.float32)
    if t == 0:
        return q, k, v
    ks, vs = k_cache.stride(), v_cache.stride()
    params = _pack_params(t, heads, kvh, d, k_cache.shape[1], k_cache.shape[0], qkv.stride(0), ks[0], ks[1], vs[0],
                          vs[1], cos.shape[0])
    rc = fn(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), slot_blocks.data_ptr(),  # type: ignore[operator]
            slot_offsets.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
            params, torch.get_num_threads())
    if rc == pa._ERR_NOMEM:
        raise MemoryError("rope_write_prefill: out of memory for a row buffer")
    if rc != 0:
        pa._check_fused_values(positions, slot_blocks, slot_offsets, cos.shape[0], *k_cache.shape[:2])
        raise ValueError(f"rope_write_prefill: invalid arguments (code {rc})")
    return q, k, v


def rope_write_prefill_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                                 slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, k_cache: torch.Tensor,
                                 v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rope_write_prefill` in torch on any one device: the ops of `rope.apply_rotary`, `write_kv` and
    `as_cached`. Same contract."""
    t, heads, kvh, d = _check(qkv, cos, sin, positions, slot_blocks, slot_offsets, k_cache, v_cache)
    pa._check_fused_values(positions, slot_blocks, slot_offsets, cos.shape[0], *k_cache.shape[:2])
    rows = qkv.unflatten(1, (heads + 2 * kvh, d))
    qk = rows[:, : heads + kvh]
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    half = d // 2
    qk = qk * c + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * s
    k, v = qk[:, heads:], rows[:, heads + kvh :]
    write_kv(k_cache, v_cache, k, v, slot_blocks, slot_offsets)
    q = qk[:, :heads].transpose(0, 1).contiguous()
    return (q, as_cached(k, k_cache.dtype).transpose(0, 1).contiguous(),
            as_cached(v, v_cache.dtype).transpose(0, 1).contiguous())


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_blocks: torch.Tensor, slot_offsets: torch.Tensor) -> None:
    """Store new K/V ([T, kv_heads, head_dim]) at the rows' slots of the layer's cache views ([num_blocks,
    block_size, kv_heads, head_dim], strided in dim 0), converted to the cache's dtype (round to nearest
    for an fp16 cache)."""
    index = (slot_blocks, slot_offsets)
    k_cache.index_put_(index, k.to(k_cache.dtype))
    v_cache.index_put_(index, v.to(v_cache.dtype))


def as_cached(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """`x` as attention reads it back from a cache of `cache_dtype`: rounded to that dtype and widened
    to x's again (x itself when the dtypes agree)."""
    return x if x.dtype == cache_dtype else x.to(cache_dtype).to(x.dtype)
