"""GGUF files: metadata → `ModelConfig`, tensors → an fp32 state dict in our names (see weights.py).

The `gguf` package only parses the container here; dequantisation is our own vectorised numpy, one
pass over whole tensors with no per-block Python loop. Supported tensor types: F32, F16, BF16, Q8_0,
Q4_0, Q4_1; anything else raises `UnsupportedWeightError`.

llama.cpp's converter stores the Q and K projections of `llama` models with each head's rotary
halves interleaved (its rotary layout); `load_gguf` undoes that so the weights match Hugging Face's.

Mixture-of-experts files: a `llama` file with `llama.expert_count` is a Mixtral, a `qwen2moe` file a
Qwen2-MoE. Their sparse layers hold `ffn_gate_inp` (the router), the experts fused into 3-D
`ffn_gate_exps`/`ffn_up_exps`/`ffn_down_exps` (split per expert here; the per-expert
`ffn_gate.{e}` names of older Mixtral files are read too) and, for Qwen2-MoE, the shared expert
`ffn_gate_shexp`/`ffn_up_shexp`/`ffn_down_shexp` with its gate `ffn_gate_inp_shexp`. A layer that
has `ffn_gate` instead of a router is dense.

DeepSeek-V2/V2-Lite/V3 files (`deepseek2`: latent attention, DeepSeek routing) are read by
`gguf_deepseek.py`; their tensor names are in `_MLA_NAMES` below. `gguf_model.py` puts the two together:
`config_from_gguf` and `load_gguf` read any supported file.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from deepinfer.config.gguf_metadata import GgufFile, GgufTensor, metadata
from deepinfer.config.model import ConfigError, MoEConfig

QK = 32  # elements per block of every supported quantized type
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")

# GGUF tensor name (after "blk.{i}.") → our per-layer name.
_LAYER_NAMES = {
    "attn_norm.weight": "input_norm",
    "ffn_norm.weight": "post_attn_norm",
    "attn_q.weight": "q_proj",
    "attn_k.weight": "k_proj",
    "attn_v.weight": "v_proj",
    "attn_output.weight": "o_proj",
    "attn_q.bias": "q_bias",
    "attn_k.bias": "k_bias",
    "attn_v.bias": "v_bias",
    "ffn_gate.weight": "gate_proj",
    "ffn_up.weight": "up_proj",
    "ffn_down.weight": "down_proj",
}
# Sparse-layer names (after "blk.{i}.") → ours; the fused 3-D expert tensors map to a per-expert suffix.
_MOE_NAMES = {
    "ffn_gate_inp.weight": "router",
    "ffn_gate_shexp.weight": "shared_expert.gate_proj",
    "ffn_up_shexp.weight": "shared_expert.up_proj",
    "ffn_down_shexp.weight": "shared_expert.down_proj",
    "ffn_gate_inp_shexp.weight": "shared_expert_gate",
}
_FUSED_EXPERTS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
                  "ffn_down_exps.weight": "down_proj"}
# Latent attention and DeepSeek routing (deepseek2 files). `attn_k_b`/`attn_v_b` are kv_b_proj split per
# head; gguf_deepseek.join_kv_b turns the pair back into `kv_b_proj`.
_MLA_NAMES = {
    "attn_q_a.weight": "q_a_proj",
    "attn_q_a_norm.weight": "q_a_norm",
    "attn_q_b.weight": "q_b_proj",
    "attn_kv_a_mqa.weight": "kv_a_proj",
    "attn_kv_a_norm.weight": "kv_a_norm",
    "attn_kv_b.weight": "kv_b_proj",
    "attn_k_b.weight": "k_b_proj",
    "attn_v_b.weight": "v_b_proj",
    "exp_probs_b.bias": "router_bias",
}
_SPLIT_EXPERT = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}  # blk.N.ffn_gate.E.weight
_GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens",
    "output_norm.weight": "norm",
    "output.weight": "lm_head",
}
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen2moe", "deepseek2")
_ROPE_TYPES = {"linear": "linear", "yarn": "yarn"}


class UnsupportedWeightError(ValueError):
    """A tensor stored in a type (or under a name) this loader cannot turn into fp32 weights."""


def dequantize(raw: np.ndarray, qtype: int, shape: Sequence[int], name: str = "<tensor>") -> np.ndarray:
    """fp32 array of `shape` (numpy order, last axis contiguous) from a tensor's stored data."""
    try:
        kind = GGMLQuantizationType(qtype)
    except ValueError:
        kind = None
    type_name = kind.name if kind is not None else f"type {qtype}"
    if type_name not in SUPPORTED_TYPES:
        raise UnsupportedWeightError(
            f"tensor {name!r} is stored as {type_name}, which this loader cannot dequantize; "
            f"supported: {', '.join(SUPPORTED_TYPES)}"
        )
    shape = tuple(int(d) for d in shape)
    n = int(np.prod(shape, dtype=np.int64))
    if kind == GGMLQuantizationType.F32:
        out = np.array(np.asarray(raw).view(np.float32).reshape(-1))  # a copy: `raw` may be a read-only map
    elif kind == GGMLQuantizationType.F16:
        out = np.asarray(raw).view(np.float16).reshape(-1).astype(np.float32)
    elif kind == GGMLQuantizationType.BF16:
        # bf16 is the upper half of an fp32.
        bits = np.ascontiguousarray(raw).view(np.uint16).reshape(-1).astype(np.uint32) << 16
        out = bits.view(np.float32)
    else:
        data = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
        if shape[-1] % QK or data.size != n // QK * GGML_QUANT_SIZES[kind][1]:
            raise UnsupportedWeightError(f"tensor {name!r}: {data.size} bytes of {type_name} cannot hold {shape}")
        out = _dequantize_blocks(data, kind)
    if out.size != n:
        raise UnsupportedWeightError(f"tensor {name!r}: {out.size} values stored, shape {shape} needs {n}")
    return out.reshape(shape)


