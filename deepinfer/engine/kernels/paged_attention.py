"""Paged attention for decode rows (one query token per sequence) on CPU.

`paged_decode_attention` reads K/V in place through the block tables with a small C kernel
(`paged_attention.c`), compiled on first use with the system C compiler into a per-user cache
and loaded with ctypes. Loading a shared library runs its code, so a cached build is used only
from a directory and file that this user owns and nobody else can write (see `_check_private`);
anything else is refused with a warning and the kernel is rebuilt in a fresh private directory.
`paged_decode_attention_reference` is the pure-torch version (gather + softmax): the oracle for
tests, and what `paged_decode_attention` falls back to when the kernel cannot be built or loaded.

Shapes:
    q             [B, num_heads, head_dim] float32, head_dim contiguous
    k, v          [num_blocks, block_size, num_kv_heads, head_dim] float32, the inner three dims
                  contiguous; dim 0 may have any stride (layer views of the engine's KV tensor
                  [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim])
    block_tables  [B, max_blocks] int32, innermost dim contiguous; entries past a row's
                  ceil(context_len / block_size) blocks are ignored
    context_lens  [B] int32, tokens of context including the current one (0 gives a zero row)
    out           [B, num_heads, head_dim] float32, head_dim contiguous
GQA: query head h reads kv head h // (num_heads // num_kv_heads).
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import struct
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

__all__ = [
    "native_available",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "kernel_cache_dir",
    "native_unavailable_reason",
    "native_info",
]

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_attention.c")
_LIB_STEM = "paged_attention"
_ERR_CONTEXT_LEN = -1
_ERR_BLOCK_ID = -2
_ERR_NOMEM = -3

_lock = threading.Lock()
_state: dict[str, object] = {"tried": False, "reason": None}
_lib: ctypes.CDLL | None = None
_fn = None  # the ctypes function once loaded


# ---------------------------------------------------------------------------------------------
# Build and load


def kernel_cache_dir() -> Path:
    """Where compiled kernels are kept: $DEEPINFER_CACHE_DIR, else $XDG_CACHE_HOME/deepinfer,
    else ~/.cache/deepinfer; subdirectory `kernels` (created 0700, checked before every use)."""
    root = os.environ.get("DEEPINFER_CACHE_DIR")
    if root:
        base = Path(root)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = Path(xdg) / "deepinfer" if xdg else Path.home() / ".cache" / "deepinfer"
    return base / "kernels"


class UnsafeKernelPath(OSError):
    """A kernel directory or library another user could have written (or could still change)."""


def _check_private(st: os.stat_result, path: Path, *, is_dir: bool) -> None:
    """Raise UnsafeKernelPath unless `st` (from lstat/fstat, never following a link) is a real
    directory / regular file owned by this user and not writable by group or others: only then
    can nobody else have put code there or swap it in later."""
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeKernelPath(f"{path} is a symlink")
    if not (stat.S_ISDIR(st.st_mode) if is_dir else stat.S_ISREG(st.st_mode)):
        raise UnsafeKernelPath(f"{path} is not a {'directory' if is_dir else 'regular file'}")
    if st.st_uid != os.geteuid():
        raise UnsafeKernelPath(f"{path} is owned by uid {st.st_uid}, not {os.geteuid()}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeKernelPath(f"{path} is group/world-writable (mode {stat.S_IMODE(st.st_mode):o})")


def _ensure_private_dir(path: Path) -> None:
    """Create `path` with mode 0700 (parents with the default mode) and check it. An existing
    directory is accepted only if it passes `_check_private`; it is not silently repaired."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)  # the umask can only clear bits
    except FileExistsError:
        pass
    _check_private(os.lstat(path), path, is_dir=True)


_fresh_dir: Path | None = None


def _fresh_private_dir() -> Path:
    """A new directory only this process knows (mkdtemp: random name, created 0700, fails rather
    than reuse an existing one); one per process, removed at exit. Used when the cache is refused."""
    global _fresh_dir
    if _fresh_dir is None:
        _fresh_dir = Path(tempfile.mkdtemp(prefix=f"deepinfer-kernels-{os.geteuid()}-"))
        atexit.register(shutil.rmtree, _fresh_dir, True)  # a loaded .so stays mapped after unlink
    return _fresh_dir


def _reusable(target: Path) -> bool:
    """True if a build is already at `target` and safe to load; False if there is none; raises
    UnsafeKernelPath if something is there that must not be loaded."""
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return False
    _check_private(st, target, is_dir=False)
    return True


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _compile_flags(openmp: bool = True, simd: bool = True) -> list[str]:
    flags = ["-O3", "-std=gnu11", "-fPIC", "-shared", "-fno-math-errno"]
    if openmp:
        flags.append("-fopenmp")
    if simd and platform.machine().lower() in ("x86_64", "amd64") and {"avx2", "fma"} <= _cpu_flags():
        flags += ["-mavx2", "-mfma"]
    return flags


