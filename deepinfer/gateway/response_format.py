"""OpenAI's `response_format` as the mesh's structured-output parameters (the client's `json_schema`, `json_object`,
`regex`, `grammar` keys: protocol.client_requests.constraint_of).

Accepted shapes:

* `{"type": "text"}` (or absent): no constraint.
* `{"type": "json_object"}`: any JSON object.
* `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": bool}}`: the schema; `strict`
  defaults to false, as OpenAI's does (keywords the grammar engine cannot enforce are then ignored; with true
  such a schema is refused).
* Our extensions: `{"type": "regex", "regex": "..."}` and `{"type": "grammar", "grammar": "<Lark>"}`.

The schema's own validity, and whether the grammar engine can compile it, is decided on the worker that
compiles it (an `invalid_request` with the reason, a 400 here); this module checks only the shapes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from deepinfer.gateway.errors import invalid

MAX_FORMAT_CHARS = 64 * 1024  # as SamplingParams.MAX_CONSTRAINT_CHARS


def response_format_params(fmt: Any) -> dict[str, Any]:
    """The client parameters for `fmt` (module docstring); raises ApiError (400) naming what is wrong."""
    if fmt is None:
        return {}
    if not isinstance(fmt, Mapping) or not isinstance(fmt.get("type"), str):
        raise invalid("response_format must be an object with a type", "response_format")
    kind = fmt["type"]
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema", {}), Mapping | bool):
            raise invalid("response_format.json_schema must be an object with a schema object", "response_format")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise invalid("response_format.json_schema.strict must be a boolean", "response_format")
        text = json.dumps(spec.get("schema", {}), ensure_ascii=False)
        return {"json_schema": _bounded(text), "strict": bool(strict)}
    if kind in ("regex", "grammar"):
        text = fmt.get(kind)
        if not isinstance(text, str) or not text:
            raise invalid(f"response_format of type {kind} needs a non-empty string {kind!r}", "response_format")
        return {kind: _bounded(text)}
    raise invalid(f"response_format type must be one of text, json_object, json_schema, regex, grammar; got "
                  f"{kind!r}", "response_format")


def _bounded(text: str) -> str:
    if len(text) > MAX_FORMAT_CHARS:
        raise invalid(f"response_format may carry at most {MAX_FORMAT_CHARS} characters of schema, regex or "
                      f"grammar (got {len(text)})", "response_format")
    return text
