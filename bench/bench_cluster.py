"""The mesh as a cluster (issue 32), measured: hosts are network namespaces on one bridge (bench.cluster_harness),
each service started in its host's namespace as its systemd unit runs it. Needs root (namespaces):

    sudo .venv/bin/python -m bench.bench_cluster [bench_replay's workload options] [--parts replay,pd,cut]

Three parts, each with its own baseline run the same way in the same invocation:

* replay — bench_replay's trace workload through the reference cluster (front: router, tokenizer; p1, p2: a
  prefill worker and a cache daemon each; d1, d2: a decode worker and a cache daemon each), twice: every
  daemon's disk tier in one shared pool directory, and each daemon's in a private directory of the same size
  (so the same total capacity). Prints each arm's hit rate by tier over the trace's reusable fraction, TTFT
  p50/p99 and throughput.
* pd — a 2k-token prompt's time to first and second token with its prefill on p1 and decode on d1 (the KV crosses
  the bridge over tcp://) against both workers on one host, over tcp:// inside one namespace and over ipc:// (as
  `up` wires one host): what the network hop costs. Prefix caching is off, every prompt is new; the KV handoff's
  bytes and seconds come from the workers' metrics, giving its throughput on each path.
* cut — streams decoding on d1 and d2, then d1's link is cut: for each stream that moved, the time from the cut to
  its next token (the router's heartbeat timeout, the move, a prefill of prompt + output on another worker).
* restart — a warm pool, streams decoding, p1's cache daemon killed -9 and started again at once (as systemd would,
  less its RestartSec): the seconds until the router has it serving again.

The clients run in the root namespace (outside the cluster). Without [security]: CURVE's cost is not what any
part measures. Figures depend on the machine (bench/results/ says which); on a 2-core VM every host shares the
same two cores, so the cluster's throughput is one machine's, not five.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.bench_mesh import table
from bench.bench_replay import (
    RESULTS,
    TIERS,
    build_workload,
    command_line,
    mesh_settings,
    replay,
    summarize,
    warm_prompts,
    workload_parser,
)
from bench.cluster_harness import Cluster, available
from deepinfer.launch.sections import KvCacheSpec, TokenizerSpec, WorkerSpec
from deepinfer.launch.topology import RouterConfig, Topology
from deepinfer.loading.fetch import resolve_model
from deepinfer.loading.identity import model_config_at
from deepinfer.protocol.client import Client

REFERENCE = ("front", "p1", "p2", "d1", "d2")
SERVED_WAIT_S = 300.0  # the cluster's services start one by one, each loading the model
PD_PROMPT_TOKENS = 2048
PD_RUNS = 4  # measured requests per arm, after one unmeasured
CUT_STREAMS = 4
CUT_MAX_TOKENS = 96
RESTART_PROMPTS, RESTART_PROMPT_TOKENS = 24, 512


@dataclasses.dataclass
class Running:
    cluster: Cluster
    topology: Topology
    file: Path
    metrics: Path


@contextlib.contextmanager
def running_cluster(hosts: tuple[str, ...], build: Any, root: Path, name: str) -> Iterator[Running]:
    """A cluster of `hosts`, the topology `build(cluster)` written to `root/name.toml`, every service of it started
    in its host's namespace and serving; all of it gone afterwards."""
    (root / name).mkdir(parents=True)
    with Cluster(hosts, log_dir=root / name) as cluster:
        topo, placement = build(cluster)
        path = root / f"{name}.toml"
        path.write_text(topo.to_toml())
        metrics_dir = root / name / "metrics"
        metrics_dir.mkdir()
        env = {"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
        for host, role, service in placement:
            cluster.start(host, role, service, path, env=env)
        running = Running(cluster, topo, path, metrics_dir)
        wait_served(running)
        yield running


def wait_served(r: Running) -> None:
    deadline = time.monotonic() + SERVED_WAIT_S
    with Client(r.topology.frontend, timeout_s=120) as c:
        while True:
            dead = r.cluster.dead()
            if dead:
                raise SystemExit("a service exited:\n" + "\n".join(dead))
            try:
                c.generate(prompt_token_ids=[1, 2, 3], max_tokens=1)
                return
            except Exception:  # noqa: BLE001 - not up yet: no tokenizer or no worker
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)


