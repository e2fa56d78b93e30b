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
    sampled: list[Request]  # the requests whose logits rows are returned, in row order


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
        """Lay out the step's tokens: single-token rows first (they take the decode kernel), then chunks."""
        singles = [c for c in out.chunks if c.num_new_tokens == 1]
        multis = [c for c in out.chunks if c.num_new_tokens > 1]
        ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        logits_rows: list[int] = []
        sampled: list[Request] = []
        prefills: list[PrefillChunk] = []
        bs = self.block_size

        for chunk in singles:
            req, pos = chunk.request, chunk.start
            ids.append(_token_at(req, pos))
            positions.append(pos)
            slot_blocks.append(req.block_ids[pos // bs])
        for chunk in multis:
            req, start, n = chunk.request, chunk.start, chunk.num_new_tokens
            q_start = len(ids)
            ids.extend(req.all_token_ids[start : start + n])
            positions.extend(range(start, start + n))
            blocks = req.block_ids
            slot_blocks.extend(blocks[p // bs] for p in range(start, start + n))
            context = start + n
            prefills.append(
                PrefillChunk(q_start, n, context, torch.tensor(blocks[: -(-context // bs)], dtype=torch.int64))
            )
        row = 0
        for chunk in singles + multis:
            row += chunk.num_new_tokens
            if chunk.samples:
                logits_rows.append(row - 1)
                sampled.append(chunk.request)

        pos_t = torch.tensor(positions, dtype=torch.int64)
        meta = AttentionMetadata(
            slot_blocks=torch.tensor(slot_blocks, dtype=torch.int64),
            slot_offsets=pos_t % bs,
            num_decode=len(singles),
            prefills=prefills,
            use_native=self.use_native,
        )
        if singles:
            meta.decode_block_tables = _block_table(singles, bs)
            meta.decode_context_lens = torch.tensor([c.start + 1 for c in singles], dtype=torch.int32)
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=pos_t,
            meta=meta,
            logits_rows=torch.tensor(logits_rows, dtype=torch.int64),
            sampled=sampled,
        )

    def execute(self, out: SchedulerOutput) -> tuple[list[Request], torch.Tensor]:
        """Run the step; returns the requests to sample for and their logits [n, vocab]."""
        inputs = self.prepare(out)
        logits = self.model.forward(inputs.input_ids, inputs.positions, self.kv, inputs.meta, inputs.logits_rows)
        return inputs.sampled, logits


def _token_at(req: Request, pos: int) -> int:
    n_prompt = len(req.prompt_token_ids)
    return req.prompt_token_ids[pos] if pos < n_prompt else req.output_token_ids[pos - n_prompt]


def _block_table(chunks: list[ScheduledChunk], block_size: int) -> torch.Tensor:
    """[rows, max_blocks] int32, each row the blocks covering its context, zero-padded."""
    lens = [-(-(c.start + 1) // block_size) for c in chunks]
    width = max(lens)
    rows = [c.request.block_ids[:n] + [0] * (width - n) for c, n in zip(chunks, lens)]
    return torch.tensor(rows, dtype=torch.int32)
