"""The fused decode step (`rope_write_decode_attention`: rotary, K/V store and decode attention in one
native call) against the three torch steps it replaces, bit for bit; its argument checks; and the
engine generating the same tokens with it as on the pure-torch path."""

from __future__ import annotations

import pytest
import torch

from deepinfer import kernels
from deepinfer.config.engine import EngineConfig
from deepinfer.config.model import ModelConfig
from deepinfer.engine.attention import Segment, layout, paged_attention, rope_attention
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.models.rope import RotaryTable, apply_rotary
from deepinfer.engine.request import SamplingParams
from deepinfer.kernels import (
    attention_amx,
    native_available,
    paged_decode_attention,
    rope_write_decode_attention,
    rope_write_decode_attention_reference,
)
from deepinfer.kernels import paged_attention as pa
from deepinfer.kernels.rope_write import as_cached, write_kv

needs_native = pytest.mark.skipif(
    not native_available(),
    reason=f"native paged attention kernel could not be built: {kernels.native_unavailable_reason()}",
)

MAX_POSITIONS = 2048
LAYERS, LAYER = 3, 1
# Sequences of a step as (position of the first row, rows): several rows of one sequence are
# speculative verification rows; contexts start at 1, cross block boundaries and reach 1300 tokens:
# long enough for the kernel to split a context into partitions and run two threads, which must
# not change a bit (one sequence of 1300: few enough items that a thread-count-dependent split
# would show).
BATCHES = {
    1: [(1299, 1)],
    3: [(15, 1), (299, 2)],
    7: [(0, 1), (31, 3), (1300, 3)],
}
# (heads, kv_heads, head_dim): GQA 3, MHA, and a head_dim the vector loops do not take.
SHAPES = [(9, 3, 64), (4, 4, 64), (6, 2, 36)]


def _rotary(head_dim: int) -> RotaryTable:
    cfg = ModelConfig(architecture="llama", vocab_size=8, hidden_size=head_dim, intermediate_size=8, num_layers=1,
                      num_heads=1, num_kv_heads=1, head_dim=head_dim, max_position_embeddings=MAX_POSITIONS)
    return RotaryTable(cfg, MAX_POSITIONS)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    diff = (_bits(a) != _bits(b)).sum().item()
    assert diff == 0, f"{diff} of {a.numel()} values differ in their bits"


