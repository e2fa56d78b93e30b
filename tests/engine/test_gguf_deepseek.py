"""DeepSeek-V2/V3 from GGUF (llama.cpp's `deepseek2`), against the Hugging Face directory and transformers.

Tiny seeded random models are built with transformers and saved with `save_pretrained`; a GGUF is then
written from the saved weights the way llama.cpp's converter writes one (`write_deepseek_gguf`: its
metadata keys, its tensor names from gguf's own HF→GGUF map, experts fused into 3-D tensors, the
score-correction bias as `exp_probs_b.bias`, no rotary permutation, routers and 1-D tensors kept F32,
and kv_b either whole — older files — or split into `attn_k_b` [H, C, N] / `attn_v_b` [H, V, C] with the
latent written as one MQA head — current files). Checked: an F32 file loads to exactly the Hugging Face
load (config, every tensor bit for bit, fingerprint); greedy outputs equal transformers' with and without
chunked prefill; F16 and Q8_0 files equal transformers holding the same dequantised weights; files that
cannot be read consistently are refused with a ConfigError naming the problem.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V
from safetensors.torch import load_file

from deepinfer.config.engine import EngineConfig
from deepinfer.config.model import ConfigError
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import SamplingParams
from deepinfer.loading.gguf import gguf_to_our_name
from deepinfer.loading.gguf_model import load_gguf
from deepinfer.loading.weights import hf_to_our_name, load_model_weights
from tests.engine.deepseek_models import COMMON, VOCAB, save
from tests.engine.oracle import assert_same_greedy, assert_whole, memoised_greedy, random_tokens, run_staggered

NEW_TOKENS = 16
BLOCK = 4
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
MODES = {"ample": dict(num_kv_blocks=128, max_num_batched_tokens=512),
         "chunked": dict(num_kv_blocks=128, max_num_batched_tokens=12)}
# DeepSeek's YaRN as llama.cpp can store it: mscale equal to mscale_all_dim (only the latter is written).
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32.0, "beta_slow": 1.0}
# What a deepseek2 file can describe (no attention biases, rope always in adjacent pairs).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # Low-rank queries, layer 0 dense, one shared expert, sigmoid top-2 of 8 in 4 groups (2 kept) with the
    # correction bias, renormalised and scaled by 2.5, YaRN.
    "v3-qlora-yarn": ("DeepseekV3Config", dict(
        q_lora_rank=32, first_k_dense_replace=1, n_shared_experts=1, n_routed_experts=8, n_group=4, topk_group=2,
        num_experts_per_tok=2, routed_scaling_factor=2.5, norm_topk_prob=True, rope_parameters=YARN)),
    # Plain q_proj, every layer sparse, two shared experts, 2 groups (1 kept), not renormalised, scale 1.5.
    "v3-plain-q": ("DeepseekV3Config", dict(
        q_lora_rank=None, first_k_dense_replace=0, n_shared_experts=2, n_routed_experts=8, n_group=2, topk_group=1,
        num_experts_per_tok=2, routed_scaling_factor=1.5, norm_topk_prob=False)),
    # DeepSeek-V2: softmax, group_limited_greedy (3 of 6 groups), top-3 of 12, scale 2, layer 0 dense.
    "v2-softmax": ("DeepseekV2Config", dict(
        q_lora_rank=None, first_k_dense_replace=1, n_shared_experts=1, n_routed_experts=12, n_group=6,
        topk_group=3, num_experts_per_tok=3, topk_method="group_limited_greedy", routed_scaling_factor=2.0,
        norm_topk_prob=False)),
}


pytestmark = pytest.mark.usefixtures("one_thread")


def build_hf(variant: str, seed: int) -> Any:
    """The transformers model of `variant`, weights initialised as deepseek_models.build_hf_deepseek does."""
    import transformers

    cls_name, kwargs = VARIANTS[variant]
    config = getattr(transformers, cls_name)(**{**COMMON, **kwargs})
    model_cls = transformers.DeepseekV3ForCausalLM if "V3" in cls_name else transformers.DeepseekV2ForCausalLM
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p)) if name.endswith("norm.weight") else p.normal_(
                0, 1 / math.sqrt(p.shape[-1]))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0, 0.1)
    return model


# -- a GGUF written as llama.cpp's converter writes one ----------------------------------------------


def _tokenizer_metadata(vocab: int) -> dict[str, tuple[Any, V]]:
    """A byte-level BPE vocabulary of exactly `vocab` tokens: 3 specials, the 256 byte symbols, merges."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    pairs = [(a, b) for a in alphabet[:16] for b in alphabet[:16]][: vocab - 3 - len(alphabet)]
    tokens = ["<unk>", "<s>", "</s>", *alphabet, *(a + b for a, b in pairs)]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    return {"tokenizer.ggml.model": ("gpt2", V.STRING), "tokenizer.ggml.pre": ("default", V.STRING),
            "tokenizer.ggml.tokens": (tokens, V.ARRAY), "tokenizer.ggml.token_type": (types, V.ARRAY),
            "tokenizer.ggml.merges": ([f"{a} {b}" for a, b in pairs], V.ARRAY),
            "tokenizer.ggml.bos_token_id": (1, V.UINT32), "tokenizer.ggml.eos_token_id": (2, V.UINT32)}


