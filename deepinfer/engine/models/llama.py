"""A Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Mistral without sliding window) over a paged KV cache.

Weights arrive in the engine's names (see `deepinfer.loading.weights`) and are fused here: Q/K/V into
one projection and gate/up into another, so each layer runs four matmuls. The model is stateless
apart from its weights: the KV tensor and the step's attention metadata are passed in (the contract
is `deepinfer.engine.models.base.CausalLM`).

A step whose rows are all decode rows runs the whole layer stack in one native call
(`kernels/decode_layers.py`: the same kernels in the same order, so the same bits) when the step's
attention backend takes that fast path (`AttentionBackend.layer_loop`: the native backend, unless
`EngineConfig.decode_loop` is off) and every layer is a dense SwiGLU one; other steps, and models with
other blocks, take the per-op loop in `forward`.

Each layer's MLP is a pluggable block, any callable from the normed hidden states [T, hidden] to the
MLP's output [T, hidden]: `LlamaModel.build_mlp` makes the dense SwiGLU one, and a subclass overrides
it to give some layers another (the mixture-of-experts models of `moe.py`), sharing the attention.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from deepinfer.config.model import ModelConfig
from deepinfer.engine.attention import AttentionMetadata, rope_attention
from deepinfer.engine.models.linear import Weight, embed_rows, fuse_rows, in_one_arena, linear, to_device
from deepinfer.engine.models.rope import RotaryTable
from deepinfer.kernels.decode_layers import DecodeStack, LayerWeights, silu_mul
from deepinfer.kernels.rms_norm import rms_norm

# A layer's MLP block: normed hidden states [T, hidden] -> output [T, hidden], each row from its own row.
FeedForward = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: Weight  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None
    o_proj: Weight
    post_attn_norm: torch.Tensor
    mlp: FeedForward


@dataclass
class DenseMLP:
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one projection."""

    gate_up: Weight  # [2 * intermediate, hidden]
    down: Weight  # [hidden, intermediate]

    @classmethod
    def from_state(cls, sd: dict[str, Weight], prefix: str) -> DenseMLP:
        """From `{prefix}gate_proj`, `{prefix}up_proj`, `{prefix}down_proj`."""
        return cls(fuse_rows([sd[prefix + "gate_proj"], sd[prefix + "up_proj"]]), sd[prefix + "down_proj"])

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return linear(silu_mul(linear(h, self.gate_up)), self.down)


