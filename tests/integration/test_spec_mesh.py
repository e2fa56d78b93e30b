"""Speculative decoding through the whole mesh, in one process, co-located and disaggregated: with n-gram
speculation on the decoding worker, greedy outputs equal the engine's without speculation token for token
(streamed too, where a step may now carry several tokens), every request's usage reports the draft tokens
proposed and accepted, the router sums them, and the decoding worker's heartbeats carry its counters to the
router's view of it. Prompts repeat themselves so that n-gram lookup has something to find."""

from __future__ import annotations

import asyncio

import pytest

from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import SamplingParams
from deepinfer.launch.mesh import InprocMesh
from deepinfer.launch.topology import Topology
from deepinfer.protocol import messages as m
from deepinfer.protocol.client import AsyncClient
from tests.integration.test_mesh import settle, worker_engines

pytestmark = pytest.mark.smollm2

# Each answer repeats itself or the prompt (checked on SmolLM2: most output positions end in an n-gram
# seen earlier in the sequence).
QUESTIONS = ["Write the word 'hello' ten times.", "Count from 1 to 20, separated by commas.",
             "Copy this sentence exactly: the quick brown fox jumps over the lazy dog.",
             "Repeat this list twice: apple, banana, cherry, apple, banana, cherry."]
MAX_TOKENS = 32
HEARTBEAT_WAIT_S = 5.0  # heartbeats come every 0.5 s


@pytest.fixture(scope="module")
def reference(smollm2_path):
    """The engine's greedy answers without speculation: what the speculating mesh must reproduce."""
    engine = LLMEngine.load(smollm2_path, EngineConfig(kv_cache_bytes=64 * 1024 * 1024))
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    # Every block a committed sequence (prompt and answer) names: all the cache daemon may ever hold.
    names = {h for p, o in zip(prompts, outs) for h in engine.block_hashes(p + o.token_ids)}
    return [o.token_ids for o in outs], names


def topology(path, disaggregated: bool) -> Topology:
    # Adaptive speculation off: the controller may rightly decide that speculation does not pay on this
    # machine and propose nothing; always proposing makes "something was proposed" a fair assertion.
    return Topology.local(str(path), "inproc", disaggregated=disaggregated, threads=1, kv_cache_mb=64,
                          speculative="ngram", num_speculative_tokens=4, adaptive_speculation=False)


async def router_view(mesh: InprocMesh, name: str) -> m.Heartbeat:
    """The router's latest heartbeat of worker `name`, once it shows the worker's current counters."""
    engine = mesh.service(name).engine
    inst = mesh.service("router").core.table.get(name)
    for _ in range(int(HEARTBEAT_WAIT_S / 0.05)):
        if inst.load is not None and inst.load.spec_proposed_tokens == engine.stats.spec_proposed_tokens:
            break
        await asyncio.sleep(0.05)
    return inst.load


async def daemon_blocks(mesh: InprocMesh, timeout_s: float = 10.0) -> set[bytes]:
    """Every block the cache daemon holds, once its write-behind has landed."""
    store = mesh.service("kvcache-0").store
    for _ in range(int(timeout_s / 0.05)):
        if not store.pending_writes() and any(store.snapshot().values()):
            break
        await asyncio.sleep(0.05)
    return {h for hashes in store.snapshot().values() for h in hashes}


@pytest.mark.parametrize("disaggregated", [False, True], ids=["colocated", "disaggregated"])
def test_speculating_mesh_equals_the_engine_and_reports_its_drafts(smollm2_path, reference, disaggregated):
    decoder = "decode-0" if disaggregated else "worker-0"

    async def run():
        mesh = InprocMesh(topology(smollm2_path, disaggregated))
        await mesh.start()
        free = [e.num_free_blocks for e in worker_engines(mesh)]
        try:
            async with AsyncClient(mesh.topology.frontend, ctx=mesh.ctx, timeout_s=120) as c:
                results = await asyncio.gather(*[
                    c.generate(messages=[{"role": "user", "content": q}], max_tokens=MAX_TOKENS) for q in QUESTIONS])
                streamed = [msg async for msg in c.stream(messages=[{"role": "user", "content": QUESTIONS[0]}],
                                                          max_tokens=MAX_TOKENS)]
            await settle(mesh, free)  # verification steps must not leak KV blocks
            stored = await daemon_blocks(mesh)
            view = await router_view(mesh, decoder)
            stats = {s.instance: s.engine.stats for s in mesh.services if hasattr(s, "engine")}
            metrics = mesh.service("router").core.metrics
        finally:
            await mesh.stop()
        return results, streamed, view, stats, metrics, stored

    results, streamed, view, stats, metrics, stored = asyncio.run(run())
    reference, committed = reference
    assert [r.token_ids for r in results] == reference
    # Written behind to the daemon: blocks of committed tokens only, never one holding a rejected draft.
    assert stored and stored <= committed
    for r in results:
        assert r.usage.completion_tokens == len(r.token_ids)
        assert r.usage.spec_proposed_tokens >= r.usage.spec_accepted_tokens >= 0
    assert sum(r.usage.spec_proposed_tokens for r in results) > 0

    deltas, final = streamed[:-1], streamed[-1]
    assert isinstance(final, m.RequestFinished) and all(isinstance(d, m.StreamDelta) for d in deltas)
    assert [t for d in deltas for t in d.token_ids] == final.token_ids == reference[0]
    assert "".join(d.text for d in deltas) == final.text
    assert final.usage.spec_proposed_tokens >= final.usage.spec_accepted_tokens >= 0
    if final.usage.spec_accepted_tokens:  # an accepted draft token rode in a step with the model's own
        assert any(len(d.token_ids) > 1 for d in deltas)

    # The router's totals are the requests' usage; the decoding worker's engine counters reach the router in
    # its heartbeats. The prefill worker, which stops after one token, never speculates.
    usages = [r.usage for r in results] + [final.usage]
    assert metrics.spec_proposed_tokens == sum(u.spec_proposed_tokens for u in usages)
    assert metrics.spec_accepted_tokens == sum(u.spec_accepted_tokens for u in usages)
    counters = (stats[decoder].spec_proposed_tokens, stats[decoder].spec_accepted_tokens)
    assert counters[0] >= counters[1] >= 0 and counters[0] > 0
    assert (view.spec_proposed_tokens, view.spec_accepted_tokens) == counters
    if disaggregated:
        assert stats["prefill-0"].spec_proposed_tokens == 0
