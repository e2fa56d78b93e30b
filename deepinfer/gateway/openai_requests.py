"""OpenAI request bodies → mesh requests: parsing and validation, no I/O.

`parse_completion` and `parse_chat` turn a JSON body into a `GenerationPlan`: the mesh requests to send (the
keyword arguments of `AsyncClient.generate/stream`), in choice order, and what the response must look like.
A body the gateway cannot serve raises `ApiError` (400 naming the parameter; 404 for another model's name).

Choices: with `n` samples of each of P prompts, choice `i * n + j` is sample j of prompt i (OpenAI's order).
Sample j > 0 of a seeded request uses `seed + j`, so the n samples differ yet are reproducible; they share
the prompt's KV through the prefix cache. `max_tokens = 0` (with `echo`: evaluate the prompt only, what
log-likelihood harnesses ask for) is served by generating one token and dropping it: the engine always
samples at least one (`evaluate_only`).

Bounds (ParseContext): a request asks for at most `max_sequences` choices (n × prompts: one POST must not
become a hundred thousand mesh requests), and a prompt longer than `max_prompt_chars` is refused before
anything tokenises it (no prompt that long fits the context). Values quoted in error messages are cut short.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from deepinfer.engine.request import InvalidRequestError, SamplingParams
from deepinfer.gateway.errors import ApiError, invalid, model_not_found
from deepinfer.gateway.response_format import response_format_params
from deepinfer.gateway.tool_formats import JSON_CONVENTION, ToolFormat
from deepinfer.gateway.tools import (
    ToolPlan,
    constraint_params,
    history_turn,
    parse_tools,
    prompt_messages,
    tool_specs,
)
from deepinfer.protocol.client import logit_bias_pairs

MAX_N = 128  # samples per prompt
MAX_BATCH = 1024  # prompts per completions request
MAX_TOP_LOGPROBS = 20  # OpenAI's bound (and the engine's: SamplingParams.MAX_LOGPROBS)
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
MAX_TOKEN_ID = 2**63 - 1  # token ids (stop_token_ids, logit_bias keys) past this cannot be one
_reprs = reprlib.Repr()
_reprs.maxstring = _reprs.maxother = 40
_reprs.maxlist = _reprs.maxdict = 4
_reprs.maxlevel = 2


def _short(v: Any) -> str:
    """`v` as an error message quotes it: a string as it is, anything else as its repr, either cut short."""
    return (v if len(v) <= 60 else v[:60] + "...") if isinstance(v, str) else _reprs.repr(v)


# Sampling parameters both endpoints take (OpenAI's, then vLLM's extensions) that map one to one.
_SAMPLING_KEYS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "stop",
                  "logit_bias", "top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos")
_COMMON_KEYS = {"model", "max_tokens", "n", "stream", "stream_options", "user", "ttft_slo_s", "tpot_slo_s",
                *_SAMPLING_KEYS}
COMPLETION_KEYS = _COMMON_KEYS | {"prompt", "logprobs", "echo", "suffix", "best_of"}
CHAT_KEYS = _COMMON_KEYS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format",
                            "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
                            "metadata", "store", "service_tier"}


@dataclass(frozen=True)
class MeshRequest:
    """One request to the mesh: exactly one of prompt, prompt_token_ids or messages, and its sampling params."""

    params: dict[str, Any]
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None

    def kwargs(self) -> dict[str, Any]:
        """`AsyncClient.generate/stream`'s keyword arguments (the api key is added by the caller)."""
        given = {"prompt": self.prompt, "prompt_token_ids": self.prompt_token_ids, "messages": self.messages}
        return {**{k: v for k, v in given.items() if v is not None}, **self.params}


@dataclass(frozen=True)
class GenerationPlan:
    """What one completions or chat request asks of the mesh, and how to answer it."""

    kind: Literal["completion", "chat"]
    model: str
    requests: tuple[MeshRequest, ...]  # choice order: prompt i's sample j at i * n + j
    n: int
    stream: bool = False
    include_usage: bool = False  # streaming: a last chunk with the usage and no choices
    echo: bool = False  # completions: the prompt comes first in text (and tokens, logprobs)
    # Completions: top alternatives per token (0: the chosen token's logprob only); chat: top_logprobs
    # when logprobs is true. None: no logprobs in the response.
    logprobs: int | None = None
    evaluate_only: bool = False  # max_tokens 0: the one generated token is dropped from the answer
    echo_texts: tuple[str | None, ...] = field(default=())  # per prompt: its text (None: decode its ids)
    tools: ToolPlan | None = None  # chat with tools: answers may be tool calls (gateway.tools)

    def prompt_index(self, choice: int) -> int:
        return choice // self.n