class LlamaModel:
    """Dense Llama-family decoder; a `CausalLM` (see base.py). Subclasses change the MLP blocks only."""

    def __init__(self, config: ModelConfig, state_dict: dict[str, Weight], max_positions: int,
                 device: str = "cpu") -> None:
        """`state_dict`: our names (weights.py); projections may be PackedWeight (packed_weights.py)."""
        self.config = config
        self.max_positions = max_positions
        c = config
        sd = {k: to_device(v, device) for k, v in state_dict.items()}
        self.embed = sd["embed_tokens"]
        self.norm = sd["norm"]
        self.lm_head = self.embed if c.tie_word_embeddings else sd["lm_head"]
        self.layers: list[_Layer] = []
        for i in range(c.num_layers):
            p = f"layers.{i}."
            bias = None
            if c.attention_bias:
                bias = torch.cat([sd[p + "q_bias"], sd[p + "k_bias"], sd[p + "v_bias"]])
            self.layers.append(
                _Layer(
                    input_norm=sd[p + "input_norm"],
                    qkv=fuse_rows([sd[p + "q_proj"], sd[p + "k_proj"], sd[p + "v_proj"]]),
                    qkv_bias=bias,
                    o_proj=sd[p + "o_proj"],
                    post_attn_norm=sd[p + "post_attn_norm"],
                    mlp=self.build_mlp(i, sd),
                )
            )
        self._pack_weights_in_step_order()
        self.rotary = RotaryTable(c, max_positions)
        self.scale = c.head_dim**-0.5
        self._q_dim = c.num_heads * c.head_dim
        self._kv_dim = c.num_kv_heads * c.head_dim

    def _pack_weights_in_step_order(self) -> None:
        """Packed weights (dense layers and the LM head) into one huge-page arena in the order a step
        reads them (see linear.in_one_arena). A tied embedding is the LM head's arena copy."""
        order: list[Weight] = []
        for layer in self.layers:
            order += [layer.qkv, layer.o_proj]
            if isinstance(layer.mlp, DenseMLP):
                order += [layer.mlp.gate_up, layer.mlp.down]
        order.append(self.lm_head)
        moved = iter(in_one_arena(order))
        for layer in self.layers:
            layer.qkv, layer.o_proj = next(moved), next(moved)
            if isinstance(layer.mlp, DenseMLP):
                layer.mlp.gate_up, layer.mlp.down = next(moved), next(moved)
        tied = self.embed is self.lm_head
        self.lm_head = next(moved)
        if tied:
            self.embed = self.lm_head

    def build_mlp(self, layer: int, sd: dict[str, Weight]) -> FeedForward:
        """Layer `layer`'s MLP block from the state dict (our names, already on the device)."""
        return DenseMLP.from_state(sd, f"layers.{layer}.")

    def truncated(self, num_layers: int) -> LlamaModel:
        """The same model with only its first `num_layers` layers (final norm and LM head kept), sharing
        the weights: what a self-draft runs."""
        if not 1 <= num_layers <= self.config.num_layers:
            raise ValueError(f"a model of {self.config.num_layers} layers has no first {num_layers}")
        short = copy.copy(self)
        short.layers = self.layers[:num_layers]
        short.config = dataclasses.replace(self.config, num_layers=num_layers)
        return short

    def use_decode_loop(self, enabled: bool = True) -> None:
        """Let decode steps take the native layer loop (the default, where it applies and the step's backend
        takes it) or keep every step per op (for comparisons; a runner whose backend does not take the loop
        turns it off here when it is built, `AttentionBackend.bind`). Either way the current binding is
        dropped, so layers whose modules were replaced in place are bound anew."""
        self._decode_loop_enabled = enabled
        self._decode_stack = None

    def decode_stack(self) -> DecodeStack | None:
        """The native layer loop bound to this model's layers (built on first use, again after the layer
        list changes, as in `truncated`), or None where it does not apply or is turned off."""
        if not self.__dict__.get("_decode_loop_enabled", True):
            return None
        bound = self.__dict__.get("_decode_stack")
        if bound is None or bound[0] is not self.layers:
            bound = self._decode_stack = (self.layers, _bind_decode_loop(self.layers))
        return bound[1]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor,
                meta: AttentionMetadata, logits_rows: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] int64. kv: the pool of `KvSpec.for_model(config, block_size)`,
        [num_blocks, layers, 2 (K, V), block_size, kv_heads, head_dim].
        Returns fp32 logits [len(logits_rows), vocab] for the requested token rows."""
        c = self.config
        T = input_ids.shape[0]
        eps = c.rms_norm_eps
        # x is the residual stream; each sublayer's output joins it inside the norm that reads it next
        # (rms_norm's residual=, in place), and `pending` is the last MLP's output, added at the end.
        x = embed_rows(input_ids, self.embed)
        # A step of decode rows runs every layer in one native call (the same kernels, the same bits) when
        # the step's backend takes that fast path and the model and the step fit it; otherwise, or when it
        # declines, the per-op loop below.
        stack = meta.backend.layer_loop(self)
        pending = None if stack is None else stack.run(x, positions, kv, meta, self.rotary.cos, self.rotary.sin,
                                                       self.scale, eps, self._q_dim)
        if pending is None:
            for i, layer in enumerate(self.layers):
                h = rms_norm(x, layer.input_norm, eps, residual=pending)
                qkv = linear(h, layer.qkv, layer.qkv_bias)
                o = rope_attention(qkv, positions, self.rotary, kv[:, i, 0], kv[:, i, 1], meta, self.scale)
                h = rms_norm(x, layer.post_attn_norm, eps, residual=linear(o.view(T, self._q_dim), layer.o_proj))
                pending = layer.mlp(h)
        rows = x[logits_rows]  # a copy: only these rows need the last add and the final norm
        return linear(rms_norm(rows, self.norm, eps, residual=None if pending is None else pending[logits_rows]),
                      self.lm_head)


def _bind_decode_loop(layers: Sequence[_Layer]) -> DecodeStack | None:
    """The native loop over `layers`, when every MLP is a dense SwiGLU (the only MLP the loop computes)."""
    if not layers or not all(isinstance(layer.mlp, DenseMLP) for layer in layers):
        return None
    return DecodeStack.for_layers([
        LayerWeights(layer.input_norm, layer.post_attn_norm, layer.qkv, layer.qkv_bias, layer.o_proj,
                     layer.mlp.gate_up, layer.mlp.down)
        for layer in layers])
