"""The cache daemon under faults, with real processes (one per service over ipc://, the supervisor
restarting the dead): kill -9 it again and again while workers write blocks behind their requests, then
serve prompts whose prefixes must come back from the daemon — after its warm restart, from disk.

Every output is compared with the engine computing everything itself: a torn or half-written block
served by the restarted daemon would change the tokens. The worker's device pool is kept small, so
earlier prompts' blocks are evicted there and a repeated prompt has to fetch its prefix."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import zmq

from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import SamplingParams
from deepinfer.launch.topology import Topology
from deepinfer.protocol import messages as m
from deepinfer.protocol.client import AsyncClient
from deepinfer.protocol.sockets import make_dealer, recv_msg, send_msg
from tests.integration.supervised import supervised_mesh

pytestmark = pytest.mark.smollm2

TOPICS = ["rivers", "mountains", "deserts", "forests", "oceans", "glaciers", "volcanoes", "islands"]
MAX_TOKENS = 6
KV_CACHE_MB = 24  # ~32 SmolLM2 blocks: a few prompts' worth, so older prefixes leave the device


@pytest.fixture(scope="module")
def prompts_and_reference(smollm2_path):
    """Distinct prompts of ~330 tokens (about 20 full blocks each) and the engine's greedy answers."""
    engine = LLMEngine.load(smollm2_path, EngineConfig(kv_cache_bytes=64 << 20, enable_prefix_caching=False))
    ids = [engine.tokenizer.encode(f"Write about {t}. " + " ".join(f"Fact {i} about {t} is worth knowing."
                                                                   for i in range(40))) for t in TOPICS]
    outs = engine.generate(ids, SamplingParams(max_tokens=MAX_TOKENS))
    return ids, [o.token_ids for o in outs]


@pytest.fixture
def mesh(smollm2_path, tmp_path):
    topo = Topology.local(str(smollm2_path), "ipc", tmp_path, disaggregated=False, threads=1,
                          kv_cache_mb=KV_CACHE_MB, cache_dir=tmp_path / "kv", host_cache_mb=64, disk_cache_mb=256)
    with supervised_mesh(topo, tmp_path, poll_s=0.1) as sup:
        yield sup


def wait_for_daemon(endpoint: str, timeout_s: float = 60.0) -> None:
    """Until the (restarted) daemon answers a lookup."""
    ctx = zmq.Context()
    sock = make_dealer(ctx, endpoint, f"probe-{os.getpid()}")
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            send_msg(sock, m.CacheLookup("probe", []))
            if sock.poll(500):
                assert isinstance(recv_msg(sock), m.CacheLookupReply)
                return
        raise AssertionError("the cache daemon did not come back")
    finally:
        sock.close(linger=0)
        ctx.term()


def test_kill_9_daemon_during_writes_then_serve_prefixes_from_its_disk(mesh, prompts_and_reference):
    ids, want = prompts_and_reference
    daemon = mesh.child("kvcache-0")
    endpoint = mesh.topology.kvcache("kvcache-0").endpoint

    async def run():
        async with AsyncClient(mesh.topology.frontend, timeout_s=300) as c:
            async def kill_repeatedly() -> int:
                kills = 0
                for _ in range(3):
                    await asyncio.sleep(1.5)
                    if daemon.proc is not None and daemon.proc.poll() is None:
                        os.kill(daemon.proc.pid, signal.SIGKILL)
                        kills += 1
                return kills

            killer = asyncio.ensure_future(kill_repeatedly())
            first = await asyncio.gather(*[c.generate(prompt_token_ids=p, max_tokens=MAX_TOKENS) for p in ids])
            kills = await killer
            # Let the last incarnation come back and the workers' write-behind of the later prompts land,
            # then restart it once more: what follows can only come from the disk (DRAM starts empty).
            await asyncio.to_thread(wait_for_daemon, endpoint)
            again = [await c.generate(prompt_token_ids=p, max_tokens=MAX_TOKENS) for p in ids]
            await asyncio.sleep(2.0)
            os.kill(daemon.proc.pid, signal.SIGKILL)
            await asyncio.sleep(0.5)
            await asyncio.to_thread(wait_for_daemon, endpoint)
            # The worker learns the daemon is back from its probe (every 1 s), so a prompt sent before that
            # recomputes. Walk the prompts whose blocks left the device until one is served from the disk.
            after_restart = []
            for p in ids[:6]:
                after_restart.append(await c.generate(prompt_token_ids=p, max_tokens=MAX_TOKENS))
                if after_restart[-1].usage.cached_by_tier.get("disk", 0) > 0:
                    break
                await asyncio.sleep(1.0)
            return first, again, after_restart, kills

    first, again, after_restart, kills = asyncio.run(run())
    assert kills >= 2
    assert [r.token_ids for r in first] == want
    assert [r.token_ids for r in again] == want
    assert [r.token_ids for r in after_restart] == want[:len(after_restart)]
    # The device pool holds only the last prompts, so an early one came back from the restarted daemon's disk.
    assert after_restart[-1].usage.cached_by_tier.get("disk", 0) > 0, [r.usage for r in after_restart]
