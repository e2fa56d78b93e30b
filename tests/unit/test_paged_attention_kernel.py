"""Native paged decode attention vs the pure-torch reference, and argument validation."""

from __future__ import annotations

import pytest
import torch

from deepinfer import kernels
from deepinfer.kernels import (
    native_available,
    paged_decode_attention,
    paged_decode_attention_reference,
)

needs_native = pytest.mark.skipif(
    not native_available(),
    reason=f"native paged attention kernel could not be built: {kernels.native_unavailable_reason()}",
)


def _make(
    *,
    batch: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    context_lens: list[int],
    num_layers: int = 3,
    layer: int = 1,
    spare_blocks: int = 7,
    seed: int = 0,
):
    """Random q, a multi-layer KV tensor's strided layer views, shuffled block tables."""
    g = torch.Generator().manual_seed(seed)
    assert len(context_lens) == batch
    per_seq = [(n + block_size - 1) // block_size for n in context_lens]
    max_blocks = max(per_seq) + 2  # unused trailing entries
    num_blocks = sum(per_seq) + spare_blocks
    kv = torch.randn(num_blocks, num_layers, 2, block_size, kv_heads, head_dim, generator=g)
    k, v = kv[:, layer, 0], kv[:, layer, 1]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    # Garbage past each row's blocks: the kernel must ignore it.
    bt = torch.full((batch, max_blocks), 10**6, dtype=torch.int32)
    pos = 0
    for b, nb in enumerate(per_seq):
        bt[b, :nb] = torch.tensor(perm[pos : pos + nb], dtype=torch.int32)
        if nb < max_blocks:
            bt[b, nb] = -5
        pos += nb
    q = torch.randn(batch, heads, head_dim, generator=g)
    cl = torch.tensor(context_lens, dtype=torch.int32)
    return q, k, v, bt, cl


def _assert_matches(q, k, v, bt, cl, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    ref = paged_decode_attention_reference(q, k, v, bt, cl, scale)
    out = paged_decode_attention(q, k, v, bt, cl, scale)
    assert out.shape == q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    return out, ref


# (heads, kv_heads, head_dim, block_size)
SHAPES = [
    (9, 3, 64, 16),  # GQA 3
    (8, 8, 64, 16),  # MHA
    (8, 2, 64, 5),  # GQA 4, odd block size
    (12, 4, 48, 16),  # head_dim 48, GQA 3
    (4, 1, 48, 5),  # GQA 4, one kv head
    (6, 2, 36, 7),  # head_dim not a multiple of 8 (generic path)
    (3, 3, 20, 3),
    (4, 2, 128, 32),
]


@needs_native
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", SHAPES)
def test_native_matches_reference(heads, kv_heads, head_dim, block_size):
    g = torch.Generator().manual_seed(heads * 1000 + head_dim * 10 + block_size)
    lens = [1, 2, block_size, block_size + 1, 2 * block_size, 3 * block_size - 1, 300, 299, 17, 64]
    lens += torch.randint(1, 301, (6,), generator=g).tolist()
    _assert_matches(*_make(batch=len(lens), heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                           block_size=block_size, context_lens=lens))


@needs_native
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("batch", [1, 2, 5])
def test_native_small_batches_long_contexts(batch, threads):
    """Few (sequence, kv_head) pairs: long contexts are split across threads and merged."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        lens = [1000, 1, 777, 256, 513][:batch]
        _assert_matches(*_make(batch=batch, heads=8, kv_heads=2, head_dim=64, block_size=16,
                               context_lens=lens, seed=batch))
        _assert_matches(*_make(batch=batch, heads=8, kv_heads=2, head_dim=48, block_size=5,
                               context_lens=lens, seed=batch + 1))
        _assert_matches(*_make(batch=batch, heads=12, kv_heads=1, head_dim=36, block_size=7,
                               context_lens=lens, seed=batch + 2))
    finally:
        torch.set_num_threads(old)


@needs_native
def test_native_every_context_length():
    lens = list(range(1, 301))
    _assert_matches(*_make(batch=len(lens), heads=6, kv_heads=2, head_dim=64, block_size=16,
                           context_lens=lens, num_layers=2, layer=0))


@needs_native
def test_native_large_scores_stable():
    """Large logits: the online softmax must not overflow."""
    q, k, v, bt, cl = _make(batch=4, heads=4, kv_heads=2, head_dim=64, block_size=16,
                            context_lens=[50, 300, 17, 1])
    out, _ = _assert_matches(q * 30.0, k, v, bt, cl)
    assert torch.isfinite(out).all()


@needs_native
def test_native_writes_into_out_and_strided_q():
    q, k, v, bt, cl = _make(batch=5, heads=9, kv_heads=3, head_dim=64, block_size=16,
                            context_lens=[33, 1, 160, 75, 299])
    ref = paged_decode_attention_reference(q, k, v, bt, cl, 0.125)
    out = torch.full_like(q, float("nan"))
    res = paged_decode_attention(q, k, v, bt, cl, 0.125, out=out)
    assert res.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # q and out as row slices of wider buffers (fused qkv projections): strided in dims 0 and 1.
    qkv = torch.randn(5, 15, 64)
    qkv[:, :9] = q
    wide = torch.zeros(5, 12, 64)
    paged_decode_attention(qkv[:, :9], k, v, bt, cl, 0.125, out=wide[:, 2:11])
    torch.testing.assert_close(wide[:, 2:11], ref, rtol=1e-5, atol=1e-5)
    assert (wide[:, :2] == 0).all() and (wide[:, 11:] == 0).all()


@needs_native
def test_native_zero_context_gives_zero_row():
    q, k, v, bt, cl = _make(batch=3, heads=4, kv_heads=2, head_dim=64, block_size=16,
                            context_lens=[5, 1, 40])
    cl[1] = 0
    out, ref = _assert_matches(q, k, v, bt, cl)
    assert (out[1] == 0).all() and (ref[1] == 0).all()


@needs_native
def test_native_empty_batch():
    q, k, v, bt, cl = _make(batch=1, heads=4, kv_heads=2, head_dim=64, block_size=16, context_lens=[5])
    out = paged_decode_attention(q[:0], k, v, bt[:0], cl[:0], 0.1)
    assert out.shape == (0, 4, 64)


@needs_native
def test_native_is_deterministic_across_thread_counts():
    args = _make(batch=3, heads=8, kv_heads=2, head_dim=64, block_size=16, context_lens=[900, 40, 1])
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = paged_decode_attention(*args, 0.125)
        torch.set_num_threads(2)
        b = paged_decode_attention(*args, 0.125)
    finally:
        torch.set_num_threads(old)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_reference_matches_naive_loop():
    """The oracle itself, against a per-row, per-head loop in float64."""
    q, k, v, bt, cl = _make(batch=4, heads=6, kv_heads=2, head_dim=16, block_size=5,
                            context_lens=[1, 5, 11, 23])
    scale = 0.3
    ref = paged_decode_attention_reference(q, k, v, bt, cl, scale)
    group = 3
    for b in range(4):
        n = int(cl[b])
        ids = bt[b, : (n + 4) // 5].long()
        kk = k[ids].reshape(-1, 2, 16)[:n].double()
        vv = v[ids].reshape(-1, 2, 16)[:n].double()
        for h in range(6):
            s = kk[:, h // group] @ q[b, h].double() * scale
            expect = torch.softmax(s, 0) @ vv[:, h // group]
            torch.testing.assert_close(ref[b, h].double(), expect, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------
# Argument validation (both entry points)

ENTRY_POINTS = [
    pytest.param(paged_decode_attention, id="native", marks=needs_native),
    pytest.param(paged_decode_attention_reference, id="reference"),
]


def _valid():
    return _make(batch=2, heads=4, kv_heads=2, head_dim=32, block_size=4, context_lens=[5, 8])


@pytest.mark.parametrize("fn", ENTRY_POINTS)
@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a: {**a, "q": a["q"].double()}, "float32"),
        (lambda a: {**a, "k": a["k"].half()}, "float32"),
        (lambda a: {**a, "q": a["q"][0]}, r"q must be \[B, num_heads, head_dim\]"),
        (lambda a: {**a, "q": a["q"][..., :16]}, "head_dim mismatch"),
        (lambda a: {**a, "q": a["q"][:, :3].contiguous()}, "multiple of num_kv_heads"),
        (lambda a: {**a, "q": a["q"].transpose(1, 2).contiguous().transpose(1, 2)}, "last dim"),
        (lambda a: {**a, "k": a["k"][:, :, :1]}, "k and v shapes differ"),
        (lambda a: {**a, "k": a["k"].flatten(0, 1)}, r"k and v must be \[num_blocks"),
        (lambda a: {**a, "k": a["k"].transpose(1, 2).contiguous().transpose(1, 2)}, "inner dims"),
        (lambda a: {**a, "block_tables": a["block_tables"].long()}, "int32"),
        (lambda a: {**a, "block_tables": a["block_tables"][:1]}, "block_tables has 1 rows"),
        (lambda a: {**a, "block_tables": a["block_tables"].t().contiguous().t()}, "rows must be contiguous"),
        (lambda a: {**a, "context_lens": a["context_lens"].long()}, "context_lens must be int32"),
        (lambda a: {**a, "context_lens": a["context_lens"][:1]}, "context_lens must be int32 of shape"),
        (lambda a: {**a, "out": torch.empty(2, 4, 16)}, "out must be"),
        (lambda a: {**a, "out": torch.empty(2, 4, 32, dtype=torch.float64)}, "out must be"),
    ],
)
def test_invalid_arguments(fn, mutate, match):
    q, k, v, bt, cl = _valid()
    args = mutate({"q": q, "k": k, "v": v, "block_tables": bt, "context_lens": cl, "out": None})
    with pytest.raises(ValueError, match=match):
        fn(args["q"], args["k"], args["v"], args["block_tables"], args["context_lens"], 0.1, out=args["out"])


@pytest.mark.parametrize("fn", ENTRY_POINTS)
def test_context_len_beyond_block_table(fn):
    q, k, v, bt, cl = _valid()
    cap = bt.shape[1] * 4
    cl[1] = cap + 1
    with pytest.raises(ValueError, match=rf"context_lens\[1\] = {cap + 1} is outside"):
        fn(q, k, v, bt, cl, 0.1)
    cl[1] = -1
    with pytest.raises(ValueError, match=r"context_lens\[1\] = -1"):
        fn(q, k, v, bt, cl, 0.1)


@pytest.mark.parametrize("fn", ENTRY_POINTS)
def test_block_id_out_of_range(fn):
    q, k, v, bt, cl = _valid()
    bt[0, 1] = k.shape[0]  # row 0 uses 2 blocks (5 tokens, block 4)
    with pytest.raises(ValueError, match=r"block_tables\[0\] uses block ids outside"):
        fn(q, k, v, bt, cl, 0.1)
    bt[0, 1] = -1
    with pytest.raises(ValueError, match=r"block_tables\[0\]"):
        fn(q, k, v, bt, cl, 0.1)


def test_native_available_is_cached_and_reports_reason():
    first = native_available()
    assert native_available() is first
    if not first:
        assert kernels.native_unavailable_reason()


def test_build_failure_falls_back(monkeypatch, tmp_path, caplog):
    """A compiler that fails: native_available() is False with a logged reason, and
    paged_decode_attention still answers through the reference."""
    from deepinfer.kernels import paged_attention as pa

    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    monkeypatch.setattr(pa, "_loader", pa._new_loader())
    with caplog.at_level("WARNING", logger=pa.__name__):
        assert pa.native_available() is False
        assert pa.native_available() is False
    assert pa.native_unavailable_reason() and "failed" in pa.native_unavailable_reason()
    assert sum("unavailable" in r.getMessage() for r in caplog.records) == 1
    q, k, v, bt, cl = _valid()
    out = pa.paged_decode_attention(q, k, v, bt, cl, 0.1)
    torch.testing.assert_close(out, paged_decode_attention_reference(q, k, v, bt, cl, 0.1))
    assert not list(tmp_path.rglob("*.so"))


def test_build_goes_to_cache_dir_atomically(monkeypatch, tmp_path):
    """A fresh cache dir: the library is built there under a content-keyed name, no temp files
    left behind, and a second build reuses it."""
    from deepinfer.kernels import paged_attention as pa

    compiler = pa._find_compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    path = pa._build(compiler, pa._compile_flags())
    assert path.parent == tmp_path / "kernels" and path.name.startswith("paged_attention-")
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    mtime = path.stat().st_mtime_ns
    assert pa._build(compiler, pa._compile_flags()) == path
    assert path.stat().st_mtime_ns == mtime


@needs_native
@pytest.mark.parametrize("openmp,simd", [(True, False), (False, True)], ids=["no-avx2", "no-openmp"])
def test_reduced_builds(monkeypatch, openmp, simd):
    """The builds a CPU without AVX2+FMA, or a compiler without OpenMP, gets also match."""
    from deepinfer.kernels import paged_attention as pa

    lib, fns = pa._load(pa._build(pa._find_compiler(), pa._compile_flags(openmp=openmp, simd=simd)))
    assert lib.pa_has_avx2() == 0 or simd
    assert lib.pa_has_openmp() == int(openmp)
    monkeypatch.setattr(pa._loader, "fns", fns)
    for heads, kv_heads, head_dim, block_size in SHAPES[:6]:
        lens = [1, block_size, 2 * block_size + 1, 300, 45]
        _assert_matches(*_make(batch=len(lens), heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                               block_size=block_size, context_lens=lens))
    _assert_matches(*_make(batch=1, heads=8, kv_heads=2, head_dim=64, block_size=16, context_lens=[1000]))
