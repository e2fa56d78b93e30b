"""Which kernels compute a step's attention: one `AttentionBackend`, chosen once per model runner.

`select_backend(config)` picks it when a `ModelRunner` (or a draft model's proposer) is built: the native
kernels (`NativeAttention`) when `EngineConfig.use_native_kernels` is set and the paged attention kernel
loads, else the torch reference ops (`TorchAttention`). `attention.layout` puts it in every step's
`AttentionMetadata.backend`, and the model code (`attention.rope_attention`, `models/mla.py`,
`models/llama.py`) calls its ops without asking which one it has. The backend's contract is
`AttentionBackend`'s docstring.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from deepinfer import kernels
from deepinfer.kernels import attention_amx
from deepinfer.kernels.rope_write import rope_write_prefill, rope_write_prefill_reference

if TYPE_CHECKING:
    from deepinfer.config.engine import EngineConfig
    from deepinfer.kernels.decode_layers import DecodeStack

__all__ = ["NATIVE", "TORCH", "AttentionBackend", "NativeAttention", "TorchAttention", "backend_for",
           "select_backend"]


@runtime_checkable
class LayerLoopModel(Protocol):
    """A model that can run a step of decode rows through all its layers in one native call (LlamaModel)."""

    def use_decode_loop(self, enabled: bool = True) -> None: ...

    def decode_stack(self) -> DecodeStack | None: ...


class AttentionBackend:
    """The attention ops of a step. Shapes: T rows, `heads` query heads and `kv_heads` K/V heads of width D;
    k_cache, v_cache are one layer's views [num_blocks, block_size, kv_heads, D] of the pool (fp32 or fp16:
    stores round into the cache dtype, reads widen back, arithmetic is in the query's dtype).

    * `rope_write_decode_attention(qkv, cos, sin, positions, slot_blocks, slot_offsets, k_cache, v_cache,
      block_tables, context_lens, scale, out)` — rope + write + decode attention for the first
      B = len(block_tables) rows of qkv [T, (heads + 2 * kv_heads) * D] (the step's decode rows): rotate
      their q and k (in place in qkv, or not: callers must not read qkv afterwards), store their K/V at
      their slots, then attend, one query per row, to its first context_lens[i] positions into out [B,
      heads, D]. Every row's K/V is stored before any row attends (verification rows of one sequence see
      each other).
    * `rope_write_prefill(qkv, cos, sin, positions, slot_blocks, slot_offsets, k_cache, v_cache)` — prefill
      write and layout: the same rotation and store for prefill rows, returning q [heads, T, D], k and v
      [kv_heads, T, D], contiguous (head-major), k and v as the cache holds them (rounded through its dtype).
    * `decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, out=None)` — one query per
      row, q [B, heads, D], over its paged context (K/V already stored); returns out [B, heads, D].
      MLA's absorbed decode runs on it with one latent K/V head.
    * `prefill_attention(q, k, v, scale, out, mask=None)` — one prefill chunk's causal attention: q [heads,
      q_len, D] are the last q_len positions of the context k, v [kv_heads, context_len, D] (query i sees the
      keys up to context_len - q_len + i); writes out [q_len, heads, D]. A `mask` ([q_len, context_len] bool, a
      draft tree's) says instead which keys each query sees.
    * `layer_loop(model)` — the native fast path: the C loop that runs a step of decode rows through every
      layer of `model` in one call (`kernels.decode_layers.DecodeStack`; it calls this backend's kernels in
      the per-op order, so the same bits), or None: the model takes its per-op path.

    Invariants: the two backends store bit-identical K/V; their attention agrees to fp32 rounding (bit for
    bit where both run SDPA); with either one, a row's result depends only on its own sequence, never on
    the rest of the batch. A backend holds no per-step state: one instance serves every step of its runner.
    """

    native: bool = False  # the C kernels (for reports and tests; the model code never branches on it)
    decode_loop: bool = False  # whether `layer_loop` may hand out the C layer loop (decided at construction)

    def bind(self, model: object) -> None:
        """Called once by the runner that owns `model`: a model with its own layer-loop switch is switched
        off where this backend does not take the loop, so `model.decode_stack()` tells what its steps run."""
        if not self.decode_loop and isinstance(model, LayerLoopModel):
            model.use_decode_loop(False)

    def layer_loop(self, model: LayerLoopModel) -> DecodeStack | None:
        return None

    def rope_write_decode_attention(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                    positions: torch.Tensor, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor,
                                    k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                                    context_lens: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def rope_write_prefill(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                           slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                         out: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                          out: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(decode_loop={self.decode_loop})"


class TorchAttention(AttentionBackend):
    """The reference: every op in torch, on any one device. What runs when native kernels are turned off or
    cannot be built, and the oracle the native backend is checked against."""

    def rope_write_decode_attention(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                    positions: torch.Tensor, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor,
                                    k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                                    context_lens: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
        # The prefill rows' torch steps, then decode attention over the head-major q: the ops (and the
        # operand layouts) the torch path has always run for decode rows, so its outputs keep their bits.
        B = block_tables.shape[0]
        q, _, _ = rope_write_prefill_reference(qkv[:B], cos, sin, positions[:B], slot_blocks[:B], slot_offsets[:B],
                                               k_cache, v_cache)
        return kernels.paged_decode_attention_reference(q.transpose(0, 1), k_cache, v_cache, block_tables,
                                                        context_lens, scale, out=out)

    def rope_write_prefill(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                           slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return rope_write_prefill_reference(qkv, cos, sin, positions, slot_blocks, slot_offsets, k_cache, v_cache)

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                         out: torch.Tensor | None = None) -> torch.Tensor:
        return kernels.paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale, out)

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                          out: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        _sdpa_prefill(q, k, v, scale, out, mask)


class NativeAttention(AttentionBackend):
    """The C kernels (`kernels/paged_attention.c`, AMX tiles for prefill chunks where the CPU has them), and
    the C layer loop as the fast path for steps of decode rows when `decode_loop` (EngineConfig.decode_loop).
    Each kernel falls back to its torch version on its own when it cannot be built or the tensors are not on
    the CPU."""

    native = True

    def __init__(self, decode_loop: bool = True) -> None:
        self.decode_loop = decode_loop

    def layer_loop(self, model: LayerLoopModel) -> DecodeStack | None:
        # The model binds (and caches) the loop to its current layers; None where its layers do not fit it.
        return model.decode_stack() if self.decode_loop else None

    def rope_write_decode_attention(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                    positions: torch.Tensor, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor,
                                    k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                                    context_lens: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
        return kernels.rope_write_decode_attention(qkv, cos, sin, positions, slot_blocks, slot_offsets, k_cache,
                                                   v_cache, block_tables, context_lens, scale, out=out)

    def rope_write_prefill(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                           slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return rope_write_prefill(qkv, cos, sin, positions, slot_blocks, slot_offsets, k_cache, v_cache)

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                         out: torch.Tensor | None = None) -> torch.Tensor:
        return kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, out)

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                          out: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        # AMX tiles (fp32's accuracy, ~1.8x SDPA on a 1,024-token chunk) where the CPU and the shape allow; the
        # tiles are causal only, so a draft tree's mask takes SDPA.
        if (mask is None and q.dtype == torch.float32 and q.is_cpu
                and attention_amx.supports(q.shape[2], q.shape[0], k.shape[0])):
            attention_amx.prefill_attention(q, k, v, scale, out=out)
        else:
            _sdpa_prefill(q, k, v, scale, out, mask)


def _sdpa_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor,
                  mask: torch.Tensor | None = None) -> None:
    """`AttentionBackend.prefill_attention` with torch's SDPA."""
    q_len, context_len = q.shape[1], k.shape[1]
    # SDPA takes its fused (flash) CPU path only for 4-D inputs; 3-D falls back to the math
    # path, which materialises every score and ran ~7x slower on a 1k-token prefill.
    if mask is not None:
        o = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                           attn_mask=mask.to(q.device), scale=scale, enable_gqa=True)
    elif context_len == q_len:
        o = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), is_causal=True,
                                           scale=scale, enable_gqa=True)
    else:
        mask = torch.ones(q_len, context_len, dtype=torch.bool).tril(context_len - q_len)
        o = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                           scale=scale, enable_gqa=True)
    out.copy_(o[0].transpose(0, 1))


# The shared instances: backends hold no per-step state.
NATIVE: AttentionBackend = NativeAttention(decode_loop=True)
TORCH: AttentionBackend = TorchAttention()


def backend_for(native: bool) -> AttentionBackend:
    """NATIVE or TORCH, for callers that still choose by a flag (`layout(..., use_native)`)."""
    return NATIVE if native else TORCH


def select_backend(config: EngineConfig) -> AttentionBackend:
    """The backend for a runner built with `config`, decided once: the native kernels when asked for and the
    paged attention kernel loads (else every op in torch), with the C layer loop when `config.decode_loop`."""
    if not (config.use_native_kernels and kernels.native_available()):
        return TORCH
    return NATIVE if config.decode_loop else NativeAttention(decode_loop=False)
