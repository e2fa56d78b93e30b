"""Micro-benchmark: the GGUF-block linear kernel (deepinfer/kernels/quant_linear.c) vs torch's fp32
matmul on the same weights dequantised, at SmolLM2-135M's projection shapes.

    python -m bench.bench_quant_linear                         # 2 threads, M = 1, 8, 32, 256, 1024, 30 layers
    python -m bench.bench_quant_linear --layers 1              # one layer again and again: hot in cache
    python -m bench.bench_quant_linear --threads 1 --rows 1 8 --json /tmp/ql.json

Weights: q_proj (576→576), qkv (q, k, v stacked: 576→960), up_proj (576→1536), gate_up (gate, up
stacked: 576→3072) and down_proj (1536→576) of the first `--layers` layers, and the LM head (the tied
token embedding, 576→49152, one of it), read from the real SmolLM2 Q4_1 GGUF in the cache when it is
there (Q4_1, the head Q8_0), else random blocks of the same formats and shapes (printed as "random"). A
timed call is one sweep over the layers (each its own weights, as in a forward pass, so the working set
is the model's and not one layer's L2-resident copy), reported per layer. Both arms run with `--threads`
threads (the kernel's `num_threads`, `torch.set_num_threads` for torch), on the same x.

Per shape and row count M: the kernel's path for that many rows (`path`: "kernel" for its register paths,
"amx" for the AMX tiles that compute exact fp32 products from bf16 pieces, "gemm" for dequantised chunks +
torch), µs per call (best of `--samples` samples, each enough calls for ~`--sample-ms`),
the baseline / native ratio (>1: the kernel is faster), the GB/s of packed weights read (for torch at M=1,
of its fp32 weights), and that as a fraction ("of stream") of a streaming read of as many bytes as one
timed sweep reads (torch summing an fp32 buffer; one of `--stream-mib` MiB is printed first, for the
bandwidth from memory). A max relative difference check against torch runs first; the bench stops if it
exceeds 1e-4.

`--interleave`: instead, time steps that alternate a parallel torch op (an add over 2^17 floats, which
torch splits across its OpenMP threads) with one q_proj kernel call, against either alone: whether
switching between torch's parallel regions and the kernel's costs anything beyond the two (both use one
OpenMP runtime in one process: torch's libgomp, which the kernel binds to since torch loads first).

`DEEPINFER_AMX=0` in the environment switches the AMX tiles off for the run (read here, at the bench's edge,
into `kernels.amx.allow_amx`, as the launcher maps it onto `EngineConfig.amx`): the dequantise + GEMM path
for an A/B.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from deepinfer.config.gguf_metadata import open_gguf
from deepinfer.config.paths import default_cache_dir
from deepinfer.kernels import quant_linear as ql
from deepinfer.kernels.amx import allow_amx
from deepinfer.loading.fetch import SMOLLM2_FILE

SHAPES = [  # (label, GGUF tensors whose rows are stacked, default format, out_features, in_features)
    ("q_proj 576->576", ("blk.0.attn_q.weight",), "Q4_1", 576, 576),
    ("qkv 576->960", ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"), "Q4_1", 960, 576),
    ("up_proj 576->1536", ("blk.0.ffn_up.weight",), "Q4_1", 1536, 576),
    ("gate_up 576->3072", ("blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"), "Q4_1", 3072, 576),
    ("down_proj 1536->576", ("blk.0.ffn_down.weight",), "Q4_1", 576, 1536),
    ("lm_head 576->49152", ("token_embd.weight",), "Q8_0", 49152, 576),
]


def _weights(path: Path, layers: int) -> dict[str, tuple[list[ql.PackedWeight], str]]:
    """Each shape's packed weights (one per layer; one LM head) and where they came from."""
    out: dict[str, tuple[list[ql.PackedWeight], str]] = {}
    tensors = {t.name: t for t in open_gguf(path).tensors} if path.exists() else {}
    rng = np.random.default_rng(0)
    for label, parts, fmt, n, k in SHAPES:
        per_layer = [[name.replace("blk.0.", f"blk.{i}.") for name in parts] for i in range(layers)] \
            if parts[0].startswith("blk.") else [list(parts)]
        found = [[tensors[x] for x in names if x in tensors and tensors[x].tensor_type.name == fmt]
                 for names in per_layer]
        if all(len(f) == len(parts) for f in found):
            # Stacking the row-major block arrays of q, k, v (gate, up) stacks their output features.
            out[label] = ([ql.PackedWeight.from_raw(np.concatenate([np.asarray(t.data).reshape(-1) for t in f]),
                                                    fmt, (n, k)) for f in found], "file")
            continue
        packed = []
        for _ in per_layer:
            bsz = ql.FORMATS[fmt][1]
            raw = rng.integers(0, 256, size=n * k // 32 * bsz, dtype=np.uint8)
            blocks = raw.reshape(-1, bsz)
            for lo in (0, 2) if fmt == "Q4_1" else (0,):  # finite scales
                scales = rng.normal(scale=0.02, size=len(blocks)).astype(np.float16)
                blocks[:, lo:lo + 2] = scales.view(np.uint8).reshape(-1, 2)
            packed.append(ql.PackedWeight.from_raw(raw, fmt, (n, k)))
        out[label] = (packed, "random")
    return out


def _time(fn, sample_s: float, samples: int) -> float:
    """Best per-call seconds over `samples` samples of ~sample_s each."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    calls = max(1, int(sample_s / once))
    best = float("inf")
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def _stream_gbs(nbytes: int, sample_s: float, samples: int) -> float:
    """GB/s of torch summing an fp32 buffer of `nbytes` on torch's threads: a streaming-read probe, the
    ceiling a kernel that reads each weight byte once can approach at that working-set size."""
    buf = torch.ones(max(nbytes // 4, 1024), dtype=torch.float32)
    return buf.numel() * 4 / _time(lambda: buf.sum(), sample_s, samples) / 1e9


def _interleave(args: argparse.Namespace) -> int:
    """Per step: a parallel torch add, a q_proj kernel call (one row), or the two in turn."""
    packs, src = _weights(args.model, args.layers)["q_proj 576->576"]
    x = torch.randn(1, packs[0].in_features)
    a, b, out = torch.randn(1 << 17), torch.randn(1 << 17), torch.empty(1 << 17)

    def torch_op() -> None:
        torch.add(a, b, out=out)

    def kernel(i: int) -> None:
        ql.quant_linear(x, packs[i % len(packs)], args.threads)

    def steps(body) -> float:  # µs per step, over one sweep of the layers
        def sweep() -> None:
            for i in range(len(packs)):
                body(i)
        return _time(sweep, args.sample_ms / 1e3, args.samples) / len(packs) * 1e6

    t_torch = steps(lambda i: torch_op())
    t_kernel = steps(kernel)
    t_both = steps(lambda i: (torch_op(), kernel(i)))
    print(f"q_proj weights ({src}), {args.threads} threads, µs per step: torch add {t_torch:.2f}, kernel "
          f"{t_kernel:.2f}, alternating {t_both:.2f} (the sum of the two alone: {t_torch + t_kernel:.2f}; "
          f"excess {t_both - t_torch - t_kernel:+.2f})")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256, 1024])
    p.add_argument("--samples", type=int, default=5)
    p.add_argument("--sample-ms", type=float, default=30.0)
    p.add_argument("--layers", type=int, default=30, help="layers swept per timed call (1: hot in cache)")
    p.add_argument("--model", type=Path, default=default_cache_dir() / "smollm2" / SMOLLM2_FILE)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--interleave", action="store_true", help="time torch ops alternating with kernel calls")
    p.add_argument("--stream-mib", type=int, default=256, help="size of the streaming-read probe's buffer")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    allow_amx(os.environ.get("DEEPINFER_AMX", "1") != "0")  # the one environment override, at this edge
    if not ql.native_available():
        print(f"native kernel unavailable: {ql.native_unavailable_reason()}")
        return 1
    info = ql.native_info() or {}
    stream = _stream_gbs(args.stream_mib << 20, args.sample_ms / 1e3, args.samples)
    print(f"threads={args.threads} layers={args.layers} kernel avx2={info['avx2']} openmp={info['openmp']} "
          f"torch {torch.__version__}; streaming read of {args.stream_mib} MiB: {stream:.1f} GB/s")
    print("native GB/s: packed bytes per call / time; 'of stream': that over a streaming read of the same bytes "
          "as one timed sweep")
    print(f"{'shape':22} {'fmt':5} {'src':6} {'M':>4} {'path':>6} {'native us':>10} {'torch us':>10} "
          f"{'torch/native':>12} {'native GB/s':>11} {'stream GB/s':>11} {'of stream':>9} {'torch GB/s':>10}")
    if args.interleave:
        return _interleave(args)
    rows = []
    for label, (packs, src) in _weights(args.model, args.layers).items():
        ws = [p.dequantize() for p in packs]
        packed, nl = packs[0], len(packs)
        sweep_stream = _stream_gbs(packed.nbytes * nl, args.sample_ms / 1e3, args.samples)

        def native(x: torch.Tensor, packs: list[ql.PackedWeight] = packs) -> None:
            for p in packs:
                ql.quant_linear(x, p, args.threads)

        def fp32(x: torch.Tensor, ws: list[torch.Tensor] = ws) -> None:
            for w in ws:
                torch.nn.functional.linear(x, w)

        for m in args.rows:
            x = torch.randn(m, packed.in_features, generator=torch.Generator().manual_seed(m))
            ref = torch.nn.functional.linear(x, ws[0])
            y = ql.quant_linear(x, packed, args.threads)
            rel = float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
            if rel > 1e-4:
                print(f"{label} M={m}: max relative difference {rel:.2e} > 1e-4")
                return 1
            t_native = _time(lambda x=x: native(x), args.sample_ms / 1e3, args.samples) / nl
            t_torch = _time(lambda x=x: fp32(x), args.sample_ms / 1e3, args.samples) / nl
            native_gbs = packed.nbytes / t_native / 1e9
            row = {"shape": label, "format": packed.format, "source": src, "layers": nl, "rows": m,
                   "path": ql.auto_route(m),
                   "native_us": t_native * 1e6, "torch_us": t_torch * 1e6, "ratio": t_torch / t_native,
                   "max_rel_diff": rel, "native_gbs": native_gbs, "stream_gbs": sweep_stream,
                   "of_stream": native_gbs / sweep_stream, "stream_probe_gbs": stream}
            gbs = f"{native_gbs:11.1f} {sweep_stream:11.1f} {native_gbs / sweep_stream:9.2f}"
            if m == 1:
                row["torch_gbs"] = ws[0].numel() * 4 / t_torch / 1e9
                gbs += f" {row['torch_gbs']:10.1f}"
            rows.append(row)
            print(f"{label:22} {packed.format:5} {src:6} {m:4d} {row['path']:>6} {t_native * 1e6:10.1f} "
                  f"{t_torch * 1e6:10.1f} {t_torch / t_native:12.2f} {gbs}", flush=True)
    if args.json:
        report = {"threads": args.threads, "layers": args.layers, "kernel": info, "rows": rows}
        args.json.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
