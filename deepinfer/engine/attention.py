"""Paged attention over a batch that mixes decode rows and prefill chunks.

A step's tokens are laid out row after row: first the single-token rows (decodes, and prefill
chunks of one token), then the multi-token prefill chunks. Every row reads its context through its
block table straight from the KV tensor; nothing is concatenated per step.

Which kernels run each op is the step's `AttentionBackend` (`attention_backend.py`), chosen once when
the model runner is built and carried in `AttentionMetadata.backend`; this module only lays the step
out and sequences the ops:

* Single-token rows take one call per layer, the backend's `rope_write_decode_attention`: it rotates
  their q and k, stores their K/V and runs decode attention, which reads K/V in place (natively one C
  call, bit-identical to `apply_rotary`, `rope_write.write_kv` and `paged_decode_attention` in turn).
* The multi-token rows take one call per layer too, the backend's `rope_write_prefill`: it rotates
  their q and k, stores their K/V and lays q, k, v out head-major (bit-identical to `apply_rotary`,
  `rope_write.write_kv` and `rope_write.as_cached`). Each chunk then gathers its own context blocks
  once (a chunk with no earlier context attends to its fresh K/V directly) and attends causally with
  the backend's `prefill_attention` (natively on AMX tiles where the CPU has them, else SDPA).

The cache may hold K/V in a narrower dtype than the step computes in (an fp16 KV cache, fp32
activations): the store rounds on the way in, every reader widens what it reads, and all
arithmetic is in the query's dtype. A chunk attending to its fresh K/V uses them rounded through the
cache dtype, so a token's attention sees the same values whether its context was just computed,
read back from the pool, or imported from a cache tier (outputs do not depend on chunking or on
prefix-cache hits).

The contract between a step's callers and this module is `layout(segments)`: each `Segment` is a run
of consecutive tokens of one sequence with its block table. A one-token segment, or one marked
`rows` (speculative verification, a draft's catch-up that must stay on the kernel), becomes decode
rows — one per token, each with context up to its own position, sharing the sequence's block table:
every row's K/V is written before attention, so a row sees the rows before it and none after. A segment
with a draft `tree` (speculative/tree.py) is a prefill chunk whose rows sit at their nodes' depths and see
their ancestors only (`PrefillChunk.mask`). Any other segment is a prefill chunk. `layout` builds the token
tensors, the metadata and the logits rows; the model runner and the draft models both step through it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from deepinfer.engine.attention_backend import NATIVE, AttentionBackend, backend_for
from deepinfer.engine.speculative.tree import depths, tree_mask

if TYPE_CHECKING:
    from deepinfer.engine.models.rope import RotaryTable


@dataclass
class PrefillChunk:
    """One multi-token row: query tokens [q_start, q_start + q_len) of the step, attending to the
    first `context_len` tokens of its sequence (the chunk's own tokens are the last q_len of them)."""

    q_start: int
    q_len: int
    context_len: int
    block_ids: torch.Tensor  # int64, the blocks covering context_len tokens
    # [q_len, context_len] bool, which keys each query sees: a draft tree's (tree.tree_mask). None: causal, the
    # query i at slot context_len - q_len + i seeing every key up to it.
    mask: torch.Tensor | None = None

    def attention_mask(self, device: torch.device) -> torch.Tensor:
        """The mask to attend with when the chunk reads earlier context (for a fresh chunk, causal is implied)."""
        if self.mask is not None:
            return self.mask.to(device)
        return torch.ones(self.q_len, self.context_len, dtype=torch.bool, device=device).tril(
            self.context_len - self.q_len)


@dataclass
class AttentionMetadata:
    # Where each of the step's T tokens writes its K/V.
    slot_blocks: torch.Tensor  # [T] int64
    slot_offsets: torch.Tensor  # [T] int64
    num_decode: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decode, max_blocks] int32
    decode_context_lens: torch.Tensor | None = None  # [num_decode] int32
    prefills: list[PrefillChunk] = field(default_factory=list)
    # The kernels every op of the step runs on: the runner's, chosen once when it was built.
    backend: AttentionBackend = NATIVE

    @property
    def use_native(self) -> bool:
        """Whether the step runs on the native backend (a view of `backend`, for callers that pick by flag)."""
        return self.backend.native

    @use_native.setter
    def use_native(self, native: bool) -> None:
        self.backend = backend_for(native)


@dataclass
class Segment:
    """Consecutive tokens of one sequence to compute in a step."""

    token_ids: Sequence[int]
    start: int  # position of token_ids[0]
    block_ids: Sequence[int]  # the sequence's block table, covering start + len(token_ids) positions
    rows: bool = False  # lay out as decode rows even when longer than one token
    num_logits: int = 0  # logits wanted for this many trailing tokens
    # A draft tree's parents for token_ids[1:] (speculative/tree.py): token i + 1 is node i, at slot start + 1 + i,
    # rotary position start + its depth, attending to its ancestors only.
    tree: Sequence[int] | None = None


@dataclass
class StepLayout:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    # Rows to compute logits for: each segment's trailing num_logits tokens, in segment order.
    logits_rows: torch.Tensor


