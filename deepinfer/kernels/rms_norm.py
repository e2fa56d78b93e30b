"""RMS normalisation, optionally fused with the residual add before it (`rms_norm.c`).

`rms_norm(x, weight, eps)` is transformers' LlamaRMSNorm in fp32; `rms_norm(x, weight, eps,
residual=r)` first does `x += r` in place and normalises the sum, which is how a decoder layer uses
it (the sublayer's output joins the residual stream, and the next sublayer reads its norm).

On CPU, for fp32 tensors whose rows have a contiguous last dimension, the C kernel does it (one
call instead of torch's add and norm, which at decode cost ~10x the arithmetic in dispatch); the
sum of squares is taken in double in a fixed order, so every row's result is the same whatever the
thread count and whatever rows share the call. Elsewhere (CUDA, other dtypes, strided rows, no
compiler) the same operations run in torch, whose rounding of the sum may differ in the last bit.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from deepinfer.kernels import build

__all__ = ["entry_point", "native_available", "rms_norm", "rms_norm_reference"]

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("rms_norm.c")


def _load(path: Path) -> tuple[ctypes.CDLL, dict[str, object]]:
    lib = build.dlopen_checked(path)
    fn = lib.rn_rms_norm_f32
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    # x, ldx, residual, ldr, w, out, ldo, M, K, eps, num_threads
    fn.argtypes = [vp, i64, vp, i64, vp, vp, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    fn.restype = ctypes.c_int
    return lib, {"rms_norm": fn}


_loader = build.KernelLoader(_SOURCE, "rms_norm", "RMS norm kernel", _load, probe_prefix="rn", log=logger,
                             simd=())
_fns = _loader.fns


def native_available() -> bool:
    """Build (cached on disk) and load the kernel; False, with the reason logged once, if it cannot."""
    return bool(_fns) or _loader.available()


def entry_point() -> int:
    """The address of `rn_rms_norm_f32` (what `rms_norm` calls) for native callers; 0 without the kernel."""
    return _loader.entry_point("rms_norm")


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> torch.Tensor:
    """The torch path of `rms_norm` (same contract)."""
    if residual is not None:
        x.add_(residual)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _kernel_ok(t: torch.Tensor, k: int) -> bool:
    return t.dtype is torch.float32 and t.is_cpu and t.dim() == 2 and t.shape[1] == k and t.stride(1) == 1 \
        and t.stride(0) >= k


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """weight * (x / sqrt(mean(x²) + eps)) over the last dimension of x [rows, hidden], as a new tensor.
    With `residual` (x's shape), x += residual first, in place, and the sum is normalised."""
    k = x.shape[-1]
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} differs from x's {tuple(x.shape)}")
    fn = _fns.get("rms_norm") if _fns or _loader.available() else None
    if (fn is None or not _kernel_ok(x, k) or (residual is not None and not _kernel_ok(residual, k))
            or not (weight.dtype is torch.float32 and weight.is_cpu and weight.shape == (k,)
                    and weight.is_contiguous())):
        return rms_norm_reference(x, weight, eps, residual)
    m = x.shape[0]
    out = torch.empty((m, k), dtype=torch.float32)
    rc = fn(x.data_ptr(), x.stride(0), residual.data_ptr() if residual is not None else None,
            residual.stride(0) if residual is not None else 0, weight.data_ptr(), out.data_ptr(), k, m, k, eps,
            torch.get_num_threads())
    if rc:
        raise ValueError(f"rms_norm: bad shape {tuple(x.shape)} or strides {x.stride()}")
    return out
