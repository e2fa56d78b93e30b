"""A decode step's decoder layers in one native call (`decode_layers.c`), and the SwiGLU activation.

`DecodeStack.for_layers(layers)` binds the C loop to the weights of a Llama-family model's layers, handed in as
`LayerWeights` by the model (None when a weight or kernel the loop needs is missing); `stack.run(...)` then
computes a step whose rows are all decode rows (one-token rows and speculative verification rows) through every layer in
one call, or returns None when the step does not fit the loop (prefill chunks, more rows than the small-row
kernels take, tensors off the CPU) and the caller takes its per-op path. The loop calls the same C entry
points the per-op path's wrappers call, in the same order, so the two are bit for bit equal; what it saves
is the per-op path's Python (about 75 us a layer at batch 1 on SmolLM2).

`silu_mul(gate_up)` is silu(gate) * up for gate_up = [gate | up] ([rows, 2I] → [rows, I]): the C function
both paths use on CPU fp32 (so the loop and the per-op MLP agree to the bit), torch's F.silu elsewhere. Its
exp is a polynomial within a few ulp of torch's, not torch's own bits.

Whether a step may take the loop at all is decided once per model runner, by its attention backend (the
native one with `EngineConfig.decode_loop`, see `deepinfer/engine/attention_backend.py`); `run` only checks
that the step fits. `EngineConfig.decode_loop = False` keeps every step on the per-op path (for comparisons).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from deepinfer.kernels import build
from deepinfer.kernels import dense_linear as dl
from deepinfer.kernels import paged_attention as pa
from deepinfer.kernels import quant_linear as ql
from deepinfer.kernels import rms_norm as rn

__all__ = ["DecodeStack", "native_available", "silu_mul", "silu_mul_reference"]

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("decode_layers.c")
_STAGES = ("input norm", "qkv projection", "attention", "o projection", "post-attention norm",
           "gate/up projection", "SwiGLU", "down projection")
_vp, _i64 = ctypes.c_void_p, ctypes.c_int64


class _Kernels(ctypes.Structure):
    _fields_ = [("quant", _vp), ("dense", _vp), ("norm", _vp), ("attn", _vp)]


class _Weight(ctypes.Structure):
    _fields_ = [("data", _vp), ("bias", _vp), ("format", _i64), ("n", _i64), ("k", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _vp), ("post_norm", _vp), ("qkv", _Weight), ("o", _Weight), ("gate_up", _Weight),
                ("down", _Weight)]


_STEP_POINTERS = ("x", "pending", "h", "qkv", "attn", "o", "gu", "act", "cos", "sin", "positions", "slot_blocks",
                  "slot_offsets", "block_tables", "context_lens", "attn_params", "kv")


class _Step(ctypes.Structure):
    _fields_ = [(name, _i64) for name in ("M", "hidden", "q_width", "qkv_width", "intermediate", "num_threads")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float)] + [(name, _vp) for name in _STEP_POINTERS] + [
        ("layer_bytes", _i64), ("v_bytes", _i64), ("fail_layer", _i64), ("fail_stage", _i64)]


def _load(path: Path) -> tuple[ctypes.CDLL, dict[str, object]]:
    lib = build.dlopen_checked(path)
    fn = lib.dk_silu_mul_f32  # gu, ldg, out, ldo, M, I
    fn.argtypes = [_vp, _i64, _vp, _i64, _i64, _i64]
    fn.restype = ctypes.c_int
    loop = lib.dk_decode_layers  # kernels, layers, num_layers, step
    loop.argtypes = [ctypes.POINTER(_Kernels), ctypes.POINTER(_Layer), _i64, ctypes.POINTER(_Step)]
    loop.restype = ctypes.c_int
    return lib, {"silu_mul": fn, "loop": loop}


_loader = build.KernelLoader(_SOURCE, "decode_layers", "decode layer loop", _load, probe_prefix="dk", log=logger,
                             simd=("avx2", "fma"))
_fns = _loader.fns


def native_available() -> bool:
    """Build (cached on disk) and load the kernel; False, with the reason logged once, if it cannot."""
    return bool(_fns) or _loader.available()


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """torch's silu(gate) * up (any device and dtype)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [rows, 2I] = [gate | up] → new [rows, I] (module docstring)."""
    fn = _fns.get("silu_mul") if _fns or _loader.available() else None
    if (fn is None or gate_up.dtype is not torch.float32 or not gate_up.is_cpu or gate_up.dim() != 2
            or gate_up.shape[1] % 2 or gate_up.stride(1) != 1 or gate_up.stride(0) < gate_up.shape[1]):
        return silu_mul_reference(gate_up)
    m, width = gate_up.shape
    out = torch.empty((m, width // 2), dtype=torch.float32)
    if m and fn(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), width // 2, m, width // 2):  # type: ignore[operator]
        raise ValueError(f"silu_mul: bad shape {tuple(gate_up.shape)} or strides {gate_up.stride()}")
    return out


def _weight(w: Any, bias: torch.Tensor | None) -> tuple[_Weight, str] | None:
    """The C description of a projection and its kind ("quant" or "dense"), or None when the loop cannot
    run it the way the per-op path does."""
    if bias is not None and not (bias.dtype is torch.float32 and bias.is_cpu and bias.is_contiguous()
                                 and bias.dim() == 1):
        return None
    b = bias.data_ptr() if bias is not None else None
    if isinstance(w, ql.PackedWeight):
        if not w.blocks.is_cpu:
            return None
        return _Weight(w.blocks.data_ptr(), b, ql.FORMATS[w.format][0], w.out_features, w.in_features), "quant"
    if isinstance(w, torch.Tensor) and w.dtype is torch.float32 and w.is_cpu and w.dim() == 2 and w.is_contiguous():
        return _Weight(w.data_ptr(), b, -1, w.shape[0], w.shape[1]), "dense"
    return None


def _vector_ok(t: Any, n: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype is torch.float32 and t.is_cpu and t.shape == (n,) \
        and t.is_contiguous()


@dataclass(frozen=True)
class LayerWeights:
    """One Llama-family layer as the loop reads it: the two RMSNorm weights, the fused QKV projection (and
    its bias, Qwen2), the output projection and a dense SwiGLU MLP's fused gate/up and down projections.
    A projection is a `PackedWeight` or an fp32 tensor [out, in]. The model hands these in; this module
    knows no model class."""

    input_norm: torch.Tensor
    post_attn_norm: torch.Tensor
    qkv: Any
    qkv_bias: torch.Tensor | None
    o_proj: Any
    gate_up: Any
    down: Any


class DecodeStack:
    """The C layer loop bound to one model's layers (module docstring). It holds pointers into the tensors
    the layers held when it was bound, and references to those tensors, so they outlive it: a layer whose
    weights are replaced afterwards keeps computing with the old ones until the model binds again
    (LlamaModel.decode_stack binds anew when its layer list is a new list)."""

    def __init__(self, table: ctypes.Array, kinds: set[str], hidden: int, intermediate: int,
                 tensors: list[torch.Tensor]) -> None:
        self.num_layers = len(table)
        self._table, self._kinds, self._tensors = table, kinds, tensors
        self.hidden, self.intermediate = hidden, intermediate
        # The kernels' addresses, resolved once: one set per KV dtype (the attention entry point differs).
        quant, dense = ql.entry_point() if "quant" in kinds else None, dl.entry_point() if "dense" in kinds else None
        self._kernels = {dtype: _Kernels(quant=quant, dense=dense, norm=rn.entry_point(),
                                         attn=pa.fused_decode_entry_point(dtype)) for dtype in pa.KV_COMPUTE_DTYPES}

    @classmethod
    def for_layers(cls, layers: Sequence[LayerWeights]) -> DecodeStack | None:
        """Bind to `layers` (each layer's weights, handed in by the model), or None when the loop does not
        apply: a projection neither packed nor contiguous fp32 on the CPU, a norm weight that is not a
        contiguous fp32 vector, or a kernel that cannot be built."""
        if not layers or not native_available() or not pa.native_available():
            return None
        table = (_Layer * len(layers))()
        kinds: set[str] = set()
        tensors: list[torch.Tensor] = []
        hidden = intermediate = 0
        for i, layer in enumerate(layers):
            parts = [_weight(layer.qkv, layer.qkv_bias), _weight(layer.o_proj, None),
                     _weight(layer.gate_up, None), _weight(layer.down, None)]
            if any(p is None for p in parts):
                return None
            (qkv, k1), (o, k2), (gu, k3), (down, k4) = parts  # type: ignore[misc]
            hidden, intermediate = o.n, down.k
            # Every layer the same shapes: the step's buffers are sized once for all of them.
            if not (_vector_ok(layer.input_norm, hidden) and _vector_ok(layer.post_attn_norm, hidden)
                    and qkv.k == hidden and o.n == hidden and gu.k == hidden and gu.n == 2 * intermediate
                    and down.n == hidden and (i == 0 or (qkv.n, o.k, hidden, intermediate)
                                              == (table[0].qkv.n, table[0].o.k, table[0].o.n, table[0].down.k))):
                return None
            kinds |= {k1, k2, k3, k4}
            tensors += [layer.input_norm, layer.post_attn_norm] + [
                w.blocks if isinstance(w, ql.PackedWeight) else w
                for w in (layer.qkv, layer.qkv_bias, layer.o_proj, layer.gate_up, layer.down) if w is not None]
            table[i] = _Layer(layer.input_norm.data_ptr(), layer.post_attn_norm.data_ptr(), qkv, o, gu, down)
        # Every kernel the C loop calls must be loaded: it calls them through these addresses unchecked.
        if ("quant" in kinds and not ql.entry_point()) or ("dense" in kinds and not dl.entry_point()) \
                or not rn.entry_point() or not all(pa.fused_decode_entry_point(d) for d in pa.KV_COMPUTE_DTYPES):
            return None
        return cls(table, kinds, hidden, intermediate, tensors)

    def max_rows(self) -> int:
        """The most rows a step may have for the loop: those the per-op path's `linear` gives the same small-row
        kernels (the packed kernel's route, the dense kernel's rows)."""
        limit = 1 << 30
        if "quant" in self._kinds:
            limit = min(limit, ql.kernel_max_rows())
        if "dense" in self._kinds:
            limit = min(limit, dl.MAX_ROWS)
        return limit

    def run(self, x: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor, meta: Any, cos: torch.Tensor,
            sin: torch.Tensor, scale: float, eps: float, q_width: int) -> torch.Tensor | None:
        """All layers for a step of decode rows: updates the residual stream `x` [T, hidden] in place and
        returns the last MLP's output [T, hidden] (what the per-op loop leaves in `pending`), or None, having
        changed nothing, when the step does not fit the loop (the caller's backend has already chosen the native
        kernels and the loop). kv: the engine's pool [num_blocks, layers, 2,
        block_size, kv_heads, head_dim]. Raises ValueError (MemoryError) as the per-op path's kernels would."""
        T = x.shape[0]
        if (meta.prefills or meta.num_decode != T or not 0 < T <= self.max_rows()
                or x.dtype is not torch.float32 or not x.is_cpu or not x.is_contiguous() or x.shape[1] != self.hidden
                or not kv.is_cpu or kv.dim() != 6 or kv.shape[1] < self.num_layers
                or kv.dtype not in pa.KV_COMPUTE_DTYPES):
            return None
        k0, v0 = kv[:, 0, 0], kv[:, 0, 1]
        D = k0.shape[-1]
        qkv_width = q_width + 2 * k0.shape[2] * D
        if (qkv_width, q_width) != (self._table[0].qkv.n, self._table[0].o.k):  # the C code writes these widths
            raise ValueError(f"decode layers: the pool's heads give q/qkv widths {q_width}/{qkv_width}, the "
                             f"projections {self._table[0].o.k}/{self._table[0].qkv.n}")
        qkv = torch.empty((T, qkv_width), dtype=torch.float32)
        attn = torch.empty((T, q_width // D, D), dtype=torch.float32)
        # The per-op path checks these per layer; every layer's views share shapes and strides.
        params = pa.fused_decode_params(qkv, cos, sin, positions, meta.slot_blocks, meta.slot_offsets, k0, v0,
                                        meta.decode_block_tables, meta.decode_context_lens, attn)
        H, inter, item = self.hidden, self.intermediate, kv.element_size()
        pending = torch.empty((T, H), dtype=torch.float32)
        h, o = torch.empty((T, H), dtype=torch.float32), torch.empty((T, H), dtype=torch.float32)
        gu, act = torch.empty((T, 2 * inter), dtype=torch.float32), torch.empty((T, inter), dtype=torch.float32)
        step = _Step(M=T, hidden=H, q_width=q_width, qkv_width=qkv.shape[1], intermediate=inter,
                     num_threads=torch.get_num_threads(), eps=eps, scale=scale, x=x.data_ptr(),
                     pending=pending.data_ptr(), h=h.data_ptr(), qkv=qkv.data_ptr(), attn=attn.data_ptr(),
                     o=o.data_ptr(), gu=gu.data_ptr(), act=act.data_ptr(), cos=cos.data_ptr(), sin=sin.data_ptr(),
                     positions=positions.data_ptr(), slot_blocks=meta.slot_blocks.data_ptr(),
                     slot_offsets=meta.slot_offsets.data_ptr(), block_tables=meta.decode_block_tables.data_ptr(),
                     context_lens=meta.decode_context_lens.data_ptr(),
                     attn_params=ctypes.cast(ctypes.c_char_p(params), _vp), kv=kv.data_ptr(),
                     layer_bytes=kv.stride(1) * item, v_bytes=kv.stride(2) * item, fail_layer=-1, fail_stage=-1)
        rc = _fns["loop"](ctypes.byref(self._kernels[kv.dtype]), self._table, self.num_layers, ctypes.byref(step))
        if rc:
            stage = _STAGES[step.fail_stage] if 0 <= step.fail_stage < len(_STAGES) else "setup"
            if stage == "attention":
                pa.raise_fused_decode_error(rc, "decode layers", positions, meta.slot_blocks, meta.slot_offsets,
                                            cos, k0, meta.decode_block_tables, meta.decode_context_lens)
            if rc == -4:
                raise MemoryError(f"decode layers: out of memory in layer {step.fail_layer}'s {stage}")
            raise ValueError(f"decode layers: layer {step.fail_layer}'s {stage} refused its arguments (code {rc})")
        return pending
