"""The model runner: owns the KV tensor and turns a scheduler step into one forward pass.

KV layout: one tensor [num_blocks, num_layers, 2 (K, V), block_size, kv_heads, head_dim]. A block is
therefore one contiguous slab holding every layer's K and V for `block_size` tokens, which is the
unit the cache tiers store and the P/D transfer moves; a layer's K (or V) is the strided view
`kv[:, layer, 0]`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.engine import kernels
from deepinfer.engine.attention import AttentionMetadata, PrefillChunk
from deepinfer.engine.config import EngineConfig, ModelConfig
from deepinfer.engine.models.llama import LlamaModel
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import ScheduledChunk, SchedulerOutput


def num_blocks_for_budget(model: ModelConfig, config: EngineConfig) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = model.kv_bytes_per_token * config.block_size
    n = config.kv_cache_bytes // per_block
    if n < 1:
        raise ValueError(f"kv_cache_bytes={config.kv_cache_bytes} is smaller than one KV block ({per_block} bytes)")
    return int(n)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor
    # The chunks whose logits rows are returned, in row order: 1 + chunk.num_spec rows each.
    sampled: list[ScheduledChunk]


class ModelRunner:
    def __init__(self, model: LlamaModel, config: EngineConfig, num_blocks: int) -> None:
        c = model.config
        self.model = model
        self.block_size = config.block_size
        # Zero-filled, not empty: the torch decode fallback multiplies masked (beyond-context) slots by
        # zero weights, and 0 * NaN from uninitialised memory would poison the row.
        self.kv = torch.zeros(
            (num_blocks, c.num_layers, 2, config.block_size, c.num_kv_heads, c.head_dim),
            dtype=torch.float32,
            device=config.device,
        )
        self.use_native = config.use_native_kernels and kernels.native_available()

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """Lay out the step's tokens: rows first (single tokens and speculating chunks, which take the
        decode kernel), then multi-token prefill chunks.

        A speculating chunk (the last committed token plus k drafts) becomes 1 + k decode rows that
        share the request's block table, row j with context up to its own position: every row's K/V
        is written before attention runs, so row j sees the drafts before it and none after — causal
        among themselves, on the kernel path, with no per-request loop."""
        row_chunks = [c for c in out.chunks if c.num_new_tokens == 1 or c.num_spec]
        multis = [c for c in out.chunks if c.num_new_tokens > 1 and not c.num_spec]
        ids: list[int] = []
        positions: list[int] = []
        row_requests: list[Request] = []
        logits_rows: list[int] = []
        sampled: list[ScheduledChunk] = []
        prefills: list[PrefillChunk] = []
        bs = self.block_size

        for chunk in row_chunks:
            req, pos = chunk.request, chunk.start
            tokens = [_token_at(req, pos)] + chunk.draft_token_ids
            if len(tokens) != chunk.num_new_tokens:
                raise ValueError(f"chunk of {req.request_id!r} has {len(tokens)} tokens for {chunk.num_new_tokens}")
            ids.extend(tokens)
            positions.extend(range(pos, pos + len(tokens)))
            row_requests.extend([req] * len(tokens))
        for chunk in multis:
            req, start, n = chunk.request, chunk.start, chunk.num_new_tokens
            q_start = len(ids)
            ids.extend(req.all_token_ids[start : start + n])
            positions.extend(range(start, start + n))
            context = start + n
            prefills.append(
                PrefillChunk(q_start, n, context, torch.tensor(req.block_ids[: -(-context // bs)], dtype=torch.int64))
            )
        row = 0
        for chunk in row_chunks + multis:
            row += chunk.num_new_tokens
            if chunk.samples:
                logits_rows.extend(range(row - 1 - chunk.num_spec, row))
                sampled.append(chunk)

        slot_blocks = [r.block_ids[p // bs] for r, p in zip(row_requests, positions)]
        for chunk in multis:
            blocks, start = chunk.request.block_ids, chunk.start
            slot_blocks.extend(blocks[p // bs] for p in range(start, start + chunk.num_new_tokens))
        pos_t = torch.tensor(positions, dtype=torch.int64)
        meta = AttentionMetadata(
            slot_blocks=torch.tensor(slot_blocks, dtype=torch.int64),
            slot_offsets=pos_t % bs,
            num_decode=len(row_requests),
            prefills=prefills,
            use_native=self.use_native,
        )
        if row_requests:
            contexts = [p + 1 for p in positions[: len(row_requests)]]
            meta.decode_block_tables = _block_table(row_requests, contexts, bs)
            meta.decode_context_lens = torch.tensor(contexts, dtype=torch.int32)
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=pos_t,
            meta=meta,
            logits_rows=torch.tensor(logits_rows, dtype=torch.int64),
            sampled=sampled,
        )

    def execute(self, out: SchedulerOutput) -> tuple[list[ScheduledChunk], torch.Tensor]:
        """Run the step; returns the chunks to sample for and their logits [rows, vocab] (1 + num_spec
        rows per chunk, in order)."""
        inputs = self.prepare(out)
        logits = self.model.forward(inputs.input_ids, inputs.positions, self.kv, inputs.meta, inputs.logits_rows)
        return inputs.sampled, logits


def _token_at(req: Request, pos: int) -> int:
    n_prompt = len(req.prompt_token_ids)
    return req.prompt_token_ids[pos] if pos < n_prompt else req.output_token_ids[pos - n_prompt]


def _block_table(requests: list[Request], contexts: list[int], block_size: int) -> torch.Tensor:
    """[rows, max_blocks] int32, each row the blocks covering its context, zero-padded."""
    lens = [-(-c // block_size) for c in contexts]
    width = max(lens)
    rows = [r.block_ids[:n] + [0] * (width - n) for r, n in zip(requests, lens)]
    return torch.tensor(rows, dtype=torch.int32)
