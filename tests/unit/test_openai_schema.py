"""The gateway's pure mapping: OpenAI bodies → mesh requests (parameters, validation), mesh records → OpenAI
responses (choices, logprobs shapes, echo, usage), stream chunks and SSE framing, errors → statuses."""

from __future__ import annotations

import json

import pytest

from deepinfer.gateway import openai_responses as out
from deepinfer.gateway.errors import ApiError, from_mesh_error
from deepinfer.gateway.openai_requests import (
    ParseContext,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
)
from deepinfer.protocol import messages as m
from deepinfer.protocol.client import (
    InvalidRequestError,
    MeshError,
    OverloadedError,
    RequestTimeoutError,
    RouterLostError,
    UnauthorizedError,
    UnavailableError,
    WorkerLostError,
)

CTX = ParseContext("tiny", 100, lambda msgs: 10 * len(msgs))
VOCAB = {1: "a", 2: "b", 3: "c", 4: "dd", 5: "e"}


def decode(t: int) -> str:
    return VOCAB[t]


def decode_all(ids: list[int]) -> str:
    return "".join(VOCAB[t] for t in ids)


def lp(token: int, logprob: float, *top: tuple[int, float]) -> m.LogprobWire:
    return m.LogprobWire(token, logprob, list(top))


def finished(text: str, ids: list[int], reason: str = "stop", logprobs=None, prompt_ids=None, prompt_lps=None,
             prompt_tokens: int = 3, cached: int = 0) -> m.RequestFinished:
    return m.RequestFinished("r", text, ids, reason, m.UsageWire(prompt_tokens, len(ids), cached), m.Timings(0.1),
                             logprobs=logprobs, prompt_token_ids=prompt_ids, prompt_logprobs=prompt_lps)


def refused(body: dict, parse=parse_completion, status: int = 400) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse(body, CTX)
    assert e.value.status == status
    return e.value


# -- requests ---------------------------------------------------------------------------------------------------


def test_completion_parameters_map_to_the_mesh():
    plan = parse_completion({"model": "tiny", "prompt": "hi", "max_tokens": 5, "temperature": 0.5, "top_p": 0.9,
                             "top_k": 4, "min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": -0.5,
                             "repetition_penalty": 1.1, "seed": 3, "stop": "x", "stop_token_ids": [2],
                             "ignore_eos": True, "logit_bias": {"5": -100}, "user": "u"}, CTX)
    [req] = plan.requests
    assert req.kwargs() == dict(prompt="hi", max_tokens=5, temperature=0.5, top_p=0.9, top_k=4, min_p=0.1,
                                presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1, seed=3,
                                stop=["x"], stop_token_ids=[2], ignore_eos=True, logit_bias={5: -100.0})
    assert plan.kind == "completion" and plan.n == 1 and not plan.stream and plan.logprobs is None


def test_defaults_are_openai_s():
    [req] = parse_completion({"model": "tiny", "prompt": "hi"}, CTX).requests
    assert req.params["max_tokens"] == 16 and req.params["temperature"] == 1.0
    chat = parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "x"}]}, CTX)
    assert chat.requests[0].params["max_tokens"] == 90  # the rest of the context: 100 - 10
    chat = parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 7,
                       "max_tokens": 3}, CTX)
    assert chat.requests[0].params["max_tokens"] == 7


@pytest.mark.parametrize("prompt, expect", [
    ("hi", [dict(prompt="hi")]),
    (["a", "b"], [dict(prompt="a"), dict(prompt="b")]),
    ([1, 2, 3], [dict(prompt_token_ids=[1, 2, 3])]),
    ([[1, 2], [3]], [dict(prompt_token_ids=[1, 2]), dict(prompt_token_ids=[3])]),
])
def test_the_four_prompt_forms(prompt, expect):
    plan = parse_completion({"model": "tiny", "prompt": prompt, "max_tokens": 1}, CTX)
    assert [{k: v for k, v in r.kwargs().items() if k.startswith("prompt")} for r in plan.requests] == expect


def test_n_samples_use_consecutive_seeds_in_openai_s_choice_order():
    plan = parse_completion({"model": "tiny", "prompt": ["a", "b"], "n": 3, "seed": 10}, CTX)
    assert [(r.prompt, r.params["seed"]) for r in plan.requests] == [
        ("a", 10), ("a", 11), ("a", 12), ("b", 10), ("b", 11), ("b", 12)]
    assert [plan.prompt_index(i) for i in range(6)] == [0, 0, 0, 1, 1, 1]
    unseeded = parse_completion({"model": "tiny", "prompt": "a", "n": 2}, CTX)
    assert [r.params["seed"] for r in unseeded.requests] == [None, None]


def test_echo_with_logprobs_asks_for_prompt_logprobs_and_max_tokens_0_evaluates_only():
    plan = parse_completion({"model": "tiny", "prompt": "hi", "echo": True, "logprobs": 2, "max_tokens": 0}, CTX)
    [req] = plan.requests
    assert req.params["max_tokens"] == 1 and req.params["prompt_logprobs"] == 2 and req.params["logprobs"] == 2
    assert plan.evaluate_only and plan.echo and plan.echo_texts == ("hi",)
    chat = parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": True,
                       "top_logprobs": 3}, CTX)
    assert chat.logprobs == 3 and chat.requests[0].params["logprobs"] == 3
    assert parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "x"}]}, CTX).logprobs is None


