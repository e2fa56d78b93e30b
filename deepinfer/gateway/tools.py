"""Tool calling for the chat endpoint: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, on any model.

* The tools are put to the model in its `ToolFormat` (gateway/tool_formats.py): through the chat template where
  the template renders tools itself (Hermes `<tool_call>` blocks), otherwise in a system message with our own
  JSON answer format. Earlier turns that called tools are rendered in the same format, and tool results as turns
  of role "tool", so the model sees one convention throughout.
* `tool_choice` "required" or a named function constrains the output (structured output) to the format's calls
  with the allowed tools' own parameter schemas, non-strict (keywords the grammar engine cannot enforce are
  ignored rather than refused): the answer always parses and always calls what was asked. A named tool is
  called once; "required" allows several calls unless `parallel_tool_calls` is false (a small model may repeat
  a call until `max_tokens` cuts it: the answer is then text, finish_reason "length"). "auto" leaves the model
  free, and an answer that reads as calls of known tools is taken as calls; "none" describes no tools.
* The answer becomes `message.tool_calls` (each with an id `call_…` and its arguments as a JSON string) and
  `finish_reason: "tool_calls"`, when the whole answer is calls (text around a call stays text). Streamed, the
  text is held back while it could still be a call: calls go out as one `delta.tool_calls` chunk per call,
  which the SDKs assemble by index; an answer that turns out to be text is streamed from there on.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deepinfer.gateway.errors import invalid
from deepinfer.gateway.tool_formats import JSON_CONVENTION, ToolFormat

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
    format: ToolFormat = JSON_CONVENTION

    @property
    def forced(self) -> bool:
        return self.choice != "auto"


def parse_tools(body: Mapping[str, Any], fmt: ToolFormat = JSON_CONVENTION) -> ToolPlan | None:
    """The request's tool plan in the model's format, or None (no tools, or tool_choice "none"); ApiError (400)
    for a bad shape."""
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
    return ToolPlan(tools, picked, parallel, fmt)


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


def tool_specs(plan: ToolPlan) -> list[dict[str, Any]]:
    """The tools as chat templates take them (OpenAI's shape)."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": dict(t.parameters)}} for t in plan.tools]


def prompt_messages(messages: list[dict[str, Any]], plan: ToolPlan) -> list[dict[str, Any]]:
    """`messages` with the tools described, where the format does it in the messages (not the template)."""
    how = ("You must call " + ("the tool " + plan.choice if plan.choice != "required" else "one or more tools")
           if plan.forced else "If a tool helps, call it")
    return plan.format.prompt(messages, tool_specs(plan), how)


def history_turn(msg: Mapping[str, Any], content: str, where: str, fmt: ToolFormat) -> dict[str, Any]:
    """An earlier assistant turn that called tools, in the model's format."""
    try:
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]]
    except (KeyError, TypeError, ValueError):
        raise invalid(f"{where}.tool_calls must be OpenAI tool calls with JSON arguments", "messages") from None
    return fmt.call_turn(calls, content)


def constraint_params(plan: ToolPlan) -> dict[str, Any]:
    """For a forced choice, the structured-output parameters that make the answer a call of the allowed tools."""
    if not plan.forced:
        return {}
    allowed = [(t.name, t.parameters) for t in plan.tools if plan.choice in ("required", t.name)]
    return plan.format.constraint(allowed, several=plan.parallel and plan.choice == "required")


# --- the answer ------------------------------------------------------------------------------------------------


def tool_calls(text: str, plan: ToolPlan) -> list[dict[str, Any]] | None:
    """The OpenAI tool calls `text` makes, or None when it is not only calls of the plan's tools (plain text)."""
    calls = plan.format.calls(text)
    names = {t.name for t in plan.tools}
    if not calls or not all(name in names and isinstance(args, dict) for name, args in calls):
        return None
    if not plan.parallel:
        calls = calls[:1]
    return [{"id": "call_" + secrets.token_hex(12), "type": "function",
             "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}
            for name, args in calls]


def may_be_a_call(text: str, plan: ToolPlan) -> bool:
    """Whether a streamed answer so far could still turn out to be a call (held back until it is known)."""
    return plan.format.may_be_a_call(text)
