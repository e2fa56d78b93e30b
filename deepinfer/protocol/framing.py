"""Multipart framing: `[type byte] [msgpack payload] [buffer frames…]`.

On a ROUTER socket one identity frame precedes these (sockets.py strips and adds it; only single-hop
DEALER → ROUTER edges are used, so there is exactly one). The type byte is a frame of its own so a
PUB/SUB topic filter can select message types (`type_frame(Heartbeat)` is a valid subscription) and a
router can dispatch without touching the payload.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq

from deepinfer.protocol import codec
from deepinfer.protocol.errors import ProtocolError
from deepinfer.protocol.limits import DEFAULT_LIMITS, Limits
from deepinfer.protocol.records import message_class, type_id_of

# What a received frame may be: zmq.Frame with copy=False, bytes with copy=True, buffers in tests.
FrameLike = bytes | bytearray | memoryview | zmq.Frame
OutFrame = bytes | memoryview

_TYPE_FRAMES = [bytes((i,)) for i in range(256)]
# A refused message's request id is looked for in at most this many bytes of its payload, whatever its size.
PEEK_BYTES = 512
MAX_PEEKED_ID = 256  # bytes of a request id that a peek returns; a longer one is not taken


def type_frame(msg_or_cls: Any) -> bytes:
    """The one-byte first frame of a message type (also its PUB/SUB topic)."""
    return _TYPE_FRAMES[type_id_of(msg_or_cls)]


def encode_frames(msg: Any, limits: Limits = DEFAULT_LIMITS) -> list[OutFrame]:
    """The frames of `msg`, buffer frames zero-copy. Refuses ('too_large') what a peer would refuse."""
    enc = codec.encode(msg, limits)
    frames: list[OutFrame] = [_TYPE_FRAMES[enc.type_id], enc.payload, *enc.buffers]
    _check_sizes(frames, [memoryview(f).nbytes for f in frames], limits)
    return frames


def decode_frames(frames: Sequence[FrameLike], limits: Limits = DEFAULT_LIMITS) -> Any:
    """Decode one message from its frames (identity already removed). Any violation raises ProtocolError:
    'truncated' (fewer than 2 frames), 'too_large', 'bad_frames', 'unknown_type', or a codec error."""
    if len(frames) < 2:
        raise ProtocolError("truncated", f"{len(frames)} frame(s); a message has a type frame and a payload")
    try:
        views = [memoryview(f) for f in frames]
    except TypeError as e:
        raise ProtocolError("bad_frames", f"a frame is not a buffer: {e}") from None
    _check_sizes(views, [v.nbytes for v in views], limits)
    if views[0].nbytes != 1:
        raise ProtocolError("bad_frames", f"the type frame has {views[0].nbytes} bytes, not 1")
    type_id = bytes(views[0])[0]
    # Views keep their frames alive; tensors decoded from them keep the views alive.
    return codec.decode(type_id, views[1], views[2:], limits)


def _check_sizes(frames: Sequence[Any], sizes: list[int], limits: Limits) -> None:
    if len(frames) > limits.max_frames:
        raise ProtocolError("too_large", f"{len(frames)} frames (max {limits.max_frames})")
    if len(sizes) > 1 and sizes[1] > limits.max_payload:
        raise ProtocolError("too_large", f"payload is {sizes[1]} bytes (max {limits.max_payload})")
    largest = max(sizes)
    if largest > limits.max_frame:
        raise ProtocolError("too_large", f"a frame has {largest} bytes (max {limits.max_frame})")
    total = sum(sizes)
    if total > limits.max_total:
        raise ProtocolError("too_large", f"message has {total} bytes (max {limits.max_total})")


def peek_request_id(frames: Sequence[FrameLike]) -> str | None:
    """The request id of a message that failed to decode (too large, malformed further on), when a bounded
    look can read it: the type frame names a message whose first field is `request_id`, and the payload starts
    with a msgpack map whose first entry is "request_id" and a str of at most MAX_PEEKED_ID bytes (records
    encode their fields in order, so a well-behaved sender's id is there). Reads at most PEEK_BYTES of the
    payload; never raises (None when nothing can be read)."""
    try:
        if len(frames) < 2:
            return None
        type_frame, payload = memoryview(frames[0]), memoryview(frames[1])
        if type_frame.nbytes != 1:
            return None
        cls = message_class(bytes(type_frame)[0])
        if cls is None or not dataclasses.fields(cls) or dataclasses.fields(cls)[0].name != "request_id":
            return None
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=PEEK_BYTES,
                                    max_str_len=MAX_PEEKED_ID, max_bin_len=0, max_array_len=0, max_map_len=1 << 16,
                                    max_ext_len=0)
        unpacker.feed(bytes(payload[:PEEK_BYTES]))
        if unpacker.read_map_header() < 1 or unpacker.unpack() != "request_id":
            return None
        rid = unpacker.unpack()
    except Exception:  # anything unreadable within the bound: no id
        return None
    return rid if isinstance(rid, str) else None
