"""fp32 linear layers for a few rows of activations: the C kernel of `dense_linear.c`.

`dense_linear(x, w, num_threads)` computes x @ w.T for fp32 x [rows, in] and a contiguous fp32
w [out, in] on CPU, streaming w once for all rows. It returns None when it does not apply (no kernel,
another device or dtype, strides it cannot read, more than MAX_ROWS rows), and the caller uses torch.

Why a kernel of our own: a linear layer at decode is bound by reading its weight, so a few rows
(a small batch, a speculative step's verification rows) should cost about what one row costs. The
torch wheel's BLAS does not do that (see the C file's measurements); this kernel keeps the weight
stream's speed up to about MAX_ROWS rows, where a blocked GEMM starts to win.

Invariant: each output row is the same to the bit whatever other rows share the call and whatever the
thread count (batch invariance; see the C file), so a token decoded alone and the same token verified
among drafts get equal logits.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from deepinfer.kernels import build
from deepinfer.kernels.amx import amx_allowed

__all__ = ["AMX_MIN_ROWS", "MAX_ROWS", "amx_available", "dense_linear", "dense_linear_amx", "entry_point",
           "native_available", "native_info"]

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("dense_linear.c")
# Up to this many rows the kernel beats torch's GEMM on SmolLM2's projections (measured on the 2-core
# AVX-512 VM, bench/bench_dense_linear.py); above it the GEMM's register blocking wins.
MAX_ROWS = 64
# From this many rows, where the CPU has AMX-BF16, the tile path (dense_amx.h): on SmolLM2's projections it
# runs 0.73-1.2x torch's GEMM at 65 rows, 0.96-1.32x at 128, 1.1-1.8x at 192 and 1.2-1.4x at 1,024.
AMX_MIN_ROWS = 128
_PATHS = {0: "portable", 1: "avx2", 2: "avx512"}


def _load(path: Path) -> tuple[ctypes.CDLL, dict[str, object]]:
    lib = build.dlopen_checked(path)
    fns: dict[str, object] = {}
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    for key, name in (("native", "dl_linear_f32"), ("portable", "dl_linear_f32_portable"),
                      ("avx2", "dl_linear_f32_avx2")):
        fn = getattr(lib, name)
        fn.argtypes = [vp, i64, vp, vp, i64, i64, i64, i64, ctypes.c_int]  # x, ldx, w, y, ldy, M, N, K, threads
        fn.restype = ctypes.c_int
        fns[key] = fn
    lib.dl_path.restype = ctypes.c_int
    fns["path"] = _PATHS.get(lib.dl_path(), "portable")
    lib.dl_amx_ready.restype = ctypes.c_int
    if lib.dl_amx_ready():  # registered where the CPU has tiles; each call asks the switch (kernels/amx.py)
        fn = lib.dl_linear_amx
        fn.argtypes = fns["native"].argtypes
        fn.restype = ctypes.c_int
        fns["amx"] = fn
    return lib, fns


_loader = build.KernelLoader(_SOURCE, "dense_linear", "dense linear kernel", _load, probe_prefix="dl", log=logger)
_fns = _loader.fns


def native_available() -> bool:
    """Build (cached on disk) and load the kernel; False, with the reason logged once, if it cannot."""
    return bool(_fns) or _loader.available()


def native_info() -> dict[str, object] | None:
    """How the loaded kernel was built and which path it runs here (None when not loaded)."""
    info = _loader.info()
    return None if info is None else {**info, "simd": _fns["path"]}


def entry_point() -> int:
    """The address of `dl_linear_f32` (what `dense_linear` calls by default) for native callers; 0 without
    the kernel."""
    return _loader.entry_point("native")


def dense_linear(x: torch.Tensor, w: torch.Tensor, num_threads: int, *, impl: str = "native") -> torch.Tensor | None:
    """x [rows, in] @ w.T → new fp32 [rows, out], or None when the kernel does not apply (see the module
    docstring; `impl` "portable" / "avx2" picks that path of the kernel, for tests)."""
    fn = _fns.get(impl) if _fns or _loader.available() else None
    if impl == "amx" and not amx_allowed():  # the tiles only with the switch on, whichever way they are asked for
        fn = None
    if fn is None or x.dtype is not torch.float32 or w.dtype is not torch.float32 or x.dim() != 2 or w.dim() != 2:
        return None
    m, k = x.shape
    n = w.shape[0]
    if not (0 < m <= MAX_ROWS and w.shape[1] == k and x.is_cpu and w.is_cpu and w.is_contiguous()
            and x.stride(1) == 1 and (x.stride(0) >= k or m == 1)):
        return None
    y = torch.empty((m, n), dtype=torch.float32)
    rc = fn(x.data_ptr(), max(x.stride(0), k), w.data_ptr(), y.data_ptr(), n, m, n, k, num_threads)  # type: ignore[operator]
    if rc:
        raise ValueError(f"dense_linear: rc {rc} for x {tuple(x.shape)} stride {x.stride()}, w {tuple(w.shape)}")
    return y


def amx_available() -> bool:
    """True when the kernel is loaded with its AMX tile path (AMX-BF16 here, the tile state granted by Linux) and
    the process-wide switch lets calls take it (`kernels/amx.py`: `EngineConfig.amx`, DEEPINFER_AMX=0 at the
    launcher)."""
    return amx_allowed() and ("amx" in _fns or (native_available() and "amx" in _fns))


def dense_linear_amx(x: torch.Tensor, w: torch.Tensor, num_threads: int) -> torch.Tensor | None:
    """x [rows, in] @ w.T on AMX tiles (dense_amx.h: three bf16 pieces per value, six piece products; errors
    against float64 at torch's GEMM's level), as a new fp32 [rows, out]; None where the path does not apply (no
    tiles, the AMX switch off, another device or dtype, strides it cannot read), and the caller uses torch."""
    fn = _fns.get("amx") if amx_allowed() and (_fns or _loader.available()) else None
    if fn is None or x.dtype is not torch.float32 or w.dtype is not torch.float32 or x.dim() != 2 or w.dim() != 2:
        return None
    m, k = x.shape
    n = w.shape[0]
    if not (m > 0 and w.shape[1] == k and x.is_cpu and w.is_cpu and w.is_contiguous() and x.stride(1) == 1
            and (x.stride(0) >= k or m == 1)):
        return None
    y = torch.empty((m, n), dtype=torch.float32)
    rc = fn(x.data_ptr(), max(x.stride(0), k), w.data_ptr(), y.data_ptr(), n, m, n, k, num_threads)  # type: ignore[operator]
    if rc == -4:
        raise MemoryError("dense_linear_amx: out of memory")
    if rc:
        raise ValueError(f"dense_linear_amx: rc {rc} for x {tuple(x.shape)} stride {x.stride()}, w {tuple(w.shape)}")
    return y
