"""Prefill on AMX tiles: the attention kernel and the fp32 products against torch, then the engine's prefill with
the tile paths on and off, alternated in one process.

    python -m bench.bench_amx_prefill                 # 2 threads, ~3 min
    python -m bench.bench_amx_prefill --rounds 5 --lengths 512 1024 2048 --threads 1

1. Attention (`kernels/attention_amx.c` vs torch's SDPA, fused CPU path): SmolLM2's shape (9 heads over 3 KV heads,
   head_dim 64), causal, for each `--lengths` T: a prompt alone (T queries over T keys) and a chunk of T/2 queries
   after T/2 tokens of context (what chunked prefill and prefix-cache hits run; SDPA takes a boolean mask there).
   Best of 5, ms per layer, and the largest difference from float64 attention for both.
2. fp32 products (`kernels/dense_amx.h` vs torch.mm) on SmolLM2's projections at 128, 256 and 1,024 rows.
3. The engine's prefill of fresh 1,024-token prompts (one per timed run), weights "native" (GGUF blocks) and
   "fp32", with the tile attention (and, for fp32 weights, the tile products) switched off and on, alternated
   `--rounds` times: the ratio of medians is the figure; a fresh prompt each run so no prefix is cached.
Needs a CPU with AMX-BF16 (it says so and stops otherwise).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from bench.bench_engine import load_for, make_prompts, run_engine
from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.kernels import attention_amx
from deepinfer.kernels import dense_linear as dl
from deepinfer.loading.fetch import fetch_smollm2

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
PROJECTIONS = {"qkv 576->960": (960, 576), "o_proj 576->576": (576, 576), "gate_up 576->3072": (3072, 576),
               "down 1536->576": (576, 1536)}


def best_ms(fn, *args, repeats: int = 5) -> float:  # type: ignore[no-untyped-def]
    """Best of `repeats` timed calls of fn(*args) after one untimed, in ms."""
    fn(*args)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def float64_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    tq, tk = q.shape[1], k.shape[1]
    kk, vv = (t.double().repeat_interleave(HEADS // KV_HEADS, 0) for t in (k, v))
    s = torch.einsum("hid,hjd->hij", q.double(), kk) * scale
    s = s.masked_fill(~torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq), float("-inf"))
    return torch.einsum("hij,hjd->hid", torch.softmax(s, -1), vv).transpose(0, 1)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    tq, tk = q.shape[1], k.shape[1]
    if tq == tk:
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale, enable_gqa=True)
    else:
        mask = torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq)
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def attention_rows(lengths: list[int]) -> None:
    print("1. causal attention, SmolLM2 shape (9 heads / 3 KV heads, head_dim 64), ms per layer")
    print(f"{'queries x keys':>16} {'SDPA ms':>9} {'tiles ms':>9} {'SDPA/tiles':>10} {'err SDPA':>9} {'err tiles':>9}")
    g = torch.Generator().manual_seed(0)
    scale = HEAD_DIM**-0.5
    for t in lengths:
        for tq in (t, t // 2):
            q = torch.randn(HEADS, tq, HEAD_DIM, generator=g)
            k, v = (torch.randn(KV_HEADS, t, HEAD_DIM, generator=g) for _ in range(2))
            ref = float64_attention(q, k, v, scale)
            ms_s = best_ms(sdpa, q, k, v, scale)
            ms_t = best_ms(attention_amx.prefill_attention, q, k, v, scale)
            err_s = (sdpa(q, k, v, scale).double() - ref).abs().max().item()
            err_t = (attention_amx.prefill_attention(q, k, v, scale).double() - ref).abs().max().item()
            print(f"{f'{tq} x {t}':>16} {ms_s:9.2f} {ms_t:9.2f} {ms_s / ms_t:10.2f} {err_s:9.1e} {err_t:9.1e}")


def product_rows(threads: int) -> None:
    print("\n2. fp32 products, x [rows, in] @ W^T: torch.mm vs the tiles, ms")
    print(f"{'projection':>18} {'rows':>5} {'torch ms':>9} {'tiles ms':>9} {'torch/tiles':>11}")
    g = torch.Generator().manual_seed(1)
    for name, (n, k) in PROJECTIONS.items():
        w = torch.randn(n, k, generator=g) * 0.05
        for m in (128, 256, 1024):
            x = torch.randn(m, k, generator=g)
            ms_t = best_ms(torch.mm, x, w.t())
            ms_a = best_ms(dl.dense_linear_amx, x, w, threads)
            print(f"{name:>18} {m:5d} {ms_t:9.3f} {ms_a:9.3f} {ms_t / ms_a:11.2f}")


def engine_rows(rounds: int, threads: int) -> None:
    print(f"\n3. engine prefill of fresh 1,024-token prompts, tok/s, tile paths off / on, alternated x {rounds}")
    path = fetch_smollm2()
    saved_attn, saved_mm = attention_amx._fns["prefill"], dl._fns["amx"]
    for mode in ("native", "fp32"):
        loaded = load_for(path, mode)
        engine = LLMEngine(loaded, None, EngineConfig(block_size=16, num_kv_blocks=70 * (2 * rounds + 1) + 16,
                                                      max_num_seqs=8, num_threads=threads, weights=mode))
        prompts = make_prompts(2 * rounds + 1, 1024, 1024, loaded.config.vocab_size, 7)
        run_engine(engine, prompts[:1], 1)  # warm-up
        runs: dict[str, list[float]] = {"off": [], "on": []}
        for i in range(rounds):
            for arm in ("off", "on") if i % 2 == 0 else ("on", "off"):
                attention_amx._fns.pop("prefill", None)
                dl._fns.pop("amx", None)
                if arm == "on":
                    attention_amx._fns["prefill"], dl._fns["amx"] = saved_attn, saved_mm
                prompt = prompts[1 + 2 * i + (arm == "on")]
                runs[arm].append(1024 / run_engine(engine, [prompt], 1)["p50_ttft_s"])
        attention_amx._fns["prefill"], dl._fns["amx"] = saved_attn, saved_mm
        off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
        what = "attention" if mode == "native" else "attention + products"
        print(f"  weights {mode:6s} ({what} on tiles): off {off:7.1f}, on {on:7.1f} tok/s (medians), "
              f"on/off {on / off:.2f}; runs off {[round(r) for r in runs['off']]}, on {[round(r) for r in runs['on']]}")
        del engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not (attention_amx.available() and dl.amx_available()):
        raise SystemExit("this CPU has no AMX-BF16 tiles (or the kernels cannot be built): nothing to compare")
    torch.set_num_threads(args.threads)
    attention_rows(args.lengths)
    product_rows(args.threads)
    engine_rows(args.rounds, args.threads)
    print(f"\nreproduce: python -m bench.bench_amx_prefill --threads {args.threads} --rounds {args.rounds} "
          f"--lengths {' '.join(map(str, args.lengths))}")


if __name__ == "__main__":
    main()
