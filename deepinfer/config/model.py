"""What a model is: the architecture description every loader produces (from a Hugging Face config.json
or from GGUF metadata) and every model consumes.

A mixture-of-experts model carries a `MoEConfig` in `ModelConfig.moe` (None for a dense model), and a
multi-head latent attention model (DeepSeek-V2/V3) an `MLAConfig` in `ModelConfig.mla` (None for GQA
attention). The knobs of one engine instance are `deepinfer.config.engine.EngineConfig`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral", "mixtral", "qwen2_moe", "deepseek_v2", "deepseek_v3")
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "deepseek_v2", "deepseek_v3")
# Multi-head latent attention (MLA): the KV cache holds one compressed latent per token and layer.
MLA_ARCHITECTURES = ("deepseek_v2", "deepseek_v3")
# config.json's `architectures` class name → our architecture, for a config without `model_type`.
HF_ARCHITECTURE_CLASSES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")




class ConfigError(ValueError):
    """A model configuration we cannot serve; the message names what is wrong."""


# How a router chooses experts (`MoEConfig.topk_method`):
# * "greedy": the top-k scores (Mixtral, Qwen2-MoE, DeepSeek-V2's default);
# * "group_limited_greedy" (DeepSeek-V2): experts split into n_group groups, a group scored by its best
#   expert; only the topk_group best groups compete for the top k;
# * "noaux_tc" (DeepSeek-V3): a per-expert correction bias is added to the scores for choosing only;
#   a group is scored by the sum of its two best biased scores; topk_group groups compete.
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEConfig:
    """The sparse MLP of a mixture-of-experts decoder (Mixtral, Qwen2-MoE, DeepSeek-V2/V3).

    Routing: `scoring` ("softmax" or "sigmoid") of the router's logits, the `num_experts_per_tok` best
    chosen as `topk_method` says (see TOPK_METHODS), renormalised to sum to 1 when `norm_topk_prob`,
    then multiplied by `routed_scaling_factor`. Each expert is a SwiGLU MLP of width
    `expert_intermediate_size`. A shared expert (width `shared_expert_intermediate_size`, 0 = none)
    sees every token; when `shared_expert_gated` its output is scaled by sigmoid(shared_expert_gate·x).
    Layer i is sparse when i is not in `dense_layers` and (i + 1) is a multiple of `sparse_step`
    (Qwen2-MoE's `mlp_only_layers` and `decoder_sparse_step`); other layers have a dense MLP of
    `ModelConfig.intermediate_size`. Router jitter is a training-time noise and has no field.

    The routing fields after `dense_layers` were added for DeepSeek; at their defaults (softmax,
    greedy, no groups, scale 1) they describe Mixtral/Qwen2-MoE routing and are left out of `to_dict`,
    so those models' fingerprints did not change.
    """

    num_experts: int
    num_experts_per_tok: int
    expert_intermediate_size: int
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = False
    sparse_step: int = 1
    dense_layers: tuple[int, ...] = ()
    scoring: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, "
                              f"num_experts={self.num_experts}]")
        if self.expert_intermediate_size <= 0 or self.sparse_step <= 0 or self.shared_expert_intermediate_size < 0:
            raise ConfigError("expert sizes and sparse_step must be positive")
        if self.shared_expert_gated and not self.shared_expert_intermediate_size:
            raise ConfigError("a shared-expert gate needs a shared expert")
        if self.scoring not in SCORING_FUNCS or self.topk_method not in TOPK_METHODS:
            raise ConfigError(f"unsupported routing: scoring {self.scoring!r} (supported: {SCORING_FUNCS}), "
                              f"topk_method {self.topk_method!r} (supported: {TOPK_METHODS})")
        if self.topk_method != "greedy":
            # noaux_tc scores a group by its two best experts, so a group needs two.
            per_group = 2 if self.topk_method == "noaux_tc" else 1
            if self.n_group < 1 or self.num_experts % self.n_group or self.num_experts // self.n_group < per_group:
                raise ConfigError(f"n_group={self.n_group} must split num_experts={self.num_experts} into equal "
                                  f"groups of at least {per_group} for topk_method {self.topk_method!r}")
            if not 1 <= self.topk_group <= self.n_group:
                raise ConfigError(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
            if self.topk_group * (self.num_experts // self.n_group) < self.num_experts_per_tok:
                raise ConfigError(f"topk_group={self.topk_group} groups hold fewer than num_experts_per_tok="
                                  f"{self.num_experts_per_tok} experts")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["dense_layers"] = list(self.dense_layers)
        for name in _ROUTING_FIELDS:  # see the class docstring: fingerprints of earlier MoE models
            if d[name] == _ROUTING_DEFAULTS[name]:
                del d[name]
        return d

    def is_sparse_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0


_ROUTING_FIELDS = ("scoring", "topk_method", "n_group", "topk_group", "routed_scaling_factor")
_ROUTING_DEFAULTS = {f.name: f.default for f in dataclasses.fields(MoEConfig) if f.name in _ROUTING_FIELDS}


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3).

    Queries: `q_proj` [heads·(nope+rope), hidden] when `q_lora_rank` is None, else a low-rank pair
    q_a_proj → RMSNorm → q_b_proj. Keys and values: `kv_a_proj` maps a token to a latent of
    `kv_lora_rank` (RMS-normed) plus one rope key of `qk_rope_head_dim` shared by every head;
    `kv_b_proj` expands the latent into each head's no-rope key (`qk_nope_head_dim`) and value
    (`v_head_dim`). The KV cache holds, per token and layer, the normed latent and the roped key:
    `latent_dim` floats. `rope_interleave`: the rope dimensions rotate in adjacent pairs (x0, x1),
    (x2, x3), ... (DeepSeek's checkpoints) rather than Llama's half split.
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        sizes = (self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)
        if any(s <= 0 for s in sizes) or (self.q_lora_rank is not None and self.q_lora_rank <= 0):
            raise ConfigError(f"MLA sizes must be positive: {self}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (rotary pairs)")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Cached floats per token and layer: the latent, then the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder: GQA, RoPE, RMSNorm, SwiGLU (dense, or mixture-of-experts when `moe` is
    set), optional attention bias. With `mla` set (DeepSeek) attention is multi-head latent attention
    instead: `head_dim` is then the rotary dimension (`mla.qk_rope_head_dim`, as transformers has it),
    `num_kv_heads` equals `num_heads`, and `attention_bias` puts biases on q_a_proj, kv_a_proj and
    o_proj."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # None or a dict with "rope_type" in SUPPORTED_ROPE_TYPES plus that type's parameters,
    # spelled as in Hugging Face configs ("factor", "original_max_position_embeddings", ...).
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if (self.moe is not None) != (self.architecture in MOE_ARCHITECTURES):
            raise ConfigError(f"architecture {self.architecture!r} {'needs' if self.moe is None else 'has no'} "
                              "mixture-of-experts settings")
        if (self.mla is not None) != (self.architecture in MLA_ARCHITECTURES):
            raise ConfigError(f"architecture {self.architecture!r} {'needs' if self.mla is None else 'has no'} "
                              "multi-head latent attention settings")
        if self.mla is not None and (self.head_dim != self.mla.qk_rope_head_dim or self.num_kv_heads != self.num_heads):
            raise ConfigError("an MLA model's head_dim is its qk_rope_head_dim and its num_kv_heads its num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(f"unsupported rope scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        if self.moe is None:
            del d["moe"]  # a dense model's dict (and so its fingerprint) is what it was before MoE
        else:
            d["moe"] = self.moe.to_dict()
        if self.mla is None:
            del d["mla"]  # likewise for a model without latent attention
        return d

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json (transformers 4.x `rope_theta`/`rope_scaling` or 5.x
        `rope_parameters` spellings)."""
        model_type = d.get("model_type") or HF_ARCHITECTURE_CLASSES.get((d.get("architectures") or [""])[0], "llama")
        hidden = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        mla = _mla_from_hf_dict(model_type, d)
        rope_params = dict(d.get("rope_parameters") or {})
        rope_scaling = d.get("rope_scaling") or None
        rope_theta = float(d.get("rope_theta", rope_params.get("rope_theta", 10000.0)))
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            if "type" in rope_scaling and "rope_type" not in rope_scaling:
                rope_scaling["rope_type"] = rope_scaling.pop("type")
            if rope_scaling.get("rope_type", "default") == "default":
                rope_scaling = None
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=heads if mla else int(d.get("num_key_value_heads") or heads),
            head_dim=mla.qk_rope_head_dim if mla else int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; its config does not say so. Qwen2-MoE says so in `qkv_bias`.
            attention_bias=bool(d.get("attention_bias", d.get("qkv_bias", model_type in ("qwen2", "qwen2_moe")))),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            moe=_moe_from_hf_dict(model_type, d),
            mla=mla,
        )


