"""Micro-benchmark: the fp32 few-rows linear kernel (deepinfer/kernels/dense_linear.c) against torch's
BLAS on the same fp32 weights, over all of SmolLM2-135M's projections, by row count.

    python -m bench.bench_dense_linear                    # 2 threads, rows 1 2 4 8 12 17 24 32 48 64 96 128
    python -m bench.bench_dense_linear --rows 1 5 17 --threads 1 --json /tmp/dl.json
    python -m bench.bench_dense_linear --weights native --rows 1 8 17 32 128 256 384    # packed GGUF weights

Weights: SmolLM2-135M's shapes, random fp32 (the values do not change the time): per layer qkv (576→960), o_proj
(576→576), gate_up (576→3072) and down_proj (1536→576), 30 layers, plus the 576→49152 LM head: 538 MB, one
forward's weight stream, so nothing stays in cache between sweeps. A timed sweep calls every weight once on
the same x (rows × in); the figure is the best of `--repeats` sweeps, in ms. Arms, same threads, same x:

* `F.linear`  — torch.nn.functional.linear (the BLAS's GEMM/GEMV);
* `W@x.T`     — torch.mm(W, x.T).T, the orientation models/linear.py used before the kernel where it has none;
* `kernel`    — dense_linear (what models/linear.py uses up to dense_linear.MAX_ROWS rows).

Printed per row count: the three times, kernel vs the better torch arm (>1: the kernel is faster), the kernel's
time relative to its own one-row time (the cost of verifying k drafts at once is this at k + 1 rows), and GB/s
of weights streamed. Results were checked against torch first (max relative difference printed).

`--weights native`: the same sweep over packed GGUF weights (random blocks, Q4_1 for the layers and Q8_0 for the
LM head, as SmolLM2's file holds them: 97 MB), timing `quant_linear` three ways: `gemm` (dequantise, then torch's
GEMM: what the auto path does from GEMM_MIN_ROWS rows), `kernel` (the C kernel at every row count: on AVX-512 the
group path of 4..256 rows, which shares dense_linear's tiles) and `auto` (what the engine runs).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from deepinfer.kernels import dense_linear as dl
from deepinfer.kernels import quant_linear as ql

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD_SHAPE = (49152, 576)


def _weights(layers: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, k, generator=g) * 0.02 for _ in range(layers) for n, k in LAYER_SHAPES]
    return ws + [torch.randn(*HEAD_SHAPE, generator=g) * 0.02]


def _sweep_ms(fn, ws: list, xs: dict[int, torch.Tensor], repeats: int, in_features=lambda w: w.shape[1]) -> float:
    best = float("inf")
    for _ in range(repeats + 1):  # the first sweep warms up
        t = time.perf_counter()
        for w in ws:
            fn(xs[in_features(w)], w)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def _packed_weights(layers: int) -> list[ql.PackedWeight]:
    rng = np.random.default_rng(0)

    def packed(fmt: str, n: int, k: int) -> ql.PackedWeight:
        bsz = ql.FORMATS[fmt][1]
        raw = rng.integers(0, 256, size=n * k // 32 * bsz, dtype=np.uint8)
        blocks = raw.reshape(-1, bsz)
        for lo in (0, 2) if fmt == "Q4_1" else (0,):  # finite f16 scales (and minimums)
            blocks[:, lo:lo + 2] = rng.normal(scale=0.02, size=len(blocks)).astype(np.float16).view(np.uint8) \
                .reshape(-1, 2)
        return ql.PackedWeight.from_raw(raw, fmt, (n, k))

    ws = [packed("Q4_1", n, k) for _ in range(layers) for n, k in LAYER_SHAPES]
    return ws + [packed("Q8_0", *HEAD_SHAPE)]


def _native(args: argparse.Namespace) -> int:
    if not ql.native_available():
        print("quantized linear kernel unavailable; nothing to compare", file=sys.stderr)
        return 1
    ws = _packed_weights(args.layers)
    nbytes = sum(w.blocks.numel() for w in ws)
    print(f"reproduce: python -m bench.bench_dense_linear --weights native --rows {' '.join(map(str, args.rows))} "
          f"--threads {args.threads} --layers {args.layers} --repeats {args.repeats}")
    print(f"kernel: {ql.native_info()}; group path up to {ql._fns.get('gemm_min_rows', ql.GEMM_MIN_ROWS) - 1} "
          f"rows; weights {nbytes / 1e6:.0f} MB packed")
    arms = {arm: (lambda x, w, impl=impl: ql.quant_linear(x, w, args.threads, impl=impl))
            for arm, impl in (("gemm", "gemm"), ("kernel", "native"), ("auto", "auto"))}
    g = torch.Generator().manual_seed(1)
    print(f"{'rows':>5} {'gemm ms':>9} {'kernel ms':>10} {'auto ms':>9} {'gemm/kernel':>12}")
    rows_out = []
    for m in args.rows:
        xs = {k: torch.randn(m, k, generator=g) for k in (576, 1536)}
        t = {name: _sweep_ms(fn, ws, xs, args.repeats, lambda w: w.in_features) for name, fn in arms.items()}
        print(f"{m:>5} {t['gemm']:>9.1f} {t['kernel']:>10.1f} {t['auto']:>9.1f} {t['gemm'] / t['kernel']:>11.2f}x",
              flush=True)
        rows_out.append({"rows": m, **{f"{k}_ms": v for k, v in t.items()}})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "kernel": ql.native_info(), "rows": rows_out}, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 17, 24, 32, 48, 64, 96, 128])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--weights", choices=("fp32", "native"), default="fp32",
                    help="native: packed GGUF blocks through quant_linear (see the module docstring)")
    args = ap.parse_args(argv)
    if args.weights == "native":
        torch.set_num_threads(args.threads)
        return _native(args)
    if not dl.native_available():
        print("dense linear kernel unavailable; nothing to compare", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    ws = _weights(args.layers)
    nbytes = sum(w.numel() for w in ws) * 4
    print(f"reproduce: python -m bench.bench_dense_linear --rows {' '.join(map(str, args.rows))} "
          f"--threads {args.threads} --layers {args.layers} --repeats {args.repeats}")
    print(f"kernel: {dl.native_info()}; torch {torch.__version__}; {platform.processor() or platform.machine()}; "
          f"weights {nbytes / 1e6:.0f} MB fp32")
    arms = {
        "F.linear": lambda x, w: F.linear(x, w),
        "W@x.T": lambda x, w: torch.mm(w, (x.repeat(2, 1) if x.shape[0] == 1 else x).t()),
        "kernel": lambda x, w: dl.dense_linear(x, w, args.threads),
    }
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 576, generator=g)
    ref, got = F.linear(x.double(), ws[0].double()), dl.dense_linear(x, ws[0], args.threads)
    assert got is not None
    print(f"check: max |kernel - float64| / max |float64| = {float((got - ref).abs().max() / ref.abs().max()):.2e}")
    print(f"{'rows':>5} {'F.linear ms':>12} {'W@x.T ms':>10} {'kernel ms':>10} {'kernel/best torch':>18} "
          f"{'vs 1 row':>9} {'kernel GB/s':>12}")
    rows_out, one_row = [], None
    for m in args.rows:
        if m > dl.MAX_ROWS:
            arms_m = {k: v for k, v in arms.items() if k != "kernel"}
        else:
            arms_m = arms
        xs = {k: torch.randn(m, k, generator=g) for k in (576, 1536)}
        t = {name: _sweep_ms(fn, ws, xs, args.repeats) for name, fn in arms_m.items()}
        best_torch = min(t["F.linear"], t["W@x.T"])
        k_ms = t.get("kernel")
        if m == 1 and k_ms is not None:
            one_row = k_ms
        speed = f"{best_torch / k_ms:.2f}x" if k_ms else "(torch)"
        rel = f"{k_ms / one_row:.2f}" if k_ms and one_row else "-"
        gbs = f"{nbytes / k_ms / 1e6:.1f}" if k_ms else "-"
        print(f"{m:>5} {t['F.linear']:>12.1f} {t['W@x.T']:>10.1f} {(k_ms or float('nan')):>10.1f} {speed:>18} "
              f"{rel:>9} {gbs:>12}", flush=True)
        rows_out.append({"rows": m, **{f"{k}_ms": v for k, v in t.items()}})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "kernel": dl.native_info(), "rows": rows_out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
