"""What a request's outputs are made of: `LLMEngine`'s per-request output state and the `RequestOutput` it
builds (`OutputsMixin`).

Per request the engine keeps a seeded generator and, with a tokenizer, an incremental detokenizer and the
text it has released (`_track`); each committed token goes through the stop checks (`_check_stop`: stop
strings on the detokenized text, stop token ids, EOS, `max_tokens`, the context limit); `_output` builds
the step's `RequestOutput` (the whole text, token ids and logprobs on the final one, prompt logprobs once
the step loop has collected them all).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deepinfer.cache.hashing import BlockHash
from deepinfer.engine.request import FinishReason, Request, RequestOutput, RequestStatus, Usage
from deepinfer.engine.sampler import make_generator
from deepinfer.text.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from deepinfer.config.engine import EngineConfig
    from deepinfer.engine.structured import StructuredOutput
    from deepinfer.text.tokenizer import Tokenizer

class OutputsMixin:
    """The output side of `LLMEngine`'s step loop (module docstring)."""

    # The engine's state this part uses, set by `LLMEngine.__init__`.
    config: EngineConfig
    tokenizer: Tokenizer | None
    max_model_len: int
    structured: StructuredOutput
    _generators: dict[str, torch.Generator | None]
    _texts: dict[str, tuple[IncrementalDetokenizer, list[str]]]  # the detokenizer, the text it released

    def _track(self, req: Request) -> None:
        """Per-request engine state beside the scheduler's: the seeded generator, the detokenizer (fed the
        output the request already has, so its text and stop strings continue across a resume)."""
        self._generators[req.request_id] = make_generator(req.params.seed)
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids=req.prompt_token_ids, stop=req.params.stop,
                                           skip_special_tokens=True)
            pieces = [detok.push(req.output_token_ids).text] if req.output_token_ids else []
            self._texts[req.request_id] = (detok, pieces)

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
        return self.structured.after_token(req, token)

    def _output(self, req: Request, new_tokens: list[int]) -> RequestOutput:
        handoff = req.status == RequestStatus.HELD
        finished = req.is_finished or handoff
        text = None
        if finished and req.request_id in self._texts:
            detok, pieces = self._texts.pop(req.request_id)
            text = "".join(pieces) + detok.flush().text
        prompt_logprobs = None
        if req.prompt_logprobs is not None and req.prompt_logprobs_done and (
                finished or (new_tokens and not req.prompt_logprobs_sent)):
            prompt_logprobs = list(req.prompt_logprobs)
            req.prompt_logprobs_sent = req.prompt_logprobs_sent or bool(new_tokens)
        wants_logprobs = req.params.logprobs is not None
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_tokens,
            token_ids=list(req.output_token_ids) if finished else [],
            finished=finished,
            finish_reason=req.finish_reason,
            usage=Usage(len(req.prompt_token_ids), len(req.output_token_ids), req.num_cached_tokens,
                        dict(req.cached_by_tier), req.spec_proposed_tokens, req.spec_accepted_tokens),
            logprobs=list(req.output_logprobs) if finished and wants_logprobs else None,
            error=req.error,
            text=text,
            handoff=handoff,
            block_hashes=self._computed_block_hashes(req) if finished else [],
            # Every token this engine committed appended its logprob: the last len(new_tokens) are theirs.
            new_logprobs=req.output_logprobs[len(req.output_logprobs) - len(new_tokens):] if wants_logprobs else None,
            prompt_logprobs=prompt_logprobs,
        )

    def _computed_block_hashes(self, req: Request) -> list[BlockHash]:
        if not self.config.enable_prefix_caching or req.hasher is None:
            return []
        return list(req.block_hashes(req.num_computed_tokens // self.config.block_size))
