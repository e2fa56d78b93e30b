"""The attention backend: chosen once per model runner (and per draft proposer) from the engine config, carried to
the model in every step's metadata, and the only thing that decides native kernels, torch ops or the C layer loop."""

from __future__ import annotations

import pytest
import torch

from deepinfer import kernels
from deepinfer.config.engine import EngineConfig
from deepinfer.engine.attention import Segment, layout
from deepinfer.engine.attention_backend import (
    NATIVE,
    TORCH,
    NativeAttention,
    TorchAttention,
    select_backend,
)
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import SamplingParams
from deepinfer.kernels import decode_layers
from deepinfer.kernels.decode_layers import DecodeStack

pytestmark = pytest.mark.usefixtures("one_thread")
needs_native = pytest.mark.skipif(not (kernels.native_available() and decode_layers.native_available()),
                                  reason="native kernels not built")


def test_select_backend_follows_the_config_knobs():
    assert select_backend(EngineConfig(use_native_kernels=False)) is TORCH
    assert select_backend(EngineConfig(use_native_kernels=False, decode_loop=True)).decode_loop is False
    if kernels.native_available():
        assert select_backend(EngineConfig()) is NATIVE and NATIVE.decode_loop
        no_loop = select_backend(EngineConfig(decode_loop=False))
        assert isinstance(no_loop, NativeAttention) and no_loop.native and not no_loop.decode_loop


def test_layout_carries_the_backend_and_a_flag_picks_one():
    segs = [Segment([1], 3, [0]), Segment([1, 2, 3], 0, [1], num_logits=1)]
    assert layout(segs, 4).meta.backend is NATIVE
    backend = NativeAttention(decode_loop=False)
    meta = layout(segs, 4, backend).meta
    assert meta.backend is backend and meta.use_native
    assert layout(segs, 4, False).meta.backend is TORCH and layout(segs, 4, True).meta.backend is NATIVE
    meta.use_native = False  # the flag is a view of the backend
    assert meta.backend is TORCH and not meta.use_native


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("loop", [True, False])
def test_the_runner_decides_once_and_every_step_runs_on_its_backend(tiny_llama, monkeypatch, native, loop):
    engine = LLMEngine(tiny_llama, None, EngineConfig(block_size=4, num_kv_blocks=64, use_native_kernels=native,
                                                      decode_loop=loop))
    runner = engine.runner
    assert runner.backend.decode_loop == (loop and runner.use_native)
    assert runner.use_native == (native and kernels.native_available())
    takes_loop = runner.use_native and loop and decode_layers.native_available()
    # The model's own switch follows the decision, so it tells what the engine's steps run.
    assert (runner.model.decode_stack() is not None) == takes_loop
    seen, ran = [], []
    forward = runner.model.forward

    def spy_forward(input_ids, positions, kv, meta, logits_rows):  # type: ignore[no-untyped-def]
        seen.append(meta.backend)
        return forward(input_ids, positions, kv, meta, logits_rows)

    def spy_run(self, *args):  # type: ignore[no-untyped-def]
        ran.append(1)
        return None  # decline: the per-op path computes the same step

    monkeypatch.setattr(runner.model, "forward", spy_forward)
    monkeypatch.setattr(DecodeStack, "run", spy_run)
    engine.generate([[5, 6, 7], [9]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert seen and all(b is runner.backend for b in seen)
    assert bool(ran) == takes_loop


@needs_native
def test_the_torch_backends_decode_rows_store_what_the_native_one_stores():
    """rope + write + decode attention of both backends: the same cache bits, attention to fp32 rounding."""
    torch.manual_seed(0)
    heads, kvh, D, bs = 4, 2, 32, 4
    k0 = torch.randn(8, bs, kvh, D)
    v0 = torch.randn(8, bs, kvh, D)
    step = layout([Segment([1], 5, [0, 1]), Segment([1, 1], 2, [2], rows=True)], bs)
    meta = step.meta
    qkv = torch.randn(3, (heads + 2 * kvh) * D)
    angles = torch.arange(16.0)[:, None] * torch.linspace(0.1, 1.0, D)[None]
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    results = []
    for backend in (NATIVE, TorchAttention()):
        k, v, out = k0.clone(), v0.clone(), torch.empty(3, heads, D)
        backend.rope_write_decode_attention(qkv.clone(), cos, sin, step.positions, meta.slot_blocks,
                                            meta.slot_offsets, k, v, meta.decode_block_tables,
                                            meta.decode_context_lens, D**-0.5, out)
        results.append((k, v, out))
    (k_n, v_n, o_n), (k_t, v_t, o_t) = results
    assert torch.equal(k_n, k_t) and torch.equal(v_n, v_t)
    torch.testing.assert_close(o_n, o_t, rtol=1e-5, atol=1e-5)


def test_a_self_draft_chooses_its_backend_from_the_config(tiny_llama):
    engine = LLMEngine(tiny_llama, None, EngineConfig(block_size=4, num_kv_blocks=64, speculative="self:1",
                                                      decode_loop=False))
    proposer = engine.speculator.proposer  # type: ignore[union-attr]
    assert proposer.backend.native == engine.runner.use_native and not proposer.backend.decode_loop
    assert proposer.model.decode_stack() is None
