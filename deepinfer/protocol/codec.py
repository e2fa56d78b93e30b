"""msgpack encoding of registered messages, and the bounded, type-checked decoder.

`encode` turns a message into (type id, msgpack payload, out-of-band buffers); `decode` is its inverse for
untrusted input. The decoder never runs code chosen by the peer (no pickle, no eval, every msgpack ext type
refused), never allocates beyond `Limits`, and turns every failure into ProtocolError with a stable code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import msgpack

from deepinfer.protocol.errors import ProtocolError
from deepinfer.protocol.limits import DEFAULT_LIMITS, Limits
from deepinfer.protocol.records import DecodeContext, decode_record, encode_record, message_class, type_id_of


class Encoded(NamedTuple):
    type_id: int
    payload: bytes
    buffers: list[memoryview]  # out-of-band frames, in the order TensorRef.frame indexes them


def encode(msg: Any, limits: Limits = DEFAULT_LIMITS) -> Encoded:
    """Encode a registered message. Raises ProtocolError for unregistered types ('unknown_type'), values
    msgpack cannot carry ('bad_field', 'bad_tensor') and payloads over `limits.max_payload` ('too_large')."""
    type_id = type_id_of(msg)
    name = type(msg).__name__
    buffers: list[memoryview] = []
    try:
        payload = msgpack.packb(encode_record(msg, buffers), use_bin_type=True)
    except ProtocolError as e:
        e.path.append(name)
        raise
    except (TypeError, ValueError, OverflowError, AttributeError) as e:  # e.g. a numpy int, a 2**64, a str
        raise ProtocolError("bad_field", f"{name} cannot be encoded: {e}") from None
    if len(payload) > limits.max_payload:
        raise ProtocolError("too_large", f"{name} payload is {len(payload)} bytes (max {limits.max_payload})")
    return Encoded(type_id, payload, buffers)


def decode(type_id: int, payload: Any, buffers: Sequence[Any] = (), limits: Limits = DEFAULT_LIMITS) -> Any:
    """Decode and type-check one message from its type id, payload (a buffer) and buffer frames.
    Every buffer frame must be referenced exactly once by the message's tensor fields."""
    cls = message_class(type_id)
    if cls is None:
        raise ProtocolError("unknown_type", f"type byte 0x{type_id:02x} names no message")
    size = memoryview(payload).nbytes
    if size > limits.max_payload:
        raise ProtocolError("too_large", f"{cls.__name__} payload is {size} bytes (max {limits.max_payload})")
    value = unpack(payload, limits)
    ctx = DecodeContext(buffers)
    try:
        msg = decode_record(cls, value, ctx)
        ctx.check_all_claimed()
    except ProtocolError as e:
        e.path.append(cls.__name__)
        raise
    return msg


def unpack(payload: Any, limits: Limits = DEFAULT_LIMITS) -> Any:
    """msgpack → plain values, bounded by `limits`; no schema check yet."""
    try:
        return msgpack.unpackb(
            payload,
            raw=False,
            use_list=True,
            strict_map_key=True,
            ext_hook=_refuse_ext,
            max_str_len=limits.max_str_len,
            max_bin_len=limits.max_bin_len,
            max_array_len=limits.max_array_len,
            max_map_len=limits.max_map_len,
            # Bounded so a huge ext is refused cheaply; any ext that fits reaches _refuse_ext.
            max_ext_len=limits.max_bin_len,
        )
    except ProtocolError:
        raise
    except msgpack.StackError:
        raise ProtocolError("too_deep", "msgpack nesting exceeds the parser's stack") from None
    except msgpack.ExtraData:
        raise ProtocolError("bad_payload", "trailing bytes after the msgpack value") from None
    except msgpack.FormatError as e:
        raise ProtocolError("bad_payload", f"not msgpack: {e}") from None
    except UnicodeDecodeError:
        raise ProtocolError("bad_payload", "a str is not valid UTF-8") from None
    except ValueError as e:
        text = str(e)
        if "exceeds max_" in text:
            raise ProtocolError("too_large", text) from None
        if "incomplete input" in text:
            raise ProtocolError("truncated", "the payload ends inside a msgpack value") from None
        raise ProtocolError("bad_payload", text) from None
    except (TypeError, OverflowError) as e:  # msgpack documents "other exceptions"; none may escape
        raise ProtocolError("bad_payload", f"{type(e).__name__}: {e}") from None


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError("bad_payload", f"msgpack ext type {code} is refused")
