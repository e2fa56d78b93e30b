"""The native decode layer loop (kernels/decode_layers.py) against the model's per-op forward.

The contract: a step of decode rows through the loop is bit for bit the per-op step — the same logits and
the same K/V written to the pool — for packed (Q8_0, Q4_0, Q4_1) and fp32 weights, with a QKV bias, an fp16
KV cache, verification rows of one sequence beside single rows of others, and a self-draft's truncated
model; a step the loop does not take (prefill chunks, too many rows) runs per op; a refused slot raises
the per-op path's error and writes nothing. `silu_mul`, the activation both paths share, is torch's
within a few ulp and does not depend on where a value sits in its row.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from deepinfer.config.engine import EngineConfig
from deepinfer.config.kv import KvSpec
from deepinfer.engine.attention import Segment, layout
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.models.registry import build_model
from deepinfer.kernels import build, decode_layers, paged_attention
from deepinfer.kernels.decode_layers import DecodeStack, silu_mul, silu_mul_reference
from deepinfer.loading.weights import load_model_weights
from tests.engine.oracle import random_tokens
from tests.unit.test_gguf import _write_tiny_gguf

pytestmark = pytest.mark.skipif(not decode_layers.native_available(), reason="no C compiler for the kernel")

BLOCK = 4
CONTEXTS = (5, 12, 1)  # three sequences' prompt lengths before the decode step


def _model(tiny_hf_model, tmp_path: Path, weights: str, architecture: str = "llama"):  # type: ignore[no-untyped-def]
    if weights == "fp32":
        loaded = load_model_weights(tiny_hf_model(architecture).path)
    else:
        path = tmp_path / f"tiny-{architecture}-{weights}.gguf"
        _write_tiny_gguf(path, tiny_hf_model(architecture), T[weights])
        loaded = load_model_weights(path, "native")
    return build_model(loaded.config, loaded.state_dict, 128), loaded.config


def _per_op(model) -> None:  # type: ignore[no-untyped-def]
    model.use_decode_loop(False)


def _prefilled(model, config, kv_dtype: str):  # type: ignore[no-untyped-def]
    """A pool holding the CONTEXTS prompts (prefilled per op), and each sequence's tokens and blocks."""
    spec = KvSpec.for_model(config, BLOCK, kv_dtype)
    kv = spec.allocate(32)
    seqs, next_block = [], 1
    for i, n in enumerate(CONTEXTS):
        tokens = random_tokens(n, 100 + i, config.vocab_size)
        blocks = list(range(next_block, next_block + 6))
        next_block += 6
        step = layout([Segment(tokens, 0, blocks, num_logits=1)], BLOCK)
        with torch.inference_mode():
            model.forward(step.input_ids, step.positions, kv, step.meta, step.logits_rows)
        seqs.append((tokens, blocks))
    return kv, seqs


def _decode_step(seqs, vocab: int, verify: int):  # type: ignore[no-untyped-def]
    """Sequence 0 verifies `verify` rows (a speculative step), the others decode one token each."""
    segs = []
    for i, (tokens, blocks) in enumerate(seqs):
        n = verify if i == 0 else 1
        segs.append(Segment(random_tokens(n, 200 + i, vocab), len(tokens), blocks, rows=True, num_logits=n))
    return layout(segs, BLOCK)


def _spy(stack: DecodeStack) -> list:
    """What each of `stack.run`'s calls returns, from now on."""
    ran: list = []
    run = stack.run

    def spied(*args):  # type: ignore[no-untyped-def]
        ran.append(run(*args))
        return ran[-1]

    stack.run = spied  # type: ignore[method-assign]
    return ran


def _both_ways(model, config, kv_dtype: str, verify: int):  # type: ignore[no-untyped-def]
    """(logits, pool) of the step through the loop and per op, from the same prefilled pool."""
    kv, seqs = _prefilled(model, config, kv_dtype)
    step = _decode_step(seqs, config.vocab_size, verify)
    results = []
    for loop in (True, False):
        pool = kv.clone()
        if loop:
            model.use_decode_loop(True)
            stack = model.decode_stack()
            assert stack is not None
            ran = _spy(stack)
        else:
            _per_op(model)
        with torch.inference_mode():
            results.append((model.forward(step.input_ids, step.positions, pool, step.meta, step.logits_rows), pool))
        if loop:
            assert len(ran) == 1 and ran[0] is not None  # the loop took the step
    model.use_decode_loop(True)
    return results, kv