def _moe_from_hf_dict(model_type: str, d: dict[str, Any]) -> MoEConfig | None:
    """Mixtral: every layer sparse, experts of `intermediate_size`, weights always renormalised.
    Qwen2-MoE: experts of `moe_intermediate_size`, a gated shared expert, `norm_topk_prob` (default
    False), `decoder_sparse_step` and `mlp_only_layers` choosing the sparse layers; no experts at all
    (num_experts 0) is refused, since that model is a plain Qwen2."""
    if model_type == "mixtral":
        return MoEConfig(
            num_experts=int(d.get("num_local_experts", d.get("num_experts", 8))),
            num_experts_per_tok=int(d.get("num_experts_per_tok", 2)),
            expert_intermediate_size=int(d["intermediate_size"]),
        )
    if model_type == "qwen2_moe":
        shared = int(d.get("shared_expert_intermediate_size") or 0)
        return MoEConfig(
            num_experts=int(d.get("num_experts", 60)),
            num_experts_per_tok=int(d.get("num_experts_per_tok", 4)),
            expert_intermediate_size=int(d.get("moe_intermediate_size", 1408)),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=shared,
            shared_expert_gated=shared > 0,
            sparse_step=int(d.get("decoder_sparse_step", 1)),
            dense_layers=tuple(sorted(int(i) for i in d.get("mlp_only_layers") or ())),
        )
    if model_type in MLA_ARCHITECTURES:
        return _deepseek_moe(model_type, d)
    return None


