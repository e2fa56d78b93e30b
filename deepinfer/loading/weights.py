"""Model weights from a Hugging Face directory or a GGUF file, as one state dict in our names.

Naming contract (every loader produces it, every model consumes it; fp32 tensors, projections
shaped [out, in] like `nn.Linear.weight`, Q/K in Hugging Face's rotary layout). With packed weights
(`load_model_weights(weights="native" | "q8_0")`) the projections and embedding that
`packed_weights.packable` names may instead be `PackedWeight`s of the same [out, in]:

    embed_tokens             [vocab, hidden]
    norm                     [hidden]                  final RMSNorm weight
    lm_head                  [vocab, hidden]           absent when config.tie_word_embeddings
    layers.{i}.input_norm    [hidden]                  RMSNorm before attention
    layers.{i}.post_attn_norm [hidden]                 RMSNorm before the MLP
    layers.{i}.q_proj        [num_heads·head_dim, hidden]
    layers.{i}.k_proj        [num_kv_heads·head_dim, hidden]
    layers.{i}.v_proj        [num_kv_heads·head_dim, hidden]
    layers.{i}.o_proj        [hidden, num_heads·head_dim]
    layers.{i}.q_bias        [num_heads·head_dim]      q/k/v biases only when config.attention_bias
    layers.{i}.k_bias        [num_kv_heads·head_dim]
    layers.{i}.v_bias        [num_kv_heads·head_dim]
    layers.{i}.gate_proj     [intermediate, hidden]    dense MLP: every layer of a dense model, and the
    layers.{i}.up_proj       [intermediate, hidden]    layers a MoE config calls dense (Qwen2-MoE's
    layers.{i}.down_proj     [hidden, intermediate]    mlp_only_layers)

A sparse (mixture-of-experts) layer has instead, with E = moe.num_experts, I = expert_intermediate_size,
S = shared_expert_intermediate_size:

    layers.{i}.router                     [E, hidden]  router logits = router · x
    layers.{i}.experts.{e}.gate_proj      [I, hidden]  expert e's SwiGLU, e in 0..E-1
    layers.{i}.experts.{e}.up_proj        [I, hidden]
    layers.{i}.experts.{e}.down_proj      [hidden, I]
    layers.{i}.shared_expert.gate_proj    [S, hidden]  only when S > 0
    layers.{i}.shared_expert.up_proj      [S, hidden]
    layers.{i}.shared_expert.down_proj    [hidden, S]
    layers.{i}.shared_expert_gate         [1, hidden]  only when moe.shared_expert_gated

A DeepSeek-V2/V3 layer (`config.mla` set; H = num_heads, N/R/V = qk_nope/qk_rope/v_head_dim,
C = kv_lora_rank, Q = q_lora_rank) has multi-head latent attention instead of q/k/v_proj:

    layers.{i}.q_proj        [H·(N+R), hidden]         only when Q is None
    layers.{i}.q_a_proj      [Q, hidden]               only when Q is set: q = q_b(norm(q_a(x)))
    layers.{i}.q_a_norm      [Q]
    layers.{i}.q_b_proj      [H·(N+R), Q]
    layers.{i}.kv_a_proj     [C+R, hidden]             latent (C) then the shared rope key (R)
    layers.{i}.kv_a_norm     [C]
    layers.{i}.kv_b_proj     [H·(N+V), C]              per head: no-rope key rows, then value rows
    layers.{i}.o_proj        [hidden, H·V]
    layers.{i}.q_a_bias      [Q]                       biases only when config.attention_bias
    layers.{i}.kv_a_bias     [C+R]                     (q_a_bias only when Q is set)
    layers.{i}.o_bias        [hidden]

Its rope rows are in the checkpoint's order (interleaved pairs when mla.rope_interleave); the model
reorders them. Its sparse layers have the MoE names above with `shared_expert.*` the ungated shared
experts (HF `mlp.shared_experts.*`), and, for DeepSeek-V3's noaux_tc routing,

    layers.{i}.router_bias   [E]                       e_score_correction_bias: added for choosing only

Tensors of layers past num_hidden_layers (DeepSeek-V3's multi-token-prediction module,
`model.layers.61.*`) are not loaded: the engine does not run them.

Experts are always one tensor per expert here, whatever the checkpoint stores: Hugging Face per-expert
tensors (Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2`, Qwen2-MoE's `mlp.experts.{e}.gate_proj/
up_proj/down_proj`) map one to one, and the fused 3-D tensors transformers 5 writes with
`save_original_format=False` (`mlp.experts.gate_up_proj` [E, 2I, hidden], gate rows first, and
`mlp.experts.down_proj` [E, hidden, I]) are split per expert on load (views, no copy).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from deepinfer.config.engine import WEIGHTS_MODES
from deepinfer.config.gguf_metadata import open_gguf
from deepinfer.config.model import ConfigError, ModelConfig
from deepinfer.loading.gguf import UnsupportedWeightError
from deepinfer.loading.gguf_model import config_from_gguf, load_gguf
from deepinfer.loading.identity import model_config_at
from deepinfer.loading.packed_weights import (
    PackedWeight,
    Weight,
    packable,
    quantize_state_q8_0,
    resolve_weights_mode,
    weight_shape,
)

_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_LAYER_NAMES = {
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
# Multi-head latent attention (DeepSeek-V2/V3), mapped only for a config with `mla` (elsewhere, e.g. an
# o_proj bias in a Llama checkpoint, these tensors have no place and are refused by name).
_HF_MLA_NAMES = {
    "self_attn.q_a_proj.weight": "q_a_proj",
    "self_attn.q_a_layernorm.weight": "q_a_norm",
    "self_attn.q_b_proj.weight": "q_b_proj",
    "self_attn.kv_a_proj_with_mqa.weight": "kv_a_proj",
    "self_attn.kv_a_layernorm.weight": "kv_a_norm",
    "self_attn.kv_b_proj.weight": "kv_b_proj",
    "self_attn.q_a_proj.bias": "q_a_bias",
    "self_attn.kv_a_proj_with_mqa.bias": "kv_a_bias",
    "self_attn.o_proj.bias": "o_bias",
}
# Mixture-of-experts names, after "model.layers.{i}." and Mixtral's `block_sparse_moe.` or the `mlp.` prefix.
_HF_MOE_NAMES = {
    "gate.weight": "router",
    "shared_expert.gate_proj.weight": "shared_expert.gate_proj",
    "shared_expert.up_proj.weight": "shared_expert.up_proj",
    "shared_expert.down_proj.weight": "shared_expert.down_proj",
    "shared_expert_gate.weight": "shared_expert_gate",
    # DeepSeek: ungated shared experts, and V3's selection bias.
    "shared_experts.gate_proj.weight": "shared_expert.gate_proj",
    "shared_experts.up_proj.weight": "shared_expert.up_proj",
    "shared_experts.down_proj.weight": "shared_expert.down_proj",
    "gate.e_score_correction_bias": "router_bias",
}
_HF_EXPERT = re.compile(r"(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
_HF_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_HF_FUSED_EXPERTS = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(gate_up_proj|down_proj)")
_HF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "embed_tokens",
    "model.norm.weight": "norm",
    "lm_head.weight": "lm_head",
}
# Buffers some checkpoints carry that are recomputed from the config.
_HF_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    # fp32 tensors; `PackedWeight` projections when `weights` is "native" or "q8_0" (see packed_weights.py).
    state_dict: dict[str, Weight]
    fingerprint: str
    source: Path
    weights: str = "fp32"  # the resolved weights mode: "native", "q8_0" or "fp32"


def load_model_weights(path: str | os.PathLike[str], weights: str = "fp32", device: str = "cpu") -> LoadedModel:
    """Load a Hugging Face model directory (config.json + *.safetensors) or a `.gguf` file, its projections
    held as `weights` says (config.WEIGHTS_MODES; "auto" resolved for `device`, see packed_weights.py)."""
    source = Path(path)
    gguf = source.is_file() and source.suffix == ".gguf"
    if not gguf and not (source.is_dir() and (source / "config.json").is_file() and any(source.glob("*.safetensors"))):
        raise FileNotFoundError(
            f"no model at {str(source)!r}: expected a .gguf file or a directory holding config.json "
            "and *.safetensors"
        )
    if weights not in WEIGHTS_MODES:
        raise ConfigError(f"weights must be one of {', '.join(WEIGHTS_MODES)}, got {weights!r}")
    state: dict[str, Weight]
    if gguf:
        reader = open_gguf(source)  # parsed once: its metadata (the vocabulary above all) takes a while
        mode = resolve_weights_mode(weights, source, config_from_gguf(reader), device)
        config, state = load_gguf(reader, packable if mode == "native" else None)
    else:
        mode = resolve_weights_mode(weights, source, model_config_at(source), device)  # before any weights
        config, state = load_hf_dir(source)
    if mode == "q8_0":
        state = quantize_state_q8_0(state, config)
    check_state_dict(config, state)
    return LoadedModel(config, state, model_fingerprint(config, state), source, mode)


def load_hf_dir(path: str | os.PathLike[str]) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and fp32 state dict (our names) of a Hugging Face model directory, sharded or not."""
    root = Path(path)
    config = ModelConfig.from_hf_dict(json.loads((root / "config.json").read_text()))
    generation = root / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        extra = eos if isinstance(eos, list) else [] if eos is None else [eos]
        merged = tuple(dict.fromkeys([*config.eos_token_ids, *extra]))
        config = dataclasses.replace(config, eos_token_ids=merged)
    state: dict[str, torch.Tensor] = {}
    for shard in _safetensors_files(root):
        with safe_open(str(shard), framework="pt") as f:
            for hf_name in f.keys():
                if _HF_IGNORED.fullmatch(hf_name) or _beyond_last_layer(hf_name, config):
                    continue
                fused = _HF_FUSED_EXPERTS.fullmatch(hf_name)
                if fused:
                    tensor = f.get_tensor(hf_name).to(torch.float32).contiguous()
                    state.update(split_fused_experts(int(fused.group(1)), fused.group(2), tensor))
                    continue
                name = hf_to_our_name(hf_name, mla=config.mla is not None)
                if name == "lm_head" and config.tie_word_embeddings:
                    continue
                state[name] = f.get_tensor(hf_name).to(torch.float32).contiguous()
    return config, state


