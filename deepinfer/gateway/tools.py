"""Tool calling for the chat endpoint: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, on any model.

* The tools are described to the model in a system message (appended to the conversation's own, or a new
  first one), with the one answer format it must use to call them: a JSON object
  `{"tool_calls": [{"name": <tool>, "arguments": {...}}, ...]}` and nothing else. Earlier turns that called
  tools are rendered the same way, and tool results as turns of role "tool", so the model sees one
  convention throughout. (A chat template that renders tools itself is not used: the mesh's requests carry
  messages only, and SmolLM2's template, like many, has no tools.)
* `tool_choice` "required" or a named function constrains the output (structured output, `json_schema`) to that
  format with the allowed tools' own parameter schemas, non-strict (keywords the grammar engine cannot
  enforce are ignored rather than refused): the answer always parses and always calls what was asked. A
  named tool is called once; "required" allows several calls unless `parallel_tool_calls` is false (a small
  model may repeat a call until `max_tokens` cuts it: the answer is then text, finish_reason "length").
  "auto" leaves the model free, and an answer that parses as the format with known tool names is taken as
  calls; "none" describes no tools.
* The answer becomes `message.tool_calls` (each with an id `call_…` and its arguments as a JSON string) and
  `finish_reason: "tool_calls"`. Streamed, the text is held back while it could still be a call (it starts with
  `{`): calls go out as one `delta.tool_calls` chunk per call, which the SDKs assemble by index; an answer that
  turns out to be text is streamed from there on.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deepinfer.gateway.errors import invalid

MAX_TOOLS = 128


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: Mapping[str, Any]


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[Tool, ...]
    choice: str  # "auto", "required", or the one tool's name ("none" never makes a plan)
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice != "auto"


def parse_tools(body: Mapping[str, Any]) -> ToolPlan | None:
    """The request's tool plan, or None (no tools, or tool_choice "none"); ApiError (400) for a bad shape."""
    raw = body.get("tools")
    choice = body.get("tool_choice")
    if raw is None:
        if choice not in (None, "none", "auto"):
            raise invalid("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(raw, list) or not raw or len(raw) > MAX_TOOLS:
        raise invalid(f"tools must be a list of 1 to {MAX_TOOLS} tools", "tools")
    tools = tuple(_tool(t, i) for i, t in enumerate(raw))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise invalid("tool names must be unique", "tools")
    if choice in (None, "auto"):
        picked = "auto"
    elif choice == "none":
        return None
    elif choice == "required":
        picked = "required"
    elif isinstance(choice, Mapping) and choice.get("type") == "function" and isinstance(choice.get("function"),
                                                                                         Mapping):
        picked = choice["function"].get("name")
        if picked not in names:
            raise invalid(f"tool_choice names {picked!r}, which is not among the tools", "tool_choice")
    else:
        raise invalid('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                      '{"name": ...}}', "tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if picked != "auto" and body.get("response_format") not in (None, {"type": "text"}):
        raise invalid("response_format cannot be combined with a forced tool_choice", "response_format")
    return ToolPlan(tools, picked, parallel)


def _tool(t: Any, i: int) -> Tool:
    fn = t.get("function") if isinstance(t, Mapping) and t.get("type") == "function" else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise invalid(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., ...}}}}', "tools")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, Mapping):
        raise invalid(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    description = fn.get("description", "")
    return Tool(fn["name"], description if isinstance(description, str) else "", params)


# --- the prompt ------------------------------------------------------------------------------------------------


def system_text(plan: ToolPlan) -> str:
    specs = [{"name": t.name, "description": t.description, "parameters": t.parameters} for t in plan.tools]
    how = ("You must call " + ("the tool " + plan.choice if plan.choice != "required" else "one or more tools")
           if plan.forced else "If a tool helps, call it")
    return (f"You can call these tools:\n{json.dumps(specs, ensure_ascii=False)}\n{how} by answering with only a "
            'JSON object {"tool_calls": [{"name": <tool name>, "arguments": {<its arguments>}}]}; otherwise answer '
            "in plain text.")


def render_call_turn(msg: Mapping[str, Any], where: str) -> dict[str, str]:
    """An earlier assistant turn that called tools, as a plain turn in the calling convention."""
    try:
        rendered = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                    for c in msg["tool_calls"]]
    except (KeyError, TypeError, ValueError):
        raise invalid(f"{where}.tool_calls must be OpenAI tool calls with JSON arguments", "messages") from None
    return {"role": "assistant", "content": json.dumps({"tool_calls": rendered}, ensure_ascii=False)}


def with_tools(messages: list[dict[str, str]], plan: ToolPlan) -> list[dict[str, str]]:
    """`messages` with the tools described in the system message."""
    text = system_text(plan)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def constraint_params(plan: ToolPlan) -> dict[str, Any]:
    """For a forced choice, the structured-output parameters that make the answer a call of the allowed tools."""
    if not plan.forced:
        return {}
    allowed = [t for t in plan.tools if plan.choice in ("required", t.name)]
    calls = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": dict(t.parameters)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in allowed]
    items: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    array: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if not plan.parallel or plan.choice != "required":  # a named tool is called once
        array["maxItems"] = 1
    schema = {"type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"],
              "additionalProperties": False}
    return {"json_schema": json.dumps(schema, ensure_ascii=False), "strict": False}


# --- the answer ------------------------------------------------------------------------------------------------


def tool_calls(text: str, plan: ToolPlan) -> list[dict[str, Any]] | None:
    """The OpenAI tool calls `text` makes, or None when it is not a call of the plan's tools (plain text)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    calls = value.get("tool_calls") if isinstance(value, dict) else None
    names = {t.name for t in plan.tools}
    if not isinstance(calls, list) or not calls or not all(
            isinstance(c, dict) and c.get("name") in names and isinstance(c.get("arguments", {}), dict)
            for c in calls):
        return None
    if not plan.parallel:
        calls = calls[:1]
    return [{"id": "call_" + secrets.token_hex(12), "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c.get("arguments", {}), ensure_ascii=False)}}
            for c in calls]


def may_be_a_call(text: str) -> bool:
    """Whether a streamed answer so far could still turn out to be a call (held back until it is known)."""
    head = text.lstrip()
    return not head or head.startswith("{")