def converter_metadata(c: dict[str, Any], split: bool) -> dict[str, tuple[Any, V]]:
    """The deepseek2 keys llama.cpp's converter writes for config.json `c`. `split`: current files (latent
    as one MQA head, *_mla per-head sizes); otherwise the older layout (per-head sizes in key/value_length)."""
    a, rope = "deepseek2.", c["qk_rope_head_dim"]
    # DeepSeek-V3's own config.json says scoring_func "sigmoid"; transformers' config leaves it unset.
    scoring = c.get("scoring_func") or ("sigmoid" if c["model_type"] == "deepseek_v3" else "softmax")
    u32 = {"block_count": c["num_hidden_layers"], "context_length": c["max_position_embeddings"],
           "embedding_length": c["hidden_size"], "feed_forward_length": c["intermediate_size"],
           "attention.head_count": c["num_attention_heads"], "vocab_size": c["vocab_size"],
           "leading_dense_block_count": c["first_k_dense_replace"], "attention.kv_lora_rank": c["kv_lora_rank"],
           "expert_feed_forward_length": c["moe_intermediate_size"], "expert_count": c["n_routed_experts"],
           "expert_used_count": c["num_experts_per_tok"], "expert_shared_count": c["n_shared_experts"],
           "expert_gating_func": 2 if scoring == "sigmoid" else 1,
           "expert_group_count": c["n_group"], "expert_group_used_count": c["topk_group"],
           "rope.dimension_count": rope}
    if c.get("q_lora_rank"):
        u32["attention.q_lora_rank"] = c["q_lora_rank"]
    if split:
        u32 |= {"attention.head_count_kv": 1, "attention.key_length": c["kv_lora_rank"] + rope,
                "attention.value_length": c["kv_lora_rank"],
                "attention.key_length_mla": c["qk_nope_head_dim"] + rope, "attention.value_length_mla": c["v_head_dim"]}
    else:
        u32 |= {"attention.head_count_kv": c["num_attention_heads"],
                "attention.key_length": c["qk_nope_head_dim"] + rope, "attention.value_length": c["v_head_dim"]}
    rope_params = c.get("rope_parameters") or {}
    f32 = {"rope.freq_base": rope_params.get("rope_theta", c.get("rope_theta", 10000.0)),
           "attention.layer_norm_rms_epsilon": c["rms_norm_eps"], "expert_weights_scale": c["routed_scaling_factor"]}
    meta: dict[str, tuple[Any, V]] = {"general.architecture": ("deepseek2", V.STRING)}
    meta |= {a + k: (v, V.UINT32) for k, v in u32.items()} | {a + k: (v, V.FLOAT32) for k, v in f32.items()}
    if c.get("norm_topk_prob"):
        meta[a + "expert_weights_norm"] = (True, V.BOOL)
    if rope_params.get("rope_type") == "yarn":
        r = a + "rope.scaling."
        meta |= {r + "type": ("yarn", V.STRING), r + "factor": (rope_params["factor"], V.FLOAT32),
                 r + "original_context_length": (rope_params["original_max_position_embeddings"], V.UINT32),
                 r + "yarn_log_multiplier": (0.1 * rope_params["mscale_all_dim"], V.FLOAT32)}
    return meta | _tokenizer_metadata(c["vocab_size"])


