"""SmolLM2-135M-Instruct from its GGUF (Q4_1 + Q8_0, dequantised) against transformers holding the
same dequantised weights: greedy outputs token for token, with ample memory, forced chunked prefill
and forced preemption, and logits within a stated tolerance."""

from __future__ import annotations

import pytest
import torch

from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from tests.engine.oracle import assert_same_greedy, hf_logits, smollm2_case
from tests.engine.test_oracle_tiny import run_staggered

pytestmark = pytest.mark.smollm2

NEW_TOKENS = 32
QUESTIONS = [
    "Hi!",
    "What is 17 * 23?",
    "Name three primary colours.",
    "Write a Python function that reverses a string.",
    "Translate 'good morning' into French and Spanish.",
    "Explain in two sentences why the sky is blue.",
    "List the planets of the solar system in order from the sun, with one fact about each.",
    "Summarise the plot of Romeo and Juliet for a ten-year-old, in a short paragraph without spoilers "
    "about the ending, and suggest one question to discuss afterwards.",
    "用一句话介绍一下长城。",
]
MODES = {
    "ample": dict(kv_cache_bytes=256 * 1024 * 1024, max_num_batched_tokens=2048),
    "chunked": dict(kv_cache_bytes=256 * 1024 * 1024, max_num_batched_tokens=40),
    # 24 blocks of 16 tokens for 9 sequences of 40-110 tokens: preemption is certain.
    "preempt": dict(num_kv_blocks=24, max_num_batched_tokens=2048),
}


@pytest.fixture(scope="module")
def smollm2(smollm2_oracle):
    return smollm2_case(smollm2_oracle, QUESTIONS, NEW_TOKENS)


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_transformers(smollm2, mode):
    loaded, tok, hf, prompts, refs = smollm2
    engine = LLMEngine(loaded, tok, EngineConfig(**MODES[mode]))
    free = engine.num_free_blocks
    ours = run_staggered(engine, prompts)
    for i, p in enumerate(prompts):
        assert_same_greedy(hf, p, ours[i], refs[i])
    assert engine.num_free_blocks == free
    if mode == "preempt":  # victims swapped to host memory and back (the default where a copy is cheaper)
        assert engine.stats.num_preemptions > 0 and engine.stats.swap_in_blocks > 0


def test_logits_within_tolerance(smollm2):
    """fp32 logits (magnitudes ~10-30) agree to 1e-3 absolute at every prompt position."""
    loaded, tok, hf, prompts, refs = smollm2
    engine = LLMEngine(loaded, tok, EngineConfig(kv_cache_bytes=64 * 1024 * 1024))
    tokens = prompts[-2] + refs[-2]
    ours = engine.prompt_logits(tokens)
    ref = hf_logits(hf, tokens)
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=0)


def test_logits_within_tolerance_on_amx_tiles(smollm2, monkeypatch):
    """A prompt of 128+ tokens in one chunk: on an AMX CPU its fp32 projections run on the tiles
    (dense_amx.h, six bf16 piece products per fp32 product) and the logits still agree to 1e-3."""
    from deepinfer.engine.models import linear as linear_mod
    from deepinfer.kernels import dense_linear

    if not dense_linear.amx_available():
        pytest.skip("no AMX-BF16 tiles here")
    loaded, tok, hf, prompts, refs = smollm2
    tokens = [t for i in (-1, -2, -3) for t in prompts[i] + refs[i]]
    assert len(tokens) >= dense_linear.AMX_MIN_ROWS
    rows = []
    real = linear_mod.dense_linear_amx
    monkeypatch.setattr(linear_mod, "dense_linear_amx", lambda x, *a: rows.append(x.shape[0]) or real(x, *a))
    engine = LLMEngine(loaded, tok, EngineConfig(kv_cache_bytes=64 * 1024 * 1024))
    ours = engine.prompt_logits(tokens)
    assert rows and max(rows) == len(tokens)
    ref = hf_logits(hf, tokens)
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=0)


def test_chat_answer_is_sensible(smollm2):
    loaded, tok, hf, prompts, refs = smollm2
    engine = LLMEngine(loaded, tok, EngineConfig(kv_cache_bytes=64 * 1024 * 1024))
    from deepinfer.engine.request import SamplingParams

    out = engine.generate([tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])],
                          SamplingParams(max_tokens=24))[0]
    assert "Paris" in out.text


@pytest.mark.parametrize("mode", ["chunked", "ample"])
def test_native_weights_match_transformers(smollm2, smollm2_path, mode):
    """The GGUF's Q4_1/Q8_0 blocks kept packed (`weights="native"`, what a CPU engine uses by default):
    they dequantise bit for bit to the fp32 load's weights, and the engine computing from the blocks
    gives transformers' greedy tokens on those weights and logits within the same tolerance. Chunks of
    40 rows take the register kernels; "ample" batches whole prompts, which on an AMX CPU take the tiles."""
    from deepinfer.loading.packed_weights import PackedWeight, dequantized
    from deepinfer.loading.weights import load_model_weights

    loaded, tok, hf, prompts, refs = smollm2
    native = load_model_weights(smollm2_path, "native")
    assert isinstance(native.state_dict["layers.0.q_proj"], PackedWeight)
    assert {n: w.format for n, w in native.state_dict.items() if n in ("embed_tokens", "layers.0.up_proj")} == \
        {"embed_tokens": "Q8_0", "layers.0.up_proj": "Q4_1"}
    for name, w in dequantized(native.state_dict).items():
        assert torch.equal(w, loaded.state_dict[name]), name
    engine = LLMEngine(native, tok, EngineConfig(**MODES[mode]))
    ours = run_staggered(engine, prompts)
    for i, p in enumerate(prompts):
        assert_same_greedy(hf, p, ours[i], refs[i])
    tokens = prompts[-2] + refs[-2]
    ref = hf_logits(hf, tokens)
    torch.testing.assert_close(engine.prompt_logits(tokens), ref, atol=1e-3, rtol=0)
