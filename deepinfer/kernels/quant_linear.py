"""Linear layers that compute straight from GGUF block formats (Q8_0, Q4_0, Q4_1).

`PackedWeight` holds one projection's weight W [out_features, in_features] as the file stores it: each
row is in_features / 32 blocks of 32 weights along the input dimension (layouts in `quant_linear.c`).
`quant_linear(x, packed, num_threads)` computes x @ W^T on CPU with the C kernel (`quant_linear.c`, built
on first use by build.py):
* fewer than GEMM_MIN_ROWS rows (decode batches): the kernel proper, which dequantises the blocks in
  registers; the fp32 matrix is never made. On a CPU with AVX-512F, from 4 rows up to the kernel's
  `ql_group_max_m()` (256) it dequantises 16 weight rows at a time into a cache-resident buffer and runs
  the fp32 kernel's register tiles (`dense_tiles.h`), which beats the GEMM below up to that many rows;
  on AVX2 alone its tile path beats the GEMM up to 128 rows (`ql_kernel_max_m()`, the crossover either way);
* from AMX_MIN_ROWS rows on a CPU with AMX-BF16 (prefill chunks, large batches): the kernel's tile path
  (`quant_amx.h`), which splits activations and weights into bf16 pieces whose products are exact, so it
  computes the fp32 layer's products at 1.3-1.6x torch's fp32 GEMM speed on the dequantised weights;
* more rows elsewhere: the kernel dequantises W, or chunks of it, into a reused per-thread buffer (at
  most GEMM_CHUNK_FLOATS floats) and torch's GEMM multiplies them. At that size the product is
  compute-bound and dequantising costs a few percent of it, so this runs at torch's fp32 speed, which
  on a CPU with AVX-512 is about twice what the kernel's AVX2 micro-kernel reaches
  (bench/bench_quant_linear.py).
`auto_route(rows)` says which of these a call takes; the process-wide AMX switch (`kernels/amx.py`:
`EngineConfig.amx`, DEEPINFER_AMX=0 at the launcher) keeps the tiles out, asked on every call.
When the kernel cannot be built, or x lives on another device (CUDA), W is dequantised with torch
(`quant_linear_reference`).

Invariants: in_features is a multiple of 32 (GGUF guarantees it; anything else is a ValueError);
`blocks` is a contiguous uint8 tensor [out_features, in_features // 32 * block_bytes]; `dequantize()`
gives bit for bit what `deepinfer.loading.gguf.dequantize` gives for the same bytes.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from deepinfer.kernels import build
from deepinfer.kernels.amx import amx_allowed

__all__ = [
    "FORMATS",
    "amx_available",
    "auto_route",
    "entry_point",
    "kernel_max_rows",
    "PackedWeight",
    "native_available",
    "native_info",
    "native_unavailable_reason",
    "quant_linear",
    "quant_linear_reference",
]

logger = logging.getLogger(__name__)

QK = 32
# name → (format code passed to the C kernel, bytes per block of 32 weights)
FORMATS: dict[str, tuple[int, int]] = {"Q8_0": (0, 34), "Q4_0": (1, 18), "Q4_1": (2, 20)}
_GGML_TYPES = {8: "Q8_0", 2: "Q4_0", 3: "Q4_1"}  # GGMLQuantizationType values
_ERRORS = {-1: "K is not a positive multiple of 32", -2: "unknown format", -3: "bad shape or strides",
           -4: "out of memory", -5: "no AMX tiles on this CPU"}

_SOURCE = Path(__file__).with_name("quant_linear.c")
_LIB_STEM = "quant_linear"
_SIMD = ("avx2", "fma", "f16c")
GEMM_MIN_ROWS = 32  # from this many rows of x, dequantise chunks + torch GEMM (measured crossover: 16-64)
# A W of up to GEMM_CHUNK_FLOATS weights is dequantised whole (8 MiB, one GEMM); a larger one (the LM
# head) in chunks of GEMM_SPLIT_FLOATS (2 MiB: measured 10-20% faster at 32 rows than 8 MiB chunks,
# ~7% slower at 256).
GEMM_CHUNK_FLOATS = 1 << 21
GEMM_SPLIT_FLOATS = 1 << 19
AMX_MIN_ROWS = 64  # from this many rows, the AMX tile path where the CPU has it (measured crossover: 48-64)
_scratch = threading.local()  # per-thread fp32 chunk buffer for the GEMM path



@dataclass(frozen=True)
class PackedWeight:
    """One weight matrix in a GGUF block format.

    format: "Q8_0", "Q4_0" or "Q4_1"; blocks: contiguous uint8 [out_features, in_features // 32 *
    block_bytes]; row n holds output feature n's weights, 32 per block, in input order."""

    format: str
    blocks: torch.Tensor
    out_features: int
    in_features: int

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"unsupported format {self.format!r}; supported: {', '.join(FORMATS)}")
        if self.in_features <= 0 or self.in_features % QK:
            raise ValueError(f"in_features must be a positive multiple of {QK}, got {self.in_features}")
        shape = (self.out_features, self.in_features // QK * self.block_bytes)
        b = self.blocks
        if b.dtype != torch.uint8 or tuple(b.shape) != shape or not b.is_contiguous():
            raise ValueError(f"blocks must be a contiguous uint8 tensor of shape {shape}, got {b.dtype} "
                             f"{tuple(b.shape)}{'' if b.is_contiguous() else ' (not contiguous)'}")

    @property
    def block_bytes(self) -> int:
        return FORMATS[self.format][1]

    @property
    def nbytes(self) -> int:
        """Bytes of packed weights (what one pass over W reads)."""
        return self.blocks.numel()

    @classmethod
    def from_raw(cls, raw: np.ndarray | bytes | memoryview | torch.Tensor, qtype: int | str,
                 shape: Sequence[int]) -> PackedWeight:
        """From a GGUF tensor's stored bytes (`GgufTensor.data`), its type (GGMLQuantizationType or
        name) and its shape in numpy order [out_features, in_features] (GGUF's dims reversed).
        The bytes are copied (a reader's data is a read-only memory map)."""
        fmt = _GGML_TYPES.get(int(qtype), f"type {int(qtype)}") if not isinstance(qtype, str) else qtype
        if fmt not in FORMATS:
            raise ValueError(f"unsupported format {fmt!r}; supported: {', '.join(FORMATS)}")
        if len(shape) != 2:
            raise ValueError(f"shape must be [out_features, in_features], got {tuple(shape)}")
        n, k = (int(d) for d in shape)
        if k <= 0 or k % QK:
            raise ValueError(f"in_features must be a positive multiple of {QK}, got {k}")
        if isinstance(raw, torch.Tensor):
            flat = raw.detach().contiguous().view(torch.uint8).reshape(-1).clone()
        else:
            flat = torch.from_numpy(np.array(np.frombuffer(raw, np.uint8) if isinstance(raw, bytes | memoryview)
                                             else np.ascontiguousarray(raw).view(np.uint8).reshape(-1)))
        row = k // QK * FORMATS[fmt][1]
        if flat.numel() != n * row:
            raise ValueError(f"{flat.numel()} bytes of {fmt} cannot hold [{n}, {k}] (needs {n * row})")
        return cls(fmt, flat.reshape(n, row), n, k)

    def dequantize(self) -> torch.Tensor:
        """fp32 [out_features, in_features] on the blocks' device, equal to gguf.dequantize's values."""
        bsz = self.block_bytes
        b = self.blocks.reshape(-1, bsz)  # one row per block

        def half(lo: int) -> torch.Tensor:  # [blocks, 1] fp32 from the f16 at bytes lo, lo + 1
            return b[:, lo:lo + 2].contiguous().view(torch.float16).float()

        d = half(0)
        if self.format == "Q8_0":
            w = d * b[:, 2:].contiguous().view(torch.int8).float()
        else:
            nib = b[:, bsz - QK // 2:]
            q = torch.cat([nib & 0x0F, nib >> 4], dim=1).float()  # low nibbles: elements 0-15
            # Same operations as the numpy dequantiser: one product (Q4_0) or a product then a sum (Q4_1).
            w = d * (q - 8.0) if self.format == "Q4_0" else d * q + half(2)
        return w.reshape(self.out_features, self.in_features)

    def to(self, device: torch.device | str) -> PackedWeight:
        return PackedWeight(self.format, self.blocks.to(device), self.out_features, self.in_features)


# ---------------------------------------------------------------------------------------------
# Build and load


def _build(compiler: str, flags: list[str]) -> Path:
    return _loader.build_one(compiler, flags)


def _load(path: Path) -> tuple[ctypes.CDLL, dict[str, object]]:
    lib = build.dlopen_checked(path)
    fns: dict[str, object] = {}
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    for key, name in (("native", "ql_linear_f32"), ("portable", "ql_linear_f32_portable")):
        fn = getattr(lib, name)
        # x, ldx, w, y, ldy, M, N, K, format, num_threads
        fn.argtypes = [vp, i64, vp, vp, i64, i64, i64, i64, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
        fns[key] = fn
    fn = lib.ql_linear_amx  # same arguments; -5 when the CPU or the OS has no AMX tiles
    fn.argtypes = fns["native"].argtypes
    fn.restype = ctypes.c_int
    lib.ql_amx_ready.restype = ctypes.c_int
    if lib.ql_amx_ready():  # registered where the CPU has tiles; each call asks the switch (`_tiles_on`)
        fns["amx"] = fn
    fn = lib.ql_dequantize_f32  # w, out, N, K, format, num_threads
    fn.argtypes = [vp, vp, i64, i64, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    fns["dequantize"] = fn
    lib.ql_kernel_max_m.restype = ctypes.c_int
    # The kernel beats dequantise + GEMM up to its row limit on this CPU (quant_linear.c): 256 with the
    # AVX-512 group path, 128 on AVX2 alone (where torch's GEMM runs the same AVX2 FMAs).
    # From AMX_MIN_ROWS rows, the tile path beats both where it may run (`_many_rows`).
    fns["gemm_min_rows"] = max(GEMM_MIN_ROWS, lib.ql_kernel_max_m() + 1)
    lib.ql_block_bytes.argtypes = [ctypes.c_int]
    for name, (code, bsz) in FORMATS.items():
        if lib.ql_block_bytes(code) != bsz:
            raise RuntimeError(f"{path}: {name} blocks are {lib.ql_block_bytes(code)} bytes there, {bsz} here")
    return lib, fns


_loader = build.KernelLoader(_SOURCE, _LIB_STEM, "quantized linear kernel", _load, probe_prefix="ql",
                             log=logger, simd=_SIMD)
# The loader's own dicts under the names the code below and the tests use: `_fns` ("native",
# "portable", "dequantize": the ctypes functions) is empty until the kernel is loaded.
_state = _loader.state
_fns = _loader.fns


def native_available() -> bool:
    """Build (once per source/flags, cached on disk) and load the kernel. False, with the reason
    logged once, when there is no C compiler or the build or load fails."""
    # Module globals first, so a test that swaps `_fns` / `_state` decides the answer.
    return bool(_fns) or (not _state["tried"] and _loader.available())


def native_info() -> dict[str, object] | None:
    """Where the loaded kernel came from and how it was built (None when not loaded)."""
    return _loader.info() if _fns else None


def amx_available() -> bool:
    """True when the kernel is loaded with its AMX tile path (the CPU has AMX-BF16, Linux granted the tile
    state) and the process-wide switch lets calls take it (`kernels/amx.py`: `EngineConfig.amx`,
    DEEPINFER_AMX=0 at the launcher)."""
    return native_available() and _tiles_on()


def _tiles_on() -> bool:
    """The loaded kernel registered the tile path and the AMX switch is on (asked per call, so switching it off
    after the kernel loaded holds from the next call)."""
    return "amx" in _fns and amx_allowed()


def _many_rows() -> int:
    """The first row count the auto path takes past the register kernel: AMX_MIN_ROWS where the tiles may run
    (they pack W afresh each call, which fewer rows do not pay back), else the kernel's crossover to
    dequantise + GEMM on this CPU."""
    # `_tiles_on()` inline: this runs on every call of the decode fast path.
    return AMX_MIN_ROWS if "amx" in _fns and amx_allowed() else _fns.get("gemm_min_rows", GEMM_MIN_ROWS)  # type: ignore[return-value]


def auto_route(rows: int) -> str:
    """The path `quant_linear(..., impl="auto")` takes for `rows` rows of CPU fp32 x: "kernel" (registers),
    "amx" (tiles), "gemm" (dequantised chunks + torch) or "torch" (no kernel)."""
    if not native_available():
        return "torch"
    if rows < _many_rows():
        return "kernel"
    return "amx" if _tiles_on() else "gemm"


def entry_point() -> int:
    """The address of `ql_linear_f32` (the kernel route of `quant_linear`) for native callers; 0 without it."""
    return _loader.entry_point("native")


def kernel_max_rows() -> int:
    """The most rows of x `quant_linear(..., impl="auto")` gives the kernel route (`auto_route`): below the
    many-rows route's threshold; 0 without the kernel."""
    return _many_rows() - 1 if native_available() else 0


def native_unavailable_reason() -> str | None:
    """Why `native_available()` returned False (None if it was not tried or succeeded)."""
    return _state["reason"]  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# Entry points


def _check(x: torch.Tensor, packed: PackedWeight) -> None:
    if not x.is_floating_point() or x.dim() < 1 or x.shape[-1] != packed.in_features:
        raise ValueError(f"x must be a floating tensor [..., {packed.in_features}], got {x.dtype} "
                         f"{tuple(x.shape)}")
    if x.device != packed.blocks.device:
        raise ValueError(f"x is on {x.device}, the packed weight on {packed.blocks.device}")


def quant_linear_reference(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """x [..., in_features] @ W^T → [..., out_features], by dequantising W with torch (any device;
    the result has x's dtype)."""
    _check(x, packed)
    return torch.matmul(x, packed.dequantize().to(x.dtype).t())


def quant_linear(x: torch.Tensor, packed: PackedWeight, num_threads: int, *, impl: str = "auto") -> torch.Tensor:
    """x [..., in_features] @ W^T → [..., out_features] (fp32 activations, fp32 sums).

    On CPU, x must be float32; it is read in place when its rows are contiguous, else copied. The
    kernel uses at most `num_threads` threads (one for small problems; below GEMM_MIN_ROWS rows the
    result is the same to the bit for any `num_threads`); the GEMM path's matmul runs on torch's
    intra-op pool (torch.get_num_threads()), as the fp32 layer it replaces would. The kernel shares
    torch's OpenMP runtime, so calling it from the thread that runs torch's ops reuses one team of
    threads (from another thread, libgomp starts a second team for it). `impl`:
    "auto" (kernel below GEMM_MIN_ROWS rows, else dequantised chunks + GEMM; torch when the kernel
    is unavailable), "native" / "portable" (the kernel's SIMD / plain-C path for every row count;
    RuntimeError if it cannot be built), "gemm" (dequantised chunks + GEMM), "torch"
    (`quant_linear_reference`). On other devices it is always the torch path. Raises ValueError on
    bad shapes, dtypes, devices or thread counts."""
    # Fast path for decode (a few contiguous rows, the loaded kernel): the checks below in their
    # cheapest form, since at batch 1 the wrapper's own cost is a sizeable part of a small layer's.
    fn = _fns.get("native") if impl == "auto" else None
    if fn is not None and x.dtype is torch.float32 and x.ndim == 2 and type(num_threads) is int and num_threads >= 1:
        m, k = x.shape
        ldx, unit = x.stride()
        blocks = packed.blocks
        if (0 < m < _many_rows() and k == packed.in_features and unit == 1
                and (ldx >= k or m == 1) and x.is_cpu and blocks.is_cpu):
            n = packed.out_features
            y = torch.empty((m, n), dtype=torch.float32)
            rc = fn(x.data_ptr(), ldx, blocks.data_ptr(), y.data_ptr(), n, m, n, k, FORMATS[packed.format][0],
                    num_threads)
            if rc:
                _raise_on(rc)
            return y
    k, n = packed.in_features, packed.out_features
    if not (x.dtype is torch.float32 and x.is_cpu and x.dim() >= 1 and x.shape[-1] == k and packed.blocks.is_cpu
            and type(num_threads) is int and num_threads >= 1 and impl in _IMPLS):
        _check(x, packed)
        if impl not in _IMPLS:
            raise ValueError(f"impl must be one of {', '.join(_IMPLS)}, got {impl!r}")
        if type(num_threads) is not int or num_threads < 1:
            raise ValueError(f"num_threads must be a positive int, got {num_threads!r}")
        if x.is_cpu:
            raise ValueError(f"x must be float32 on CPU, got {x.dtype}")
        return quant_linear_reference(x, packed)
    if impl == "torch" or not (_fns or native_available()):
        if impl not in ("auto", "torch"):
            raise RuntimeError(f"quantized linear kernel unavailable: {native_unavailable_reason()}")
        return quant_linear_reference(x, packed)
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    m = x2.shape[0]
    # The kernel reads rows of K contiguous floats, ldx apart (ldx >= K when there are several rows).
    if x2.stride(1) != 1 or (m > 1 and x2.stride(0) < k):
        x2 = x2.contiguous()
    code = FORMATS[packed.format][0]
    if impl == "auto" and m >= _many_rows():
        impl = "amx" if _tiles_on() else "gemm"
    if impl == "amx" and not _tiles_on():
        raise RuntimeError("the AMX tile path is unavailable: this CPU has no AMX-BF16, the OS refused the tile "
                           "state, or the AMX switch is off (allow_amx(False): EngineConfig.amx, DEEPINFER_AMX=0)")
    if impl == "gemm":
        y = _dequantize_gemm(x2, packed, code, num_threads)
    else:
        y = torch.empty((m, n), dtype=torch.float32)
        if m and n:
            fn = _fns[impl if impl in ("portable", "amx") else "native"]
            _raise_on(fn(x2.data_ptr(), x2.stride(0), packed.blocks.data_ptr(), y.data_ptr(), n, m, n, k, code,
                         num_threads))
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], n)


_IMPLS = ("auto", "native", "portable", "amx", "gemm", "torch")


def _raise_on(rc: int) -> None:
    if rc == -4:
        raise MemoryError("quant_linear: out of memory")
    if rc != 0:
        raise ValueError(f"quant_linear: {_ERRORS.get(rc, f'error {rc}')}")


def _dequantize_gemm(x2: torch.Tensor, packed: PackedWeight, code: int, num_threads: int) -> torch.Tensor:
    """x2 [M, K] @ W^T, W dequantised by the kernel a chunk of rows at a time into a reused buffer."""
    k, n = packed.in_features, packed.out_features
    rows = n if n * k <= GEMM_CHUNK_FLOATS else max(1, GEMM_SPLIT_FLOATS // k)
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < rows * k:
        buf = _scratch.buf = torch.empty(rows * k, dtype=torch.float32)
    dequantize_rows, row_bytes = _fns["dequantize"], packed.blocks.stride(0)
    base = packed.blocks.data_ptr()
    if rows == n:  # one chunk: multiply straight into the result
        w = buf[: n * k].view(n, k)
        _raise_on(dequantize_rows(base, w.data_ptr(), n, k, code, num_threads))
        return torch.mm(x2, w.t())
    y = torch.empty((x2.shape[0], n), dtype=torch.float32)
    for n0 in range(0, n, rows):
        nc = min(rows, n - n0)
        w = buf[: nc * k].view(nc, k)
        _raise_on(dequantize_rows(base + n0 * row_bytes, w.data_ptr(), nc, k, code, num_threads))
        y[:, n0:n0 + nc] = torch.mm(x2, w.t())
    return y