@dataclass(frozen=True)
class ParseContext:
    """What parsing needs to know of the deployment: the served model's name and context length, and a way to
    count a chat's prompt tokens (for chat's default max_tokens: the rest of the context)."""

    model: str
    max_model_len: int
    count_chat_tokens: Callable[[list[dict[str, str]]], int] | None = None
    max_sequences: int = MAX_N * MAX_BATCH  # choices (n × prompts) one request may ask for
    max_prompt_chars: int | None = None  # a prompt (or a chat's contents) longer than this cannot fit the context
    # How the model takes tools; a native format's chats with tools are rendered here, by `render_chat`
    # (messages, tools or None → token ids; raises when the template refuses them).
    tool_format: ToolFormat = JSON_CONVENTION
    render_chat: Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], list[int]] | None = None


# --- field readers: each refuses a wrong type with a 400 naming the parameter --------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: Mapping[str, Any], key: str, default: float | None) -> float | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise invalid(f"{key} must be a number, got {_short(v)}", key)
    return float(v)


def _int(body: Mapping[str, Any], key: str, default: int | None, lo: int | None = None,
         hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if not _is_int(v):
        raise invalid(f"{key} must be an integer, got {_short(v)}", key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bounds = f"at least {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise invalid(f"{key} must be {bounds}, got {v}", key)
    return v


def _bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(f"{key} must be true or false, got {_short(v)}", key)
    return v


def _token_ids(v: Any, key: str) -> list[int]:
    if not isinstance(v, list) or not all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in v):
        raise invalid(f"{key} must be a list of token ids (integers in [0, 2**63))", key)
    return list(v)


def _stop(body: Mapping[str, Any]) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return list(v)
    raise invalid("stop must be a string or a list of strings", "stop")


def _logit_bias(body: Mapping[str, Any]) -> dict[int, float]:
    """OpenAI's {"token id as a string": bias}; ids must be integers, biases numbers (the client's rules)."""
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise invalid("logit_bias must map token ids to biases", "logit_bias")
    try:
        pairs = dict(logit_bias_pairs(v))
    except ValueError as exc:  # a key of more digits than int() takes is one too
        raise invalid(str(exc), "logit_bias") from None
    bad = next((t for t in pairs if not 0 <= t <= MAX_TOKEN_ID), None)
    if bad is not None:
        raise invalid(f"logit_bias key {_short(bad)} is not a token id", "logit_bias")
    return pairs


def _check_keys(body: Any, known: set[str]) -> None:
    if not isinstance(body, Mapping):
        raise invalid("the request body must be a JSON object")
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        raise invalid(f"Unrecognized request argument supplied: {', '.join(map(_short, unknown))}", unknown[0][:40])


def _check_model(body: Mapping[str, Any], ctx: ParseContext) -> str:
    model = body.get("model")
    if model is None:
        raise invalid("you must provide a model parameter", "model")
    if model != ctx.model:
        raise model_not_found(_short(model))
    return model


def _unsupported(key: str, why: str = "") -> ApiError:
    return invalid(f"{key} is not supported by this server{': ' + why if why else ''}", key)


def _sampling(body: Mapping[str, Any], max_tokens: int) -> dict[str, Any]:
    """The sampling parameters shared by both endpoints, as SamplingParamsWire fields, range-checked by the
    engine's own rules (SamplingParams.validate) so a bad value fails before any request leaves."""
    params: dict[str, Any] = dict(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0),  # OpenAI's default: sampling
        top_p=_number(body, "top_p", 1.0),
        top_k=_int(body, "top_k", 0),
        min_p=_number(body, "min_p", 0.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0),
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        seed=_int(body, "seed", None),
        stop=_stop(body),
        stop_token_ids=_token_ids(body["stop_token_ids"], "stop_token_ids") if body.get("stop_token_ids") else [],
        ignore_eos=_bool(body, "ignore_eos", False),
    )
    bias = _logit_bias(body)
    if bias:
        params["logit_bias"] = bias
    try:
        SamplingParams(**params).validate()
    except InvalidRequestError as exc:
        raise invalid(str(exc), next((k for k in params if f" {k}=" in str(exc)), None)) from None
    # Our extensions: a tighter time-to-first-token and time-per-output-token SLO than the tenant's.
    for key in ("ttft_slo_s", "tpot_slo_s"):
        slo = _number(body, key, None)
        if slo is not None:
            if slo <= 0:
                raise invalid(f"{key} must be a positive number of seconds, got {slo:g}", key)
            params[key] = slo
    return params


