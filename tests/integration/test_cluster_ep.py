"""Expert parallelism across hosts (issue 32): an EP = 2 worker group whose two ranks run on two hosts (network
namespaces e1 and e2, bench/cluster_harness.py), torch.distributed's gloo over tcp:// between them, each rank
started as its unit runs it (`deepinfer-launch service worker --name worker-0 --rank R`); the router and the
tokenizer on `front`. The topology names each rank's host (`rank_hosts`), and each host's units (`systemd --host`)
are its ranks'. The model is a tiny random-weight Mixtral (test_group_mesh's, SmolLM2's tokenizer).

Its greedy output equals the same model in one process (EP = 1) token for token. Then e2 is lost under load
(every process there killed): rank 0 stops the broken group, both ranks are started again (as their units'
Restart= would, e2 back), and every stream that was in flight finishes on the new group with the undisturbed
tokens: the router moved them there (they waited parked for it).

The group's rendezvous (torch.distributed's TCPStore on `ep_master`) and its collectives are not authenticated:
run a group's ranks on a network only they share (docs/cluster.md)."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from bench.cluster_harness import Cluster, available
from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import SamplingParams
from deepinfer.launch.sections import TokenizerSpec, WorkerSpec
from deepinfer.launch.systemd import unit_files
from deepinfer.launch.topology import RouterConfig, Topology
from deepinfer.protocol.client import Client
from tests.integration.test_cluster import idle_everywhere
from tests.integration.test_group_mesh import tiny_mixtral  # noqa: F401 - the fixture

pytestmark = [pytest.mark.smollm2, pytest.mark.skipif(available() is not None, reason=str(available()))]

MAX_TOKENS = 24
ENV = {"GLOO_SOCKET_IFNAME": "eth0"}  # gloo's interface inside each host's namespace: its link to the others


def wait_served(c: Client, made: Cluster, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            c.generate(prompt_token_ids=[300, 301, 302], max_tokens=1)
            return
        except Exception:  # noqa: BLE001 - not up yet: the error says which part is missing
            if time.monotonic() > deadline:
                raise AssertionError("the EP group never served:\n" + "\n".join(made.dead())) from None
            time.sleep(1.0)


def test_an_ep_group_across_two_hosts_serves_as_one_process_and_comes_back_from_a_lost_host(
        tiny_mixtral: Path, tmp_path: Path) -> None:  # noqa: F811 - the fixture
    rng = random.Random(7)
    prompts = [[rng.randrange(300, 49152) for _ in range(24 + 4 * i)] for i in range(4)]
    engine = LLMEngine.load(str(tiny_mixtral), EngineConfig(kv_cache_bytes=32 << 20))
    want = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))]
    with Cluster(("front", "e1", "e2"), log_dir=tmp_path) as made:
        front, e1 = made.address("front"), made.address("e1")
        topo = Topology(str(tiny_mixtral), f"tcp://{front}:5550", f"tcp://{front}:5551",
                        (TokenizerSpec("tokenizer-0", f"tcp://{front}:5560"),),
                        (WorkerSpec("worker-0", "worker", f"tcp://{e1}:5570", threads=2, kv_cache_mb=32, ep=2,
                                    ep_master=f"{e1}:29611", rank_hosts=(e1, made.address("e2"))),),
                        router=RouterConfig(placement_timeout_s=240.0), insecure=True)
        path = tmp_path / "ep.toml"
        path.write_text(topo.to_toml())
        # Each host's units (`systemd --host`) run exactly its ranks, as this test starts them below.
        for host, rank in (("e1", 0), ("e2", 1)):
            units = [n for n in unit_files(path, topo, host=made.address(host)) if "-rank" in n]
            assert units == [f"deepinfer-worker-worker-0-rank{rank}.service"], (host, units)
        for host, role, extra in (("front", "router", ()), ("front", "tokenizer", ()),
                                  ("e2", "worker", ("--rank", "1")), ("e1", "worker", ("--rank", "0"))):
            made.start(host, role, {"router": "router", "tokenizer": "tokenizer-0"}.get(role, "worker-0"), path,
                       *extra, env=ENV)
        with Client(topo.frontend, timeout_s=300) as c:
            wait_served(c, made)
            outs = c.generate_many([dict(prompt_token_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True)
                                    for p in prompts])
            assert [o.token_ids for o in outs] == want  # EP = 2 across hosts = EP = 1

            streams: list[list[Any]] = [[] for _ in prompts]
            flowing = [threading.Event() for _ in prompts]

            def follow(i: int) -> None:
                try:
                    for msg in c.stream(prompt_token_ids=prompts[i], max_tokens=MAX_TOKENS, ignore_eos=True):
                        streams[i].append(msg)
                        flowing[i].set()
                except Exception as exc:  # noqa: BLE001 - the assertions below say what it was
                    streams[i].append(exc)
                    flowing[i].set()

            readers = [threading.Thread(target=follow, args=(i,)) for i in range(len(prompts))]
            for t in readers:
                t.start()
            assert all(e.wait(240) for e in flowing)
            made.kill_host("e2")
            rank0 = next(s for s in made.services if s.host == "e1")
            rank0.process.wait(timeout=300)  # it stops the broken group
            made.services.remove(rank0)  # its exit was the group's answer to the loss, not a failure
            made.start("e2", "worker", "worker-0", path, "--rank", "1", env=ENV)
            made.start("e1", "worker", "worker-0", path, "--rank", "0", env=ENV)
            for t in readers:
                t.join(300)
            assert not any(t.is_alive() for t in readers)
        idle_everywhere(topo)  # the new group holds no request and no block of the moved streams'
        for i, msgs in enumerate(streams):
            *deltas, final = msgs
            assert not isinstance(final, Exception), (i, final)
            assert final.token_ids == want[i], i
            assert [t for d in deltas for t in d.token_ids] == want[i], i
        assert not made.dead(), "\n".join(made.dead())
    assert made.leftovers() == []