def _find_compiler() -> str | None:
    for name in (os.environ.get("CC"), "gcc", "cc"):
        if name:
            path = shutil.which(name)
            if path:
                return path
    return None


def _lib_name(compiler: str, flags: list[str]) -> str:
    """File name of the build: keyed by source, flags, compiler and machine."""
    key = hashlib.sha256(
        b"\0".join([_SOURCE.read_bytes(), " ".join(flags).encode(), os.path.basename(compiler).encode(),
                    platform.machine().encode()])
    ).hexdigest()[:20]
    return f"{_LIB_STEM}-{key}.so"


def _build(compiler: str, flags: list[str]) -> Path:
    """Path of a checked build for these flags: reused from the cache, else compiled into it. If the
    cache directory or the file found there fails the checks (or cannot be written), warn and
    compile into a fresh private directory instead. Raises RuntimeError if the compiler fails."""
    name = _lib_name(compiler, flags)
    cache = kernel_cache_dir()
    try:
        _ensure_private_dir(cache)
        target = cache / name
        if _reusable(target):
            return target
        if not os.access(cache, os.W_OK | os.X_OK):
            raise PermissionError(f"{cache} is not writable")
    except OSError as e:  # UnsafeKernelPath included
        target = _fresh_private_dir() / name
        logger.warning("refusing kernel cache: %s; building the paged attention kernel in %s instead",
                       e, target.parent)
    if not _reusable(target):
        _compile(compiler, flags, target)
    return target


