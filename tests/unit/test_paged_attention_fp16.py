"""Paged decode attention over an fp16 KV cache: the kernel's fp16 entry point against the torch
path on the same halves and against fp32 attention over the fp16-rounded K/V, in every build the
loader can fall back to (F16C, AVX2 without F16C, plain C)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.kernels import paged_attention as pa
from deepinfer.kernels import paged_decode_attention, paged_decode_attention_reference
from tests.unit.test_paged_attention_kernel import SHAPES, _make, needs_native

# Both paths widen the same halves and compute in fp32; they differ only in summation order.
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _half(q, k, v, bt, cl):
    return q, k.half(), v.half(), bt, cl


def _assert_fp16_matches(q, k16, v16, bt, cl, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = paged_decode_attention(q, k16, v16, bt, cl, scale)
    assert out.dtype == torch.float32 and out.shape == q.shape
    torch.testing.assert_close(out, paged_decode_attention_reference(q, k16, v16, bt, cl, scale), **TOL)
    # The fp32 kernel on the widened values: the fp16 path adds no error beyond the rounding itself.
    torch.testing.assert_close(out, paged_decode_attention(q, k16.float(), v16.float(), bt, cl, scale), **TOL)
    return out


@needs_native
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", SHAPES)
def test_fp16_kernel_matches_torch_and_fp32(heads, kv_heads, head_dim, block_size):
    lens = [1, 2, block_size, block_size + 1, 3 * block_size - 1, 300, 17, 64]
    _assert_fp16_matches(*_half(*_make(batch=len(lens), heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                       block_size=block_size, context_lens=lens, seed=head_dim)))


@needs_native
@pytest.mark.parametrize("threads", [1, 3])
def test_fp16_long_contexts_split_and_merged(threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for head_dim, block_size in ((64, 16), (36, 7)):
            _assert_fp16_matches(*_half(*_make(batch=2, heads=8, kv_heads=2, head_dim=head_dim,
                                               block_size=block_size, context_lens=[1000, 513])))
    finally:
        torch.set_num_threads(old)


@needs_native
def test_fp16_zero_context_rows_and_out():
    q, k, v, bt, cl = _half(*_make(batch=3, heads=4, kv_heads=2, head_dim=64, block_size=16,
                                   context_lens=[5, 1, 40]))
    cl[1] = 0
    out = torch.full_like(q, float("nan"))
    res = paged_decode_attention(q, k, v, bt, cl, 0.125, out=out)
    assert res.data_ptr() == out.data_ptr() and (out[1] == 0).all()
    torch.testing.assert_close(out, paged_decode_attention_reference(q, k, v, bt, cl, 0.125), **TOL)


def _special_halves(n: int) -> torch.Tensor:
    """n halves cycling through subnormals, signed zeros, the extremes and ordinary values."""
    bits = np.array([0x0001, 0x03FF, 0x8001, 0x0000, 0x8000, 0x0400, 0x7BFF, 0xFBFF, 0x3C00, 0xB555], np.uint16)
    return torch.from_numpy(np.resize(bits, n).view(np.float16))


@needs_native
@pytest.mark.parametrize("features", [(), ("avx2", "fma")], ids=["plain-c", "avx2-no-f16c"])
def test_fp16_builds_without_f16c(monkeypatch, features):
    """Without F16C the fp16 rows are read by the generic loops with the scalar conversion: same
    results, including subnormal, zero and extreme halves."""
    flags = pa.build.compile_flags(openmp=True, simd=bool(features), features=features or ("avx2",))
    lib, fns = pa._load(pa._build(pa._find_compiler(), flags))
    assert not lib.pa_has_f16c()
    monkeypatch.setattr(pa._loader, "fns", fns)
    for heads, kv_heads, head_dim, block_size in (SHAPES[0], SHAPES[5]):
        q, k, v, bt, cl = _half(*_make(batch=4, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                       block_size=block_size, context_lens=[1, 40, 300, 77]))
        _assert_fp16_matches(q, k, v, bt, cl)
        k = _special_halves(k.numel()).view(k.shape)
        # Scores of ~65504 * |q| would overflow nothing in fp32, but keep them modest for the tolerance.
        _assert_fp16_matches(q * 1e-4, k, v, bt, cl)


@needs_native
def test_special_halves_with_f16c():
    q, k, v, bt, cl = _half(*_make(batch=2, heads=8, kv_heads=2, head_dim=64, block_size=16,
                                   context_lens=[33, 250]))
    v = _special_halves(v.numel()).view(v.shape)
    _assert_fp16_matches(q, k, v, bt, cl)


def test_mixed_or_unsupported_kv_dtypes_are_refused():
    q, k, v, bt, cl = _make(batch=2, heads=4, kv_heads=2, head_dim=32, block_size=4, context_lens=[3, 7])
    for fn in (paged_decode_attention, paged_decode_attention_reference):
        with pytest.raises(ValueError, match="both be float32 or both float16"):
            fn(q, k.half(), v, bt, cl, 0.1)
        with pytest.raises(ValueError, match="both be float32 or both float16"):
            fn(q, k.bfloat16(), v.bfloat16(), bt, cl, 0.1)
        with pytest.raises(ValueError, match="q must be float32"):
            fn(q.half(), k.half(), v.half(), bt, cl, 0.1)