def reference_cluster(model: str, settings: Any, pool: Path | None, root: Path) -> Any:
    """The build function of the reference cluster; `pool`: the shared directory, or None for private ones."""
    def build(cluster: Cluster) -> tuple[Topology, list[tuple[str, str, str]]]:
        at = {h: cluster.address(h) for h in REFERENCE}

        def worker(name: str, role: str, host: str) -> WorkerSpec:
            return WorkerSpec(name, role, f"tcp://{at[host]}:5570", threads=settings.threads,
                              kv_cache_mb=settings.kv_cache_mb, kvcache=f"kvcache-{host}")

        def daemon(host: str) -> KvCacheSpec:
            directory = pool if pool is not None else root / f"private-{host}"
            return KvCacheSpec(f"kvcache-{host}", f"tcp://{at[host]}:5580", dir=str(directory),
                               host_mb=settings.host_cache_mb, disk_mb=settings.disk_cache_mb)

        topo = Topology(model, f"tcp://{at['front']}:5550", f"tcp://{at['front']}:5551",
                        (TokenizerSpec("tokenizer-0", f"tcp://{at['front']}:5560"),),
                        (worker("prefill-0", "prefill", "p1"), worker("prefill-1", "prefill", "p2"),
                         worker("decode-0", "decode", "d1"), worker("decode-1", "decode", "d2")),
                        router=RouterConfig(**settings.router_options),
                        kvcaches=tuple(daemon(h) for h in ("p1", "p2", "d1", "d2")), insecure=True)
        placement = [("front", "router", "router"), ("front", "tokenizer", "tokenizer-0")]
        placement += [(h, "kvcache", f"kvcache-{h}") for h in ("p1", "p2", "d1", "d2")]
        placement += [("p1", "worker", "prefill-0"), ("p2", "worker", "prefill-1"), ("d1", "worker", "decode-0"),
                      ("d2", "worker", "decode-1")]
        return topo, placement
    return build


# -- replay: one shared pool against private pools ---------------------------------------------------------------


def part_replay(args: argparse.Namespace, model: str, vocab: int, context: int, root: Path) -> dict[str, Any]:
    st, workload = build_workload(args, vocab, context)
    settings = mesh_settings(args, model, workload)
    settings = dataclasses.replace(settings, threads=1)  # four workers share the machine's cores
    warm = warm_prompts(args.seed, args.low, vocab)
    print(f"replay: {workload['requests']} requests, {workload['prompt_tokens']} prompt tokens over "
          f"{workload['span_s']:.0f} s", file=sys.stderr)
    arms: dict[str, Any] = {}
    for name, pool in (("shared pool", root / "pool"), ("private pools", None)):
        with running_cluster(REFERENCE, reference_cluster(model, settings, pool, root), root,
                             name.replace(" ", "-")) as running:
            rows = asyncio.run(replay(running.topology.frontend, None, st.requests, warm, args.timeout_s, name))
        arms[name] = summarize(rows)
    reusable = workload["reusable_kv_blocks"]
    shared, private = arms["shared pool"], arms["private pools"]
    ratios = {"shared hit rate / reusable": _ratio(shared["hit_rate"], reusable),
              "private hit rate / reusable": _ratio(private["hit_rate"], reusable),
              "TTFT p50, private / shared": _ratio(private["ttft_p50_s"], shared["ttft_p50_s"]),
              "TTFT p99, private / shared": _ratio(private["ttft_p99_s"], shared["ttft_p99_s"]),
              "throughput (req/s), shared / private": _ratio(shared["req_s"], private["req_s"])}
    return {"workload": workload, "settings": dataclasses.asdict(settings), "arms": arms, "ratios": ratios}


# -- pd: the network hop of a disaggregated prefill ------------------------------------------------------------------


PD_ARMS = (("one host, ipc", ("front", "pd"), "ipc"), ("one host, tcp", ("front", "pd"), "tcp"),
           ("across hosts", ("front", "p1", "d1"), "across"))


