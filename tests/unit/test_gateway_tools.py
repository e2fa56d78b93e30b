"""Tool calling in the gateway (gateway/tools.py): the request's tools and tool_choice, the prompt that describes
them, the constraint a forced choice puts on the answer, and the answer read back as OpenAI tool calls, whole
and streamed."""

from __future__ import annotations

import json

import jsonschema
import pytest

from deepinfer.gateway.errors import ApiError
from deepinfer.gateway.openai_requests import ParseContext, parse_chat
from deepinfer.gateway.openai_responses import ChoiceStream, chat_choice
from deepinfer.protocol import messages as m

CTX = ParseContext("tiny", 1000)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def chat(**body: object):  # type: ignore[no-untyped-def]
    return parse_chat({"model": "tiny", "messages": ASK, **body}, CTX)


def finished(text: str, reason: str = "stop") -> m.RequestFinished:
    return m.RequestFinished("r", text, [1, 2], reason, m.UsageWire(3, 2), m.Timings(0.1))


def test_tools_are_described_in_the_system_message_and_a_forced_choice_constrains_the_answer() -> None:
    plan = chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    kw = plan.requests[0].kwargs()
    system = kw["messages"][0]
    assert system["role"] == "system" and "get_weather" in system["content"] and "tool_calls" in system["content"]
    schema = json.loads(kw["json_schema"])
    assert kw["strict"] is False
    jsonschema.validate({"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}, schema)
    with pytest.raises(jsonschema.ValidationError):  # only the named tool
        jsonschema.validate({"tool_calls": [{"name": "get_time", "arguments": {}}]}, schema)
    assert schema["properties"]["tool_calls"]["maxItems"] == 1  # called once
    required = json.loads(chat(tools=[WEATHER, TIME], tool_choice="required").requests[0].kwargs()["json_schema"])
    jsonschema.validate({"tool_calls": [{"name": "get_time", "arguments": {}},
                                        {"name": "get_weather", "arguments": {"city": "Rome"}}]}, required)
    single = json.loads(chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
                        .requests[0].kwargs()["json_schema"])
    assert single["properties"]["tool_calls"]["maxItems"] == 1
    auto = chat(tools=[WEATHER]).requests[0].kwargs()
    assert "json_schema" not in auto and "get_weather" in auto["messages"][0]["content"]
    assert "get_weather" not in chat(tools=[WEATHER], tool_choice="none").requests[0].kwargs()["messages"][0][
        "content"]


def test_bad_tool_requests_are_400() -> None:
    for body in ({"tools": []}, {"tools": [WEATHER, WEATHER]}, {"tools": [WEATHER], "tool_choice": "always"},
                 {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                 {"tools": [WEATHER], "parallel_tool_calls": "yes"},
                 {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}):
        with pytest.raises(ApiError):
            chat(**body)


def test_history_with_calls_and_results_is_rendered_in_the_same_convention() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    msgs = parse_chat({"model": "tiny", "messages": history, "tools": [WEATHER]}, CTX).requests[0].kwargs()["messages"]
    assert json.loads(msgs[2]["content"]) == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
    assert msgs[3] == {"role": "tool", "content": "sunny, 21 C"}
    bad = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "x", "arguments": "{no"}}]}
    with pytest.raises(ApiError):
        parse_chat({"model": "tiny", "messages": [*ASK, bad], "tools": [WEATHER]}, CTX)


def test_an_answer_that_calls_a_tool_becomes_tool_calls_and_text_stays_text() -> None:
    plan = chat(tools=[WEATHER])
    call = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'
    choice = chat_choice(plan, 0, finished(call), lambda t: str(t))
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [tc] = choice["message"]["tool_calls"]
    assert tc["type"] == "function" and tc["id"].startswith("call_") and tc["function"]["name"] == "get_weather"
    assert json.loads(tc["function"]["arguments"]) == {"city": "Paris"}
    for text in ("It is sunny.", '{"tool_calls": [{"name": "unknown", "arguments": {}}]}', '{"tool_calls": ['):
        assert chat_choice(plan, 0, finished(text), lambda t: str(t))["message"]["content"] == text


def test_a_streamed_call_is_held_back_and_sent_as_tool_call_deltas_and_text_streams_once_it_is_text() -> None:
    plan = chat(tools=[WEATHER], stream=True)
    call = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'
    stream = ChoiceStream(plan, "id", 0, 0, lambda t: str(t), lambda ids: "")
    chunks = [c for part in (call[:10], call[10:]) for c in stream.on_delta(m.StreamDelta("r", part, [1]))]
    assert all(not c["choices"][0]["delta"].get("content") for c in chunks)  # held
    end = stream.on_finished(finished(call))
    deltas = [c["choices"][0]["delta"] for c in end]
    [call_delta] = [d for d in deltas if "tool_calls" in d]
    assert call_delta["tool_calls"][0]["index"] == 0
    assert json.loads(call_delta["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert end[-1]["choices"][0]["finish_reason"] == "tool_calls"
    text = ChoiceStream(plan, "id", 0, 0, lambda t: str(t), lambda ids: "")
    first = text.on_delta(m.StreamDelta("r", "  It", [1]))
    assert [c["choices"][0]["delta"].get("content") for c in first][-1] == "  It"  # plainly text: streamed
    assert text.on_delta(m.StreamDelta("r", " is", [2]))[-1]["choices"][0]["delta"]["content"] == " is"
