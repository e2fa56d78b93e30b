"""The RMS norm kernel (deepinfer/kernels/rms_norm.c) against torch and a float64 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer.kernels import rms_norm as rn

pytestmark = pytest.mark.skipif(not rn.native_available(), reason="no C compiler for the RMS norm kernel")

EPS = 1e-5


def exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float64 RMS norm, rounded to fp32 once."""
    xd = x.double()
    return (w.double() * xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + EPS)).float()


@pytest.mark.parametrize("rows", [1, 2, 3, 17, 300])
@pytest.mark.parametrize("width", [7, 64, 576, 1000])
def test_matches_torch_and_float64(rows: int, width: int) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + width)
    x = torch.randn(rows, width, generator=g) * 4
    w = torch.randn(width, generator=g)
    out = rn.rms_norm(x.clone(), w, EPS)
    torch.testing.assert_close(out, F.rms_norm(x, (width,), w, EPS), rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(out, exact(x, w), rtol=2e-6, atol=2e-6)


def test_residual_is_added_in_place_then_normalised() -> None:
    g = torch.Generator().manual_seed(1)
    x, r, w = torch.randn(5, 576, generator=g), torch.randn(5, 576, generator=g), torch.randn(576, generator=g)
    summed = x + r
    out = rn.rms_norm(x, w, EPS, residual=r)
    assert torch.equal(x, summed)  # fp32 add, the same rounding as torch's
    assert torch.equal(out, rn.rms_norm(summed.clone(), w, EPS))


def test_rows_do_not_depend_on_threads_or_neighbours() -> None:
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(300, 576, generator=g), torch.randn(576, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = rn.rms_norm(x.clone(), w, EPS)
        torch.set_num_threads(max(2, threads))
        many = rn.rms_norm(x.clone(), w, EPS)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)
    assert torch.equal(rn.rms_norm(x[7:8].clone(), w, EPS), one[7:8])


def test_strided_rows_and_rows_apart() -> None:
    g = torch.Generator().manual_seed(3)
    base, w = torch.randn(4, 1200, generator=g), torch.randn(576, generator=g)
    x = base[:, 100:676]  # rows 1200 apart: the kernel reads them in place
    expected = rn.rms_norm(x.contiguous(), w, EPS)
    assert torch.equal(rn.rms_norm(x, w, EPS), expected)
    col = torch.randn(576, 4, generator=g).t()  # last dim strided: the torch path
    torch.testing.assert_close(rn.rms_norm(col, w, EPS), rn.rms_norm(col.contiguous(), w, EPS), rtol=2e-6,
                               atol=2e-6)


def test_other_dtypes_take_the_torch_path() -> None:
    x, w = torch.randn(3, 64, dtype=torch.float64), torch.randn(64, dtype=torch.float64)
    torch.testing.assert_close(rn.rms_norm(x, w, EPS), F.rms_norm(x, (64,), w, EPS))


def test_residual_of_another_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="residual shape"):
        rn.rms_norm(torch.zeros(2, 8), torch.ones(8), EPS, residual=torch.zeros(1, 8))


def test_zero_rows() -> None:
    assert rn.rms_norm(torch.zeros(0, 64), torch.ones(64), EPS).shape == (0, 64)
