"""Tiny seeded random-weight Mixtral and Qwen2-MoE models, built with transformers and saved with
`save_pretrained` (per-expert tensors by default; the fused 3-D expert tensors with
`save_original_format=False`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

VOCAB = 320
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
    max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (transformers config class, kwargs over COMMON)
    "mixtral-8e-top2": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48)),
    # A gated shared expert, renormalised top-2 of 6, layer 1 dense (mlp_only_layers).
    "qwen2moe-shared-norm-dense1": ("Qwen2MoeConfig", dict(
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=56,
        intermediate_size=80, norm_topk_prob=True, mlp_only_layers=[1])),
    # Top-4 of 8 without renormalisation; decoder_sparse_step 2 over 4 layers: layers 1 and 3 sparse.
    "qwen2moe-unnormed-step2": ("Qwen2MoeConfig", dict(
        num_experts=8, num_experts_per_tok=4, moe_intermediate_size=24, shared_expert_intermediate_size=48,
        intermediate_size=80, norm_topk_prob=False, decoder_sparse_step=2, num_hidden_layers=4)),
}


def build_hf_moe(variant: str, seed: int = 0, vocab_size: int = VOCAB) -> Any:
    """The transformers model of `variant`, in eval mode, with weights that make every part count:
    projections (router and shared-expert gate included) ~ N(0, 1/fan_in) so activations stay O(1)
    and routing is decisive, norms 1 + N(0, 0.1), biases N(0, 0.5). Default init would leave biases
    at zero, norms at one and the MLPs' share of the logits tiny."""
    import transformers

    cls_name, kwargs = VARIANTS[variant]
    config = getattr(transformers, cls_name)(**{**COMMON, **kwargs, "vocab_size": vocab_size})
    model_cls = transformers.MixtralForCausalLM if cls_name == "MixtralConfig" else transformers.Qwen2MoeForCausalLM
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0, 0.5)
            else:
                p.normal_(0, 1 / math.sqrt(p.shape[-1]))
    return model


def save(model: Any, path: Path, fused: bool = False) -> Path:
    model.save_pretrained(path, save_original_format=not fused)
    return path
