"""Test support: hypothesis strategies derived from record annotations, and an equality that understands
tensors. Needs the `hypothesis` package (the `test` extra); nothing in the services imports this module."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal, Union

import torch
from hypothesis import strategies as st

from deepinfer.protocol.records import INT64_MAX, INT64_MIN, fields_of, is_record
from deepinfer.protocol.tensors import MAX_NDIM, TENSOR_DTYPES, Tensor


def strategy_for(tp: Any, *, max_len: int = 4) -> st.SearchStrategy[Any]:
    """Values of annotation `tp` that the codec must round-trip exactly (floats exclude NaN only because
    NaN != NaN; the codec carries it)."""
    if tp is int:
        return st.integers(INT64_MIN, INT64_MAX)
    if tp is float:
        return st.floats(allow_nan=False)
    if tp is bool:
        return st.booleans()
    if tp is str:
        return st.text(max_size=12)
    if tp is bytes:
        return st.binary(max_size=40)
    if tp is None or tp is type(None):
        return st.none()
    if tp is Tensor:
        return tensors()
    if is_record(tp):
        return st.builds(tp, **{f.name: strategy_for(f.type, max_len=max_len) for f in fields_of(tp)})
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return st.sampled_from(args)
    if origin in (Union, types.UnionType):
        return st.one_of([strategy_for(a, max_len=max_len) for a in args])
    if origin is list:
        return st.lists(strategy_for(args[0], max_len=max_len), max_size=max_len)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return st.lists(strategy_for(args[0], max_len=max_len), max_size=max_len).map(tuple)
    if origin is tuple:
        return st.tuples(*(strategy_for(a, max_len=max_len) for a in args))
    if origin is dict:
        return st.dictionaries(st.text(max_size=8), strategy_for(args[1], max_len=max_len), max_size=max_len)
    raise TypeError(f"no strategy for {tp!r}")


@st.composite
def tensors(draw: st.DrawFn, max_dim: int = 5) -> Any:
    """Small tensors of every allowed dtype with arbitrary bytes (NaN bit patterns included)."""
    dtype = getattr(torch, draw(st.sampled_from(TENSOR_DTYPES)))
    shape = draw(st.lists(st.integers(0, max_dim), max_size=min(3, MAX_NDIM)))
    data = draw(st.binary(min_size=math.prod(shape) * dtype.itemsize, max_size=math.prod(shape) * dtype.itemsize))
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape).clone()


def same(a: Any, b: Any) -> bool:
    """Deep equality with exact types (True is not 1) and tensors compared by dtype, shape and bytes."""
    if type(a) is not type(b):
        return False
    if dataclasses.is_dataclass(a):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and _raw(a) == _raw(b)
    return a == b


def _raw(t: torch.Tensor) -> bytes:
    return bytes(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
