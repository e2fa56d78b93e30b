"""Which projection weights stay packed in GGUF block formats, and how they get packed.

`EngineConfig.weights` chooses (see config.WEIGHTS_MODES):
* "native": a GGUF file's Q8_0 / Q4_0 / Q4_1 projections are kept as the file stores them
  (`PackedWeight`) and multiplied from the blocks by `kernels.quant_linear`; tensors in other types
  (F32, F16 norms and projections) are dequantised as before. The model computes exactly the
  dequantised weights' products — only the summation order differs — so its oracle is transformers
  holding `dequantized(state)`.
* "q8_0": a checkpoint's projections are quantised to Q8_0 at load (`quantize_q8_0`), then served
  natively: a quarter of fp32's bytes per decode step, for any Hugging Face model.
* "fp32": every tensor dequantised to fp32 at load (the path before packed weights existed).
* "auto": "native" for a GGUF file on a CPU device, "fp32" otherwise (on CUDA the packed path would
  dequantise a layer per call in torch: correct, but slower than holding fp32).

Only the dense Llama-family projections pack (`packable`): q/k/v/o, the dense MLP's gate/up/down,
the LM head and the token embedding (a packed embedding is looked up a row at a time, and is also the
LM head when the two are tied). Experts, routers and latent-attention (MLA) tensors stay fp32: their
models multiply them in their own code.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from deepinfer.config.model import ConfigError, ModelConfig
from deepinfer.kernels.quant_linear import QK, PackedWeight

__all__ = ["PackedWeight", "dequantized", "packable", "quantize_q8_0", "resolve_weights_mode", "weight_shape"]

# A state dict's values: fp32 tensors, and PackedWeight where the weights mode keeps blocks packed.
Weight = torch.Tensor | PackedWeight

_PACKABLE = re.compile(r"layers\.\d+\.(?:q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)|lm_head|embed_tokens")


def packable(name: str, config: ModelConfig) -> bool:
    """True if tensor `name` (our names) may be held packed for a model of `config`."""
    return config.mla is None and _PACKABLE.fullmatch(name) is not None


def resolve_weights_mode(mode: str, source: Path, config: ModelConfig, device: str) -> str:
    """The mode actually used ("native", "q8_0" or "fp32") for weights `mode` of `source` on `device`.
    ConfigError when "native" is asked of a checkpoint that has no packed blocks, or a packed mode of a
    latent-attention model (none of its tensors would pack)."""
    gguf = source.suffix == ".gguf"
    if mode == "auto":
        return "native" if gguf and device == "cpu" and config.mla is None else "fp32"
    if mode in ("native", "q8_0") and config.mla is not None:
        raise ConfigError(f"weights={mode!r}: packed weights serve Llama-family attention and MLPs, and "
                          f"{config.architecture} (latent attention) would keep every tensor in fp32: use 'fp32'")
    if mode == "native" and not gguf:
        raise ConfigError(f"weights='native' serves a GGUF file's packed blocks, and {source} is a Hugging Face "
                          "checkpoint: use weights='q8_0' to quantise it on load, or 'fp32'")
    return mode


def quantize_q8_0(w: torch.Tensor) -> PackedWeight:
    """Q8_0 blocks of a [out, in] weight (in a multiple of 32): per block of 32 along `in`, the scale
    d = max|w| / 127 rounded to fp16, and q = round(w / d) as int8 (GGUF's Q8_0, 34 bytes a block)."""
    out_features, in_features = w.shape
    if in_features % QK:
        raise ValueError(f"Q8_0 needs in_features divisible by {QK}, got {in_features}")
    blocks = w.detach().to(torch.float32).reshape(out_features, in_features // QK, QK)
    d = (blocks.abs().amax(dim=-1, keepdim=True) / 127.0).to(torch.float16)
    inv = torch.where(d == 0, torch.zeros_like(d, dtype=torch.float32), 1.0 / d.float())
    q = torch.round(blocks * inv).clamp_(-127, 127).to(torch.int8)
    packed = torch.cat([d.view(torch.uint8), q.view(torch.uint8)], dim=-1)  # [out, in/32, 2 + 32]
    return PackedWeight("Q8_0", packed.reshape(out_features, -1).contiguous(), out_features, in_features)


def quantize_state_q8_0(state: dict[str, Weight], config: ModelConfig) -> dict[str, Weight]:
    """`state` with every packable fp32 projection whose input width is a multiple of 32 as Q8_0."""
    return {name: quantize_q8_0(t) if (isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[1] % QK == 0
                                       and packable(name, config)) else t
            for name, t in state.items()}


def dequantized(state: dict[str, Weight]) -> dict[str, torch.Tensor]:
    """`state` with every PackedWeight dequantised to fp32: the weights a packed model computes with."""
    return {name: t.dequantize() if isinstance(t, PackedWeight) else t for name, t in state.items()}


def weight_shape(t: Weight) -> tuple[int, ...]:
    """[out, in] of a PackedWeight, a tensor's shape otherwise."""
    return (t.out_features, t.in_features) if isinstance(t, PackedWeight) else tuple(t.shape)
