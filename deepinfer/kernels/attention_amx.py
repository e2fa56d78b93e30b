"""Causal prefill attention on AMX tiles (`attention_amx.c`), built on first use like the other kernels.

`prefill_attention(q, k, v, scale, out=..., num_threads=...)`: q [heads, Tq, D], k and v [kv_heads, Tk, D]
(float32, last dim contiguous, any head and row strides), the Tq queries being the last Tq of the Tk
positions; out [Tq, heads, D] (a view is fine). Each query attends to the keys at or before its position:
what SDPA computes with `is_causal=True` when Tq == Tk, and with a bottom-right-aligned causal mask when a
chunk follows earlier context. Accuracy is fp32's (the C file says how bf16 tiles get there): outputs
agree with SDPA's to fp32 rounding, not bit for bit, and are as close to float64 attention as SDPA's.

`available()` is False (and the caller keeps SDPA) where the CPU has no AMX-BF16, Linux refuses the tile
state, or the kernel cannot be built, and while the process-wide switch is off (`kernels/amx.py`:
`EngineConfig.amx`, DEEPINFER_AMX=0 at the launcher); it is asked on every call, so turning it off after the
kernel loaded holds from the next call.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from deepinfer.kernels import build
from deepinfer.kernels.amx import amx_allowed

__all__ = ["available", "prefill_attention", "supports"]

logger = logging.getLogger(__name__)

_ERRORS = {-1: "bad shape or strides", -4: "out of memory", -5: "no AMX tiles on this CPU"}


def _load(path: Path) -> tuple[ctypes.CDLL, dict[str, object]]:
    lib = build.dlopen_checked(path)
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    fn = lib.fa_prefill_f32
    # q, q_hs, q_rs, k, v, kv_hs, kv_rs, out, o_hs, o_rs, H, Hkv, Tq, Tk, D, scale, num_threads
    fn.argtypes = [vp, i64, i64, vp, vp, i64, i64, vp, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    fn.restype = ctypes.c_int
    lib.fa_amx_ready.restype = ctypes.c_int
    lib.fa_max_head_dim.restype = ctypes.c_int
    fns: dict[str, object] = {"max_head_dim": lib.fa_max_head_dim()}
    if lib.fa_amx_ready():  # registered where the CPU has tiles; `available()` asks the switch per call
        fns["prefill"] = fn
    return lib, fns


_loader = build.KernelLoader(Path(__file__).with_name("attention_amx.c"), "attention_amx", "AMX prefill attention",
                             _load, probe_prefix="fa", log=logger)
_fns = _loader.fns


def available() -> bool:
    """True when the kernel is loaded, can run its tiles here and the AMX switch is on (see the module
    docstring)."""
    if not amx_allowed():
        return False
    return "prefill" in _fns or (not _loader.state["tried"] and _loader.available() and "prefill" in _fns)


def supports(head_dim: int, heads: int, kv_heads: int) -> bool:
    """Whether the kernel takes this shape (head_dim a multiple of 32 up to its maximum, whole GQA groups)."""
    return (available() and head_dim % 32 == 0 and 32 <= head_dim <= int(_fns["max_head_dim"])  # type: ignore[call-overload]
            and kv_heads > 0 and heads % kv_heads == 0)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
                      out: torch.Tensor | None = None, num_threads: int | None = None) -> torch.Tensor:
    """See the module docstring. Returns `out` (allocated [Tq, heads, D] when None). Raises ValueError on
    bad shapes, dtypes or strides and RuntimeError when the kernel is unavailable."""
    if not available():
        why = "switched off (allow_amx(False))" if not amx_allowed() else _loader.state["reason"] or "no AMX tiles here"
        raise RuntimeError(f"AMX prefill attention unavailable: {why}")
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or q.shape[2] != k.shape[2]:
        raise ValueError(f"q must be [heads, Tq, D] and k, v [kv_heads, Tk, D], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    H, Tq, D = q.shape
    Hkv, Tk = k.shape[0], k.shape[1]
    if not supports(D, H, Hkv) or Tq > Tk:
        raise ValueError(f"unsupported shape: heads {H}, kv_heads {Hkv}, head_dim {D}, Tq {Tq} > Tk {Tk}?")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != torch.float32 or not t.is_cpu or t.stride(2) != 1:
            raise ValueError(f"{name} must be float32 on CPU with a contiguous last dim, got {t.dtype} on {t.device} "
                             f"with strides {t.stride()}")
    if k.stride() != v.stride():
        k, v = k.contiguous(), v.contiguous()
    if out is None:
        out = torch.empty((Tq, H, D), dtype=torch.float32)
    elif out.shape != (Tq, H, D) or out.dtype != torch.float32 or out.stride(2) != 1:
        raise ValueError(f"out must be float32 [{Tq}, {H}, {D}] with a contiguous last dim, got {out.dtype} "
                         f"{tuple(out.shape)} strides {out.stride()}")
    threads = torch.get_num_threads() if num_threads is None else num_threads
    rc = _fns["prefill"](q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(),  # type: ignore[operator]
                         k.stride(0), k.stride(1), out.data_ptr(), out.stride(1), out.stride(0), H, Hkv, Tq, Tk, D,
                         scale, threads)
    if rc:
        raise (MemoryError if rc == -4 else RuntimeError)(f"attention_amx: {_ERRORS.get(rc, f'error {rc}')}")
    return out
