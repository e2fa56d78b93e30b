"""The compiled paged-attention kernel is only loaded from a directory and file this user owns and
nobody else can write; anything else is refused (rebuilt in a fresh private directory, or the
torch path). Builds are atomic, so concurrent builders never load a partial library."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from deepinfer.kernels import build
from deepinfer.kernels import paged_attention as pa

COMPILER = pa._find_compiler()
needs_compiler = pytest.mark.skipif(COMPILER is None, reason="no C compiler")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
# Plain C, serial: the quickest build; these tests are about where it goes, not how fast it is.
FLAGS = pa._compile_flags(openmp=False, simd=False)


@pytest.fixture
def cache(monkeypatch, tmp_path) -> Path:
    """$DEEPINFER_CACHE_DIR under tmp_path, and a fresh-private-dir fallback there too."""
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setattr(build, "_fresh_dir", None)  # the per-process fallback dir lives in build.py
    return tmp_path / "cache" / "kernels"


@pytest.fixture(scope="module")
def built_once(tmp_path_factory) -> Path:
    """One real build with FLAGS, made once for the module."""
    target = tmp_path_factory.mktemp("built-once") / pa._lib_name(COMPILER, FLAGS)
    build.compile_source(pa._SOURCE, COMPILER, FLAGS, target)
    return target


@pytest.fixture
def copy_for_compile(monkeypatch, built_once) -> None:
    """Every compile of the kernel with FLAGS writes a copy of `built_once`, through a temporary and a rename as a
    compile does: the tests using it are about where builds go and what is refused, and compiling the same source
    a dozen times taught them nothing (the real compile, and its atomic rename, are tested beside them)."""
    def copy(source: Path, compiler: str, flags: list[str], target: Path) -> None:
        assert (source, compiler, flags) == (pa._SOURCE, COMPILER, FLAGS)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.stem}-", suffix=".so.tmp", dir=target.parent)
        os.close(fd)
        shutil.copyfile(built_once, tmp)
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)

    monkeypatch.setattr(build, "compile_source", copy)


def _assert_private_dir(path: Path) -> None:
    st = os.lstat(path)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700


def _assert_refused_and_rebuilt(path: Path, cache: Path, caplog, why: str) -> None:
    """`path` came from a build that refused the cache: it lies in a fresh 0700 dir and loads."""
    assert path.parent != cache and path.parent.parent == Path(tempfile.gettempdir())
    _assert_private_dir(path.parent)
    assert any("refusing kernel cache" in r.getMessage() and why in r.getMessage() for r in caplog.records)
    lib, _ = pa._load(path)
    assert lib.pa_num_params() == pa._NUM_PARAMS


def _build_elsewhere(tmp_path: Path) -> Path:
    """A valid build outside the cache (to plant in it)."""
    other = tmp_path / "elsewhere"
    other.mkdir(mode=0o700)
    target = other / pa._lib_name(COMPILER, FLAGS)
    pa._compile(COMPILER, FLAGS, target)
    return target


@needs_compiler
def test_normal_build_is_private_and_loads(cache, caplog):
    with caplog.at_level(logging.WARNING, logger=pa.__name__):
        path = pa._build(COMPILER, FLAGS)
    assert path.parent == cache and not caplog.records
    _assert_private_dir(cache)
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022
    assert [p.name for p in cache.iterdir()] == [path.name]  # no temporary left behind
    lib, _ = pa._load(path)
    assert lib.pa_num_params() == pa._NUM_PARAMS
    assert pa._build(COMPILER, FLAGS) == path  # reused


@needs_compiler
@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770])
def test_group_or_world_writable_cache_dir_is_refused(copy_for_compile, cache, caplog, mode):
    cache.mkdir(parents=True)
    cache.chmod(mode)
    with caplog.at_level(logging.WARNING, logger=pa.__name__):
        path = pa._build(COMPILER, FLAGS)
    _assert_refused_and_rebuilt(path, cache, caplog, "group/world-writable")
    assert not list(cache.iterdir())
    # A library already there is not loaded either.
    planted = cache / path.name
    planted.write_bytes(path.read_bytes())
    planted.chmod(0o755)
    with pytest.raises(pa.UnsafeKernelPath, match="group/world-writable"):
        pa._load(planted)


@needs_compiler
def test_group_writable_library_is_refused(copy_for_compile, cache, caplog):
    good = pa._build(COMPILER, FLAGS)
    good.chmod(0o775)
    with caplog.at_level(logging.WARNING, logger=pa.__name__):
        path = pa._build(COMPILER, FLAGS)
    _assert_refused_and_rebuilt(path, cache, caplog, "group/world-writable")
    with pytest.raises(pa.UnsafeKernelPath, match="group/world-writable"):
        pa._load(good)


@needs_compiler
@needs_root
def test_library_owned_by_another_uid_is_refused(copy_for_compile, cache, caplog):
    foreign = pa._build(COMPILER, FLAGS)
    os.chown(foreign, 65534, 65534)
    with caplog.at_level(logging.WARNING, logger=pa.__name__):
        path = pa._build(COMPILER, FLAGS)
    _assert_refused_and_rebuilt(path, cache, caplog, "owned by uid 65534")
    with pytest.raises(pa.UnsafeKernelPath, match="owned by uid 65534"):
        pa._load(foreign)


@needs_compiler
@needs_root
def test_cache_dir_owned_by_another_uid_is_refused(copy_for_compile, cache, caplog):
    cache.mkdir(parents=True, mode=0o700)
    os.chown(cache, 65534, 65534)
    with caplog.at_level(logging.WARNING, logger=pa.__name__):
        path = pa._build(COMPILER, FLAGS)
    _assert_refused_and_rebuilt(path, cache, caplog, "owned by uid 65534")
    assert not list(cache.iterdir())


@needs_compiler
def test_symlinked_library_is_refused(copy_for_compile, cache, caplog, tmp_path):
    real = _build_elsewhere(tmp_path)
    cache.mkdir(parents=True, mode=0o700)
    link = cache / real.name
    link.symlink_to(real)
    with caplog.at_level(logging.WARNING, logger=pa.__name__):
        path = pa._build(COMPILER, FLAGS)
    _assert_refused_and_rebuilt(path, cache, caplog, "is a symlink")
    with pytest.raises(pa.UnsafeKernelPath, match="is a symlink"):
        pa._load(link)


@needs_compiler
def test_symlinked_cache_dir_is_refused(copy_for_compile, cache, caplog, tmp_path):
    real = _build_elsewhere(tmp_path)
    cache.parent.mkdir(parents=True)
    cache.symlink_to(real.parent)
    with caplog.at_level(logging.WARNING, logger=pa.__name__):
        path = pa._build(COMPILER, FLAGS)
    _assert_refused_and_rebuilt(path, cache, caplog, "is a symlink")
    with pytest.raises(pa.UnsafeKernelPath, match="is a symlink"):
        pa._load(cache / real.name)


@needs_compiler
def test_refused_at_load_falls_back_to_torch(copy_for_compile, monkeypatch, cache, caplog, tmp_path):
    """If the library fails the checks at load time (e.g. swapped after the build), the kernel is
    not loaded and paged_decode_attention answers through the torch reference."""
    real = _build_elsewhere(tmp_path)
    cache.mkdir(parents=True, mode=0o700)
    link = cache / real.name
    link.symlink_to(real)
    loader = pa._new_loader()
    monkeypatch.setattr(loader, "build_one", lambda compiler, flags: link)
    monkeypatch.setattr(pa, "_loader", loader)
    with caplog.at_level(logging.WARNING, logger=pa.__name__):
        assert pa.native_available() is False
    assert "UnsafeKernelPath" in pa.native_unavailable_reason() and "symlink" in pa.native_unavailable_reason()
    assert any("torch fallback" in r.getMessage() for r in caplog.records)
    q, k = torch.randn(2, 4, 32), torch.randn(6, 4, 2, 32)
    v = torch.randn_like(k)
    bt = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    cl = torch.tensor([9, 12], dtype=torch.int32)
    out = pa.paged_decode_attention(q, k, v, bt, cl, 0.2)
    torch.testing.assert_close(out, pa.paged_decode_attention_reference(q, k, v, bt, cl, 0.2))


_WORKER = """
import sys, torch
from deepinfer.kernels import paged_attention as pa
sys.stdin.readline()  # start line: both processes build at the same moment
assert pa.native_available(), pa.native_unavailable_reason()
q, k = torch.randn(2, 4, 32), torch.randn(6, 4, 2, 32)
v = torch.randn_like(k)
bt = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
cl = torch.tensor([9, 12], dtype=torch.int32)
out = pa.paged_decode_attention(q, k, v, bt, cl, 0.2)
torch.testing.assert_close(out, pa.paged_decode_attention_reference(q, k, v, bt, cl, 0.2))
print(pa.native_info()["path"])
"""


@needs_compiler
def test_concurrent_builds_both_load_a_valid_kernel(cache):
    env = {**os.environ, "DEEPINFER_CACHE_DIR": str(cache.parent), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    results = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
        assert Path(out.strip()).parent == cache
    _assert_private_dir(cache)
    names = [p.name for p in cache.iterdir()]
    assert len(names) == 1 and names[0].endswith(".so")  # one complete library, no temporaries
