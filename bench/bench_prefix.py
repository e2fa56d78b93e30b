"""Prefix-cache benchmark on SmolLM2-135M (fp32): time to first token of a long prompt whose prefix is cached in
each tier, against computing the whole prompt (a miss) in the same run.

    python -m bench.bench_prefix [--model smollm2] [--threads 2] [--prompt-tokens 2048] [--cached-tokens 2032]
                                 [--repeats 3] [--cache-dir DIR] [--no-wire] [--out bench/results/prefix.json]

Cases, all on one engine, each with a cache salt of its own so that no device block of another case can help:

* miss: the whole prompt computed (add_request with max_tokens=1, step until it finishes);
* device: the same prompt and salt right after the miss, the prefix still in the engine's pool (reference);
* dram: the worker's path with the prefix in the cache daemon's DRAM tier: TieredStore.read, a tensor per
  block by the daemon's own `KvCacheService._read`, `import_cached_blocks(..., "host")`, then the prompt's
  last tokens computed and the first token sampled; timed from the device lookup to the first token;
* dram+zmq: the same, the fetch going over a real ipc:// DEALER → ROUTER pair (CacheFetch → CacheBlocks);
* nvme: as dram, the blocks only in a disk tier (its host tier has no room) whose files were dropped from the
  page cache (posix_fadvise DONTNEED) just before.

The KV written into the stores is the engine's own, exported once from a computed prompt (a block's KV does not
depend on the salt, only its name does). One warm-up round, then --repeats rounds, cases interleaved within a
round; medians over rounds. See bench/README.md for what every figure means.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import mmap
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import zmq

from deepinfer.cache.store import TieredStore
from deepinfer.config.engine import EngineConfig
from deepinfer.config.kv import KvSpec
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import SamplingParams, Usage
from deepinfer.launch.tuning import tune_malloc
from deepinfer.protocol import messages as m
from deepinfer.protocol.sockets import make_dealer, make_router, recv_msg, recv_routed, send_msg
from deepinfer.services.cache_client import FETCH_DEADLINE_S
from deepinfer.services.kvcache import KvCacheService

BLOCK = 16
CASES = ("miss", "device", "dram", "dram+zmq", "nvme")
TARGETS = {"dram": 25.0, "dram+zmq": 25.0, "nvme": 10.0}  # prefill throughput / the miss's
PARTS = ("lookup_s", "read_s", "assemble_s", "wire_s", "import_s", "prefill_s", "ttft_s")

Fetch = Callable[[list[bytes]], tuple[m.CacheBlocks, dict[str, float]]]


def make_prompt(n: int, low: int, vocab: int, seed: int) -> list[int]:
    """Seeded random token ids in [low, vocab): above SmolLM2's special tokens."""
    rng = random.Random(seed)
    return [rng.randrange(low, vocab) for _ in range(n)]


# --- the engine side ----------------------------------------------------------------------------------------------


def first_token(engine: LLMEngine, prompt: list[int], salt: str) -> tuple[int, Usage]:
    """Submit `prompt` for one greedy token and step until it is out."""
    rid = engine.add_request(None, prompt, SamplingParams(max_tokens=1, ignore_eos=True), cache_salt=salt)
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out.token_ids[0], out.usage
    raise RuntimeError(f"request {rid} never finished")


def computed(engine: LLMEngine, prompt: list[int], salt: str) -> dict[str, Any]:
    """A miss (or, with a salt already computed, a device hit): submit → first token."""
    t0, c0 = time.perf_counter(), time.process_time()
    token, usage = first_token(engine, prompt, salt)
    ttft = time.perf_counter() - t0
    return {"ttft_s": ttft, "prefill_s": ttft, "cpu_s": time.process_time() - c0, "token": token,
            "cached_by_tier": usage.cached_by_tier}


def import_runs(engine: LLMEngine, reply: m.CacheBlocks) -> int:
    """As the worker's CacheClient._import: each run of blocks from one tier, holding the chain before it."""
    head: list[bytes] = []
    imported = start = 0
    for i in range(1, len(reply.tiers) + 1):
        if i == len(reply.tiers) or reply.tiers[i] != reply.tiers[start]:
            n = engine.import_cached_blocks(reply.block_hashes[start:i], reply.blocks[start:i], reply.tiers[start],
                                            keep_resident=head)
            imported += n
            if n < i - start:
                break
            head += reply.block_hashes[start:i]
            start = i
    return imported


