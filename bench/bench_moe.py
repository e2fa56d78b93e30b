"""Expert parallelism on this machine: smollm2-moe with EP=1 vs EP=2, where a step's time goes, what
the all-to-alls move, how unevenly real text routes, and what MLA saves in KV bytes.

    python -m bench.bench_moe                                  # concurrency 1, 8, 32; 32 new tokens each
    python -m bench.bench_moe --concurrency 32 --max-tokens 64 --json /tmp/moe.json

Path timed: the engine (`LLMEngine.step`), not the mesh. EP=1 is one process with every expert and all the
machine's threads; EP=2 is two spawned processes (gloo over tcp on 127.0.0.1), each holding half of every
layer's experts, owning half of the requests and half of the threads; they step in lockstep (a rank with
nothing scheduled joins the all-to-alls with an empty batch). Both arms run the same prompts — windows of
deepinfer/data/moe_eval.txt, a real text — greedy, `ignore_eos`, the same `max_tokens`, so they generate the
same number of tokens. The run checks the token ids: EP=2 must equal EP=1 (the executor adds each token's
expert outputs in EP=1's order whatever rank computed them), else the run stops as a bug.

Per step (summed over a run, divided by the lockstep steps; under EP=2 the rank that waited least in the
all-to-alls, whose time there is communication, not waiting — the other rank's extra is printed as "wait"):
* dispatch — routing tokens to ranks plus the header and dispatch all-to-alls;
* experts — the routed experts' SwiGLU (under EP=1 timed by wrapping each block's executor);
* combine — the return all-to-all and the per-token sums;
* rest — everything else in the step: attention, projections, norms, router logits, sampling.
The target is all-to-all (dispatch + combine) <= 15% of the step at 32 concurrent.

The expert-load histogram is the group's (counts summed over ranks) for the same run. The KV bytes per
token compare MLA's cached latent with multi-head attention of the same shape, for DeepSeek-V3's published
dimensions (no weights needed: sizes only).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer.config.engine import EngineConfig
from deepinfer.config.kv import KvSpec
from deepinfer.config.model import ModelConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.ep.group import init_ep_group
from deepinfer.engine.models.moe import moe_blocks
from deepinfer.engine.request import SamplingParams
from deepinfer.launch.tuning import tune_malloc
from deepinfer.loading.derive_moe import EVAL_TEXT
from deepinfer.loading.fetch import resolve_model
from deepinfer.loading.weights import load_model_weights
from deepinfer.text.tokenizer import Tokenizer

PROMPT_TOKENS = 96  # each prompt: a window of this many tokens of the text, windows starting 37 tokens apart


@dataclass
class ArmResult:
    ep: int
    concurrency: int
    seconds: float = 0.0  # first step to last, the slowest rank
    tokens: int = 0  # generated, all ranks
    steps: int = 0  # lockstep steps
    step_s: float = 0.0  # time inside step() (under EP=2, of the rank whose split is shown, see run_arm)
    dispatch_s: float = 0.0
    experts_s: float = 0.0
    combine_s: float = 0.0
    a2a_bytes: int = 0  # the most bytes one rank sent by the all-to-alls
    a2a_wait_s: float = 0.0  # the other rank's extra time in the all-to-alls: waiting for the slower rank
    counts: list[list[int]] = field(default_factory=list)  # [moe layers][experts], summed over ranks
    outputs: dict[str, list[int]] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def per_step(self, seconds: float) -> float:
        return 1e3 * seconds / max(1, self.steps)


class TimedExperts:
    """EP=1 only: wraps a block's local executor to time the routed experts (the executor's own
    token counts stay reachable for `LLMEngine.expert_counts`)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seconds = 0.0

    def __call__(self, x: torch.Tensor, routing: Any) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self.inner(x, routing)
        self.seconds += time.perf_counter() - t0
        return out

    def take_counts(self) -> torch.Tensor:
        return self.inner.take_counts()


def prompts(tokenizer: Tokenizer, n: int) -> list[list[int]]:
    ids = tokenizer.encode(EVAL_TEXT.read_text())
    starts = [(i * 37) % (len(ids) - PROMPT_TOKENS) for i in range(n)]
    return [ids[s:s + PROMPT_TOKENS] for s in starts]