def _compile(compiler: str, flags: list[str], target: Path) -> None:
    """Compile to a private temporary name in target's directory, then rename atomically: a
    concurrent process (building the same key) sees no file or a complete one, never a partial one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.stem}-", suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        cmd = [compiler, *flags, "-o", tmp, str(_SOURCE)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr.strip()}")
        os.chmod(tmp, 0o755)  # the linker creates it with the umask; never group/world-writable
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_NUM_PARAMS = 16
_pack_params = struct.Struct(f"<{_NUM_PARAMS}q").pack


def _dlopen_checked(path: Path) -> ctypes.CDLL:
    """dlopen `path` only if it and its directory pass `_check_private`. The file is opened with
    O_NOFOLLOW and checked with fstat, and on Linux that same open file is loaded through
    /proc/self/fd, so nothing can be swapped in between the check and the load."""
    _check_private(os.lstat(path.parent), path.parent, is_dir=True)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if os.path.islink(path):
            raise UnsafeKernelPath(f"{path} is a symlink") from e
        raise
    try:
        _check_private(os.fstat(fd), path, is_dir=False)
        proc_path = f"/proc/self/fd/{fd}"
        if os.path.exists(proc_path):
            # fd stays open for the life of the process, like the mapping: dlopen hands back an
            # already loaded object of the same name, so a reused fd number would load the wrong one.
            return ctypes.CDLL(proc_path)
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return ctypes.CDLL(str(path))  # no /proc: the checked 0700 directory is what protects the path


def _load(path: Path):
    """Load the checked library at `path`; returns (lib, ctypes function). Raises on a refused path."""
    lib = _dlopen_checked(path)
    if lib.pa_num_params() != _NUM_PARAMS:
        raise RuntimeError(f"{path} expects {lib.pa_num_params()} parameters, this wrapper passes {_NUM_PARAMS}")
    fn = lib.pa_paged_decode_attention_f32
    vp = ctypes.c_void_p
    # q, k, v, block_tables, context_lens, out, packed int64 params, scale, num_threads
    fn.argtypes = [vp, vp, vp, vp, vp, vp, ctypes.c_char_p, ctypes.c_float, ctypes.c_int]
    fn.restype = ctypes.c_int
    return lib, fn


def native_available() -> bool:
    """Build (once per source/flags, cached on disk) and load the native kernel. False, with the
    reason logged once, when there is no C compiler or the build or load fails."""
    global _lib, _fn
    if _fn is not None:
        return True
    with _lock:
        if _state["tried"]:
            return _fn is not None
        _state["tried"] = True
        try:
            compiler = _find_compiler()
            if compiler is None:
                raise RuntimeError("no C compiler found (looked for $CC, gcc, cc)")
            # Fall back to a serial build when the compiler has no OpenMP, and to plain C when
            # the SIMD flags are refused.
            errors: list[str] = []
            for openmp, simd in ((True, True), (False, True), (False, False)):
                try:
                    path = _build(compiler, _compile_flags(openmp, simd))
                    break
                except RuntimeError as e:
                    errors.append(str(e))
            else:
                raise RuntimeError("\n".join(errors))
            if errors:
                logger.warning("paged attention kernel built with reduced flags %s; first failure: %s",
                               _compile_flags(openmp, simd), errors[0])
            _lib, fn = _load(path)
            _state.update(path=str(path), flags=_compile_flags(openmp, simd),
                          avx2=bool(_lib.pa_has_avx2()), openmp=bool(_lib.pa_has_openmp()))
            _fn = fn
            logger.debug("paged attention kernel loaded from %s", path)
            return True
        except Exception as e:  # noqa: BLE001 - any failure means "use the torch path"
            _state["reason"] = f"{type(e).__name__}: {e}"
            logger.warning("native paged attention kernel unavailable, using the torch fallback: %s",
                           _state["reason"])
            return False


def native_info() -> dict[str, object] | None:
    """Where the loaded kernel came from and how it was built (None when not loaded)."""
    if _fn is None:
        return None
    return {key: _state[key] for key in ("path", "flags", "avx2", "openmp")}


def native_unavailable_reason() -> str | None:
    """Why `native_available()` returned False (None if it was not tried or succeeded)."""
    return _state["reason"]  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# Argument checks


_F32, _I32 = torch.float32, torch.int32


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_tables: torch.Tensor,
           context_lens: torch.Tensor, out: torch.Tensor | None) -> tuple[int, int, int, int, int, int]:
    """Validate everything that does not need to read tensor values; returns
    (B, num_heads, head_dim, num_kv_heads, block_size, max_blocks). One cheap combined test on
    the hot path; `_diagnose` works out the message when it fails."""
    qsh, ksh, bsh = q.shape, k.shape, block_tables.shape
    if len(qsh) == 3 and len(ksh) == 4 and len(bsh) == 2:
        B, H, D = qsh
        bs, kvh = ksh[1], ksh[2]
        ks, vs = k.stride(), v.stride()
        row = kvh * D
        if (q.dtype is _F32 and k.dtype is _F32 and v.dtype is _F32 and block_tables.dtype is _I32
                and context_lens.dtype is _I32 and ksh[3] == D and v.shape == ksh and kvh > 0 and H % kvh == 0
                and q.stride(2) == 1 and ks[3] == 1 and ks[2] == D and ks[1] == row
                and vs[3] == 1 and vs[2] == D and vs[1] == row and bsh[0] == B
                and (block_tables.stride(1) == 1 or bsh[1] <= 1) and context_lens.shape == (B,)
                and (context_lens.stride(0) == 1 or B <= 1)
                and q.is_cpu and k.is_cpu and v.is_cpu and block_tables.is_cpu and context_lens.is_cpu
                and (out is None or (out.dtype is _F32 and out.shape == qsh and out.stride(2) == 1
                                     and out.is_cpu))):
            return B, H, D, kvh, bs, bsh[1]
    _diagnose(q, k, v, block_tables, context_lens, out)
    raise ValueError("invalid arguments to paged_decode_attention")  # not reached


def _diagnose(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_tables: torch.Tensor,
              context_lens: torch.Tensor, out: torch.Tensor | None) -> None:
    """Raise a ValueError that says what is wrong with the arguments."""
    f32 = torch.float32
    if q.dtype != f32 or k.dtype != f32 or v.dtype != f32:
        raise ValueError(f"q, k, v must be float32, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dim() != 3:
        raise ValueError(f"q must be [B, num_heads, head_dim], got shape {tuple(q.shape)}")
    if k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"k and v must be [num_blocks, block_size, num_kv_heads, head_dim], got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    B, H, D = q.shape
    nb, bs, kvh, kd = k.shape
    if v.shape != k.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if kd != D:
        raise ValueError(f"head_dim mismatch: q has {D}, k/v have {kd}")
    if kvh <= 0 or H % kvh:
        raise ValueError(f"num_heads ({H}) must be a positive multiple of num_kv_heads ({kvh})")
    if q.stride(2) != 1:
        raise ValueError("q's last dim must be contiguous")
    ks, vs = k.stride(), v.stride()
    if ks[3] != 1 or ks[2] != D or ks[1] != kvh * D or vs[3] != 1 or vs[2] != D or vs[1] != kvh * D:
        raise ValueError("k and v must have contiguous [block_size, num_kv_heads, head_dim] inner dims, got "
                         f"strides {ks} and {vs}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError(f"block_tables must be a 2-D int32 tensor, got {block_tables.dtype} "
                         f"shape {tuple(block_tables.shape)}")
    if block_tables.shape[0] != B:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows, q has {B}")
    if block_tables.stride(1) != 1 and block_tables.shape[1] > 1:
        raise ValueError("block_tables rows must be contiguous")
    if context_lens.dtype != torch.int32 or context_lens.shape != (B,):
        raise ValueError(f"context_lens must be int32 of shape ({B},), got {context_lens.dtype} "
                         f"shape {tuple(context_lens.shape)}")
    if context_lens.stride(0) != 1 and B > 1:
        raise ValueError("context_lens must be contiguous")
    if not (q.is_cpu and k.is_cpu and v.is_cpu and block_tables.is_cpu and context_lens.is_cpu):
        raise ValueError("paged_decode_attention runs on CPU tensors only")
    if out is not None:
        if out.dtype != f32 or out.shape != q.shape or out.stride(2) != 1 or not out.is_cpu:
            raise ValueError(f"out must be a float32 CPU tensor of shape {tuple(q.shape)} with a contiguous "
                             f"last dim, got {out.dtype} shape {tuple(out.shape)} strides {out.stride()}")


def _check_values(block_tables: torch.Tensor, context_lens: torch.Tensor, num_blocks: int,
                  block_size: int) -> None:
    """Value checks (context lengths, used block ids); raises ValueError naming the first bad row."""
    max_blocks = block_tables.shape[1]
    cap = max_blocks * block_size
    lens = context_lens.long()
    bad = (lens < 0) | (lens > cap)
    if bool(bad.any()):
        b = int(bad.nonzero()[0, 0])
        raise ValueError(f"context_lens[{b}] = {int(lens[b])} is outside [0, max_blocks * block_size = {cap}]")
    used = torch.arange(max_blocks).unsqueeze(0) < ((lens + block_size - 1) // block_size).unsqueeze(1)
    bad_ids = used & ((block_tables < 0) | (block_tables >= num_blocks))
    if bool(bad_ids.any()):
        b = int(bad_ids.any(dim=1).nonzero()[0, 0])
        raise ValueError(f"block_tables[{b}] uses block ids outside [0, {num_blocks}): "
                         f"{block_tables[b][used[b]].tolist()}")


# ---------------------------------------------------------------------------------------------
# Entry points


def paged_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention (one query token per row) reading K/V through the block tables.

    Uses the native kernel; falls back to `paged_decode_attention_reference` when it cannot be
    built. Raises ValueError on bad arguments (including context lengths beyond the block table
    and out-of-range block ids)."""
    fn = _fn
    if fn is None:
        if not native_available():
            return paged_decode_attention_reference(q, k, v, block_tables, context_lens, scale, out)
        fn = _fn
    B, H, D, kvh, bs, max_blocks = _check(q, k, v, block_tables, context_lens, out)
    if out is None:
        out = torch.empty((B, H, D), dtype=torch.float32)
    if B == 0:
        return out
    ks, vs = k.stride(), v.stride()
    params = _pack_params(B, H, kvh, D, bs, k.shape[0], max_blocks, q.stride(0), q.stride(1),
                          out.stride(0), out.stride(1), block_tables.stride(0), ks[0], ks[1], vs[0], vs[1])
    rc = fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), block_tables.data_ptr(), context_lens.data_ptr(),
            out.data_ptr(), params, scale, torch.get_num_threads())
    if rc != 0:
        if rc in (_ERR_CONTEXT_LEN, _ERR_BLOCK_ID):
            _check_values(block_tables, context_lens, k.shape[0], bs)
        if rc == _ERR_NOMEM:
            raise MemoryError("paged_decode_attention: out of memory for scratch buffers")
        raise ValueError(f"paged_decode_attention: invalid block tables or context lengths (code {rc})")
    return out


