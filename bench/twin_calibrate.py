"""Fit the twin's cost model (deepinfer/twin/costs.py) from measurements on this machine; write a cost file.

    python -m bench.twin_calibrate [--model smollm2] [--threads 2] [--out deepinfer/twin/costs/cpu-smollm2.json]
                                   [--quick]

Measured, each briefly (about a minute in all; --quick less):
* engine steps: the real LLMEngine on the model, steps timed one by one with what the scheduler gave them —
  prefill chunks of several lengths after cached prefixes of several lengths, decode batches of several
  sizes and contexts; StepCosts fitted by least squares (coefficients clipped at 0);
* a hop: a small msgpack message's round trip over ZeroMQ ipc, halved;
* KV transfer: 16 MiB frames PUSH → PULL over ipc (copy=False);
* tiers: the real TieredStore with the model's block size in a temporary directory on the cache's disk —
  host writes and reads, disk writes (flush, fsynced) and cold reads (page cache dropped).
Every record's source says how it was measured; the file also keeps the raw samples' sizes and the command.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from deepinfer.cache.store import TieredStore
from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import SamplingParams
from deepinfer.launch.sections import default_kvcache_dir
from deepinfer.twin.costs import COSTS_DIR, CostModel, LinkCosts, StepCosts, TierCosts, save_costs
from deepinfer.twin.worker import SimWorker


def step_samples(engine: LLMEngine, quick: bool) -> list[tuple[list[tuple[int, int]], list[int], float]]:
    """(prefill chunks, decode contexts, seconds) per engine step."""
    samples: list[tuple[list[tuple[int, int]], list[int], float]] = []
    sched = engine.scheduler
    original = sched.schedule
    captured: list[Any] = []

    def schedule() -> Any:
        out = original()
        captured.append(out)
        return out

    sched.schedule = schedule  # type: ignore[method-assign]
    rid = iter(range(1 << 30))

    def run(prompts: list[list[int]], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        for p in prompts:
            engine.add_request(f"c{next(rid)}", p, params)
        while engine.has_unfinished():
            captured.clear()
            t0 = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - t0
            if captured and not captured[0].is_empty:
                samples.append((*SimWorker._step_shape(captured[0]), seconds))

    rng = np.random.default_rng(0)
    tok = lambda n: [int(x) for x in rng.integers(256, 30000, n)]  # noqa: E731
    run([tok(300), tok(40)], 8)  # warm-up: kernels built and loaded, caches touched; not kept
    samples.clear()
    lengths = (64, 256, 1024) if quick else (32, 128, 512, 1024, 2048)
    for n in lengths:
        for cached in (0, 512) if quick else (0, 256, 1024):
            head = tok(cached)
            if cached:
                run([head + tok(16)], 1)  # puts the head in the pool
            run([head + tok(n)], 1)
    for batch in (1, 8) if quick else (1, 4, 16, 32):
        for ctx in (128, 1024) if quick else (64, 512, 1536):
            run([tok(ctx) for _ in range(batch)], 12 if quick else 24)
    sched.schedule = original  # type: ignore[method-assign]
    return samples


def fit_steps(samples: list[tuple[list[tuple[int, int]], list[int], float]]) -> StepCosts:
    rows, y = [], []
    for prefill, decode, s in samples:
        rows.append([1.0, sum(n for n, _ in prefill), sum(n * (st + n / 2) for n, st in prefill), len(decode),
                     sum(decode)])
        y.append(s)
    coef, *_ = np.linalg.lstsq(np.array(rows), np.array(y), rcond=None)
    c = [max(float(v), 0.0) for v in coef]
    return StepCosts(*c)


def zmq_costs(quick: bool) -> tuple[LinkCosts, LinkCosts]:
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory() as d:
        rep, req = ctx.socket(zmq.REP), ctx.socket(zmq.REQ)
        rep.bind(f"ipc://{d}/rr")
        req.connect(f"ipc://{d}/rr")
        n = 300 if quick else 2000

        def echo() -> None:
            for _ in range(n):
                rep.send(rep.recv())

        th = threading.Thread(target=echo)
        th.start()
        msg = b"\x01" + bytes(120)  # about a heartbeat's msgpack
        t0 = time.perf_counter()
        for _ in range(n):
            req.send(msg)
            req.recv()
        hop = (time.perf_counter() - t0) / n / 2
        th.join()
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        pull.bind(f"ipc://{d}/bulk")
        push.connect(f"ipc://{d}/bulk")
        frame, k = bytes(16 << 20), 8 if quick else 32
        got = threading.Thread(target=lambda: [pull.recv(copy=False) for _ in range(k)])
        got.start()
        t0 = time.perf_counter()
        for _ in range(k):
            push.send(frame, copy=False)
        got.join()
        bulk = k * len(frame) / (time.perf_counter() - t0)
        for s in (rep, req, push, pull):
            s.close(linger=0)
    ctx.term()
    return LinkCosts(hop, 1e12), LinkCosts(hop, bulk)


def tier_costs(block_nbytes: int, quick: bool) -> tuple[TierCosts, TierCosts]:
    n = 32 if quick else 128
    payloads = [np.random.default_rng(i).bytes(block_nbytes) for i in range(n)]
    hashes = [i.to_bytes(32, "big") for i in range(1, n + 1)]
    root = default_kvcache_dir()
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as d:
        ns = "ab" * 32
        store = TieredStore(ns, block_nbytes, (n + 1) * block_nbytes, Path(d), (n + 8) * block_nbytes * 2)
        store.open()
        t0 = time.perf_counter()
        store.write(hashes, payloads)
        host_write = n * block_nbytes / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        store.read(hashes)
        host_read = n * block_nbytes / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        store.flush()
        disk_write = n * block_nbytes / (time.perf_counter() - t0)
        store.drop_page_cache()
        store.close()
        cold = TieredStore(ns, block_nbytes, 0, Path(d), (n + 8) * block_nbytes * 2)
        cold.open()
        cold.drop_page_cache()
        t0 = time.perf_counter()
        cold.read(hashes)
        disk_read = n * block_nbytes / (time.perf_counter() - t0)
        cold.close()
    host = TierCosts(LinkCosts(0.0, host_read), LinkCosts(0.0, host_write))
    disk = TierCosts(LinkCosts(0.0, disk_read), LinkCosts(0.0, disk_write))
    return host, disk


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="fewer, shorter measurements")
    ap.add_argument("--out", type=Path, default=COSTS_DIR / "cpu-smollm2.json")
    args = ap.parse_args(argv)
    engine = LLMEngine.load(args.model, EngineConfig(num_threads=args.threads))
    samples = step_samples(engine, args.quick)
    step = fit_steps(samples)
    errors = [abs(step.seconds(p, d) - s) / s for p, d, s in samples]
    hop, ipc = zmq_costs(args.quick)
    host, disk = tier_costs(engine.kv_spec.block_nbytes, args.quick)
    when = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    model = CostModel(
        name=args.out.stem, machine=f"{cpu_name()}, {args.threads} threads", block_nbytes=engine.kv_spec.block_nbytes,
        step=step, hop=hop, transports={"ipc": ipc, "inproc": ipc}, host=host, disk=disk,
        sources={"step": f"LLMEngine.step on {args.model}, {len(samples)} steps timed, least squares "
                         f"(median relative error {statistics.median(errors):.1%})",
                 "hop": "ZeroMQ REQ/REP over ipc, 121-byte messages, round trip / 2",
                 "transports": "ZeroMQ PUSH/PULL over ipc, 16 MiB frames, copy=False (inproc: the ipc figure)",
                 "host": "TieredStore host tier, write and read of the model's blocks",
                 "disk": "TieredStore disk tier: flush (fsynced) and cold read (page cache dropped), "
                         f"in {default_kvcache_dir()}"})
    command = "python -m bench.twin_calibrate " + " ".join(argv or [])
    save_costs(model, args.out, {"calibrated": when, "command": command,
                                 "step_samples": len(samples), "step_median_rel_error": statistics.median(errors)})
    print(f"wrote {args.out}: {model.step}, hop {hop.latency_s * 1e6:.0f} us, ipc {ipc.bytes_per_s / 1e9:.2f} GB/s, "
          f"host r/w {host.read.bytes_per_s / 1e9:.1f}/{host.write.bytes_per_s / 1e9:.1f} GB/s, "
          f"disk r/w {disk.read.bytes_per_s / 1e9:.2f}/{disk.write.bytes_per_s / 1e9:.2f} GB/s; "
          f"step fit median error {statistics.median(errors):.1%}")


if __name__ == "__main__":
    main()