def _deepseek_moe(model_type: str, d: dict[str, Any]) -> MoEConfig:
    """DeepSeek-V2/V3 routing as transformers implements it (the oracle), and refusals where a config
    asks for something it does not do:

    * V3: sigmoid scores, `noaux_tc` (biased group-limited top-k), renormalised when norm_topk_prob.
      `scoring_func` and `topk_method`, when present, must say exactly that.
    * V2: softmax scores, `greedy` or `group_limited_greedy`, never renormalised — transformers ignores
      `norm_topk_prob` for V2 while DeepSeek's own code honours it, so a V2 config setting it is refused.
    * Both: the first `first_k_dense_replace` layers dense, every later one sparse; a `moe_layer_freq`
      other than 1 is refused (transformers ignores it); the shared experts are one ungated SwiGLU of
      `n_shared_experts · moe_intermediate_size`; weights times `routed_scaling_factor`.
    """
    v3 = model_type == "deepseek_v3"
    experts = d.get("n_routed_experts")
    if not experts:
        raise ConfigError(f"{model_type} without routed experts (n_routed_experts={experts}) is not supported")
    if int(d.get("moe_layer_freq") or 1) != 1:
        raise ConfigError(f"{model_type}: moe_layer_freq={d['moe_layer_freq']} is not supported (only 1)")
    scoring = "sigmoid" if v3 else "softmax"
    if d.get("scoring_func", scoring) != scoring:
        raise ConfigError(f"{model_type}: scoring_func {d['scoring_func']!r} is not supported ({scoring!r} only)")
    method = d.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    allowed = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
    if method not in allowed:
        raise ConfigError(f"{model_type}: topk_method {method!r} is not supported (one of {allowed})")
    norm = bool(d.get("norm_topk_prob", v3))
    if norm and not v3:
        raise ConfigError("deepseek_v2 with norm_topk_prob=true is refused: transformers ignores it and "
                          "DeepSeek's reference code renormalises, so the two disagree")
    grouped = method != "greedy"
    return MoEConfig(
        num_experts=int(experts),
        num_experts_per_tok=int(d.get("num_experts_per_tok") or 0),  # unset: 0, refused by MoEConfig
        expert_intermediate_size=int(d["moe_intermediate_size"]),
        norm_topk_prob=norm,
        shared_expert_intermediate_size=int(d.get("n_shared_experts") or 0) * int(d["moe_intermediate_size"]),
        dense_layers=tuple(range(int(d.get("first_k_dense_replace") or 0))),
        scoring=scoring,
        topk_method=method,
        n_group=int(d["n_group"]) if grouped and d.get("n_group") is not None else 1,
        topk_group=int(d["topk_group"]) if grouped and d.get("topk_group") is not None else 1,
        routed_scaling_factor=float(d.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
    )


def _mla_from_hf_dict(model_type: str, d: dict[str, Any]) -> MLAConfig | None:
    """V3's `rope_interleave` (default true); V2 always rotates adjacent pairs (complex multiplication)."""
    if model_type not in MLA_ARCHITECTURES:
        return None
    q_lora = d.get("q_lora_rank")
    return MLAConfig(
        kv_lora_rank=int(d["kv_lora_rank"]),
        qk_nope_head_dim=int(d["qk_nope_head_dim"]),
        qk_rope_head_dim=int(d["qk_rope_head_dim"]),
        v_head_dim=int(d["v_head_dim"]),
        q_lora_rank=None if q_lora is None else int(q_lora),
        rope_interleave=bool(d.get("rope_interleave", True)) if model_type == "deepseek_v3" else True,
    )