def pd_cluster(model: str, threads: int, kv_cache_mb: int, wiring: str, sockets: Path) -> Any:
    """front (router, tokenizer) and the P/D pair: on p1 and d1 over tcp:// ("across"), or both on one host `pd`
    over tcp:// ("tcp") or, with every endpoint but the router's front, over ipc:// sockets in `sockets` ("ipc")."""
    def build(cluster: Cluster) -> tuple[Topology, list[tuple[str, str, str]]]:
        front = cluster.address("front")
        prefill_host, decode_host = ("p1", "d1") if wiring == "across" else ("pd", "pd")

        def at(host: str, port: int) -> str:
            return f"ipc://{sockets}/{port}.sock" if wiring == "ipc" else f"tcp://{cluster.address(host)}:{port}"

        workers = (WorkerSpec("prefill-0", "prefill", at(prefill_host, 5570), threads=threads, kv_cache_mb=kv_cache_mb,
                              prefix_caching=False),
                   WorkerSpec("decode-0", "decode", at(decode_host, 5571), threads=threads, kv_cache_mb=kv_cache_mb,
                              prefix_caching=False))
        topo = Topology(model, f"tcp://{front}:5550", at("front", 5551),
                        (TokenizerSpec("tokenizer-0", at("front", 5560)),), workers, insecure=True)
        return topo, [("front", "router", "router"), ("front", "tokenizer", "tokenizer-0"),
                      (prefill_host, "worker", "prefill-0"), (decode_host, "worker", "decode-0")]
    return build


