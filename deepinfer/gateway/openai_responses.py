"""Mesh results → OpenAI response objects, stream chunks and SSE frames, no I/O.

A finished choice is a `protocol.messages.RequestFinished` (non-streaming), or the `StreamDelta`s and the
`RequestFinished` of a streamed one (`ChoiceStream` turns each into chunks). Token strings (OpenAI's
logprobs name tokens by their text) come from `decode`, the model's tokenizer decoding one id.

Completions logprobs are OpenAI's legacy shape: `tokens`, `token_logprobs`, `top_logprobs` (a {token: logprob}
map per token holding the top alternatives and the chosen token, as vLLM does), `text_offset` (each token's
offset in the choice's text). With `echo`, the prompt's tokens come first, the first one's logprob and top map
null (nothing precedes it). Chat logprobs are `{"content": [{token, logprob, bytes, top_logprobs}]}`.

Invariant: a stream's chunks concatenate to the non-streamed response's text (the mesh's deltas concatenate
to its final text), and a stream is a sequence of `data: {json}\\n\\n` events ending with `data: [DONE]\\n\\n`.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

from deepinfer.gateway.openai_requests import GenerationPlan
from deepinfer.gateway.tools import may_be_a_call, tool_calls
from deepinfer.protocol import messages as m

Decode = Callable[[int], str]  # one token id → its text
DONE = b"data: [DONE]\n\n"
_FINISH = {"stop": "stop", "length": "length", "abort": "stop", "error": "stop"}


def sse(obj: Any) -> bytes:
    """One server-sent event carrying `obj` as JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def response_id(plan: GenerationPlan) -> str:
    return ("cmpl-" if plan.kind == "completion" else "chatcmpl-") + secrets.token_hex(12)


def finish_reason(fin: m.RequestFinished, plan: GenerationPlan) -> str:
    return "length" if plan.evaluate_only else _FINISH.get(fin.finish_reason, "stop")


# --- logprobs ------------------------------------------------------------------------------------------------


class CompletionLogprobs:
    """OpenAI's legacy logprobs object, built token by token (a stream's chunks each get the new part)."""

    def __init__(self, decode: Decode, top: int, offset: int = 0) -> None:
        self.decode, self.top, self.offset = decode, top, offset

    def part(self, lps: Sequence[m.LogprobWire | None], token_ids: Sequence[int]) -> dict[str, list[Any]]:
        """The entries of `token_ids` (their logprobs `lps`, None for a token with none), offsets continuing."""
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, lp in zip(token_ids, lps, strict=True):
            text = self.decode(token_id)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            if lp is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            top = {self.decode(t): v for t, v in lp.top[:self.top]}
            top.setdefault(text, lp.logprob)  # the chosen token is always listed
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append(top)
        return out


def _merge(a: dict[str, list[Any]], b: dict[str, list[Any]]) -> dict[str, list[Any]]:
    return {k: a[k] + b[k] for k in a}


def chat_logprobs(lps: Sequence[m.LogprobWire], decode: Decode, top: int) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = decode(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top[:top]]}
                        for lp in lps]}


def _generated(fin_or_delta: m.RequestFinished | m.StreamDelta) -> tuple[list[int], list[m.LogprobWire]]:
    lps = fin_or_delta.logprobs or []
    return list(fin_or_delta.token_ids), list(lps)


def _prompt_entries(record: Any) -> tuple[list[int], list[m.LogprobWire | None]]:
    """The prompt's token ids and logprobs a record carries (RequestFinished, or a stream's first delta)."""
    ids = list(getattr(record, "prompt_token_ids", None) or [])
    lps = getattr(record, "prompt_logprobs", None)
    return ids, list(lps) if lps is not None else [None] * len(ids)


# --- usage ---------------------------------------------------------------------------------------------------


def usage(plan: GenerationPlan, finished: Sequence[m.RequestFinished]) -> dict[str, Any]:
    """Prompt tokens count once per prompt (its n samples share it), completion tokens once per choice."""
    firsts = finished[::plan.n]
    prompt = sum(f.usage.prompt_tokens for f in firsts)
    completion = 0 if plan.evaluate_only else sum(f.usage.completion_tokens for f in finished)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(f.usage.cached_tokens for f in firsts)}}


# --- whole responses -----------------------------------------------------------------------------------------


def _echo_text(plan: GenerationPlan, choice: int, prompt_ids: Sequence[int], decode_all: Callable[[list[int]], str]) \
        -> str:
    """The prompt as the response echoes it: the text given, else the token ids given (or the mesh's) decoded."""
    text = plan.echo_texts[plan.prompt_index(choice)] if plan.echo_texts else None
    if text is not None:
        return text
    given = plan.requests[choice].prompt_token_ids if choice < len(plan.requests) else None
    return decode_all(list(given if given is not None else prompt_ids))


def completion_choice(plan: GenerationPlan, choice: int, fin: m.RequestFinished, decode: Decode,
                      decode_all: Callable[[list[int]], str]) -> dict[str, Any]:
    text, (ids, lps) = fin.text, _generated(fin)
    if plan.evaluate_only:
        text, ids, lps = "", [], []
    logprobs = None
    if plan.echo:
        prompt_ids, prompt_lps = _prompt_entries(fin)
        text = _echo_text(plan, choice, prompt_ids, decode_all) + text
    if plan.logprobs is not None:
        builder = CompletionLogprobs(decode, plan.logprobs)
        logprobs = builder.part(lps, ids)
        if plan.echo:
            logprobs = _merge(CompletionLogprobs(decode, plan.logprobs).part(prompt_lps, prompt_ids), logprobs)
            logprobs["text_offset"] = _offsets(logprobs["tokens"])
    return {"index": choice, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(fin, plan)}


