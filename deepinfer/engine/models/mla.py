"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of latents.

Per token and layer the cache holds one vector of `kv_lora_rank + qk_rope_head_dim` floats: the
RMS-normed compressed latent c, then the roped key k_r that every head shares (the "latent" component
of `KvSpec.for_model`). Head h's key is [W_UK[h] c, k_r] and its value W_UV[h] c, where W_UK and W_UV
are the two halves of kv_b_proj; nothing per head is ever cached.

Two ways to attend, picked by the kind of row (see `attention.layout`):

* Decode rows use the *absorbed* form. q·k = q_nope·(W_UK c) + q_r·k_r = (W_UKᵀ q_nope)·c + q_r·k_r, so
  each head's query is moved into latent space once ([q_lat, q_r], kv_lora_rank + rope wide) and scored
  against the cached vectors as they are; the softmax-weighted sum of latents is taken back through
  W_UV once per head. That is multi-query attention with one KV head whose key and value are both the
  cached vector, so it runs on the paged decode kernel unchanged (the value's trailing rope columns
  come out too and are dropped). A decode step is memory-bound: it reads kv_lora_rank + rope floats
  per context token and layer, instead of heads·(nope + rope + v) for expanded keys and values — the
  point of MLA — and it never materialises per-head K/V.
* Prefill chunks use the *expanded* form: the chunk's context latents go through kv_b_proj into
  per-head keys and values and one causal SDPA runs over them. A prefill chunk is compute-bound, and
  expanded heads are nope + rope wide where absorbed ones are kv_lora_rank + rope (for DeepSeek-V3
  192 vs 576), so past a few hundred query tokens expanding the context once costs fewer FLOPs than
  scoring every query pair in latent space.

The rope dimensions: DeepSeek's checkpoints rotate adjacent pairs (x0, x1), (x2, x3), ... (V3 with
`rope_interleave`, and V2 always). `MLAttention.from_state` reorders the rope rows of the query and
kv_a projections once, evens then odds, so the Llama half-split rotation of `rope.apply_rotary` rotates
the same pairs by the same angles. q·k is unchanged by the reordering (both sides move alike), and the
cached rope key is in the reordered layout — only this module reads it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepinfer.config.model import ModelConfig
from deepinfer.engine.attention import AttentionMetadata, PrefillChunk
from deepinfer.engine.models.linear import linear
from deepinfer.engine.models.llama import rms_norm
from deepinfer.engine.models.rope import apply_rotary

# transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps, not config.rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def softmax_scale(config: ModelConfig) -> float:
    """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)² when the rope is scaled and the config
    names `mscale_all_dim` (DeepSeek's YaRN: the longer context sharpens every head's softmax)."""
    assert config.mla is not None
    scale = config.mla.qk_head_dim ** -0.5
    p = config.rope_scaling or {}
    if config.rope_type != "default" and p.get("mscale_all_dim"):
        factor = float(p["factor"])
        m = 1.0 if factor <= 1 else 0.1 * float(p["mscale_all_dim"]) * math.log(factor) + 1.0
        scale *= m * m
    return scale


def deinterleave(rows: int) -> torch.Tensor:
    """The row order [0, 2, 4, ..., 1, 3, 5, ...] of `rows` (even) rope rows: pairs become half splits."""
    return torch.cat([torch.arange(0, rows, 2), torch.arange(1, rows, 2)])