def tier_hit(engine: LLMEngine, prompt: list[int], salt: str, n_blocks: int, fetch: Fetch) -> dict[str, Any]:
    """The worker's path for a prefix held by the cache daemon: device lookup, fetch, import, then prefill what
    is left and sample. Timed from the lookup to the first token."""
    hashes = engine.block_hashes(prompt, salt)[:n_blocks]
    t0, c0 = time.perf_counter(), time.process_time()
    on_device = engine.cached_prefix_blocks(hashes)  # CacheClient.load_prefix asks this first
    t1 = time.perf_counter()
    if on_device:
        raise RuntimeError(f"{on_device} blocks of salt {salt!r} already on the device: not a tier hit")
    reply, parts = fetch(hashes)
    t2 = time.perf_counter()
    imported = import_runs(engine, reply) if reply.blocks else 0
    t3 = time.perf_counter()
    token, usage = first_token(engine, prompt, salt)
    t4 = time.perf_counter()
    return {"ttft_s": t4 - t0, "cpu_s": time.process_time() - c0, "lookup_s": t1 - t0, **parts,
            "import_s": t3 - t2, "prefill_s": t4 - t3, "blocks_served": len(reply.block_hashes),
            "blocks_imported": imported, "stop_reason": reply.reason,
            "token": token, "cached_by_tier": usage.cached_by_tier}


# --- the cache daemon side ----------------------------------------------------------------------------------------


class TimedStore:
    """A TieredStore whose `read` is timed: the rest of the daemon's `_read` is laying the blocks out."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self.read_s = 0.0

    def read(self, hashes: list[bytes], deadline: float | None = None) -> Any:
        t0 = time.perf_counter()
        try:
            return self.store.read(hashes, deadline)
        finally:
            self.read_s = time.perf_counter() - t0


def daemon_read(store: TieredStore, kv_spec: KvSpec, hashes: list[bytes]) -> tuple[m.CacheBlocks, float,
                                                                                               float]:
    """What the daemon's I/O thread does for a CacheFetch: the real `KvCacheService._read`, run on a stand-in
    holding only what it uses, with the worker's deadline. Returns (reply, store.read seconds, all seconds)."""
    timed = TimedStore(store)
    daemon = SimpleNamespace(store=timed, kv=kv_spec)
    t0 = time.perf_counter()
    reply = KvCacheService._read(daemon, "bench/fetch", hashes, time.monotonic() + FETCH_DEADLINE_S)  # type: ignore[arg-type]
    return reply, timed.read_s, time.perf_counter() - t0


def local_fetch(store: TieredStore, kv_spec: KvSpec) -> Fetch:
    def fetch(hashes: list[bytes]) -> tuple[m.CacheBlocks, dict[str, float]]:
        reply, read_s, all_s = daemon_read(store, kv_spec, hashes)
        return reply, {"read_s": read_s, "assemble_s": all_s - read_s}

    return fetch


@contextlib.contextmanager
def wire_fetch(store: TieredStore, kv_spec: KvSpec) -> Iterator[Fetch]:
    """The fetch over ipc://: the worker's DEALER sends CacheFetch, the daemon's ROUTER answers CacheBlocks (the
    KV as one zero-copy frame, decoded to a tensor aliasing it). Both ends in this thread, one after the other,
    as bench_mesh moves KV; the daemon's part is `daemon_read`, the rest is wire."""
    ctx, run_dir = zmq.Context(), tempfile.mkdtemp(prefix="diprefix-")
    rx = make_router(ctx, f"ipc://{run_dir}/kvcache.sock")
    tx = make_dealer(ctx, f"ipc://{run_dir}/kvcache.sock", b"worker-0")

    def fetch(hashes: list[bytes]) -> tuple[m.CacheBlocks, dict[str, float]]:
        t0 = time.perf_counter()
        send_msg(tx, m.CacheFetch("bench/fetch", hashes, FETCH_DEADLINE_S, store.namespace_id))
        peer, req = recv_routed(rx)
        reply, read_s, all_s = daemon_read(store, kv_spec, req.block_hashes)
        send_msg(rx, reply, peer)
        got = recv_msg(tx)
        return got, {"read_s": read_s, "assemble_s": all_s - read_s, "wire_s": time.perf_counter() - t0 - all_s}

    try:
        yield fetch
    finally:
        tx.close(linger=0)
        rx.close(linger=0)
        ctx.term()
        shutil.rmtree(run_dir, ignore_errors=True)


