"""Build and load the native C kernels: compile on first use, cache privately, load with ctypes.

Each kernel is one C source file beside its Python wrapper. It is compiled with the system C compiler
($CC, else gcc, else cc) into a per-user cache (`kernel_cache_dir()`), under a file name that hashes the
source, the flags, the compiler and the machine, so an edited source or another flag set never loads a
stale build. Loading a shared library runs its code, so a cached build is used only from a directory and
file this user owns and nobody else can write (`check_private`); anything else is refused with a warning
and the kernel is rebuilt in a fresh private directory (one per process, removed at exit). Builds are
compiled under a temporary name and renamed into place, so concurrent builders never load a partial file.

Flags: -O3, OpenMP, and the SIMD features the CPU reports in /proc/cpuinfo (x86-64 only). A wrapper tries
flag sets in order (`flag_fallbacks`): without OpenMP when the compiler has none, then plain C. What it
could not build is the wrapper's "unavailable reason", and it then uses its torch path.

`KernelLoader` is that whole sequence for one kernel (find a compiler, build with the first flag set that
compiles, load, remember how or why not); each wrapper holds one and delegates its `native_available`,
`native_info` and `native_unavailable_reason` to it.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "KernelLoader",
    "UnsafeKernelPath",
    "build",
    "build_first",
    "check_private",
    "compile_flags",
    "compile_source",
    "cpu_flags",
    "dlopen_checked",
    "find_compiler",
    "flag_fallbacks",
    "kernel_cache_dir",
    "lib_name",
    "source_bytes",
]

# The SIMD features the paged attention kernel uses; others ask for more (e.g. "f16c").
DEFAULT_SIMD = ("avx2", "fma")


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


def check_private(st: os.stat_result, path: Path, *, is_dir: bool) -> None:
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
    directory is accepted only if it passes `check_private`; it is not silently repaired."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)  # the umask can only clear bits
    except FileExistsError:
        pass
    check_private(os.lstat(path), path, is_dir=True)


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
    check_private(st, target, is_dir=False)
    return True


def cpu_flags() -> set[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def compile_flags(openmp: bool = True, simd: bool = True, features: Sequence[str] = DEFAULT_SIMD) -> list[str]:
    """Compiler flags; `-m<feature>` for each of `features` only if the CPU has all of them (x86-64)."""
    flags = ["-O3", "-std=gnu11", "-fPIC", "-shared", "-fno-math-errno"]
    if openmp:
        flags.append("-fopenmp")
    if simd and platform.machine().lower() in ("x86_64", "amd64") and set(features) <= cpu_flags():
        flags += [f"-m{feature}" for feature in features]
    return flags


def flag_fallbacks(features: Sequence[str] = DEFAULT_SIMD) -> list[list[str]]:
    """Flag sets to try in order: everything, then without OpenMP, then plain C."""
    return [compile_flags(openmp, simd, features) for openmp, simd in ((True, True), (False, True), (False, False))]


def find_compiler() -> str | None:
    for name in (os.environ.get("CC"), "gcc", "cc"):
        if name:
            path = shutil.which(name)
            if path:
                return path
    return None


_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"/]+)"', re.MULTILINE)


def source_bytes(source: Path) -> bytes:
    """The source and, after it, every header it includes with `#include "name.h"` from its own directory,
    and the headers those include, each once (the kernels share register tiles and AMX helpers that way),
    so that editing any of them also changes the build's key."""
    parts = [source.read_bytes()]
    seen: set[bytes] = set()
    pending = list(_LOCAL_INCLUDE.findall(parts[0]))
    while pending:
        name = pending.pop(0)
        header = source.parent / name.decode()
        if name in seen or not header.is_file():
            continue
        seen.add(name)
        text = header.read_bytes()
        parts += [b"\0" + name, text]
        pending += _LOCAL_INCLUDE.findall(text)
    return b"".join(parts)


def lib_name(source: Path, stem: str, compiler: str, flags: list[str]) -> str:
    """File name of the build: keyed by source (with its local headers), flags, compiler and machine."""
    key = hashlib.sha256(
        b"\0".join([source_bytes(source), " ".join(flags).encode(), os.path.basename(compiler).encode(),
                    platform.machine().encode()])
    ).hexdigest()[:20]
    return f"{stem}-{key}.so"


def build(source: Path, stem: str, compiler: str, flags: list[str], *, what: str, log: logging.Logger) -> Path:
    """Path of a checked build of `source` for these flags: reused from the cache, else compiled into
    it. If the cache directory or the file found there fails the checks (or cannot be written), warn
    on `log` and compile into a fresh private directory instead. Raises RuntimeError if the compiler
    fails. `what` names the kernel in the warning."""
    name = lib_name(source, stem, compiler, flags)
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
        log.warning("refusing kernel cache: %s; building the %s in %s instead", e, what, target.parent)
    if not _reusable(target):
        compile_source(source, compiler, flags, target)
    return target


