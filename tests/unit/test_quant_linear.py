"""The GGUF-block linear kernel (quant_linear.c) against dequantise-then-matmul in float64.

Tolerance: |y - ref| <= RTOL * (|x| @ |W|^T) elementwise, RTOL = 1e-5. The kernel sums K fp32 products
in another order than any reference (8-lane partial sums, then a tree), so its error is a few fp32
ulps of the sum of absolute terms (~sqrt(K) * 6e-8 typically, at most ~K/8 * 6e-8 = 1.2e-5 for K=1536
in the worst case); scaling by |x| @ |W|^T keeps the check meaningful where terms cancel.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from deepinfer.config.gguf_metadata import open_gguf
from deepinfer.config.paths import default_cache_dir
from deepinfer.kernels import quant_linear as ql
from deepinfer.kernels.quant_linear import PackedWeight, quant_linear, quant_linear_reference
from deepinfer.loading.fetch import SMOLLM2_FILE
from deepinfer.loading.gguf import dequantize, tensor_to_numpy

RTOL = 1e-5
QTYPES = {"Q8_0": T.Q8_0, "Q4_0": T.Q4_0, "Q4_1": T.Q4_1}
ROWS = (1, 2, 3, 7, 8, 9, 31, 64, 127, 300)
# Every N in {1, 3, 17, 576, 1536} and every K in {32, 64, 576, 1536}, without every product of them;
# (67, 1536) and (1023, 64) are split across threads (over QL_MIN_PARALLEL_WORK = 64K multiply-adds at
# one row) and end in a part group of the 2 or 4 weight rows the decode path takes together.
SHAPES = [(1, 32), (1, 1536), (3, 64), (17, 576), (17, 1536), (576, 64), (576, 1536), (1536, 32), (1536, 576),
          (67, 1536), (1023, 64)]

needs_native = pytest.mark.skipif(not ql.native_available(),
                                  reason=f"kernel could not be built: {ql.native_unavailable_reason()}")


def _random_raw(fmt: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random blocks: random int8 / nibbles; f16 scales (and Q4_1 minimums) normal, with some
    negative, some exactly zero, some subnormal; never inf or NaN."""
    g = np.random.default_rng(seed)
    bsz = ql.FORMATS[fmt][1]
    raw = g.integers(0, 256, size=n * k // 32 * bsz, dtype=np.uint8)
    blocks = raw.reshape(-1, bsz)
    for lo in (0, 2) if fmt == "Q4_1" else (0,):
        s = g.normal(scale=0.05, size=len(blocks))
        s[g.random(len(blocks)) < 0.1] = 0.0
        s[g.random(len(blocks)) < 0.05] = 3e-6  # an f16 subnormal
        blocks[:, lo:lo + 2] = s.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw


def _packed(fmt: str, n: int, k: int, seed: int = 0) -> tuple[PackedWeight, torch.Tensor]:
    raw = _random_raw(fmt, n, k, seed)
    return PackedWeight.from_raw(raw, QTYPES[fmt], (n, k)), torch.from_numpy(dequantize(raw, QTYPES[fmt], (n, k)))


def _assert_product(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    xd, wd = x.double(), w.double()
    ref = xd @ wd.T
    bound = RTOL * (xd.abs() @ wd.abs().T) + 1e-30
    err = (y.double() - ref).abs()
    assert y.dtype == torch.float32 and y.shape == ref.shape
    assert bool((err <= bound).all()), f"max error/bound {float((err / bound).max()):.3g}"


@pytest.mark.parametrize("fmt", list(QTYPES))
@pytest.mark.parametrize("n,k", [(1, 32), (17, 576), (1536, 64)])
def test_dequantize_equals_gguf_loader_bit_for_bit(fmt, n, k):
    raw = _random_raw(fmt, n, k, seed=1)
    packed = PackedWeight.from_raw(raw, QTYPES[fmt], (n, k))
    ours = packed.dequantize()
    theirs = torch.from_numpy(dequantize(raw, QTYPES[fmt], (n, k)))
    assert ours.dtype == torch.float32 and torch.equal(ours.view(torch.int32), theirs.view(torch.int32))


@needs_native
@pytest.mark.parametrize("fmt", list(QTYPES))
def test_kernel_dequantizer_equals_gguf_loader_bit_for_bit(fmt):
    """ql_dequantize_f32 (what the many-rows path feeds to torch's GEMM), rows 3..19 of 20."""
    raw = _random_raw(fmt, 20, 576, seed=10)
    packed = PackedWeight.from_raw(raw, QTYPES[fmt], (20, 576))
    out = torch.empty(17, 576)
    code, bsz = ql.FORMATS[fmt]
    assert ql._fns["dequantize"](packed.blocks.data_ptr() + 3 * 18 * bsz, out.data_ptr(), 17, 576, code, 2) == 0
    theirs = torch.from_numpy(dequantize(raw, QTYPES[fmt], (20, 576)))[3:]
    assert torch.equal(out.view(torch.int32), theirs.view(torch.int32))


@pytest.mark.parametrize("fmt", list(QTYPES))
def test_dequantize_random_bytes_including_inf_and_nan_scales(fmt):
    raw = np.random.default_rng(2).integers(0, 256, size=64 * 2 * ql.FORMATS[fmt][1], dtype=np.uint8)
    ours = PackedWeight.from_raw(raw.tobytes(), fmt, (64, 64)).dequantize()
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 and inf - inf: NaN on both sides
        theirs = torch.from_numpy(dequantize(raw, QTYPES[fmt], (64, 64)))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)


@needs_native
@pytest.mark.parametrize("fmt", list(QTYPES))
@pytest.mark.parametrize("n,k", SHAPES)
def test_kernel_matches_float64_reference(fmt, n, k):
    packed, w = _packed(fmt, n, k, seed=n * 7 + k)
    x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(k))
    for m in ROWS:
        for impl, threads in (("auto", 2), ("native", 1), ("native", 2), ("portable", 2), ("gemm", 2)):
            _assert_product(quant_linear(x[:m], packed, threads, impl=impl), x[:m], w)


