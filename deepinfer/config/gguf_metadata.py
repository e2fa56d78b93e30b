"""A GGUF file's metadata as plain Python values: the file format's counterpart of a Hugging Face
config.json, read by the model config (`deepinfer.loading.gguf`) and by the tokenizer (its vocabulary
and merges) alike. Tensors are read in `deepinfer.loading`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, ReaderField


def open_gguf(path: str | os.PathLike[str]) -> GGUFReader:
    """Memory-map a GGUF file for reading."""
    return GGUFReader(Path(path), "r")


def field_value(field: ReaderField) -> Any:
    """A metadata value as plain Python: str, int, float, bool, list[str] or a numpy array of numbers."""
    kind = field.types[0]
    if kind == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    if kind == GGUFValueType.ARRAY:
        if field.types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        if not field.data:
            return np.zeros(0)
        return np.concatenate([field.parts[i] for i in field.data])
    value = field.parts[field.data[0]][0]
    if kind == GGUFValueType.FLOAT32:
        # The shortest decimal that reads back as this float32 is what the converter was given
        # (1e-05, not 9.999999747378752e-06).
        return float(str(value))
    return bool(value) if kind == GGUFValueType.BOOL else value.item()


def metadata(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field_value(field)
