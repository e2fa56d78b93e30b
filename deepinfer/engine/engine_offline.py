"""`LLMEngine` without the services: loading a model by name, `generate` over a batch of prompts, and
`prompt_logits` (`OfflineMixin`). All three drive the step loop's public calls or the model runner
directly; none is part of the `ServingEngine` interface the services use.

    engine = LLMEngine.load("smollm2")
    outs = engine.generate(["Hello"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Self

import torch

from deepinfer.config.engine import EngineConfig
from deepinfer.engine.attention import Segment, layout
from deepinfer.engine.request import InvalidRequestError, Request, RequestOutput, SamplingParams
from deepinfer.loading.fetch import resolve_model
from deepinfer.loading.weights import load_model_weights
from deepinfer.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from deepinfer.cache.block_pool import BlockPool
    from deepinfer.engine.ep.group import EpGroup
    from deepinfer.engine.model_runner import ModelRunner


class OfflineMixin:
    """The offline calls of `LLMEngine` (module docstring). `generate` steps with `add_request`, `abort` and
    `step`; `prompt_logits` runs one forward outside the scheduler, with the validation `add_request` uses."""

    # The engine's state this part uses, set by `LLMEngine.__init__`.
    config: EngineConfig
    pool: BlockPool
    runner: ModelRunner
    ep_group: EpGroup | None
    _pending: list[RequestOutput]

    @classmethod
    def load(cls, model: str | Path, config: EngineConfig | None = None) -> Self:
        """`model` is "smollm2" (fetched on first use), a Hugging Face directory or a .gguf file."""
        path = resolve_model(str(model))
        config = config or EngineConfig()
        return cls(load_model_weights(path, config.weights, config.device), Tokenizer.load(path), config)

    def prompt_logits(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        """Logits [len(prompt), vocab] at every prompt position from one prefill pass, outside the
        scheduler (for scoring and for checking against an oracle). Uses and returns pool blocks.
        Refused under expert parallelism: it is a forward outside the group's lockstep steps."""
        if self.ep_group is not None:
            raise NotImplementedError("prompt_logits runs a forward outside step(); under expert parallelism "
                                      "every forward is a collective of the whole group, so it is not available")
        req = Request("__prompt_logits__", list(prompt_ids), SamplingParams(max_tokens=1))
        self._validate(req.prompt_token_ids, req.params)
        req.block_ids = self.pool.allocate(-(-len(prompt_ids) // self.config.block_size))
        try:
            step = layout([Segment(prompt_ids, 0, req.block_ids, num_logits=len(prompt_ids))], self.config.block_size,
                          self.runner.backend)
            return self.runner.model.forward(step.input_ids, step.positions, self.runner.kv, step.meta,
                                             step.logits_rows)
        finally:
            self.pool.free(reversed(req.block_ids))

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Submit every prompt at once, run until all finish; final outputs in input order. Not under
        expert parallelism: it steps until this rank's prompts finish, which the other ranks cannot know."""
        if self.ep_group is not None:
            raise NotImplementedError("generate steps on this rank's schedule alone; under expert parallelism "
                                      "the group steps together (add_request, then step() in lockstep)")
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, plist):
                ids.append(self.add_request(None, p, sp))
        except InvalidRequestError:
            for rid in ids:  # all or nothing: leave no half-submitted batch behind
                self.abort(rid)
            self._pending.clear()
            raise
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]