def layout(segments: Sequence[Segment], block_size: int, backend: AttentionBackend | bool = NATIVE) -> StepLayout:
    """Rows first (decode-kernel rows), then prefill chunks; see the module docstring. `backend`: the
    runner's (a bool picks the native or the torch backend, for callers that still choose by flag)."""
    if isinstance(backend, bool):
        backend = backend_for(backend)
    as_rows = [s for s in segments if (len(s.token_ids) == 1 or s.rows) and s.tree is None]
    chunks = [s for s in segments if len(s.token_ids) > 1 and (not s.rows or s.tree is not None)]
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    slot_positions: list[int] = []
    tables: list[Sequence[int]] = []
    prefills: list[PrefillChunk] = []
    first_row: dict[int, int] = {}
    for seg, is_chunk in [(s, False) for s in as_rows] + [(s, True) for s in chunks]:
        n, start, blocks = len(seg.token_ids), seg.start, seg.block_ids
        first_row[id(seg)] = len(ids)
        if is_chunk:
            context = start + n
            mask = None if seg.tree is None else tree_mask(seg.tree, start)
            prefills.append(PrefillChunk(len(ids), n, context,
                                         torch.tensor(list(blocks[: -(-context // block_size)]), dtype=torch.int64),
                                         mask))
        else:
            tables.extend([blocks] * n)
        ids.extend(seg.token_ids)
        if seg.tree is None:
            positions.extend(range(start, start + n))
        else:
            positions.extend([start] + [start + d for d in depths(seg.tree)])
        slot_positions.extend(range(start, start + n))  # a tree's nodes too: slots in node order
        slots.extend(blocks[p // block_size] for p in range(start, start + n))
    pos = torch.tensor(positions, dtype=torch.int64)
    meta = AttentionMetadata(slot_blocks=torch.tensor(slots, dtype=torch.int64),
                             slot_offsets=torch.tensor(slot_positions, dtype=torch.int64) % block_size,
                             num_decode=len(tables), prefills=prefills, backend=backend)
    if tables:
        contexts = [p + 1 for p in positions[: len(tables)]]
        lens = [-(-c // block_size) for c in contexts]
        width = max(lens)
        meta.decode_block_tables = torch.tensor([list(t[:n]) + [0] * (width - n) for t, n in zip(tables, lens)],
                                                dtype=torch.int32)
        meta.decode_context_lens = torch.tensor(contexts, dtype=torch.int32)
    logits_rows = [first_row[id(s)] + len(s.token_ids) - s.num_logits + j
                   for s in segments for j in range(s.num_logits)]
    return StepLayout(torch.tensor(ids, dtype=torch.int64), pos, meta, torch.tensor(logits_rows, dtype=torch.int64))


def rope_attention(qkv: torch.Tensor, positions: torch.Tensor, rotary: RotaryTable, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One layer's attention for the step: rotate q and k, store K/V, attend. qkv: the step's
    [T, (heads + 2 * kv_heads) * head_dim] projections (the backend may rotate the decode rows' q and k
    in place); positions: [T] int64; k_cache, v_cache: the layer's cache views. Returns [T, heads, head_dim].

    Decode rows take the backend's one rope + write + decode attention call; prefill rows its call that
    rotates, stores and lays out their q, k, v head-major, then `paged_attention`'s causal attention per
    chunk. The decode rows' K/V are stored first; they belong to other sequences than the chunks', so
    neither sees the other's."""
    if qkv.stride(-1) != 1:  # the kernel reads rows; a projection with a bias may come column-major
        qkv = qkv.contiguous()
    T, D, kvh = qkv.shape[0], rotary.cos.shape[1], k_cache.shape[2]
    heads = qkv.shape[1] // D - 2 * kvh
    out = qkv.new_empty((T, heads, D))
    backend, nd = meta.backend, meta.num_decode
    if nd:
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        backend.rope_write_decode_attention(qkv, rotary.cos, rotary.sin, positions, meta.slot_blocks,
                                            meta.slot_offsets, k_cache, v_cache, meta.decode_block_tables,
                                            meta.decode_context_lens, scale, out[:nd])
    if nd < T:
        q, k, v = backend.rope_write_prefill(qkv[nd:], rotary.cos, rotary.sin, positions[nd:], meta.slot_blocks[nd:],
                                             meta.slot_offsets[nd:], k_cache, v_cache)  # head-major, k and v as cached
        paged_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), k_cache, v_cache, meta, scale,
                        out=out[nd:], start=nd)
    return out


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None,
                    start: int = 0) -> torch.Tensor:
    """Attention of the step's rows from `start` on, on the step's backend. q: [T - start, heads, head_dim];
    k, v: their fresh [T - start, kv_heads, head_dim], already written to the cache and as it holds them
    (rounded through its dtype, as `rope_write_prefill` returns them). Returns `out`
    ([T - start, heads, head_dim], allocated when None)."""
    out = torch.empty_like(q) if out is None else out
    backend = meta.backend
    nd = meta.num_decode - start
    if nd > 0:
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        backend.decode_attention(q[:nd], k_cache, v_cache, meta.decode_block_tables[start:],
                                 meta.decode_context_lens[start:], scale, out=out[:nd])
    block_size = k_cache.shape[1]
    for chunk in meta.prefills:
        rows = slice(chunk.q_start - start, chunk.q_start - start + chunk.q_len)
        qh = q[rows].transpose(0, 1)  # [heads, q_len, D]
        if chunk.context_len == chunk.q_len and chunk.mask is None:
            kh, vh = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
        else:
            kh = _gather(k_cache, chunk, block_size, q.dtype)
            vh = _gather(v_cache, chunk, block_size, q.dtype)
        backend.prefill_attention(qh, kh, vh, scale, out[rows], chunk.mask)
    return out


def _gather(cache: torch.Tensor, chunk: PrefillChunk, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[kv_heads, context_len, D] copy of one sequence's context, widened to `dtype`."""
    blocks = cache.index_select(0, chunk.block_ids)  # [nb, bs, kvh, D]
    return blocks.flatten(0, 1)[: chunk.context_len].transpose(0, 1).to(dtype)