def _beyond_last_layer(hf_name: str, config: ModelConfig) -> bool:
    """A tensor of a layer the config does not have: DeepSeek-V3's multi-token-prediction module is
    stored as the layers after the last (`model.layers.61.*` for 61 layers) and is not run here."""
    m = _HF_LAYER.fullmatch(hf_name)
    return config.mla is not None and m is not None and int(m.group(1)) >= config.num_layers


def split_fused_experts(layer: int, kind: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-expert tensors (our names) from a fused 3-D one: `gate_up_proj` [E, 2I, hidden] (gate rows
    first) or `down_proj` [E, hidden, I]. The results are views into `tensor`, each contiguous."""
    if tensor.dim() != 3 or (kind == "gate_up_proj" and tensor.shape[1] % 2):
        raise UnsupportedWeightError(f"fused expert tensor {kind} of layer {layer} has shape "
                                     f"{tuple(tensor.shape)}; expected [experts, 2·intermediate, hidden] "
                                     "or [experts, hidden, intermediate]")
    p = f"layers.{layer}.experts."
    out: dict[str, torch.Tensor] = {}
    for e, w in enumerate(tensor.unbind(0)):
        if kind == "gate_up_proj":
            gate, up = w.chunk(2, dim=0)
            out[f"{p}{e}.gate_proj"], out[f"{p}{e}.up_proj"] = gate, up
        else:
            out[f"{p}{e}.down_proj"] = w
    return out


def _safetensors_files(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [root / s for s in shards]
    return sorted(root.glob("*.safetensors"))


def hf_to_our_name(hf_name: str, mla: bool = False) -> str:
    """Our name of a Hugging Face tensor; `mla`: the checkpoint is a latent-attention (DeepSeek) one."""
    if hf_name in _HF_GLOBAL_NAMES:
        return _HF_GLOBAL_NAMES[hf_name]
    m = _HF_LAYER.fullmatch(hf_name)
    if m:
        layer, rest = m.group(1), m.group(2)
        if rest in _HF_LAYER_NAMES:
            return f"layers.{layer}.{_HF_LAYER_NAMES[rest]}"
        if mla and rest in _HF_MLA_NAMES:
            return f"layers.{layer}.{_HF_MLA_NAMES[rest]}"
        moe_rest = rest.split(".", 1)[1] if rest.startswith(("mlp.", "block_sparse_moe.")) else ""
        if moe_rest in _HF_MOE_NAMES:
            return f"layers.{layer}.{_HF_MOE_NAMES[moe_rest]}"
        expert = _HF_EXPERT.fullmatch(rest)
        if expert:
            e, proj = expert.groups()
            return f"layers.{layer}.experts.{e}.{_HF_EXPERT_NAMES.get(proj, proj)}"
    raise UnsupportedWeightError(f"checkpoint tensor {hf_name!r} has no place in a Llama-family model")


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every name of the naming contract this config needs, with its shape."""
    h, v, f = config.hidden_size, config.vocab_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens": (v, h), "norm": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (v, h)
    moe = config.moe
    for i in range(config.num_layers):
        p = f"layers.{i}."
        layer: dict[str, tuple[int, ...]] = {"input_norm": (h,), "post_attn_norm": (h,)}
        if config.mla is not None:
            layer |= _mla_shapes(config)
        else:
            layer |= {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q)}
            if config.attention_bias:
                layer |= {"q_bias": (q,), "k_bias": (kv,), "v_bias": (kv,)}
        if moe is not None and moe.is_sparse_layer(i):
            layer["router"] = (moe.num_experts, h)
            if moe.topk_method == "noaux_tc":
                layer["router_bias"] = (moe.num_experts,)
            for e in range(moe.num_experts):
                layer |= _mlp_shapes(f"experts.{e}.", h, moe.expert_intermediate_size)
            if moe.shared_expert_intermediate_size:
                layer |= _mlp_shapes("shared_expert.", h, moe.shared_expert_intermediate_size)
            if moe.shared_expert_gated:
                layer["shared_expert_gate"] = (1, h)
        else:
            layer |= _mlp_shapes("", h, f)
        shapes.update({p + n: s for n, s in layer.items()})
    return shapes