@dataclass
class MLAttention:
    """One layer's latent attention; `__call__` maps normed hidden states to the attention output."""

    q_proj: torch.Tensor | None  # [H·(N+R), hidden] when q_lora_rank is None
    q_a_proj: torch.Tensor | None  # [Q, hidden] when q_lora_rank is set
    q_a_bias: torch.Tensor | None
    q_a_norm: torch.Tensor | None
    q_b_proj: torch.Tensor | None  # [H·(N+R), Q]
    kv_a_proj: torch.Tensor  # [C+R, hidden]
    kv_a_bias: torch.Tensor | None
    kv_a_norm: torch.Tensor  # [C]
    kv_b_proj: torch.Tensor  # [H·(N+V), C]: the expanded form's projection
    w_uk: torch.Tensor  # [H, N, C]: the absorbed form's key half of kv_b_proj
    w_uv: torch.Tensor  # [H, V, C]: its value half
    o_proj: torch.Tensor  # [hidden, H·V]
    o_bias: torch.Tensor | None
    num_heads: int
    nope: int  # N
    rope: int  # R
    v_dim: int  # V
    kv_lora: int  # C
    scale: float

    @classmethod
    def from_state(cls, sd: dict[str, torch.Tensor], prefix: str, config: ModelConfig) -> MLAttention:
        """From `{prefix}q_proj` (or q_a_proj/q_a_norm/q_b_proj), kv_a_proj, kv_a_norm, kv_b_proj, o_proj
        and the biases when config.attention_bias (our names, see weights.py)."""
        mla = config.mla
        assert mla is not None
        H, N, R, V, C = config.num_heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim, mla.kv_lora_rank
        q_name = prefix + ("q_proj" if mla.q_lora_rank is None else "q_b_proj")
        q_out, kv_a, kv_a_bias = sd[q_name], sd[prefix + "kv_a_proj"], sd.get(prefix + "kv_a_bias")
        if mla.rope_interleave:  # see the module docstring
            order = deinterleave(R).to(q_out.device)
            q_out = q_out.view(H, N + R, -1)
            q_out = torch.cat([q_out[:, :N], q_out[:, N:][:, order]], dim=1).reshape(H * (N + R), -1)
            kv_a = torch.cat([kv_a[:C], kv_a[C:][order]])
            if kv_a_bias is not None:
                kv_a_bias = torch.cat([kv_a_bias[:C], kv_a_bias[C:][order]])
        kv_b = sd[prefix + "kv_b_proj"]
        per_head = kv_b.view(H, N + V, C)
        lora = mla.q_lora_rank is not None
        return cls(
            q_proj=None if lora else q_out,
            q_a_proj=sd[prefix + "q_a_proj"] if lora else None,
            q_a_bias=sd.get(prefix + "q_a_bias") if lora else None,
            q_a_norm=sd[prefix + "q_a_norm"] if lora else None,
            q_b_proj=q_out if lora else None,
            kv_a_proj=kv_a, kv_a_bias=kv_a_bias, kv_a_norm=sd[prefix + "kv_a_norm"],
            kv_b_proj=kv_b, w_uk=per_head[:, :N].contiguous(), w_uv=per_head[:, N:].contiguous(),
            o_proj=sd[prefix + "o_proj"], o_bias=sd.get(prefix + "o_bias"),
            num_heads=H, nope=N, rope=R, v_dim=V, kv_lora=C, scale=softmax_scale(config),
        )

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """h: normed hidden states [T, hidden]; cos, sin: `RotaryTable.lookup` of the step's positions;
        cache: this layer's latent view [num_blocks, block_size, C+R] (strided in dim 0). Writes the
        step's latents into the slots `meta` names, then attends; returns [T, hidden]."""
        T, H, N = h.shape[0], self.num_heads, self.nope
        if self.q_proj is not None:
            q = linear(h, self.q_proj)
        else:
            assert self.q_a_proj is not None and self.q_a_norm is not None and self.q_b_proj is not None
            q = linear(rms_norm(linear(h, self.q_a_proj, self.q_a_bias), self.q_a_norm, LATENT_NORM_EPS), self.q_b_proj)
        q = q.view(T, H, N + self.rope)
        q_nope, q_rope = q[..., :N], apply_rotary(q[..., N:], cos, sin)
        kv_a = linear(h, self.kv_a_proj, self.kv_a_bias)
        latent = torch.cat([rms_norm(kv_a[:, : self.kv_lora], self.kv_a_norm, LATENT_NORM_EPS),
                            apply_rotary(kv_a[:, None, self.kv_lora :], cos, sin)[:, 0]], dim=-1)
        # Every row's latent is in the cache before any row attends: a decode row sees the rows of its
        # sequence before it in this step (speculative verification) through the cache. An fp16 cache
        # stores it rounded; every read widens it again (see attention.py on narrower caches).
        cache.index_put_((meta.slot_blocks, meta.slot_offsets), latent.to(cache.dtype))
        out = torch.empty(T, H, self.v_dim, dtype=h.dtype, device=h.device)
        nd = meta.num_decode
        if nd:
            out[:nd] = self._decode(q_nope[:nd], q_rope[:nd], cache, meta)
        for chunk in meta.prefills:
            rows = slice(chunk.q_start, chunk.q_start + chunk.q_len)
            out[rows] = self._prefill(q_nope[rows], q_rope[rows], latent[rows], cache, chunk)
        return linear(out.view(T, H * self.v_dim), self.o_proj, self.o_bias)

    def _decode(self, q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Absorbed attention of decode rows ([nd, H, N], [nd, H, R]) over their paged latents: [nd, H, V]."""
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        q_lat = torch.einsum("thn,hnc->thc", q_nope, self.w_uk)
        query = torch.cat([q_lat, q_rope], dim=-1).contiguous()  # [nd, H, C+R]
        kv = cache.unsqueeze(2)  # [num_blocks, block_size, 1 KV head, C+R]: key and value alike
        o = meta.backend.decode_attention(query, kv, kv, meta.decode_block_tables, meta.decode_context_lens,
                                          self.scale)
        return torch.einsum("thc,hvc->thv", o[..., : self.kv_lora], self.w_uv)

    def _prefill(self, q_nope: torch.Tensor, q_rope: torch.Tensor, fresh: torch.Tensor, cache: torch.Tensor,
                 chunk: PrefillChunk) -> torch.Tensor:
        """Expanded causal attention of one chunk's queries over its context: [q_len, H, V]. `fresh` is
        the chunk's own latents, used as the cache holds them (rounded through its dtype); a chunk with
        earlier context reads all of it from the cache, widened to the queries' dtype."""
        H, N, C = self.num_heads, self.nope, self.kv_lora
        if chunk.context_len == chunk.q_len and chunk.mask is None:
            lat, mask = fresh.to(cache.dtype).to(fresh.dtype), None
        else:
            lat = cache.index_select(0, chunk.block_ids).flatten(0, 1)[: chunk.context_len].to(fresh.dtype)
            # Causal (query i sits at absolute position context_len - q_len + i and sees keys up to there), or a
            # draft tree's mask.
            mask = chunk.attention_mask(lat.device)
        ctx = lat.shape[0]
        kv = linear(lat[:, :C], self.kv_b_proj).view(ctx, H, N + self.v_dim)
        k = torch.cat([kv[..., :N], lat[:, None, C:].expand(ctx, H, self.rope)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        # [1, H, len, D]: SDPA's fused CPU path wants 4-D inputs (see attention.paged_attention).
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, kv[..., N:]))
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=mask is None, scale=self.scale)
        return o[0].transpose(0, 1)
