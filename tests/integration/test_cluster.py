"""The mesh as a cluster (issue 32): hosts are network namespaces joined by a bridge (bench/cluster_harness.py),
each service started in its host's namespace as its systemd unit runs it, every edge CURVE-secured over tcp://.

The cluster: `front` (router, tokenizer, HTTP gateway), `p1` and `p2` (a prefill worker and a cache daemon each),
`d1` and `d2` (a decode worker and a cache daemon each); every daemon's disk tier on one pool directory (the shared
mount). The services start
one by one in an order no supervisor would choose (decode first, router last), as independent units do; `p2`'s
worker joins later, in the test that needs it. The clients run in the root namespace, reaching only `front`.
Two hosts' clocks are off, `p2`'s 30 s ahead and `d2`'s 30 s behind (CLOCK_SHIFTS), for every test of the module.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench.cluster_harness import Cluster, available
from deepinfer import metrics
from deepinfer.launch.keys import make_keys
from deepinfer.launch.sections import GatewaySpec, KvCacheSpec, SecuritySpec, TokenizerSpec, WorkerSpec
from deepinfer.launch.topology import Topology
from deepinfer.protocol.auth import load_client_keys
from deepinfer.protocol.client import Client
from tests.integration.http_served import sse_text

pytestmark = [pytest.mark.smollm2, pytest.mark.skipif(available() is not None, reason=str(available()))]

HOSTS = ("front", "p1", "p2", "d1", "d2")
CLOCK_SHIFTS = {"p2": 30.0, "d2": -30.0}  # seconds: these hosts' wall clocks are off (bench/clock_shift.c)
# (host, role, name): the services the fixture starts, in this order; p2's worker is started by the test using it.
UNITS = [("d1", "worker", "decode-0"), ("front", "tokenizer", "tokenizer-0"), ("p1", "kvcache", "kvcache-p1"),
         ("front", "gateway", "gateway-0"), ("p2", "kvcache", "kvcache-p2"), ("d2", "kvcache", "kvcache-d2"),
         ("p1", "worker", "prefill-0"), ("d1", "kvcache", "kvcache-d1"), ("d2", "worker", "decode-1"),
         ("front", "router", "router")]
GATEWAY_PORT = 8090


def cluster_topology(cluster: Cluster, model: str, keys: Path, pool: Path) -> Topology:
    front, p1, p2, d1, d2 = (cluster.address(h) for h in HOSTS)

    def prefill(name: str, host: str, address: str) -> WorkerSpec:
        # fetch_policy "always": a hit is loaded even where this CPU would recompute it as fast (what is tested
        # here is that the pool serves it; when loading pays is bench_replay's question).
        return WorkerSpec(name, "prefill", f"tcp://{address}:5570", threads=1, kv_cache_mb=64,
                          kvcache=f"kvcache-{host}", fetch_policy="always")

    return Topology(
        model, f"tcp://{front}:5550", f"tcp://{front}:5551", (TokenizerSpec("tokenizer-0", f"tcp://{front}:5560"),),
        (prefill("prefill-0", "p1", p1), prefill("prefill-1", "p2", p2),
         WorkerSpec("decode-0", "decode", f"tcp://{d1}:5570", threads=1, kv_cache_mb=64, kvcache="kvcache-d1"),
         WorkerSpec("decode-1", "decode", f"tcp://{d2}:5570", threads=1, kv_cache_mb=64, kvcache="kvcache-d2")),
        kvcaches=tuple(KvCacheSpec(f"kvcache-{host}", f"tcp://{address}:5580", dir=str(pool), host_mb=64,
                                   disk_mb=256, pool_mb=512)
                       for host, address in (("p1", p1), ("p2", p2), ("d1", d1), ("d2", d2))),
        security=SecuritySpec(str(keys)),
        gateways=(GatewaySpec("gateway-0", f"{front}:{GATEWAY_PORT}"),),
    )


@dataclass
class Running:
    cluster: Cluster
    topology: Topology
    file: Path
    pool: Path
    metrics: Path
    env: dict[str, str]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[Running]:
    root = tmp_path_factory.mktemp("cluster")
    with Cluster(HOSTS, log_dir=root, clock_shifts=CLOCK_SHIFTS) as made:
        topo = cluster_topology(made, str(smollm2_path), root / "keys", root / "pool")
        path = root / "cluster.toml"
        path.write_text(topo.to_toml())
        make_keys(root / "keys", topo)
        (root / "metrics").mkdir()
        env = {metrics.MULTIPROC_ENV: str(root / "metrics")}  # every host's samples, read as one /metrics would
        for host, role, name in UNITS:
            made.start(host, role, name, path, env=env)
        yield Running(made, topo, path, root / "pool", root / "metrics", env)
    assert made.leftovers() == []  # every namespace, link and process gone
    # Every service stopped on its SIGTERM (its drain), as `systemctl stop` asks, with the router stopping at the
    # same time and after everything the tests did (a router restart leaves workers holding finished requests
    # for reclaims that never come: a drain must not wait for those).
    assert made.forced == []


@pytest.fixture(autouse=True)
def nothing_left_held(cluster: Running) -> Iterator[None]:
    """After every test of the module, whatever it broke: no request left on any worker and no KV block leaked."""
    yield
    idle_everywhere(cluster.topology)


def idle_everywhere(topo: Topology, timeout_s: float = 120.0) -> None:
    """Wait until every live worker of `topo` is idle with its whole KV pool free, as the router sees it in their
    heartbeats (`deepinfer-launch status`'s figures): no request running, waiting or held there, no block in use.
    A block a request kept after it ended never comes back, so this times out on a leak (a guard, not a timing)."""
    import time

    from deepinfer.launch.operator_link import OperatorLink
    from deepinfer.protocol import messages as m

    deadline = time.monotonic() + timeout_s
    with OperatorLink(topo) as link:
        while True:
            rows = [link.ask(m.ServiceQuery(w.name), deadline=deadline) for w in topo.workers]
            busy = [f"{s.instance}: {s.running} running, {s.waiting} waiting, {s.held} held, {s.free_blocks} of "
                    f"{s.total_blocks} blocks free" for s in rows
                    if s.alive and (s.running or s.waiting or s.held or s.free_blocks != s.total_blocks)]
            if not busy and all(s.heartbeat_age_s is not None for s in rows if s.alive):
                return
            assert time.monotonic() < deadline, busy
            time.sleep(0.5)


def client(topo: Topology) -> Client:
    assert topo.security is not None
    pair, router_key = load_client_keys(topo.security.keys_dir)
    return Client(topo.frontend, timeout_s=240, curve_keys=pair, server_key=router_key)


def wait_until_served(c: Client, cluster: Cluster) -> None:
    """Every unit was started in a bad order: ask until the mesh answers (the CLI's --wait does the same)."""
    import time

    deadline = time.monotonic() + 180
    while True:
        assert not cluster.dead(), "\n".join(cluster.dead())
        try:
            c.generate(prompt_token_ids=[1, 2, 3], max_tokens=1)
            return
        except Exception:  # noqa: BLE001 - not up yet (no tokenizer, no workers): the error says which
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def test_started_unit_by_unit_in_any_order_the_secured_cluster_serves_exactly(
    cluster: Running, smollm2_oracle: Any
) -> None:
    """Prefill on p1, decode on d1: every request's KV crosses hosts over tcp://, CURVE on every edge, and the
    tokens equal transformers'."""
    made, topo = cluster.cluster, cluster.topology
    c = client(topo)
    try:
        wait_until_served(c, made)
        rng = random.Random(32)
        prompts = [smollm2_oracle.tok.encode(f"Question {i}: name a colour and say why it is {rng.random():.3f}.")
                   for i in range(4)]
        results = c.generate_many([dict(prompt_token_ids=p, max_tokens=12, ignore_eos=True) for p in prompts])
    finally:
        c.close()
    for p, r in zip(prompts, results):
        assert not isinstance(r, Exception), r
        assert r.token_ids == smollm2_oracle.greedy(p, 12)
    assert not made.dead(), "\n".join(made.dead())


def test_a_decode_host_cut_off_for_ten_seconds_loses_nothing(cluster: Running, smollm2_oracle: Any) -> None:
    """Four streams decoding on d1 and d2; d1's link goes down right after every stream's first token, for 10 s
    (d1 keeps running, unreachable), then comes back. The router moves d1's streams (counted as decode deaths),
    every stream's deltas add up to its final tokens with no token twice, those equal transformers' (so nothing
    d1 computed meanwhile was delivered), and the mesh serves a batch again with d1 back. (That d1 itself takes
    work again is not checked here.)"""
    import threading
    import time

    made, topo = cluster.cluster, cluster.topology
    prompts = [smollm2_oracle.tok.encode(f"Write a long story about lighthouse number {i}.") for i in range(4)]
    first_token = [threading.Event() for _ in prompts]
    streams: list[list[Any]] = [[] for _ in prompts]
    c = client(topo)

    def follow(i: int) -> None:
        for msg in c.stream(prompt_token_ids=prompts[i], max_tokens=64, ignore_eos=True):
            streams[i].append(msg)
            first_token[i].set()

    try:
        wait_until_served(c, made)
        before = migrations(cluster, "decode_death")
        readers = [threading.Thread(target=follow, args=(i,)) for i in range(len(prompts))]
        for t in readers:
            t.start()
        assert all(e.wait(120) for e in first_token)
        made.cut("d1")
        time.sleep(10.0)
        made.restore("d1")
        for t in readers:
            t.join(240)
        assert not any(t.is_alive() for t in readers)
        after = c.generate_many([dict(prompt_token_ids=p, max_tokens=4, ignore_eos=True) for p in prompts * 2])
    finally:
        c.close()
    for p, msgs in zip(prompts, streams):
        *deltas, final = msgs
        assert final.token_ids == smollm2_oracle.greedy(p, 64)
        assert [t for d in deltas for t in d.token_ids] == final.token_ids
    assert all(not isinstance(r, Exception) and r.token_ids == smollm2_oracle.greedy(p, 4)
               for p, r in zip(prompts * 2, after))
    wait_for(lambda: migrations(cluster, "decode_death") > before, "the router's count of d1's moved streams")
    assert not made.dead(), "\n".join(made.dead())


def test_the_router_killed_mid_stream_loses_no_zeromq_or_sse_stream(cluster: Running, smollm2_oracle: Any) -> None:
    """Two ZeroMQ streams and two SSE streams (through the gateway on `front`) are decoding when the router is
    killed -9; it is started again 2 s later (systemd's RestartSec) on the same host. Every stream ends as if
    nothing happened: the ZeroMQ streams' deltas add up to transformers' tokens, the SSE streams' text is the
    undisturbed run's. The decode workers kept the streams running while no router was there, and the new router
    took each back from its worker (resumes "reclaimed") or, where the report came too late, computed it again
    ("readmitted")."""
    import threading
    import time

    made, topo = cluster.cluster, cluster.topology
    prompts = [smollm2_oracle.tok.encode(f"Write a long letter to the keeper of tower number {i}.") for i in range(4)]
    flowing = [threading.Event() for _ in prompts]
    streams: list[list[Any]] = [[], []]
    texts: list[str | BaseException] = ["", ""]
    url = f"http://{made.address('front')}:{GATEWAY_PORT}"
    c = client(topo)

    def follow(i: int) -> None:
        for msg in c.stream(prompt_token_ids=prompts[i], max_tokens=64, ignore_eos=True):
            streams[i].append(msg)
            flowing[i].set()

    def follow_sse(i: int) -> None:
        body = {"model": topo.model, "prompt": prompts[i], "max_tokens": 64, "stream": True, "ignore_eos": True,
                "temperature": 0}
        try:
            texts[i - 2] = sse_text(url, body, timeout_s=240, flowing=flowing[i])
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            texts[i - 2] = exc

    try:
        wait_until_served(c, made)
        before = resumes(cluster, "reclaimed") + resumes(cluster, "readmitted")
        readers = [threading.Thread(target=follow, args=(i,)) for i in range(2)]
        readers += [threading.Thread(target=follow_sse, args=(i,)) for i in range(2, 4)]
        for t in readers:
            t.start()
        assert all(e.wait(120) for e in flowing)
        made.kill("router")
        time.sleep(2.0)
        made.start("front", "router", "router", cluster.file, env=cluster.env)
        for t in readers:
            t.join(240)
        assert not any(t.is_alive() for t in readers)
        undisturbed = c.generate_many([dict(prompt_token_ids=p, max_tokens=64, ignore_eos=True) for p in prompts[2:]])
    finally:
        c.close()
    for p, msgs in zip(prompts, streams):
        *deltas, final = msgs
        assert final.token_ids == smollm2_oracle.greedy(p, 64)
        assert [t for d in deltas for t in d.token_ids] == final.token_ids
    for p, text, want in zip(prompts[2:], texts, undisturbed):
        assert want.token_ids == smollm2_oracle.greedy(p, 64)
        assert text == want.text, text
    wait_for(lambda: resumes(cluster, "reclaimed") + resumes(cluster, "readmitted") >= before + 4,
             "the new router's count of resumed streams")
    print(f"resumed on the new router: {resumes(cluster, 'reclaimed'):g} reclaimed, "
          f"{resumes(cluster, 'readmitted'):g} computed again")
    assert resumes(cluster, "reclaimed") >= 1
    assert not made.dead(), "\n".join(made.dead())


def test_status_shows_every_host_and_service_as_the_router_sees_it(cluster: Running) -> None:
    """`deepinfer-launch status --topology FILE` from outside the cluster (the root namespace reaches the router's
    backend on front): a line per service with its host's address, the running ones serving with a pid and load,
    p2's worker (not started yet) unregistered, so the exit status is 1; the published blocks by tier shown.

    Each service's clock against the router's: p2's 30 s ahead, d2's 30 s behind (CLOCK_SHIFTS), the others'
    true. Nothing in the mesh compares one host's wall clock with another's — liveness, deadlines and the pool's
    budget run on each process's monotonic clock, and the pool's files are aged by their times only past a margin
    far above any skew — and the other tests of the module show the skewed hosts serving as the others do: d2 takes
    the streams moved from d1 and from the killed router, p2's worker serves from the pool what p1 wrote, p2's
    daemon shares the pool's budget and rides out the pool going away."""
    import json
    import subprocess
    import sys

    made, topo = cluster.cluster, cluster.topology
    c = client(topo)
    try:
        wait_until_served(c, made)
        c.generate(prompt_token_ids=list(range(100, 180)), max_tokens=2)  # blocks for the index, whatever ran before
    finally:
        c.close()

    def status() -> tuple[int, dict[str, Any]]:
        run = subprocess.run([sys.executable, "-m", "deepinfer.launch.cli", "status", "--topology", str(cluster.file),
                              "--json"], capture_output=True, text=True, timeout=120)
        return run.returncode, {row["instance"]: row for row in map(json.loads, run.stdout.splitlines())}

    wait_for(lambda: any(row["cached_blocks"] for row in status()[1].values()),
             "blocks in the router's prefix index (a new router asks its publishers for a resync)")
    code, rows = status()
    assert code == 1  # prefill-1 never registered
    hosts = {name: host for host, role, name in UNITS if role not in ("router", "gateway")}  # the router's members
    hosts["prefill-1"] = "p2"
    assert sorted(rows) == sorted(hosts)
    for name, host in hosts.items():
        row = rows[name]
        assert row["host"] == made.address(host), row
        if name == "prefill-1":
            assert row["state"] == "unregistered" and not row["known"], row
        else:
            assert row["state"] == "serving" and row["alive"] and row["pid"] > 0 and row["incarnation"], row
            assert row["heartbeat_age_s"] is not None and row["heartbeat_age_s"] < 30, row
            shift = CLOCK_SHIFTS.get(host, 0.0)
            assert abs(row["clock_offset_s"] - shift) < 2.0, row
    assert all(rows[w]["total_blocks"] > 0 for w in ("prefill-0", "decode-0", "decode-1"))
    text = subprocess.run([sys.executable, "-m", "deepinfer.launch.cli", "status", "--topology", str(cluster.file)],
                          capture_output=True, text=True, timeout=120).stdout
    assert "HOST" in text.splitlines()[1] and "unregistered" in text and made.address("d2") in text, text
    assert "+30.0s" in text or "+29.9s" in text or "+30.1s" in text, text


def migrations(cluster: Running, cause: str) -> float:
    from tests.service.test_metrics_mesh import aggregate, total

    return total(aggregate(cluster.metrics), "deepinfer_router_migrations_total", cause=cause)


def resumes(cluster: Running, case: str) -> float:
    from tests.service.test_metrics_mesh import aggregate, total

    return total(aggregate(cluster.metrics), "deepinfer_router_resumes_total", case=case)


def test_a_prefix_computed_on_one_host_is_served_on_another_from_the_pool(
    cluster: Running, smollm2_oracle: Any
) -> None:
    """A long prompt prefilled on p1 leaves its blocks in the shared pool (written by p1's daemon). p2's worker
    joins, p1 is lost (every process on it killed), and the same prompt with a new question is prefilled on p2:
    its daemon, which opened before those blocks existed, finds them in the pool, and the request is served
    from the disk tier with transformers' tokens."""
    made, topo = cluster.cluster, cluster.topology
    shared = smollm2_oracle.tok.encode(" ".join(f"Line {i}: the pool is one directory every host mounts."
                                                for i in range(16)))
    first, second = shared + smollm2_oracle.tok.encode(" First?"), shared + smollm2_oracle.tok.encode(" Second?")
    blocks = len(shared) // topo.block_size
    c = client(topo)
    try:
        wait_until_served(c, made)
        on_disk = lambda: len(list(cluster.pool.rglob("*.kvb")))  # noqa: E731
        before = on_disk()  # the earlier tests' blocks: written behind long ago, nothing else writes now
        a = c.generate(prompt_token_ids=first, max_tokens=8, ignore_eos=True)
        wait_for(lambda: on_disk() >= before + blocks, "the shared prompt's blocks on the pool's disk")
        made.start("p2", "worker", "prefill-1", cluster.file, env=cluster.env)
        made.kill_host("p1")
        b = c.generate(prompt_token_ids=second, max_tokens=8, ignore_eos=True)
    finally:
        c.close()
    assert a.token_ids == smollm2_oracle.greedy(first, 8)
    assert b.token_ids == smollm2_oracle.greedy(second, 8)
    assert b.usage.cached_by_tier.get("disk", 0) >= (blocks - 1) * topo.block_size, b.usage


def test_the_pool_gone_full_or_read_only_fails_no_request(cluster: Running, smollm2_oracle: Any,
                                                         tmp_path: Path) -> None:
    """The pool's mount goes away (an empty read-only mount over it: every block file gone, every write refused),
    then is full (a 1 MiB tmpfs over it, about one block: writes fail with ENOSPC), then comes back read-only,
    then read-write, under every daemon at once. Throughout, prompts are answered with transformers' tokens (the
    workers compute what the pool cannot give) and no service dies; the daemons count the failed writes by cause
    (deepinfer_cache_disk_write_errors_total); back read-write, new blocks reach the pool again."""
    from tests.service.test_metrics_mesh import aggregate, total

    made, topo = cluster.cluster, cluster.topology
    on_disk = lambda: len(list(cluster.pool.rglob("*.kvb")))  # noqa: E731
    c = client(topo)

    def answered(tag: str) -> None:
        prompts = [smollm2_oracle.tok.encode(" ".join(f"{tag} line {i}: the pool may vanish, yet nothing fails."
                                                      for i in range(8 + k))) for k in range(3)]
        outs = c.generate_many([dict(prompt_token_ids=p, max_tokens=4, ignore_eos=True) for p in prompts])
        for p, out in zip(prompts, outs):
            assert not isinstance(out, Exception), (tag, out)
            assert out.token_ids == smollm2_oracle.greedy(p, 4), tag

    daemons = [s.name for s in made.services if s.role == "kvcache" and s.process.poll() is None]

    def mount(source: Path) -> None:  # on every host running a daemon, as a mount that changed under them all
        for name in daemons:
            made.in_mounts(name, "mount", "--bind", str(source), str(cluster.pool))
            made.in_mounts(name, "mount", "-o", "remount,bind,ro", str(cluster.pool))

    def unmount() -> None:
        for name in daemons:
            made.in_mounts(name, "umount", "--lazy", str(cluster.pool))

    try:
        wait_until_served(c, made)
        (tmp_path / "empty").mkdir()
        mount(tmp_path / "empty")
        try:
            answered("gone")
            # The daemons tried to write the new prompts' blocks behind them, and the mount refused.
            logs = [s.log for s in made.services if s.name in daemons]
            wait_for(lambda: any("disk writes failing" in log.read_text() for log in logs),
                     "a daemon's warning that its disk writes fail")
        finally:
            unmount()
        write_errors = lambda: total(aggregate(cluster.metrics), "deepinfer_cache_disk_write_errors_total",  # noqa: E731
                                     cause="no_space")
        full_before = write_errors()
        for name in daemons:
            made.in_mounts(name, "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(cluster.pool))
        try:
            answered("full")
            wait_for(lambda: write_errors() > full_before, "the daemons' count of writes a full pool refused")
        finally:
            unmount()
        mount(cluster.pool)
        try:
            answered("read-only")
        finally:
            unmount()
        before = on_disk()
        answered("back")
        wait_for(lambda: on_disk() > before, "new blocks in the pool once it is writable again")
        # Every daemon takes part in the pool's one budget: its usage note is there (cache.pool_share).
        notes = lambda: {p.name for p in cluster.pool.glob("*/.usage/*")}  # noqa: E731
        wait_for(lambda: set(daemons) <= notes(), "every daemon's note of its share of the pool")
    finally:
        c.close()
    assert not made.dead(), "\n".join(made.dead())


def wait_for(check: Any, what: str, timeout_s: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
