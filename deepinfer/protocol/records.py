"""Typed wire records: frozen dataclasses whose annotations are the wire schema.

`@record` makes a nested record (travels inside another); `@message(0x10)` also registers a top-level
message under a one-byte type id. Each record's annotations compile once (lazily, on first use, so that
forward references resolve) into a pair of functions:

* an encoder: record → plain msgpack-ready values (records become maps keyed by field name; custom wire
  types such as tensors are swapped for their wire record and may append out-of-band buffers). Scalars
  are passed through unchecked: the receiver is the authority, and senders are tested by round trips.
* a decoder: untrusted msgpack values → record, checking every value against its annotation. `bool` is not
  an `int`; ints must fit int64; `float` fields accept ints; unknown fields and missing required fields
  are refused. Anything else raises ProtocolError (the path to the field is attached on the way out).

Supported annotations: int, float, bool, str, bytes, None, `X | None`, `Literal[...]` of str or int,
list[X], tuple[X, ...], tuple[X, Y], dict[str, X], nested records, and registered wire types.
Schemas may not be recursive and nest at most MAX_SCHEMA_DEPTH levels, so decoded data is bounded in depth
by the schema itself (msgpack's own parser stops at 1024 levels before that).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, Union

import msgpack

from deepinfer.protocol.errors import ProtocolError

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MAX_SCHEMA_DEPTH = 16

T = TypeVar("T")

# (value, out-of-band buffers being collected) -> msgpack-ready value
Encoder = Callable[[Any, list], Any]
# (untrusted msgpack value, context) -> checked Python value
Decoder = Callable[[Any, "DecodeContext"], Any]


class DecodeContext:
    """Decoding state of one message: its buffer frames and which ones fields have claimed.
    Invariant after a successful decode: every buffer frame was claimed exactly once."""

    __slots__ = ("buffers", "_claimed")

    def __init__(self, buffers: Sequence[Any] = ()) -> None:
        self.buffers = buffers
        self._claimed = [False] * len(buffers)

    def claim(self, index: int) -> Any:
        if not 0 <= index < len(self.buffers):
            raise ProtocolError("bad_frames", f"buffer frame {index} does not exist ({len(self.buffers)} sent)")
        if self._claimed[index]:
            raise ProtocolError("bad_frames", f"buffer frame {index} is referenced twice")
        self._claimed[index] = True
        return self.buffers[index]

    def check_all_claimed(self) -> None:
        unclaimed = [i for i, c in enumerate(self._claimed) if not c]
        if unclaimed:
            raise ProtocolError("bad_frames", f"buffer frames {unclaimed[:8]} are not referenced by any field")


@dataclass(frozen=True)
class FieldSpec:
    name: str
    type: Any  # the resolved annotation
    required: bool  # no default: the decoder refuses a map without it


@dataclass(frozen=True)
class WireType:
    """A Python type that travels as a record plus out-of-band buffers (see tensors.py)."""

    wire: type  # the record class it is encoded as
    to_wire: Callable[[Any, list], Any]  # (value, buffers) -> wire record; may append to buffers
    from_wire: Callable[[Any, DecodeContext], Any]  # (checked wire record, context) -> value


@dataclass(frozen=True)
class _Schema:
    fields: tuple[FieldSpec, ...]
    encode: Encoder
    decode: Decoder
    depth: int


_RECORDS: set[type] = set()
_MESSAGES: dict[int, type] = {}
_TYPE_IDS: dict[type, int] = {}
_SCHEMAS: dict[type, _Schema] = {}
_WIRE_TYPES: dict[Any, WireType] = {}


def record(cls: type[T]) -> type[T]:
    """Declare a nested wire record (frozen, slotted dataclass)."""
    new = dataclass(frozen=True, slots=True)(cls)
    _RECORDS.add(new)
    return new


def message(type_id: int) -> Callable[[type[T]], type[T]]:
    """Declare a top-level message with a unique type id in 1..255 (0 is never a message)."""
    if not isinstance(type_id, int) or not 1 <= type_id <= 0xFF:
        raise ValueError(f"message type id must be in 1..255, got {type_id!r}")

    def register(cls: type[T]) -> type[T]:
        if type_id in _MESSAGES:
            raise ValueError(f"type id 0x{type_id:02x} of {cls.__name__} is taken by {_MESSAGES[type_id].__name__}")
        new = record(cls)
        _MESSAGES[type_id] = new
        _TYPE_IDS[new] = type_id
        return new

    return register


def register_wire_type(marker: Any, wire: type, to_wire: Callable, from_wire: Callable) -> None:
    """Let annotations name `marker`; values travel as the record `wire` (plus buffers)."""
    if wire not in _RECORDS:
        raise TypeError(f"{wire!r} is not a record")
    _WIRE_TYPES[marker] = WireType(wire, to_wire, from_wire)


def registered_messages() -> Mapping[int, type]:
    return types.MappingProxyType(_MESSAGES)


def message_class(type_id: int) -> type | None:
    return _MESSAGES.get(type_id)


def type_id_of(msg: Any) -> int:
    """The type id of a message class or instance; ProtocolError('unknown_type') for anything else."""
    cls = msg if isinstance(msg, type) else type(msg)
    try:
        return _TYPE_IDS[cls]
    except KeyError:
        raise ProtocolError("unknown_type", f"{cls.__name__} is not a registered message") from None


def is_record(tp: Any) -> bool:
    return isinstance(tp, type) and tp in _RECORDS


def fields_of(cls: type) -> tuple[FieldSpec, ...]:
    return _schema(cls).fields


def compile_all(module: str) -> None:
    """Compile the records declared in `module` now: a bad annotation fails at import, not at first use."""
    for cls in list(_RECORDS):
        if cls.__module__ == module:
            _schema(cls)


def encode_record(obj: Any, buffers: list) -> dict[str, Any]:
    return _schema(type(obj)).encode(obj, buffers)


def decode_record(cls: type[T], value: Any, ctx: DecodeContext) -> T:
    return _schema(cls).decode(value, ctx)


# --- compiling annotations --------------------------------------------------------------------------------


def _schema(cls: type, stack: tuple[type, ...] = ()) -> _Schema:
    schema = _SCHEMAS.get(cls)
    if schema is not None:
        return schema
    if cls not in _RECORDS:
        raise TypeError(f"{cls!r} is not a record")
    if cls in stack:
        raise TypeError(f"recursive record schema: {' -> '.join(c.__name__ for c in (*stack, cls))}")
    hints = typing.get_type_hints(cls)  # resolves string annotations in the class's module
    specs: list[FieldSpec] = []
    convs: list[tuple[str, Encoder | None, Decoder]] = []
    depth = 0
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        specs.append(FieldSpec(f.name, hints[f.name], required))
        try:
            enc, dec, d = _compile(hints[f.name], (*stack, cls))
        except TypeError as e:
            raise TypeError(f"{cls.__name__}.{f.name}: {e}") from None
        convs.append((f.name, enc, dec))
        depth = max(depth, d)
    depth += 1
    if depth > MAX_SCHEMA_DEPTH:
        raise TypeError(f"{cls.__name__} nests {depth} levels deep (max {MAX_SCHEMA_DEPTH})")
    schema = _Schema(tuple(specs), _record_encoder(cls, convs), _record_decoder(cls, convs, specs), depth)
    _SCHEMAS[cls] = schema
    return schema


def _record_encoder(cls: type, convs: list[tuple[str, Encoder | None, Decoder]]) -> Encoder:
    encs = [(name, enc) for name, enc, _ in convs]

    def encode(obj: Any, buffers: list) -> dict[str, Any]:
        if type(obj) is not cls:
            raise ProtocolError("bad_field", f"expected {cls.__name__}, got {type(obj).__name__}")
        out = {}
        for name, enc in encs:
            value = getattr(obj, name)
            if enc is None:
                out[name] = value
                continue
            try:
                out[name] = enc(value, buffers)
            except ProtocolError as e:
                e.path.append(name)
                raise
        return out

    return encode


def _record_decoder(cls: type, convs: list[tuple[str, Encoder | None, Decoder]], specs: list[FieldSpec]) -> Decoder:
    decs = {name: dec for name, _, dec in convs}
    required = frozenset(s.name for s in specs if s.required)

    def decode(value: Any, ctx: DecodeContext) -> Any:
        if type(value) is not dict:
            raise _mismatch(f"{cls.__name__} map", value)
        if not required.issubset(value):
            missing = sorted(required.difference(value))
            raise ProtocolError("bad_field", f"{cls.__name__} lacks required field(s) {missing}")
        kwargs = {}
        for key, item in value.items():
            dec = decs.get(key)
            if dec is None:
                raise ProtocolError("bad_field", f"{cls.__name__} has no field {key!r:.60}")
            try:
                kwargs[key] = dec(item, ctx)
            except ProtocolError as e:
                e.path.append(key)
                raise
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as e:  # a record's own __post_init__ invariant
            raise ProtocolError("bad_field", f"{cls.__name__}: {e}") from None

    return decode


def _compile(tp: Any, stack: tuple[type, ...]) -> tuple[Encoder | None, Decoder, int]:
    """(encoder or None when values are already msgpack-ready, decoder, nesting depth)."""
    if tp in _SCALARS:
        return None, _SCALARS[tp], 0
    if tp in _WIRE_TYPES:
        return _compile_wire_type(_WIRE_TYPES[tp], stack)
    if is_record(tp):
        schema = _schema(tp, stack)
        return schema.encode, schema.decode, schema.depth
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return None, _literal_decoder(args), 0
    if origin in (Union, types.UnionType):
        return _compile_optional(tp, args, stack)
    if origin is list and len(args) == 1:
        enc, dec, depth = _compile(args[0], stack)
        return _seq_encoder(enc), _list_decoder(args[0], dec), depth + 1
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        enc, dec, depth = _compile(args[0], stack)
        list_dec = _list_decoder(args[0], dec)
        return _seq_encoder(enc), lambda v, ctx: tuple(list_dec(v, ctx)), depth + 1
    if origin is tuple and args and Ellipsis not in args:
        return _compile_fixed_tuple(args, stack)
    if origin is dict and len(args) == 2:
        if args[0] is not str:
            raise TypeError(f"dict keys must be str, not {args[0]!r}")
        enc, dec, depth = _compile(args[1], stack)
        return _dict_encoder(enc), _dict_decoder(dec), depth + 1
    raise TypeError(f"unsupported wire type {tp!r}")


def _compile_wire_type(wt: WireType, stack: tuple[type, ...]) -> tuple[Encoder, Decoder, int]:
    schema = _schema(wt.wire, stack)
    to_wire, from_wire, rec_enc, rec_dec = wt.to_wire, wt.from_wire, schema.encode, schema.decode
    return (
        lambda v, bufs: rec_enc(to_wire(v, bufs), bufs),
        lambda v, ctx: from_wire(rec_dec(v, ctx), ctx),
        schema.depth,
    )


def _compile_optional(tp: Any, args: tuple, stack: tuple[type, ...]) -> tuple[Encoder | None, Decoder, int]:
    inner = [a for a in args if a is not type(None)]
    if len(args) != 2 or len(inner) != 1:
        raise TypeError(f"only `X | None` unions are supported, not {tp!r}")
    enc, dec, depth = _compile(inner[0], stack)
    encode = None if enc is None else (lambda v, bufs: None if v is None else enc(v, bufs))
    return encode, (lambda v, ctx: None if v is None else dec(v, ctx)), depth


def _compile_fixed_tuple(args: tuple, stack: tuple[type, ...]) -> tuple[Encoder | None, Decoder, int]:
    parts = [_compile(a, stack) for a in args]
    n = len(parts)
    encs = [p[0] for p in parts]
    decs = [p[1] for p in parts]

    def decode(v: Any, ctx: DecodeContext) -> tuple:
        if type(v) is not list or len(v) != n:
            raise _mismatch(f"array of {n}", v)
        out = []
        for i, (dec, item) in enumerate(zip(decs, v)):
            try:
                out.append(dec(item, ctx))
            except ProtocolError as e:
                e.path.append(f"[{i}]")
                raise
        return tuple(out)

    encode = None
    if any(e is not None for e in encs):
        encode = lambda v, bufs: [x if e is None else e(x, bufs) for e, x in zip(encs, v)]
    return encode, decode, max(p[2] for p in parts) + 1


# --- decoders ------------------------------------------------------------------------------------------------


def _describe(v: Any) -> str:
    if type(v) is int and not INT64_MIN <= v <= INT64_MAX:
        return "int outside int64"
    if type(v) in (list, dict, str, bytes):
        return f"{type(v).__name__} of length {len(v)}"
    return type(v).__name__


def _mismatch(expected: str, v: Any) -> ProtocolError:
    # msgpack decodes ext type -1 (timestamp) itself, never through ext_hook: refuse it here, where
    # it shows up as a value no annotation accepts.
    if isinstance(v, msgpack.Timestamp):
        return ProtocolError("bad_payload", "msgpack ext type -1 (timestamp) is refused")
    return ProtocolError("bad_field", f"expected {expected}, got {_describe(v)}")


def _dec_int(v: Any, ctx: DecodeContext) -> int:
    if type(v) is int and INT64_MIN <= v <= INT64_MAX:  # type() is exact: bool is refused
        return v
    raise _mismatch("int64", v)


def _dec_float(v: Any, ctx: DecodeContext) -> float:
    t = type(v)
    if t is float:
        return v
    if t is int:  # msgpack keeps integral numbers as ints; a float field accepts them
        return float(v)
    raise _mismatch("float", v)


def _exact(tp: type) -> Decoder:
    def dec(v: Any, ctx: DecodeContext) -> Any:
        if type(v) is tp:
            return v
        raise _mismatch(tp.__name__, v)

    return dec


def _dec_none(v: Any, ctx: DecodeContext) -> None:
    if v is None:
        return None
    raise _mismatch("nil", v)


_SCALARS: dict[Any, Decoder] = {
    int: _dec_int,
    float: _dec_float,
    bool: _exact(bool),
    str: _exact(str),
    bytes: _exact(bytes),
    type(None): _dec_none,
    None: _dec_none,
}


def _literal_decoder(values: tuple) -> Decoder:
    kinds = {type(v) for v in values}
    if kinds not in ({str}, {int}):
        raise TypeError(f"Literal values must all be str or all int, got {values!r}")
    kind = kinds.pop()
    allowed = frozenset(values)

    def dec(v: Any, ctx: DecodeContext) -> Any:
        if type(v) is not kind:
            raise _mismatch(f"one of {sorted(allowed)}", v)
        if v not in allowed:
            raise ProtocolError("bad_field", f"{v!r:.60} is not one of {sorted(allowed)}")
        return v

    return dec


def _list_decoder(item_tp: Any, item_dec: Decoder) -> Decoder:
    # Lists of scalars are checked at C speed first and walked one by one only to name the offending index:
    # token id lists are the bulk of most payloads. msgpack cannot encode an int below INT64_MIN, so only
    # the top of the range (uint64 values) needs checking.
    if item_tp in (int, str, bytes, bool):
        kind = {item_tp}
        is_int = item_tp is int

        def fast(v: Any, ctx: DecodeContext) -> list:
            if type(v) is not list:
                raise _mismatch("array", v)
            if v and (not kind.issuperset(map(type, v)) or (is_int and max(v) > INT64_MAX)):
                _walk(v, item_dec, ctx)
            return v

        return fast

    def dec(v: Any, ctx: DecodeContext) -> list:
        if type(v) is not list:
            raise _mismatch("array", v)
        return _walk(v, item_dec, ctx)

    return dec


def _walk(v: list, item_dec: Decoder, ctx: DecodeContext) -> list:
    out = []
    for i, item in enumerate(v):
        try:
            out.append(item_dec(item, ctx))
        except ProtocolError as e:
            e.path.append(f"[{i}]")
            raise
    return out


def _dict_decoder(value_dec: Decoder) -> Decoder:
    def dec(v: Any, ctx: DecodeContext) -> dict:
        if type(v) is not dict:
            raise _mismatch("map", v)
        out = {}
        for key, item in v.items():
            if type(key) is not str:  # strict_map_key still admits bytes keys
                raise ProtocolError("bad_field", f"map key {key!r:.60} is not a str")
            try:
                out[key] = value_dec(item, ctx)
            except ProtocolError as e:
                e.path.append(f"[{key!r:.60}]")
                raise
        return out

    return dec


# --- encoders ------------------------------------------------------------------------------------------------


def _seq_encoder(item_enc: Encoder | None) -> Encoder | None:
    if item_enc is None:
        return None  # msgpack packs lists and tuples as arrays as they are
    return lambda v, bufs: [item_enc(x, bufs) for x in v]


def _dict_encoder(value_enc: Encoder | None) -> Encoder | None:
    if value_enc is None:
        return None
    return lambda v, bufs: {k: value_enc(x, bufs) for k, x in v.items()}
