"""DeepSeek-V3 and DeepSeek-V2 (`deepseek_v3`, `deepseek_v2`): multi-head latent attention (`mla.py`)
and DeepSeek's mixture of experts, matched to transformers' DeepseekV3/V2ForCausalLM.

Layers 0 .. first_k_dense_replace-1 have a dense SwiGLU MLP, every later layer a sparse block built
from `moe.py`'s parts — `SparseMoE(route=DeepseekRouter, experts=LocalExperts(bank), shared=...)` —
so an expert-parallel executor replaces `experts` for DeepSeek exactly as for Mixtral. The shared
experts are one ungated SwiGLU every token passes through.

Routing (`DeepseekRouter`, one call per step over all token rows), as transformers computes it, with
the same torch.topk calls in the same order so that exact ties resolve the same way:

* V3 (`noaux_tc`): s = sigmoid(router logits). Choosing uses s + e_score_correction_bias: each of
  n_group groups is scored by the sum of its two best biased scores, the topk_group best groups are
  kept, the others' experts masked to -inf, and the top k of what is left chosen. The weights are the
  *unbiased* s of the chosen experts, divided by their sum (+1e-20) when norm_topk_prob.
* V2: s = softmax(router logits); `greedy` takes the top k of s, `group_limited_greedy` first keeps
  the topk_group groups with the best single score (the others' scores set to 0). Never renormalised
  (see `config._deepseek_moe` for why a V2 config asking for it is refused).
* Both: the weights are multiplied by routed_scaling_factor.

Supported: q_lora_rank set or None, attention_bias, any first_k_dense_replace, shared experts or none,
rope scaling including YaRN with DeepSeek's mscale/mscale_all_dim (cos/sin and softmax scale), V3's
rope_interleave either way. Refused with a ConfigError at config time: V2's norm_topk_prob, any
moe_layer_freq but 1, a scoring_func or topk_method transformers does not implement for the version,
a model without routed experts. Not run: V3's multi-token-prediction layers (not loaded).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepinfer.config.model import ConfigError, ModelConfig, MoEConfig
from deepinfer.engine.attention import AttentionMetadata
from deepinfer.engine.models.linear import linear
from deepinfer.engine.models.llama import DenseMLP, FeedForward, LlamaModel, rms_norm
from deepinfer.engine.models.mla import MLAttention
from deepinfer.engine.models.moe import ExpertBank, LocalExperts, Routing, SparseMoE
from deepinfer.engine.models.rope import RotaryTable


@dataclass
class DeepseekRouter:
    """DeepSeek's routing of normed hidden states [T, hidden] (see the module docstring)."""

    weight: torch.Tensor  # [E, hidden]
    correction_bias: torch.Tensor | None  # [E], noaux_tc only: added to the scores for choosing
    moe: MoEConfig

    @property
    def top_k(self) -> int:
        """Experts chosen per token."""
        return self.moe.num_experts_per_tok

    def __call__(self, h: torch.Tensor) -> Routing:
        moe, k = self.moe, self.moe.num_experts_per_tok
        logits = F.linear(h.float(), self.weight)
        scores = logits.sigmoid() if moe.scoring == "sigmoid" else logits.softmax(dim=-1)
        if moe.topk_method == "noaux_tc":
            assert self.correction_bias is not None
            choice = scores + self.correction_bias
            group_scores = self._grouped(choice).topk(2, dim=-1)[0].sum(dim=-1)
            choice = choice.masked_fill(~self._kept_experts(group_scores), float("-inf"))
            experts = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, experts)
        elif moe.topk_method == "group_limited_greedy":
            kept = self._kept_experts(self._grouped(scores).max(dim=-1).values)
            weights, experts = torch.topk(scores.masked_fill(~kept, 0.0), k=k, dim=-1, sorted=False)
        else:
            weights, experts = torch.topk(scores, k=k, dim=-1, sorted=False)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * moe.routed_scaling_factor
        tokens = torch.arange(h.shape[0], device=h.device).repeat_interleave(k)
        return Routing(tokens, experts.reshape(-1), weights.reshape(-1))

    def _grouped(self, scores: torch.Tensor) -> torch.Tensor:
        """[T, E] -> [T, n_group, E / n_group]."""
        return scores.view(-1, self.moe.n_group, self.moe.num_experts // self.moe.n_group)

    def _kept_experts(self, group_scores: torch.Tensor) -> torch.Tensor:
        """[T, E] bool: the experts of each token's topk_group best groups."""
        moe = self.moe
        group_idx = torch.topk(group_scores, k=moe.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        per_group = moe.num_experts // moe.n_group
        return group_mask.unsqueeze(-1).expand(-1, moe.n_group, per_group).reshape(-1, moe.num_experts).bool()


@dataclass
class _Layer:
    input_norm: torch.Tensor
    attn: MLAttention
    post_attn_norm: torch.Tensor
    mlp: FeedForward


class DeepseekModel(LlamaModel):
    """A `CausalLM` (see base.py) over the latent KV of `KvSpec.for_model`: [num_blocks, layers, 1,
    block_size, kv_lora_rank + qk_rope_head_dim].

    A LlamaModel by inheritance for what the two share — embedding, final norm and LM head, the
    residual stream, `truncated` (the self-draft of the first layers) — with its own layers: latent
    attention instead of GQA, DeepSeek's sparse blocks. `LlamaModel.__init__` is not called; this
    one sets every attribute `truncated` and `forward` rely on.
    """

    def __init__(self, config: ModelConfig, state_dict: dict[str, torch.Tensor], max_positions: int,
                 device: str = "cpu") -> None:
        if config.mla is None or config.moe is None:
            raise ConfigError(f"{config.architecture} config has no latent-attention or mixture-of-experts settings")
        self.config = config
        self.max_positions = max_positions
        sd = {k: v.to(device=device, dtype=torch.float32) for k, v in state_dict.items()}
        self.embed = sd["embed_tokens"]
        self.norm = sd["norm"]
        self.lm_head = self.embed if config.tie_word_embeddings else sd["lm_head"]
        self.layers: list[_Layer] = [  # type: ignore[assignment]
            _Layer(sd[f"layers.{i}.input_norm"], MLAttention.from_state(sd, f"layers.{i}.", config),
                   sd[f"layers.{i}.post_attn_norm"], self.build_mlp(i, sd))
            for i in range(config.num_layers)
        ]
        # head_dim is the rope dimension for an MLA config (see ModelConfig), so the table is the rope's.
        self.rotary = RotaryTable(config, max_positions)

    def build_mlp(self, layer: int, sd: dict[str, torch.Tensor]) -> FeedForward:
        moe = self.config.moe
        assert moe is not None
        p = f"layers.{layer}."
        if not moe.is_sparse_layer(layer):
            return DenseMLP.from_state(sd, p)
        router = DeepseekRouter(sd[p + "router"], sd.get(p + "router_bias"), moe)
        shared = DenseMLP.from_state(sd, p + "shared_expert.") if moe.shared_expert_intermediate_size else None
        return SparseMoE(route=router, experts=LocalExperts(ExpertBank.from_state(sd, p, moe.num_experts)),
                         shared=shared, shared_gate=None)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor,
                meta: AttentionMetadata, logits_rows: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] int64; kv: [num_blocks, layers, 1, block_size, latent_dim].
        Returns fp32 logits [len(logits_rows), vocab]."""
        eps = self.config.rms_norm_eps
        cos, sin = self.rotary.lookup(positions)
        x = F.embedding(input_ids, self.embed)
        for i, layer in enumerate(self.layers):
            x = x + layer.attn(rms_norm(x, layer.input_norm, eps), cos, sin, kv[:, i, 0], meta)
            x = x + layer.mlp(rms_norm(x, layer.post_attn_norm, eps))
        x = rms_norm(x[logits_rows], self.norm, eps)
        return linear(x, self.lm_head)