@needs_native
@pytest.mark.parametrize("fmt", list(QTYPES))
def test_decode_result_does_not_depend_on_thread_count(fmt):
    """Each output is summed in the same order whatever the thread count (threads split N at whole
    groups of weight rows, or tiles), so kernel results are bit for bit reproducible across num_threads."""
    packed, _ = _packed(fmt, 1023, 576, seed=11)
    x = torch.randn(20, 576, generator=torch.Generator().manual_seed(12))
    for m in (*range(1, 9), 20):  # the decode paths, and the tile path below GEMM_MIN_ROWS
        y1 = quant_linear(x[:m], packed, 1, impl="native")
        for threads in (2, 3):
            assert torch.equal(quant_linear(x[:m], packed, threads, impl="native"), y1), (m, threads)


def _group_max_m() -> int:
    return int(ql._loader.lib.ql_group_max_m()) if ql.native_available() and ql._loader.lib is not None else 0


@needs_native
@pytest.mark.skipif(_group_max_m() == 0, reason="no AVX-512F here: the group path does not run")
@pytest.mark.parametrize("fmt", list(QTYPES))
def test_group_path_is_the_fp32_kernel_on_the_loaders_weights(fmt):
    """From 4 rows to ql_group_max_m() (AVX-512F), the kernel dequantises 16 weight rows at a time and runs
    dense_linear's tiles: every output equals dense_linear on the loader's fp32 weights, to the bit, for every
    row count in that range (N not a multiple of 16, K a multiple of 32 but not of 64) and thread count; and
    the auto path takes it instead of dequantise + GEMM up to that limit (or to the AMX tiles' first row)."""
    from deepinfer.kernels import dense_linear as dl

    packed, w = _packed(fmt, 1000, 608, seed=21)
    limit = _group_max_m()
    x = torch.randn(limit + 1, 608, generator=torch.Generator().manual_seed(22))
    full = quant_linear(x[:limit], packed, 2, impl="native")
    for m in (4, 5, 7, 17, 64, limit):
        for threads in (1, 3):
            y = quant_linear(x[:m], packed, threads, impl="native")
            assert torch.equal(y, full[:m]), (m, threads)
        ref = torch.cat([dl.dense_linear(x[i:min(i + 64, m)], w, 2) for i in range(0, m, 64)])
        assert torch.equal(y, ref), m
    assert ql._fns["gemm_min_rows"] == limit + 1
    # The auto path takes it up to that limit, or below AMX_MIN_ROWS where the AMX tiles take over.
    top = min(limit, ql.kernel_max_rows())
    assert torch.equal(quant_linear(x[:top], packed, 2), full[:top])
    _assert_product(quant_linear(x[:top + 1], packed, 2), x[:top + 1], w)  # AMX tiles, or dequantise + GEMM