def _step(seqs, heads, kv_heads, head_dim, block_size, kv_dtype, seed=0, chunks=()):
    """A step of decode rows for `seqs` (then prefill chunks for `chunks`, same format) over shuffled
    blocks of a multi-layer KV tensor holding random old context; returns (qkv, layout, kv)."""
    g = torch.Generator().manual_seed(seed)
    wanted = [(start, n, True) for start, n in seqs] + [(start, n, False) for start, n in chunks]
    need = [-(-(start + n) // block_size) for start, n, _ in wanted]
    num_blocks = sum(need) + 5
    perm = torch.randperm(num_blocks, generator=g).tolist()
    segments, used = [], 0
    for (start, n, rows), nb in zip(wanted, need):
        segments.append(Segment(token_ids=[0] * n, start=start, block_ids=perm[used : used + nb], rows=rows))
        used += nb
    step = layout(segments, block_size)
    kv = torch.randn(num_blocks, LAYERS, 2, block_size, kv_heads, head_dim, generator=g).to(kv_dtype)
    qkv = torch.randn(len(step.input_ids), (heads + 2 * kv_heads) * head_dim, generator=g)
    return qkv, step, kv


def _torch_steps(qkv, step, kv, rotary, heads, kv_heads, head_dim, scale):
    """What the model did before the fused call: apply_rotary, write_kv, paged_decode_attention."""
    B = step.meta.num_decode
    cos, sin = rotary.lookup(step.positions[:B])
    qk = apply_rotary(qkv[:B, : (heads + kv_heads) * head_dim].view(B, -1, head_dim), cos, sin)
    v = qkv[:B, (heads + kv_heads) * head_dim :].view(B, kv_heads, head_dim)
    write_kv(kv[:, LAYER, 0], kv[:, LAYER, 1], qk[:, heads:], v, step.meta.slot_blocks[:B], step.meta.slot_offsets[:B])
    out = paged_decode_attention(qk[:, :heads].contiguous(), kv[:, LAYER, 0], kv[:, LAYER, 1],
                                 step.meta.decode_block_tables, step.meta.decode_context_lens, scale)
    return qk, out


def _fused(fn, qkv, step, kv, rotary, scale, threads=None):
    old = torch.get_num_threads()
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        m = step.meta
        return fn(qkv, rotary.cos, rotary.sin, step.positions, m.slot_blocks, m.slot_offsets, kv[:, LAYER, 0],
                  kv[:, LAYER, 1], m.decode_block_tables, m.decode_context_lens, scale)
    finally:
        torch.set_num_threads(old)


@needs_native
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("batch", list(BATCHES))
def test_fused_equals_the_three_torch_steps(batch, heads, kv_heads, head_dim, block_size, kv_dtype):
    rotary, scale = _rotary(head_dim), head_dim**-0.5
    qkv, step, kv = _step(BATCHES[batch], heads, kv_heads, head_dim, block_size, kv_dtype)
    assert step.meta.num_decode == batch
    kv_ref, qkv_in = kv.clone(), qkv.clone()
    qk_ref, out_ref = _torch_steps(qkv, step, kv_ref, rotary, heads, kv_heads, head_dim, scale)

    results = []
    for threads in (1, 2):
        q_run, kv_run = qkv_in.clone(), kv.clone()
        out = _fused(rope_write_decode_attention, q_run, step, kv_run, rotary, scale, threads)
        qk_dim = (heads + kv_heads) * head_dim
        _assert_bits_equal(q_run[:, :qk_dim], qk_ref.reshape(batch, -1))  # rotated in place, as apply_rotary
        _assert_bits_equal(q_run[:, qk_dim:], qkv_in[:, qk_dim:])  # v untouched
        _assert_bits_equal(kv_run, kv_ref)  # every layer: this layer's slots as write_kv, the rest untouched
        _assert_bits_equal(out, out_ref)
        results.append(out)
    _assert_bits_equal(results[0], results[1])

    # The torch fallback: the same rotation and cache bits, attention within float tolerance.
    q_run, kv_run = qkv_in.clone(), kv.clone()
    out = _fused(rope_write_decode_attention_reference, q_run, step, kv_run, rotary, scale)
    _assert_bits_equal(q_run[:, : (heads + kv_heads) * head_dim], qk_ref.reshape(batch, -1))
    _assert_bits_equal(q_run[:, (heads + kv_heads) * head_dim :], qkv_in[:, (heads + kv_heads) * head_dim :])
    _assert_bits_equal(kv_run, kv_ref)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_rope_attention_mixed_step_matches_torch_path(kv_dtype):
    """Decode rows (one of them verification rows) and prefill chunks in one step: the fused path
    stores the same cache bits and gives the pure-torch path's chunk rows: bit for bit where they take SDPA
    on both paths, to fp32 rounding where the native path runs them on AMX tiles."""
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    rotary, scale = _rotary(head_dim), head_dim**-0.5
    qkv, step, kv = _step([(40, 1), (17, 3)], heads, kv_heads, head_dim, block_size, kv_dtype,
                          chunks=[(0, 20), (33, 12)])
    nd = step.meta.num_decode
    assert nd == 4 and len(step.meta.prefills) == 2
    runs = {}
    for native in (True, False):
        step.meta.use_native = native
        q_run, kv_run = qkv.clone(), kv.clone()
        o = rope_attention(q_run, step.positions, rotary, kv_run[:, LAYER, 0], kv_run[:, LAYER, 1], step.meta, scale)
        runs[native] = o, kv_run
    (o_native, kv_native), (o_torch, kv_torch) = runs[True], runs[False]
    _assert_bits_equal(kv_native, kv_torch)
    if attention_amx.supports(head_dim, heads, kv_heads):  # chunks on AMX tiles: SDPA's values to fp32 rounding
        torch.testing.assert_close(o_native[nd:], o_torch[nd:], rtol=1e-5, atol=1e-5)
    else:
        _assert_bits_equal(o_native[nd:], o_torch[nd:])
    torch.testing.assert_close(o_native[:nd], o_torch[:nd], rtol=1e-5, atol=1e-5)

    # The torch path is what llama.py ran before: rotate all rows, write_kv, paged_attention.
    kv_old = kv.clone()
    T = qkv.shape[0]
    cos, sin = rotary.lookup(step.positions)
    qk = apply_rotary(qkv[:, : (heads + kv_heads) * head_dim].view(T, -1, head_dim), cos, sin)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(T, kv_heads, head_dim)
    write_kv(kv_old[:, LAYER, 0], kv_old[:, LAYER, 1], qk[:, heads:], v, step.meta.slot_blocks, step.meta.slot_offsets)
    o_old = paged_attention(qk[:, :heads].contiguous(), as_cached(qk[:, heads:], kv_dtype), as_cached(v, kv_dtype),
                            kv_old[:, LAYER, 0], kv_old[:, LAYER, 1], step.meta, scale)
    _assert_bits_equal(kv_old, kv_torch)
    _assert_bits_equal(o_old, o_torch)


def _special_floats(n: int) -> torch.Tensor:
    """fp32 values whose fp16 rounding is delicate: ties (to even, both ways), overflow, the largest
    half, subnormal halves and underflow, signed zeros."""
    vals = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11), 65504.0, 65519.0, 65520.0, 1e6, -1e6,
                         2**-24, 2**-25, 3 * 2**-26, 2**-26, 6e-8, 1e-9, 0.0, -0.0, 2**-14 - 2**-25,
                         0.1, -3.14159, 1234.5678])
    return vals.repeat(-(-n // len(vals)))[:n]


@needs_native
@pytest.mark.parametrize("features", [(), ("avx2", "fma"), None], ids=["plain-c", "avx2-no-f16c", "default"])
def test_fp16_store_rounds_like_torch(monkeypatch, features):
    """The fp16 store rounds to nearest even as torch does, with F16C and with the scalar conversion
    of builds without it (ties, overflow to inf, subnormals)."""
    if features is not None:
        flags = pa.build.compile_flags(openmp=True, simd=bool(features), features=features or ("avx2",))
        lib, fns = pa._load(pa._build(pa._find_compiler(), flags))
        assert not lib.pa_has_f16c()
        monkeypatch.setattr(pa._loader, "fns", fns)
    heads, kv_heads, head_dim, block_size = 4, 2, 64, 4
    rotary, scale = _rotary(head_dim), head_dim**-0.5
    qkv, step, kv = _step(BATCHES[3], heads, kv_heads, head_dim, block_size, torch.float16)
    kv_dim = kv_heads * head_dim
    qkv[:, -2 * kv_dim :] = _special_floats(qkv.shape[0] * 2 * kv_dim).view(qkv.shape[0], -1)
    kv_ref = kv.clone()
    _torch_steps(qkv.clone(), step, kv_ref, rotary, heads, kv_heads, head_dim, scale)
    _fused(rope_write_decode_attention, qkv, step, kv, rotary, scale)
    _assert_bits_equal(kv, kv_ref)
    if features is not None:  # the rest of a reduced build: same bits as the three steps on the same build
        qkv, step, kv = _step(BATCHES[7], 6, 2, 36, 5, torch.float16, seed=3)
        kv_ref = kv.clone()
        _, out_ref = _torch_steps(qkv.clone(), step, kv_ref, _rotary(36), 6, 2, 36, 0.2)
        out = _fused(rope_write_decode_attention, qkv, step, kv, _rotary(36), 0.2)
        _assert_bits_equal(kv, kv_ref)
        _assert_bits_equal(out, out_ref)


# --------------------------------------------------------------------------------------------
# Argument validation (both entry points); nothing is written when the arguments are refused.

ENTRY_POINTS = [
    pytest.param(rope_write_decode_attention, id="native", marks=needs_native),
    pytest.param(rope_write_decode_attention_reference, id="reference"),
]


def _args():
    rotary = _rotary(32)
    qkv, step, kv = _step([(5, 1), (9, 2)], 4, 2, 32, 4, torch.float32)
    m = step.meta
    return dict(qkv=qkv, cos=rotary.cos, sin=rotary.sin, positions=step.positions, slot_blocks=m.slot_blocks,
                slot_offsets=m.slot_offsets, k=kv[:, LAYER, 0], v=kv[:, LAYER, 1], block_tables=m.decode_block_tables,
                context_lens=m.decode_context_lens, scale=0.1, out=None)


@pytest.mark.parametrize("fn", ENTRY_POINTS)
@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a: {"qkv": a["qkv"].double()}, "qkv must be a 2-D float32"),
        (lambda a: {"k": a["k"].bfloat16(), "v": a["v"].bfloat16()}, "float32 or both float16"),
        (lambda a: {"v": a["v"].half()}, "float32 or both float16"),
        (lambda a: {"cos": a["cos"].double()}, "cos and sin must be float32"),
        (lambda a: {"sin": a["sin"][:, :16]}, "cos and sin must be float32"),
        (lambda a: {"positions": a["positions"].int()}, "positions must be a contiguous 1-D int64"),
        (lambda a: {"positions": a["positions"][:2]}, "at least 3 entries"),
        (lambda a: {"slot_offsets": a["slot_offsets"].int()}, "slot_offsets must be"),
        (lambda a: {"qkv": a["qkv"][:, :-32]}, r"not \(num_heads \+ 2 \* 2\) \* 32"),
        (lambda a: {"qkv": a["qkv"][:2]}, "qkv has 2 rows, block_tables 3"),
        (lambda a: {"k": a["k"].flatten(0, 1), "v": a["v"].flatten(0, 1)}, r"\[num_blocks, block_size"),
        (lambda a: {"k": a["k"][..., :30], "v": a["v"][..., :30]}, "contiguous"),
        (lambda a: {"block_tables": a["block_tables"].long()}, "block_tables must be a 2-D int32"),
        (lambda a: {"context_lens": a["context_lens"][:2]}, "context_lens must be contiguous int32"),
        (lambda a: {"out": torch.empty(3, 4, 16)}, "out must be float32"),
        (lambda a: {"positions": a["positions"] + (MAX_POSITIONS - 9)}, r"positions\[1\] = 2048 is outside the rotary"),
        (lambda a: {"positions": a["positions"] - 6}, r"positions\[0\] = -1 is outside the rotary"),
        (lambda a: {"slot_blocks": a["slot_blocks"] + 100}, "slot .* of row 0 is outside"),
        (lambda a: {"slot_offsets": a["slot_offsets"] + 4}, "slot .* of row 0 is outside"),
        (lambda a: {"context_lens": a["context_lens"] + 100}, r"context_lens\[0\]"),
    ],
)
def test_invalid_arguments(fn, mutate, match):
    args = _args()
    args.update(mutate(args))
    before = [t.clone() for t in (args["qkv"], args["k"], args["v"])]
    with pytest.raises(ValueError, match=match):
        fn(**args)
    for t, b in zip((args["qkv"], args["k"], args["v"]), before):
        _assert_bits_equal(t, b)


