"""Requests that reach a worker while its engine is in the middle of a step all start at the next step.

The worker's socket loops hand every engine command to the engine thread and go on reading: none of them
waits for a step boundary. (They once did: each PrefillJob's handler waited until the engine had taken the
job, so the next job stayed unread in the socket and a burst arriving at a busy worker was admitted one
request per step; under 32 concurrent streams a third of the requests waited 3–14 s for their first
token.) Here a step is held open while a burst arrives; every job of the burst (and, disaggregated, every
KvReserve the decode worker receives) must be queued on the engine thread before the step is let go.
Outputs still equal the engine's, and every block comes back."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

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

BURST = 8
MAX_TOKENS = 6


class StepGate:
    """Wraps an engine's step: once closed, the next step waits (on the engine thread) until opened."""

    def __init__(self, engine: LLMEngine) -> None:
        self.closed = False
        self.holding = threading.Event()  # a step is waiting at the gate
        self._open = threading.Event()
        step = engine.step

        def gated_step(*a: Any, **kw: Any) -> Any:
            if self.closed:
                self.holding.set()
                self._open.wait(120)
            return step(*a, **kw)

        engine.step = gated_step  # type: ignore[method-assign]

    def open(self) -> None:
        self.closed = False
        self._open.set()


async def until(check, what: str, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout_s / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not reached: {what}")


@pytest.fixture(scope="module")
def burst_reference(smollm2_path):
    engine = LLMEngine.load(smollm2_path, EngineConfig(kv_cache_bytes=64 << 20))
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": f"Name animal number {i}."}])
               for i in range(BURST + 1)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    return prompts, [o.token_ids for o in outs]


@pytest.mark.parametrize("disaggregated", [False, True], ids=["colocated-no-cache", "disaggregated-with-cache"])
def test_a_burst_at_a_busy_worker_is_queued_whole_for_the_next_step(smollm2_path, tmp_path, burst_reference,
                                                                    disaggregated):
    prompts, want = burst_reference
    topo = Topology.local(str(smollm2_path), "inproc", disaggregated=disaggregated, threads=1, kv_cache_mb=64,
                          kvcache=disaggregated, cache_dir=tmp_path / "kvcache")
    # Held in turn: the worker that takes the router's jobs, and with P/D also the decode worker, which
    # takes the prefill worker's KvReserves. Each check counts what the held worker has read and queued.
    if disaggregated:
        plan = [("prefill-0", lambda w: len(w.core) >= BURST + 1),
                ("decode-0", lambda w: w._thread.pending >= BURST)]
    else:
        plan = [("worker-0", lambda w: len(w.core) >= BURST + 1 and w._thread.pending >= BURST)]

    async def run() -> None:
        mesh = InprocMesh(topo)
        await mesh.start()
        free = [e.num_free_blocks for e in worker_engines(mesh)]
        try:
            async with AsyncClient(mesh.topology.frontend, ctx=mesh.ctx, timeout_s=180) as c:
                for name, queued in plan:
                    worker = mesh.service(name)
                    gate = StepGate(worker.engine)
                    # A first request keeps the engine busy, and the gate holds its next step: with P/D,
                    # the prefill worker's step computing its prompt; else a step in the middle of its decode.
                    gate.closed = name == "prefill-0"

                    async def first_request(g: StepGate = gate) -> None:
                        async for msg in c.stream(prompt_token_ids=prompts[0], max_tokens=32, ignore_eos=True):
                            if isinstance(msg, m.StreamDelta):
                                g.closed = True

                    first = asyncio.ensure_future(first_request())
                    await asyncio.get_running_loop().run_in_executor(None, gate.holding.wait, 60)
                    assert gate.holding.is_set()
                    burst = [asyncio.ensure_future(c.generate(prompt_token_ids=p, max_tokens=MAX_TOKENS,
                                                              ignore_eos=True)) for p in prompts[1:]]
                    await until(lambda w=worker, q=queued: q(w), f"{name}: the whole burst read and queued")
                    gate.open()
                    assert [r.token_ids for r in await asyncio.gather(*burst)] == want[1:], name
                    await first
            await settle(mesh, free)
        finally:
            await mesh.stop()

    asyncio.run(run())