def engine_config(threads: int, concurrency: int) -> EngineConfig:
    return EngineConfig(num_threads=threads, max_num_seqs=max(32, concurrency), kv_cache_bytes=512 << 20,
                        enable_prefix_caching=False)


def run_rank(rank: int, size: int, master: str, model: str, concurrency: int, max_tokens: int,
             threads: int, queue: Any) -> None:
    """One arm's rank (size 1: the whole EP=1 arm). Puts its partial ArmResult on `queue`."""
    tune_malloc()  # as every service does at start
    torch.set_num_threads(threads)
    loaded = load_model_weights(model)
    tokenizer = Tokenizer.load(model)
    group = init_ep_group(size, rank, master) if size > 1 else None
    engine = LLMEngine(loaded, tokenizer, engine_config(threads, concurrency), ep_group=group)
    timed: list[TimedExperts] = []
    if group is None:
        for block in moe_blocks(engine.runner.model):
            block.experts = TimedExperts(block.experts)
            timed.append(block.experts)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    mine = [(i, p) for i, p in enumerate(prompts(tokenizer, concurrency)) if i % size == rank]
    for i, p in mine:
        engine.add_request(f"r{i}", p, params)
    result = ArmResult(size, concurrency)
    engine.expert_counts(), engine.ep_stats()  # start the counters here
    flag = torch.zeros(1, dtype=torch.int64)
    if group is not None:  # the ranks finish loading at different times: the clock starts when all have
        dist.barrier(group=group.cpu_group)
    began = time.perf_counter()
    while True:
        if group is not None:  # lockstep: the group steps while any rank has work
            flag[0] = int(engine.has_unfinished())
            dist.all_reduce(flag, group=group.cpu_group)
            if not flag[0]:
                break
        elif not engine.has_unfinished():
            break
        t0 = time.perf_counter()
        for out in engine.step():
            result.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        result.step_s += time.perf_counter() - t0
        result.steps += 1
    result.seconds = time.perf_counter() - began
    result.tokens = sum(len(v) for v in result.outputs.values())
    result.counts = engine.expert_counts().tolist()
    stats = engine.ep_stats()
    if stats is not None:
        result.dispatch_s, result.experts_s, result.combine_s = stats.dispatch_s, stats.compute_s, stats.combine_s
        result.a2a_bytes = stats.dispatch_bytes + stats.combine_bytes
    else:
        result.experts_s = sum(t.seconds for t in timed)
    queue.put((rank, asdict(result)))
    if group is not None:
        group.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_arm(model: str, size: int, concurrency: int, max_tokens: int, cores: int) -> ArmResult:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    master = f"127.0.0.1:{free_port()}"
    threads = max(1, cores // size)
    procs = [ctx.Process(target=run_rank,
                         args=(r, size, master, model, concurrency, max_tokens, threads, queue))
             for r in range(size)]
    for p in procs:
        p.start()
    parts = [ArmResult(**{k: v for k, v in queue.get(timeout=3600)[1].items()}) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise SystemExit(f"a rank exited with {p.exitcode}")
    merged = ArmResult(size, concurrency, seconds=max(p.seconds for p in parts), steps=parts[0].steps)
    # The split shown is the rank that spent least time in the all-to-alls: the last to arrive at them,
    # so its all-to-all time is communication rather than waiting for a slower peer (the critical path).
    critical = min(parts, key=lambda p: p.dispatch_s + p.combine_s)
    merged.step_s, merged.dispatch_s, merged.experts_s, merged.combine_s = (
        critical.step_s, critical.dispatch_s, critical.experts_s, critical.combine_s)
    merged.a2a_wait_s = max(p.dispatch_s + p.combine_s for p in parts) - (critical.dispatch_s + critical.combine_s)
    merged.a2a_bytes = max(p.a2a_bytes for p in parts)
    merged.counts = torch.stack([torch.tensor(p.counts) for p in parts]).sum(0).tolist()
    for p in parts:
        merged.outputs |= p.outputs
    merged.tokens = sum(p.tokens for p in parts)
    return merged


# DeepSeek-V3's published config.json, the keys that size its attention and routing (no weights needed).
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "first_k_dense_replace": 3, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "bos_token_id": 0, "eos_token_id": 1,
}


def kv_bytes_mla_vs_mha() -> dict[str, int]:
    """Bytes per token, every layer, fp32 as this engine caches (bf16 halves both): MLA's latent from the
    engine's own KvSpec for DeepSeek-V3, against multi-head attention caching each head's key (nope + rope
    dims) and value."""
    config = ModelConfig.from_hf_dict(DEEPSEEK_V3)
    mla = config.mla
    assert mla is not None
    spec = KvSpec.for_model(config, 16)
    mha = config.num_layers * config.num_heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim) * 4
    return {"mla_bytes_per_token": spec.bytes_per_token, "mha_bytes_per_token": mha}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-moe")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model = str(resolve_model(args.model))
    rows = []
    print(f"model {args.model} ({Path(model).name}); {args.cores} cores; {args.max_tokens} new tokens per request, "
          f"greedy, ignore_eos; prompts: {PROMPT_TOKENS}-token windows of {EVAL_TEXT.name}")
    print(f"{'conc':>4} {'EP':>2} {'tok/s':>8} {'vs EP1':>7} {'step ms':>8} {'rest':>7} {'dispatch':>8} "
          f"{'experts':>8} {'combine':>8} {'a2a %':>6} {'wait':>6} {'a2a KiB/step':>12} {'same as EP1':>11}")
    for conc in (int(c) for c in args.concurrency.split(",")):
        base = run_arm(model, 1, conc, args.max_tokens, args.cores)
        for arm in (base, run_arm(model, 2, conc, args.max_tokens, args.cores)):
            moe = arm.dispatch_s + arm.experts_s + arm.combine_s
            a2a = arm.dispatch_s + arm.combine_s
            same = sum(arm.outputs[r] == base.outputs[r] for r in base.outputs)
            print(f"{conc:>4} {arm.ep:>2} {arm.tokens_per_s:>8.1f} {arm.tokens_per_s / base.tokens_per_s:>7.2f} "
                  f"{arm.per_step(arm.step_s):>8.1f} {arm.per_step(arm.step_s - moe):>7.1f} "
                  f"{arm.per_step(arm.dispatch_s):>8.1f} {arm.per_step(arm.experts_s):>8.1f} "
                  f"{arm.per_step(arm.combine_s):>8.1f} {100 * a2a / arm.step_s:>6.1f} "
                  f"{arm.per_step(arm.a2a_wait_s):>6.1f} "
                  f"{arm.a2a_bytes / max(1, arm.steps) / 1024:>12.1f} {f'{same}/{len(base.outputs)}':>11}", flush=True)
            row = {k: v for k, v in asdict(arm).items() if k != "outputs"}
            rows.append(row | {"tokens_per_s": arm.tokens_per_s, "requests_equal_ep1": same})
            if arm.ep > 1 and same < len(base.outputs):
                raise SystemExit(f"EP={arm.ep} outputs differ from EP=1 in {len(base.outputs) - same} request(s): "
                                 "a correctness bug")
    counts = torch.tensor(rows[-1]["counts"])
    skew = counts.max(1).values / counts.float().mean(1)
    print(f"\nexpert load (last run, tokens per expert summed over ranks): max/mean per layer "
          f"worst {skew.max():.2f} (layer {int(skew.argmax())}), mean {skew.mean():.2f}")
    for i, row in enumerate(counts.tolist()):
        print(f"  layer {i:2d}: {' '.join(f'{n:5d}' for n in row)}   max/mean {skew[i]:.2f}")
    kv = kv_bytes_mla_vs_mha()
    print(f"\nKV bytes per token, DeepSeek-V3 shape, fp32: MLA {kv['mla_bytes_per_token']:,} vs multi-head "
          f"{kv['mha_bytes_per_token']:,} ({kv['mha_bytes_per_token'] / kv['mla_bytes_per_token']:.0f}x smaller)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": rows, "kv": kv}, indent=2))
    print("reproduce: python -m bench.bench_moe " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
