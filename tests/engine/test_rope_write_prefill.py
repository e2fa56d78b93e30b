"""`rope_write_prefill`: the prefill rows' rotation, KV store and head-major layout in one native call,
bit for bit the torch ops it replaces (`rope.apply_rotary`, `rope_write.write_kv`, `rope_write.as_cached`)."""

from __future__ import annotations

import pytest
import torch

from deepinfer import kernels
from deepinfer.engine.models.rope import apply_rotary
from deepinfer.kernels.rope_write import as_cached, rope_write_prefill, rope_write_prefill_reference, write_kv

needs_native = pytest.mark.skipif(not kernels.native_available(), reason="paged attention kernel not built")
H, KVH, D, NB, BS, LAYERS = 6, 2, 64, 12, 16, 3


def _case(t: int, dtype: torch.dtype, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(t, (H + 2 * KVH) * D + 40, generator=g)
    qkv = wide[:, 8:8 + (H + 2 * KVH) * D]  # rows read in place, 40 floats wider than they are
    cos, sin = torch.randn(300, D, generator=g), torch.randn(300, D, generator=g)
    positions = torch.randint(0, 300, (t,), generator=g)
    slots = torch.randperm(NB * BS, generator=g)[:t]
    pool = torch.randn(NB, LAYERS, 2, BS, KVH, D, generator=g).to(dtype)
    return qkv, cos, sin, positions, slots // BS, slots % BS, pool


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t", [1, 5, 130])
def test_native_equals_the_torch_ops(dtype, t):
    qkv, cos, sin, pos, blocks, offsets, pool = _case(t, dtype)
    before = qkv.clone()
    theirs_pool = pool.clone()
    q, k, v = rope_write_prefill(qkv, cos, sin, pos, blocks, offsets, pool[:, 1, 0], pool[:, 1, 1])
    assert torch.equal(qkv, before)  # read, not changed
    # The torch steps the engine ran before: rotate, store, attend to the rounded fresh values.
    rows = qkv.reshape(t, H + 2 * KVH, D)
    qk = apply_rotary(rows[:, : H + KVH], cos[pos].unsqueeze(1), sin[pos].unsqueeze(1))

    write_kv(theirs_pool[:, 1, 0], theirs_pool[:, 1, 1], qk[:, H:], rows[:, H + KVH:], blocks, offsets)
    assert torch.equal(pool, theirs_pool)
    assert torch.equal(q, qk[:, :H].transpose(0, 1).contiguous())
    assert torch.equal(k, as_cached(qk[:, H:], dtype).transpose(0, 1).contiguous())
    assert torch.equal(v, as_cached(rows[:, H + KVH:], dtype).transpose(0, 1).contiguous())
    ref = rope_write_prefill_reference(qkv, cos, sin, pos, blocks, offsets, theirs_pool[:, 1, 0], theirs_pool[:, 1, 1])
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), ref))
    assert all(x.is_contiguous() for x in (q, k, v)) and q.shape == (H, t, D) and k.shape == v.shape == (KVH, t, D)


@pytest.mark.parametrize("fn", [rope_write_prefill, rope_write_prefill_reference])
def test_bad_positions_and_slots_write_nothing(fn):
    qkv, cos, sin, pos, blocks, offsets, pool = _case(9, torch.float32, seed=1)
    before = pool.clone()
    for p, b, o, what in ((pos.clone().index_fill_(0, torch.tensor([4]), 300), blocks, offsets, "positions"),
                          (pos, blocks.clone().index_fill_(0, torch.tensor([8]), NB), offsets, "slot"),
                          (pos, blocks, offsets.clone().index_fill_(0, torch.tensor([0]), -1), "slot")):
        with pytest.raises(ValueError, match=what):
            fn(qkv, cos, sin, p, b, o, pool[:, 0, 0], pool[:, 0, 1])
        assert torch.equal(pool, before)
    with pytest.raises(ValueError, match="qkv"):
        fn(qkv[:, :-D], cos, sin, pos, blocks, offsets, pool[:, 0, 0], pool[:, 0, 1])
    with pytest.raises(ValueError, match="positions"):
        fn(qkv, cos, sin, pos.int(), blocks, offsets, pool[:, 0, 0], pool[:, 0, 1])


def test_no_rows():
    qkv, cos, sin, pos, blocks, offsets, pool = _case(0, torch.float16)
    q, k, v = rope_write_prefill(qkv, cos, sin, pos, blocks, offsets, pool[:, 0, 0], pool[:, 0, 1])
    assert q.shape == (H, 0, D) and k.shape == v.shape == (KVH, 0, D)
