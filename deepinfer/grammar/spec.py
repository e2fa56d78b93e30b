"""What a request asks its output to match, as a value: the kind of constraint and its text.

A `ConstraintSpec` is what travels with a request (wire, migration, P/D handoff) and what the compile cache is
keyed by; it holds no compiled state, so it is cheap to copy and compare.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["json_schema", "json_object", "regex", "grammar"]

# The one layout of every constrained JSON answer: `{"a": 1, "b": [2, 3]}` (llguidance's JSON overrides; a schema
# embedded in a grammar carries it as "x-guidance"). Flexible whitespace would let a model emit whitespace without
# end (small models do), and one layout keeps outputs for a schema comparable across runs and engines.
JSON_LAYOUT: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS: tuple[Kind, ...] = ("json_schema", "json_object", "regex", "grammar")


class GrammarError(ValueError):
    """A constraint that cannot be used: malformed text, a schema or grammar the engine rejects, a compile that
    failed or ran out of time. `reason` is meant for the client (the gateway answers 400 with it)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ConstraintSpec:
    """One output constraint.

    * `json_schema`: `text` is a JSON Schema (a JSON object or boolean). `strict=True`: every keyword that
      constrains output must be enforced, so a schema with a keyword the engine cannot enforce (`if`/`then`,
      say) is a `GrammarError`; `strict=False`: such keywords are ignored and the output matches the rest.
    * `json_object`: any JSON object; `text` must be empty.
    * `regex`: `text` is a regular expression (Rust `regex` syntax) the whole output must match.
    * `grammar`: `text` is a Lark grammar as llguidance accepts it (a GBNF grammar is converted).

    `strict` only means something for `json_schema`; `digest` ignores it for the other kinds.
    """

    kind: Kind
    text: str = ""
    strict: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"unknown constraint kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        if not isinstance(self.text, str):
            raise GrammarError(f"constraint text must be a string, not {type(self.text).__name__}")
        if self.kind == "json_object" and self.text:
            raise GrammarError("a json_object constraint takes no text")
        if self.kind in ("regex", "grammar") and not self.text:
            raise GrammarError(f"a {self.kind} constraint needs a non-empty text")

    @classmethod
    def json_schema(cls, schema: str | Mapping[str, Any] | bool, *, strict: bool = True) -> ConstraintSpec:
        text = schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False)
        return cls("json_schema", text, strict)

    @classmethod
    def json_object(cls) -> ConstraintSpec:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> ConstraintSpec:
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, lark: str) -> ConstraintSpec:
        return cls("grammar", lark)

    def canonical_text(self) -> str:
        """The text in the form that is hashed and compiled.

        A schema is re-serialised without insignificant whitespace, but with its keys in their original order:
        the order of `properties` decides the order fields are generated in, so two schemas differing only in key
        order are different constraints. Regexes and grammars are taken verbatim (whitespace in them can matter).
        Raises GrammarError for a schema that is not JSON.
        """
        if self.kind != "json_schema":
            return self.text
        try:
            schema = json.loads(self.text)
        except json.JSONDecodeError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise GrammarError(f"a JSON schema must be an object or a boolean, not {type(schema).__name__}")
        return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))

    def digest(self) -> str:
        """sha256 hex of kind, strictness and canonical text: equal digests compile to the same grammar."""
        strict = self.strict if self.kind == "json_schema" else True
        h = hashlib.sha256(f"{self.kind}\0{int(strict)}\0".encode())
        h.update(self.canonical_text().encode())
        return h.hexdigest()
