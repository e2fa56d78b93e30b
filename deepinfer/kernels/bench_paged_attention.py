"""Micro-benchmark: native paged decode attention vs the torch reference.

    python -m deepinfer.kernels.bench_paged_attention [--batch 32] [--context 400] [--kv-dtype float16] ...

One "step" is `--layers` calls (one per layer, each on that layer's strided view of a single
multi-layer KV tensor, as the engine does). Reports time per step and per call, and the GB/s of
K/V actually read (context tokens × kv_heads × head_dim × bytes per element × 2). `--kv-dtype`
is the cached K/V's dtype (float32, float16, or both: each timed on the same values, fp16 rounded,
and the ratio printed).
"""

from __future__ import annotations

import argparse
import time

import torch

from deepinfer.kernels import (
    native_available,
    native_info,
    native_unavailable_reason,
    paged_decode_attention,
    paged_decode_attention_reference,
)


def _time_step(fn, qs, ks, vs, bt, cl, scale, outs, repeats: int) -> float:
    """Best wall time of one step (all layers) over `repeats` runs."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for layer in range(len(ks)):
            fn(qs[layer], ks[layer], vs[layer], bt, cl, scale, out=outs[layer])
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=400)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--kv-dtype", choices=("float32", "float16", "both"), default="float32")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    B, T, H, KVH, D, bs, L = (args.batch, args.context, args.heads, args.kv_heads, args.head_dim,
                              args.block_size, args.layers)
    per_seq = (T + bs - 1) // bs
    num_blocks = B * per_seq + 8
    kv32 = torch.randn(num_blocks, L, 2, bs, KVH, D).half().float()  # fp16-representable: both dtypes agree
    qs = [torch.randn(B, H, D) for _ in range(L)]
    outs = [torch.empty(B, H, D) for _ in range(L)]
    bt = torch.randperm(num_blocks)[: B * per_seq].reshape(B, per_seq).to(torch.int32).contiguous()
    cl = torch.full((B,), T, dtype=torch.int32)
    scale = D**-0.5
    print(f"B={B} context={T} heads={H} kv_heads={KVH} head_dim={D} block={bs} layers={L} "
          f"threads={torch.get_num_threads()}")
    native = native_available()
    if not native:
        print(f"native kernel unavailable: {native_unavailable_reason()}")
    else:
        info = native_info() or {}
        print(f"kernel: avx2={info.get('avx2')} f16c={info.get('f16c')} openmp={info.get('openmp')} "
              f"({info.get('path')})")
    dtypes = ("float32", "float16") if args.kv_dtype == "both" else (args.kv_dtype,)
    native_ms: dict[str, float] = {}
    for name in dtypes:
        kv = kv32.to(getattr(torch, name))
        ks = [kv[:, i, 0] for i in range(L)]
        vs = [kv[:, i, 1] for i in range(L)]
        kv_bytes = B * T * KVH * D * kv.element_size() * 2  # per call
        print(f"-- KV {name}: tensor {kv.numel() * kv.element_size() / 2**20:.0f} MiB, "
              f"{kv_bytes / 2**20:.2f} MiB read per call")
        if native:
            a = paged_decode_attention(qs[0], ks[0], vs[0], bt, cl, scale)
            r = paged_decode_attention_reference(qs[0], ks[0], vs[0], bt, cl, scale)
            print(f"max |native - reference| = {(a - r).abs().max().item():.2e}")
            _time_step(paged_decode_attention, qs, ks, vs, bt, cl, scale, outs, 2)  # warm-up
            t = _time_step(paged_decode_attention, qs, ks, vs, bt, cl, scale, outs, args.repeats)
            native_ms[name] = t / L * 1e3
            print(f"native:    {t * 1e3:8.2f} ms / {L} calls  ({t / L * 1e6:7.1f} us/call, "
                  f"{kv_bytes * L / t / 1e9:5.1f} GB/s KV read)")
            _print_overhead(ks[0], bt, H, D, scale)
        ref = paged_decode_attention_reference
        _time_step(ref, qs, ks, vs, bt, cl, scale, outs, 1)
        t = _time_step(ref, qs, ks, vs, bt, cl, scale, outs, max(1, args.repeats // 3))
        print(f"reference: {t * 1e3:8.2f} ms / {L} calls  ({t / L * 1e6:7.1f} us/call, "
              f"{kv_bytes * L / t / 1e9:5.1f} GB/s KV read)")
    if len(native_ms) == 2:
        print(f"native fp16 / fp32 time per call: {native_ms['float16'] / native_ms['float32']:.3f} "
              f"(fp32 / fp16 speed-up {native_ms['float32'] / native_ms['float16']:.2f}x)")


def _print_overhead(k: torch.Tensor, bt: torch.Tensor, H: int, D: int, scale: float) -> None:
    """Wrapper overhead: a call with almost no work."""
    tq, tb = torch.randn(1, H, D), bt[:1].contiguous()
    tc, to = torch.ones(1, dtype=torch.int32), torch.empty(1, H, D)
    n = 2000
    for _ in range(100):
        paged_decode_attention(tq, k, k, tb, tc, scale, out=to)
    t0 = time.perf_counter()
    for _ in range(n):
        paged_decode_attention(tq, k, k, tb, tc, scale, out=to)
    print(f"per-call overhead (B=1, context 1): {(time.perf_counter() - t0) / n * 1e6:.1f} us")


if __name__ == "__main__":
    main()
