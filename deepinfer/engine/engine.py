"""The in-process engine: a plain `step()` loop over scheduler, model runner and sampler.

    engine = LLMEngine.load("smollm2")
    outs = engine.generate(["Hello"], SamplingParams(max_tokens=32))

or, driven step by step (what a worker service does):

    engine.add_request("r1", prompt_token_ids, params)
    while engine.has_unfinished():
        for out in engine.step(): ...

Every request ends exactly once: its last `RequestOutput` has `finished=True` and a finish reason
(stop, length, abort or error), and by then all its KV blocks are back in the pool.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from deepinfer.cache.block_pool import BlockPool
from deepinfer.engine.config import EngineConfig, ModelConfig
from deepinfer.engine.detokenizer import IncrementalDetokenizer
from deepinfer.engine.fetch import resolve_model
from deepinfer.engine.model_runner import ModelRunner, num_blocks_for_budget
from deepinfer.engine.models.llama import LlamaModel
from deepinfer.engine.request import (
    FinishReason,
    InvalidRequestError,
    Request,
    RequestOutput,
    SamplingParams,
    Usage,
)
from deepinfer.engine.sampler import Sampler, SamplingRow, make_generator
from deepinfer.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from deepinfer.engine.tokenizer import Tokenizer
from deepinfer.engine.weights import LoadedModel, load_model_weights

log = structlog.get_logger("deepinfer.engine")


@dataclass
class EngineStats:
    """Monotonic counters since the engine started."""

    num_steps: int = 0
    num_preemptions: int = 0
    tokens_computed: int = 0  # every token through the model, recomputation after preemption included
    tokens_generated: int = 0


class LLMEngine:
    def __init__(self, loaded: LoadedModel, tokenizer: Tokenizer | None = None,
                 config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        self.model_config: ModelConfig = loaded.config
        self.fingerprint = loaded.fingerprint
        self.tokenizer = tokenizer
        num_blocks = num_blocks_for_budget(self.model_config, self.config)
        capacity = num_blocks * self.config.block_size
        # One sequence must always fit in the whole pool, or preemption could not make room for it.
        self.max_model_len = min(
            self.config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
            capacity,
        )
        model = LlamaModel(self.model_config, loaded.state_dict, self.max_model_len, self.config.device)
        self.pool = BlockPool(num_blocks)
        self.scheduler = Scheduler(
            self.pool, self.config.block_size, self.config.max_num_seqs, self.config.max_num_batched_tokens
        )
        self.runner = ModelRunner(model, self.config, num_blocks)
        self.sampler = Sampler()
        self.eos_token_ids = tuple(tokenizer.eos_token_ids) if tokenizer else self.model_config.eos_token_ids
        self._generators: dict[str, torch.Generator | None] = {}
        # Per request: the detokenizer and the text it has released so far.
        self._texts: dict[str, tuple[IncrementalDetokenizer, list[str]]] = {}
        self._pending: list[RequestOutput] = []  # terminal outputs of aborted requests
        self._ids = itertools.count()
        self.stats = EngineStats()

    @classmethod
    def load(cls, model: str | Path, config: EngineConfig | None = None) -> LLMEngine:
        """`model` is "smollm2" (fetched on first use), a Hugging Face directory or a .gguf file."""
        path = resolve_model(str(model))
        return cls(load_model_weights(path), Tokenizer.load(path), config)

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, request_id: str | None, prompt: str | Sequence[int], params: SamplingParams,
                    priority: int = 0) -> str:
        """Queue a request (text needs a tokenizer). Raises InvalidRequestError, leaving the engine untouched."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("a text prompt needs a tokenizer; pass token ids instead")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = list(prompt)
        self._validate(prompt_ids, params)
        req = Request(request_id, prompt_ids, params, priority=priority, eos_token_ids=self.eos_token_ids)
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer")
        self._generators[request_id] = make_generator(params.seed)
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids=prompt_ids, stop=params.stop,
                                           skip_special_tokens=True)
            self._texts[request_id] = (detok, [])
        self.scheduler.add(req)
        return request_id

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        params.validate(vocab)
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty")
        bad = next((t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad!r} is outside the vocabulary [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_ids)} tokens; the context limit is {self.max_model_len} "
                "(prompt plus at least one generated token)"
            )

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its blocks are freed now and its terminal output comes with the next step().
        Returns False if the request is unknown or already finished."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return False
        self._finish(req, FinishReason.ABORT)
        self._pending.append(self._output(req, []))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    # -- the loop ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return outputs
        self.stats.num_steps += 1
        self.stats.num_preemptions += len(sched.preempted)
        try:
            sampled, logits = self.runner.execute(sched)
            self.scheduler.update(sched)
            rows = [
                SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids, self._generators[r.request_id])
                for r in sampled
            ]
            results = self.sampler(logits, rows)
        except Exception as exc:  # a failed step fails its requests, never the engine
            log.exception("step failed", requests=[c.request.request_id for c in sched.chunks])
            for chunk in sched.chunks:
                req = chunk.request
                if not req.is_finished:
                    req.error = f"{type(exc).__name__}: {exc}"
                    self._finish(req, FinishReason.ERROR)
                    outputs.append(self._output(req, []))
            return outputs
        self.stats.tokens_generated += len(sampled)
        self.stats.tokens_computed += sched.num_batched_tokens
        for req, (token, logprob) in zip(sampled, results):
            req.output_token_ids.append(token)
            if logprob is not None:
                req.output_logprobs.append(logprob)
            reason = self._check_stop(req, token)
            if reason is not None:
                self._finish(req, reason)
            outputs.append(self._output(req, [token]))
        return outputs

    def _check_stop(self, req: Request, token: int) -> FinishReason | None:
        p = req.params
        text = self._texts.get(req.request_id)
        if text is not None:
            delta = text[0].push([token])
            text[1].append(delta.text)
            if delta.stopped:
                return FinishReason.STOP
        if token in p.stop_token_ids or (not p.ignore_eos and token in req.eos_token_ids):
            return FinishReason.STOP
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self.scheduler.finish(req, reason)
        self._generators.pop(req.request_id, None)

    def _output(self, req: Request, new_tokens: list[int]) -> RequestOutput:
        finished = req.is_finished
        text = None
        if finished and req.request_id in self._texts:
            detok, pieces = self._texts.pop(req.request_id)
            text = "".join(pieces) + detok.flush().text
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_tokens,
            token_ids=list(req.output_token_ids) if finished else [],
            finished=finished,
            finish_reason=req.finish_reason,
            usage=Usage(len(req.prompt_token_ids), len(req.output_token_ids), req.num_cached_tokens),
            logprobs=list(req.output_logprobs) if finished and req.params.logprobs is not None else None,
            error=req.error,
            text=text,
        )

    def prompt_logits(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        """Logits [len(prompt), vocab] at every prompt position from one prefill pass, outside the
        scheduler (for scoring and for checking against an oracle). Uses and returns pool blocks."""
        req = Request("__prompt_logits__", list(prompt_ids), SamplingParams(max_tokens=1))
        self._validate(req.prompt_token_ids, req.params)
        req.block_ids = self.pool.allocate(-(-len(prompt_ids) // self.config.block_size))
        try:
            inputs = self.runner.prepare(SchedulerOutput([ScheduledChunk(req, len(prompt_ids))]))
            rows = torch.arange(len(prompt_ids))
            return self.runner.model.forward(inputs.input_ids, inputs.positions, self.runner.kv, inputs.meta, rows)
        finally:
            self.pool.free(reversed(req.block_ids))

    # -- convenience ------------------------------------------------------------------------

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Submit every prompt at once, run until all finish; final outputs in input order."""
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