def put_blocks(store: TieredStore, hashes: list[bytes], kv: torch.Tensor) -> None:
    """Store `kv` (block i named hashes[i]) as the daemon's CacheStore does, then drain write-behind to disk."""
    raw = memoryview(kv.contiguous().numpy()).cast("B")
    nb = store.block_nbytes
    stored, _ = store.write(hashes, [raw[i * nb:(i + 1) * nb] for i in range(len(hashes))])
    store.flush()
    if stored != len(hashes):
        raise RuntimeError(f"the store kept {stored} of {len(hashes)} blocks: {store.stats()}")


def resident_fraction(paths: list[Path]) -> float | None:
    """Fraction of the files' pages in the page cache (mincore on a private mapping; nothing is read)."""
    try:
        mincore = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    resident = total = 0
    for p in paths:
        with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
            pages = -(-len(mm) // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            anchor = ctypes.c_char.from_buffer(mm)
            try:
                if mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(len(mm)), vec):
                    return None
            finally:
                del anchor
            resident += sum(b & 1 for b in vec)
            total += pages
    return resident / total if total else None


def raw_cold_read(store: TieredStore, paths: list[Path]) -> float:
    """Seconds to read the files whole after dropping them from the page cache: no verification, no bookkeeping."""
    store.drop_page_cache()
    t0 = time.perf_counter()
    for p in paths:
        p.read_bytes()
    return time.perf_counter() - t0


# --- the run ------------------------------------------------------------------------------------------------------


def one_round(tag: str, engine: LLMEngine, prompt: list[int], n_blocks: int, kv: torch.Tensor,
              dram: TieredStore, disk: TieredStore, wire: Fetch | None) -> dict[str, dict[str, Any]]:
    salt = lambda case: f"{tag}/{case}"
    names = lambda case: engine.block_hashes(prompt, salt(case))[:n_blocks]
    row: dict[str, dict[str, Any]] = {}
    gc.collect()
    row["miss"] = computed(engine, prompt, salt("miss"))
    row["device"] = computed(engine, prompt, salt("miss"))
    for case, fetch in (("dram", local_fetch(dram, engine.kv_spec)), ("dram+zmq", wire)):
        if fetch is None:
            continue
        put_blocks(dram, names(case), kv)
        gc.collect()
        row[case] = tier_hit(engine, prompt, salt(case), n_blocks, fetch)
    hashes = names("nvme")
    put_blocks(disk, hashes, kv)
    assert disk.disk is not None
    paths = [disk.disk.path_of(h) for h in hashes]
    advised = disk.drop_page_cache()
    resident = resident_fraction(paths)
    gc.collect()
    row["nvme"] = tier_hit(engine, prompt, salt("nvme"), n_blocks, local_fetch(disk, engine.kv_spec))
    file_bytes = sum(p.stat().st_size for p in paths)
    row["nvme"].update(files_advised=advised, resident_after_drop=resident, file_bytes=file_bytes,
                       read_gb_s=file_bytes / row["nvme"]["read_s"] / 1e9,
                       raw_cold_read_gb_s=file_bytes / raw_cold_read(disk, paths) / 1e9)
    return row


def summarize(rounds: list[dict[str, dict[str, Any]]], prompt_tokens: int) -> dict[str, dict[str, Any]]:
    miss = statistics.median(r["miss"]["ttft_s"] for r in rounds)
    out: dict[str, dict[str, Any]] = {}
    for case in CASES:
        rows = [r[case] for r in rounds if case in r]
        if not rows:
            continue
        s: dict[str, Any] = {k: statistics.median(x[k] for x in rows) for k in PARTS if k in rows[0]}
        s["prompt_tok_s"] = prompt_tokens / s["ttft_s"]
        s["x_miss"] = miss / s["ttft_s"]
        s["x_miss_per_round"] = [r["miss"]["ttft_s"] / r[case]["ttft_s"] for r in rounds if case in r]
        s["target"] = TARGETS.get(case)
        s["met"] = None if s["target"] is None else s["x_miss"] >= s["target"]
        s["tokens"] = sorted({x["token"] for x in rows})
        s["cached_by_tier"] = rows[-1]["cached_by_tier"]
        for k in ("blocks_served", "read_gb_s", "raw_cold_read_gb_s", "resident_after_drop"):
            if k in rows[0] and rows[0][k] is not None:
                s[k] = statistics.median(x[k] for x in rows)
        out[case] = s
    return out


