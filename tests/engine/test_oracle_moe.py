"""The engine against transformers on tiny random-weight mixture-of-experts models (Mixtral, Qwen2-MoE
with a gated shared expert, dense layers, renormalised and raw top-k weights), saved with
`save_pretrained` and loaded through our loader.

Greedy outputs must equal transformers' token for token (up to an oracle near-tie) with ample memory,
with chunked prefill, with preemption and on prefix-cache hits; one forward's logits must be within
1e-4; a self-draft of the first layer must not change greedy outputs.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.models.moe import MoEModel
from deepinfer.engine.request import RequestOutput, SamplingParams
from deepinfer.loading.weights import load_model_weights
from tests.engine.moe_models import VARIANTS, VOCAB, build_hf_moe, save
from tests.engine.oracle import (
    assert_same_greedy,
    assert_whole,
    memoised_greedy,
    oracle_prompts,
    random_tokens,
    run_staggered,
)

NEW_TOKENS = 24
BLOCK = 4
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
MODES = {
    "ample": dict(num_kv_blocks=256, max_num_batched_tokens=512),
    "chunked": dict(num_kv_blocks=256, max_num_batched_tokens=20),
    # 9 sequences growing to 25-94 tokens in 36 blocks of 4: preemption is certain.
    "preempt": dict(num_kv_blocks=36, max_num_batched_tokens=512),
}
# The last variant is saved with fused 3-D expert tensors, the others per expert.
FUSED = {"qwen2moe-unnormed-step2"}


@pytest.fixture(scope="module", params=list(VARIANTS))
def moe_case(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    """(transformers model, our loaded weights, memoised transformers greedy continuation)."""
    variant = request.param
    hf = build_hf_moe(variant, seed=sum(map(ord, variant)))
    loaded = load_model_weights(save(hf, tmp_path_factory.mktemp(variant), fused=variant in FUSED))
    return hf, loaded, memoised_greedy(hf, NEW_TOKENS)


def tokens(n: int, seed: int) -> list[int]:
    return random_tokens(n, seed, VOCAB)


def prompts() -> list[list[int]]:
    return oracle_prompts(VOCAB)


def run(e: LLMEngine, batch: list[list[int]], stagger: bool = True) -> list[RequestOutput]:
    return run_staggered(e, batch, GREEDY, stagger)


def test_loaded_as_moe(moe_case):  # type: ignore[no-untyped-def]
    hf, loaded, _ = moe_case
    e = LLMEngine(loaded, None, EngineConfig(block_size=BLOCK, num_kv_blocks=8))
    assert isinstance(e.runner.model, MoEModel)
    moe = loaded.config.moe
    sparse = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert [i for i in range(loaded.config.num_layers) if moe.is_sparse_layer(i)] == sparse
    assert sparse and len(sparse) <= loaded.config.num_layers


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_transformers(moe_case, mode):  # type: ignore[no-untyped-def]
    hf, loaded, oracle = moe_case
    e = LLMEngine(loaded, None, EngineConfig(block_size=BLOCK, **MODES[mode]))
    batch = prompts()
    for p, out in zip(batch, run(e, batch)):
        assert_same_greedy(hf, p, out.token_ids, oracle(p))
    if mode == "preempt":
        assert e.stats.num_preemptions > 0
    assert_whole(e)


def test_logits_within_tolerance(moe_case):  # type: ignore[no-untyped-def]
    """All-position logits of one forward pass against transformers' (fp32; stated tolerance 1e-4)."""
    hf, loaded, _ = moe_case
    e = LLMEngine(loaded, None, EngineConfig(block_size=BLOCK, num_kv_blocks=64))
    batch = prompts()[-1]
    ours = e.prompt_logits(batch)
    with torch.inference_mode():
        ref = hf(torch.tensor([batch])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", list(MODES))
def test_prefix_cache_hits_match_transformers(moe_case, mode):  # type: ignore[no-untyped-def]
    hf, loaded, oracle = moe_case
    stem = tokens(20, seed=100)  # 5 blocks
    batch = [stem + tokens(n, seed=200 + n) for n in (1, 3, 4, 6, 9)]
    kw = dict(MODES[mode], num_kv_blocks=26) if mode == "preempt" else MODES[mode]
    e = LLMEngine(loaded, None, EngineConfig(block_size=BLOCK, **kw))
    [first] = run(e, [stem + tokens(2, seed=99)])
    assert first.usage.cached_tokens == 0
    outs = run(e, batch, stagger=False)
    for p, out in zip(batch, outs):
        want = min(20, (len(p) - 1) // BLOCK * BLOCK)
        if mode != "preempt":  # a preempted request's hit counts what it refound on readmission
            assert out.usage.cached_by_tier == {"device": want}
        assert_same_greedy(hf, p, out.token_ids, oracle(p))
    assert e.stats.prefix_hit_tokens >= 20 * len(batch) - 4
    if mode == "preempt":
        assert e.stats.num_preemptions > 0
    assert_whole(e)


def test_self_draft_of_a_moe_model_keeps_greedy_output(moe_case):  # type: ignore[no-untyped-def]
    hf, loaded, oracle = moe_case
    e = LLMEngine(loaded, None, EngineConfig(block_size=BLOCK, num_kv_blocks=256, speculative="self:1",
                                             num_speculative_tokens=3, adaptive_speculation=False))
    batch = prompts()[2:6]
    for p, out in zip(batch, run(e, batch, stagger=False)):
        assert_same_greedy(hf, p, out.token_ids, oracle(p))
    assert e.stats.spec_proposed_tokens > 0
    assert_whole(e)