@pytest.mark.parametrize("weights", ["fp32", "Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_the_loop_is_the_per_op_step_to_the_bit(tiny_hf_model, tmp_path, weights, kv_dtype):
    model, config = _model(tiny_hf_model, tmp_path, weights)
    for verify in (1, 5):
        ((loop_logits, loop_kv), (op_logits, op_kv)), before = _both_ways(model, config, kv_dtype, verify)
        assert loop_logits.shape == (verify + len(CONTEXTS) - 1, config.vocab_size)
        assert torch.equal(loop_logits, op_logits)
        assert torch.equal(loop_kv, op_kv) and not torch.equal(loop_kv, before)  # the step stored its K/V


def test_a_qkv_bias_is_added_as_the_per_op_path_adds_it(tiny_hf_model, tmp_path):
    model, config = _model(tiny_hf_model, tmp_path, "fp32", "qwen2")
    assert model.layers[0].qkv_bias is not None
    ((loop_logits, loop_kv), (op_logits, op_kv)), _ = _both_ways(model, config, "float32", 3)
    assert torch.equal(loop_logits, op_logits) and torch.equal(loop_kv, op_kv)


def test_a_truncated_model_binds_its_own_layers(tiny_hf_model, tmp_path):
    model, config = _model(tiny_hf_model, tmp_path, "Q8_0")
    full = model.decode_stack()
    short = model.truncated(1)
    assert short.decode_stack() is not None and short.decode_stack().num_layers == 1
    assert model.decode_stack() is full and full.num_layers == config.num_layers
    ((loop_logits, _), (op_logits, _)), _ = _both_ways(short, short.config, "float32", 2)
    assert torch.equal(loop_logits, op_logits)


def test_steps_the_loop_does_not_take_run_per_op(tiny_hf_model, tmp_path, monkeypatch):
    model, config = _model(tiny_hf_model, tmp_path, "Q4_1")
    stack = model.decode_stack()
    kv, seqs = _prefilled(model, config, "float32")
    x = torch.zeros(2, stack.hidden)
    tokens, blocks = seqs[1]
    cos, sin = model.rotary.cos, model.rotary.sin
    # A prefill chunk in the step.
    mixed = layout([Segment([3], len(tokens), blocks, num_logits=1), Segment([4, 5], 0, [20, 21], num_logits=1)],
                   BLOCK)
    assert stack.run(torch.zeros(3, stack.hidden), mixed.positions, kv, mixed.meta, cos, sin, model.scale, 1e-6,
                     model._q_dim) is None
    # More rows than the small-row kernels take.
    monkeypatch.setattr(DecodeStack, "max_rows", lambda self: 1)
    rows = layout([Segment([3, 4], len(tokens), blocks, rows=True, num_logits=2)], BLOCK)
    assert stack.run(x, rows.positions, kv, rows.meta, cos, sin, model.scale, 1e-6, model._q_dim) is None
    assert torch.equal(x, torch.zeros(2, stack.hidden))
    # ...and the model's forward then takes the per-op path, with the same logits.
    with torch.inference_mode():
        via_forward = model.forward(rows.input_ids, rows.positions, kv.clone(), rows.meta, rows.logits_rows)
        _per_op(model)
        per_op = model.forward(rows.input_ids, rows.positions, kv.clone(), rows.meta, rows.logits_rows)
    assert torch.equal(via_forward, per_op)


def test_a_model_with_a_non_dense_mlp_has_no_loop(tiny_hf_model, tmp_path):
    model, _ = _model(tiny_hf_model, tmp_path, "fp32")
    model.layers[1].mlp = lambda h: h
    model.use_decode_loop(True)
    assert model.decode_stack() is None


def test_a_refused_slot_raises_and_writes_nothing(tiny_hf_model, tmp_path):
    model, config = _model(tiny_hf_model, tmp_path, "Q4_0")
    kv, seqs = _prefilled(model, config, "float32")
    step = _decode_step(seqs, config.vocab_size, 1)
    step.meta.slot_blocks[1] = kv.shape[0]  # past the pool
    before = kv.clone()
    with pytest.raises(ValueError, match="outside"), torch.inference_mode():
        model.forward(step.input_ids, step.positions, kv, step.meta, step.logits_rows)
    assert torch.equal(kv, before)


def test_silu_mul_is_torchs_within_a_few_ulp():
    torch.manual_seed(0)
    for width in (2, 14, 16, 96, 1536, 3074):
        gu = torch.randn(5, width) * 6
        ours, ref = silu_mul(gu), silu_mul_reference(gu)
        assert ours.shape == (5, width // 2)
        torch.testing.assert_close(ours, ref, rtol=3e-7 * 4, atol=1e-30)
    gate = [-200.0, -88.0, -87.0, -20.0, -1e-30, 0.0, -0.0, 1e-30, 20.0, 87.0, 89.0, 200.0]
    edges = torch.tensor([gate + [1.0] * 12])
    torch.testing.assert_close(silu_mul(edges), F.silu(edges[:, :12]) * edges[:, 12:], rtol=1e-6, atol=1e-30)


def test_silu_mul_of_a_value_does_not_depend_on_its_column():
    torch.manual_seed(1)
    g, u = torch.randn(40) * 8, torch.randn(40)
    wide = silu_mul(torch.cat([g, u]).unsqueeze(0))[0]  # vector lanes for most columns
    one_by_one = torch.cat([silu_mul(torch.stack([g[i], u[i]]).unsqueeze(0))[0] for i in range(40)])  # scalar tail
    assert torch.equal(wide, one_by_one)
    strided = torch.cat([g, u, torch.zeros(3)]).repeat(2, 1)[:, :80]  # rows 83 floats apart
    assert torch.equal(silu_mul(strided)[1], wide)


def test_the_stack_keeps_the_tensors_it_points_at_alive(tiny_hf_model, tmp_path):
    model, _ = _model(tiny_hf_model, tmp_path, "fp32")
    stack = model.decode_stack()
    held = weakref.ref(model.layers[0].o_proj)
    model.layers[0].o_proj = model.layers[0].o_proj.clone()  # the model lets go of the tensor the loop points at
    gc.collect()
    assert held() is not None and stack is model.decode_stack()
    del stack
    model.use_decode_loop(True)
    gc.collect()
    assert held() is None


def test_a_build_without_avx2_gives_the_same_activation_bits():
    compiler = build.find_compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    loader = decode_layers._loader
    lib, fns = loader.load(loader.build_one(compiler, build.compile_flags(openmp=True, simd=False)))
    assert lib.dk_has_avx2() == 0
    torch.manual_seed(2)
    gu = torch.randn(3, 2 * 77) * 10
    out = torch.empty(3, 77)
    assert fns["silu_mul"](gu.data_ptr(), gu.stride(0), out.data_ptr(), 77, 3, 77) == 0
    assert torch.equal(out, silu_mul(gu))


def test_a_pool_of_other_heads_is_refused_not_overrun(tiny_hf_model, tmp_path):
    model, config = _model(tiny_hf_model, tmp_path, "Q8_0")
    kv, seqs = _prefilled(model, config, "float32")
    step = _decode_step(seqs, config.vocab_size, 2)
    narrow = kv[:, :, :, :, :1].contiguous()  # one KV head where the model has two
    with pytest.raises(ValueError, match="widths"), torch.inference_mode():
        model.forward(step.input_ids, step.positions, narrow, step.meta, step.logits_rows)


def test_no_loop_without_the_attention_kernel(tiny_hf_model, tmp_path, monkeypatch):
    model, _ = _model(tiny_hf_model, tmp_path, "fp32")
    monkeypatch.setattr(paged_attention, "fused_decode_entry_point", lambda dtype: 0)
    model.use_decode_loop(True)
    assert model.decode_stack() is None  # the per-op path (and its torch fallback) takes every step


def test_the_engine_config_turns_the_loop_off_for_its_model(tiny_hf_model):
    """`EngineConfig.decode_loop` is the one switch (the launcher maps DEEPINFER_DECODE_LOOP=0 onto it): an engine
    built with it off runs its model per op, and one built by default binds the loop."""
    loaded = load_model_weights(tiny_hf_model("llama").path)
    on = LLMEngine(loaded, None, EngineConfig(block_size=BLOCK, num_kv_blocks=16))
    off = LLMEngine(load_model_weights(tiny_hf_model("llama").path), None,
                    EngineConfig(block_size=BLOCK, num_kv_blocks=16, decode_loop=False))
    assert on.runner.model.decode_stack() is not None
    assert off.runner.model.decode_stack() is None
