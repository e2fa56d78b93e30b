"""GGUF loading: our dequantisation against gguf's reference, metadata → ModelConfig, and tensors
(including llama.cpp's Q/K permutation) against the Hugging Face weights they were written from."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFWriter, RopeScalingType, quants
from gguf import GGMLQuantizationType as T

from deepinfer.config.gguf_metadata import open_gguf
from deepinfer.config.model import ModelConfig
from deepinfer.loading.gguf import UnsupportedWeightError, dequantize, gguf_to_our_name
from deepinfer.loading.gguf_model import config_from_gguf, load_gguf
from deepinfer.loading.weights import hf_to_our_name, load_model_weights
from tests import oracle_memo

SUPPORTED = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1]
QUANTIZED = [T.Q8_0, T.Q4_0, T.Q4_1]


# ----- dequantisation -----


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
def test_dequantize_matches_gguf_reference(qtype: T) -> None:
    data = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32) * 3
    raw = quants.quantize(data, qtype)
    ours = dequantize(raw, qtype, data.shape)
    assert ours.dtype == np.float32 and ours.shape == data.shape
    np.testing.assert_array_equal(ours, quants.dequantize(raw, qtype))


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
def test_dequantize_random_bytes_matches_gguf_reference(qtype: T) -> None:
    rng = np.random.default_rng(int(qtype))
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(5, 4 * size), dtype=np.uint8)
    if qtype in QUANTIZED:
        # Finite f16 scale (and min, for Q4_1) at the start of every block.
        blocks = raw.reshape(-1, size)
        n_scales = 2 if qtype == T.Q4_1 else 1
        blocks[:, : 2 * n_scales] = rng.uniform(-4, 4, (len(blocks), n_scales)).astype(np.float16).view(np.uint8)
    shape = (5, 4 * block)
    # NaN bit patterns from random F16/BF16 bytes compare equal position by position.
    np.testing.assert_array_equal(dequantize(raw, qtype, shape), quants.dequantize(raw, qtype))


def _f16(x: float) -> np.ndarray:
    return np.array([x], dtype=np.float16).view(np.uint8)


def test_q8_0_block_by_hand() -> None:
    q = np.arange(-16, 16, dtype=np.int8)
    raw = np.concatenate([_f16(0.5), q.view(np.uint8)])
    assert dequantize(raw, T.Q8_0, (32,)).tolist() == [0.5 * v for v in range(-16, 16)]


def test_q4_0_block_by_hand() -> None:
    low, high = np.arange(16), 15 - np.arange(16)  # low nibbles → elements 0-15, high → 16-31
    raw = np.concatenate([_f16(2.0), (low | high << 4).astype(np.uint8)])
    expected = [2.0 * (v - 8) for v in [*low.tolist(), *high.tolist()]]
    assert dequantize(raw, T.Q4_0, (32,)).tolist() == expected


def test_q4_1_block_by_hand() -> None:
    low, high = np.arange(16), (np.arange(16) * 7) % 16
    raw = np.concatenate([_f16(0.25), _f16(-1.0), (low | high << 4).astype(np.uint8)])
    expected = [0.25 * v - 1.0 for v in [*low.tolist(), *high.tolist()]]
    assert dequantize(raw, T.Q4_1, (32,)).tolist() == expected


def test_bf16_by_hand() -> None:
    raw = np.array([0x3F80, 0xC000, 0x4049], dtype=np.uint16).view(np.uint8)
    np.testing.assert_array_equal(dequantize(raw, T.BF16, (3,)), np.array([1.0, -2.0, 3.140625], np.float32))


def test_unsupported_type_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedWeightError, match=r"'blk\.0\.attn_q\.weight'.*Q4_K"):
        dequantize(np.zeros(144, np.uint8), T.Q4_K, (256,), "blk.0.attn_q.weight")


# ----- a tiny GGUF written from a tiny Hugging Face model -----

_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}


def _gguf_name(hf: str) -> str:
    if hf in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf]
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_GGUF_LAYER[rest]}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to llama Q/K (weights and biases)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny_gguf(path: Path, tiny, qtype: T = T.F32, rope: dict | None = None) -> dict[str, np.ndarray]:
    """Write `tiny` as llama.cpp would; returns each tensor's dequantised stored value (GGUF layout)."""
    config = ModelConfig.from_hf_dict(json.loads((tiny.path / "config.json").read_text()))
    arch = config.architecture
    w = GGUFWriter(path, arch)
    w.add_block_count(config.num_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_rope_freq_base(config.rope_theta)
    w.add_rope_dimension_count(config.head_dim)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(config.vocab_size)
    w.add_bos_token_id(config.bos_token_id)
    w.add_eos_token_id(config.eos_token_ids[0])
    if rope:
        w.add_rope_scaling_type(rope["type"])
        w.add_rope_scaling_factor(rope["factor"])
        if "original" in rope:
            w.add_rope_scaling_orig_ctx_len(rope["original"])
    stored: dict[str, np.ndarray] = {}
    for hf_name, tensor in tiny.state_dict.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name, array = _gguf_name(hf_name), tensor.numpy()
        if arch == "llama" and ".attn_q." in name:
            array = _llama_cpp_permute(array, config.num_heads)
        elif arch == "llama" and ".attn_k." in name:
            array = _llama_cpp_permute(array, config.num_kv_heads)
        if array.ndim == 2 and qtype != T.F32:
            raw = quants.quantize(array, qtype)
            w.add_tensor(name, raw, raw_dtype=qtype if raw.dtype == np.uint8 else None)
            stored[name] = quants.dequantize(raw, qtype)
        else:
            w.add_tensor(name, array)
            stored[name] = array
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def _hf_to_ours(hf: str) -> str:
    return gguf_to_our_name(_gguf_name(hf))


def test_tiny_llama_gguf_equals_hf_weights(tiny_hf_model, tmp_path: Path) -> None:
    tiny = tiny_hf_model("llama")
    _write_tiny_gguf(tmp_path / "tiny.gguf", tiny)
    config, state = load_gguf(tmp_path / "tiny.gguf")
    expected = {_hf_to_ours(k): v for k, v in tiny.state_dict.items()}
    assert state.keys() == expected.keys()
    for name, value in expected.items():
        assert state[name].dtype == torch.float32
        assert torch.equal(state[name], value), name
    hf_config = ModelConfig.from_hf_dict(json.loads((tiny.path / "config.json").read_text()))
    assert config == hf_config


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
def test_tiny_llama_gguf_types_and_unpermute(tiny_hf_model, tmp_path: Path, qtype: T) -> None:
    tiny = tiny_hf_model("llama")
    stored = _write_tiny_gguf(tmp_path / "tiny.gguf", tiny, qtype)
    config, state = load_gguf(tmp_path / "tiny.gguf")
    for gguf_name, value in stored.items():
        ours = state[gguf_to_our_name(gguf_name)].numpy()
        if ".attn_q." in gguf_name:
            ours = _llama_cpp_permute(ours, config.num_heads)
        elif ".attn_k." in gguf_name:
            ours = _llama_cpp_permute(ours, config.num_kv_heads)
        np.testing.assert_array_equal(ours, value.astype(np.float32), err_msg=gguf_name)
    # Quantisation error is small against the weights' spread (std 0.5); a wrong row order is not.
    for hf_name, value in tiny.state_dict.items():
        error = (state[_hf_to_ours(hf_name)] - value).abs().mean().item()
        assert error < 0.1, (hf_name, error)


def test_tiny_qwen2_gguf_keeps_layout_and_biases(tiny_hf_model, tmp_path: Path) -> None:
    tiny = tiny_hf_model("qwen2")
    _write_tiny_gguf(tmp_path / "tiny.gguf", tiny)
    config, state = load_gguf(tmp_path / "tiny.gguf")
    assert config.architecture == "qwen2" and config.attention_bias
    expected = {_hf_to_ours(k): v for k, v in tiny.state_dict.items()}
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], v) for k, v in expected.items())