def converter_tensors(hf_dir: Path, c: dict[str, Any], split: bool) -> dict[str, np.ndarray]:
    """GGUF name → fp32 array (numpy order) as the converter produces them from the saved checkpoint."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, c["num_hidden_layers"])
    hf = load_file(hf_dir / "model.safetensors")
    out: dict[str, np.ndarray] = {}

    def put(hf_name: str, t: torch.Tensor) -> None:
        out[names.get_name(hf_name, try_suffixes=(".weight", ".bias"))] = t.float().numpy()

    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, t in hf.items():
        expert = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight", name)
        if expert:
            experts.setdefault((int(expert[1]), expert[3]), {})[int(expert[2])] = t
        elif name.endswith("kv_b_proj.weight") and split:
            heads, n, v = c["num_attention_heads"], c["qk_nope_head_dim"], c["v_head_dim"]
            k_b, v_b = t.view(heads, n + v, -1).split([n, v], dim=1)
            put(name.replace("kv_b_proj", "k_b_proj"), k_b.transpose(1, 2))
            put(name.replace("kv_b_proj", "v_b_proj"), v_b)
        else:
            put(name.replace("e_score_correction_bias", "e_score_correction.bias"), t)
    for (layer, proj), per_expert in experts.items():
        put(f"model.layers.{layer}.mlp.experts.{proj}.weight", torch.stack([per_expert[e] for e in sorted(per_expert)]))
    return out


def write_deepseek_gguf(path: Path, hf_dir: Path, split: bool = True, qtype: T = T.F32,
                        edit: Callable[[dict[str, Any], dict[str, np.ndarray]], None] | None = None
                        ) -> dict[str, np.ndarray]:
    """Write `hf_dir` as a deepseek2 GGUF; returns each tensor's stored value, dequantised. Routers and 1-D
    tensors stay F32 (as the converter keeps them); with Q8_0 a tensor whose rows are not whole blocks
    falls back to F16, as the converter's does. `edit(metadata, tensors)` may alter both before writing."""
    c = json.loads((hf_dir / "config.json").read_text())
    meta, tensors = converter_metadata(c, split), converter_tensors(hf_dir, c, split)
    if edit is not None:
        edit(meta, tensors)
    w = gguf.GGUFWriter(path, "deepseek2")
    for key, (value, kind) in meta.items():
        if key != "general.architecture":
            w.add_key_value(key, value, kind, sub_type=V.STRING if key in (
                "tokenizer.ggml.tokens", "tokenizer.ggml.merges") else V.INT32 if kind == V.ARRAY else None)
    stored: dict[str, np.ndarray] = {}
    for name, array in tensors.items():
        kind = T.F32 if array.ndim == 1 or ".ffn_gate_inp." in name else qtype
        if kind == T.Q8_0 and array.shape[-1] % 32:
            kind = T.F16
        if kind == T.Q8_0:
            raw = gguf.quants.quantize(array, kind)
            w.add_tensor(name, raw, raw_dtype=kind)
            stored[name] = gguf.quants.dequantize(raw, kind)
        else:
            data = array.astype(np.float16 if kind == T.F16 else np.float32)
            w.add_tensor(name, data)
            stored[name] = data.astype(np.float32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


# -- fixtures ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):  # type: ignore[no-untyped-def]
    """variant -> (transformers model, its saved directory), built once."""
    cache: dict[str, tuple[Any, Path]] = {}

    def get(variant: str) -> tuple[Any, Path]:
        if variant not in cache:
            hf = build_hf(variant, seed=sum(map(ord, variant)))
            cache[variant] = hf, save(hf, tmp_path_factory.mktemp(variant))
        return cache[variant]

    return get


def tokens(n: int, seed: int) -> list[int]:
    return random_tokens(n, seed, VOCAB)


PROMPTS = [tokens(n, n) for n in (1, 5, 16, 23, 41)]


def hf_holding(hf: Any, state: dict[str, torch.Tensor]) -> Any:
    """A transformers model like `hf` whose weights are `state` (our names; e.g. dequantised GGUF weights)."""
    clone = type(hf)(hf.config).eval()
    sd: dict[str, torch.Tensor] = {}
    for name in clone.state_dict():
        fused = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", name)
        if fused:
            p, e = f"layers.{fused[1]}.experts.", range(hf.config.n_routed_experts)
            parts = ["gate_proj", "up_proj"] if fused[2] == "gate_up_proj" else ["down_proj"]
            sd[name] = torch.stack([torch.cat([state[f"{p}{i}.{q}"] for q in parts]) for i in e])
        else:
            sd[name] = state[hf_to_our_name(name, mla=True)]
    clone.load_state_dict(sd, strict=True)
    return clone


def assert_greedy_like(hf: Any, path: Path, mode: str) -> None:
    e = LLMEngine.load(path, EngineConfig(block_size=BLOCK, **MODES[mode]))
    oracle = memoised_greedy(hf, NEW_TOKENS)
    for p, out in zip(PROMPTS, run_staggered(e, PROMPTS, GREEDY)):
        assert_same_greedy(hf, p, out.token_ids, oracle(p))
    assert_whole(e)


# -- the F32 file is the Hugging Face checkpoint -----------------------------------------------------


@pytest.mark.parametrize("split", [True, False], ids=["k_b-v_b", "kv_b"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_f32_gguf_loads_exactly_like_the_hf_directory(saved, tmp_path, variant, split):  # type: ignore[no-untyped-def]
    _, hf_dir = saved(variant)
    path = tmp_path / "m.gguf"
    stored = write_deepseek_gguf(path, hf_dir, split=split)
    assert any(".attn_k_b." in n for n in stored) == split and any(".attn_kv_b." in n for n in stored) != split
    ours, theirs = load_model_weights(path), load_model_weights(hf_dir)
    assert ours.weights == "fp32"
    assert ours.config == theirs.config
    assert ours.state_dict.keys() == theirs.state_dict.keys()
    for name, value in theirs.state_dict.items():
        assert ours.state_dict[name].dtype == torch.float32 and torch.equal(ours.state_dict[name], value), name
    assert ours.fingerprint == theirs.fingerprint


def test_whole_kv_b_wins_over_a_split_pair_beside_it(saved, tmp_path):  # type: ignore[no-untyped-def]
    """A file holding attn_kv_b and attn_k_b/attn_v_b: the whole tensor is the converter's input, used as is."""
    _, hf_dir = saved("v3-plain-q")
    heads, c, n, v = (COMMON[k] for k in ("num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"))

    def add_zero_pairs(meta: dict[str, Any], tensors: dict[str, np.ndarray]) -> None:
        for i in range(COMMON["num_hidden_layers"]):
            tensors[f"blk.{i}.attn_k_b.weight"] = np.zeros((heads, c, n), np.float32)
            tensors[f"blk.{i}.attn_v_b.weight"] = np.zeros((heads, v, c), np.float32)

    write_deepseek_gguf(tmp_path / "both.gguf", hf_dir, split=False, edit=add_zero_pairs)
    assert load_model_weights(tmp_path / "both.gguf").fingerprint == load_model_weights(hf_dir).fingerprint


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_from_gguf_matches_transformers(saved, tmp_path, variant, mode):  # type: ignore[no-untyped-def]
    hf, hf_dir = saved(variant)
    write_deepseek_gguf(tmp_path / "m.gguf", hf_dir, split=True)
    assert_greedy_like(hf, tmp_path / "m.gguf", mode)


def test_gguf_tokenizer_and_engine_load(saved, tmp_path):  # type: ignore[no-untyped-def]
    _, hf_dir = saved("v3-plain-q")
    write_deepseek_gguf(tmp_path / "m.gguf", hf_dir)
    e = LLMEngine.load(tmp_path / "m.gguf", EngineConfig(block_size=BLOCK, num_kv_blocks=16))
    assert e.tokenizer is not None and e.eos_token_ids == (2,)
    assert e.tokenizer.decode(e.tokenizer.encode("abc", add_special_tokens=False)) == "abc"
    assert e.kv_spec.token_shape == (COMMON["kv_lora_rank"] + COMMON["qk_rope_head_dim"],)


# -- F16 and Q8_0: transformers holding the same dequantised weights ---------------------------------


@pytest.mark.parametrize("qtype", [T.F16, T.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("variant", ["v3-qlora-yarn", "v2-softmax"])
def test_quantised_gguf_matches_transformers_on_its_weights(saved, tmp_path, variant, qtype):  # type: ignore[no-untyped-def]
    hf, hf_dir = saved(variant)
    path = tmp_path / "m.gguf"
    stored = write_deepseek_gguf(path, hf_dir, split=True, qtype=qtype)
    config, state = load_gguf(path)
    for name, value in stored.items():  # every stored tensor arrives dequantised exactly
        if ".attn_k_b." in name or ".attn_v_b." in name:
            continue  # joined into kv_b_proj: checked below
        ours = state[gguf_to_our_name(name)] if "_exps." not in name else torch.stack(
            [state[gguf_to_our_name(name).replace("*", str(e))] for e in range(config.moe.num_experts)])
        np.testing.assert_array_equal(ours.numpy(), value, err_msg=name)
    heads, n = config.num_heads, config.mla.qk_nope_head_dim
    for i in range(config.num_layers):
        k_b, v_b = (torch.from_numpy(stored[f"blk.{i}.attn_{x}_b.weight"]) for x in "kv")
        kv_b = state[f"layers.{i}.kv_b_proj"].view(heads, -1, config.mla.kv_lora_rank)
        assert torch.equal(kv_b[:, :n], k_b.transpose(1, 2)) and torch.equal(kv_b[:, n:], v_b)
    original = load_model_weights(hf_dir).state_dict
    changed = [k for k in original if not torch.equal(original[k], state[k])]
    assert len(changed) > len(original) // 2  # quantisation really happened
    if qtype == T.Q8_0:
        assert any(t.tensor_type == T.Q8_0 for t in gguf.GGUFReader(path).tensors)
    assert_greedy_like(hf_holding(hf, state), path, "chunked")


# -- refusals ---------------------------------------------------------------------------------------


def _drop(key: str) -> Callable[[dict[str, Any], dict[str, np.ndarray]], None]:
    return lambda meta, tensors: meta.pop(key)


def _set(key: str, value: Any) -> Callable[[dict[str, Any], dict[str, np.ndarray]], None]:
    return lambda meta, tensors: meta.__setitem__(key, (value, meta[key][1] if key in meta else V.UINT32))


def _drop_tensors(part: str) -> Callable[[dict[str, Any], dict[str, np.ndarray]], None]:
    def edit(meta: dict[str, Any], tensors: dict[str, np.ndarray]) -> None:
        for name in [n for n in tensors if part in n]:
            del tensors[name]
    return edit


@pytest.mark.parametrize("variant, edit, message", [
    ("v3-plain-q", _drop("deepseek2.attention.kv_lora_rank"), r"no deepseek2\.attention\.kv_lora_rank"),
    ("v3-plain-q", _set("deepseek2.expert_gating_func", 3), r"expert_gating_func=3 is not supported"),
    ("v3-plain-q", _drop_tensors("exp_probs_b"), r"sigmoid gating without the score-correction bias"),
    ("v2-softmax", _set("deepseek2.expert_gating_func", 2), r"sigmoid gating without the score-correction bias"),
    ("v3-plain-q", _set("deepseek2.attention.key_length_mla", 20), r"blk\.0\.attn_q\.weight has shape"),
    ("v3-plain-q", _set("deepseek2.attention.value_length_mla", 8), r"blk\.0\.attn_output\.weight has shape"),
    ("v3-plain-q", _set("deepseek2.attention.q_lora_rank", 32), r"blk\.0\.attn_q_a\.weight is missing"),
    ("v3-qlora-yarn", _drop("deepseek2.attention.q_lora_rank"), r"blk\.0\.attn_q\.weight is missing"),
    ("v3-qlora-yarn", _set("deepseek2.leading_dense_block_count", 2), r"leading_dense_block_count=2"),
    ("v3-plain-q", _drop_tensors("blk.1.attn_v_b"), r"blk\.1\.attn_v_b\.weight is missing"),
    ("v3-plain-q", _set("deepseek2.expert_count", 0), r"without routed experts"),
])
def test_inconsistent_deepseek2_files_are_refused(saved, tmp_path, variant, edit, message):  # type: ignore[no-untyped-def]
    _, hf_dir = saved(variant)
    write_deepseek_gguf(tmp_path / "bad.gguf", hf_dir, edit=edit)
    with pytest.raises(ConfigError, match=message):
        load_model_weights(tmp_path / "bad.gguf")


def _add_tensor(name: str, array: np.ndarray) -> Callable[[dict[str, Any], dict[str, np.ndarray]], None]:
    return lambda meta, tensors: tensors.__setitem__(name, array)


def test_unknown_tensor_is_refused_by_name(saved, tmp_path):  # type: ignore[no-untyped-def]
    _, hf_dir = saved("v3-plain-q")
    bias = _add_tensor("blk.0.attn_output.bias", np.zeros(64, np.float32))
    write_deepseek_gguf(tmp_path / "bias.gguf", hf_dir, edit=bias)
    with pytest.raises(ConfigError, match=r"'blk\.0\.attn_output\.bias' has no place"):
        load_model_weights(tmp_path / "bias.gguf")


def test_routing_keys_older_and_optional(saved, tmp_path):  # type: ignore[no-untyped-def]
    """No expert_gating_func (older V2 files): softmax, as llama.cpp defaults. expert_weights_norm set on a
    softmax file: renormalised top-k weights, as llama.cpp computes them (no transformers oracle: its V2
    ignores the flag). No expert_group_count: greedy."""
    _, hf_dir = saved("v2-softmax")
    reference = load_model_weights(hf_dir).config
    write_deepseek_gguf(tmp_path / "old.gguf", hf_dir, split=False, edit=_drop("deepseek2.expert_gating_func"))
    assert load_gguf(tmp_path / "old.gguf")[0] == reference

    def norm_no_groups(meta: dict[str, Any], tensors: dict[str, np.ndarray]) -> None:
        meta["deepseek2.expert_weights_norm"] = (True, V.BOOL)
        del meta["deepseek2.expert_group_count"], meta["deepseek2.expert_group_used_count"]

    write_deepseek_gguf(tmp_path / "norm.gguf", hf_dir, edit=norm_no_groups)
    moe = load_gguf(tmp_path / "norm.gguf")[0].moe
    assert (moe.scoring, moe.topk_method, moe.n_group, moe.norm_topk_prob) == ("softmax", "greedy", 1, True)


def test_packed_weights_stay_refused_for_latent_attention(saved, tmp_path):  # type: ignore[no-untyped-def]
    _, hf_dir = saved("v3-plain-q")
    write_deepseek_gguf(tmp_path / "q8.gguf", hf_dir, qtype=T.Q8_0)
    for mode in ("native", "q8_0"):
        with pytest.raises(ConfigError, match="latent attention"):
            load_model_weights(tmp_path / "q8.gguf", mode)
    assert load_model_weights(tmp_path / "q8.gguf", "auto").weights == "fp32"


def test_deepseek2_tensor_names() -> None:
    assert gguf_to_our_name("blk.3.attn_q_a.weight") == "layers.3.q_a_proj"
    assert gguf_to_our_name("blk.3.attn_q_a_norm.weight") == "layers.3.q_a_norm"
    assert gguf_to_our_name("blk.3.attn_q_b.weight") == "layers.3.q_b_proj"
    assert gguf_to_our_name("blk.3.attn_kv_a_mqa.weight") == "layers.3.kv_a_proj"
    assert gguf_to_our_name("blk.3.attn_kv_a_norm.weight") == "layers.3.kv_a_norm"
    assert gguf_to_our_name("blk.3.attn_kv_b.weight") == "layers.3.kv_b_proj"
    assert gguf_to_our_name("blk.3.exp_probs_b.bias") == "layers.3.router_bias"
    assert gguf_to_our_name("blk.3.ffn_up_shexp.weight") == "layers.3.shared_expert.up_proj"
    assert gguf_to_our_name("blk.3.ffn_down_exps.weight") == "layers.3.experts.*.down_proj"
