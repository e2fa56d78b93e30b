"""The engine thread measures the time per output token by batch size (services/token_cadence) over
back-to-back steps of a real engine, for the heartbeats the router judges TPOT SLOs by."""

from __future__ import annotations

import asyncio

import pytest

from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import SamplingParams
from deepinfer.services.engine_thread import EngineThread

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_thread_measures_each_batch_sizes_time_per_token_and_never_across_an_idle_gap(tiny_llama) -> None:
    engine = LLMEngine(tiny_llama, None, EngineConfig(block_size=4, num_kv_blocks=128, max_num_batched_tokens=64))
    finished: list[str] = []
    records: list[tuple[int, int, int, float]] = []  # (phase, streams, tokens, interval)
    phase = [0]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    async def run() -> EngineThread:
        loop = asyncio.get_running_loop()
        thread = EngineThread(engine, loop, lambda outs: finished.extend(o.request_id for o in outs if o.finished))
        record = thread.cadence.record
        thread.cadence.record = lambda s, t, i: (records.append((phase[0], s, t, i)), record(s, t, i))[-1]
        thread.start()
        try:
            for batch in (1, 4):  # one stream alone, then four added at once, after an idle wait
                phase[0] = batch
                ids = [f"b{batch}-{i}" for i in range(batch)]

                def add(ids: list[str] = ids) -> None:
                    for rid in ids:
                        engine.add_request(rid, [5, 6, 7, 8, 9, 10], params)

                await thread.call(add)
                while not set(ids) <= set(finished):
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.1)
        finally:
            thread.stop()
        return thread

    thread = asyncio.run(run())
    # Alone, every step gave one stream one token; the four, prefilled in one step and finished in one, always
    # four. A record of one stream in the second phase would be the first phase's last step timed across the
    # idle wait.
    assert {(s, t) for p, s, t, _ in records if p == 1} == {(1, 1)}
    assert {(s, t) for p, s, t, _ in records if p == 4} == {(4, 4)}
    assert len([r for r in records if r[0] == 1]) == 15  # 16 tokens: 16 steps, 15 intervals between them
    assert [round(rows) for rows, _ in thread.cadence.points()] == [1, 4]
