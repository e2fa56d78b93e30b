"""The engine against transformers on tiny random-weight DeepSeek-V3 and DeepSeek-V2 models (see
`deepseek_models.VARIANTS`), saved with `save_pretrained` and loaded through our loader.

Greedy outputs must equal transformers' token for token (up to an oracle near-tie) with ample memory,
with chunked prefill, with preemption and on prefix-cache hits; one forward's logits must be within
1e-4; a self-draft of the first layer must not change greedy outputs. The router is also checked on
its own against transformers' gate, including a layer whose every choice is an exact tie. The KV is
the latent: one vector of kv_lora_rank + qk_rope_head_dim floats per token and layer.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer.config.engine import EngineConfig
from deepinfer.config.kv import KvSpec
from deepinfer.config.model import ConfigError, ModelConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.models.deepseek import DeepseekModel, DeepseekRouter
from deepinfer.engine.models.moe import LocalExperts, SparseMoE
from deepinfer.engine.request import RequestOutput, SamplingParams
from deepinfer.loading.weights import load_model_weights
from tests.engine.deepseek_models import FUSED, TIED_LAYER, VARIANTS, VOCAB, build_hf_deepseek, save
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


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=list(VARIANTS))
def ds_case(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    """(variant, transformers model, our loaded weights, memoised transformers greedy continuation)."""
    variant = request.param
    hf = build_hf_deepseek(variant, seed=sum(map(ord, variant)))
    loaded = load_model_weights(save(hf, tmp_path_factory.mktemp(variant), fused=variant in FUSED))
    return variant, hf, loaded, memoised_greedy(hf, NEW_TOKENS)


def tokens(n: int, seed: int) -> list[int]:
    return random_tokens(n, seed, VOCAB)


def prompts() -> list[list[int]]:
    return oracle_prompts(VOCAB)


def run(e: LLMEngine, batch: list[list[int]], stagger: bool = True) -> list[RequestOutput]:
    return run_staggered(e, batch, GREEDY, stagger)


def test_loaded_as_deepseek_with_a_latent_cache(ds_case):  # type: ignore[no-untyped-def]
    _, hf, loaded, _ = ds_case
    c, hc = loaded.config, hf.config
    e = LLMEngine(loaded, None, EngineConfig(block_size=BLOCK, num_kv_blocks=8))
    assert isinstance(e.runner.model, DeepseekModel)
    sparse = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert [i for i in range(c.num_layers) if c.moe.is_sparse_layer(i)] == sparse
    # moe.py's blocks, so expert parallelism (which swaps a block's `experts`) applies to DeepSeek too.
    blocks = [layer.mlp for layer in e.runner.model.layers if isinstance(layer.mlp, SparseMoE)]
    assert len(blocks) == len(sparse) and all(isinstance(b.experts, LocalExperts) for b in blocks)
    assert all((b.shared is not None) == bool(hc.n_shared_experts) and b.shared_gate is None for b in blocks)
    latent = hc.kv_lora_rank + hc.qk_rope_head_dim
    assert e.kv_spec.components == ("latent",) and e.kv_spec.token_shape == (latent,)
    assert e.runner.kv.shape == (8, c.num_layers, 1, BLOCK, latent)
    # The cache holds one latent per token and layer; expanded MHA would hold every head's K and V.
    assert e.kv_spec.bytes_per_token == c.num_layers * latent * 4
    mha = c.num_layers * c.num_heads * (hc.qk_nope_head_dim + hc.qk_rope_head_dim + hc.v_head_dim) * 4
    assert e.kv_spec.bytes_per_token < mha


def test_deepseek_v3_full_size_kv_spec() -> None:
    """DeepSeek-V3's published config: 61 layers × (512 + 64) fp32 floats per token, far below MHA's."""
    c = ModelConfig.from_hf_dict({
        "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
        "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "max_position_embeddings": 163840,
    })
    spec = KvSpec.for_model(c, 16)
    assert spec.layout == "layers=61,kv=1,block_size=16,latent_dim=576"
    assert spec.bytes_per_token == 61 * (512 + 64) * 4
    assert spec.bytes_per_token < 61 * 128 * (128 + 64 + 128) * 4
    assert c.head_dim == 64 and c.moe.dense_layers == (0, 1, 2) and c.moe.routed_scaling_factor == 2.5


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_transformers(ds_case, mode):  # type: ignore[no-untyped-def]
    _, hf, loaded, oracle = ds_case
    e = LLMEngine(loaded, None, EngineConfig(block_size=BLOCK, **MODES[mode]))
    batch = prompts()
    for p, out in zip(batch, run(e, batch)):
        assert_same_greedy(hf, p, out.token_ids, oracle(p))
    if mode == "preempt":  # victims' latent KV swapped to host memory and back
        assert e.stats.num_preemptions > 0 and e.stats.swap_in_blocks > 0
    assert_whole(e)


@pytest.mark.parametrize("native", [True, False])
def test_logits_within_tolerance(ds_case, native):  # type: ignore[no-untyped-def]
    """All-position logits of one prefill against transformers' (fp32; stated tolerance 1e-4), then the
    decode path (absorbed attention, kernel or torch) one token at a time against the same."""
    _, hf, loaded, _ = ds_case
    e = LLMEngine(loaded, None, EngineConfig(block_size=BLOCK, num_kv_blocks=64, use_native_kernels=native))
    batch = prompts()[-1]
    with torch.inference_mode():
        ref = hf(torch.tensor([batch])).logits[0]
    torch.testing.assert_close(e.prompt_logits(batch), ref, atol=1e-4, rtol=1e-4)
    from deepinfer.engine.attention import Segment, layout

    blocks = e.pool.allocate(-(-len(batch) // BLOCK))
    try:  # token by token: every row a decode row reading its earlier latents from the pool
        for pos, tok in enumerate(batch):
            step = layout([Segment([tok], pos, blocks, num_logits=1)], BLOCK, e.runner.use_native)
            got = e.runner.model.forward(step.input_ids, step.positions, e.runner.kv, step.meta, step.logits_rows)
            torch.testing.assert_close(got[0], ref[pos], atol=1e-4, rtol=1e-4)
    finally:
        e.pool.free(reversed(blocks))


@pytest.mark.parametrize("mode", list(MODES))
def test_prefix_cache_hits_match_transformers(ds_case, mode):  # type: ignore[no-untyped-def]
    _, hf, loaded, oracle = ds_case
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
    if mode == "preempt":  # victims' latent KV swapped to host memory and back
        assert e.stats.num_preemptions > 0 and e.stats.swap_in_blocks > 0
    assert_whole(e)


def test_self_draft_keeps_greedy_output(ds_case):  # type: ignore[no-untyped-def]
    _, hf, loaded, oracle = ds_case
    e = LLMEngine(loaded, None, EngineConfig(block_size=BLOCK, num_kv_blocks=256, speculative="self:1",
                                             num_speculative_tokens=3, adaptive_speculation=False))
    batch = prompts()[2:6]
    for p, out in zip(batch, run(e, batch, stagger=False)):
        assert_same_greedy(hf, p, out.token_ids, oracle(p))
    assert e.stats.spec_proposed_tokens > 0
    assert_whole(e)


def test_draft_trees_keep_greedy_output(ds_case):  # type: ignore[no-untyped-def]
    """A draft tree's rows attend through the latent cache with the tree's mask (mla.py), and walked branch nodes'
    latents move to their chain positions: greedy output stays transformers'."""
    from tests.engine.test_spec_tree import ScriptedTreeProposer

    _, hf, loaded, oracle = ds_case
    e = LLMEngine(loaded, None, EngineConfig(block_size=BLOCK, num_kv_blocks=256, speculative="ngram",
                                             num_speculative_tokens=6, adaptive_speculation=False))
    batch = prompts()[2:6]
    assert e.speculator is not None
    e.speculator.proposer = ScriptedTreeProposer({tuple(p): oracle(p) for p in batch}, vocab=VOCAB)
    for p, out in zip(batch, run(e, batch, stagger=False)):
        assert_same_greedy(hf, p, out.token_ids, oracle(p))
    assert e.stats.spec_accepted_tokens > 0
    assert_whole(e)