@needs_native
def test_empty_batch_and_out_rows_past_the_batch():
    args = _args()
    rows = args["qkv"].shape[0]
    out = torch.full((rows + 2, 4, 32), 7.0)
    rope_write_decode_attention(**{**args, "out": out})
    assert (out[rows:] == 7.0).all() and not (out[:rows] == 7.0).any()
    empty = rope_write_decode_attention(**{**args, "block_tables": args["block_tables"][:0],
                                           "context_lens": args["context_lens"][:0]})
    assert empty.shape == (0, 4, 32)


# --------------------------------------------------------------------------------------------
# End to end


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_engine_tokens_equal_the_torch_path(tiny_llama, kv_dtype):
    """Greedy generation under a small token budget (steps mixing decode rows and prefill chunks)
    gives the same tokens with the fused decode call as with the pure-torch path."""
    prompts = [[(7 * i + 3 * j) % 320 for j in range(n)] for i, n in enumerate([1, 5, 18, 33, 9])]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    tokens = {}
    for native in (True, False):
        engine = LLMEngine(tiny_llama, None, EngineConfig(block_size=4, num_kv_blocks=128, kv_cache_dtype=kv_dtype,
                                                          max_num_batched_tokens=16, use_native_kernels=native))
        assert engine.runner.use_native == (native and native_available())
        tokens[native] = [out.token_ids for out in engine.generate(prompts, params)]
    assert tokens[True] == tokens[False]
