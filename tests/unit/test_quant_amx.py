"""The AMX tile path of the GGUF-block linear kernel (quant_amx.h): exact fp32 products from bf16 tiles.

It splits every activation into three bf16 pieces and every weight d * q into two (three for Q8_0), so
the products are the fp32 layer's and only the order of the sums differs. The tests hold it to the bound
of test_quant_linear.py (an error of a few fp32 ulps of the sum of |terms|) and, on one block, to a bound
that any dropped piece breaks. They run only on a CPU with AMX-BF16 (Sapphire Rapids and later), where the
auto path takes this route from AMX_MIN_ROWS rows; the switch-off test runs everywhere, on a stand-in for the
tile entry point.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import quant_linear as ql
from deepinfer.kernels.amx import allow_amx
from deepinfer.kernels.quant_linear import quant_linear
from tests.unit.test_quant_linear import QTYPES, _assert_product, _packed

needs_amx = pytest.mark.skipif(not ql.amx_available(), reason="no AMX-BF16 tile path on this CPU / OS")


@needs_amx
@pytest.mark.parametrize("fmt", list(QTYPES))
@pytest.mark.parametrize("n,k", [(1, 32), (17, 64), (48, 608), (1000, 576), (50, 32 * 33), (576, 1536)])
def test_amx_matches_the_dequantised_product(fmt, n, k):
    """Row counts around the 16-row tile, N off the 48-feature triple, K with a partial tile of Q4_1 block
    sums (608 = 19 blocks) and with two of them (33 blocks)."""
    packed, w = _packed(fmt, n, k, seed=n + k)
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(k))
    for m in (1, 15, 16, 17, 63, 64, 65, 300):
        _assert_product(quant_linear(x[:m], packed, 2, impl="amx"), x[:m], w)


@needs_amx
@pytest.mark.parametrize("fmt", list(QTYPES))
def test_amx_products_are_exact_not_bf16(fmt):
    """One block, activations with all 24 significant bits: the error is that of fp32 sums of exact products
    (bound 4e-7 of the sum of |terms|). Rounding x to bf16, or dropping its third piece, misses by far more
    than that, as the check on a deliberately rounded x shows, so the bound can tell them apart."""
    packed, w = _packed(fmt, 64, 32, seed=5)
    g = torch.Generator().manual_seed(6)
    x = (torch.rand(64, 32, generator=g) + 1.0) * torch.where(torch.rand(64, 32, generator=g) < 0.5, -1.0, 1.0)
    x = x + torch.rand(64, 32, generator=g) * 2.0**-20  # low mantissa bits set

    def worst(y: torch.Tensor, xs: torch.Tensor) -> float:
        ref = xs.double() @ w.double().T
        scale = xs.double().abs() @ w.double().abs().T + 1e-30
        return float(((y.double() - ref).abs() / scale).max())

    def truncated(v: torch.Tensor) -> torch.Tensor:  # v with its low 16 bits cleared (a bf16 piece)
        return (v.view(torch.int32) & -65536).view(torch.float32)

    assert worst(quant_linear(x, packed, 1, impl="amx"), x) <= 4e-7
    x1 = truncated(x)
    x12 = x1 + truncated(x - x1)  # the third piece dropped
    assert worst(x12.double() @ w.double().T, x) > 4e-7
    assert worst(x1.double() @ w.double().T, x) > 1e-4  # one bf16 piece


@needs_amx
@pytest.mark.parametrize("fmt", list(QTYPES))
def test_amx_result_does_not_depend_on_thread_count(fmt):
    """Each output tile is summed by one thread in one order, so the bits are the same for any thread count."""
    packed, _ = _packed(fmt, 1000, 608, seed=7)
    x = torch.randn(200, 608, generator=torch.Generator().manual_seed(8))
    y1 = quant_linear(x, packed, 1, impl="amx")
    for threads in (2, 3):
        assert torch.equal(quant_linear(x, packed, threads, impl="amx"), y1)


@needs_amx
def test_amx_strided_input_and_auto_route():
    """Rows read in place from a wider tensor; the auto path takes the tiles from AMX_MIN_ROWS rows and the
    register kernel below, each within the product bound."""
    packed, w = _packed("Q4_1", 100, 96, seed=9)
    wide = torch.randn(ql.AMX_MIN_ROWS + 10, 200)
    x = wide[:, 10:106]
    y = quant_linear(x, packed, 2)
    assert torch.equal(y, quant_linear(x.contiguous(), packed, 2, impl="amx"))
    _assert_product(y, x, w)
    small = x[: ql.AMX_MIN_ROWS - 1]
    assert torch.equal(quant_linear(small, packed, 2), quant_linear(small, packed, 2, impl="native"))


@needs_amx
def test_amx_non_finite_inputs_stay_in_their_rows():
    """A NaN activation makes its row's outputs NaN and an infinite one makes them non-finite (NaN where the
    infinity meets a zero piece: the documented limit); every other row is exact."""
    packed, w = _packed("Q4_1", 40, 64, seed=10)
    x = torch.randn(70, 64, generator=torch.Generator().manual_seed(11))
    x[3, 5] = float("nan")
    x[9, 40] = float("inf")
    x[12, 0] = float("-inf")
    y = quant_linear(x, packed, 2, impl="amx")
    assert bool(y[3].isnan().all())
    assert not bool(y[9].isfinite().any()) and not bool(y[12].isfinite().any())
    rest = [i for i in range(70) if i not in (3, 9, 12)]
    _assert_product(y[rest], x[rest], w)


def test_amx_unavailable_is_a_clear_error(monkeypatch):
    packed, _ = _packed("Q8_0", 4, 32)
    if ql.native_available():
        monkeypatch.delitem(ql._fns, "amx", raising=False)
    with pytest.raises(RuntimeError, match="AMX tile path is unavailable|kernel unavailable"):
        quant_linear(torch.randn(70, 32), packed, 1, impl="amx")


@pytest.mark.skipif(not ql.native_available(), reason="kernel could not be built")
def test_amx_can_be_switched_off(monkeypatch, restore_amx_switch):
    """`allow_amx(False)` (what `EngineConfig(amx=False)` sets; DEEPINFER_AMX=0 at the launcher) keeps every call
    off the tiles, though the kernel loaded with them, from the next call on: no route, no threshold and no
    explicit impl="amx" reaches the tile entry point. Where the CPU has no tiles a stand-in is registered (the
    register kernel, which takes the same arguments), so the test can fail anywhere."""
    calls: list[int] = []
    tiles = ql._fns.get("amx") or ql._fns["native"]
    monkeypatch.setitem(ql._fns, "amx", lambda *a: calls.append(a[5]) or tiles(*a))  # a[5]: the row count
    packed, w = _packed("Q4_1", 40, 96, seed=13)
    x = torch.randn(ql.AMX_MIN_ROWS + 6, 96, generator=torch.Generator().manual_seed(14))
    gemm_min_rows = ql._fns["gemm_min_rows"]

    allow_amx(True)
    assert ql.amx_available() and ql.auto_route(ql.AMX_MIN_ROWS) == "amx"
    assert ql.kernel_max_rows() == ql.AMX_MIN_ROWS - 1
    _assert_product(quant_linear(x, packed, 2), x, w)
    assert calls == [len(x)]

    allow_amx(False)
    assert ql.native_available() and not ql.amx_available()
    assert ql.kernel_max_rows() == gemm_min_rows - 1  # the register kernel's own crossover again
    assert ql.auto_route(len(x)) == ("kernel" if len(x) < gemm_min_rows else "gemm")
    _assert_product(quant_linear(x, packed, 2), x, w)
    assert torch.equal(quant_linear(x[:1], packed, 2), quant_linear(x[:1], packed, 2, impl="native"))
    with pytest.raises(RuntimeError, match="AMX switch is off"):
        quant_linear(x, packed, 2, impl="amx")
    assert calls == [len(x)]

    allow_amx(True)  # asked per call: back on, the tiles take the many rows again
    quant_linear(x, packed, 2)
    assert calls == [len(x), len(x)]


@needs_amx
def test_amx_from_several_threads_at_once():
    """Each call packs into its own buffers and each OS thread configures its own tiles: concurrent calls from
    Python threads (a worker's engine thread beside a draft model's, say) give the single-threaded bits."""
    from concurrent.futures import ThreadPoolExecutor

    packed, _ = _packed("Q4_1", 300, 576, seed=12)
    xs = [torch.randn(100, 576, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    want = [quant_linear(x, packed, 2, impl="amx") for x in xs]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda x: quant_linear(x, packed, 2, impl="amx"), xs * 4))
    assert all(torch.equal(g, want[i % 8]) for i, g in enumerate(got))