def test_chat_messages_take_text_parts_and_null_content():
    plan = parse_chat({"model": "tiny", "messages": [
        {"role": "system", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
        {"role": "assistant", "content": None, "name": "bot"}, {"role": "user", "content": "q"}]}, CTX)
    assert plan.requests[0].messages == [{"role": "system", "content": "be brief"},
                                         {"role": "assistant", "content": ""}, {"role": "user", "content": "q"}]


def test_stream_options():
    plan = parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True,
                       "stream_options": {"include_usage": True}}, CTX)
    assert plan.stream and plan.include_usage
    refused({"model": "tiny", "prompt": "x", "stream_options": {"include_usage": True}})


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x"}, "model"),
    ({"model": "tiny"}, "prompt"),
    ({"model": "tiny", "prompt": ""}, "prompt"),
    ({"model": "tiny", "prompt": []}, "prompt"),
    ({"model": "tiny", "prompt": [1, "a"]}, "prompt"),
    ({"model": "tiny", "prompt": [-1]}, "prompt"),
    ({"model": "tiny", "prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "temperature": True}, "temperature"),
    ({"model": "tiny", "prompt": "x", "temperature": -1}, "temperature"),
    ({"model": "tiny", "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": "tiny", "prompt": "x", "n": 0}, "n"),
    ({"model": "tiny", "prompt": "x", "logprobs": 21}, "logprobs"),
    ({"model": "tiny", "prompt": "x", "stop": [1]}, "stop"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ({"model": "tiny", "prompt": "x", "suffix": "y"}, "suffix"),
    ({"model": "tiny", "prompt": "x", "best_of": 3}, "best_of"),
    ({"model": "tiny", "prompt": "x", "frobnicate": 1}, "frobnicate"),
])
def test_bad_completion_bodies_are_400_naming_the_parameter(body, param):
    err = refused(body)
    assert err.param == param and err.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"tools": [{"type": "function"}]}, "tools"),  # no function name
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"messages": []}, "messages"),
])
def test_unsupported_chat_fields_are_400_naming_them(extra, param):
    err = refused({"model": "tiny", "messages": [{"role": "user", "content": "x"}], **extra}, parse_chat)
    assert err.param == param
    assert parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                       "response_format": {"type": "text"}, "tool_choice": "none"}, CTX).n == 1


def test_another_model_is_404_model_not_found():
    err = refused({"model": "gpt-4", "prompt": "x"}, status=404)
    assert err.code == "model_not_found" and err.param == "model"
    refused({"model": "gpt-4", "prompt": "x"}, lambda b, c: parse_tokenize(b, c), status=404)


def test_tokenize_and_detokenize_bodies():
    assert parse_tokenize({"prompt": "hi", "add_special_tokens": False}, CTX).add_special_tokens is False
    req = parse_tokenize({"messages": [{"role": "user", "content": "x"}]}, CTX)
    assert req.messages == [{"role": "user", "content": "x"}] and req.add_generation_prompt
    refused({"prompt": "a", "messages": []}, parse_tokenize)
    assert parse_detokenize({"tokens": [1, 2]}, CTX, 10) == [1, 2]
    with pytest.raises(ApiError, match="outside the vocabulary"):
        parse_detokenize({"tokens": [10]}, CTX, 10)


# -- errors -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("exc, status, kind", [
    (InvalidRequestError("invalid_request: bad"), 400, "invalid_request_error"),
    (UnauthorizedError("unauthorized: no key"), 401, "authentication_error"),
    (OverloadedError("overloaded: full", retry_after_s=2.2), 429, "rate_limit_exceeded"),
    (UnavailableError("unavailable: no worker"), 503, "service_unavailable"),
    (WorkerLostError("worker_lost: gone"), 503, "service_unavailable"),
    (RouterLostError("lost"), 503, "service_unavailable"),
    (RequestTimeoutError("too slow"), 504, "timeout"),
    (MeshError("internal: boom"), 500, "internal_error"),
])
def test_mesh_errors_map_to_openai_statuses(exc, status, kind):
    err = from_mesh_error(exc)
    assert (err.status, err.type, err.code) == (status, kind, exc.code)
    assert not err.message.startswith(exc.code + ":")
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}
    assert (err.headers.get("Retry-After") == "3") == (status == 429)
    assert ("Retry-After" in err.headers) == (status in (429, 503))


# -- responses --------------------------------------------------------------------------------------------------


def plan_for(body: dict, chat: bool = False):
    base = {"model": "tiny", **body}
    return parse_chat(base, CTX) if chat else parse_completion(base, CTX)