def test_router_chooses_and_weighs_like_transformers(ds_case):  # type: ignore[no-untyped-def]
    """Every sparse layer's routing of random hidden states, against transformers' gate: the same expert
    sets with the same weights (exactly: same calls, same order). In the tied layer every choice is a tie."""
    variant, hf, loaded, _ = ds_case
    model = DeepseekModel(loaded.config, loaded.state_dict, 16)
    h = torch.randn(300, loaded.config.hidden_size, generator=torch.Generator().manual_seed(5))
    checked = 0
    for i, layer in enumerate(model.layers):
        if not loaded.config.moe.is_sparse_layer(i):
            continue
        routing = layer.mlp.route(h)
        with torch.inference_mode():
            _, ref_w, ref_e = hf.model.layers[i].mlp.gate(h)
        k = loaded.config.moe.num_experts_per_tok
        ours = {(int(t), int(x)): float(w) for t, x, w in zip(routing.token, routing.expert, routing.weight)}
        theirs = {(t, int(ref_e[t, j])): float(ref_w[t, j]) for t in range(h.shape[0]) for j in range(k)}
        assert ours == theirs, f"layer {i} routes differently"
        if TIED_LAYER.get(variant) == i:
            # Both groups and three experts in each are tied: the choice is tie-breaking alone.
            assert set(routing.expert.tolist()) <= {0, 1, 2, 4, 5, 6}
            assert torch.all(routing.weight == 0.5 * loaded.config.moe.routed_scaling_factor)
        checked += 1
    assert checked


