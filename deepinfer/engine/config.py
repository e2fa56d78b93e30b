"""Model and engine configuration.

`ModelConfig` is the architecture description every loader produces (from a Hugging Face
config.json or from GGUF metadata) and every model consumes; a mixture-of-experts model carries a
`MoEConfig` in `ModelConfig.moe` (None for a dense model). `EngineConfig` holds the knobs of
one engine instance (KV memory budget, batching limits).

The `DEFAULT_*` constants are the one definition of each engine default: EngineConfig, the launcher's
topology and command line, and the services' constructors all take them from here, so no two layers can
disagree (the block size above all: it is part of the KV-cache namespace, and services that hash blocks
differently refuse each other at the handshake).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral", "mixtral", "qwen2_moe")
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe")
# config.json's `architectures` class name → our architecture, for a config without `model_type`.
HF_ARCHITECTURE_CLASSES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


DEFAULT_BLOCK_SIZE = 16  # tokens per KV block
DEFAULT_KV_CACHE_MB = 512  # a worker's device KV pool
DEFAULT_MAX_NUM_SEQS = 128
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
DEFAULT_DEVICE = "cpu"
MIN_SPECULATIVE_TOKENS, MAX_SPECULATIVE_TOKENS = 1, 32  # bounds of num_speculative_tokens


class ConfigError(ValueError):
    """A model configuration we cannot serve; the message names what is wrong."""


@dataclass(frozen=True)
class MoEConfig:
    """The sparse MLP of a mixture-of-experts decoder (Mixtral, Qwen2-MoE).

    Routing: softmax over the router's logits, the `num_experts_per_tok` largest probabilities chosen,
    renormalised to sum to 1 when `norm_topk_prob`. Each expert is a SwiGLU MLP of width
    `expert_intermediate_size`. A shared expert (width `shared_expert_intermediate_size`, 0 = none)
    sees every token; when `shared_expert_gated` its output is scaled by sigmoid(shared_expert_gate·x).
    Layer i is sparse when i is not in `dense_layers` and (i + 1) is a multiple of `sparse_step`
    (Qwen2-MoE's `mlp_only_layers` and `decoder_sparse_step`); other layers have a dense MLP of
    `ModelConfig.intermediate_size`. Router jitter is a training-time noise and has no field.
    """

    num_experts: int
    num_experts_per_tok: int
    expert_intermediate_size: int
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = False
    sparse_step: int = 1
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, "
                              f"num_experts={self.num_experts}]")
        if self.expert_intermediate_size <= 0 or self.sparse_step <= 0 or self.shared_expert_intermediate_size < 0:
            raise ConfigError("expert sizes and sparse_step must be positive")
        if self.shared_expert_gated and not self.shared_expert_intermediate_size:
            raise ConfigError("a shared-expert gate needs a shared expert")

    def is_sparse_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder: GQA, RoPE, RMSNorm, SwiGLU (dense, or mixture-of-experts when `moe` is
    set), optional attention bias."""

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

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if (self.moe is not None) != (self.architecture in MOE_ARCHITECTURES):
            raise ConfigError(f"architecture {self.architecture!r} {'needs' if self.moe is None else 'has no'} "
                              "mixture-of-experts settings")
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
            d["moe"]["dense_layers"] = list(self.moe.dense_layers)
        return d

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json (transformers 4.x `rope_theta`/`rope_scaling` or 5.x
        `rope_parameters` spellings)."""
        model_type = d.get("model_type") or HF_ARCHITECTURE_CLASSES.get((d.get("architectures") or [""])[0], "llama")
        hidden = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
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
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
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
    return None


@dataclass
class EngineConfig:
    """Limits of one engine instance."""

    block_size: int = DEFAULT_BLOCK_SIZE
    # Bytes of KV cache to preallocate; `num_kv_blocks` overrides it when set.
    kv_cache_bytes: int = DEFAULT_KV_CACHE_MB * 1024 * 1024
    num_kv_blocks: int | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    # Context limit; None means the model's max_position_embeddings.
    max_model_len: int | None = None
    device: str = DEFAULT_DEVICE
    num_threads: int | None = None
    # Use the compiled paged-attention kernel for decode rows when it builds; the torch path otherwise.
    use_native_kernels: bool = True
    # Keep freed full blocks addressable by their hash so later prompts with the same prefix reuse them.
    enable_prefix_caching: bool = True
    # Speculative decoding: None (off), "ngram", "suffix", "self:L" (the model's first L layers as the
    # draft) or "draft:PATH" (a smaller model sharing the tokenizer). See deepinfer.engine.spec.
    speculative: str | None = None
    # The most tokens proposed for one request in one step.
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    # Let the controller choose each request's k per step (0 = off) from measured costs and acceptance;
    # False: always propose up to num_speculative_tokens.
    adaptive_speculation: bool = True
    # n-gram matching: the shortest and longest suffix of a request's tokens looked up.
    ngram_min: int = 1
    ngram_max: int = 4

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ConfigError("block_size must be positive")
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise ConfigError("max_num_batched_tokens and max_num_seqs must be positive")
        if not MIN_SPECULATIVE_TOKENS <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"num_speculative_tokens must be in [{MIN_SPECULATIVE_TOKENS}, {MAX_SPECULATIVE_TOKENS}]")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError("ngram_min and ngram_max must satisfy 1 <= ngram_min <= ngram_max")
        if self.speculative is not None:
            from deepinfer.engine.spec.base import parse_speculative

            parse_speculative(self.speculative)  # raises ConfigError naming what is wrong
