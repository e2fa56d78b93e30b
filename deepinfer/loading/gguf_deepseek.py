"""DeepSeek-V2, V2-Lite and V3 from GGUF (llama.cpp's architecture `deepseek2`): metadata → a
`ModelConfig` with `mla` and DeepSeek routing, and the split kv_b tensors joined back (`join_kv_b`).
The tensor names themselves are mapped by gguf.py (`_MLA_NAMES`, and the MoE names shared with Mixtral).

What llama.cpp's converter does to a DeepSeek checkpoint, and so what this reader assumes:

* Row order is Hugging Face's. deepseek2 rotates adjacent pairs, which is how DeepSeek's checkpoints
  store their rope rows, so unlike `llama` nothing is permuted (and nothing is unpermuted here).
* The latent is written as one "MQA" head: `attention.head_count_kv` 1, `attention.key_length` C + R
  and `attention.value_length` C; the per-head sizes are `attention.key_length_mla` (N + R) and
  `attention.value_length_mla` (V). Files converted before that change have head_count_kv = heads,
  key_length = N + R, value_length = V and no `*_mla` keys. Both are read.
* kv_b_proj [H·(N+V), C] is stored whole as `attn_kv_b` (older files), or split per head into
  `attn_k_b` [H, C, N] — each head's key rows, transposed — and `attn_v_b` [H, V, C] (current files).
* Experts are fused into 3-D `ffn_{gate,up,down}_exps`, the shared experts are `ffn_*_shexp` (one SwiGLU
  of expert_shared_count · expert_feed_forward_length), V3's score-correction bias is `exp_probs_b.bias`,
  and layers below `leading_dense_block_count` have a dense `ffn_{gate,up,down}`.
* YaRN: `rope.scaling.yarn_log_multiplier` is 0.1 · mscale_all_dim. The checkpoint's `mscale` is not
  stored; llama.cpp takes it equal to mscale_all_dim (cos/sin then unscaled), and so does this reader.
  beta_fast/beta_slow default to 32/1, llama.cpp's defaults and DeepSeek's values.
* `expert_gating_func` 2 (sigmoid) is V3's `noaux_tc` routing, which needs the correction bias;
  1 (softmax), or absent as in older V2 files (llama.cpp's default), is V2's softmax routing,
  `group_limited_greedy` when `expert_group_count` > 1 and `greedy` otherwise. Top-k weights are
  renormalised only when `expert_weights_norm` says so, then scaled by `expert_weights_scale` (default 1).

Everything that cannot be read consistently (a missing size, a gating function other than 1 or 2, a
tensor whose shape contradicts the metadata, dense/sparse layers that disagree with
leading_dense_block_count) is a ConfigError naming it, raised before any tensor data is read.
"""

from __future__ import annotations

from typing import Any

import torch

from deepinfer.config.gguf_metadata import GgufFile, metadata
from deepinfer.config.model import ConfigError, MLAConfig, ModelConfig, MoEConfig
from deepinfer.loading.gguf import (
    UnsupportedWeightError,
    common_config_fields,
    gguf_to_our_name,
    required,
    rope_scaling_from_gguf,
)

ARCH = "deepseek2"
GATING_FUNCS = {1: "softmax", 2: "sigmoid"}  # llama.cpp's expert_gating_func values
YARN_LOG_MUL_UNIT = 0.1  # llama.cpp's converter stores 0.1 · mscale_all_dim


def deepseek_config(reader: GgufFile) -> ModelConfig:
    """The `ModelConfig` of a deepseek2 file: `deepseek_v3` for sigmoid gating, `deepseek_v2` otherwise."""
    shapes = {t.name: tuple(reversed([int(d) for d in t.shape])) for t in reader.tensors}
    _check_names(shapes)
    common = common_config_fields(reader, ARCH)
    heads = required(reader, ARCH, "attention.head_count")
    kv_heads = int(_key(reader, "attention.head_count_kv", heads))
    if kv_heads not in (1, heads):
        raise ConfigError(f"GGUF deepseek2: attention.head_count_kv={kv_heads} is neither 1 (the latent as one "
                          f"head) nor head_count={heads}")
    mla = _mla_config(reader)
    _check_attention_shapes(shapes, mla, heads, common["hidden_size"], common["num_layers"])
    moe = _moe_config(reader, shapes, common["num_layers"])
    return ModelConfig(
        architecture="deepseek_v3" if moe.scoring == "sigmoid" else "deepseek_v2",
        num_heads=heads,
        num_kv_heads=heads,  # MLA: every head has its own key and value once kv_b expands the latent
        head_dim=mla.qk_rope_head_dim,
        attention_bias=False,  # deepseek2 files have no attention biases (any bias tensor is refused by name)
        moe=moe,
        mla=mla,
        **(common | {"rope_scaling": _rope_scaling(reader)}),
    )


