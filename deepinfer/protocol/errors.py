"""The one exception the wire layer raises for anything a peer sent (or we tried to send) that breaks the
contract. Services catch it per message: count it, log it with `peer`, answer with a typed error where a
reply is expected, and carry on."""

from __future__ import annotations

from typing import Literal

ProtocolErrorCode = Literal[
    "truncated",  # fewer frames or bytes than the header/layout promises
    "unknown_type",  # the type byte names no registered message
    "bad_payload",  # not msgpack, trailing bytes, invalid UTF-8, ext types, non-str map keys
    "bad_field",  # a field is unknown, missing, or of the wrong type / out of range
    "bad_frames",  # type frame malformed, buffer frames unreferenced, referenced twice or out of range
    "bad_tensor",  # a tensor's dtype/shape disagrees with its frame, or the tensor cannot be framed
    "too_large",  # a size or count limit (frames, payload, frame, total, str/bin/array/map length)
    "too_deep",  # nesting beyond the decoder's bound
    "unauthenticated",  # the sender's routing id is not one its CURVE key may claim (see protocol.auth)
]

ERROR_CODES: frozenset[str] = frozenset(ProtocolErrorCode.__args__)  # type: ignore[attr-defined]


class ProtocolError(Exception):
    """A message that breaks the wire contract.

    `code` is one of ERROR_CODES (machine-readable, stable); `detail` is for humans. `path` locates the
    offending field, innermost first while the error propagates out of nested records (it is reversed only
    when printed). `peer` is the sender's identity when the receiving socket knows it; `request_id` the
    refused message's request id when a bounded look could read it (see `framing.peek_request_id`).
    """

    def __init__(self, code: ProtocolErrorCode, detail: str) -> None:
        assert code in ERROR_CODES, code
        super().__init__(code, detail)
        self.code: ProtocolErrorCode = code
        self.detail = detail
        self.path: list[str] = []
        self.peer: bytes | None = None
        self.request_id: str | None = None

    @property
    def where(self) -> str:
        """The field path, e.g. `GenerateRequest.params.stop[2]`; empty when not inside a record."""
        out = ""
        for part in reversed(self.path):
            out += part if part.startswith("[") or not out else "." + part
        return out

    def __str__(self) -> str:
        where = self.where
        return f"{self.code}: {where}: {self.detail}" if where else f"{self.code}: {self.detail}"
