"""Fault tests with real processes: kill -9 and SIGSTOP a decode worker under load, an expired KV lease.

The mesh runs as one process per service (ipc://) under the supervisor, as `deepinfer-launch up` runs it.
Timing bounds here are the contract's (requests of a dead worker end within 5 s), not speed measurements.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time

import pytest

from deepinfer.launch.topology import Topology
from deepinfer.protocol import messages as m
from deepinfer.protocol.client import AsyncClient, Client, WorkerLostError
from tests.integration.supervised import supervised_mesh

pytestmark = pytest.mark.smollm2


@pytest.fixture
def mesh(smollm2_path, tmp_path):
    topo = Topology.local(str(smollm2_path), "ipc", tmp_path, disaggregated=True, threads=1, kv_cache_mb=64)
    topo = dataclasses.replace(topo, router_options={"heartbeat_timeout_s": 1.5})
    with supervised_mesh(topo, tmp_path) as sup:
        yield sup


async def stream_until_error(endpoint: str, n: int) -> list[tuple[float, BaseException | m.RequestFinished]]:
    """Start n long streams; return, per stream, when (monotonic clock) and how it ended."""
    ended: list[tuple[float, BaseException | m.RequestFinished]] = []
    async with AsyncClient(endpoint, timeout_s=60) as c:
        started = asyncio.Event()

        async def one(i: int) -> None:
            try:
                async for msg in c.stream(prompt=f"Count from {i} to 1000:", max_tokens=400, ignore_eos=True):
                    if isinstance(msg, m.StreamDelta):
                        started.set()
                    else:
                        ended.append((time.monotonic(), msg))
            except Exception as exc:
                ended.append((time.monotonic(), exc))

        tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
        await asyncio.wait_for(started.wait(), 60)
        await asyncio.gather(*tasks)
    return ended


def test_kill_9_decode_worker_fails_its_requests_and_the_restart_rejoins(mesh):
    decode = mesh.child("decode-0")

    async def run():
        task = asyncio.ensure_future(stream_until_error(mesh.topology.frontend, 4))
        await asyncio.sleep(1.0)  # streams are flowing
        killed_at = time.monotonic()
        os.kill(decode.proc.pid, signal.SIGKILL)
        return killed_at, await task

    killed_at, ended = asyncio.run(run())
    assert len(ended) == 4
    for end_time, outcome in ended:
        assert isinstance(outcome, WorkerLostError), outcome
        # The fault contract (not a speed measurement): a dead worker's requests end within 5 s.
        assert end_time - killed_at < 5.0
    # The supervisor restarts the worker; it re-registers and serves again.
    deadline = time.monotonic() + 120
    while decode.restarts == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert decode.restarts >= 1
    mesh.wait_ready(timeout_s=120)
    with Client(mesh.topology.frontend, timeout_s=60) as c:
        assert len(c.generate(prompt="Hello", max_tokens=5, ignore_eos=True).token_ids) == 5


def test_sigstop_worker_is_declared_dead_then_its_stale_messages_are_dropped(mesh):
    decode = mesh.child("decode-0")

    async def run():
        task = asyncio.ensure_future(stream_until_error(mesh.topology.frontend, 2))
        await asyncio.sleep(1.0)
        os.kill(decode.proc.pid, signal.SIGSTOP)
        try:
            ended = await asyncio.wait_for(task, 30)
        finally:
            os.kill(decode.proc.pid, signal.SIGCONT)
        return ended

    ended = asyncio.run(run())
    assert all(isinstance(o, WorkerLostError) for _, o in ended), ended
    # After SIGCONT the worker's late token batches for those requests must not resurrect them, and the
    # worker (same incarnation) serves new work again.
    time.sleep(2.0)
    mesh.wait_ready(timeout_s=60)
    with Client(mesh.topology.frontend, timeout_s=60) as c:
        assert len(c.generate(prompt="Hi", max_tokens=4, ignore_eos=True).token_ids) == 4
