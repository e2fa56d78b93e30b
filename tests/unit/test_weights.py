"""Hugging Face directory loading (our names, config, sharding, tying), the model fingerprint, and the
reference-model cache."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from deepinfer.config.model import ModelConfig
from deepinfer.loading import fetch
from deepinfer.loading.fetch import fetch_smollm2, resolve_model
from deepinfer.loading.gguf import UnsupportedWeightError
from deepinfer.loading.weights import check_state_dict, load_model_weights, model_fingerprint

# Written out independently of the loader's table: the naming contract of weights.py.
_LAYER = {
    "input_layernorm.weight": "input_norm",
    "post_attention_layernorm.weight": "post_attn_norm",
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj",
    "self_attn.o_proj.weight": "o_proj",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "mlp.gate_proj.weight": "gate_proj",
    "mlp.up_proj.weight": "up_proj",
    "mlp.down_proj.weight": "down_proj",
}


def _expected(hf_state: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in hf_state.items():
        if name == "model.embed_tokens.weight":
            out["embed_tokens"] = value
        elif name == "model.norm.weight":
            out["norm"] = value
        elif name == "lm_head.weight":
            if not tied:
                out["lm_head"] = value
        else:
            _, _, layer, rest = name.split(".", 3)
            out[f"layers.{layer}.{_LAYER[rest]}"] = value
    return out


def _assert_state_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert got[name].dtype == torch.float32, name
        assert torch.equal(got[name], value), name


@pytest.mark.parametrize(
    ("architecture", "overrides"),
    [("llama", {}), ("llama", {"tie_word_embeddings": True}), ("qwen2", {})],
    ids=["llama", "llama-tied", "qwen2-bias"],
)
def test_hf_dir_state_dict_equals_transformers(tiny_hf_model, architecture: str, overrides: dict) -> None:
    tiny = tiny_hf_model(architecture, **overrides)
    loaded = load_model_weights(tiny.path)
    tied = bool(overrides.get("tie_word_embeddings"))
    _assert_state_equal(loaded.state_dict, _expected(tiny.state_dict, tied))
    c = loaded.config
    assert c.architecture == architecture
    assert c.attention_bias == (architecture == "qwen2")
    assert c.tie_word_embeddings == tied
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (2, 4, 2, 16)
    assert c.eos_token_ids == (2,) and c.bos_token_id == 1
    assert loaded.source == tiny.path


def test_sharded_checkpoint(tiny_hf_model) -> None:
    tiny = tiny_hf_model("llama", max_shard_size="40KB")
    assert (tiny.path / "model.safetensors.index.json").is_file()
    assert len(list(tiny.path.glob("*.safetensors"))) > 1
    _assert_state_equal(load_model_weights(tiny.path).state_dict, _expected(tiny.state_dict, tied=False))


def test_bf16_checkpoint_is_upcast(tiny_hf_model, tmp_path: Path) -> None:
    tiny = tiny_hf_model("llama")
    shutil.copy(tiny.path / "config.json", tmp_path / "config.json")
    save_file({k: v.to(torch.bfloat16) for k, v in tiny.state_dict.items()}, tmp_path / "model.safetensors")
    loaded = load_model_weights(tmp_path)
    want = {k: v.to(torch.bfloat16).float() for k, v in _expected(tiny.state_dict, tied=False).items()}
    _assert_state_equal(loaded.state_dict, want)


def test_unknown_checkpoint_tensor_is_refused(tiny_hf_model, tmp_path: Path) -> None:
    tiny = tiny_hf_model("llama")
    shutil.copy(tiny.path / "config.json", tmp_path / "config.json")
    extra = {**tiny.state_dict, "model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}
    save_file(extra, tmp_path / "model.safetensors")
    with pytest.raises(UnsupportedWeightError, match="o_proj.bias"):
        load_model_weights(tmp_path)


def test_missing_model_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"\.gguf.*config\.json.*safetensors"):
        load_model_weights(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model_weights(tmp_path)


def test_check_state_dict_names_problems(tiny_hf_model) -> None:
    loaded = load_model_weights(tiny_hf_model("llama").path)
    state = dict(loaded.state_dict)
    del state["layers.1.up_proj"]
    state["layers.0.k_proj"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"missing layers\.1\.up_proj.*layers\.0\.k_proj has shape \(3, 3\)"):
        check_state_dict(loaded.config, state)


def test_fingerprint_is_stable_and_sensitive(tiny_hf_model) -> None:
    tiny = tiny_hf_model("llama")
    first, second = load_model_weights(tiny.path), load_model_weights(tiny.path)
    assert first.fingerprint == second.fingerprint
    assert len(first.fingerprint) == 64 and int(first.fingerprint, 16) >= 0

    code = (
        "import sys; from deepinfer.loading.weights import load_model_weights; "
        "print(load_model_weights(sys.argv[1]).fingerprint)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tiny.path)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == first.fingerprint

    changed = {k: v.clone() for k, v in first.state_dict.items()}
    changed["layers.1.down_proj"][3, 5] += 1e-3
    assert model_fingerprint(first.config, changed) != first.fingerprint
    renamed = dataclasses.replace(first.config, rms_norm_eps=1e-5)
    assert model_fingerprint(renamed, first.state_dict) != first.fingerprint
    reordered = dict(reversed(list(first.state_dict.items())))
    assert model_fingerprint(first.config, reordered) == first.fingerprint


def test_generation_config_eos_ids_are_merged(tiny_hf_model, tmp_path: Path) -> None:
    tiny = tiny_hf_model("llama")
    for item in tiny.path.iterdir():
        shutil.copy(item, tmp_path / item.name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    config = load_model_weights(tmp_path).config
    assert isinstance(config, ModelConfig) and config.eos_token_ids == (2, 7)


# ----- the reference model cache (fetch.py) -----


def test_resolve_model_paths(tmp_path: Path) -> None:
    assert resolve_model(tmp_path) == tmp_path
    with pytest.raises(FileNotFoundError, match="smollm2"):
        resolve_model(tmp_path / "missing.gguf")


@pytest.mark.smollm2
def test_fetch_uses_verified_cache_and_refetches_bad_files(smollm2_path: Path, tmp_path: Path, monkeypatch) -> None:
    cached = tmp_path / "smollm2" / smollm2_path.name
    cached.parent.mkdir()
    shutil.copy(smollm2_path, cached)

    def no_download(*args, **kwargs):
        raise AssertionError("a verified cached file must not be downloaded again")

    monkeypatch.setattr(fetch.subprocess, "run", no_download)
    assert fetch_smollm2(tmp_path, progress=False) == cached
    assert cached.with_name(cached.name + ".verified").is_file()
    assert fetch_smollm2(tmp_path, progress=False) == cached
    monkeypatch.undo()

    cached.write_bytes(b"truncated")
    assert fetch_smollm2(tmp_path, progress=False) == cached
    assert cached.stat().st_size == fetch.SMOLLM2_SIZE
    assert not list(cached.parent.glob(".download-*"))
