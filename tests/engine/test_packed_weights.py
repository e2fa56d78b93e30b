"""Packed weights in the model (`EngineConfig.weights`): a GGUF file's Q8_0/Q4_0/Q4_1 projections kept in
their blocks ("native"), and a Hugging Face checkpoint quantised to Q8_0 on load ("q8_0").

The contract: a packed model computes exactly the dequantised weights' products (only the summation order
differs), so its oracle is transformers holding those dequantised weights — greedy equal token for token
(near-ties excepted, tests/engine/oracle.py) and logits within a tight tolerance — and the fp32 load of the
same file holds bit for bit the weights the packed load dequantises to.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from deepinfer.config.engine import EngineConfig
from deepinfer.config.model import ConfigError
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.models.linear import linear
from deepinfer.engine.request import SamplingParams
from deepinfer.loading.packed_weights import PackedWeight, dequantized, quantize_q8_0, resolve_weights_mode
from deepinfer.loading.weights import load_model_weights
from tests.engine.oracle import (
    assert_same_greedy,
    assert_whole,
    hf_greedy,
    hf_model_from_loaded,
    random_tokens,
    run_staggered,
)
from tests.unit.test_gguf import _write_tiny_gguf

QTYPES = [T.Q8_0, T.Q4_0, T.Q4_1]
NEW_TOKENS = 8
# Lengths around block (16) and kernel-path edges (2, 8, 32 rows); with a 24-token step budget the long
# prompts are prefilled in chunks, so the model sees 1..24-row products as well as single decode rows.
PROMPT_LENS = (1, 2, 3, 9, 16, 17, 31, 33, 70)


def _tiny_gguf(tiny_hf_model, tmp_path: Path, qtype: T, **overrides) -> Path:  # type: ignore[no-untyped-def]
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    _write_tiny_gguf(path, tiny_hf_model("llama", **overrides), qtype)
    return path


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_native_load_keeps_blocks_that_dequantise_to_the_fp32_load(tiny_hf_model, tmp_path, qtype, tied):
    path = _tiny_gguf(tiny_hf_model, tmp_path, qtype, tie_word_embeddings=tied)
    native, fp32 = load_model_weights(path, "native"), load_model_weights(path, "fp32")
    assert (native.weights, fp32.weights) == ("native", "fp32")
    packed = {n for n, w in native.state_dict.items() if isinstance(w, PackedWeight)}
    two_d = {n for n, w in fp32.state_dict.items() if w.dim() == 2}
    assert packed == two_d and "embed_tokens" in packed and ("lm_head" in packed) != tied
    assert {native.state_dict[n].format for n in packed} == {qtype.name}
    # Bit for bit, Q/K rows included (their rotary order is undone on the packed rows).
    for name, w in dequantized(native.state_dict).items():
        assert torch.equal(w, fp32.state_dict[name]), name
    # Packed blocks take (bytes per block) / (32 * 4) of fp32's room.
    assert sum(native.state_dict[n].nbytes for n in packed) < sum(fp32.state_dict[n].numel() * 4 for n in packed) / 3
    # A mesh must not mix the two (their KV differs in rounding): the fingerprints tell them apart.
    assert native.fingerprint != fp32.fingerprint


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_native_engine_matches_transformers_on_the_dequantised_weights(tiny_hf_model, tmp_path, qtype):
    path = _tiny_gguf(tiny_hf_model, tmp_path, qtype)
    loaded = load_model_weights(path, "native")
    hf = hf_model_from_loaded(loaded.config, dequantized(loaded.state_dict))
    prompts = [random_tokens(n, n, loaded.config.vocab_size) for n in PROMPT_LENS]
    engine = LLMEngine(loaded, None, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=24))
    outs = run_staggered(engine, prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert_same_greedy(hf, prompt, out.token_ids, hf_greedy(hf, prompt, NEW_TOKENS))
    assert_whole(engine)
    # Logits at every prompt position (one 70-row prefill: the dequantise-then-GEMM path).
    tokens = prompts[-1]
    with torch.inference_mode():
        ref = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(engine.prompt_logits(tokens), ref, atol=1e-4, rtol=1e-4)


def test_q8_0_on_load_serves_a_hugging_face_checkpoint(tiny_hf_model):
    tiny = tiny_hf_model("llama")
    loaded = load_model_weights(tiny.path, "q8_0")
    assert loaded.weights == "q8_0"
    assert all(isinstance(loaded.state_dict[n], PackedWeight) for n in ("layers.0.q_proj", "lm_head"))
    assert not isinstance(loaded.state_dict["layers.0.input_norm"], PackedWeight)
    hf = hf_model_from_loaded(loaded.config, dequantized(loaded.state_dict))
    prompts = [random_tokens(n, n, loaded.config.vocab_size) for n in PROMPT_LENS[:5]]
    engine = LLMEngine(loaded, None, EngineConfig(num_kv_blocks=64))
    outs = run_staggered(engine, prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert_same_greedy(hf, prompt, out.token_ids, hf_greedy(hf, prompt, NEW_TOKENS))
    assert_whole(engine)


def test_quantize_q8_0_is_ggufs_q8_0():
    """Same blocks as the gguf package's reference quantiser (up to the scale's reciprocal rounding,
    which may move a value by one step), and dequantisation within half a step of the input."""
    from gguf import quants

    torch.manual_seed(0)
    w = torch.randn(8, 96) * torch.rand(8, 1) * 3
    w[0, :32] = 0.0  # an all-zero block: scale 0, no division by it
    ours = quantize_q8_0(w)
    ref = torch.from_numpy(quants.quantize(w.numpy(), T.Q8_0)).reshape(8, -1)
    assert ours.blocks.shape == ref.shape and ours.format == "Q8_0"
    diff = (ours.blocks.view(-1, 34)[:, 2:].view(torch.int8).int() - ref.view(-1, 34)[:, 2:].view(torch.int8).int())
    assert diff.abs().max() <= 1
    step = w.reshape(8, 3, 32).abs().amax(-1, keepdim=True) / 127
    assert ((ours.dequantize().reshape(8, 3, 32) - w.reshape(8, 3, 32)).abs() <= step * 0.5 + 1e-3 * step).all()
    assert torch.equal(ours.dequantize()[0, :32], torch.zeros(32))


def test_weights_modes_resolve_and_refuse(tiny_hf_model, tmp_path):
    gguf = _tiny_gguf(tiny_hf_model, tmp_path, T.Q8_0)
    tiny = tiny_hf_model("llama")
    config = load_model_weights(gguf).config
    assert resolve_weights_mode("auto", gguf, config, "cpu") == "native"
    assert resolve_weights_mode("auto", gguf, config, "cuda:0") == "fp32"
    assert resolve_weights_mode("auto", tiny.path, config, "cpu") == "fp32"
    with pytest.raises(ConfigError, match="q8_0"):
        load_model_weights(tiny.path, "native")
    with pytest.raises(ConfigError, match="weights must be one of"):
        EngineConfig(weights="int4")
    assert load_model_weights(gguf, "auto").weights == "native"


def test_packed_modes_are_refused_for_latent_attention():
    from types import SimpleNamespace

    mla = SimpleNamespace(architecture="deepseek_v3", mla=object())  # all resolve_weights_mode reads
    for mode in ("native", "q8_0"):
        with pytest.raises(ConfigError, match="latent attention"):
            resolve_weights_mode(mode, Path("m.gguf"), mla, "cpu")  # type: ignore[arg-type]
    assert resolve_weights_mode("auto", Path("m.gguf"), mla, "cpu") == "fp32"  # type: ignore[arg-type]


def test_in_one_arena_keeps_values_order_and_aliases() -> None:
    from deepinfer.engine.models.linear import in_one_arena

    g = torch.Generator().manual_seed(11)
    a = quantize_q8_0(torch.randn(64, 96, generator=g))
    b = quantize_q8_0(torch.randn(5, 32, generator=g))
    dense = torch.randn(3, 4, generator=g)
    moved = in_one_arena([a, dense, b, a])
    assert moved[1] is dense  # fp32 tensors are left where they are
    assert moved[0] is moved[3]  # one weight listed twice (a tied embedding) is copied once
    for old, new in ((a, moved[0]), (b, moved[2])):
        assert isinstance(new, PackedWeight) and new is not old
        assert (new.format, new.out_features, new.in_features) == (old.format, old.out_features, old.in_features)
        assert torch.equal(new.blocks, old.blocks) and new.blocks.is_contiguous()
    # in the order given, each starting on a page
    assert moved[2].blocks.data_ptr() > moved[0].blocks.data_ptr()
    assert moved[0].blocks.data_ptr() % 4096 == 0 and moved[2].blocks.data_ptr() % 4096 == 0
    x = torch.randn(3, 96, generator=g)
    assert torch.equal(linear(x, moved[0]), linear(x, a))


def test_model_weights_share_one_arena_in_step_order(tiny_hf_model) -> None:  # type: ignore[no-untyped-def]
    loaded = load_model_weights(tiny_hf_model("llama").path, "q8_0")
    model = LLMEngine(loaded, None, EngineConfig(num_kv_blocks=8)).runner.model
    ptrs = []
    for layer in model.layers:
        ptrs += [layer.qkv.blocks.data_ptr(), layer.o_proj.blocks.data_ptr(), layer.mlp.gate_up.blocks.data_ptr(),
                 layer.mlp.down.blocks.data_ptr()]
    ptrs.append(model.lm_head.blocks.data_ptr())
    assert ptrs == sorted(ptrs) and ptrs[-1] - ptrs[0] < 2 * sum(
        w.nbytes for w in loaded.state_dict.values() if isinstance(w, PackedWeight))
