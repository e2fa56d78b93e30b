"""The mesh as a cluster (issue 32): hosts are network namespaces joined by a bridge (bench/cluster_harness.py),
each service started in its host's namespace as its systemd unit runs it, every edge CURVE-secured over tcp://.

The cluster: `front` (router, tokenizer), `p1` (a prefill worker and a cache daemon), `d1` (a decode worker and a
cache daemon); both daemons' disk tiers on one pool directory (the shared mount). The services start one by one
in an order no supervisor would choose (decode first, router last), as independent units do; the clients run in
the root namespace, reaching only `front`.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.cluster_harness import Cluster, available
from deepinfer.launch.keys import make_keys
from deepinfer.launch.sections import KvCacheSpec, SecuritySpec, TokenizerSpec, WorkerSpec
from deepinfer.launch.topology import Topology
from deepinfer.protocol.auth import load_client_keys
from deepinfer.protocol.client import Client

pytestmark = [pytest.mark.smollm2, pytest.mark.skipif(available() is not None, reason=str(available()))]

HOSTS = ("front", "p1", "d1")
# (host, role, name): every service of the topology below, in the order the test starts them.
UNITS = [("d1", "worker", "decode-0"), ("front", "tokenizer", "tokenizer-0"), ("p1", "kvcache", "kvcache-p1"),
         ("p1", "worker", "prefill-0"), ("d1", "kvcache", "kvcache-d1"), ("front", "router", "router")]


def cluster_topology(cluster: Cluster, model: str, keys: Path, pool: Path) -> Topology:
    front, p1, d1 = (cluster.address(h) for h in HOSTS)
    return Topology(
        model, f"tcp://{front}:5550", f"tcp://{front}:5551", (TokenizerSpec("tokenizer-0", f"tcp://{front}:5560"),),
        (WorkerSpec("prefill-0", "prefill", f"tcp://{p1}:5570", threads=1, kv_cache_mb=64, kvcache="kvcache-p1"),
         WorkerSpec("decode-0", "decode", f"tcp://{d1}:5570", threads=1, kv_cache_mb=64, kvcache="kvcache-d1")),
        kvcaches=(KvCacheSpec("kvcache-p1", f"tcp://{p1}:5580", dir=str(pool), host_mb=64, disk_mb=256),
                  KvCacheSpec("kvcache-d1", f"tcp://{d1}:5580", dir=str(pool), host_mb=64, disk_mb=256)),
        security=SecuritySpec(str(keys)),
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[tuple[Cluster, Topology]]:
    root = tmp_path_factory.mktemp("cluster")
    with Cluster(HOSTS, log_dir=root) as made:
        topo = cluster_topology(made, str(smollm2_path), root / "keys", root / "pool")
        path = root / "cluster.toml"
        path.write_text(topo.to_toml())
        make_keys(root / "keys", topo)
        for host, role, name in UNITS:
            made.start(host, role, name, path)
        yield made, topo
    assert made.leftovers() == []  # every namespace, link and process gone


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
    cluster: tuple[Cluster, Topology], smollm2_oracle: Any
) -> None:
    """Prefill on p1, decode on d1: every request's KV crosses hosts over tcp://, CURVE on every edge, and the
    tokens equal transformers'."""
    made, topo = cluster
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
