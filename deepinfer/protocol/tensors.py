"""Tensors as out-of-band buffer frames.

A record field annotated `Tensor` holds a `torch.Tensor` in Python. On the wire it is a `TensorRef` map in
the msgpack body — dtype name, shape, index of a buffer frame — and the raw bytes (row-major, little-endian)
travel in that buffer frame: never inside the msgpack body, never pickled.

Zero-copy both ways:

* sending — `tensor_to_frame` returns a memoryview of the tensor's own memory (a contiguous CPU tensor is
  not copied; any other tensor is first made a contiguous CPU copy). With `copy=False`, pyzmq holds a
  reference to that view (and through it the tensor's storage) until libzmq has sent the frame, so lifetime
  is safe; but libzmq reads the bytes when it sends, which may be after `send` returns. The sender must
  therefore not write into the tensor (e.g. reuse a staging buffer) until the send is done — pass
  `track=True` and wait on the tracker when it needs to.
* receiving — `frame_to_tensor` wraps the received frame's buffer with `torch.frombuffer`; the tensor keeps
  the frame alive and aliases it. Treat it as read-only input (copy it into the KV pool; a frame given as
  `bytes` is immutable memory). A frame whose address is not aligned to the element size (possible for
  tiny frames stored inside the zmq message) is copied once into aligned memory.

torch is imported lazily, inside the functions, so services that never touch tensors (the tokenizer,
the router, clients) do not pay for importing it.
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import TYPE_CHECKING, Any, Literal

from deepinfer.protocol.errors import ProtocolError
from deepinfer.protocol.records import DecodeContext, record, register_wire_type

if TYPE_CHECKING:
    import torch
    from torch import Tensor
else:

    class Tensor:
        """Annotation marker for tensor fields (torch.Tensor to type checkers); see the module docstring."""


if sys.byteorder != "little":  # frames carry native bytes; every supported host is little-endian
    raise ImportError("deepinfer.protocol.tensors assumes a little-endian host")

TensorDType = Literal["float32", "float16", "bfloat16", "int32", "int64", "uint8"]
TENSOR_DTYPES: tuple[str, ...] = TensorDType.__args__  # type: ignore[attr-defined]
MAX_NDIM = 8


@record
class TensorRef:
    """Wire form of a tensor: the dtype (from the allow-list), the shape, and which buffer frame
    (0-based, counting frames after the payload) holds its bytes."""

    dtype: TensorDType
    shape: tuple[int, ...]
    frame: int


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


def tensor_to_frame(t: torch.Tensor, frame: int = 0) -> tuple[TensorRef, memoryview]:
    """The TensorRef describing `t` as buffer frame `frame`, and a view of its bytes (zero-copy for a
    contiguous CPU tensor). The caller must not write into `t` until the frame is sent."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise ProtocolError("bad_tensor", f"expected a torch.Tensor, got {type(t).__name__}")
    name = str(t.dtype).removeprefix("torch.")
    if name not in TENSOR_DTYPES:
        raise ProtocolError("bad_tensor", f"dtype {name} is not one of {list(TENSOR_DTYPES)}")
    if t.dim() > MAX_NDIM:
        raise ProtocolError("bad_tensor", f"{t.dim()} dimensions (max {MAX_NDIM})")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()  # the one unavoidable device→host copy for a ZeroMQ transport
    t = t.contiguous()  # returns `t` itself when already contiguous
    try:
        # numpy() shares memory and the array keeps a reference to `flat` (hence to the storage).
        view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
    except (RuntimeError, TypeError) as e:
        raise ProtocolError("bad_tensor", f"cannot frame tensor: {e}") from None
    return TensorRef(name, tuple(t.shape), frame), view


def frame_to_tensor(ref: TensorRef, frame: Any) -> torch.Tensor:
    """The tensor `ref` describes, aliasing `frame` (bytes, bytearray, memoryview or zmq.Frame).
    Raises ProtocolError('bad_tensor') when the frame's size disagrees with dtype × shape."""
    import torch

    if ref.dtype not in TENSOR_DTYPES:
        raise ProtocolError("bad_tensor", f"dtype {ref.dtype!r:.40} is not one of {list(TENSOR_DTYPES)}")
    shape = tuple(ref.shape)
    if len(shape) > MAX_NDIM or any(d < 0 for d in shape):
        raise ProtocolError("bad_tensor", f"invalid shape {list(shape)[: MAX_NDIM + 1]}")
    dtype = _torch_dtype(ref.dtype)
    try:
        view = memoryview(frame)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
    except TypeError as e:
        raise ProtocolError("bad_tensor", f"frame is not a contiguous buffer: {e}") from None
    need = math.prod(shape) * dtype.itemsize
    if view.nbytes != need:
        raise ProtocolError("bad_tensor", f"frame has {view.nbytes} bytes, {ref.dtype}{list(shape)} needs {need}")
    try:
        return _wrap(view, dtype, shape) if need else torch.empty(shape, dtype=dtype)
    except RuntimeError as e:  # e.g. an empty shape whose other dimensions overflow torch's strides
        raise ProtocolError("bad_tensor", f"{ref.dtype}{list(shape)}: {e}") from None


def _wrap(view: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    import torch

    if view.readonly:
        # torch warns that it cannot stop writes to immutable memory; the documented contract is read-only.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(view, dtype=torch.uint8)
    else:
        raw = torch.frombuffer(view, dtype=torch.uint8)
    if raw.data_ptr() % dtype.itemsize:
        raw = raw.clone()  # misaligned frame: one copy into aligned memory
    return raw.view(dtype).view(shape)


def _to_wire(t: Any, buffers: list) -> TensorRef:
    ref, view = tensor_to_frame(t, len(buffers))
    buffers.append(view)
    return ref


def _from_wire(ref: TensorRef, ctx: DecodeContext) -> torch.Tensor:
    return frame_to_tensor(ref, ctx.claim(ref.frame))


register_wire_type(Tensor, TensorRef, _to_wire, _from_wire)
