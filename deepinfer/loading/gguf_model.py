"""A GGUF file → its `ModelConfig` and state dict, for every supported architecture: the Llama family and
mixtures of experts through `gguf.py`, DeepSeek's latent attention through `gguf_deepseek.py`."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from deepinfer.config.gguf_metadata import GgufFile, metadata, open_gguf
from deepinfer.config.model import ConfigError, ModelConfig
from deepinfer.kernels.quant_linear import FORMATS, PackedWeight
from deepinfer.loading.gguf import (
    GGUF_ARCHITECTURES,
    UnsupportedWeightError,
    common_config_fields,
    gguf_to_our_name,
    moe_config_from_gguf,
    required,
    tensor_to_numpy,
    unpermute_rotary,
)
from deepinfer.loading.gguf_deepseek import deepseek_config, join_kv_b


def config_from_gguf(reader: GgufFile) -> ModelConfig:
    """The architecture described by a GGUF file's metadata (`{arch}.*` and tokenizer keys)."""
    arch = metadata(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(GGUF_ARCHITECTURES)
        raise ConfigError(f"GGUF architecture {arch!r} is not supported; supported: {supported}")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ConfigError("GGUF rope_freqs.weight (llama3-style rope scaling) is not supported")
    if arch == "deepseek2":
        return deepseek_config(reader)

    def key(name: str, default: Any = None) -> Any:
        return metadata(reader, f"{arch}.{name}", default)

    hidden = required(reader, arch, "embedding_length")
    heads = required(reader, arch, "attention.head_count")
    head_dim = key("attention.key_length") or key("rope.dimension_count") or hidden // heads
    names = {t.name for t in reader.tensors}
    moe = moe_config_from_gguf(reader, arch, names)
    architecture = arch if moe is None else {"llama": "mixtral", "qwen2moe": "qwen2_moe"}[arch]
    if moe is None and arch == "qwen2moe":
        raise ConfigError("GGUF qwen2moe file has no qwen2moe.expert_count")
    return ModelConfig(
        architecture=architecture,
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(head_dim),
        attention_bias="blk.0.attn_q.bias" in names,
        moe=moe,
        **common_config_fields(reader, arch),
    )


def load_gguf(source: GgufFile | str | os.PathLike[str],
              keep_packed: Callable[[str, ModelConfig], bool] | None = None) -> tuple[ModelConfig, dict[str, Any]]:
    """Config and state dict (our names, Hugging Face rotary layout) of a GGUF file: fp32 tensors, except
    that a 2-D tensor stored as Q8_0/Q4_0/Q4_1 whose name `keep_packed(name, config)` accepts stays in its
    blocks, as a `PackedWeight` (its rows reordered like the fp32 ones: a row is whole blocks)."""
    reader = source if isinstance(source, GgufFile) else open_gguf(source)
    config = config_from_gguf(reader)
    arch = metadata(reader, "general.architecture")
    permuted = arch == "llama"  # Mixtral files too; deepseek2 keeps Hugging Face's row order
    state: dict[str, Any] = {}
    for tensor in reader.tensors:
        name = gguf_to_our_name(tensor.name)
        kind = GGMLQuantizationType(int(tensor.tensor_type))
        if keep_packed is not None and kind.name in FORMATS and len(tensor.shape) == 2 and keep_packed(name, config):
            rows, cols = (int(d) for d in reversed([int(d) for d in tensor.shape]))
            blocks = np.asarray(tensor.data).view(np.uint8).reshape(rows, -1)
            if permuted and name.endswith((".q_proj", ".k_proj")):
                heads = config.num_heads if name.endswith(".q_proj") else config.num_kv_heads
                blocks = unpermute_rotary(blocks, heads)
            state[name] = PackedWeight.from_raw(blocks, kind.name, (rows, cols))
            continue
        array = tensor_to_numpy(tensor)
        if permuted:
            if name.endswith((".q_proj", ".q_bias")):
                array = unpermute_rotary(array, config.num_heads)
            elif name.endswith((".k_proj", ".k_bias")):
                array = unpermute_rotary(array, config.num_kv_heads)
        if name.endswith(".shared_expert_gate"):
            array = array.reshape(1, -1)  # llama.cpp keeps it 1-D [hidden]; ours is a [1, hidden] projection
        whole = torch.from_numpy(np.ascontiguousarray(array))
        if ".experts.*." in name:
            if whole.dim() != 3:
                raise UnsupportedWeightError(f"GGUF tensor {tensor.name!r} has shape {tuple(whole.shape)}, "
                                             "expected [experts, rows, columns]")
            for e, w in enumerate(whole.unbind(0)):
                state[name.replace("*", str(e))] = w
        else:
            state[name] = whole
    if arch == "deepseek2":
        join_kv_b(state, config)
    return config, state
