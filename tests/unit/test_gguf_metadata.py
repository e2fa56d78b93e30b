"""Our GGUF reader against the `gguf` package's own: every metadata value and every tensor (type,
shape, bytes, layout) equal on a file holding every value type, on a custom alignment and on the real
SmolLM2 file; damaged files are refused with a ValueError naming the file."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from deepinfer.config.gguf_metadata import open_gguf


def reference_value(field) -> object:
    """The gguf package's field as the plain value our reader gives."""
    kind = field.types[0]
    if kind == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    if kind == GGUFValueType.ARRAY:
        if field.types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return np.concatenate([field.parts[i] for i in field.data]) if field.data else None
    value = field.parts[field.data[0]][0]
    if kind == GGUFValueType.FLOAT32:
        return float(str(value))
    return bool(value) if kind == GGUFValueType.BOOL else value.item()


def assert_same_as_gguf_package(path: Path) -> None:
    ours, ref = open_gguf(path), GGUFReader(path)
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert list(ours.fields) == keys
    for key in keys:
        want, got = reference_value(ref.fields[key]), ours.fields[key]
        if isinstance(want, np.ndarray):
            assert got.dtype == want.dtype and np.array_equal(got, want), key
        elif want is None:  # an empty numeric array
            assert len(got) == 0, key
        else:
            assert type(got) is type(want) and got == want, key
    assert len(ours.tensors) == len(ref.tensors)
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert (a.name, a.tensor_type, a.shape) == (b.name, b.tensor_type, tuple(int(d) for d in b.shape))
        assert (a.n_elements, a.n_bytes, a.data_offset) == (b.n_elements, b.n_bytes, b.data_offset)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data), a.name


def write_every_kind(path: Path, alignment: int | None = None) -> None:
    w = GGUFWriter(path, "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float32("t.f32", 1e-5)
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ▁wörld")
    w.add_string("t.empty_str", "")
    w.add_array("t.strs", ["a", "", "Ġb", "日本"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.5])
    w.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 7)).astype(np.float16))
    w.add_tensor("i32", np.arange(6, dtype=np.int32))
    q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_and_tensor_layout_equal_the_gguf_package(tmp_path: Path, alignment: int | None) -> None:
    write_every_kind(tmp_path / "k.gguf", alignment)
    assert_same_as_gguf_package(tmp_path / "k.gguf")
    f = open_gguf(tmp_path / "k.gguf")
    assert f.fields["t.f32"] == 1e-05 and f.fields["t.strs"] == ["a", "", "Ġb", "日本"]
    q8 = next(t for t in f.tensors if t.name == "q8")
    assert q8.shape == (64, 4) and q8.data.shape == (4, 2 * 34)  # two Q8_0 blocks of 34 bytes per row


@pytest.mark.smollm2
def test_smollm2_equals_the_gguf_package(smollm2_path: Path) -> None:
    assert_same_as_gguf_package(smollm2_path)


def test_damaged_files_are_refused_with_their_name(tmp_path: Path) -> None:
    write_every_kind(tmp_path / "k.gguf")
    whole = (tmp_path / "k.gguf").read_bytes()
    cases = {
        "empty": b"",
        "magic": b"GGUX" + whole[4:],
        "big-endian": whole[:4] + (3).to_bytes(4, "big") + whole[8:],
        "version": whole[:4] + (9).to_bytes(4, "little") + whole[8:],
        "metadata cut": whole[:200],
        "tensor cut": whole[:-40],  # past the last tensor's padding (< 32 bytes)
    }
    for name, data in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(data)
        with pytest.raises(ValueError, match=str(path)):
            open_gguf(path)
