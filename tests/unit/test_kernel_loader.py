"""build.KernelLoader, the build-once-and-load mechanism both native kernels use: one build under a lock,
fallback flag sets with one warning, what `info()` reports, and a failure kept as the reason and logged
once."""

from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path

import pytest

from deepinfer.kernels import build

SOURCE = """
int tl_has_avx2(void) { return 0; }
#ifdef _OPENMP
int tl_has_openmp(void) { return 1; }
#else
int tl_has_openmp(void) { return 0; }
#endif
int tl_answer(void) { return 42; }
"""
needs_compiler = pytest.mark.skipif(build.find_compiler() is None, reason="no C compiler")
log = logging.getLogger("test_kernel_loader")


def _load(path: Path) -> tuple[ctypes.CDLL, dict[str, object]]:
    lib = build.dlopen_checked(path)
    return lib, {"answer": lib.tl_answer}


@pytest.fixture
def source(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tl.c"
    path.write_text(SOURCE)
    return path


def loader(source: Path, load=_load) -> build.KernelLoader:  # type: ignore[no-untyped-def]
    return build.KernelLoader(source, "tl", "test kernel", load, probe_prefix="tl", log=log, simd=())


@needs_compiler
def test_builds_once_loads_and_reports(source):
    k = loader(source)
    assert k.info() is None and k.unavailable_reason() is None and not k.fns
    builds: list[list[str]] = []
    real = k.build_one
    k.build_one = lambda compiler, flags: builds.append(flags) or real(compiler, flags)  # type: ignore[method-assign]
    threads = [threading.Thread(target=k.available) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and k.available() and len(builds) == 1
    assert k.fns["answer"]() == 42
    info = k.info()
    assert info is not None and info["flags"] == builds[0] and info["avx2"] is False
    assert info["openmp"] == ("-fopenmp" in builds[0])
    assert Path(str(info["path"])).parent == source.parent / "cache" / "kernels"
    assert k.unavailable_reason() is None


@needs_compiler
def test_reduced_flags_are_used_with_one_warning(source, caplog):
    k = loader(source)
    real = k.build_one

    def no_openmp(compiler: str, flags: list[str]) -> Path:
        if "-fopenmp" in flags:
            raise RuntimeError("gcc: error: unrecognized command-line option '-fopenmp'")
        return real(compiler, flags)

    k.build_one = no_openmp  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger=log.name):
        assert k.available()
    [warning] = [r.getMessage() for r in caplog.records]
    assert "test kernel built with reduced flags" in warning and "-fopenmp" in warning
    assert k.info()["openmp"] is False and "-fopenmp" not in k.info()["flags"]  # type: ignore[index]


def test_failure_is_kept_and_logged_once(source, caplog, monkeypatch):
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    k = loader(source)
    with caplog.at_level(logging.WARNING, logger=log.name):
        assert not k.available() and not k.available()
    assert k.info() is None and not k.fns
    assert "RuntimeError" in (k.unavailable_reason() or "") and "failed" in (k.unavailable_reason() or "")
    assert [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()] == [
        f"native test kernel unavailable, using the torch fallback: {k.unavailable_reason()}"]


@needs_compiler
def test_a_load_that_refuses_the_library_leaves_it_unloaded(source):
    def refuse(path: Path) -> tuple[ctypes.CDLL, dict[str, object]]:
        raise RuntimeError(f"{path} was built for another wrapper")

    k = loader(source, refuse)
    assert not k.available() and k.lib is None and not k.fns
    assert "built for another wrapper" in (k.unavailable_reason() or "")


def test_the_build_key_covers_local_headers(tmp_path: Path) -> None:
    """A kernel that includes a header of its own directory (dense_tiles.h) must rebuild when only the header
    changes: the header's bytes are part of the cached library's name; system headers are not read."""
    src, header = tmp_path / "k.c", tmp_path / "tiles.h"
    src.write_text('#include <stdint.h>\n#include "tiles.h"\nint tl_answer(void) { return TILE; }\n')
    header.write_text("#define TILE 42\n")
    first = build.lib_name(src, "k", "gcc", ["-O3"])
    assert build.lib_name(src, "k", "gcc", ["-O3"]) == first
    header.write_text("#define TILE 43\n")
    assert build.lib_name(src, "k", "gcc", ["-O3"]) != first
    assert b"#define TILE 43" in build.source_bytes(src)
    # The shipped kernels: the dense and quantized linear sources both carry the shared tiles.
    kernels = Path(build.__file__).parent
    for name in ("dense_linear.c", "quant_linear.c"):
        assert (kernels / "dense_tiles.h").read_bytes() in build.source_bytes(kernels / name)


def test_the_build_key_covers_headers_included_by_headers(tmp_path: Path) -> None:
    """quant_linear.c includes quant_amx.h, which includes amx_common.h: an edit two levels down rebuilds too;
    a header included twice, or a cycle, is read once."""
    src = tmp_path / "k.c"
    src.write_text('#include "outer.h"\n#include "inner.h"\nint tl_answer(void) { return INNER; }\n')
    (tmp_path / "outer.h").write_text('#include "inner.h"\n')
    (tmp_path / "inner.h").write_text('#include "outer.h"\n#define INNER 1\n')
    first = build.lib_name(src, "k", "gcc", ["-O3"])
    (tmp_path / "inner.h").write_text('#include "outer.h"\n#define INNER 2\n')
    assert build.lib_name(src, "k", "gcc", ["-O3"]) != first
    assert build.source_bytes(src).count(b"#define INNER 2") == 1
    kernels = Path(build.__file__).parent
    common = (kernels / "amx_common.h").read_bytes()
    for name in ("quant_linear.c", "attention_amx.c"):
        assert common in build.source_bytes(kernels / name)