def _samples(params: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """n copies of one prompt's parameters; sample j > 0 of a seeded request uses seed + j."""
    seed = params.get("seed")
    return [dict(params, seed=None if seed is None else (seed + j) % 2**63) for j in range(n)]


def _stream_options(body: Mapping[str, Any], stream: bool) -> bool:
    """Whether the stream ends with a usage chunk (stream_options.include_usage)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(options, Mapping) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise invalid("stream_options takes include_usage", "stream_options")
    return _bool(options, "include_usage", False)


# --- /v1/completions -----------------------------------------------------------------------------------------


def _prompts(v: Any) -> list[str | list[int]]:
    """A string, a list of strings (a batch), a token id list, or a list of token id lists (a batch)."""
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and v:
        if all(isinstance(p, str) for p in v):
            return list(v)
        if all(_is_int(t) for t in v):
            return [_token_ids(v, "prompt")]
        if all(isinstance(p, list) for p in v):
            return [_token_ids(p, "prompt") for p in v]
    raise invalid("prompt must be a string, a list of strings, a list of token ids or a list of token id lists",
                  "prompt")


def _check_sequences(prompts: int, n: int, ctx: ParseContext) -> None:
    if prompts * n > ctx.max_sequences:
        raise invalid(f"{prompts} prompts × n = {n} asks for {prompts * n} choices; at most {ctx.max_sequences} "
                      f"per request", "n", cause="too_many_sequences")


def check_prompt_chars(chars: int, ctx: ParseContext, param: str) -> None:
    """A prompt of `chars` characters that no context of ctx.max_model_len tokens can hold: refused before
    anything tokenises it."""
    if ctx.max_prompt_chars is not None and chars > ctx.max_prompt_chars:
        raise invalid(f"the prompt has {chars} characters, more than the model's context of {ctx.max_model_len} "
                      f"tokens can hold", param, cause="prompt_too_long")


def parse_completion(body: Any, ctx: ParseContext) -> GenerationPlan:
    _check_keys(body, COMPLETION_KEYS)
    model = _check_model(body, ctx)
    if "prompt" not in body:
        raise invalid("you must provide a prompt", "prompt")
    prompts = _prompts(body["prompt"])
    if any(not p for p in prompts):
        raise invalid("a prompt must not be empty", "prompt")
    if len(prompts) > MAX_BATCH:
        raise invalid(f"at most {MAX_BATCH} prompts per request", "prompt")
    if body.get("suffix"):
        raise _unsupported("suffix", "insertion is not offered")
    n = _int(body, "n", 1, 1, MAX_N)
    assert n is not None
    _check_sequences(len(prompts), n, ctx)
    for p in prompts:
        check_prompt_chars(len(p), ctx, "prompt")
    best_of = _int(body, "best_of", None, 1)
    if best_of is not None and best_of != n:
        raise _unsupported("best_of", "give n samples instead")
    stream = _bool(body, "stream", False)
    echo = _bool(body, "echo", False)
    logprobs = _int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    max_tokens = _int(body, "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS, 0)
    assert max_tokens is not None
    evaluate_only = max_tokens == 0
    params = _sampling(body, max(1, max_tokens))
    if evaluate_only:
        params["temperature"] = 0.0  # the token is dropped: the cheapest way to the one it costs
    if logprobs is not None:
        params["logprobs"] = logprobs
        if echo:
            params["prompt_logprobs"] = logprobs
    requests = []
    for p in prompts:
        for sample in _samples(params, n):
            requests.append(MeshRequest(sample, prompt=p) if isinstance(p, str)
                            else MeshRequest(sample, prompt_token_ids=p))
    return GenerationPlan("completion", model, tuple(requests), n, stream, _stream_options(body, stream), echo,
                          logprobs, evaluate_only, tuple(p if isinstance(p, str) else None for p in prompts))


# --- /v1/chat/completions ------------------------------------------------------------------------------------


def _content(content: Any, where: str) -> str:
    """A message's content: a string, null (an assistant turn that only called tools), or text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise invalid(f"{where}: only text content parts are supported, got {kind!r}", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(f"{where}: content must be a string or a list of text parts", "messages")


def chat_messages(v: Any, fmt: ToolFormat = JSON_CONVENTION) -> list[dict[str, Any]]:
    """OpenAI's messages as the chat template takes them: {"role", "content"} with string contents; earlier tool
    calls in the model's tool format, and (for a native format) tool results with their call's id."""
    if not isinstance(v, list) or not v:
        raise invalid("messages must be a non-empty list", "messages")
    out = []
    for i, msg in enumerate(v):
        if not isinstance(msg, Mapping) or not isinstance(msg.get("role"), str):
            raise invalid(f"messages[{i}] must be an object with a role", "messages")
        if msg["role"] == "function":
            raise _unsupported("function messages", f"messages[{i}]: use tools and role tool")
        content = _content(msg.get("content"), f"messages[{i}]")
        if msg.get("tool_calls"):
            out.append(history_turn(msg, content, f"messages[{i}]", fmt))
            continue
        turn = {"role": msg["role"], "content": content}
        if fmt.native and msg["role"] == "tool" and isinstance(msg.get("tool_call_id"), str):
            turn["tool_call_id"] = msg["tool_call_id"]
        out.append(turn)
    return out


def _render_native(ctx: ParseContext, messages: list[dict[str, Any]], tools: ToolPlan | None) -> list[int]:
    """A chat whose tools or earlier calls the template renders itself, as token ids (the mesh's messages carry
    strings only)."""
    assert ctx.render_chat is not None, "a native tool format needs render_chat"
    try:
        return ctx.render_chat(messages, tool_specs(tools) if tools is not None else None)
    except Exception as exc:  # the template refused the messages (raise_exception), or cannot render them
        raise invalid(f"cannot apply the chat template: {str(exc)[:200]}", "messages") from None


def _check_chat_unsupported(body: Mapping[str, Any]) -> None:
    if body.get("functions"):
        raise _unsupported("functions", "use tools")
    if body.get("function_call") not in (None, "none", "auto"):
        raise _unsupported("function_call", "use tool_choice")


def parse_chat(body: Any, ctx: ParseContext) -> GenerationPlan:
    _check_keys(body, CHAT_KEYS)
    model = _check_model(body, ctx)
    if "messages" not in body:
        raise invalid("you must provide messages", "messages")
    _check_chat_unsupported(body)
    tools = parse_tools(body, ctx.tool_format)
    messages = chat_messages(body["messages"], ctx.tool_format)
    if tools is not None:
        messages = prompt_messages(messages, tools)
    check_prompt_chars(sum(len(msg["content"]) for msg in messages), ctx, "messages")
    rendered = None
    if ctx.tool_format.native and (tools is not None or any("tool_calls" in msg for msg in messages)):
        rendered = _render_native(ctx, messages, tools)
    n = _int(body, "n", 1, 1, MAX_N)
    assert n is not None
    _check_sequences(1, n, ctx)
    stream = _bool(body, "stream", False)
    want_logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not want_logprobs:
        raise invalid("top_logprobs needs logprobs set to true", "top_logprobs")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, key, None, 1)
    if max_tokens is None:  # the rest of the context, as OpenAI does
        if rendered is not None:
            used = len(rendered)
        else:
            used = ctx.count_chat_tokens(messages) if ctx.count_chat_tokens is not None else 0
        max_tokens = max(1, ctx.max_model_len - used)
    params = _sampling(body, max_tokens) | response_format_params(body.get("response_format"))
    if tools is not None:
        params |= constraint_params(tools)
    logprobs = (top or 0) if want_logprobs else None
    if logprobs is not None:
        params["logprobs"] = logprobs
    prompt = {"messages": messages} if rendered is None else {"prompt_token_ids": rendered}
    requests = tuple(MeshRequest(sample, **prompt) for sample in _samples(params, n))
    return GenerationPlan("chat", model, requests, n, stream, _stream_options(body, stream), logprobs=logprobs,
                          tools=tools)


