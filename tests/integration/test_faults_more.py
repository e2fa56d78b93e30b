"""Fault tests with real processes, continued: kill -9 one of two co-located workers (role "worker", no P/D)
while it holds several streams; the other one takes them over and every stream completes with the output of
an undisturbed engine, delta by delta, without a gap or a repeated token (as test_faults checks for a decode
worker)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time

import pytest

from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import SamplingParams
from deepinfer.launch.topology import RouterConfig, Topology
from deepinfer.protocol.client import Client
from tests.integration.supervised import metric, supervised_mesh
from tests.integration.test_faults import assert_undisturbed, streams_through_a_fault

pytestmark = pytest.mark.smollm2

NUM_STREAMS = 12
MAX_TOKENS = 96  # long enough that the victim still holds several streams when the heartbeat reports them
VICTIM_HOLDS = 3  # kill only once the victim runs at least this many streams
RUNNING = "deepinfer_num_requests_running"  # a worker's running batch, refreshed at its heartbeat rate


def greedy(i: int) -> dict:
    return dict(max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def colocated_reference(smollm2_path):
    """12 prompts and what an undisturbed single engine answers to each (greedy)."""
    engine = LLMEngine.load(smollm2_path, EngineConfig(kv_cache_bytes=64 << 20))
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": f"Describe harbour number {i}."}])
               for i in range(NUM_STREAMS)]
    outs = engine.generate(prompts, SamplingParams(**greedy(0)))
    return prompts, [o.token_ids for o in outs]


@pytest.fixture
def colocated_mesh(smollm2_path, tmp_path):
    """Two co-located workers (each prefills and decodes its own requests) and two tokenizers."""
    topo = Topology.local(str(smollm2_path), "ipc", tmp_path, disaggregated=False, num_tokenizers=2, threads=1,
                          kv_cache_mb=64)
    (first,) = topo.workers
    second = dataclasses.replace(first, name="worker-1", kv=f"ipc://{tmp_path}/worker-1-kv.sock")
    topo = dataclasses.replace(topo, workers=(first, second), router=RouterConfig(heartbeat_timeout_s=1.5))
    with supervised_mesh(topo, tmp_path, metrics=True) as sup:
        yield sup


def test_kill_9_one_of_two_colocated_workers_moves_its_streams_to_the_other(colocated_mesh, colocated_reference):
    prompts, want = colocated_reference
    mesh = colocated_mesh
    victim = mesh.child("worker-0")
    held: list[float] = []

    async def kill_once_it_holds_several() -> None:
        deadline = time.monotonic() + 240  # a guard, not a timing: the heartbeat reports every 0.5 s
        while (running := metric(mesh.log_dir, RUNNING, instance="worker-0") or 0) < VICTIM_HOLDS:
            assert time.monotonic() < deadline, "worker-0 never ran several streams"
            await asyncio.sleep(0.05)
        held.append(running)
        os.kill(victim.proc.pid, signal.SIGKILL)

    results = asyncio.run(streams_through_a_fault(mesh.topology.frontend, prompts, kill_once_it_holds_several,
                                                  greedy))
    print(f"worker-0 ran {held[0]:.0f} streams when killed")
    assert_undisturbed(results, want)
    router_log = (mesh.log_dir / "router.log").read_text()
    assert "service exited" in router_log and "worker-0" in router_log
    # The streams it held moved to worker-1 (the router counts a move per request; refreshed every 0.5 s).
    deadline = time.monotonic() + 60
    while (metric(mesh.log_dir, "deepinfer_router_events_total", event="moves") or 0) < 1:
        assert time.monotonic() < deadline, "the router moved no request"
        time.sleep(0.2)
    # The supervisor restarts the worker; it re-registers and serves again.
    deadline = time.monotonic() + 120
    while victim.restarts == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert victim.restarts >= 1
    mesh.wait_ready(timeout_s=120)
    with Client(mesh.topology.frontend, timeout_s=60) as c:
        assert len(c.generate(prompt="Hello", max_tokens=5, ignore_eos=True).token_ids) == 5