def _offsets(tokens: Sequence[str]) -> list[int]:
    out, at = [], 0
    for t in tokens:
        out.append(at)
        at += len(t)
    return out


def chat_choice(plan: GenerationPlan, choice: int, fin: m.RequestFinished, decode: Decode) -> dict[str, Any]:
    logprobs = None if plan.logprobs is None else chat_logprobs(fin.logprobs or [], decode, plan.logprobs)
    calls = tool_calls(fin.text, plan.tools) if plan.tools is not None else None
    if calls:
        return {"index": choice, "message": {"role": "assistant", "content": None, "tool_calls": calls},
                "logprobs": logprobs, "finish_reason": "tool_calls"}
    return {"index": choice, "message": {"role": "assistant", "content": fin.text}, "logprobs": logprobs,
            "finish_reason": finish_reason(fin, plan)}


def response(plan: GenerationPlan, rid: str, created: int, finished: Sequence[m.RequestFinished], decode: Decode,
             decode_all: Callable[[list[int]], str]) -> dict[str, Any]:
    """The whole non-streamed response; `finished[i]` is choice i."""
    if plan.kind == "completion":
        choices = [completion_choice(plan, i, f, decode, decode_all) for i, f in enumerate(finished)]
        obj = "text_completion"
    else:
        choices = [chat_choice(plan, i, f, decode) for i, f in enumerate(finished)]
        obj = "chat.completion"
    return {"id": rid, "object": obj, "created": created, "model": plan.model, "choices": choices,
            "usage": usage(plan, finished)}


# --- streams -------------------------------------------------------------------------------------------------


class ChoiceStream:
    """One choice of a streamed response: each mesh record in, the chunks to send out (possibly none)."""

    def __init__(self, plan: GenerationPlan, rid: str, created: int, choice: int, decode: Decode,
                 decode_all: Callable[[list[int]], str]) -> None:
        self.plan, self.rid, self.created, self.choice = plan, rid, created, choice
        self.decode, self.decode_all = decode, decode_all
        self._started = False  # the first chunk (chat: the role; completions with echo: the prompt) went out
        self._logprobs = CompletionLogprobs(decode, plan.logprobs or 0)
        # With tools: the text held back while it may still be a tool call, and whether it was let go as text.
        self._held: list[str] = []
        self._text = plan.tools is None

    def _chunk(self, payload: dict[str, Any]) -> dict[str, Any]:
        kind = "text_completion" if self.plan.kind == "completion" else "chat.completion.chunk"
        out = {"id": self.rid, "object": kind, "created": self.created, "model": self.plan.model,
               "choices": [{"index": self.choice, "logprobs": None, "finish_reason": None, **payload}]}
        if self.plan.include_usage:
            out["usage"] = None  # as OpenAI: only the last chunk carries it
        return out

    def _start(self, record: Any) -> list[dict[str, Any]]:
        """The opening chunk, once: chat's role; a completion's echoed prompt (with its logprobs)."""
        if self._started:
            return []
        self._started = True
        if self.plan.kind == "chat":
            return [self._chunk({"delta": {"role": "assistant", "content": ""}})]
        if not self.plan.echo:
            return []
        prompt_ids, prompt_lps = _prompt_entries(record)
        text = _echo_text(self.plan, self.choice, prompt_ids, self.decode_all)
        logprobs = None if self.plan.logprobs is None else self._logprobs.part(prompt_lps, prompt_ids)
        if logprobs is not None:
            self._logprobs.offset = len(text)
        return [self._chunk({"text": text, "logprobs": logprobs})]

    def on_delta(self, delta: m.StreamDelta) -> list[dict[str, Any]]:
        chunks = self._start(delta)
        ids, lps = _generated(delta)
        if self.plan.evaluate_only or (not delta.text and not ids):
            return chunks
        if self.plan.kind == "chat":
            logprobs = None if self.plan.logprobs is None else chat_logprobs(lps, self.decode, self.plan.logprobs)
            text = delta.text
            if not self._text:
                self._held.append(text)
                assert self.plan.tools is not None
                if may_be_a_call("".join(self._held), self.plan.tools):
                    return chunks
                self._text, text, self._held = True, "".join(self._held), []
            return [*chunks, self._chunk({"delta": {"content": text}, "logprobs": logprobs})]
        logprobs = None if self.plan.logprobs is None else self._logprobs.part(lps, ids)
        return [*chunks, self._chunk({"text": delta.text, "logprobs": logprobs})]

    def on_finished(self, fin: m.RequestFinished) -> list[dict[str, Any]]:
        chunks = self._start(fin)
        if not self._text:  # held to the end: a call, or text that looked like one
            assert self.plan.tools is not None
            calls = tool_calls(fin.text, self.plan.tools)
            if calls:
                chunks += [self._chunk({"delta": {"tool_calls": [{"index": j, **call}]}})
                           for j, call in enumerate(calls)]
                return [*chunks, self._chunk({"delta": {}, "finish_reason": "tool_calls"})]
            if self._held:
                chunks.append(self._chunk({"delta": {"content": "".join(self._held)}}))
        last = {"delta": {}} if self.plan.kind == "chat" else {"text": ""}
        return [*chunks, self._chunk({**last, "finish_reason": finish_reason(fin, self.plan)})]


def usage_chunk(plan: GenerationPlan, rid: str, created: int, finished: Sequence[m.RequestFinished]) \
        -> dict[str, Any]:
    """stream_options.include_usage: the last chunk, with the usage and no choices."""
    kind = "text_completion" if plan.kind == "completion" else "chat.completion.chunk"
    return {"id": rid, "object": kind, "created": created, "model": plan.model, "choices": [],
            "usage": usage(plan, finished)}


def now() -> int:
    return int(time.time())