def test_a_completion_with_logprobs_and_usage():
    plan = plan_for({"prompt": "hi", "logprobs": 1, "max_tokens": 2})
    fin = finished("ab", [1, 2], "length", logprobs=[lp(1, -0.1, (1, -0.1)), lp(2, -2.0, (3, -0.5))], cached=2)
    r = out.response(plan, "cmpl-x", 7, [fin], decode, decode_all)
    assert r["object"] == "text_completion" and r["model"] == "tiny" and r["created"] == 7
    [choice] = r["choices"]
    assert choice["text"] == "ab" and choice["finish_reason"] == "length"
    assert choice["logprobs"] == {"tokens": ["a", "b"], "token_logprobs": [-0.1, -2.0],
                                  "top_logprobs": [{"a": -0.1}, {"c": -0.5, "b": -2.0}], "text_offset": [0, 1]}
    assert r["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                          "prompt_tokens_details": {"cached_tokens": 2}}


def test_echo_puts_the_prompt_first_with_a_null_first_logprob():
    plan = plan_for({"prompt": "ca", "echo": True, "logprobs": 0, "max_tokens": 1})
    fin = finished("dd", [4], logprobs=[lp(4, -1.0)], prompt_ids=[3, 1],
                   prompt_lps=[None, lp(1, -0.5, (2, -0.2))])
    [choice] = out.response(plan, "c", 0, [fin], decode, decode_all)["choices"]
    assert choice["text"] == "cadd"
    assert choice["logprobs"] == {"tokens": ["c", "a", "dd"], "token_logprobs": [None, -0.5, -1.0],
                                  "top_logprobs": [None, {"a": -0.5}, {"dd": -1.0}], "text_offset": [0, 1, 2]}


def test_evaluate_only_drops_the_generated_token():
    plan = plan_for({"prompt": [3, 1], "echo": True, "logprobs": 1, "max_tokens": 0})
    fin = finished("dd", [4], logprobs=[lp(4, -1.0)], prompt_ids=[3, 1], prompt_lps=[None, lp(1, -0.5)])
    r = out.response(plan, "c", 0, [fin], decode, decode_all)
    [choice] = r["choices"]
    assert choice["text"] == "ca" and choice["logprobs"]["tokens"] == ["c", "a"]
    assert choice["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 0


def test_n_choices_count_the_prompt_once():
    plan = plan_for({"prompt": ["a", "b"], "n": 2})
    fins = [finished("x", [1], prompt_tokens=p) for p in (3, 3, 5, 5)]
    r = out.response(plan, "c", 0, fins, decode, decode_all)
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert r["usage"]["prompt_tokens"] == 8 and r["usage"]["completion_tokens"] == 4


def test_a_chat_response_with_logprobs():
    plan = plan_for({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 1}, chat=True)
    fin = finished("ab", [1, 2], logprobs=[lp(1, -0.1, (1, -0.1), (2, -3.0)), lp(2, -2.0, (3, -0.5))])
    r = out.response(plan, "chatcmpl-x", 0, [fin], decode, decode_all)
    assert r["object"] == "chat.completion"
    [choice] = r["choices"]
    assert choice["message"] == {"role": "assistant", "content": "ab"} and choice["finish_reason"] == "stop"
    a, b, c = ({"token": t, "logprob": v, "bytes": [ord(t)]} for t, v in (("a", -0.1), ("b", -2.0), ("c", -0.5)))
    assert choice["logprobs"]["content"] == [{**a, "top_logprobs": [a]}, {**b, "top_logprobs": [c]}]


# -- streams ----------------------------------------------------------------------------------------------------


def test_chat_stream_chunks_concatenate_and_end_with_usage():
    plan = plan_for({"messages": [{"role": "user", "content": "x"}], "stream": True,
                     "stream_options": {"include_usage": True}}, chat=True)
    s = out.ChoiceStream(plan, "id", 0, 0, decode, decode_all)
    chunks = [*s.on_delta(m.StreamDelta("r", "a", [1])), *s.on_delta(m.StreamDelta("r", "b", [2])),
              *s.on_finished(finished("ab", [1, 2]))]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "ab"
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "stop"]
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks)
    last = out.usage_chunk(plan, "id", 0, [finished("ab", [1, 2])])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2


def test_completion_stream_echo_and_logprob_offsets():
    plan = plan_for({"prompt": "ca", "stream": True, "echo": True, "logprobs": 0})
    s = out.ChoiceStream(plan, "id", 0, 0, decode, decode_all)
    first = m.StreamDelta("r", "dd", [4], logprobs=[lp(4, -1.0)], prompt_token_ids=[3, 1],
                          prompt_logprobs=[None, lp(1, -0.5)])
    chunks = [*s.on_delta(first), *s.on_delta(m.StreamDelta("r", "e", [5], 1, [lp(5, -0.3)])),
              *s.on_finished(finished("dde", [4, 5]))]
    assert [c["choices"][0]["text"] for c in chunks] == ["ca", "dd", "e", ""]
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"] == [None, -0.5]
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in chunks[:3]] == [[0, 1], [2], [4]]


def test_sse_framing():
    frame = out.sse({"a": "é\n"})
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n") and frame.count(b"\n") == 2
    assert json.loads(frame[6:]) == {"a": "é\n"}
    assert out.DONE == b"data: [DONE]\n\n"
