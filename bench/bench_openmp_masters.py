"""Why the worker's engine thread decodes slower than an engine on the main thread: two OpenMP masters.

    python -m bench.bench_openmp_masters            # 2 threads, SmolLM2-135M's 121 decode GEMMs per pass

Each scenario runs, in a fresh process, the batch-1 matmuls of one SmolLM2-135M forward pass (30 layers of
qkv 960x576, o 576x576, gate+up 3072x576, down 576x1536, and the 49152x576 LM head; random fp32 weights,
`deepinfer.engine.models.llama.linear`, so the same GEMM calls as the engine) 10 times and prints passes/s:

* `main`: on the main thread only — the baseline;
* `thread`: on a second thread, the main thread never having used torch's OpenMP pool;
* `thread after main`: on a second thread after the main thread ran the same work with 2 threads (what
  a worker does: it loads the model on its main thread, then steps on `EngineThread`);
* `thread after a 1-thread main`: the same, but the main thread's torch work ran with 1 thread (no pool).

Measured here (2-core VM, torch 2.13 CPU, 2026-12-01): main 17.4–18.0, thread 17.9–18.1, thread after main
14.4–14.8, thread after a 1-thread main 17.6–17.9 passes/s. Once two threads each own an OpenMP pool, every
GEMM is ~20% slower, in both threads; shrinking the main thread's pool afterwards (set_num_threads(1) and a
region) does not undo it; OMP_WAIT_POLICY, GOMP_SPINCOUNT, MKL_DYNAMIC, MALLOC_ARENA_MAX and
sys.setswitchinterval do not change it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time

SCENARIOS = ("main", "thread", "thread after main", "thread after a 1-thread main")


def _weights() -> tuple[list, dict]:
    import torch

    w = []
    for _ in range(30):
        w += [torch.randn(960, 576), torch.randn(576, 576), torch.randn(3072, 576), torch.randn(576, 1536)]
    w.append(torch.randn(49152, 576))
    return w, {t.shape[1]: torch.randn(1, t.shape[1]) for t in w}


def _passes_per_s(w: list, x: dict, passes: int = 10) -> float:
    from deepinfer.engine.models.llama import linear

    t = time.perf_counter()
    for _ in range(passes):
        for m in w:
            linear(x[m.shape[1]], m)
    return passes / (time.perf_counter() - t)


def run_scenario(name: str, threads: int) -> float:
    """In this process (call it in a fresh one): passes/s of the timed run of scenario `name`."""
    import torch

    w, x = _weights()
    if name == "main":
        torch.set_num_threads(threads)
        _passes_per_s(w, x, 2)
        return _passes_per_s(w, x)
    if name != "thread":
        torch.set_num_threads(threads if name == "thread after main" else 1)
        _passes_per_s(w, x, 2)  # the "model load": the main thread's own torch work
    result: list[float] = []

    def engine_thread() -> None:
        torch.set_num_threads(threads)
        _passes_per_s(w, x, 2)
        result.append(_passes_per_s(w, x))

    t = threading.Thread(target=engine_thread)
    t.start()
    t.join()
    return result[0]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--scenario", choices=SCENARIOS, help=argparse.SUPPRESS)  # the child's side
    args = ap.parse_args(argv)
    if args.scenario:
        print(f"{run_scenario(args.scenario, args.threads):.2f}")
        return
    base = None
    for name in SCENARIOS:
        out = subprocess.run([sys.executable, "-m", "bench.bench_openmp_masters", "--threads", str(args.threads),
                              "--scenario", name], capture_output=True, text=True, check=True)
        rate = float(out.stdout.strip().splitlines()[-1])
        base = base or rate
        print(f"{name:>30}: {rate:6.2f} passes/s  ({rate / base:.2f} of main)")
    print(f"reproduce: python -m bench.bench_openmp_masters --threads {args.threads}")


if __name__ == "__main__":
    main()
