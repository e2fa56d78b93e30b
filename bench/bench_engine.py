"""End-to-end benchmark: the in-process engine vs transformers `generate` on SmolLM2-135M (fp32), same run.

    python -m bench.bench_engine [--quick] [--concurrency 1,32,128] [--threads N] [--out report.json]

Both sides hold exactly the same (GGUF-dequantised fp32) weights and use the same thread count. For each
concurrency c, c seeded random prompts (128–512 tokens) each generate 128 tokens, all submitted at once.
Caps measured in the same run put the figures in context: the model's linear layers alone (fp32, the faster of
F.linear and the engine's own product)
and a large fp32 matmul. llama-cpp-python, when importable, runs the same GGUF as a second peer.
See bench/README.md for what every figure means.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from deepinfer.engine.config import EngineConfig, ModelConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.fetch import fetch_smollm2
from deepinfer.engine.models.llama import linear as engine_linear
from deepinfer.engine.request import SamplingParams
from deepinfer.engine.weights import LoadedModel, load_model_weights
from tests.engine.oracle import hf_model_from_loaded

FULL = {"concurrency": [1, 32, 128], "new_tokens": 128, "prompt_len": (128, 512), "prefill_len": 1024}
QUICK = {"concurrency": [1, 4], "new_tokens": 16, "prompt_len": (32, 64), "prefill_len": 256}


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def best_time(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _fused_layer(sd: dict[str, torch.Tensor], i: int) -> tuple[torch.Tensor, ...]:
    w = lambda name: sd[f"layers.{i}.{name}"]
    qkv, gate_up = torch.cat([w("q_proj"), w("k_proj"), w("v_proj")]), torch.cat([w("gate_proj"), w("up_proj")])
    return qkv, w("o_proj"), gate_up, w("down_proj")


def _linear_step(mm, layers: list[tuple[torch.Tensor, ...]], head: torch.Tensor,  # type: ignore[no-untyped-def]
                 xh: torch.Tensor, xa: torch.Tensor, xi: torch.Tensor) -> None:
    for qkv, o, gate_up, down in layers:
        mm(xh, qkv)
        mm(xa, o)
        mm(xh, gate_up)
        mm(xi, down)
    mm(xh, head)


def linear_caps(cfg: ModelConfig, sd: dict[str, torch.Tensor], rows: list[int], repeats: int) -> dict[int, float]:
    """Tokens/s if a decode step cost only its linear layers: per layer x@Wqkv, x@Wo, x@Wgate_up, x@Wdown
    (fused like the engine), plus the lm_head for every (sampled) row. Each product is timed both as
    F.linear and as the engine's `linear` (which picks a faster BLAS path for few rows); the cap is the
    faster of the two, so the engine is never measured against a slow baseline."""
    layers = [_fused_layer(sd, i) for i in range(cfg.num_layers)]
    head = sd["embed_tokens"] if cfg.tie_word_embeddings else sd["lm_head"]
    caps = {}
    with torch.inference_mode():
        for r in rows:
            xs = (torch.randn(r, cfg.hidden_size), torch.randn(r, cfg.num_heads * cfg.head_dim),
                  torch.randn(r, cfg.intermediate_size))
            best = min(best_time(lambda xs=xs, mm=mm: _linear_step(mm, layers, head, *xs), repeats)
                       for mm in (F.linear, engine_linear))
            caps[r] = r / best
    return caps


def matmul_ceiling(cfg: ModelConfig, sd: dict[str, torch.Tensor], n: int = 2048) -> dict[str, float]:
    """GFLOP/s of an n×n×n fp32 matmul, and the tokens/s it allows at 2 FLOPs per weight per token."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    gflops = 2 * n**3 / best_time(lambda: a @ b, 5) / 1e9
    params = sum(t.numel() for k, t in sd.items() if k != "embed_tokens")
    if cfg.tie_word_embeddings:
        params += sd["embed_tokens"].numel()  # the lm_head matmul still runs once per token
    return {"gflops": gflops, "matmul_params": params, "tokens_per_s": gflops * 1e9 / (2 * params)}