@needs_native
@pytest.mark.parametrize("fmt", list(QTYPES))
def test_decode_with_long_rows(fmt):
    """K = 32 * 4097: Q4_1's per-block sums of x no longer fit the kernel's stack buffer (4096 floats)."""
    packed, w = _packed(fmt, 5, 32 * 4097, seed=13)
    x = torch.randn(3, 32 * 4097, generator=torch.Generator().manual_seed(14))
    for m in (1, 2, 3):
        _assert_product(quant_linear(x[:m], packed, 2, impl="native"), x[:m], w)


@needs_native
@pytest.mark.parametrize("fmt", list(QTYPES))
def test_gemm_path_in_chunks(monkeypatch, fmt):
    """Dequantised chunks of rows (the last one short) + torch GEMM, as for a large LM head."""
    monkeypatch.setattr(ql, "GEMM_CHUNK_FLOATS", 16 * 64)
    monkeypatch.setattr(ql, "GEMM_SPLIT_FLOATS", 5 * 64)
    packed, w = _packed(fmt, 17, 64, seed=9)
    x = torch.randn(40, 64)
    _assert_product(quant_linear(x, packed, 2), x, w)
    _assert_product(quant_linear(x[:3], packed, 2, impl="gemm"), x[:3], w)


@needs_native
@pytest.mark.parametrize("m", [1, 5, 40])
def test_strided_and_batched_inputs(m):
    packed, w = _packed("Q4_1", 33, 96, seed=3)
    wide = torch.randn(m, 200)
    x = wide[:, 10:106]  # rows 200 floats apart: read in place
    _assert_product(quant_linear(x, packed, 2), x, w)
    xt = torch.randn(96, m).t()  # columns contiguous: copied
    _assert_product(quant_linear(xt, packed, 2), xt, w)
    x3 = torch.randn(2, m, 96)
    y3 = quant_linear(x3, packed, 2)
    assert y3.shape == (2, m, 33)
    _assert_product(y3.reshape(-1, 33), x3.reshape(-1, 96), w)
    assert quant_linear(torch.randn(0, 96), packed, 2).shape == (0, 33)


@needs_native
@pytest.mark.parametrize("openmp", [False, True])
def test_plain_c_build_matches(monkeypatch, openmp):
    """A build without SIMD flags (its own f16 conversion, the portable loops) gives the same products."""
    flags = ql.build.compile_flags(openmp=openmp, simd=False)
    lib, fns = ql._load(ql._build(ql.build.find_compiler(), flags))
    assert not lib.ql_has_avx2()
    monkeypatch.setattr(ql, "_fns", fns)
    for fmt in QTYPES:
        packed, w = _packed(fmt, 19, 576, seed=8)
        x = torch.randn(11, 576)
        _assert_product(quant_linear(x, packed, 2), x, w)


@needs_native
@pytest.mark.skipif(not set(ql._SIMD) <= ql.build.cpu_flags(), reason="the CPU lacks AVX2/FMA/F16C")
def test_simd_build_without_openmp_matches(monkeypatch):
    """The SIMD paths built without OpenMP (the second flag set tried) run on one thread, same products."""
    flags = ql.build.compile_flags(openmp=False, simd=True, features=ql._SIMD)
    lib, fns = ql._load(ql._build(ql.build.find_compiler(), flags))
    assert lib.ql_has_avx2() and not lib.ql_has_openmp()
    monkeypatch.setattr(ql, "_fns", fns)
    for fmt in QTYPES:
        packed, w = _packed(fmt, 67, 576, seed=15)
        x = torch.randn(20, 576)
        for m in (1, 2, 3, 8, 20):
            _assert_product(quant_linear(x[:m], packed, 2), x[:m], w)


