"""Request bodies: read under a size limit (never more than the limit is held), then parsed as JSON that
fits what the gateway and the wire can carry: nesting at most `max_depth` deep, integers within 64 bits
(anything larger is no valid value of any field, and msgpack cannot carry it), no integer of more digits
than Python converts (its int-from-str limit raises ValueError), no string holding a lone surrogate (JSON's
`\ud800` escape: no UTF-8 encodes it, so neither the tokenizer nor the wire takes it). Every refusal is an
ApiError: 413 for the size, 400 for the rest, never a 500.
"""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.requests import Request

from deepinfer.gateway.errors import invalid, too_large

INT_MIN, INT_MAX = -(2**63), 2**64 - 1  # msgpack's integer range
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # how a surrogate gets into a JSON string


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body, refused with 413 as soon as its declared length or the bytes read pass `max_bytes`."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit() or len(declared) > 19:
            raise invalid(f"Content-Length {declared[:20]!r} is not a length", cause="invalid_json")
        if int(declared) > max_bytes:
            raise too_large(f"the body is {declared} bytes, over this server's limit of {max_bytes}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large(f"the body is over this server's limit of {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(raw: bytes, max_depth: int) -> Any:
    """`raw` as JSON, within `max_depth` and 64-bit integers; 400 otherwise. Pure: may run in a thread."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise invalid(f"the body nests deeper than {max_depth} levels", cause="invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of too many digits
        raise invalid(f"the body is not valid JSON: {str(exc)[:200]}", cause="invalid_json") from None
    check_value(value, max_depth, strings=_SURROGATE_ESCAPE.search(raw) is not None)
    return value


def check_value(value: Any, max_depth: int, strings: bool = False) -> None:
    """Refuses (400) a parsed body nested deeper than `max_depth` or holding an integer outside 64 bits (and,
    with `strings`, a string or key that is no valid Unicode). Iterative: a deep body cannot exhaust the
    stack here."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            items: Any = node.values()
            if strings:
                for key in node:
                    _check_string(key)
        elif isinstance(node, list):
            items = node
        else:
            _check_scalar(node)
            continue
        if depth > max_depth:
            raise invalid(f"the body nests deeper than {max_depth} levels", cause="invalid_json")
        for item in items:
            if isinstance(item, dict | list):
                stack.append((item, depth + 1))
            elif type(item) is int and not INT_MIN <= item <= INT_MAX:
                _check_scalar(item)
            elif strings and type(item) is str:
                _check_string(item)


def _check_scalar(node: Any) -> None:
    if type(node) is int and not INT_MIN <= node <= INT_MAX:
        raise invalid("an integer in the body is outside the 64-bit range", cause="invalid_json")
    if type(node) is str:
        _check_string(node)


def _check_string(s: str) -> None:
    try:
        s.encode()
    except UnicodeEncodeError:
        raise invalid("a string in the body holds a lone surrogate (no valid Unicode)", cause="invalid_json") \
            from None
