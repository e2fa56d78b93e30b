"""The tokenizer service's pure core: encode prompts, and turn decode workers' token batches into text.

No sockets, no clock. State is kept per request only while it is in flight: from its EncodeRequest until
its stream finishes (a finished item, a stop string, a gap) or the router aborts it. Anything for a
request without state — never encoded here, finished, aborted — is dropped and counted.

Decisions:
* `prompt` is encoded with the model's special tokens (BOS when the model adds one); `messages` go through
  the chat template (which writes its own special tokens) with the generation prompt; `prompt_token_ids`
  are taken as they are, after a vocabulary check. A prompt must leave room for one generated token
  within `max_model_len`. Every failure is ErrorReply "invalid_request" naming the problem.
* Speculation counts (draft tokens proposed and accepted, the request's totals so far) pass through
  from each DetokenizeItem to its TextDeltaItem unchanged, as do prompt logprobs (on a request's first
  item). Per-token logprobs are cut with the tokens they belong to (one per token id, always).
* Offsets: an item's tokens already seen (a duplicate, or the seen part of an overlap) are skipped. A gap
  (tokens were lost) cannot be repaired: the request ends with a finished item, finish_reason "error",
  and the router fails it.
* Detokenization skips special tokens (EOS is not text) and never ends a delta inside a UTF-8 character.
  A stop string ends the stream: the item is finished with finish_reason "stop" and `stop_string` set, its
  text stops just before the stop string, and its token_ids are all of that batch's new tokens (the
  detokenizer does not say which token completed the stop string). Later tokens are dropped.
* Block hashes: with a cache namespace, the result carries the chain of the prompt's full blocks, salted
  with the request's cache_salt (the router's, per tenant), for the router's prefix-aware placement.
  Workers recompute the chain themselves before trusting any cached KV.
* Resume (`resume_output_ids`: the request's first worker was lost, and it continues elsewhere under a
  new id): the stream starts as if those tokens had passed through here — the detokenizer is fed them
  (their text is what the client already has, so it is not sent again) and the next item must start at
  their count. The block hashes then cover prompt and output: that is what the next worker computes.
* An EncodeRequest for a request id in flight starts it over (the router never reuses ids; a resent
  request gets the same answer). Past `max_inflight` requests, new ones are refused with "overloaded".
"""

from __future__ import annotations

from dataclasses import dataclass

import jinja2

from deepinfer.cache.hashing import CacheNamespace, HashKeys, hash_blocks
from deepinfer.protocol.messages import (
    DetokenizeBatch,
    DetokenizeItem,
    EncodeRequest,
    EncodeResult,
    ErrorReply,
    TextDeltaItem,
    TextDeltas,
)
from deepinfer.text.detokenizer import IncrementalDetokenizer
from deepinfer.text.tokenizer import Tokenizer


class _Invalid(ValueError):
    """The request cannot be encoded; the message says why."""


@dataclass(eq=False)
class _Stream:
    detok: IncrementalDetokenizer
    next_offset: int = 0  # generated tokens seen so far: the offset the next item must start at


@dataclass
class TokenizerCounters:
    encoded: int = 0
    refused: int = 0  # EncodeRequests answered with ErrorReply
    duplicates: int = 0  # items (or leading parts of items) whose tokens were already seen
    gaps: int = 0  # requests ended because tokens went missing
    unknown: int = 0  # items for requests without state here