def test_bad_arguments_are_refused():
    packed, _ = _packed("Q8_0", 4, 64)
    with pytest.raises(ValueError, match="float32"):
        quant_linear(torch.randn(2, 64, dtype=torch.float64), packed, 1)
    with pytest.raises(ValueError, match=r"\[\.\.\., 64\]"):
        quant_linear(torch.randn(2, 32), packed, 1)
    with pytest.raises(ValueError, match="num_threads"):
        quant_linear(torch.randn(2, 64), packed, 0)
    with pytest.raises(ValueError, match="multiple of 32"):
        PackedWeight.from_raw(np.zeros(4 * 34 * 2, np.uint8), "Q8_0", (4, 48))
    with pytest.raises(ValueError, match="multiple of 32"):
        PackedWeight("Q4_0", torch.zeros(4, 27, dtype=torch.uint8), 4, 48)
    with pytest.raises(ValueError, match="cannot hold"):
        PackedWeight.from_raw(np.zeros(100, np.uint8), "Q4_0", (4, 64))
    with pytest.raises(ValueError, match="unsupported format"):
        PackedWeight.from_raw(np.zeros(100, np.uint8), T.Q5_0, (4, 64))
    with pytest.raises(ValueError, match="contiguous uint8"):
        PackedWeight("Q8_0", torch.zeros(4, 136, dtype=torch.uint8)[:, ::2], 4, 64)


@needs_native
def test_kernel_rejects_k_not_multiple_of_32():
    """The C entry point validates K itself (-1) rather than reading past a row."""
    x, y, w = torch.zeros(2, 48), torch.zeros(2, 4), torch.zeros(4 * 2 * 34, dtype=torch.uint8)
    for fn in (ql._fns["native"], ql._fns["portable"]):
        assert fn(x.data_ptr(), 48, w.data_ptr(), y.data_ptr(), 4, 2, 4, 48, 0, 1) == -1


def test_torch_fallback_gives_the_same_result(monkeypatch):
    packed, w = _packed("Q4_0", 17, 576, seed=4)
    x = torch.randn(9, 576)
    monkeypatch.setattr(ql, "_fns", {})
    monkeypatch.setattr(ql, "_state", {"tried": True, "reason": "disabled by the test"})
    y = quant_linear(x, packed, 2)
    _assert_product(y, x, w)
    torch.testing.assert_close(y, quant_linear_reference(x, packed), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="disabled by the test"):
        quant_linear(x, packed, 2, impl="native")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_dequantises_on_the_fly():
    packed, w = _packed("Q4_1", 17, 576, seed=5)
    x = torch.randn(3, 576)
    y = quant_linear(x.cuda(), packed.to("cuda"), 2)
    assert y.is_cuda
    torch.testing.assert_close(y.cpu(), x @ w.T, rtol=1e-4, atol=1e-4)


_SMOLLM2 = default_cache_dir() / "smollm2" / SMOLLM2_FILE


@pytest.mark.smollm2
@pytest.mark.skipif(not _SMOLLM2.exists(), reason=f"{_SMOLLM2} not present (deepinfer-launch fetch smollm2)")
@pytest.mark.parametrize("name", ["blk.3.ffn_down.weight", "token_embd.weight"])
def test_real_smollm2_layer_matches_loader_weights(name):
    tensor = next(t for t in open_gguf(_SMOLLM2).tensors if t.name == name)
    shape = tuple(reversed([int(d) for d in tensor.shape]))
    packed = PackedWeight.from_raw(tensor.data, tensor.tensor_type, shape)
    w = torch.from_numpy(tensor_to_numpy(tensor))  # the loader's fp32 weights
    assert torch.equal(packed.dequantize(), w)
    x = torch.randn(5, shape[1], generator=torch.Generator().manual_seed(6))
    _assert_product(quant_linear(x, packed, 2), x, w)


@needs_native
def test_the_auto_path_takes_the_kernel_up_to_this_cpus_crossover():
    """Below the kernel's crossover for this CPU (`ql_kernel_max_m()`: 256 with AVX-512, 128 on AVX2 alone,
    where torch's GEMM has no wider FMAs than the kernel) or the AMX tiles' first row, the auto path is the
    kernel, to the bit; from there on, dequantise + GEMM (or the tiles)."""
    limit = int(ql._loader.lib.ql_kernel_max_m())
    assert ql._fns["gemm_min_rows"] == max(ql.GEMM_MIN_ROWS, limit + 1)
    top = min(ql._fns["gemm_min_rows"] - 1, ql.kernel_max_rows())
    packed, w = _packed("Q4_1", 200, 96, seed=5)
    x = torch.randn(top + 1, 96, generator=torch.Generator().manual_seed(6))
    assert ql.auto_route(top) == "kernel" and ql.auto_route(top + 1) in ("gemm", "amx")
    assert torch.equal(quant_linear(x[:top], packed, 2), quant_linear(x[:top], packed, 2, impl="native"))
    _assert_product(quant_linear(x, packed, 2), x, w)