def _key(reader: GgufFile, name: str, default: Any = None) -> Any:
    return metadata(reader, f"{ARCH}.{name}", default)


def _check_names(shapes: dict[str, tuple[int, ...]]) -> None:
    """Every tensor has a place in a DeepSeek model (an attention bias, say, has none in llama.cpp's
    deepseek2 either), so that an unknown file is refused before its weights are read."""
    for name in shapes:
        try:
            gguf_to_our_name(name)
        except UnsupportedWeightError:
            raise ConfigError(f"GGUF deepseek2: tensor {name!r} has no place in a DeepSeek model") from None


def _mla_config(reader: GgufFile) -> MLAConfig:
    """Per-head sizes from the `*_mla` keys, else from key_length/value_length (older files)."""
    rope = required(reader, ARCH, "rope.dimension_count")
    latent = required(reader, ARCH, "attention.kv_lora_rank")
    qk = _key(reader, "attention.key_length_mla") or required(reader, ARCH, "attention.key_length")
    v = _key(reader, "attention.value_length_mla") or required(reader, ARCH, "attention.value_length")
    if int(qk) <= rope:
        raise ConfigError(f"GGUF deepseek2: key length {qk} leaves no no-rope dimensions beside "
                          f"rope.dimension_count={rope}")
    q_lora = _key(reader, "attention.q_lora_rank")
    return MLAConfig(kv_lora_rank=latent, qk_nope_head_dim=int(qk) - rope, qk_rope_head_dim=rope,
                     v_head_dim=int(v), q_lora_rank=int(q_lora) if q_lora else None, rope_interleave=True)


def _check_attention_shapes(shapes: dict[str, tuple[int, ...]], mla: MLAConfig, heads: int, hidden: int,
                            layers: int) -> None:
    """Every layer's attention tensors have the shapes the metadata implies (see the module docstring)."""
    n, r, v, c = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim, mla.kv_lora_rank
    for i in range(layers):
        p = f"blk.{i}."
        want: dict[str, tuple[int, ...]] = {"attn_kv_a_mqa": (c + r, hidden), "attn_kv_a_norm": (c,),
                                            "attn_output": (hidden, heads * v)}
        if mla.q_lora_rank is None:
            want["attn_q"] = (heads * (n + r), hidden)
        else:
            q = mla.q_lora_rank
            want |= {"attn_q_a": (q, hidden), "attn_q_a_norm": (q,), "attn_q_b": (heads * (n + r), q)}
        if p + "attn_kv_b.weight" in shapes or p + "attn_k_b.weight" not in shapes:
            want["attn_kv_b"] = (heads * (n + v), c)
        else:
            want |= {"attn_k_b": (heads, c, n), "attn_v_b": (heads, v, c)}
        for name, shape in want.items():
            got = shapes.get(f"{p}{name}.weight")
            if got != shape:
                found = "is missing" if got is None else f"has shape {got}"
                raise ConfigError(
                    f"GGUF deepseek2: {p}{name}.weight {found}, but the metadata (head_count={heads}, "
                    f"qk_nope={n}, qk_rope={r}, v_head={v}, kv_lora_rank={c}, q_lora_rank={mla.q_lora_rank}) "
                    f"needs {shape}")
        if mla.q_lora_rank is None and p + "attn_q_a.weight" in shapes:
            raise ConfigError(f"GGUF deepseek2: {p}attn_q_a.weight present but attention.q_lora_rank is unset")