# --- /tokenize and /detokenize (vLLM's shapes) -------------------------------------------------------------


@dataclass(frozen=True)
class TokenizeRequest:
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None  # for a native tool format's template (else in the messages)


def parse_tokenize(body: Any, ctx: ParseContext) -> TokenizeRequest:
    """A prompt, or a chat (with tools, described as a chat request with them would be)."""
    _check_keys(body, {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "tools"})
    if body.get("model") is not None and body["model"] != ctx.model:
        raise model_not_found(_short(body["model"]))
    if ("prompt" in body) == ("messages" in body):
        raise invalid("give exactly one of prompt or messages", "prompt")
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise invalid("prompt must be a string", "prompt")
        check_prompt_chars(len(body["prompt"]), ctx, "prompt")
        return TokenizeRequest(prompt=body["prompt"], add_special_tokens=_bool(body, "add_special_tokens", True))
    messages = chat_messages(body["messages"], ctx.tool_format)
    tools = parse_tools({"tools": body.get("tools")}, ctx.tool_format)
    if tools is not None:
        messages = prompt_messages(messages, tools)
    check_prompt_chars(sum(len(msg["content"]) for msg in messages), ctx, "messages")
    return TokenizeRequest(messages=messages, add_generation_prompt=_bool(body, "add_generation_prompt", True),
                           tools=tool_specs(tools) if tools is not None and ctx.tool_format.native else None)


def parse_detokenize(body: Any, ctx: ParseContext, vocab_size: int) -> list[int]:
    _check_keys(body, {"model", "tokens"})
    if body.get("model") is not None and body["model"] != ctx.model:
        raise model_not_found(_short(body["model"]))
    tokens = _token_ids(body.get("tokens"), "tokens")
    bad = next((t for t in tokens if t >= vocab_size), None)
    if bad is not None:
        raise invalid(f"token id {bad} is outside the vocabulary (size {vocab_size})", "tokens")
    return tokens
