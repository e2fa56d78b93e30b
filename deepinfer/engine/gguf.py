"""GGUF files: metadata → `ModelConfig`, tensors → an fp32 state dict in our names (see weights.py).

The `gguf` package only parses the container here; dequantisation is our own vectorised numpy, one
pass over whole tensors with no per-block Python loop. Supported tensor types: F32, F16, BF16, Q8_0,
Q4_0, Q4_1; anything else raises `UnsupportedWeightError`.

llama.cpp's converter stores the Q and K projections of `llama` models with each head's rotary
halves interleaved (its rotary layout); `load_gguf` undoes that so the weights match Hugging Face's.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderField, ReaderTensor

from deepinfer.engine.config import ConfigError, ModelConfig

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
_GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens",
    "output_norm.weight": "norm",
    "output.weight": "lm_head",
}
_ARCHITECTURES = ("llama", "qwen2")
_ROPE_TYPES = {"linear": "linear", "yarn": "yarn"}


class UnsupportedWeightError(ValueError):
    """A tensor stored in a type (or under a name) this loader cannot turn into fp32 weights."""


def open_gguf(path: str | os.PathLike[str]) -> GGUFReader:
    """Memory-map a GGUF file for reading."""
    return GGUFReader(Path(path), "r")


def field_value(field: ReaderField) -> Any:
    """A metadata value as plain Python: str, int, float, bool, list[str] or a numpy array of numbers."""
    kind = field.types[0]
    if kind == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    if kind == GGUFValueType.ARRAY:
        if field.types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        if not field.data:
            return np.zeros(0)
        return np.concatenate([field.parts[i] for i in field.data])
    value = field.parts[field.data[0]][0]
    if kind == GGUFValueType.FLOAT32:
        # The shortest decimal that reads back as this float32 is what the converter was given
        # (1e-05, not 9.999999747378752e-06).
        return float(str(value))
    return bool(value) if kind == GGUFValueType.BOOL else value.item()


def metadata(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field_value(field)


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


def tensor_to_numpy(tensor: ReaderTensor) -> np.ndarray:
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


def config_from_gguf(reader: GGUFReader) -> ModelConfig:
    """The architecture described by a GGUF file's metadata (`{arch}.*` and tokenizer keys)."""
    arch = metadata(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        supported = ", ".join(_ARCHITECTURES)
        raise ConfigError(f"GGUF architecture {arch!r} is not supported; supported: {supported}")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ConfigError("GGUF rope_freqs.weight (llama3-style rope scaling) is not supported")

    def key(name: str, default: Any = None) -> Any:
        return metadata(reader, f"{arch}.{name}", default)

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    head_dim = key("attention.key_length") or key("rope.dimension_count") or hidden // heads
    vocab = key("vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else _tensor_shape(reader, "token_embd.weight")[0]
    eos_ids: list[int] = []
    for name in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token = metadata(reader, f"tokenizer.ggml.{name}")
        if token is not None and int(token) not in eos_ids:
            eos_ids.append(int(token))
    bos = metadata(reader, "tokenizer.ggml.bos_token_id")
    names = {t.name for t in reader.tensors}
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(head_dim),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, arch),
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos_ids),
    )


def _rope_scaling(reader: GGUFReader, arch: str) -> dict[str, Any] | None:
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


def _tensor_shape(reader: GGUFReader, name: str) -> tuple[int, ...]:
    for t in reader.tensors:
        if t.name == name:
            return tuple(reversed([int(d) for d in t.shape]))
    raise UnsupportedWeightError(f"GGUF file has no tensor {name!r}")


def gguf_to_our_name(gguf_name: str) -> str:
    """Our state-dict name for a GGUF tensor name; unknown names raise `UnsupportedWeightError`."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise UnsupportedWeightError(f"GGUF tensor {gguf_name!r} has no place in a Llama-family model")


def load_gguf(source: GGUFReader | str | os.PathLike[str]) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and fp32 state dict (our names, Hugging Face rotary layout) of a GGUF file."""
    reader = source if isinstance(source, GGUFReader) else open_gguf(source)
    config = config_from_gguf(reader)
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = gguf_to_our_name(tensor.name)
        array = tensor_to_numpy(tensor)
        if config.architecture == "llama":
            if name.endswith((".q_proj", ".q_bias")):
                array = unpermute_rotary(array, config.num_heads)
            elif name.endswith((".k_proj", ".k_bias")):
                array = unpermute_rotary(array, config.num_kv_heads)
        state[name] = torch.from_numpy(np.ascontiguousarray(array))
    return config, state
