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
from deepinfer.gateway.tool_formats import HERMES_TAGS, JSON_CONVENTION, tool_format_for
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


# --- a template that renders tools itself: the Hermes format (gateway/tool_formats.py) ---------------------------

HERMES_TEMPLATE = ("{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}{% for m in messages %}"
                   "{{ m.role }}: {{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{{ c | tojson }}"
                   "</tool_call>{% endfor %}\n{% endfor %}")


def test_the_format_is_hermes_only_for_a_template_that_takes_tools_and_writes_tool_call_blocks() -> None:
    assert tool_format_for(HERMES_TEMPLATE) is HERMES_TAGS
    assert tool_format_for("{{ messages }} <tool_call>") is JSON_CONVENTION  # no tools variable
    assert tool_format_for("{% for t in tools %}{{ t }}{% endfor %}") is JSON_CONVENTION  # another call syntax
    assert tool_format_for("{% generation %}{{ tools }}<tool_call>{% endgeneration %}") is HERMES_TAGS
    assert tool_format_for("{% if tools %}<tool_call>") is JSON_CONVENTION  # does not parse
    assert tool_format_for(None) is JSON_CONVENTION


def test_a_native_format_renders_the_chat_in_the_gateway_with_structured_calls_and_the_tools() -> None:
    seen = []

    def render(messages, tools):  # type: ignore[no-untyped-def]
        seen.append((messages, tools))
        if any(msg["content"] == "refused" for msg in messages):
            raise ValueError("the template refused it")
        return [7, 8, 9]

    ctx = ParseContext("tiny", 1000, tool_format=HERMES_TAGS, render_chat=render)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    plan = parse_chat({"model": "tiny", "messages": history, "tools": [WEATHER], "tool_choice": "required"}, ctx)
    [req] = plan.requests
    assert req.prompt_token_ids == [7, 8, 9] and req.messages is None
    assert req.params["max_tokens"] == 1000 - 3  # the rest of the context after the rendered ids
    messages, tools = seen[-1]
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert tools == [WEATHER] and len(messages) == 3  # the template describes the tools: no system text
    lark = req.params["grammar"]
    assert lark.startswith('start: call ("\\n" call)*') and "<tool_call>" in lark and '"const": "get_weather"' in lark
    named = parse_chat({"model": "tiny", "messages": ASK, "tools": [WEATHER, TIME],
                        "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, ctx)
    assert named.requests[0].params["grammar"].startswith("start: call\n")
    with pytest.raises(ApiError) as refused:
        parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "refused"}], "tools": [WEATHER]}, ctx)
    assert refused.value.status == 400 and "chat template" in str(refused.value)
    # No tools and no earlier calls: the mesh renders the chat, as for any model.
    assert parse_chat({"model": "tiny", "messages": ASK}, ctx).requests[0].messages == ASK


def test_hermes_answers_are_calls_only_when_the_whole_answer_is_tool_call_blocks() -> None:
    plan = parse_chat({"model": "tiny", "messages": ASK, "tools": [WEATHER, TIME]},
                      ParseContext("tiny", 1000, tool_format=HERMES_TAGS, render_chat=lambda m, t: [1]))
    two = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
           '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    choice = chat_choice(plan, 0, finished(two), lambda t: str(t))
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather", "get_time"]
    assert choice["finish_reason"] == "tool_calls"
    for text in ("Sure. " + two, two + " Done.", "<tool_call>\n{no json}\n</tool_call>",
                 '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', "<tool_call>\n[1]\n</tool_call>",
                 '<tool_call>{"name": "get_time"', "plain"):
        assert chat_choice(plan, 0, finished(text), lambda t: str(t))["message"]["content"] == text, text
    fmt = HERMES_TAGS
    assert all(fmt.may_be_a_call(t) for t in ("", "  ", "<", " <tool", "<tool_call>", '<tool_call>\n{"na'))
    assert not any(fmt.may_be_a_call(t) for t in ("Hello", "<tools>", "{", " <b>"))