def run_engine(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    submit, first, last, count = {}, {}, {}, {}
    t0 = time.perf_counter()
    for p in prompts:
        rid = engine.add_request(None, p, params)
        submit[rid], count[rid] = time.perf_counter(), 0
    dec_tokens, dec_time, steps = 0, 0.0, 0
    while engine.has_unfinished():
        s0, comp0, gen0 = time.perf_counter(), engine.stats.tokens_computed, engine.stats.tokens_generated
        outs = engine.step()
        now = time.perf_counter()
        steps += 1
        gen = engine.stats.tokens_generated - gen0
        if gen and engine.stats.tokens_computed - comp0 == gen:  # every row was a single decode token
            dec_tokens, dec_time = dec_tokens + gen, dec_time + now - s0
        for o in outs:
            if o.new_token_ids:
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
                count[o.request_id] += len(o.new_token_ids)
    wall = time.perf_counter() - t0
    assert all(n == new_tokens for n in count.values()), count
    ttft = [first[r] - submit[r] for r in submit]
    decode = [(count[r] - 1) / (last[r] - first[r]) for r in submit if count[r] > 1 and last[r] > first[r]]
    return {
        "p50_ttft_s": statistics.median(ttft),
        "mean_request_decode_tok_s": statistics.mean(decode) if decode else float("nan"),
        "decode_only_tok_s": dec_tokens / dec_time if dec_time else float("nan"),
        "aggregate_tok_s": sum(count.values()) / wall,
        "wall_s": wall,
        "steps": steps,
    }


def hf_generate_time(model, prompts: list[list[int]], new_tokens: int, pad: int) -> float:  # type: ignore[no-untyped-def]
    """Wall time of one left-padded batched greedy `generate` of exactly `new_tokens` tokens."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad, eos_token_id=pad)
        wall = time.perf_counter() - t0
    assert out.shape[1] == width + new_tokens, out.shape
    return wall


def run_hf(model, prompts: list[list[int]], new_tokens: int, pad: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    c = len(prompts)
    full = hf_generate_time(model, prompts, new_tokens, pad)
    one = hf_generate_time(model, prompts, 1, pad)
    return {
        "aggregate_tok_s": c * new_tokens / full,
        "decode_only_tok_s": c * (new_tokens - 1) / (full - one) if full > one else float("nan"),
        "wall_s": full,
        "wall_1_token_s": one,
    }


def hf_prefill(model, prompt: list[int]) -> float:  # type: ignore[no-untyped-def]
    """Prompt tokens/s of one forward pass (logits for the last position only, as generate's prefill)."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        return len(prompt) / best_time(lambda: model(ids, logits_to_keep=1), 1)


def run_llama_cpp(path: Path, decode_prompt: list[int], prefill_prompt: list[int], new_tokens: int,
                  threads: int) -> dict[str, float] | str:
    try:
        import llama_cpp
    except ImportError:
        return "skipped: llama_cpp (llama-cpp-python) is not importable"
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=max(2048, len(prefill_prompt) + 8), n_batch=2048,
                          n_threads=threads, n_threads_batch=threads, verbose=False)

    def timed(prompt: list[int], n: int) -> tuple[float, list[float]]:
        t0, times = time.perf_counter(), []
        for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            times.append(time.perf_counter())
            if len(times) == n:
                break
        return t0, times

    timed(decode_prompt[:32], 4)  # warm-up
    t0, times = timed(decode_prompt, new_tokens)
    p0, ptimes = timed(prefill_prompt, 1)
    return {"decode_tok_s": (len(times) - 1) / (times[-1] - times[0]), "ttft_s": times[0] - t0,
            "prefill_tok_s": len(prefill_prompt) / (ptimes[0] - p0), "weights": "Q4_1 (native, not fp32)"}


def engine_phase(r: dict, loaded: LoadedModel, workloads: dict[int, list[list[int]]],  # type: ignore[type-arg]
                 prefill_prompts: list[list[int]], n_new: int, threads: int) -> None:
    """Every concurrency, then the prefill test, on one engine with KV room for the largest batch."""
    blocks = max(sum(-(-(len(p) + n_new) // 16) for p in ps) for ps in workloads.values())
    plen = len(prefill_prompts[0])
    ecfg = EngineConfig(block_size=16, num_kv_blocks=max(blocks, plen // 16 + 1) + 16,
                        max_num_seqs=max(128, *workloads), num_threads=threads)
    engine = LLMEngine(loaded, None, ecfg)
    r["engine_config"] = dict(vars(ecfg))
    run_engine(engine, make_prompts(2, 16, 32, loaded.config.vocab_size, 12345), 4)  # warm-up
    for c, prompts in workloads.items():
        r["concurrency"][c] = {"engine": run_engine(engine, prompts, n_new)}
    run_engine(engine, prefill_prompts[:1], 1)  # warm-up at the same length
    r["prefill"]["engine_tok_s"] = plen / run_engine(engine, prefill_prompts[1:], 1)["p50_ttft_s"]
    del engine
    gc.collect()


def hf_phase(r: dict, loaded: LoadedModel, workloads: dict[int, list[list[int]]],  # type: ignore[type-arg]
             prefill_prompt: list[int], n_new: int, max_concurrency: int) -> None:
    import transformers

    cfg = loaded.config
    pad = (cfg.eos_token_ids or (0,))[0]
    r["env"]["transformers"] = transformers.__version__
    hf = hf_model_from_loaded(cfg, loaded.state_dict)
    r["env"]["hf_attn_implementation"] = getattr(hf.config, "_attn_implementation", None)
    hf_generate_time(hf, make_prompts(2, 16, 32, cfg.vocab_size, 12345), 4, pad)  # warm-up
    for c, prompts in workloads.items():
        # A padded batch of 128 long prompts takes transformers tens of minutes here: skippable.
        r["concurrency"][c]["transformers"] = run_hf(hf, prompts, n_new, pad) if c <= max_concurrency else {}
    r["prefill"]["transformers_tok_s"] = hf_prefill(hf, prefill_prompt)
    del hf
    gc.collect()


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def ratios(r: dict) -> dict[str, float | None]:  # type: ignore[type-arg]
    out: dict[str, float | None] = {}
    for c, row in r["concurrency"].items():
        e, h = row["engine"], row["transformers"]
        out[f"engine/transformers aggregate c={c}"] = ratio(e["aggregate_tok_s"], h.get("aggregate_tok_s"))
        out[f"engine/transformers decode-only c={c}"] = ratio(e["decode_only_tok_s"], h.get("decode_only_tok_s"))
        out[f"engine decode-only c={c} / linear cap {c} rows"] = ratio(
            e["decode_only_tok_s"], r["caps"]["linear_tok_s"].get(c))
        out[f"engine aggregate c={c} / fp32 matmul ceiling"] = ratio(
            e["aggregate_tok_s"], r["caps"]["matmul"]["tokens_per_s"])
        out[f"engine decode-only c={c} / fp32 matmul ceiling"] = ratio(
            e["decode_only_tok_s"], r["caps"]["matmul"]["tokens_per_s"])
    p = r["prefill"]
    out[f"engine/transformers prefill {p['tokens']} tokens"] = ratio(p["engine_tok_s"], p["transformers_tok_s"])
    lc = r["llama_cpp"]
    if isinstance(lc, dict):
        e1 = r["concurrency"].get(1, {}).get("engine", {})
        out["engine/llama.cpp batch-1 decode"] = ratio(e1.get("mean_request_decode_tok_s"), lc["decode_tok_s"])
        out[f"engine/llama.cpp prefill {p['tokens']} tokens"] = ratio(p["engine_tok_s"], lc["prefill_tok_s"])
    return out


def print_report(r: dict, command: str) -> None:  # type: ignore[type-arg]
    f = lambda v, spec=".1f": "-" if v is None or v != v else format(v, spec)
    print(f"\nSmolLM2-135M fp32, {r['env']['threads']} threads, {r['new_tokens']} new tokens per request")
    head = ("c", "eng p50 TTFT s", "eng req dec t/s", "eng dec-only t/s", "eng agg t/s", "hf dec-only t/s",
            "hf agg t/s")
    print(" | ".join(f"{h:>16}" for h in head))
    for c, row in r["concurrency"].items():
        e, h = row["engine"], row["transformers"]
        vals = (str(c), f(e["p50_ttft_s"], ".3f"), f(e["mean_request_decode_tok_s"]), f(e["decode_only_tok_s"]),
                f(e["aggregate_tok_s"]), f(h.get("decode_only_tok_s")), f(h.get("aggregate_tok_s")))
        print(" | ".join(f"{v:>16}" for v in vals))
    p, caps = r["prefill"], r["caps"]
    print(f"\nprefill {p['tokens']} tokens: engine {f(p['engine_tok_s'])} tok/s, "
          f"transformers {f(p['transformers_tok_s'])} tok/s")
    print("linear-layer cap: " + ", ".join(f"{k} rows {f(v)} tok/s" for k, v in caps["linear_tok_s"].items()))
    m = caps["matmul"]
    print(f"fp32 matmul: {f(m['gflops'])} GFLOP/s -> ceiling {f(m['tokens_per_s'])} tok/s "
          f"({m['matmul_params'] / 1e6:.1f}M weights per token)")
    lc = r["llama_cpp"]
    if isinstance(lc, dict):
        print(f"llama.cpp (Q4_1): batch-1 decode {f(lc['decode_tok_s'])} tok/s, prefill {f(lc['prefill_tok_s'])} tok/s")
    else:
        print(f"llama.cpp: {lc}")
    print("\nratios:")
    for k, v in r["ratios"].items():
        print(f"  {k:<48} {f(v, '.2f')}")
    print(f"\nreproduce: {command}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: c in {1,4}, 16 new tokens, prompts 32-64")
    ap.add_argument("--concurrency", help="comma-separated concurrencies (default 1,32,128; quick 1,4)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="write the JSON report here")
    ap.add_argument("--hf-max-concurrency", type=int, default=1 << 30,
                    help="run transformers only up to this concurrency (its c=128 run takes tens of minutes)")
    ap.add_argument("--no-plots", action="store_true", help="no PNG figures beside the JSON (bench/plots.py)")
    args = ap.parse_args(argv)
    w = dict(QUICK if args.quick else FULL)
    if args.concurrency:
        w["concurrency"] = [int(c) for c in args.concurrency.split(",")]
    conc, n_new, (lo, hi), plen = w["concurrency"], w["new_tokens"], w["prompt_len"], w["prefill_len"]
    command = (f"python -m bench.bench_engine{' --quick' if args.quick else ''} --concurrency "
               f"{','.join(map(str, conc))} --threads {args.threads} --seed {args.seed}"
               + (f" --hf-max-concurrency {args.hf_max_concurrency}" if args.hf_max_concurrency < 1 << 30 else "")
               + (f" --out {args.out}" if args.out else ""))
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    path = fetch_smollm2()
    loaded = load_model_weights(path)
    cfg, sd = loaded.config, loaded.state_dict
    vocab = cfg.vocab_size
    workloads = {c: make_prompts(c, lo, hi, vocab, args.seed * 1000 + c) for c in conc}
    prefill_prompts = make_prompts(2, plen, plen, vocab, args.seed * 1000 + 7)
    r: dict = {"model": str(path), "fingerprint": loaded.fingerprint, "new_tokens": n_new,
               "prompt_len": [lo, hi], "command": command, "concurrency": {}, "prefill": {"tokens": plen},
               "env": {"threads": args.threads, "torch": torch.__version__, "python": platform.python_version(),
                       "machine": platform.machine(), "cpus": os.cpu_count()}}

    print("measuring caps ...", file=sys.stderr)
    r["caps"] = {"linear_tok_s": linear_caps(cfg, sd, sorted({1, 32, *conc}), 1 if args.quick else 10),
                 "matmul": matmul_ceiling(cfg, sd)}
    gc.collect()

    print("engine ...", file=sys.stderr)
    engine_phase(r, loaded, workloads, prefill_prompts, n_new, args.threads)
    print("transformers ...", file=sys.stderr)
    hf_phase(r, loaded, workloads, prefill_prompts[1], n_new, args.hf_max_concurrency)
    print("llama.cpp ...", file=sys.stderr)
    batch1 = make_prompts(1, lo, hi, vocab, args.seed * 1000 + 1)[0]  # = the c=1 workload's prompt
    r["llama_cpp"] = run_llama_cpp(path, batch1, prefill_prompts[1], n_new, args.threads)
    r["ratios"] = ratios(r)
    print_report(r, command)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(r, indent=2, default=str))
        print(f"wrote {args.out}")
        if not args.no_plots:
            from bench import plots

            plots.write("engine", json.loads(json.dumps(r, default=str)), args.out)


if __name__ == "__main__":
    main()