class TokenizerCore:
    def __init__(self, tokenizer: Tokenizer, instance: str, max_model_len: int, *, max_inflight: int = 65536,
                 namespace: CacheNamespace | None = None) -> None:
        self.tokenizer = tokenizer
        self.namespace = namespace
        self.instance = instance
        self.max_model_len = max_model_len
        self.max_inflight = max_inflight
        self.counters = TokenizerCounters()
        self._streams: dict[str, _Stream] = {}

    @property
    def num_inflight(self) -> int:
        return len(self._streams)

    def on_encode(self, req: EncodeRequest) -> EncodeResult | ErrorReply:
        self._streams.pop(req.request_id, None)
        if len(self._streams) >= self.max_inflight:
            self.counters.refused += 1
            msg = f"tokenizer {self.instance} has {len(self._streams)} requests in flight"
            return ErrorReply(req.request_id, "overloaded", msg)
        try:
            ids = self._encode(req)
            resumed = self._check_ids(list(req.resume_output_ids or []), "output")
        except _Invalid as e:
            self.counters.refused += 1
            return ErrorReply(req.request_id, "invalid_request", str(e))
        stop = [s for s in req.stop if s]
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids=ids, stop=stop, skip_special_tokens=True)
        if resumed:
            detok.push(resumed)
        self._streams[req.request_id] = _Stream(detok, next_offset=len(resumed))
        self.counters.encoded += 1
        hashed = ids + resumed
        hashes = [] if self.namespace is None else hash_blocks(self.namespace, hashed, HashKeys(req.cache_salt))
        return EncodeResult(req.request_id, ids, hashes)

    def _check_ids(self, ids: list[int], what: str) -> list[int]:
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise _Invalid(f"{what} token id {bad} is outside the vocabulary (size {vocab})")
        return ids

    def _encode(self, req: EncodeRequest) -> list[int]:
        given = [x for x in (req.prompt, req.messages, req.prompt_token_ids) if x is not None]
        if len(given) != 1:
            raise _Invalid("give exactly one of prompt, messages or prompt_token_ids")
        if req.prompt is not None:
            if not req.prompt:
                raise _Invalid("the prompt is empty")
            ids = self.tokenizer.encode(req.prompt)
        elif req.messages is not None:
            ids = self._encode_chat(req.messages)
        else:
            ids = self._check_ids(list(req.prompt_token_ids or []), "prompt")
        if not ids:
            raise _Invalid("the prompt has no tokens")
        if len(ids) >= self.max_model_len:
            raise _Invalid(
                f"the prompt has {len(ids)} tokens; the model's context is {self.max_model_len} tokens "
                "and must leave room for at least one generated token"
            )
        if req.max_tokens is not None and len(ids) + req.max_tokens > self.max_model_len:
            raise _Invalid(
                f"max_tokens {req.max_tokens} plus the prompt's {len(ids)} tokens exceed the model's context of "
                f"{self.max_model_len} tokens: ask for at most {self.max_model_len - len(ids)}"
            )
        return ids

    def _encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if not messages:
            raise _Invalid("messages is empty")
        for i, m in enumerate(messages):
            if "role" not in m or "content" not in m:
                raise _Invalid(f"messages[{i}] needs both 'role' and 'content'")
        if not self.tokenizer.chat_template:
            raise _Invalid("this model has no chat template: send a plain prompt")
        try:
            text = self.tokenizer.apply_chat_template(messages)
        except jinja2.TemplateError as e:  # templates raise_exception() on roles or orders they refuse
            raise _Invalid(f"the chat template refused the messages: {e}") from None
        return self.tokenizer.encode(text, add_special_tokens=False)  # the template wrote the special tokens

    def on_detokenize(self, batch: DetokenizeBatch) -> TextDeltas:
        """Text for every item that brought new tokens or a finish (items may be empty: send nothing then)."""
        items = [out for item in batch.items if (out := self._item(item)) is not None]
        return TextDeltas(self.instance, items, batch.worker)

    def on_abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def drop_all(self) -> int:
        """Forget every stream (the router that owned them is gone); returns how many there were."""
        n = len(self._streams)
        self._streams.clear()
        return n

    def _item(self, item: DetokenizeItem) -> TextDeltaItem | None:
        rid = item.request_id
        stream = self._streams.get(rid)
        if stream is None:
            self.counters.unknown += 1
            return None
        start = stream.next_offset
        if item.offset > start:
            self.counters.gaps += 1
            del self._streams[rid]
            return TextDeltaItem(rid, start, "", [], finished=True, finish_reason="error")
        skip = start - item.offset
        new = item.token_ids[skip:]
        if skip:
            self.counters.duplicates += 1
        if not new and not item.finished:
            return None
        logprobs = item.logprobs[skip:] if item.logprobs is not None else None
        stream.next_offset += len(new)
        delta = stream.detok.push(new)
        text, stopped, stop_string = delta.text, delta.stopped, delta.stop_string
        if item.finished and not stopped:
            tail = stream.detok.flush()  # a held-back partial character or stop-string prefix
            text, stopped, stop_string = text + tail.text, tail.stopped, tail.stop_string
        spec = dict(spec_proposed_tokens=item.spec_proposed_tokens, spec_accepted_tokens=item.spec_accepted_tokens,
                    prompt_logprobs=item.prompt_logprobs)
        if stopped:
            del self._streams[rid]
            return TextDeltaItem(rid, start, text, new, True, "stop", stop_string, logprobs, **spec)
        if item.finished:
            del self._streams[rid]
            return TextDeltaItem(rid, start, text, new, True, item.finish_reason or "stop", None, logprobs, **spec)
        return TextDeltaItem(rid, start, text, new, logprobs=logprobs, **spec)
