"""The fp32 few-rows linear kernel (dense_linear.c) against float64, and its batch invariance.

Tolerance: |y - ref| <= RTOL * (|x| @ |W|^T) elementwise, as in test_quant_linear.py: the kernel sums
in lanes and then a tree, so its error is a few fp32 ulps of the sum of absolute terms. The portable
path sums in order (error up to ~K ulps), hence its looser bound.

Batch invariance is asserted bit for bit: every row of a call equals that row computed alone, on one
thread or two, and a row's result does not change with its position among the others.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer.engine.models import linear as linear_mod
from deepinfer.kernels import dense_linear as dl

needs_native = pytest.mark.skipif(not dl.native_available(), reason="dense linear kernel could not be built")

RTOL = {"native": 1e-5, "avx2": 1e-5, "portable": 2e-4}
# Row counts over every tile shape (AVX-512: 4 x 4 blocks, a 2-row block, a last row; AVX2: 6 x 2 blocks, then
# 0..5 rows in one MR x 2, 2 x 4 or 1 x 8 block) and the limit; shapes with N tails (not a multiple of 16 or 8),
# K tails (masked loads), and sizes split over threads.
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 17, 33, dl.MAX_ROWS)
SHAPES = [(1, 1), (3, 7), (16, 16), (17, 23), (100, 576), (576, 1536), (1537, 33), (49, 1000)]


def _impls() -> list[str]:
    """The kernel's paths this build can run: "avx2" too where the build has it (an AVX-512 CPU runs both)."""
    if not dl.native_available():
        return ["native"]
    x, w, y = torch.ones(1, 8), torch.ones(1, 8), torch.empty(1, 1)
    has_avx2 = dl._fns["avx2"](x.data_ptr(), 8, w.data_ptr(), y.data_ptr(), 1, 1, 1, 8, 1) == 0
    return ["native", "portable"] + (["avx2"] if has_avx2 else [])


def _assert_product(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rtol: float) -> None:
    xd, wd = x.double(), w.double()
    ref = xd @ wd.T
    bound = rtol * (xd.abs() @ wd.abs().T) + 1e-30
    err = (y.double() - ref).abs()
    assert y.dtype == torch.float32 and y.shape == ref.shape
    assert bool((err <= bound).all()), f"max error/bound {float((err / bound).max()):.3g}"


@needs_native
@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("n,k", SHAPES)
def test_product_matches_float64(impl: str, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n * 7919 + k)
    w = torch.randn(n, k, generator=g)
    for m in ROWS:
        x = torch.randn(m, k, generator=g)
        for threads in (1, 2):
            y = dl.dense_linear(x, w, threads, impl=impl)
            assert y is not None
            _assert_product(y, x, w, RTOL[impl])


@needs_native
@pytest.mark.parametrize("impl", _impls())
def test_each_row_is_the_same_bits_alone_in_any_batch_and_on_any_thread_count(impl: str) -> None:
    g = torch.Generator().manual_seed(1)
    for n, k in [(100, 576), (1537, 33), (576, 1536)]:
        w = torch.randn(n, k, generator=g)
        x = torch.randn(dl.MAX_ROWS, k, generator=g)
        alone = torch.cat([dl.dense_linear(x[i:i + 1], w, 1, impl=impl) for i in range(len(x))])  # type: ignore[misc]
        for m in ROWS:
            for threads in (1, 2, 3):
                y = dl.dense_linear(x[:m], w, threads, impl=impl)
                assert y is not None and torch.equal(y, alone[:m]), (n, k, m, threads)
        # The same row in another position (another tile shape and lane) gives the same bits.
        shuffled = dl.dense_linear(x.flip(0)[:17], w, 2, impl=impl)
        assert shuffled is not None and torch.equal(shuffled, alone.flip(0)[:17])


@needs_native
def test_strided_rows_are_read_in_place() -> None:
    g = torch.Generator().manual_seed(2)
    base = torch.randn(9, 80, generator=g)
    x = base[:, 5:69]  # rows 80 floats apart, 64 used
    w = torch.randn(33, 64, generator=g)
    y = dl.dense_linear(x, w, 2)
    assert y is not None
    assert torch.equal(y, dl.dense_linear(x.contiguous(), w, 2))
    _assert_product(y, x, w, RTOL["native"])


@needs_native
def test_cases_the_kernel_does_not_take_return_none() -> None:
    w = torch.randn(8, 16)
    assert dl.dense_linear(torch.randn(dl.MAX_ROWS + 1, 16), w, 1) is None  # a GEMM's job
    assert dl.dense_linear(torch.randn(2, 16, dtype=torch.float64), w.double(), 1) is None
    assert dl.dense_linear(torch.randn(2, 8), torch.randn(8, 16).t(), 1) is None  # a transposed weight
    assert dl.dense_linear(torch.randn(16, 2).t(), w, 1) is None  # columns not contiguous
    assert dl.dense_linear(torch.randn(0, 16), w, 1) is None
    assert dl.dense_linear(torch.randn(2, 15), w, 1) is None  # K mismatch


@needs_native
def test_models_linear_uses_the_kernel_up_to_its_row_limit_and_the_gemm_above() -> None:
    g = torch.Generator().manual_seed(3)
    w, bias = torch.randn(40, 96, generator=g), torch.randn(40, generator=g)
    for m in (1, 5, dl.MAX_ROWS):
        x = torch.randn(m, 96, generator=g)
        assert torch.equal(linear_mod.linear(x, w), dl.dense_linear(x, w, torch.get_num_threads()))
        assert torch.equal(linear_mod.linear(x, w, bias), dl.dense_linear(x, w, torch.get_num_threads()) + bias)
    x = torch.randn(dl.MAX_ROWS + 1, 96, generator=g)
    assert torch.equal(linear_mod.linear(x, w), F.linear(x, w))