def _dequantize_blocks(data: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    if kind == GGMLQuantizationType.Q8_0:
        # block: f16 scale d, 32 × int8 q; x = d·q
        blocks = data.reshape(-1, 2 + QK)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        return (d * blocks[:, 2:].view(np.int8)).reshape(-1)
    if kind == GGMLQuantizationType.Q4_0:
        # block: f16 d, 16 bytes of nibbles; low nibbles are elements 0-15, high ones 16-31; x = d·(q-8)
        blocks = data.reshape(-1, 2 + QK // 2)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        return (d * (_nibbles(blocks[:, 2:]) - np.int8(8))).reshape(-1)
    # Q4_1 block: f16 d, f16 min m, 16 bytes of nibbles (same order as Q4_0); x = d·q + m
    blocks = data.reshape(-1, 4 + QK // 2)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    return (d * _nibbles(blocks[:, 4:]) + m).reshape(-1)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    return np.concatenate([packed & 0x0F, packed >> 4], axis=1).view(np.int8)


def tensor_to_numpy(tensor: GgufTensor) -> np.ndarray:
    """A reader tensor as fp32 in numpy order ([out, in] for a projection)."""
    shape = tuple(reversed([int(d) for d in tensor.shape]))
    return dequantize(tensor.data, int(tensor.tensor_type), shape, tensor.name)


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute` for attn_q/attn_k (weight [out, in] or bias [out]).

    GGUF orders each head's rows as rotary pairs (x0, y0, x1, y1, …); Hugging Face keeps the halves
    apart (x0, x1, …, y0, y1, …).
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def required(reader: GgufFile, arch: str, name: str) -> int:
    """The integer metadata value `{arch}.{name}`; ConfigError naming the key when the file lacks it."""
    value = metadata(reader, f"{arch}.{name}")
    if value is None:
        raise ConfigError(f"GGUF {arch} file has no {arch}.{name}")
    return int(value)


def common_config_fields(reader: GgufFile, arch: str) -> dict[str, Any]:
    """The `ModelConfig` fields every architecture reads the same way: sizes, norm epsilon, rope base and
    scaling, context length, vocabulary (`vocab_size`, else the token list, else the embedding's rows),
    tied embeddings (no `output.weight`) and the special token ids."""

    def key(name: str, default: Any = None) -> Any:
        return metadata(reader, f"{arch}.{name}", default)

    vocab = key("vocab_size")
    if vocab is None:
        tokens = metadata(reader, "tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens is not None else _tensor_shape(reader, "token_embd.weight")[0]
    eos_ids: list[int] = []
    for name in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token = metadata(reader, f"tokenizer.ggml.{name}")
        if token is not None and int(token) not in eos_ids:
            eos_ids.append(int(token))
    bos = metadata(reader, "tokenizer.ggml.bos_token_id")
    return dict(
        vocab_size=int(vocab),
        hidden_size=required(reader, arch, "embedding_length"),
        intermediate_size=required(reader, arch, "feed_forward_length"),
        num_layers=required(reader, arch, "block_count"),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling_from_gguf(reader, arch),
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos_ids),
    )


def moe_config_from_gguf(reader: GgufFile, arch: str, names: set[str]) -> MoEConfig | None:
    """From `{arch}.expert_count`, `expert_used_count`, `expert_feed_forward_length` (Qwen2-MoE; a
    Mixtral's experts are `feed_forward_length` wide), `expert_shared_feed_forward_length` and
    `expert_weights_norm` (absent: llama.cpp renormalises Mixtral's top-k weights, not Qwen2-MoE's);
    the dense layers are those without a router tensor."""
    count = metadata(reader, f"{arch}.expert_count")
    if not count:
        return None
    num_layers = int(metadata(reader, f"{arch}.block_count"))
    width = metadata(reader, f"{arch}.expert_feed_forward_length") or metadata(reader, f"{arch}.feed_forward_length")
    shared = metadata(reader, f"{arch}.expert_shared_feed_forward_length")
    if shared is None:
        sparse = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_shexp.weight" in names]
        shared = _tensor_shape(reader, f"blk.{sparse[0]}.ffn_gate_shexp.weight")[0] if sparse else 0
    dense = tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in names)
    return MoEConfig(
        num_experts=int(count),
        num_experts_per_tok=int(metadata(reader, f"{arch}.expert_used_count")),
        expert_intermediate_size=int(width),
        norm_topk_prob=bool(metadata(reader, f"{arch}.expert_weights_norm", arch == "llama")),
        shared_expert_intermediate_size=int(shared),
        shared_expert_gated=any(n.endswith(".ffn_gate_inp_shexp.weight") for n in names),
        dense_layers=dense,
    )


def rope_scaling_from_gguf(reader: GgufFile, arch: str) -> dict[str, Any] | None:
    kind = metadata(reader, f"{arch}.rope.scaling.type")
    factor = metadata(reader, f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind not in _ROPE_TYPES:
        raise ConfigError(f"GGUF rope scaling type {kind!r} is not supported")
    scaling: dict[str, Any] = {"rope_type": _ROPE_TYPES[kind], "factor": float(factor or 1.0)}
    original = metadata(reader, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        value = metadata(reader, f"{arch}.rope.scaling.{gguf_key}")
        if value is not None:
            scaling[hf_key] = float(value)
    return scaling


def _tensor_shape(reader: GgufFile, name: str) -> tuple[int, ...]:
    for t in reader.tensors:
        if t.name == name:
            return tuple(reversed([int(d) for d in t.shape]))
    raise UnsupportedWeightError(f"GGUF file has no tensor {name!r}")


def gguf_to_our_name(gguf_name: str) -> str:
    """Our state-dict name for a GGUF tensor name; unknown names raise `UnsupportedWeightError`. A fused
    expert tensor (`blk.N.ffn_gate_exps.weight`) names its per-expert suffix: `layers.N.experts.*.gate_proj`."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        layer, rest = parts[1], parts[2]
        if rest in _LAYER_NAMES:
            return f"layers.{layer}.{_LAYER_NAMES[rest]}"
        if rest in _MOE_NAMES:
            return f"layers.{layer}.{_MOE_NAMES[rest]}"
        if rest in _MLA_NAMES:
            return f"layers.{layer}.{_MLA_NAMES[rest]}"
        if rest in _FUSED_EXPERTS:
            return f"layers.{layer}.experts.*.{_FUSED_EXPERTS[rest]}"
        split = rest.split(".")
        if len(split) == 3 and split[0] in _SPLIT_EXPERT and split[1].isdigit() and split[2] == "weight":
            return f"layers.{layer}.experts.{split[1]}.{_SPLIT_EXPERT[split[0]]}"
    raise UnsupportedWeightError(f"GGUF tensor {gguf_name!r} has no place in a Llama-family model")
