"""Tiny seeded random-weight DeepSeek-V3 and DeepSeek-V2 models, built with transformers and saved with
`save_pretrained` (per-expert tensors by default; fused 3-D expert tensors with `save_original_format=False`).

Each variant exercises a different corner: low-rank or plain query projection, dense-first layers,
shared experts, group-limited routing with fewer groups kept than exist, a routed scaling factor other
than 1, YaRN with DeepSeek's mscale, the half-split rope (rope_interleave false), attention biases, V2's
softmax group_limited_greedy routing, and one layer whose routing is decided by exact ties only.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

VOCAB = 320
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
    eos_token_id=2,
)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "mscale": 0.8, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (transformers config class, kwargs over COMMON)
    # Low-rank queries, layer 0 dense, one shared expert, 8 experts in 4 groups of which 2 are kept, top-2,
    # renormalised then scaled by 2.5, YaRN (mscale 0.8 / mscale_all_dim 1: cos/sin and softmax scale).
    "v3-qlora-dense1-yarn": ("DeepseekV3Config", dict(
        q_lora_rank=24, first_k_dense_replace=1, n_shared_experts=1, n_routed_experts=8, n_group=4, topk_group=2,
        num_experts_per_tok=2, routed_scaling_factor=2.5, norm_topk_prob=True, rope_parameters=YARN)),
    # Plain q_proj, two shared experts, top-2 of 8 in 2 groups (1 kept) without renormalising, scaled by 1.5,
    # half-split rope; layer 1's routing is all exact ties (see `make_ties`); saved with fused experts.
    "v3-noqlora-ties-halfsplit": ("DeepseekV3Config", dict(
        q_lora_rank=None, first_k_dense_replace=0, n_shared_experts=2, n_routed_experts=8, n_group=2, topk_group=1,
        num_experts_per_tok=2, routed_scaling_factor=1.5, norm_topk_prob=False, rope_interleave=False)),
    # DeepSeek-V2: softmax scores, group_limited_greedy (3 of 6 groups kept), top-3 of 12, scaled by 2, one
    # shared expert, attention biases (q_a/kv_a/o_proj), layer 0 dense.
    "v2-grouplimited-bias": ("DeepseekV2Config", dict(
        q_lora_rank=None, first_k_dense_replace=1, n_shared_experts=1, n_routed_experts=12, n_group=6,
        topk_group=3, num_experts_per_tok=3, topk_method="group_limited_greedy", routed_scaling_factor=2.0,
        norm_topk_prob=False, attention_bias=True)),
}
FUSED = {"v3-noqlora-ties-halfsplit"}  # saved with fused 3-D expert tensors
TIED_LAYER = {"v3-noqlora-ties-halfsplit": 1}


def build_hf_deepseek(variant: str, seed: int = 0) -> Any:
    """The transformers model of `variant`, in eval mode, with weights that make every part count:
    projections (router included) ~ N(0, 1/fan_in), norms 1 + N(0, 0.1), biases N(0, 0.5), V3's
    selection bias N(0, 0.1) (default init leaves it zero and the MLPs' share of the logits tiny)."""
    import transformers

    cls_name, kwargs = VARIANTS[variant]
    config = getattr(transformers, cls_name)(**{**COMMON, **kwargs})
    v3 = cls_name == "DeepseekV3Config"
    model_cls = transformers.DeepseekV3ForCausalLM if v3 else transformers.DeepseekV2ForCausalLM
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
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0, 0.1)
        if variant in TIED_LAYER:
            make_ties(model.model.layers[TIED_LAYER[variant]].mlp.gate)
    return model


def make_ties(gate: Any) -> None:
    """Make a V3 router's every choice an exact tie. Experts 0-2 of group 0 and 4-6 of group 1 get zero
    router rows (score sigmoid(0) = 0.5 exactly, whatever the rounding of the matmul) and a selection
    bias of +1 (1.5 to choose by); experts 3 and 7 keep random rows and a bias of -1 (below 0.5). Both
    groups then score 3.0 (their two best), so which group is kept is a tie, and so is which two of its
    three tied experts are chosen — torch.topk's tie-breaking decides every token's experts."""
    per_group = gate.weight.shape[0] // gate.num_group
    tied = [e for g in range(gate.num_group) for e in range(g * per_group, g * per_group + per_group - 1)]
    gate.weight[tied] = 0.0
    gate.e_score_correction_bias.fill_(-1.0)
    gate.e_score_correction_bias[tied] = 1.0


def save(model: Any, path: Path, fused: bool = False) -> Path:
    model.save_pretrained(path, save_original_format=not fused)
    return path
