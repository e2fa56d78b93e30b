"""A mesh's exported metrics (in one process, so this process's registry): after a few requests through the
client, the router's histograms count each request once, generation tokens add up to what the clients got,
the workers' KV pool gauges and the cache daemon's tiers are there, a repeated prompt counts prefix hits,
and the P/D handoff counts its bytes. Values are compared as growth: other tests in this process may have
run meshes under the same instance names."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepinfer import metrics
from deepinfer.launch.mesh import InprocMesh
from deepinfer.launch.topology import Topology
from deepinfer.protocol import messages as m
from deepinfer.protocol.client import AsyncClient

pytestmark = pytest.mark.smollm2

QUESTIONS = ["What is 2 + 2?", "Name a colour.", "Who wrote Hamlet?"]
# Long enough for several full KV blocks, so asking it twice finds its prefix cached.
REPEATED = ("You are a careful assistant. Read the question, think about what it asks, and answer it in one "
            "short sentence without any preamble. The question: what is the capital of France?")
MAX_TOKENS = 8


def parse(body: bytes) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def snapshot() -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return parse(metrics.exposition()[0])


def aggregate(directory: Path) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """What GET /metrics shows for the processes writing to `directory` (read in a process of its own, so
    this one's prometheus_client mode does not matter)."""
    env = {**os.environ, metrics.MULTIPROC_ENV: str(directory)}
    out = subprocess.run([sys.executable, "-c", "import sys; from deepinfer import metrics; "
                          "sys.stdout.write(metrics.exposition()[0].decode())"],
                         env=env, capture_output=True, check=True, timeout=120)
    return parse(out.stdout)


def total(snap: dict[Any, float], name: str, **labels: str) -> float:
    """The sum of `name` over every series whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in snap.items() if n == name and want <= ls)


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    monkeypatch.delenv(metrics.MULTIPROC_ENV, raising=False)


def test_a_mesh_exports_its_requests_pool_cache_and_handoffs(smollm2_path):
    topo = Topology.local(str(smollm2_path), "inproc", disaggregated=True, threads=1, kv_cache_mb=64)

    async def run() -> tuple[list[m.RequestFinished], dict[Any, float], dict[Any, float], int]:
        before = snapshot()
        mesh = InprocMesh(topo)
        await mesh.start()
        try:
            async with AsyncClient(topo.frontend, ctx=mesh.ctx, timeout_s=120) as c:
                results = list(await asyncio.gather(*[
                    c.generate(messages=[{"role": "user", "content": q}], max_tokens=MAX_TOKENS) for q in QUESTIONS]))
                for _ in range(2):  # one after the other: the second finds the first's blocks
                    results.append(await c.generate(prompt=REPEATED, max_tokens=MAX_TOKENS))
                streamed = [msg async for msg in c.stream(prompt=QUESTIONS[0], max_tokens=MAX_TOKENS)]
                results.append(streamed[-1])
            # The decode worker's heartbeats carry the time per token it measured by batch size (it decoded
            # the repeated prompt's tokens one step after another); a request placed once the router has them
            # is given a predicted TPOT, and its actual over predicted is exported when it finishes.
            decode = mesh.service("router").core.table.get("decode-0")
            for _ in range(400):
                if decode.load is not None and decode.load.tpot_by_batch:
                    break
                await asyncio.sleep(0.05)
            assert decode.load.tpot_by_batch, "no cadence in decode-0's heartbeats"
            async with AsyncClient(topo.frontend, ctx=mesh.ctx, timeout_s=120) as c:
                results.append(await c.generate(prompt=QUESTIONS[1], max_tokens=MAX_TOKENS))
            # The pool gauges and the tiers come with heartbeats, and a handoff's KvAck may reach the prefill
            # worker after its request finished: wait for them.
            for _ in range(400):
                after = snapshot()
                acked = total(after, "deepinfer_kv_transfer_seconds_count", path="handoff_send") - total(
                    before, "deepinfer_kv_transfer_seconds_count", path="handoff_send")
                handoffs = mesh.service("prefill-0").engine.stats.handoffs_out
                step_count = "deepinfer_worker_step_duration_seconds_count"
                steps = [total(after, step_count, instance=w) - total(before, step_count, instance=w)
                         for w in ("prefill-0", "decode-0")]
                tpot_count = "deepinfer_router_tpot_over_predicted_count"
                predicted = total(after, tpot_count) > total(before, tpot_count)
                if total(after, "deepinfer_kv_blocks_free", instance="decode-0") and total(
                        after, "deepinfer_cache_tier_capacity_bytes", tier="host") and acked == handoffs and all(
                        steps) and predicted:
                    break
                await asyncio.sleep(0.05)
        finally:
            await mesh.stop()
        return results, before, after, handoffs

    # A request placed before the prefill worker's first heartbeat is prefilled by the decode worker: not
    # every request is handed off, so the handoffs are compared with the prefill engine's count.
    results, before, after, handoffs = asyncio.run(run())

    def grew(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    n = len(results)
    assert all(isinstance(r, m.RequestFinished) for r in results)
    router = {"service": "router"}
    assert grew("deepinfer_time_to_first_token_seconds_count", **router) == n
    assert grew("deepinfer_e2e_request_latency_seconds_count", **router) == n
    assert grew("deepinfer_e2e_request_latency_seconds_bucket", le="+Inf", **router) == n
    assert grew("deepinfer_request_success_total", **router) == n
    assert grew("deepinfer_generation_tokens_total", **router) == sum(len(r.token_ids) for r in results)
    assert grew("deepinfer_prompt_tokens_total", **router) == sum(r.usage.prompt_tokens for r in results)
    assert grew("deepinfer_prefix_cache_hits_total", **router) == sum(r.usage.cached_tokens for r in results) > 0
    assert grew("deepinfer_request_errors_total", **router) == 0
    assert grew("deepinfer_router_tpot_over_predicted_count", **router) >= 1
    # Each worker's pool, by its role.
    for service, instance in (("prefill", "prefill-0"), ("decode", "decode-0")):
        used = total(after, "deepinfer_kv_blocks_used", service=service, instance=instance)
        free = total(after, "deepinfer_kv_blocks_free", service=service, instance=instance)
        assert free > 0 and used >= 0
        assert grew("deepinfer_worker_step_duration_seconds_count", service=service, instance=instance) > 0
    assert grew("deepinfer_kv_transfer_bytes_total", path="handoff_send") == grew(
        "deepinfer_kv_transfer_bytes_total", path="handoff_recv") > 0
    assert grew("deepinfer_kv_transfer_seconds_count", path="handoff_send") == handoffs > 0
    assert total(after, "deepinfer_cache_tier_capacity_bytes", service="kvcache", tier="host") > 0
    assert total(after, "deepinfer_service_up", service="tokenizer") >= 1


def test_the_processes_of_a_launched_mesh_add_up_in_one_directory(smollm2_path, tmp_path):
    """`up` (a process per service): the router's, the tokenizer's and the worker's samples meet in the run's
    metrics directory; once the mesh stops, every service says it is down and the counters stay."""
    import deepinfer

    proc = subprocess.Popen(
        [sys.executable, "-m", "deepinfer.launch.cli", "up", "--model", str(smollm2_path), "--threads", "1",
         "--kv-cache-mb", "64", "--run-dir", str(tmp_path), "--colocated", "--no-kvcache"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    directory = tmp_path / "metrics"
    try:
        assert "ready" in proc.stdout.readline()
        frontend = proc.stdout.readline().strip()
        ready = aggregate(directory)  # the supervisor's readiness probe was a request too
        with deepinfer.Client(frontend, timeout_s=120) as c:
            results = [c.generate(q, max_tokens=MAX_TOKENS) for q in QUESTIONS[:2]]
        for _ in range(100):  # the worker's pool gauges and steps come with its heartbeats
            snap = aggregate(directory)
            if total(snap, "deepinfer_kv_blocks_free", service="worker") and total(
                    snap, "deepinfer_worker_step_duration_seconds_count", service="worker"):
                break
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    assert code == 0
    def grew(name: str) -> float:
        return total(snap, name, service="router") - total(ready, name, service="router")

    assert grew("deepinfer_time_to_first_token_seconds_count") == len(results)
    assert grew("deepinfer_request_success_total") == len(results)
    assert grew("deepinfer_generation_tokens_total") == sum(len(r.token_ids) for r in results)
    assert total(snap, "deepinfer_kv_blocks_free", service="worker") > 0
    assert total(snap, "deepinfer_worker_step_duration_seconds_count", service="worker") > 0
    up = {dict(labels)["service"]: v for (name, labels), v in snap.items() if name == "deepinfer_service_up"}
    assert up == {"router": 1, "tokenizer": 1, "worker": 1}
    after = aggregate(directory)
    assert total(after, "deepinfer_service_up") == 0
    # The supervisor reported every child's exit: their live gauges went with them, their counters stayed.
    assert not any(name == "deepinfer_kv_blocks_free" for name, _ in after)
    assert total(after, "deepinfer_time_to_first_token_seconds_count", service="router") == total(
        snap, "deepinfer_time_to_first_token_seconds_count", service="router")
