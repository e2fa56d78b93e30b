"""End-to-end benchmark: the in-process engine vs transformers `generate` and llama.cpp on SmolLM2-135M, same run.

    python -m bench.bench_engine [--quick] [--concurrency 1,32,128] [--threads N] [--weights native,fp32]
                                 [--out report.json]

All peers run the same GGUF (SmolLM2-135M-Instruct Q4_1) with the same thread count on the same prompts (token
ids, greedy, EOS ignored, the same number of new tokens). The engine runs once per `--weights` mode: "native"
multiplies from the file's packed Q4_1/Q8_0 blocks, "fp32" from the dequantised weights; transformers holds the
dequantised fp32 weights; llama.cpp (llama-cpp-python's C API, `pip install -e '.[bench]'`) computes from the
packed blocks. For each concurrency c, c seeded random prompts (128–512 tokens) each generate 128 tokens, all
submitted at once; then a 1,024-token prefill. Caps measured in the same run put the figures in context: the
model's fp32 linear layers alone, a large fp32 matmul, and a streaming read of memory (the batch-1 bandwidth
fraction = weight bytes read per decoded token × tokens/s ÷ that bandwidth).
See bench/README.md for what every figure means.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import inspect
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from deepinfer.config import engine as engine_config_module
from deepinfer.config.engine import EngineConfig
from deepinfer.config.model import ModelConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.models.llama import linear as engine_linear
from deepinfer.engine.request import SamplingParams
from deepinfer.loading.fetch import fetch_smollm2
from deepinfer.loading.weights import LoadedModel, load_model_weights
from tests.engine.oracle import hf_model_from_loaded

FULL = {"concurrency": [1, 32, 128], "new_tokens": 128, "prompt_len": (128, 512), "prefill_len": 1024}
QUICK = {"concurrency": [1, 4], "new_tokens": 16, "prompt_len": (32, 64), "prefill_len": 256}
LLAMA_CPP_INSTALL = "pip install -e '.[bench]'"


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


# --- weights modes ---------------------------------------------------------------------------------------

def weights_modes_supported() -> tuple[str, ...]:
    """The engine's weights modes this tree knows (EngineConfig.weights); ("fp32",) before packed weights."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    if "weights" not in fields or "weights" not in inspect.signature(load_model_weights).parameters:
        return ("fp32",)
    return tuple(m for m in getattr(engine_config_module, "WEIGHTS_MODES", ("fp32",)) if m != "auto")


def load_for(path: Path, mode: str) -> LoadedModel:
    return load_model_weights(path) if mode == "fp32" else load_model_weights(path, mode)  # type: ignore[call-arg]


# --- bytes per token and memory bandwidth ----------------------------------------------------------------

def weight_nbytes(w: Any) -> int:
    """Bytes one pass over a weight reads: a tensor's nbytes, a PackedWeight's packed blocks, else 0."""
    if isinstance(w, torch.Tensor):
        return w.nbytes
    n = getattr(w, "nbytes", None)
    return n if isinstance(n, int) and hasattr(w, "blocks") else 0


def model_weight_bytes(model: Any) -> int:
    """Weight bytes a Llama-family model's forward reads per decoded token: every tensor or packed weight held
    by its layers (fused QKV, O, fused gate/up, down, norms, biases), the final norm and the LM head. The token
    embedding is excluded (one row is looked up per token) unless it is also the LM head (tied), which counts
    once. Each object counts once however often it is referenced."""
    seen: set[int] = set()

    def count(w: Any) -> int:
        if id(w) in seen:
            return 0
        seen.add(id(w))
        return weight_nbytes(w)

    total = 0
    for layer in model.layers:
        for v in vars(layer).values():
            if isinstance(v, torch.Tensor) or hasattr(v, "blocks"):
                total += count(v)
            elif hasattr(v, "__dict__"):  # the MLP block: its own weights
                total += sum(count(w) for w in vars(v).values())
    return total + count(model.norm) + count(model.lm_head)


