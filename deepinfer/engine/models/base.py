"""What a model offers the engine: the contract every architecture in the registry implements.

A model is stateless apart from its weights. The model runner owns the paged KV tensor and passes it
in with the step's attention metadata; the model writes the KV of the step's tokens into the slots
the metadata names and reads earlier tokens' KV from their blocks, so a request's KV can be computed
in chunks, across steps, after a preemption or in another engine.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from deepinfer.config.model import ModelConfig
from deepinfer.engine.attention import AttentionMetadata


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only language model over a paged KV cache.

    * `config`: the architecture it was built for; the runner sizes the KV tensor from the `KvSpec`
      derived from it ([num_blocks, *spec.block_shape]; for Llama-family attention [num_blocks,
      num_layers, 2, block_size, num_kv_heads, head_dim], fp32; for MLA [num_blocks, num_layers, 1,
      block_size, kv_lora_rank + qk_rope_head_dim]).
    * `max_positions`: the longest context its position tables cover.
    * `forward(input_ids, positions, kv, meta, logits_rows)`: input_ids and positions are [T] int64
      (the step's tokens, requests concatenated); kv the runner's tensor; meta the step's attention
      metadata; logits_rows [R] int64 the token rows whose next-token logits are wanted. Returns fp32
      logits [R, vocab]. Each token's result depends only on its own request's tokens (its KV and the
      step's rows of the same request), never on the rest of the batch: outputs must not change with
      batch composition, chunking or preemption beyond floating-point rounding.
    """

    config: ModelConfig
    max_positions: int

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor,
                meta: AttentionMetadata, logits_rows: torch.Tensor) -> torch.Tensor: ...