def _mla_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """One layer's multi-head latent attention tensors (see the module docstring)."""
    mla, h, heads = config.mla, config.hidden_size, config.num_heads
    assert mla is not None
    q_out = heads * mla.qk_head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "kv_a_proj": (mla.latent_dim, h), "kv_a_norm": (mla.kv_lora_rank,),
        "kv_b_proj": (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
        "o_proj": (h, heads * mla.v_head_dim),
    }
    if mla.q_lora_rank is None:
        shapes["q_proj"] = (q_out, h)
    else:
        shapes |= {"q_a_proj": (mla.q_lora_rank, h), "q_a_norm": (mla.q_lora_rank,),
                   "q_b_proj": (q_out, mla.q_lora_rank)}
    if config.attention_bias:
        shapes |= {"kv_a_bias": (mla.latent_dim,), "o_bias": (h,)}
        if mla.q_lora_rank is not None:
            shapes["q_a_bias"] = (mla.q_lora_rank,)
    return shapes


def _mlp_shapes(prefix: str, hidden: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}gate_proj": (intermediate, hidden), f"{prefix}up_proj": (intermediate, hidden),
            f"{prefix}down_proj": (hidden, intermediate)}


def check_state_dict(config: ModelConfig, state: dict[str, Weight]) -> None:
    """Raise ValueError naming every missing, unexpected or misshapen tensor."""
    expected = expected_shapes(config)
    problems = [f"missing {n}" for n in expected if n not in state]
    problems += [f"unexpected {n}" for n in state if n not in expected]
    problems += [
        f"{n} has shape {weight_shape(state[n])}, expected {shape}"
        for n, shape in expected.items()
        if n in state and weight_shape(state[n]) != shape
    ]
    if problems:
        shown = "; ".join(problems[:10]) + (f"; … {len(problems) - 10} more" if len(problems) > 10 else "")
        raise ValueError(f"weights do not match the model config: {shown}")


def model_fingerprint(config: ModelConfig, state_dict: dict[str, Weight]) -> str:
    """sha256 hex over the config and every tensor's name, dtype, shape and bytes, in name order (a
    packed weight: its format, shape and blocks — so a mesh refuses to mix packed and fp32 workers,
    whose products differ in rounding)."""
    h = hashlib.sha256()
    h.update(json.dumps(config.to_dict(), sort_keys=True, separators=(",", ":")).encode())
    for name in sorted(state_dict):
        w = state_dict[name]
        t = (w.blocks if isinstance(w, PackedWeight) else w).detach().cpu().contiguous()
        dtype = w.format if isinstance(w, PackedWeight) else str(t.dtype)
        header = {"name": name, "dtype": dtype, "shape": list(weight_shape(w))}
        h.update(b"\0" + json.dumps(header, sort_keys=True, separators=(",", ":")).encode() + b"\0")
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()