def gguf_weight_bytes(path: Path) -> int:
    """The same figure from the GGUF file as llama.cpp reads it: every tensor's stored bytes except the token
    embedding, which counts once when it is also the LM head (no output.weight) and not at all otherwise."""
    from deepinfer.config.gguf_metadata import open_gguf

    reader = open_gguf(path)
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    total = sum(n for name, n in sizes.items() if name != "token_embd.weight")
    return total + (sizes.get("token_embd.weight", 0) if "output.weight" not in sizes else 0)


def stream_bandwidth(mib: int = 512, repeats: int = 5) -> dict[str, float]:
    """Streaming-read memory bandwidth: bytes/s of torch.sum over an fp32 buffer of `mib` MiB (far larger
    than any cache) with the current torch thread count, best of `repeats`."""
    buf = torch.ones(mib * (1 << 20) // 4)
    t = best_time(lambda: buf.sum(), repeats)
    return {"bytes_per_s": buf.nbytes / t, "buffer_mib": mib, "repeats": repeats}


def bandwidth_fraction(bytes_per_token: float | None, tok_s: float | None, bytes_per_s: float | None) -> float | None:
    """(weight bytes read per decoded token × tokens/s) ÷ streaming-read bandwidth: how close batch-1 decode
    runs to the memory-bandwidth limit on its weights (KV and activations not counted)."""
    if not bytes_per_token or not tok_s or not bytes_per_s or tok_s != tok_s:
        return None
    return bytes_per_token * tok_s / bytes_per_s


# --- caps, engine, transformers ---------------------------------------------------------------------------

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


def matmul_gflops(n: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of torch's n×n×n fp32 matmul, best of `repeats` (on the threads torch has been given)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / best_time(lambda: a @ b, repeats) / 1e9


def matmul_ceiling(cfg: ModelConfig, sd: dict[str, torch.Tensor], n: int = 2048) -> dict[str, float]:
    """GFLOP/s of an n×n×n fp32 matmul, and the tokens/s it allows at 2 FLOPs per weight per token."""
    gflops = matmul_gflops(n)
    params = sum(t.numel() for k, t in sd.items() if k != "embed_tokens")
    if cfg.tie_word_embeddings:
        params += sd["embed_tokens"].numel()  # the lm_head matmul still runs once per token
    return {"gflops": gflops, "matmul_params": params, "tokens_per_s": gflops * 1e9 / (2 * params)}


def run_engine(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """All prompts submitted at once, stepped to the end. TTFT and request decode rate per request; decode-only
    over the steps without prefill rows; aggregate = all new tokens / wall. `tokens`: each prompt's new tokens."""
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    submit, first, last, count, tokens = {}, {}, {}, {}, {}
    t0 = time.perf_counter()
    for p in prompts:
        rid = engine.add_request(None, p, params)
        submit[rid], count[rid], tokens[rid] = time.perf_counter(), 0, []
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
                tokens[o.request_id] += o.new_token_ids
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
        "tokens": [tokens[r] for r in submit],
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



# --- llama.cpp ---------------------------------------------------------------------------------------------

def import_llama_cpp() -> tuple[Any, str | None]:
    """(the llama_cpp module, None), or (None, why it was skipped)."""
    try:
        import llama_cpp
    except ImportError as e:
        return None, f"skipped: llama_cpp is not importable ({e}); install with {LLAMA_CPP_INSTALL}"
    return llama_cpp, None


class LlamaCpp:
    """llama.cpp through llama-cpp-python's low-level C API: one model, contexts of n_seq_max sequences,
    greedy decoding (argmax of `llama_get_logits_ith`), no Python sampler in the loop."""

    def __init__(self, lc: Any, path: Path, threads: int, extra_bufts: bool = False) -> None:
        """`extra_bufts`: llama.cpp's extra weight buffer types. On x86 that is AMX for Q4_1/Q8_0 (CPU_REPACK
        has no layout for them), whose mul_mat crashed (SIGSEGV in ggml_backend_amx_mul_mat, ggml-org/llama.cpp
        #20824) on SmolLM2 on this Sapphire Rapids VM; off by default, so llama.cpp runs its AVX2/AVX-512 kernels."""
        self.lc, self.threads = lc, threads
        lc.llama_backend_init()
        self._quiet = lc.llama_log_callback(lambda level, text, user_data: None)  # keep a reference
        lc.llama_log_set(self._quiet, ctypes.c_void_p())
        mp = lc.llama_model_default_params()
        mp.use_extra_bufts = extra_bufts
        self.model = lc.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.ctx, self.batch, self.ctx_params = None, None, {}

    def open(self, n_seq: int, seq_len: int, n_batch: int = 2048) -> None:
        """A fresh context for `n_seq` sequences of up to `seq_len` tokens each, each in its own KV stream
        (kv_unified off: a sequence attends over its own cells only)."""
        self.close_context()
        lc = self.lc
        cp = lc.llama_context_default_params()
        per_seq = -(-(seq_len + 8) // 256) * 256
        cp.n_ctx, cp.n_batch, cp.n_seq_max = per_seq * n_seq, n_batch, n_seq
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.kv_unified = False
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context for {n_seq} x {seq_len} tokens")
        self.n_batch, self.batch = n_batch, lc.llama_batch_init(n_batch, 0, 1)
        self.ctx_params = {"n_ctx": cp.n_ctx, "n_batch": cp.n_batch, "n_ubatch": cp.n_ubatch, "n_seq_max": n_seq,
                           "n_threads": cp.n_threads, "n_threads_batch": cp.n_threads_batch, "kv_unified": False,
                           "flash_attn_type": cp.flash_attn_type, "type_k": cp.type_k, "type_v": cp.type_v}

    def close_context(self) -> None:
        if self.batch is not None:
            self.lc.llama_batch_free(self.batch)
        if self.ctx:
            self.lc.llama_free(self.ctx)
        self.ctx, self.batch = None, None

    def close(self) -> None:
        self.close_context()
        if self.model:
            self.lc.llama_model_free(self.model)
            self.model = None

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, i: int) -> int:
        import numpy as np

        logits = np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
        return int(logits.argmax())

    def generate(self, prompts: list[list[int]], n_new: int) -> dict[str, Any]:
        """Greedy `n_new` tokens for every prompt at once, sequence i = prompts[i], on an emptied KV.
        Prefill decodes one prompt per llama_decode (logits for its last token only, which gives its first new
        token; measured with 1 thread, 8 prompts of 128-512 tokens: 13% less CPU time than packing several
        prompts into one batch of up to 2,048 tokens); then every step decodes one token of every sequence.
        Returns the tokens and the figures `run_engine` reports, measured the same way."""
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        out: list[list[int]] = [[] for _ in prompts]
        first: list[float] = [0.0] * len(prompts)
        t0 = time.perf_counter()
        for s, p in enumerate(prompts):  # one prompt per llama_decode (in n_batch chunks)
            for lo in range(0, len(p), self.n_batch):
                chunk = p[lo:lo + self.n_batch]
                self._decode([(tok, lo + i, s, lo + i == len(p) - 1) for i, tok in enumerate(chunk)])
            out[s].append(self._argmax(len(chunk) - 1))
            first[s] = time.perf_counter()
        prefilled = time.perf_counter()
        for _ in range(n_new - 1):
            self._decode([(out[s][-1], len(p) + len(out[s]) - 1, s, True) for s, p in enumerate(prompts)])
            for s in range(len(prompts)):
                out[s].append(self._argmax(s))
        end = time.perf_counter()
        c = len(prompts)
        decode = [(n_new - 1) / (end - first[s]) for s in range(c) if n_new > 1 and end > first[s]]
        return {
            "tokens": out,
            "p50_ttft_s": statistics.median(f - t0 for f in first),
            "mean_request_decode_tok_s": statistics.mean(decode) if decode else float("nan"),
            "decode_only_tok_s": c * (n_new - 1) / (end - prefilled) if n_new > 1 else float("nan"),
            "aggregate_tok_s": c * n_new / (end - t0),
            "wall_s": end - t0,
        }


def run_llama_cpp(path: Path, workloads: dict[int, list[list[int]]], prefill_prompts: list[list[int]],
                  n_new: int, threads: int, max_concurrency: int, extra_bufts: bool = False) -> dict[str, Any] | str:
    """llama.cpp on the same GGUF, prompts and thread count: every concurrency up to `max_concurrency`
    (c=1 is batch-1 decode), then the prefill test (a warm-up at the same length first, as the engine's)."""
    lc, why = import_llama_cpp()
    if lc is None:
        return why  # type: ignore[return-value]
    peer = LlamaCpp(lc, path, threads, extra_bufts)
    r: dict[str, Any] = {"llama_cpp_python": getattr(lc, "__version__", "?"), "use_extra_bufts": extra_bufts,
                         "concurrency": {}, "contexts": {}}
    warm = make_prompts(2, 16, 32, peer.n_vocab, 12345)
    try:
        for c, prompts in workloads.items():
            if c > max_concurrency:
                continue
            peer.open(c, max(len(p) for p in prompts) + n_new)
            peer.generate(warm[:1] * c, 4)  # warm-up
            res = peer.generate(prompts, n_new)
            r["concurrency"][c], r["contexts"][c] = res, peer.ctx_params
        plen = len(prefill_prompts[0])
        peer.open(1, plen + 1)
        peer.generate(prefill_prompts[:1], 1)  # warm-up at the same length
        r["prefill_tok_s"] = plen / peer.generate(prefill_prompts[1:], 1)["p50_ttft_s"]
        r["contexts"]["prefill"] = peer.ctx_params
    finally:
        peer.close()
    return r


# --- phases ------------------------------------------------------------------------------------------------

def engine_key(mode: str, modes: list[str]) -> str:
    """The report's key for a weights mode's engine rows: "engine" for the first mode (the headline), else
    "engine_<mode>"."""
    return "engine" if mode == modes[0] else f"engine_{mode}"


def engine_phase(r: dict, loaded: LoadedModel, mode: str, key: str,  # type: ignore[type-arg]
                 workloads: dict[int, list[list[int]]], prefill_prompts: list[list[int]], n_new: int,
                 threads: int, kv_cache_dtype: str | None) -> dict[int, list[list[int]]]:
    """Every concurrency, then the prefill test, on one engine with KV room for the largest batch.
    Returns the generated tokens per concurrency (kept out of the report)."""
    blocks = max(sum(-(-(len(p) + n_new) // 16) for p in ps) for ps in workloads.values())
    plen = len(prefill_prompts[0])
    extra: dict[str, Any] = {}
    if mode != "fp32" or "weights" in {f.name for f in dataclasses.fields(EngineConfig)}:
        extra["weights"] = mode
    if kv_cache_dtype:
        extra["kv_cache_dtype"] = kv_cache_dtype
    ecfg = EngineConfig(block_size=16, num_kv_blocks=max(blocks, plen // 16 + 1) + 16,
                        max_num_seqs=max(128, *workloads), num_threads=threads, **extra)
    engine = LLMEngine(loaded, None, ecfg)
    r["engines"][key] = {"weights": mode, "config": dict(vars(ecfg)),
                         "weight_bytes_per_token": model_weight_bytes(engine.runner.model)}
    run_engine(engine, make_prompts(2, 16, 32, loaded.config.vocab_size, 12345), 4)  # warm-up
    tokens = {}
    for c, prompts in workloads.items():
        res = run_engine(engine, prompts, n_new)
        tokens[c] = res.pop("tokens")
        r["concurrency"].setdefault(c, {})[key] = res
    run_engine(engine, prefill_prompts[:1], 1)  # warm-up at the same length
    r["prefill"][f"{key}_tok_s"] = plen / run_engine(engine, prefill_prompts[1:], 1)["p50_ttft_s"]
    del engine
    gc.collect()
    return tokens


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


def same_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy continuations share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b and a == a and b == b else None


def ratios(r: dict) -> dict[str, float | None]:  # type: ignore[type-arg]
    out: dict[str, float | None] = {}
    keys = list(r["engines"])
    label = {k: f"engine[{r['engines'][k]['weights']}]" for k in keys}
    lc = r["llama_cpp"] if isinstance(r["llama_cpp"], dict) else None
    bw = r["caps"]["bandwidth"]["bytes_per_s"]
    p = r["prefill"]
    for k in keys:
        e = label[k]
        if lc:
            lcc = lc["concurrency"]
            if 1 in lcc:
                out[f"{e}/llama.cpp batch-1 decode"] = ratio(
                    r["concurrency"][1][k]["mean_request_decode_tok_s"], lcc[1]["mean_request_decode_tok_s"])
            for c in (c for c in lcc if c > 1):
                out[f"{e}/llama.cpp aggregate c={c}"] = ratio(
                    r["concurrency"][c][k]["aggregate_tok_s"], lcc[c]["aggregate_tok_s"])
                out[f"{e}/llama.cpp decode-only c={c}"] = ratio(
                    r["concurrency"][c][k]["decode_only_tok_s"], lcc[c]["decode_only_tok_s"])
            out[f"{e}/llama.cpp prefill {p['tokens']} tokens"] = ratio(p[f"{k}_tok_s"], lc.get("prefill_tok_s"))
        out[f"{e}/transformers prefill {p['tokens']} tokens"] = ratio(p[f"{k}_tok_s"], p["transformers_tok_s"])
        if 1 in r["concurrency"]:
            out[f"{e} batch-1 bandwidth fraction"] = bandwidth_fraction(
                r["engines"][k]["weight_bytes_per_token"], r["concurrency"][1][k]["mean_request_decode_tok_s"], bw)
        for c, row in r["concurrency"].items():
            h = row.get("transformers", {})
            out[f"{e}/transformers aggregate c={c}"] = ratio(row[k]["aggregate_tok_s"], h.get("aggregate_tok_s"))
            out[f"{e}/transformers decode-only c={c}"] = ratio(row[k]["decode_only_tok_s"], h.get("decode_only_tok_s"))
            out[f"{e} aggregate c={c} / fp32 matmul ceiling"] = ratio(
                row[k]["aggregate_tok_s"], r["caps"]["matmul"]["tokens_per_s"])
            out[f"{e} decode-only c={c} / fp32 linear cap {c} rows"] = ratio(
                row[k]["decode_only_tok_s"], r["caps"]["linear_tok_s"].get(c))
    if lc and 1 in lc["concurrency"]:
        out["llama.cpp batch-1 bandwidth fraction"] = bandwidth_fraction(
            lc["weight_bytes_per_token"], lc["concurrency"][1]["mean_request_decode_tok_s"], bw)
    return out


def print_report(r: dict, command: str) -> None:  # type: ignore[type-arg]
    f = lambda v, spec=".1f": "-" if v is None or v != v else format(v, spec)
    keys = list(r["engines"])
    names = {k: f"engine {r['engines'][k]['weights']}" for k in keys}
    lc = r["llama_cpp"] if isinstance(r["llama_cpp"], dict) else None
    print(f"\nSmolLM2-135M-Instruct ({Path(r['model']).name}), {r['env']['threads']} threads, "
          f"{r['new_tokens']} new tokens per request, prompts of {r['prompt_len'][0]}-{r['prompt_len'][1]} tokens")
    head = ("c", "peer", "p50 TTFT s", "req decode t/s", "decode-only t/s", "aggregate t/s")
    print(" | ".join(f"{h:>16}" for h in head))
    for c, row in r["concurrency"].items():
        peers = [(names[k], row[k]) for k in keys] + [("transformers", row.get("transformers", {}))]
        if lc and c in lc["concurrency"]:
            peers.append(("llama.cpp", lc["concurrency"][c]))
        for name, e in peers:
            vals = (str(c), name, f(e.get("p50_ttft_s"), ".3f"), f(e.get("mean_request_decode_tok_s")),
                    f(e.get("decode_only_tok_s")), f(e.get("aggregate_tok_s")))
            print(" | ".join(f"{v:>16}" for v in vals))
    p, caps = r["prefill"], r["caps"]
    print(f"\nprefill {p['tokens']} tokens (tok/s): " + ", ".join(
        [f"{names[k]} {f(p[f'{k}_tok_s'])}" for k in keys] + [f"transformers {f(p['transformers_tok_s'])}"]
        + ([f"llama.cpp {f(lc.get('prefill_tok_s'))}"] if lc else [])))
    bw = caps["bandwidth"]["bytes_per_s"]
    print(f"streaming read: {bw / 1e9:.2f} GB/s ({caps['bandwidth']['buffer_mib']} MiB torch.sum, best of "
          f"{caps['bandwidth']['repeats']}); weight bytes per decoded token: " + ", ".join(
              [f"{names[k]} {r['engines'][k]['weight_bytes_per_token'] / 1e6:.1f} MB" for k in keys]
              + ([f"llama.cpp {lc['weight_bytes_per_token'] / 1e6:.1f} MB"] if lc else [])))
    print("fp32 linear-layer cap: " + ", ".join(f"{k} rows {f(v)} tok/s" for k, v in caps["linear_tok_s"].items()))
    m = caps["matmul"]
    print(f"fp32 matmul: {f(m['gflops'])} GFLOP/s -> ceiling {f(m['tokens_per_s'])} tok/s "
          f"({m['matmul_params'] / 1e6:.1f}M weights per token)")
    if lc:
        agree = ", ".join(f"{names[k]} c={c} {f(v, '.2f')}" for k, by_c in r["greedy_agreement"].items()
                          for c, v in by_c.items())
        print(f"llama.cpp {lc['llama_cpp_python']}: contexts {lc['contexts']}")
        print(f"greedy tokens shared with llama.cpp before the first difference (fraction): {agree}")
    else:
        print(f"llama.cpp: {r['llama_cpp']}")
    print("\nratios:")
    for k, v in r["ratios"].items():
        print(f"  {k:<58} {f(v, '.2f')}")
    print(f"\nreproduce: {command}")


def main(argv: list[str] | None = None) -> None:
    supported = weights_modes_supported()
    default_modes = ",".join(m for m in ("native", "fp32") if m in supported)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: c in {1,4}, 16 new tokens, prompts 32-64")
    ap.add_argument("--concurrency", help="comma-separated concurrencies (default 1,32,128; quick 1,4)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--weights", default=default_modes,
                    help=f"comma-separated engine weights modes, one engine run each, the first the headline "
                         f"(default {default_modes}; this tree knows {', '.join(supported)})")
    ap.add_argument("--kv-cache-dtype", help="the engine's KV cache dtype (fp32, fp16; default: the engine's)")
    ap.add_argument("--out", type=Path, help="write the JSON report here")
    ap.add_argument("--hf-max-concurrency", type=int, default=1 << 30,
                    help="run transformers only up to this concurrency (its c=128 run takes tens of minutes)")
    ap.add_argument("--llama-cpp-max-concurrency", type=int, default=32,
                    help="run llama.cpp only up to this concurrency (default 32)")
    ap.add_argument("--llama-cpp-extra-bufts", action="store_true",
                    help="let llama.cpp use its extra weight buffer types (AMX on x86; it crashed here)")
    ap.add_argument("--no-plots", action="store_true", help="no PNG figures beside the JSON (bench/plots.py)")
    args = ap.parse_args(argv)
    modes = [m for m in args.weights.split(",") if m]
    if not modes or any(m not in supported for m in modes):
        ap.error(f"--weights {args.weights}: each mode must be one of {', '.join(supported)}")
    if args.kv_cache_dtype and "kv_cache_dtype" not in {f.name for f in dataclasses.fields(EngineConfig)}:
        ap.error("--kv-cache-dtype: this engine has no kv_cache_dtype setting")
    w = dict(QUICK if args.quick else FULL)
    if args.concurrency:
        w["concurrency"] = [int(c) for c in args.concurrency.split(",")]
    conc, n_new, (lo, hi), plen = w["concurrency"], w["new_tokens"], w["prompt_len"], w["prefill_len"]
    command = (f"python -m bench.bench_engine{' --quick' if args.quick else ''} --concurrency "
               f"{','.join(map(str, conc))} --threads {args.threads} --seed {args.seed} --weights {','.join(modes)}"
               + (f" --kv-cache-dtype {args.kv_cache_dtype}" if args.kv_cache_dtype else "")
               + (f" --hf-max-concurrency {args.hf_max_concurrency}" if args.hf_max_concurrency < 1 << 30 else "")
               + (f" --llama-cpp-max-concurrency {args.llama_cpp_max_concurrency}"
                  if args.llama_cpp_max_concurrency != 32 else "")
               + (" --llama-cpp-extra-bufts" if args.llama_cpp_extra_bufts else "")
               + (f" --out {args.out}" if args.out else ""))
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    path = fetch_smollm2()
    loaded = load_for(path, "fp32")  # transformers and the caps hold the dequantised fp32 weights
    cfg, sd = loaded.config, loaded.state_dict
    vocab = cfg.vocab_size
    workloads = {c: make_prompts(c, lo, hi, vocab, args.seed * 1000 + c) for c in conc}
    prefill_prompts = make_prompts(2, plen, plen, vocab, args.seed * 1000 + 7)
    r: dict = {"model": str(path), "fingerprint": loaded.fingerprint, "new_tokens": n_new,
               "prompt_len": [lo, hi], "command": command, "concurrency": {}, "prefill": {"tokens": plen},
               "engines": {}, "greedy_agreement": {},
               "env": {"threads": args.threads, "torch": torch.__version__, "python": platform.python_version(),
                       "machine": platform.machine(), "cpus": os.cpu_count()}}

    print("measuring caps ...", file=sys.stderr)
    r["caps"] = {"linear_tok_s": linear_caps(cfg, sd, sorted({1, 32, *conc}), 1 if args.quick else 10),
                 "matmul": matmul_ceiling(cfg, sd),
                 "bandwidth": stream_bandwidth(repeats=3 if args.quick else 10)}
    gc.collect()

    tokens = {}
    for mode in modes:
        print(f"engine ({mode} weights) ...", file=sys.stderr)
        key = engine_key(mode, modes)
        tokens[key] = engine_phase(r, loaded if mode == "fp32" else load_for(path, mode), mode, key, workloads,
                                   prefill_prompts, n_new, args.threads, args.kv_cache_dtype)
        gc.collect()
    print("transformers ...", file=sys.stderr)
    hf_phase(r, loaded, workloads, prefill_prompts[1], n_new, args.hf_max_concurrency)
    print("llama.cpp ...", file=sys.stderr)
    lc = run_llama_cpp(path, workloads, prefill_prompts, n_new, args.threads, args.llama_cpp_max_concurrency,
                       args.llama_cpp_extra_bufts)
    if isinstance(lc, dict):
        lc["weight_bytes_per_token"] = gguf_weight_bytes(path)
        for c, res in lc["concurrency"].items():
            theirs = res.pop("tokens")
            for key, by_c in tokens.items():
                shared = [same_prefix(a, b) for a, b in zip(by_c[c], theirs)]
                r["greedy_agreement"].setdefault(key, {})[c] = sum(shared) / (len(shared) * n_new)
    else:
        print(lc, file=sys.stderr)
    r["llama_cpp"] = lc
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