def print_report(r: dict[str, Any]) -> None:
    f = lambda v, spec=".2f": "-" if v is None else format(v, spec)
    s = r["summary"]
    print(f"\n{r['model']} fp32, {r['threads']} threads: {r['prompt_tokens']}-token prompt, first "
          f"{r['cached_tokens']} tokens ({r['cached_blocks']} blocks, {r['prefix_bytes'] / 2**20:.1f} MiB of KV) "
          f"cached; medians of {r['repeats']} rounds; load average {r['loadavg_start']} -> {r['loadavg_end']}")
    head = ("case", "TTFT s", "prompt tok/s", "x miss", "per round", "target", "met")
    print(" | ".join(f"{h:>16}" for h in head))
    for case, c in s.items():
        rounds = ",".join(f"{x:.1f}" for x in c["x_miss_per_round"])
        met = "-" if c["met"] is None else "met" if c["met"] else "NOT met"
        vals = (case, f(c["ttft_s"], ".4f"), f(c["prompt_tok_s"], ".0f"), f(c["x_miss"], ".1f"), rounds,
                f(c["target"], ".0f"), met)
        print(" | ".join(f"{v:>16}" for v in vals))
    print("\nwhere a hit's time goes (ms, medians):")
    print(" | ".join(f"{h:>12}" for h in ("case", *(p[:-2] for p in PARTS))))
    for case in ("device", "dram", "dram+zmq", "nvme"):
        if case in s:
            ms = [f(None if s[case].get(p) is None else s[case][p] * 1e3, ".1f") for p in PARTS]
            print(" | ".join(f"{v:>12}" for v in (case, *ms)))
    if "nvme" in s:
        n = s["nvme"]
        print(f"\nnvme: page-cache residency after the drop {f(n.get('resident_after_drop'), '.3f')}; "
              f"store.read (read + verify + bookkeeping) {f(n['read_gb_s'])} GB/s; raw cold read of the same "
              f"files {f(n['raw_cold_read_gb_s'])} GB/s; blocks served {n['blocks_served']:.0f}/{r['cached_blocks']}")
    cores = ", ".join(f"{x:.2f}" for x in r["miss_cores_used_per_round"])
    print(f"load: 1-min average after each round {r['loadavg_per_round']}; cores the miss kept busy (CPU s / "
          f"wall s, {r['threads']} = none lost to others) per round: {cores}")
    print(f"first token (greedy) identical in every case: {r['same_first_token']} {sorted(r['first_tokens'])}")
    print(f"\nreproduce: {r['command']}")