def part_pd(args: argparse.Namespace, model: str, vocab: int, root: Path) -> dict[str, Any]:
    rng = random.Random(f"pd:{args.seed}")
    prompts = [[rng.randrange(args.low, vocab) for _ in range(PD_PROMPT_TOKENS)] for _ in range(PD_RUNS + 1)]
    threads = max(1, args.threads // 2)
    arms: dict[str, Any] = {}
    for name, hosts, wiring in PD_ARMS:
        # Short: an ipc:// path has at most 107 characters.
        with tempfile.TemporaryDirectory(prefix="dipd-") as sockets, \
                running_cluster(hosts, pd_cluster(model, threads, args.kv_cache_mb, wiring, Path(sockets)), root,
                                f"pd-{wiring}") as running:
            first, second = [], []
            with Client(running.topology.frontend, timeout_s=args.timeout_s) as c:
                for i, p in enumerate(prompts):
                    res = c.generate(prompt_token_ids=p, max_tokens=2, ignore_eos=True)
                    if i:  # the first one warms the path
                        first.append(res.timings.ttft_s)
                        second.append(res.timings.e2e_s)
            sent = metric_total(running.metrics, "deepinfer_kv_transfer_bytes_total", path="handoff_send")
            seconds = metric_total(running.metrics, "deepinfer_kv_transfer_seconds_sum", path="handoff_send")
        arms[name] = {"ttft_s": first, "second_token_s": second, "ttft_median_s": statistics.median(first),
                      "second_token_median_s": statistics.median(second), "handoff_bytes": sent,
                      "handoff_s": seconds, "handoff_gb_s": sent / seconds / 1e9 if seconds else None}
    ipc, tcp, across = arms["one host, ipc"], arms["one host, tcp"], arms["across hosts"]
    ratios = {}
    for base_name, base in (("one host ipc", ipc), ("one host tcp", tcp)):
        ratios[f"TTFT, across / {base_name}"] = _ratio(across["ttft_median_s"], base["ttft_median_s"])
        ratios[f"second token, across / {base_name}"] = _ratio(across["second_token_median_s"],
                                                              base["second_token_median_s"])
    ratios["handoff GB/s, across / one host ipc"] = _ratio(across["handoff_gb_s"], ipc["handoff_gb_s"])
    return {"prompt_tokens": PD_PROMPT_TOKENS, "runs": PD_RUNS, "arms": arms, "ratios": ratios}


def metric_total(directory: Path, name: str, **labels: str) -> float:
    """The sum over processes and other labels of one multiprocess metric sample."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    return sum(s.value for family in registry.collect() for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


# -- cut: from a cut link to the moved streams' next tokens --------------------------------------------------------


def part_cut(args: argparse.Namespace, model: str, vocab: int, root: Path) -> dict[str, Any]:
    settings = dataclasses.replace(mesh_settings(args, model, {"requests": 64, "prompt_tokens": 65536}), threads=1)
    rng = random.Random(f"cut:{args.seed}")
    prompts = [[rng.randrange(args.low, vocab) for _ in range(64)] for _ in range(CUT_STREAMS)]
    arrivals: list[list[float]] = [[] for _ in prompts]
    flowing = [threading.Event() for _ in prompts]
    with running_cluster(REFERENCE, reference_cluster(model, settings, root / "cut-pool", root), root,
                         "cut") as running:
        with Client(running.topology.frontend, timeout_s=args.timeout_s) as c:
            def follow(i: int) -> None:
                for _ in c.stream(prompt_token_ids=prompts[i], max_tokens=CUT_MAX_TOKENS, ignore_eos=True):
                    arrivals[i].append(time.monotonic())
                    if len(arrivals[i]) >= 4:  # its pace is known before the cut
                        flowing[i].set()

            readers = [threading.Thread(target=follow, args=(i,), daemon=True) for i in range(len(prompts))]
            for t in readers:
                t.start()
            for e in flowing:
                e.wait(args.timeout_s)
            cut_at = time.monotonic()
            running.cluster.cut("d1")
            for t in readers:
                t.join(args.timeout_s)
            running.cluster.restore("d1")
        moved = metric_total(running.metrics, "deepinfer_router_migrations_total", cause="decode_death")
    gaps = []
    for times in arrivals:
        after = [t for t in times if t > cut_at]
        before = [t for t in times if t <= cut_at]
        steps = [b - a for a, b in zip(before, before[1:])]
        gap = after[0] - cut_at if after else None
        # A stream left on d2 keeps its pace; a moved one waits for the move: tell them apart by the gap.
        step = statistics.median(steps) if steps else None
        gaps.append({"next_token_after_cut_s": gap, "median_step_before_s": step})
    slow = [g["next_token_after_cut_s"] for g in gaps if g["next_token_after_cut_s"] is not None
            and g["median_step_before_s"] is not None and g["next_token_after_cut_s"] > 5 * g["median_step_before_s"]]
    return {"streams": CUT_STREAMS, "moved_by_router": moved, "per_stream": gaps,
            "cut_to_first_moved_token_s": min(slow) if slow else None,
            "cut_to_last_moved_token_s": max(slow) if slow else None,
            "heartbeat_timeout_s": RouterConfig().heartbeat_timeout_s}


# -- restart: a cache daemon killed -9 and started again under load ------------------------------------------------


def part_restart(args: argparse.Namespace, model: str, vocab: int, root: Path) -> dict[str, Any]:
    """Fill the pool (RESTART_PROMPTS prompts of RESTART_PROMPT_TOKENS), then, with streams decoding, kill -9 p1's
    cache daemon and start it again at once: the seconds until the router has it serving again (its new
    incarnation's Hello and first heartbeat), and how many blocks its warm start found in the pool."""
    from deepinfer.launch.operator_link import OperatorLink
    from deepinfer.protocol import messages as m

    settings = dataclasses.replace(mesh_settings(args, model, {"requests": 64, "prompt_tokens": 65536}), threads=1)
    rng = random.Random(f"restart:{args.seed}")
    fill = [[rng.randrange(args.low, vocab) for _ in range(RESTART_PROMPT_TOKENS)] for _ in range(RESTART_PROMPTS)]
    streams = [[rng.randrange(args.low, vocab) for _ in range(64)] for _ in range(4)]
    with running_cluster(REFERENCE, reference_cluster(model, settings, root / "restart-pool", root), root,
                         "restart") as running:
        made = running.cluster
        with Client(running.topology.frontend, timeout_s=args.timeout_s) as c, OperatorLink(running.topology) as link:
            c.generate_many([dict(prompt_token_ids=p, max_tokens=1) for p in fill])
            time.sleep(2.0)  # the daemons' write-behind reaches the disk
            blocks = len(list((root / "restart-pool").rglob("*.kvb")))
            load = threading.Thread(target=lambda: c.generate_many(
                [dict(prompt_token_ids=p, max_tokens=CUT_MAX_TOKENS, ignore_eos=True) for p in streams]))
            load.start()
            time.sleep(3.0)
            before = link.ask(m.ServiceQuery("kvcache-p1"))
            made.kill("kvcache-p1")
            killed_at = time.monotonic()
            made.start("p1", "kvcache", "kvcache-p1", running.file,
                       env={"PROMETHEUS_MULTIPROC_DIR": str(running.metrics)})
            while True:
                status = link.ask(m.ServiceQuery("kvcache-p1"), time.monotonic() + 60)
                if status.incarnation != before.incarnation and status.serving:
                    break
                if time.monotonic() - killed_at > 300:
                    raise SystemExit("the restarted cache daemon never served")
                time.sleep(0.05)
            back_s = time.monotonic() - killed_at
            load.join(args.timeout_s)
        log = next(s.log for s in made.services if s.name == "kvcache-p1").read_text()
    return {"pool_blocks": blocks, "kill_to_serving_s": back_s, "opened": [line for line in log.splitlines()
                                                                        if "disk tier opened" in line][-1:]}


# -- report --------------------------------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def print_report(r: dict[str, Any]) -> None:
    f = lambda v, spec=".3f": "-" if v is None else format(v, spec)  # noqa: E731
    pc = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    if "replay" in r:
        rp = r["replay"]
        w = rp["workload"]
        print(f"\nreplay: {w['requests']} requests, {w['prompt_tokens']} prompt tokens over {w['span_s']:.0f} s; "
              f"reusable in full KV blocks: {pc(w['reusable_kv_blocks'])}")
        table(["arm", "ok", "errors", "hit", *TIERS, "TTFT p50 s", "TTFT p99 s", "wall s", "req/s"],
              [[name, str(a["ok"]), str(sum(a["errors"].values())), pc(a["hit_rate"]),
                *(pc(a["hit_rate_by_tier"].get(t)) for t in TIERS), f(a["ttft_p50_s"]), f(a["ttft_p99_s"]),
                f(a["wall_s"], ".1f"), f(a["req_s"], ".2f")] for name, a in rp["arms"].items()])
        for name, v in rp["ratios"].items():
            print(f"  {name:<40} {f(v, '.2f'):>6}")
    if "pd" in r:
        pd = r["pd"]
        print(f"\npd: a {pd['prompt_tokens']}-token prompt, {pd['runs']} runs per arm (medians)")
        table(["arm", "TTFT s", "2nd token s", "handoff MB", "handoff s", "GB/s"],
              [[name, f(a["ttft_median_s"]), f(a["second_token_median_s"]),
                f(a["handoff_bytes"] / 1e6, ".1f"), f(a["handoff_s"]), f(a["handoff_gb_s"], ".2f")]
               for name, a in pd["arms"].items()])
        for name, v in pd["ratios"].items():
            print(f"  {name:<40} {f(v, '.3f'):>6}")
    if "restart" in r:
        rs = r["restart"]
        print(f"\nrestart: p1's cache daemon killed -9 under load with {rs['pool_blocks']} blocks in the pool, started "
              f"again at once: serving after {rs['kill_to_serving_s']:.2f} s")
    if "cut" in r:
        cut = r["cut"]
        print(f"\ncut: {cut['streams']} streams, d1's link cut; the router moved {cut['moved_by_router']:g} "
              f"(heartbeat timeout {cut['heartbeat_timeout_s']:g} s)")
        print(f"  cut to the first moved stream's next token: {f(cut['cut_to_first_moved_token_s'], '.2f')} s, "
              f"to the last: {f(cut['cut_to_last_moved_token_s'], '.2f')} s")
    print(f"\nreproduce: {r['command']}")


def main(argv: list[str] | None = None) -> None:
    ap = workload_parser(__doc__)
    ap.add_argument("--parts", default="replay,pd,cut,restart", help="which parts, comma-separated")
    ap.add_argument("--out", type=Path, default=RESULTS / "cluster.json")
    args = ap.parse_args(argv)
    why = available()
    if why is not None:
        raise SystemExit(f"bench_cluster needs network namespaces: {why}")
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - {"replay", "pd", "cut", "restart"}
    if unknown:
        raise SystemExit(f"unknown parts: {sorted(unknown)}")
    path = resolve_model(args.model)
    mc = model_config_at(path)
    command = command_line(args).replace("bench.bench_replay", "bench.bench_cluster") + f" --parts {args.parts}"
    r: dict[str, Any] = {"command": command, "model": str(path),
                         "env": {"python": platform.python_version(), "machine": platform.machine(),
                                 "cpus": os.cpu_count(), "loadavg": os.getloadavg()}}
    with tempfile.TemporaryDirectory(prefix="dicluster-") as tmp:
        root = Path(tmp)
        if "replay" in parts:
            r["replay"] = part_replay(args, str(path), mc.vocab_size, mc.max_position_embeddings, root)
        if "pd" in parts:
            r["pd"] = part_pd(args, str(path), mc.vocab_size, root)
        if "cut" in parts:
            r["cut"] = part_cut(args, str(path), mc.vocab_size, root)
        if "restart" in parts:
            r["restart"] = part_restart(args, str(path), mc.vocab_size, root)
    print_report(r)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(r, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
