"""Topology tables ⇄ frozen dataclasses: checked reading, and TOML writing.

Every section of a topology file is one dataclass (deepinfer.launch.topology). Reading a table refuses an
unknown key and a value of the wrong type, naming the key, before the dataclass exists (a typo in the file
fails when the file is read, not when the service it configures starts). Writing emits the fields that
differ from their defaults as valid TOML (strings escaped, mappings as nested tables), so a file written
here reads back to an equal value.

The types understood are those the sections use: bool, int, float, str, None in a union, Mapping[str, X],
tuple[X, ...] and dataclasses (checked by isinstance; their own fields are checked where they are built).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_MISSING = dataclasses.MISSING


class TopologyError(ValueError):
    """A topology that cannot run; the message names the file, the entry and the key."""


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _describe(tp: Any) -> str:
    """What a value of type `tp` looks like in a TOML file (None has no TOML form: it is left out)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp) if a is not type(None))
    if origin is not None and issubclass(origin, Mapping):
        return f"a table with {_describe(typing.get_args(tp)[1])} as each value"
    if origin is tuple:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(tp, f"a {getattr(tp, '__name__', tp)}")


def _conforms(value: Any, tp: Any) -> bool:
    if tp is Any:
        return True
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:  # bool is an int to Python, never to a topology
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:  # TOML writes 3 for 3.0
        return isinstance(value, int | float) and not isinstance(value, bool)
    if origin is not None and issubclass(origin, Mapping):
        _, value_type = typing.get_args(tp)
        return isinstance(value, Mapping) and all(isinstance(k, str) and _conforms(v, value_type)
                                                  for k, v in value.items())
    if origin is tuple:
        return isinstance(value, tuple) and all(_conforms(v, typing.get_args(tp)[0]) for v in value)
    return isinstance(value, tp)


def field_problem(cls: type, key: str, value: Any) -> str | None:
    """Why `value` cannot be field `key` of dataclass `cls`, naming the key; None when it can."""
    tp = _hints(cls)[key]
    if _conforms(value, tp):
        return None
    return f"{key} = {value!r}: must be {_describe(tp)}"


def check_fields(obj: Any) -> None:
    """Refuse a dataclass instance built in Python with a field of the wrong type (what `from_table`
    refuses in a file): the topology tree is checked however it was made."""
    for f in dataclasses.fields(obj):
        problem = field_problem(type(obj), f.name, getattr(obj, f.name))
        if problem is not None:
            raise TopologyError(problem)


def from_table(cls: type[T], table: Any, refused: Mapping[str, str] | None = None) -> T:
    """Build dataclass `cls` from a TOML table. Unknown keys, keys in `refused` (key → why it is not
    allowed here), missing required keys and values of the wrong type raise TopologyError naming the key;
    so does a ValueError from the dataclass's own checks."""
    if not isinstance(table, Mapping):
        raise TopologyError(f"must be a table, got {table!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for key in table:
        if refused and key in refused:
            raise TopologyError(f"{key}: {refused[key]}")
        if key not in fields:
            known = ", ".join(k for k in fields if k not in (refused or {}))
            raise TopologyError(f"unknown key {key!r} (known: {known})")
    for name, f in fields.items():
        if name not in table and f.default is _MISSING and f.default_factory is _MISSING:
            raise TopologyError(f"missing key {name!r}")
    values = {}
    for key, value in table.items():
        if typing.get_origin(_hints(cls)[key]) is tuple and isinstance(value, list):
            value = tuple(value)  # a TOML array, for a field that holds a fixed sequence
        problem = field_problem(cls, key, value)
        if problem is not None:
            raise TopologyError(problem)
        values[key] = float(value) if _hints(cls)[key] in (float, float | None) and isinstance(value, int) else value
    try:
        return cls(**values)
    except ValueError as exc:  # the dataclass's own checks (bounds, one of several names)
        raise TopologyError(str(exc)) from exc


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not _MISSING:
        return f.default
    if f.default_factory is not _MISSING:
        return f.default_factory()
    return _MISSING


def toml_string(text: str) -> str:
    """A TOML basic string: quote, backslash and the control characters escaped (TOML forbids them raw)."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else toml_string(key)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):  # repr is valid TOML for finite values; TOML spells the others inf, nan
        if math.isfinite(value):
            return repr(value)
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TopologyError(f"{value!r} has no TOML form here")


def toml_table(header: str, obj: Any, skip: tuple[str, ...] = (), array: bool = False,
               first: Mapping[str, Any] | None = None) -> list[str]:
    """`[header]` (`[[header]]` with `array`), the keys in `first`, then obj's fields that are required or
    differ from their defaults, except `skip`; a mapping field becomes the nested table `[header.field]`
    after the plain keys. A None where the default is not None has no TOML form: TopologyError."""
    lines = ["", f"[[{header}]]" if array else f"[{header}]"]
    lines += [f"{toml_key(k)} = {toml_value(v)}" for k, v in (first or {}).items()]
    nested: list[str] = []
    for f in dataclasses.fields(obj):
        value, default = getattr(obj, f.name), _default(f)
        if f.name in skip or (default is not _MISSING and value == default):
            continue
        if value is None:
            raise TopologyError(f"{header}: {f.name} = None cannot be written (TOML has no null)")
        if isinstance(value, Mapping):
            nested += ["", f"[{header}.{f.name}]"] + [f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()]
        else:
            lines.append(f"{f.name} = {toml_value(value)}")
    return lines + nested
