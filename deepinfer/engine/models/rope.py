"""Rotary position embeddings: inverse frequencies for each supported scaling type, and a cos/sin
table indexed by absolute position.

Rotation uses the "half split" layout (the first half of a head's dimensions pairs with the second
half), which is the layout of Hugging Face checkpoints; GGUF loaders undo llama.cpp's interleaving
before weights reach the model.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from deepinfer.config.model import ModelConfig


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended linearly.
    factor = float(p["factor"])
    low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    ctx = float(p["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > ctx / low, inv_freq / factor, inv_freq)
    blend = (ctx / wavelen - low) / (high - low)
    blended = (1 - blend) * scaled / factor + blend * scaled
    in_band = ~(wavelen < ctx / high) * ~(wavelen > ctx / low)
    return torch.where(in_band, blended, scaled)


def _yarn(theta: float, dim: int, p: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    orig = p.get("original_max_position_embeddings") or max_pos
    factor = p.get("factor") or max_pos / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = p.get("attention_factor")
    if attn is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attn = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attn = mscale(factor)

    def dim_for_rotations(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_for_rotations(p.get("beta_fast") or 32), dim_for_rotations(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    keep = 1 - ramp  # 1: dimension keeps its original frequency (extrapolates), 0: interpolated
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attn)


def inverse_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2], attention scaling applied to cos and sin)."""
    dim, theta, p = config.head_dim, config.rope_theta, config.rope_scaling or {}
    kind = config.rope_type
    if kind == "yarn":
        return _yarn(theta, dim, p, config.max_position_embeddings)
    inv_freq = _base_inv_freq(theta, dim)
    if kind == "linear":
        inv_freq = inv_freq / float(p["factor"])
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, p)
    return inv_freq, 1.0


class RotaryTable:
    """cos/sin for positions [0, max_positions), each [max_positions, head_dim]."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        inv_freq, scaling = inverse_frequencies(config)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos() * scaling
        self.sin = emb.sin() * scaling

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each token ([T] int64 positions), shaped [T, 1, head_dim] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim] rotated by the per-token cos/sin from `RotaryTable.lookup`."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