def compile_source(source: Path, compiler: str, flags: list[str], target: Path) -> None:
    """Compile to a private temporary name in target's directory, then rename atomically: a
    concurrent process (building the same key) sees no file or a complete one, never a partial one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.stem}-", suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        cmd = [compiler, *flags, "-o", tmp, str(source)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr.strip()}")
        os.chmod(tmp, 0o755)  # the linker creates it with the umask; never group/world-writable
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_first(build_one: Callable[[list[str]], Path],
                flag_sets: Sequence[list[str]]) -> tuple[Path, list[str], list[str]]:
    """Build with the first flag set that compiles: (path, its flags, the errors of those before it).
    Raises RuntimeError with every compiler error when none does."""
    errors: list[str] = []
    for flags in flag_sets:
        try:
            return build_one(flags), flags, errors
        except RuntimeError as e:
            errors.append(str(e))
    raise RuntimeError("\n".join(errors))


def dlopen_checked(path: Path) -> ctypes.CDLL:
    """dlopen `path` only if it and its directory pass `check_private`. The file is opened with
    O_NOFOLLOW and checked with fstat, and on Linux that same open file is loaded through
    /proc/self/fd, so nothing can be swapped in between the check and the load."""
    check_private(os.lstat(path.parent), path.parent, is_dir=True)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if os.path.islink(path):
            raise UnsafeKernelPath(f"{path} is a symlink") from e
        raise
    try:
        check_private(os.fstat(fd), path, is_dir=False)
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


class KernelLoader:
    """Builds and loads one kernel on first use, once per process, and remembers how or why not.

    `load(path)` dlopens the checked build (`dlopen_checked`), sets up its ctypes functions and returns
    (library, {name: function}); it raises when the library does not match its wrapper. The library
    exports `<probe_prefix>_has_avx2()` and `<probe_prefix>_has_openmp()`, which `info()` reports.

    Invariants: `fns` is one dict for the loader's life, empty until a load succeeds and then filled in
    place by one `dict.update` (a C-level merge of str / torch.dtype keys, which holds the GIL
    throughout), so a reader without the lock sees it empty or complete; wrappers may alias it and test
    it on the hot path. The build is tried at most once; a failure is logged once on `log` and kept
    as `unavailable_reason()`."""

    def __init__(self, source: Path, stem: str, what: str,
                 load: Callable[[Path], tuple[ctypes.CDLL, dict[str, Any]]], *, probe_prefix: str,
                 log: logging.Logger, simd: Sequence[str] = DEFAULT_SIMD) -> None:
        self.source, self.stem, self.what = source, stem, what
        self.simd = tuple(simd)
        self.log = log
        self.lib: ctypes.CDLL | None = None
        self.fns: dict[str, Any] = {}
        # "tried", "reason"; after a load also "path", "flags", "avx2", "openmp"
        self.state: dict[str, object] = {"tried": False, "reason": None}
        self._load = load
        self._probe_prefix = probe_prefix
        self._lock = threading.Lock()

    def build_one(self, compiler: str, flags: list[str]) -> Path:
        """A checked build of the source for these flags (cached; see `build`)."""
        return build(self.source, self.stem, compiler, flags, what=self.what, log=self.log)

    def load(self, path: Path) -> tuple[ctypes.CDLL, dict[str, Any]]:
        """Load the build at `path` without recording it (tests load reduced builds this way)."""
        return self._load(path)

    def available(self) -> bool:
        """Build (falling back to reduced flag sets) and load, the first time; True once loaded.
        False, with the reason logged once, when there is no compiler or the build or load fails."""
        if self.fns:
            return True
        with self._lock:
            if self.state["tried"]:
                return bool(self.fns)
            self.state["tried"] = True
            try:
                compiler = find_compiler()
                if compiler is None:
                    raise RuntimeError("no C compiler found (looked for $CC, gcc, cc)")
                path, flags, errors = build_first(lambda f: self.build_one(compiler, f), flag_fallbacks(self.simd))
                if errors:
                    self.log.warning("%s built with reduced flags %s; first failure: %s", self.what, flags, errors[0])
                lib, fns = self._load(path)
                probe = self._probe_prefix
                self.state.update(path=str(path), flags=flags, avx2=bool(getattr(lib, f"{probe}_has_avx2")()),
                                  openmp=bool(getattr(lib, f"{probe}_has_openmp")()))
                self.lib = lib
                self.fns.update(fns)  # last: a non-empty dict means fully loaded
                self.log.debug("%s loaded from %s", self.what, path)
                return True
            except Exception as e:  # noqa: BLE001 - any failure means "use the torch path"
                self.state["reason"] = f"{type(e).__name__}: {e}"
                self.log.warning("native %s unavailable, using the torch fallback: %s", self.what,
                                 self.state["reason"])
                return False

    def entry_point(self, key: object) -> int:
        """The address of the loaded function `fns[key]`, for native code that calls it directly (0 when the
        kernel cannot be loaded or has no such function)."""
        fn = self.fns.get(key) if self.available() else None  # type: ignore[call-overload]
        return (ctypes.cast(fn, ctypes.c_void_p).value or 0) if fn is not None else 0

    def info(self) -> dict[str, object] | None:
        """Where the loaded kernel came from and how it was built (None when not loaded)."""
        if not self.fns:
            return None
        return {key: self.state[key] for key in ("path", "flags", "avx2", "openmp")}

    def unavailable_reason(self) -> str | None:
        """Why `available()` returned False (None if it was not tried or succeeded)."""
        return self.state["reason"]  # type: ignore[return-value]
