"""The AMX prefill attention kernel (`kernels/attention_amx.c`) against float64 attention: causal over a
chunk's own keys and after earlier context, GQA and MHA, every supported head size, lengths off the tile
sizes; the same bits for any thread count and from concurrent callers; bad shapes refused; the switch-off."""

from __future__ import annotations

import threading

import pytest
import torch

from deepinfer.engine.attention_backend import NATIVE
from deepinfer.kernels import attention_amx
from deepinfer.kernels.amx import allow_amx

needs_amx = pytest.mark.skipif(not attention_amx.available(),
                               reason="no AMX-BF16 tiles here (or the kernel could not be built)")


def _inputs(H: int, Hkv: int, Tq: int, Tk: int, D: int, seed: int = 0, spread: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(H, Tq, D, generator=g) * spread
    k = torch.randn(Hkv, Tk, D, generator=g) * spread
    v = torch.randn(Hkv, Tk, D, generator=g)
    return q, k, v


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 softmax attention, query i seeing keys up to Tk - Tq + i; [Tq, H, D]."""
    H, Tq, _ = q.shape
    Hkv, Tk, _ = k.shape
    kk = k.double().repeat_interleave(H // Hkv, 0)
    vv = v.double().repeat_interleave(H // Hkv, 0)
    s = torch.einsum("hid,hjd->hij", q.double(), kk) * scale
    visible = torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq)
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hij,hjd->hid", p, vv).transpose(0, 1)


# (heads, kv_heads, Tq, Tk, head_dim): GQA and MHA; a prompt alone (Tq == Tk) and chunks after context;
# lengths that are and are not multiples of the 16-query and 32-key tiles; one query; every head size step.
CASES = [
    (9, 3, 1024, 1024, 64),
    (9, 3, 37, 37, 64),
    (4, 4, 1, 1, 64),
    (2, 1, 5, 70, 32),
    (3, 3, 100, 333, 128),
    (4, 2, 48, 96, 96),
    (2, 2, 17, 17, 256),
    (8, 2, 33, 64, 160),
    # past one chunk of 1,024 keys: the running maximum and the output rescaled between chunks
    (3, 1, 1500, 1500, 64),
    (2, 2, 70, 2600, 64),
]


@needs_amx
@pytest.mark.parametrize("H,Hkv,Tq,Tk,D", CASES)
def test_matches_float64_attention(H, Hkv, Tq, Tk, D):
    q, k, v = _inputs(H, Hkv, Tq, Tk, D, seed=H * Tq + D)
    scale = D**-0.5
    out = attention_amx.prefill_attention(q, k, v, scale).double()
    ref = _reference(q, k, v, scale)
    sdpa_err = _sdpa(q, k, v, scale).double().sub(ref).abs().max().item()
    err = out.sub(ref).abs().max().item()
    # fp32 accuracy: within a few fp32 ulps of the (|v| ~ 1) outputs, as SDPA's fp32 kernel is.
    assert err <= 4e-6, (err, sdpa_err)


def _sdpa(q, k, v, scale):
    Tq, Tk = q.shape[1], k.shape[1]
    mask = torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq)
    o = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale,
                                                         enable_gqa=True)
    return o[0].transpose(0, 1)


@needs_amx
def test_accuracy_bound_fails_without_the_small_pieces():
    """The 4e-6 bound above can fail: plain bf16 products (the first pieces alone) miss it by far, so the
    test would notice a kernel that dropped the pieces that make products fp32-accurate."""
    q, k, v = _inputs(9, 3, 256, 256, 64, seed=3)
    scale = 0.125
    bf = _reference(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), scale)
    assert bf.sub(_reference(q, k, v, scale)).abs().max().item() > 1e-3
    out = attention_amx.prefill_attention(q, k, v, scale).double()
    assert out.sub(_reference(q, k, v, scale)).abs().max().item() <= 4e-6


@needs_amx
def test_large_scores_stay_stable():
    """Scores up to ~150 (a peaked softmax): the row maximum keeps exp in range, no inf or NaN, and the
    error (which grows with the scores' size, as any fp32 kernel's does) stays within SDPA's."""
    q, k, v = _inputs(4, 2, 64, 160, 64, seed=5, spread=6.0)
    out = attention_amx.prefill_attention(q, k, v, 0.125)
    assert torch.isfinite(out).all()
    ref = _reference(q, k, v, 0.125)
    sdpa_err = _sdpa(q, k, v, 0.125).double().sub(ref).abs().max().item()
    assert out.double().sub(ref).abs().max().item() <= max(sdpa_err, 1e-5)


@needs_amx
def test_strided_views_and_out_view():
    """Head-major views with row strides (as attention.py passes slices of a step), written into a view."""
    H, Hkv, T, D = 6, 2, 50, 64
    q_all, k_all, v_all = _inputs(H, Hkv, T + 10, T + 10, D, seed=9)
    q, k, v = q_all[:, 5:5 + T], k_all[:, 5:5 + T], v_all[:, 5:5 + T]
    big = torch.full((T + 4, H, D), 7.0)
    attention_amx.prefill_attention(q, k, v, 0.125, out=big[2:2 + T])
    torch.testing.assert_close(big[2:2 + T].double(), _reference(q, k, v, 0.125), rtol=0, atol=4e-6)
    assert (big[:2] == 7.0).all() and (big[2 + T:] == 7.0).all()


@needs_amx
@pytest.mark.parametrize("threads", [2, 3])
def test_same_bits_for_any_thread_count(threads):
    q, k, v = _inputs(9, 3, 200, 260, 64, seed=11)
    one = attention_amx.prefill_attention(q, k, v, 0.125, num_threads=1)
    many = attention_amx.prefill_attention(q, k, v, 0.125, num_threads=threads)
    assert torch.equal(one.view(torch.int32), many.view(torch.int32))


@needs_amx
def test_concurrent_callers_share_nothing():
    """Four Python threads at once, each with its own shapes (the kernel keeps per-thread buffers between
    calls): every result equals the same call made alone."""
    cases = [_inputs(9, 3, 64 + 40 * i, 64 + 70 * i, 64, seed=20 + i) for i in range(4)]
    alone = [attention_amx.prefill_attention(q, k, v, 0.125, num_threads=2) for q, k, v in cases]
    results: list[list[torch.Tensor]] = [[] for _ in cases]

    def run(i: int) -> None:
        for _ in range(5):
            results[i].append(attention_amx.prefill_attention(*cases[i], 0.125, num_threads=2))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, outs in enumerate(results):
        assert len(outs) == 5 and all(torch.equal(o, alone[i]) for o in outs)


@needs_amx
def test_bad_shapes_are_refused():
    q, k, v = _inputs(4, 2, 8, 8, 64)
    with pytest.raises(ValueError, match="unsupported"):
        attention_amx.prefill_attention(q[:3], k, v, 0.125)  # 3 heads over 2 KV heads
    with pytest.raises(ValueError, match="unsupported"):
        attention_amx.prefill_attention(*_inputs(2, 1, 8, 8, 48), 0.125)  # head_dim not a multiple of 32
    with pytest.raises(ValueError, match="unsupported"):
        attention_amx.prefill_attention(*_inputs(2, 1, 9, 8, 64), 0.125)  # more queries than keys
    with pytest.raises(ValueError, match="float32"):
        attention_amx.prefill_attention(q.half(), k, v, 0.125)
    with pytest.raises(ValueError, match="out must be"):
        attention_amx.prefill_attention(q, k, v, 0.125, out=torch.empty(8, 4, 32))


@pytest.mark.skipif(not attention_amx._loader.available(), reason="the kernel could not be built")
def test_switched_off_by_the_amx_switch(monkeypatch, restore_amx_switch):
    """`allow_amx(False)` (what `EngineConfig(amx=False)` sets; DEEPINFER_AMX=0 at the launcher) keeps SDPA, though
    the kernel loaded with its tiles, from the next call on: `available()` and `supports()` are False, the
    kernel's entry refuses, and the native backend's prefill never reaches the tiles. Where the CPU has none a
    stand-in entry point is registered (it only counts its calls), so the test can fail anywhere."""
    calls: list[int] = []
    monkeypatch.setitem(attention_amx._fns, "prefill", lambda *a: calls.append(a[12]) or 0)  # a[12]: Tq
    q, k, v = _inputs(4, 2, 24, 24, 64, seed=5)
    out = torch.zeros(24, 4, 64)

    allow_amx(True)
    assert attention_amx.available() and attention_amx.supports(64, 4, 2)
    NATIVE.prefill_attention(q, k, v, 0.125, out)
    assert calls == [24]

    allow_amx(False)
    assert not attention_amx.available() and not attention_amx.supports(64, 4, 2)
    with pytest.raises(RuntimeError, match="switched off"):
        attention_amx.prefill_attention(q, k, v, 0.125)
    NATIVE.prefill_attention(q, k, v, 0.125, out)  # SDPA
    assert calls == [24]
    torch.testing.assert_close(out.double(), _reference(q, k, v, 0.125), rtol=0, atol=1e-5)

    allow_amx(True)  # asked per call: back on, the tiles take the prefill again
    NATIVE.prefill_attention(q, k, v, 0.125, out)
    assert calls == [24, 24]
