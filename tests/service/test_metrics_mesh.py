"""A mesh's exported metrics (in one process, so this process's registry): after a few requests through the
client, the router's histograms count each request once, generation tokens add up to what the clients got,
the workers' KV pool gauges and the cache daemon's tiers are there, a repeated prompt counts prefix hits,
and the P/D handoff counts its bytes. Values are compared as growth: other tests in this process may have
run meshes under the same instance names."""

from __future__ import annotations

import asyncio
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


def snapshot() -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    body, _ = metrics.exposition()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


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
                if total(after, "deepinfer_kv_blocks_free", instance="decode-0") and total(
                        after, "deepinfer_cache_tier_capacity_bytes", tier="host") and acked == handoffs and all(steps):
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
