"""How a model is told about tools and how its calls are read back: one `ToolFormat` per family of models.

* `JSON_CONVENTION`, for any model: the tools are described in a system message, and a call is the answer
  `{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}` and nothing else. Earlier calls are rendered the same
  way as plain assistant turns, so the model sees one convention throughout. The mesh renders the chat.
* `HERMES_TAGS`, for chat templates that render tools themselves and call with
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks (the Hermes format, which Qwen 2.5/3 and
  SmolLM3 templates use): the template gets the tools and the earlier calls as structured values (`native`), so
  the model reads them as it was trained to. Those values do not fit the mesh's messages (strings only), so the
  gateway renders the chat itself and sends token ids.

`tool_format_for(template)` picks: Hermes when the template takes a `tools` variable and writes `<tool_call>`,
the JSON convention otherwise (including tool-aware templates with other call syntaxes, whose models are then
told our convention in the system message).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jinja2

from deepinfer.grammar.spec import JSON_LAYOUT
from deepinfer.text.tokenizer import template_variables

# A call as a format reads it: the tool's name and its arguments (not yet checked against the request's tools).
RawCall = tuple[Any, Any]
# Every constrained JSON answer's layout, non-strict: keywords the grammar engine cannot enforce in a tool's
# parameters are ignored rather than refused.
_LAYOUT = {**JSON_LAYOUT, "lenient": True}


@dataclass(frozen=True)
class ToolFormat:
    """One way of putting tools to a model. Contract for each format:

    * `call_turn(calls, content)`: an earlier assistant turn that made `calls` ([(name, arguments dict)]), as a
      message the chat template takes.
    * `prompt(messages, specs, how)`: the messages with the tools described, for a format that is not
      `native` (a native format's template gets `specs` itself).
    * `constraint(choices, several)`: the structured-output parameters that force the answer to be calls of the
      tools in `choices` ([(name, parameters schema)]): one call, or several when `several`.
    * `calls(text)`: the calls a whole answer makes ([(name, arguments)]), or None when it is not only calls.
    * `may_be_a_call(text)`: whether a streamed answer so far could still turn out to be calls.
    """

    name: str
    native: bool

    def call_turn(self, calls: Sequence[tuple[str, dict[str, Any]]], content: str) -> dict[str, Any]:
        raise NotImplementedError

    def prompt(self, messages: list[dict[str, Any]], specs: list[dict[str, Any]], how: str) -> list[dict[str, Any]]:
        return messages

    def constraint(self, choices: Sequence[tuple[str, Mapping[str, Any]]], several: bool) -> dict[str, Any]:
        raise NotImplementedError

    def calls(self, text: str) -> list[RawCall] | None:
        raise NotImplementedError

    def may_be_a_call(self, text: str) -> bool:
        raise NotImplementedError


def _call_schema(name: str, parameters: Mapping[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": dict(parameters)},
            "required": ["name", "arguments"], "additionalProperties": False}


def _one_of(choices: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    calls = [_call_schema(name, params) for name, params in choices]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


class _JsonConvention(ToolFormat):
    def call_turn(self, calls: Sequence[tuple[str, dict[str, Any]]], content: str) -> dict[str, Any]:
        rendered = [{"name": name, "arguments": args} for name, args in calls]
        return {"role": "assistant", "content": json.dumps({"tool_calls": rendered}, ensure_ascii=False)}

    def prompt(self, messages: list[dict[str, Any]], specs: list[dict[str, Any]], how: str) -> list[dict[str, Any]]:
        described = [s["function"] for s in specs]
        text = (f"You can call these tools:\n{json.dumps(described, ensure_ascii=False)}\n{how} by answering with "
                'only a JSON object {"tool_calls": [{"name": <tool name>, "arguments": {<its arguments>}}]}; '
                "otherwise answer in plain text.")
        if messages and messages[0]["role"] == "system":
            return [{"role": "system", "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
        return [{"role": "system", "content": text}, *messages]

    def constraint(self, choices: Sequence[tuple[str, Mapping[str, Any]]], several: bool) -> dict[str, Any]:
        array: dict[str, Any] = {"type": "array", "items": _one_of(choices), "minItems": 1}
        if not several:
            array["maxItems"] = 1
        schema = {"type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"],
                  "additionalProperties": False}
        return {"json_schema": json.dumps(schema, ensure_ascii=False), "strict": False}

    def calls(self, text: str) -> list[RawCall] | None:
        try:
            value = json.loads(text)
        except ValueError:
            return None
        calls = value.get("tool_calls") if isinstance(value, dict) else None
        if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            return None
        return [(c.get("name"), c.get("arguments", {})) for c in calls]

    def may_be_a_call(self, text: str) -> bool:
        head = text.lstrip()
        return not head or head.startswith("{")


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(r"\s*<tool_call>\s*(.*?)\s*</tool_call>\s*", re.S)


class _HermesTags(ToolFormat):
    def call_turn(self, calls: Sequence[tuple[str, dict[str, Any]]], content: str) -> dict[str, Any]:
        return {"role": "assistant", "content": content,
                "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}
                               for name, args in calls]}

    def constraint(self, choices: Sequence[tuple[str, Mapping[str, Any]]], several: bool) -> dict[str, Any]:
        # Lark with an embedded JSON schema (llguidance's %json), in the layout every JSON answer here has.
        body = {**_one_of(choices), "x-guidance": _LAYOUT}
        start = 'start: call ("\\n" call)*' if several else "start: call"
        lark = (f'{start}\ncall: "{_OPEN}\\n" body "\\n{_CLOSE}"\n'
                f"body: %json {json.dumps(body, ensure_ascii=False)}\n")
        return {"grammar": lark}

    def calls(self, text: str) -> list[RawCall] | None:
        out, at = [], 0
        for match in _HERMES_BLOCK.finditer(text):
            if match.start() != at:
                return None
            at = match.end()
            try:
                value = json.loads(match.group(1))
            except ValueError:
                return None
            if not isinstance(value, dict):
                return None
            out.append((value.get("name"), value.get("arguments", {})))
        return out if at == len(text) and out else None

    def may_be_a_call(self, text: str) -> bool:
        head = text.lstrip()
        return head.startswith(_OPEN) or _OPEN.startswith(head)


JSON_CONVENTION: ToolFormat = _JsonConvention("json", native=False)
HERMES_TAGS: ToolFormat = _HermesTags("hermes", native=True)


@lru_cache(maxsize=8)
def tool_format_for(chat_template: str | None) -> ToolFormat:
    """The format for a model with this chat template (module docstring)."""
    if not chat_template or _OPEN not in chat_template:
        return JSON_CONVENTION
    try:
        variables = template_variables(chat_template)
    except jinja2.TemplateError:
        return JSON_CONVENTION
    return HERMES_TAGS if "tools" in variables else JSON_CONVENTION