@pytest.mark.parametrize("cls_name, kwargs", [
    ("DeepseekV2Config", dict(n_routed_experts=10, num_experts_per_tok=3)),  # V2 greedy: top-k of softmax
    ("DeepseekV3Config", dict(n_routed_experts=6, num_experts_per_tok=2, n_group=1, topk_group=1,
                              routed_scaling_factor=1.0, norm_topk_prob=True)),  # one group: plain biased top-k
])
def test_router_on_its_own_against_transformers_gate(cls_name, kwargs):  # type: ignore[no-untyped-def]
    """The routing settings no model variant above uses, router against gate alone (no model built)."""
    import transformers

    config = getattr(transformers, cls_name)(hidden_size=16, num_attention_heads=4, **kwargs)
    ours = ModelConfig.from_hf_dict(config.to_dict()).moe
    gate_cls = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter
    if cls_name == "DeepseekV2Config":
        gate_cls = transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter
    torch.manual_seed(3)
    gate = gate_cls(config)
    with torch.no_grad():
        gate.weight.normal_(0, 0.25)
        if hasattr(gate, "e_score_correction_bias"):
            gate.e_score_correction_bias.normal_(0, 0.1)
    router = DeepseekRouter(gate.weight.detach().clone(), getattr(gate, "e_score_correction_bias", None), ours)
    h = torch.randn(200, 16)
    routing = router(h)
    with torch.inference_mode():
        _, ref_w, ref_e = gate(h)
    k = ours.num_experts_per_tok
    assert {(int(t), int(x)): float(w) for t, x, w in zip(routing.token, routing.expert, routing.weight)} == {
        (t, int(ref_e[t, j])): float(ref_w[t, j]) for t in range(h.shape[0]) for j in range(k)}


# -- configs and checkpoints ------------------------------------------------------------------


def _hf_config(tmp_path, variant: str = "v3-qlora-dense1-yarn") -> dict:  # type: ignore[type-arg]
    path = save(build_hf_deepseek(variant), tmp_path / "m")
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("change, message", [
    ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    ({"topk_method": "greedy"}, "topk_method 'greedy'"),
    ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ({"n_routed_experts": None}, "without routed experts"),
    ({"n_group": 3}, "n_group=3"),
])
def test_v3_configs_it_cannot_serve_are_refused(tmp_path, change, message):  # type: ignore[no-untyped-def]
    d = _hf_config(tmp_path) | change
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict(d)


def test_v2_asking_for_renormalised_weights_is_refused(tmp_path):  # type: ignore[no-untyped-def]
    d = _hf_config(tmp_path, "v2-grouplimited-bias") | {"norm_topk_prob": True}
    with pytest.raises(ConfigError, match="norm_topk_prob"):
        ModelConfig.from_hf_dict(d)


def test_multi_token_prediction_layers_are_skipped(tmp_path):  # type: ignore[no-untyped-def]
    """DeepSeek-V3 checkpoints store their MTP module as the layer after the last: not loaded, not refused."""
    path = save(build_hf_deepseek("v3-qlora-dense1-yarn"), tmp_path / "m")
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    tensors = load_file(path / "model.safetensors")
    tensors[f"model.layers.{layers}.eh_proj.weight"] = torch.zeros(64, 128)
    tensors[f"model.layers.{layers}.self_attn.kv_b_proj.weight"] = torch.zeros(4, 4)
    out = tmp_path / "with-mtp"
    out.mkdir()
    shutil.copy(path / "config.json", out / "config.json")
    save_file(tensors, out / "model.safetensors")
    loaded = load_model_weights(out)
    assert not any(k.startswith(f"layers.{layers}.") for k in loaded.state_dict)
    assert loaded.fingerprint == load_model_weights(path).fingerprint
