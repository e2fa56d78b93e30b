"""DeepSeek's latent cache in fp16 (`EngineConfig(kv_cache_dtype="float16")`).

The latent is stored rounded to fp16 and widened to fp32 wherever it is read: by the absorbed decode (the
paged decode kernel's fp16 entry point, or its torch reference) and by the expanded prefill.

The models are test_oracle_deepseek's variants with every layer dense (first_k_dense_replace = all
layers): the same latent attention (low-rank or plain queries, YaRN, half-split rope, V2's biases), no
router. A router's top-k is discontinuous: where two experts' scores are within the fp16 perturbation of
the hidden state, rounding the cache picks the other expert and the logits jump (measured: up to 1.9 on
v3-qlora-dense1-yarn's MoE layers, 2.6e-3 on its all-dense twin), so oracle equality with routed experts
would test routing ties, not the cache.

Stated tolerance: |logits(fp16 cache) - logits(fp32 cache or transformers)| <= LOGITS_REL * max |logits|
(measured at most 7e-4 of the scale on these models, whose logits reach ~4; MLA's error is coherent
across heads, since every head's K and V come from the one rounded latent). Greedy outputs equal
transformers' on the oracle prompts except where the oracle's top-2 gap is below twice that bound (the
near-tie rule of tests/engine/oracle.py, with the fp16 cache's error in place of fp32's 1e-3).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.loading.weights import load_model_weights
from tests.engine import deepseek_models
from tests.engine.oracle import assert_whole, hf_top2_gap, memoised_greedy
from tests.engine.test_fp16_kv_cache import PATHS_TOL, decode_row_logits
from tests.engine.test_oracle_deepseek import BLOCK, MODES, NEW_TOKENS, prompts, run

LOGITS_REL = 1.5e-3
pytestmark = pytest.mark.usefixtures("one_thread")  # as in test_oracle_deepseek


@pytest.fixture(scope="module", params=list(deepseek_models.VARIANTS))
def dense_case(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    """(transformers model, our loaded weights, memoised transformers greedy) of the variant made all dense."""
    variant = request.param
    cls_name, kwargs = deepseek_models.VARIANTS[variant]
    dense = {**kwargs, "first_k_dense_replace": deepseek_models.COMMON["num_hidden_layers"]}
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(deepseek_models.VARIANTS, variant, (cls_name, dense))
        mp.setattr(deepseek_models, "TIED_LAYER", {})  # no router to tie
        hf = deepseek_models.build_hf_deepseek(variant, seed=sum(map(ord, variant)))
    assert all(not hasattr(layer.mlp, "experts") for layer in hf.model.layers)
    loaded = load_model_weights(deepseek_models.save(hf, tmp_path_factory.mktemp(variant)))
    return hf, loaded, memoised_greedy(hf, NEW_TOKENS)


def fp16_engine(loaded, **kw) -> LLMEngine:  # type: ignore[no-untyped-def]
    return LLMEngine(loaded, None, EngineConfig(block_size=BLOCK, kv_cache_dtype="float16", **kw))


def assert_close_to_scale(ours: torch.Tensor, ref: torch.Tensor) -> float:
    bound = LOGITS_REL * float(ref.abs().max())
    worst = float((ours - ref).abs().max())
    assert worst <= bound, f"max |logits difference| {worst:.2e} > {LOGITS_REL} x max |logits| = {bound:.2e}"
    return bound


def assert_same_greedy_within(hf, prompt: list[int], ours: list[int], ref: list[int], near_tie: float) -> None:  # type: ignore[no-untyped-def]
    """oracle.assert_same_greedy with the near-tie bound `near_tie`."""
    assert len(ours) == len(ref)
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            gap = hf_top2_gap(hf, prompt + ref[:i])
            assert gap < near_tie, f"token {i} differs (ours {a}, oracle {b}); top-2 gap {gap:.2e} >= {near_tie:.2e}"
            return


def test_latent_pool_is_fp16(dense_case):  # type: ignore[no-untyped-def]
    hf, loaded, _ = dense_case
    e = fp16_engine(loaded, num_kv_blocks=8)
    latent = hf.config.kv_lora_rank + hf.config.qk_rope_head_dim
    assert e.runner.kv.dtype == torch.float16 and e.runner.kv.shape == (8, loaded.config.num_layers, 1, BLOCK, latent)
    assert e.kv_spec.bytes_per_token == loaded.config.num_layers * latent * 2


def test_logits_within_tolerance(dense_case):  # type: ignore[no-untyped-def]
    hf, loaded, _ = dense_case
    tokens = prompts()[-1]
    e16 = fp16_engine(loaded, num_kv_blocks=64)
    ours = e16.prompt_logits(tokens)
    assert_close_to_scale(ours, LLMEngine(loaded, None, EngineConfig(block_size=BLOCK, num_kv_blocks=64))
                          .prompt_logits(tokens))
    with torch.inference_mode():
        assert_close_to_scale(ours, hf(torch.tensor([tokens])).logits[0])
    rows = decode_row_logits(e16, tokens)  # the absorbed decode over the fp16 latents
    torch.testing.assert_close(rows, ours, **PATHS_TOL)
    reference_rows = decode_row_logits(fp16_engine(loaded, num_kv_blocks=64, use_native_kernels=False), tokens)
    torch.testing.assert_close(rows, reference_rows, **PATHS_TOL)


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_transformers(dense_case, mode):  # type: ignore[no-untyped-def]
    hf, loaded, oracle = dense_case
    e = fp16_engine(loaded, **MODES[mode])
    batch = prompts()
    with torch.inference_mode():
        scale = max(float(hf(torch.tensor([p])).logits.abs().max()) for p in batch)
    for p, out in zip(batch, run(e, batch)):
        assert_same_greedy_within(hf, p, out.token_ids, oracle(p), near_tie=2 * LOGITS_REL * scale)
    assert_whole(e)
    if mode == "preempt":
        assert e.stats.num_preemptions > 0
