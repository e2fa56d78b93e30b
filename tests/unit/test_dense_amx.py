"""fp32 linear layers on AMX tiles (`kernels/dense_amx.h`, `dense_linear.dense_linear_amx`): each output within
an fp32 GEMM's rounding of the float64 product (a bound that plain bf16 products miss), any shape (K off the
32-input tile, partial row and feature tiles), the same bits for any thread count and from concurrent
callers, and the models' routing from AMX_MIN_ROWS rows; the AMX switch keeps every call off them."""

from __future__ import annotations

import threading

import pytest
import torch

from deepinfer.engine.models import linear as linear_mod
from deepinfer.kernels import dense_linear as dl
from deepinfer.kernels.amx import allow_amx

needs_amx = pytest.mark.skipif(not dl.amx_available(), reason="no AMX-BF16 tiles here (or no kernel)")


def _case(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.05


def _scaled_error(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    """max |y - x w^T| / (|x| |w|^T): error relative to the sum of the terms' magnitudes."""
    exact = x.double() @ w.double().T
    return ((y.double() - exact).abs() / (x.double().abs() @ w.double().abs().T)).max().item()


# An fp32 dot product of K terms rounds to about K * 2^-24 of its terms' magnitude at worst, ~sqrt(K) 2^-24
# typically; the bound is a few ulps, as torch's GEMM meets on the same inputs.
BOUND = 2e-6


@needs_amx
@pytest.mark.parametrize("m,n,k", [(1024, 960, 576), (300, 576, 1536), (128, 49, 33), (129, 17, 100), (1, 48, 32),
                                   (200, 50, 2000)])
def test_products_within_fp32_rounding(m, n, k):
    x, w = _case(m, n, k, seed=m + n + k)
    y = dl.dense_linear_amx(x, w, 2)
    assert y is not None and y.shape == (m, n)
    assert _scaled_error(y, x, w) <= BOUND
    assert _scaled_error(x @ w.T, x, w) <= BOUND  # the bound is one an fp32 GEMM meets


@needs_amx
def test_bound_fails_with_bf16_products():
    """Plain bf16 products (the first pieces alone) miss the bound by orders of magnitude, so the tests above
    would notice a kernel that dropped the small pieces."""
    x, w = _case(256, 64, 576, seed=1)
    bf = x.bfloat16().float() @ w.bfloat16().float().T
    assert _scaled_error(bf, x, w) > 100 * BOUND


@needs_amx
def test_strided_rows_and_thread_counts():
    x_all, w = _case(300, 96, 576, seed=2)
    x = x_all[:, :576]
    wide = torch.zeros(300, 700)
    wide[:, :576] = x_all
    one = dl.dense_linear_amx(wide[:, :576], w, 1)
    for threads in (2, 3):
        assert torch.equal(dl.dense_linear_amx(x, w, threads), one)


@needs_amx
def test_concurrent_callers():
    cases = [_case(128 + 64 * i, 48 + 16 * i, 576, seed=10 + i) for i in range(4)]
    alone = [dl.dense_linear_amx(x, w, 2) for x, w in cases]
    got: list[list[torch.Tensor]] = [[] for _ in cases]

    def run(i: int) -> None:
        for _ in range(5):
            got[i].append(dl.dense_linear_amx(*cases[i], 2))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(len(g) == 5 and all(torch.equal(y, alone[i]) for y in g) for i, g in enumerate(got))


@needs_amx
def test_models_route_many_rows_to_the_tiles(monkeypatch):
    """`linear` sends fp32 weights at AMX_MIN_ROWS rows or more to the tiles, fewer to the few-rows kernel or
    torch; a bias is added after."""
    calls = []
    real = linear_mod.dense_linear_amx
    monkeypatch.setattr(linear_mod, "dense_linear_amx", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    x, w = _case(dl.AMX_MIN_ROWS, 40, 64, seed=3)
    bias = torch.randn(40)
    y = linear_mod.linear(x, w, bias)
    assert calls == [dl.AMX_MIN_ROWS]
    torch.testing.assert_close(y, x @ w.T + bias, rtol=0, atol=1e-5)
    linear_mod.linear(x[: dl.AMX_MIN_ROWS - 1], w)
    assert calls == [dl.AMX_MIN_ROWS]


@pytest.mark.skipif(not dl.native_available(), reason="kernel could not be built")
def test_switched_off_by_the_amx_switch(monkeypatch, restore_amx_switch):
    """`allow_amx(False)` (what `EngineConfig(amx=False)` sets; DEEPINFER_AMX=0 at the launcher) keeps every call
    off the tiles, though the kernel loaded with them, from the next call on: `amx_available()` is False,
    `dense_linear_amx` declines and the models' `linear` takes torch's GEMM. Where the CPU has no tiles a stand-in
    is registered (the kernel's own fp32 path, which takes the same arguments), so the test can fail anywhere."""
    calls: list[int] = []
    tiles = dl._fns.get("amx") or dl._fns["native"]
    monkeypatch.setitem(dl._fns, "amx", lambda *a: calls.append(a[5]) or tiles(*a))  # a[5]: the row count
    x, w = _case(dl.AMX_MIN_ROWS, 40, 64, seed=4)

    allow_amx(True)
    assert dl.amx_available()
    torch.testing.assert_close(linear_mod.linear(x, w), x @ w.T, rtol=0, atol=1e-5)
    assert calls == [dl.AMX_MIN_ROWS]

    allow_amx(False)
    assert dl.native_available() and not dl.amx_available()
    assert dl.dense_linear_amx(x, w, 2) is None and dl.dense_linear(x[:4], w, 2, impl="amx") is None
    torch.testing.assert_close(linear_mod.linear(x, w), x @ w.T, rtol=0, atol=1e-5)
    assert dl.dense_linear(x[:4], w, 2) is not None  # the few-rows kernel is not a tile path: still there
    assert calls == [dl.AMX_MIN_ROWS]

    allow_amx(True)  # asked per call: back on, the tiles take the many rows again
    linear_mod.linear(x, w)
    assert calls == [dl.AMX_MIN_ROWS] * 2