def test_tied_embeddings_without_output_tensor(tiny_hf_model, tmp_path: Path) -> None:
    tiny = tiny_hf_model("llama", tie_word_embeddings=True)
    _write_tiny_gguf(tmp_path / "tied.gguf", tiny)
    loaded = load_model_weights(tmp_path / "tied.gguf")
    assert loaded.config.tie_word_embeddings
    assert "lm_head" not in loaded.state_dict
    assert torch.equal(loaded.state_dict["embed_tokens"], tiny.state_dict["model.embed_tokens.weight"])


def test_rope_scaling_metadata(tiny_hf_model, tmp_path: Path) -> None:
    tiny = tiny_hf_model("llama")
    _write_tiny_gguf(tmp_path / "linear.gguf", tiny, rope={"type": RopeScalingType.LINEAR, "factor": 2.0})
    assert config_from_gguf(open_gguf(tmp_path / "linear.gguf")).rope_scaling == {
        "rope_type": "linear",
        "factor": 2.0,
    }
    yarn = {"type": RopeScalingType.YARN, "factor": 4.0, "original": 64}
    _write_tiny_gguf(tmp_path / "yarn.gguf", tiny, rope=yarn)
    assert config_from_gguf(open_gguf(tmp_path / "yarn.gguf")).rope_scaling == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
    }


def test_unsupported_tensor_type_in_file_names_tensor(tmp_path: Path) -> None:
    w = GGUFWriter(tmp_path / "k.gguf", "llama")
    for key, value in [("block_count", 1), ("embedding_length", 256), ("feed_forward_length", 256)]:
        w.add_uint32(f"llama.{key}", value)
    w.add_head_count(4)
    w.add_tensor("token_embd.weight", np.zeros((4, 144), np.uint8), raw_dtype=T.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedWeightError, match=r"'token_embd\.weight'.*Q4_K"):
        load_gguf(tmp_path / "k.gguf")


# ----- the real SmolLM2 file -----


def _digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's fp32 bytes; + 0.0 makes -0.0 +0.0, so equal digests are what torch.equal means."""
    return oracle_memo.tensors_digest({"": t.float() + 0.0})


def _transformers_gguf_digests(path: Path) -> dict[str, str]:
    """transformers' own GGUF loader's tensors for `path`, in our names, as `_digest`s."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    hf_config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    reference = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    return {hf_to_our_name(k): _digest(v) for k, v in reference.items() if k != "lm_head.weight"}


@pytest.mark.smollm2
def test_smollm2_gguf_matches_transformers_loader(smollm2_path: Path, smollm2_oracle: Any) -> None:
    loaded = smollm2_oracle.loaded
    c = loaded.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert (c.vocab_size, c.head_dim, c.rope_theta, c.tie_word_embeddings) == (49152, 64, 100000.0, True)
    assert c.eos_token_ids == (2,) and c.bos_token_id == 1

    # transformers' answer, from the oracle memo when pytest runs with --oracle-memo (tests/oracle_memo.py).
    reference = oracle_memo.remember(
        "gguf-tensors", lambda: oracle_memo.file_digest(smollm2_path),
        [inspect.getsource(_transformers_gguf_digests), inspect.getsource(_digest)],
        lambda: _transformers_gguf_digests(smollm2_path))
    assert reference.keys() == loaded.state_dict.keys()
    for name, digest in reference.items():
        value = loaded.state_dict[name]
        assert not value.isnan().any() and _digest(value) == digest, name