def _moe_config(reader: GgufFile, shapes: dict[str, tuple[int, ...]], layers: int) -> MoEConfig:
    count = _key(reader, "expert_count")
    if not count:
        raise ConfigError(f"GGUF deepseek2 without routed experts (expert_count={count}) is not supported")
    gating = _key(reader, "expert_gating_func", 1)
    if gating not in GATING_FUNCS:
        raise ConfigError(f"GGUF deepseek2: expert_gating_func={gating} is not supported; "
                          "1 (softmax) or 2 (sigmoid)")
    scoring = GATING_FUNCS[gating]
    biased = any(name.endswith(".exp_probs_b.bias") for name in shapes)
    if biased != (scoring == "sigmoid"):
        raise ConfigError(f"GGUF deepseek2: {scoring} gating {'with' if biased else 'without'} the score-correction "
                          "bias exp_probs_b is not supported (sigmoid needs it, softmax has none)")
    groups = int(_key(reader, "expert_group_count", 1) or 1)
    method = "noaux_tc" if scoring == "sigmoid" else "group_limited_greedy" if groups > 1 else "greedy"
    lead = int(_key(reader, "leading_dense_block_count", 0))
    sparse = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in shapes]
    if sparse != list(range(lead, layers)):
        raise ConfigError(f"GGUF deepseek2: leading_dense_block_count={lead} says layers {lead}..{layers - 1} "
                          f"are sparse, but the routers (ffn_gate_inp) are in layers {sparse}")
    width = required(reader, ARCH, "expert_feed_forward_length")
    return MoEConfig(
        num_experts=int(count),
        num_experts_per_tok=required(reader, ARCH, "expert_used_count"),
        expert_intermediate_size=width,
        norm_topk_prob=bool(_key(reader, "expert_weights_norm", False)),
        shared_expert_intermediate_size=int(_key(reader, "expert_shared_count", 0)) * width,
        dense_layers=tuple(range(lead)),
        scoring=scoring,
        topk_method=method,
        n_group=groups if method != "greedy" else 1,
        topk_group=int(_key(reader, "expert_group_used_count", 1)) if method != "greedy" else 1,
        routed_scaling_factor=float(_key(reader, "expert_weights_scale", 1.0)),
    )


def _rope_scaling(reader: GgufFile) -> dict[str, Any] | None:
    """gguf.py's reading plus DeepSeek's YaRN magnitude (see the module docstring)."""
    scaling = rope_scaling_from_gguf(reader, ARCH)
    if scaling is None or scaling["rope_type"] != "yarn":
        return scaling
    scaling.setdefault("beta_fast", 32.0)
    scaling.setdefault("beta_slow", 1.0)
    log_mul = _key(reader, "rope.scaling.yarn_log_multiplier")
    if log_mul:
        # Rounded: the stored float32 product is not exactly 0.1 · mscale_all_dim, and the checkpoint's
        # value is a short decimal (1.0 for V3, 0.707 for V2).
        mscale = round(float(log_mul) / YARN_LOG_MUL_UNIT, 6)
        scaling["mscale"] = scaling["mscale_all_dim"] = mscale
    return scaling


def join_kv_b(state: dict[str, Any], config: ModelConfig) -> None:
    """Replace each layer's split `k_b_proj` [H, C, N] / `v_b_proj` [H, V, C] by `kv_b_proj` [H·(N+V), C]
    (per head: the N key rows, then the V value rows), in place. A layer stored whole keeps its
    `kv_b_proj`, and a split pair stored beside it is dropped (the whole tensor is the converter's input)."""
    mla = config.mla
    assert mla is not None
    for i in range(config.num_layers):
        p = f"layers.{i}."
        k_b, v_b = state.pop(p + "k_b_proj", None), state.pop(p + "v_b_proj", None)
        if p + "kv_b_proj" in state:
            continue
        if k_b is None or v_b is None:
            raise UnsupportedWeightError(f"GGUF deepseek2 layer {i} has no attn_kv_b and not both of "
                                         "attn_k_b/attn_v_b")
        joined = torch.cat([k_b.transpose(1, 2), v_b], dim=1)  # [H, N+V, C]
        state[p + "kv_b_proj"] = joined.reshape(-1, mla.kv_lora_rank).contiguous()
