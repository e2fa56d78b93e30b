"""The model runner: owns the KV tensor and turns a scheduler step into one forward pass.

KV layout: one tensor [num_blocks, *spec.block_shape] as the engine's `KvSpec` describes it (for a
Llama-family model [num_blocks, num_layers, 2 (K, V), block_size, kv_heads, head_dim]; for MLA one
latent component per token). A block is therefore one contiguous slab holding every layer's KV for
`block_size` tokens, which is the unit the cache tiers store and the P/D transfer moves; a layer's
component c is the strided view `kv[:, layer, c]`. Its dtype is the spec's, one of
`ENGINE_KV_DTYPES` (fp32, or fp16: the attention paths convert on write and widen on read).

The runner also decides, once, which kernels its steps' attention runs on: its `AttentionBackend`
(`attention_backend.select_backend`: native or torch, with or without the C layer loop), which every
step's metadata carries to the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer.config.engine import EngineConfig
from deepinfer.config.kv import ENGINE_KV_DTYPES, KvSpec
from deepinfer.config.model import ConfigError
from deepinfer.engine.attention import Segment, StepLayout, layout
from deepinfer.engine.attention_backend import AttentionBackend, select_backend
from deepinfer.engine.models.base import CausalLM
from deepinfer.engine.models.moe import Routing, moe_blocks
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import ScheduledChunk, SchedulerOutput


def num_blocks_for_budget(spec: KvSpec, config: EngineConfig) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    return spec.blocks_for_budget(config.kv_cache_bytes)


@dataclass
class PromptRows:
    """Logits at prompt positions [chunk.start, chunk.start + len(logits)) of a request collecting prompt
    logprobs: row j predicts prompt token chunk.start + j + 1."""

    chunk: ScheduledChunk
    logits: torch.Tensor  # [m, vocab]


@dataclass
class StepInputs:
    layout: StepLayout
    # The chunks whose logits rows are returned, in order: 1 + chunk.num_spec rows each.
    sampled: list[ScheduledChunk]
    # Where those rows are among the forward's logits rows (None: they are all of them, in order).
    sample_rows: list[int] | None = None
    # Chunks of requests collecting prompt logprobs: (chunk, first logits row, rows at prompt positions).
    prompt_rows: list[tuple[ScheduledChunk, int, int]] | None = None


class ModelRunner:
    def __init__(self, model: CausalLM, config: EngineConfig, spec: KvSpec, num_blocks: int) -> None:
        if spec.dtype_name not in ENGINE_KV_DTYPES:
            raise ConfigError(f"KV cache dtype {spec.dtype_name!r} is not supported by the engine's attention "
                              f"(supported: {', '.join(ENGINE_KV_DTYPES)})")
        self.model = model
        self.spec = spec
        self.block_size = spec.block_size
        self.kv = spec.allocate(num_blocks, config.device)
        # Chosen here and nowhere else: every step of this runner runs on it.
        self.backend: AttentionBackend = select_backend(config)
        self.backend.bind(model)

    @property
    def use_native(self) -> bool:
        """Whether this runner's steps run on the native kernels (its backend's, decided at construction)."""
        return self.backend.native

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """The step as attention segments: a speculating chunk (the last committed token plus k
        drafts) is 1 + k decode rows with logits at every row; any other chunk is rows or a prefill
        chunk by its length, with logits at its last token when it completes the request's tokens. A chunk
        of a request collecting prompt logprobs has logits at every position (the last one sampled when
        the chunk completes the request's tokens)."""
        segments: list[Segment] = []
        sampled: list[ScheduledChunk] = []
        sample_rows: list[int] = []
        prompt_rows: list[tuple[ScheduledChunk, int, int]] = []
        row = 0
        for chunk in out.chunks:
            req, start, n = chunk.request, chunk.start, chunk.num_new_tokens
            if chunk.num_spec:
                tokens = [_token_at(req, start)] + chunk.draft_token_ids
                if len(tokens) != n:
                    raise ValueError(f"chunk of {req.request_id!r} has {len(tokens)} tokens for {n}")
            else:
                tokens = req.all_token_ids[start : start + n] if n > 1 else [_token_at(req, start)]
            logits = chunk.num_spec + 1 if chunk.samples else 0
            # Positions whose logits predict a prompt token: [start, len(prompt) - 1) within the chunk.
            at_prompt = max(0, min(start + n, len(req.prompt_token_ids) - 1) - start)
            if req.wants_prompt_logprobs and not chunk.num_spec and at_prompt:
                prompt_rows.append((chunk, row, at_prompt))
                sample_rows.extend([row + n - 1] if logits else [])
                logits = n
            else:
                sample_rows.extend(range(row, row + logits))
            row += logits
            segments.append(Segment(tokens, start, req.block_ids, rows=chunk.num_spec > 0, num_logits=logits,
                                    tree=chunk.draft_parents if chunk.num_spec else None))
            if chunk.samples:
                sampled.append(chunk)
        step = layout(segments, self.block_size, self.backend)
        if not prompt_rows:
            return StepInputs(step, sampled)
        return StepInputs(step, sampled, sample_rows, prompt_rows)

    def execute(self, out: SchedulerOutput) -> tuple[list[ScheduledChunk], torch.Tensor, list[PromptRows]]:
        """Run the step; returns the chunks to sample for, their logits [rows, vocab] (1 + num_spec rows
        per chunk, in order) and the logits at prompt positions of requests collecting prompt logprobs."""
        inputs = self.prepare(out)
        s = inputs.layout
        logits = self.model.forward(s.input_ids, s.positions, self.kv, s.meta, s.logits_rows)
        if inputs.prompt_rows is None:
            return inputs.sampled, logits, []
        assert inputs.sample_rows is not None
        prompt = [PromptRows(chunk, logits[first : first + m]) for chunk, first, m in inputs.prompt_rows]
        sample_logits = logits.index_select(0, torch.tensor(inputs.sample_rows, dtype=torch.long,
                                                            device=logits.device))
        return inputs.sampled, sample_logits, prompt

    def move_slots(self, block_ids: Sequence[int], moves: Sequence[tuple[int, int]]) -> None:
        """Copy the K/V of position `src` to position `dst` of a sequence, in every layer, for each (src, dst) in
        order (a verified draft tree's walked nodes taking their chain positions: speculative/tree.py)."""
        bs = self.block_size
        for src, dst in moves:
            self.kv[block_ids[dst // bs], :, :, dst % bs] = self.kv[block_ids[src // bs], :, :, src % bs]

    def execute_empty(self) -> None:
        """A forward of zero tokens, for a rank of an expert-parallel group with nothing scheduled. Of an
        empty batch's forward only the sparse blocks' expert executors do anything — they join their
        layer's collectives, sending nothing and computing what the other ranks send here — so exactly
        they are called, in forward order, with an empty routing: attention, routers and shared experts
        are never asked to cope with zero rows."""
        hidden = self.model.config.hidden_size
        device = self.kv.device
        empty = torch.zeros(0, hidden, dtype=torch.float32, device=device)
        none = torch.zeros(0, dtype=torch.int64, device=device)
        routing = Routing(none, none, torch.zeros(0, dtype=torch.float32, device=device))
        with torch.inference_mode():
            for block in moe_blocks(self.model):
                block.experts(empty, routing)

def _token_at(req: Request, pos: int) -> int:
    n_prompt = len(req.prompt_token_ids)
    return req.prompt_token_ids[pos] if pos < n_prompt else req.output_token_ids[pos - n_prompt]