def main(argv: list[str] | None = None) -> None:
    tune_malloc()  # what every DeepInfer service process does at start (deepinfer/launch/tuning.py)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--cached-tokens", type=int, default=2032, help="a multiple of the block size (16)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--low", type=int, default=256, help="smallest token id used (above the special tokens)")
    ap.add_argument("--cache-dir", type=Path, help="where the disk tier goes (a temporary directory inside it)")
    ap.add_argument("--no-wire", action="store_true", help="skip the dram+zmq case")
    ap.add_argument("--out", type=Path, default=Path("bench/results/prefix.json"))
    ap.add_argument("--no-plots", action="store_true", help="no PNG figures beside the JSON (bench/plots.py)")
    args = ap.parse_args(argv)
    plen, cached = args.prompt_tokens, args.cached_tokens
    if cached % BLOCK or not 0 < cached < plen:
        ap.error(f"--cached-tokens must be a positive multiple of {BLOCK} below --prompt-tokens")
    n_blocks = cached // BLOCK
    command = (f"python -m bench.bench_prefix --model {args.model} --threads {args.threads} --prompt-tokens {plen} "
               f"--cached-tokens {cached} --repeats {args.repeats} --seed {args.seed} --low {args.low}"
               + (f" --cache-dir {args.cache_dir}" if args.cache_dir else "") + (" --no-wire" if args.no_wire else "")
               + f" --out {args.out}")
    loadavg_start = [round(x, 2) for x in os.getloadavg()]

    # KV for two whole prompts, so an import never has to evict the blocks of the request it serves.
    cfg = EngineConfig(block_size=BLOCK, num_kv_blocks=2 * -(-plen // BLOCK) + 16, max_num_batched_tokens=plen,
                       num_threads=args.threads)
    engine = LLMEngine.load(args.model, cfg)
    prompt = make_prompt(plen, args.low, engine.model_config.vocab_size, args.seed)

    # The prefix's KV, computed once: every store gets these bytes, under each case's names.
    computed(engine, prompt, "source")
    names, kv = engine.export_cached_blocks(engine.block_hashes(prompt, "source")[:n_blocks])
    if kv is None or len(names) != n_blocks:
        raise RuntimeError(f"only {len(names)} of {n_blocks} prefix blocks were on the device after computing them")
    nbytes = engine.kv_spec.block_nbytes
    prefix_bytes = n_blocks * nbytes
    ns = engine.cache_namespace.id
    rounds_total = args.repeats + 1
    parent = args.cache_dir
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    disk_dir = Path(tempfile.mkdtemp(prefix="diprefix-", dir=parent))
    dram = TieredStore(ns, nbytes, 3 * prefix_bytes, None, 0)
    # No room in host: a read comes from the files (and cannot be promoted), as for a prefix evicted from DRAM.
    disk = TieredStore(ns, nbytes, 0, disk_dir, 2 * rounds_total * prefix_bytes,
                       max_pending_write_bytes=2 * prefix_bytes)
    disk.open()
    rounds: list[dict[str, dict[str, Any]]] = []
    loads: list[float] = []  # 1-minute load average after each round
    try:
        with contextlib.ExitStack() as stack:
            wire = None if args.no_wire else stack.enter_context(wire_fetch(dram, engine.kv_spec))
            for i in range(rounds_total):
                print(f"round {i}{' (warm-up)' if i == 0 else ''} ...", file=sys.stderr)
                row = one_round(f"r{i}", engine, prompt, n_blocks, kv, dram, disk, wire)
                if i:
                    rounds.append(row)
                    loads.append(round(os.getloadavg()[0], 2))
    finally:
        dram.close()
        disk.close()
        shutil.rmtree(disk_dir, ignore_errors=True)

    for row in rounds:
        for case, x in row.items():
            want = {} if case == "miss" else {"device": cached} if case == "device" else \
                {"host" if case.startswith("dram") else "disk": cached}
            if x["cached_by_tier"] != want:
                print(f"warning: {case} hit {x['cached_by_tier']}, expected {want}", file=sys.stderr)
    tokens = {x["token"] for row in rounds for x in row.values()}
    r: dict[str, Any] = {
        "model": args.model, "threads": args.threads, "prompt_tokens": plen, "cached_tokens": cached,
        "cached_blocks": n_blocks, "block_nbytes": nbytes, "prefix_bytes": prefix_bytes, "repeats": args.repeats,
        "prompt": f"{plen} token ids, random.Random({args.seed}).randrange({args.low}, vocab)",
        "fetch_deadline_s": FETCH_DEADLINE_S, "engine_config": dict(vars(cfg)), "disk_dir_parent":
        str(parent or tempfile.gettempdir()), "loadavg_start": loadavg_start,
        "loadavg_end": [round(x, 2) for x in os.getloadavg()], "loadavg_per_round": loads,
        "miss_cores_used_per_round": [row["miss"]["cpu_s"] / row["miss"]["ttft_s"] for row in rounds],
        "command": command,
        "first_tokens": sorted(tokens), "same_first_token": len(tokens) == 1,
        "summary": summarize(rounds, plen), "rounds": rounds,
        "env": {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
                "cpus": os.cpu_count()},
    }
    print_report(r)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(r, indent=2, default=str))
    print(f"wrote {args.out}")
    if not args.no_plots:
        from bench import plots

        plots.write("prefix", json.loads(json.dumps(r, default=str)), args.out)


if __name__ == "__main__":
    main()