def paged_decode_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-torch decode attention: gathers each row's blocks, masks past its context length,
    softmax, weighted sum of V. Same contract as `paged_decode_attention`."""
    B, H, D, kvh, bs, max_blocks = _check(q, k, v, block_tables, context_lens, out)
    if out is None:
        out = torch.empty((B, H, D), dtype=torch.float32)
    if B == 0:
        return out
    num_blocks = k.shape[0]
    _check_values(block_tables, context_lens, num_blocks, bs)
    lens = context_lens.long()
    max_len = int(lens.max())
    if max_len == 0:
        out.zero_()
        return out
    nb = (max_len + bs - 1) // bs
    ids = block_tables[:, :nb].long()
    used = torch.arange(nb).unsqueeze(0) * bs < lens.unsqueeze(1)  # [B, nb]
    ids = torch.where(used, ids, torch.zeros_like(ids))  # ignored entries may hold anything
    kk = k[ids].reshape(B, nb * bs, kvh, D)[:, :max_len]  # [B, T, kvh, D]
    vv = v[ids].reshape(B, nb * bs, kvh, D)[:, :max_len]
    g = H // kvh
    qg = q.reshape(B, kvh, g, D)
    scores = torch.einsum("bkgd,btkd->bkgt", qg, kk) * scale
    valid = torch.arange(max_len).unsqueeze(0) < lens.unsqueeze(1)  # [B, T]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # rows with context 0
    out.copy_(torch.einsum("bkgt,btkd->bkgd", probs, vv).reshape(B, H, D))
    return out
