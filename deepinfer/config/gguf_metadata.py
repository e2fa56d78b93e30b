"""A GGUF file read as plain values: its metadata (the file format's counterpart of a Hugging Face
config.json, read by the model config in `deepinfer.loading` and by the tokenizer, whose vocabulary and
merges it holds) and its tensors' names, types, shapes and memory-mapped bytes.

Our own reader rather than `gguf.GGUFReader`: that one builds two numpy views per metadata string, and
a 49k-token vocabulary with its 48k merges took it ~3 s per open — paid by every worker and tokenizer
process of a mesh at start. Here the metadata is unpacked with `struct` straight from the mapping
(~0.1 s), and a tensor's data is a numpy view of the mapping, laid out as `gguf.GGUFReader` lays it
out (numbers as their dtype, quantized blocks as bytes per row). Little-endian files only (the only
kind llama.cpp writes by default); a byte-swapped file is refused with the reason.

The format (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): magic, version, tensor count,
metadata count; each metadata entry a key, a value type and a value (arrays carry an element type and
a count); then each tensor's name, dimensions, type and offset; then the tensors' data, aligned to
`general.alignment` (32 by default)."""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# Value types (GGUF spec): the scalar ones with their struct format.
_STRING, _ARRAY = 8, 9
_BOOL, _FLOAT32 = 7, 6
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}

# Tensor types stored as plain numbers; every other type is quantized blocks, exposed as bytes.
_PLAIN_TENSORS = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                  GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                  GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                  GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class GgufTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the fastest-varying dimension first (reversed from torch's)
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    # A read-only view of the mapping: numbers shaped as torch orders them, or quantized blocks as
    # uint8 [rows..., bytes per row].
    data: np.ndarray


class GgufFile:
    """A memory-mapped GGUF file: `fields` maps each metadata key to a plain value (str, int, float,
    bool, list[str], a numpy array of numbers, or a list of such for nested arrays); `tensors` lists
    the tensors in file order."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # an empty file cannot be mapped
                raise ValueError(f"{self.path} is not a GGUF file (it is empty)") from None
        self.fields: dict[str, Any] = {}
        self.tensors: list[GgufTensor] = []
        try:
            self._parse()
        except (struct.error, IndexError, UnicodeDecodeError) as e:
            raise ValueError(f"{self.path} is not a readable GGUF file: {e}") from None

    def _parse(self) -> None:
        mm = self._map
        if mm[:4] != _MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (no GGUF magic)")
        version = _U32.unpack_from(mm, 4)[0]
        if version & 0xFFFF == 0:
            raise ValueError(f"{self.path} is a big-endian GGUF file; only little-endian files are read")
        if version not in (2, 3):
            raise ValueError(f"{self.path} is GGUF version {version}; versions 2 and 3 are read")
        tensor_count, kv_count = struct.unpack_from("<QQ", mm, 8)
        self._offset = 24
        for _ in range(kv_count):
            key = self._string()
            if key in self.fields:
                raise ValueError(f"{self.path}: metadata key {key!r} appears twice")
            self.fields[key] = self._value(self._u32())
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = self.fields.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{self.path}: general.alignment {alignment!r} is not a power of two")
        start = -(-self._offset // alignment) * alignment
        names: set[str] = set()
        for name, dims, kind, offset in infos:
            if name in names:
                raise ValueError(f"{self.path}: tensor {name!r} appears twice")
            names.add(name)
            self.tensors.append(self._tensor(name, dims, kind, start + offset))

    def _u32(self) -> int:
        value = _U32.unpack_from(self._map, self._offset)[0]
        self._offset += 4
        return value

    def _u64(self) -> int:
        value = _U64.unpack_from(self._map, self._offset)[0]
        self._offset += 8
        return value

    def _string(self) -> str:
        n = self._u64()
        end = self._offset + n
        if end > len(self._map):
            raise IndexError("a string runs past the end of the file")
        text = self._map[self._offset : end].decode("utf-8")
        self._offset = end
        return text

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._u32(), self._u64()
            if item == _STRING:
                return [self._string() for _ in range(count)]
            if item == _ARRAY:
                return [self._value(_ARRAY) for _ in range(count)]
            if item not in _NUMPY:
                raise ValueError(f"{self.path}: unknown GGUF array element type {item}")
            values = np.frombuffer(self._map, dtype=_NUMPY[item], count=count, offset=self._offset).copy()
            self._offset += values.nbytes
            return values
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise ValueError(f"{self.path}: unknown GGUF value type {kind}")
        value = struct.unpack_from("<" + fmt, self._map, self._offset)[0]
        self._offset += struct.calcsize(fmt)
        if kind == _FLOAT32:
            # The shortest decimal that reads back as this float32 is what the converter was given
            # (1e-05, not 9.999999747378752e-06).
            return float(str(np.float32(value)))
        return value

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        dims = tuple(self._u64() for _ in range(self._u32()))
        return name, dims, self._u32(), self._u64()

    def _tensor(self, name: str, dims: tuple[int, ...], raw_type: int, offset: int) -> GgufTensor:
        try:
            kind = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(f"{self.path}: tensor {name!r} has unknown type {raw_type}") from None
        n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        block, type_size = GGML_QUANT_SIZES[kind]
        n_bytes = n_elements * type_size // block
        shape = tuple(reversed(dims))
        if kind in _PLAIN_TENSORS:
            dtype, count = _PLAIN_TENSORS[kind], n_elements
        else:
            dtype, count = np.uint8, n_bytes
            shape = (*shape[:-1], shape[-1] // block * type_size)
        if offset + n_bytes > len(self._map):
            raise ValueError(f"{self.path}: tensor {name!r} runs past the end of the file")
        data = np.frombuffer(self._map, dtype=dtype, count=count, offset=offset).reshape(shape)
        return GgufTensor(name, kind, dims, n_elements, n_bytes, offset, data)


def open_gguf(path: str | os.PathLike[str]) -> GgufFile:
    """Memory-map a GGUF file and read its metadata and tensor table."""
    return GgufFile(path)


def metadata(reader: GgufFile, key: str, default: Any = None) -> Any:
    """The metadata value at `key`, or `default` when the file has none."""
    return reader.fields.get(key, default)
