"""Mixture-of-experts weights and configs: both Hugging Face expert layouts load to one state dict, the
MoE config fields are read from config.json and GGUF metadata, and a GGUF file written with llama.cpp's
tensor names (fused 3-D experts, per-expert ones, shared expert) loads to the Hugging Face weights."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, quants

from deepinfer.config.engine import EngineConfig
from deepinfer.config.model import SUPPORTED_ARCHITECTURES, ConfigError, ModelConfig, MoEConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.models import MODEL_CLASSES, build_model
from deepinfer.loading.weights import LoadedModel, check_state_dict, load_model_weights
from tests.engine.moe_models import VARIANTS, build_hf_moe, save


@pytest.fixture(scope="module")
def saved(tmp_path_factory):  # type: ignore[no-untyped-def]
    """Per variant: (transformers model, directory with per-expert tensors, directory with fused ones)."""
    out = {}
    for variant in VARIANTS:
        hf = build_hf_moe(variant, seed=3)
        root = tmp_path_factory.mktemp(variant)
        out[variant] = (hf, save(hf, root / "per-expert"), save(hf, root / "fused", fused=True))
    return out


def _safetensors_names(path: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_both_hf_expert_layouts_load_to_the_same_state_dict(saved, variant):  # type: ignore[no-untyped-def]
    hf, per_expert, fused = saved[variant]
    # The two directories really hold the two layouts.
    assert any(".experts.0." in n for n in _safetensors_names(per_expert))
    assert any(n.endswith("experts.gate_up_proj") for n in _safetensors_names(fused))
    a, b = load_model_weights(per_expert), load_model_weights(fused)
    assert a.config == b.config and a.state_dict.keys() == b.state_dict.keys()
    for name, value in a.state_dict.items():
        assert b.state_dict[name].dtype == torch.float32 and torch.equal(b.state_dict[name], value), name
    assert a.fingerprint == b.fingerprint
    # And the experts are the transformers model's, expert by expert (gate rows first in gate_up_proj).
    for i, layer in enumerate(hf.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            assert torch.equal(a.state_dict[f"layers.{i}.gate_proj"], layer.mlp.gate_proj.weight)
            continue
        n = experts.gate_up_proj.shape[1] // 2
        for e in range(experts.gate_up_proj.shape[0]):
            p = f"layers.{i}.experts.{e}."
            assert torch.equal(a.state_dict[p + "gate_proj"], experts.gate_up_proj[e, :n])
            assert torch.equal(a.state_dict[p + "up_proj"], experts.gate_up_proj[e, n:])
            assert torch.equal(a.state_dict[p + "down_proj"], experts.down_proj[e])
        assert torch.equal(a.state_dict[f"layers.{i}.router"], layer.mlp.gate.weight)


def test_config_fields_from_hf(saved):  # type: ignore[no-untyped-def]
    mixtral = load_model_weights(saved["mixtral-8e-top2"][1]).config
    assert mixtral.architecture == "mixtral" and not mixtral.attention_bias
    assert mixtral.moe == MoEConfig(num_experts=8, num_experts_per_tok=2, expert_intermediate_size=48)
    qwen = load_model_weights(saved["qwen2moe-shared-norm-dense1"][1]).config
    assert qwen.architecture == "qwen2_moe" and qwen.attention_bias and qwen.intermediate_size == 80
    assert qwen.moe == MoEConfig(num_experts=6, num_experts_per_tok=2, expert_intermediate_size=32,
                                 norm_topk_prob=True, shared_expert_intermediate_size=56, shared_expert_gated=True,
                                 sparse_step=1, dense_layers=(1,))
    step2 = load_model_weights(saved["qwen2moe-unnormed-step2"][1]).config.moe
    assert not step2.norm_topk_prob and [step2.is_sparse_layer(i) for i in range(4)] == [False, True, False, True]


def test_config_details() -> None:
    d = json.loads(json.dumps(dict(architectures=["MixtralForCausalLM"], vocab_size=10, hidden_size=8,
                                   intermediate_size=4, num_hidden_layers=1, num_attention_heads=2,
                                   num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.1)))
    c = ModelConfig.from_hf_dict(d)  # no model_type: the architectures class name decides
    assert c.architecture == "mixtral" and c.moe is not None and c.moe.num_experts == 4
    assert c.to_dict()["moe"]["dense_layers"] == []
    dense = ModelConfig.from_hf_dict({**d, "architectures": ["LlamaForCausalLM"]})
    assert dense.moe is None and "moe" not in dense.to_dict()  # dense fingerprints are unchanged
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        dataclasses.replace(dense, architecture="mixtral")
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        dataclasses.replace(c, architecture="llama")
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        ModelConfig.from_hf_dict({**d, "num_experts_per_tok": 5})


def test_registry_serves_every_supported_architecture(saved) -> None:  # type: ignore[no-untyped-def]
    assert set(MODEL_CLASSES) == set(SUPPORTED_ARCHITECTURES)
    loaded = load_model_weights(saved["qwen2moe-shared-norm-dense1"][1])
    model = build_model(loaded.config, loaded.state_dict, 64)
    assert model.config is loaded.config and model.max_positions == 64


def test_check_state_dict_names_missing_and_misshapen_experts(saved):  # type: ignore[no-untyped-def]
    loaded = load_model_weights(saved["qwen2moe-shared-norm-dense1"][1])
    state = dict(loaded.state_dict)
    del state["layers.2.experts.5.up_proj"]
    state["layers.0.shared_expert_gate"] = torch.zeros(64)
    state["layers.1.experts.0.up_proj"] = torch.zeros(32, 64)  # layer 1 is dense
    with pytest.raises(ValueError, match=r"missing layers\.2\.experts\.5\.up_proj.*unexpected layers\.1\.experts"
                                         r".*layers\.0\.shared_expert_gate has shape \(64,\), expected \(1, 64\)"):
        check_state_dict(loaded.config, state)


# ----- GGUF, written with llama.cpp's tensor names from our (Hugging Face) state dict -----

_GLOBAL = {"embed_tokens": "token_embd.weight", "norm": "output_norm.weight", "lm_head": "output.weight"}
_LAYER = {"input_norm": "attn_norm.weight", "post_attn_norm": "ffn_norm.weight", "q_proj": "attn_q.weight",
          "k_proj": "attn_k.weight", "v_proj": "attn_v.weight", "o_proj": "attn_output.weight",
          "q_bias": "attn_q.bias", "k_bias": "attn_k.bias", "v_bias": "attn_v.bias", "gate_proj": "ffn_gate.weight",
          "up_proj": "ffn_up.weight", "down_proj": "ffn_down.weight", "router": "ffn_gate_inp.weight",
          "shared_expert.gate_proj": "ffn_gate_shexp.weight", "shared_expert.up_proj": "ffn_up_shexp.weight",
          "shared_expert.down_proj": "ffn_down_shexp.weight", "shared_expert_gate": "ffn_gate_inp_shexp.weight"}
_EXPS = {"gate_proj": "ffn_gate_exps.weight", "up_proj": "ffn_up_exps.weight", "down_proj": "ffn_down_exps.weight"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of llama Q/K rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensors(loaded: LoadedModel, arch: str, per_expert: bool) -> dict[str, np.ndarray]:
    c, sd = loaded.config, loaded.state_dict
    out: dict[str, np.ndarray] = {}
    for name, t in sd.items():
        if name in _GLOBAL:
            out[_GLOBAL[name]] = t.numpy()
            continue
        _, i, rest = name.split(".", 2)
        a = t.numpy()
        if rest.startswith("experts."):
            _, e, proj = rest.split(".")
            if per_expert:  # the layout of older Mixtral GGUFs
                out[f"blk.{i}.{_LAYER[proj][:-len('.weight')]}.{e}.weight"] = a
            elif e == "0":  # fused: [E, rows, columns]
                out[f"blk.{i}.{_EXPS[proj]}"] = np.stack([sd[f"layers.{i}.experts.{k}.{proj}"].numpy()
                                                          for k in range(c.moe.num_experts)])
            continue
        if arch == "llama" and rest in ("q_proj", "q_bias"):
            a = _permute(a, c.num_heads)
        elif arch == "llama" and rest in ("k_proj", "k_bias"):
            a = _permute(a, c.num_kv_heads)
        elif rest == "shared_expert_gate":
            a = a.reshape(-1)  # llama.cpp's is 1-D [hidden]
        out[f"blk.{i}.{_LAYER[rest]}"] = a
    return out


def _write_gguf(path: Path, loaded: LoadedModel, qtype: T = T.F32, per_expert: bool = False) -> dict[str, np.ndarray]:
    """Returns each stored tensor's dequantised value."""
    c = loaded.config
    arch = "llama" if c.architecture == "mixtral" else "qwen2moe"
    w = GGUFWriter(path, arch)
    w.add_block_count(c.num_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_rope_dimension_count(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_ids[0])
    w.add_expert_count(c.moe.num_experts)
    w.add_expert_used_count(c.moe.num_experts_per_tok)
    if arch == "qwen2moe":
        w.add_expert_feed_forward_length(c.moe.expert_intermediate_size)
        w.add_expert_shared_feed_forward_length(c.moe.shared_expert_intermediate_size)
        if c.moe.norm_topk_prob:
            w.add_expert_weights_norm(True)
    stored = {}
    for name, array in _gguf_tensors(loaded, arch, per_expert).items():
        array = np.ascontiguousarray(array, dtype=np.float32)
        if array.ndim >= 2 and qtype != T.F32 and array.shape[-1] % 32 == 0:  # else F32, as llama.cpp falls back
            raw = quants.quantize(array, qtype)
            w.add_tensor(name, raw, raw_dtype=qtype)
            stored[name] = quants.dequantize(raw, qtype)
        else:
            w.add_tensor(name, array)
            stored[name] = array
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def _same_model_config(a: ModelConfig, b: ModelConfig) -> None:
    """Equal, the MoE layer rule compared layer by layer (GGUF names dense layers, HF may use a step)."""
    assert dataclasses.replace(a, moe=None, architecture="llama") == dataclasses.replace(b, moe=None,
                                                                                         architecture="llama")
    assert a.architecture == b.architecture
    sparse = [[m.is_sparse_layer(i) for i in range(a.num_layers)] for m in (a.moe, b.moe)]
    assert sparse[0] == sparse[1]
    assert dataclasses.replace(a.moe, sparse_step=1, dense_layers=()) == dataclasses.replace(
        b.moe, sparse_step=1, dense_layers=())


@pytest.mark.parametrize(("variant", "per_expert"), [("mixtral-8e-top2", False), ("mixtral-8e-top2", True),
                                                     ("qwen2moe-shared-norm-dense1", False),
                                                     ("qwen2moe-unnormed-step2", False)])
def test_gguf_moe_equals_hf_weights(saved, tmp_path, variant, per_expert):  # type: ignore[no-untyped-def]
    hf_loaded = load_model_weights(saved[variant][1])
    _write_gguf(tmp_path / "m.gguf", hf_loaded, per_expert=per_expert)
    loaded = load_model_weights(tmp_path / "m.gguf")
    _same_model_config(loaded.config, hf_loaded.config)
    assert loaded.state_dict.keys() == hf_loaded.state_dict.keys()
    for name, value in hf_loaded.state_dict.items():
        assert torch.equal(loaded.state_dict[name], value), name


def test_quantized_gguf_moe_serves_like_transformers(saved, tmp_path):  # type: ignore[no-untyped-def]
    """Q8_0 fused expert tensors (3-D, quantised along the rows) dequantise to the stored values, and
    an engine on them stays close to transformers on the original weights."""
    hf, per_expert_dir, _ = saved["qwen2moe-shared-norm-dense1"]
    hf_loaded = load_model_weights(per_expert_dir)
    stored = _write_gguf(tmp_path / "q8.gguf", hf_loaded, T.Q8_0)
    loaded = load_model_weights(tmp_path / "q8.gguf")
    gate_exps = stored["blk.0.ffn_gate_exps.weight"]
    assert gate_exps.shape == (6, 32, 64)
    for e in range(6):
        np.testing.assert_array_equal(loaded.state_dict[f"layers.0.experts.{e}.gate_proj"].numpy(), gate_exps[e])
    tokens = list(range(3, 40))
    ours = LLMEngine(loaded, None, EngineConfig(block_size=4, num_kv_blocks=32)).prompt_logits(tokens)
    with torch.inference_mode():
        ref = hf(torch.tensor([tokens])).logits[0]
    assert (ours - ref).abs().max() < 0.1 * ref.abs().max()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
