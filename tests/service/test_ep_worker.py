"""A mesh whose worker is an expert-parallel group of two ranks, on smollm2-moe (SmolLM2's weights split
into experts): router, tokenizer and the group's rank 0 in this process (InprocMesh over ipc://), rank 1 a
follower started as the supervisor starts it (`deepinfer-launch service worker --rank 1`).

Greedy answers equal the single engine's; the router sees one worker with both ranks' blocks; the group
reports its expert load, which the router keeps; stopping the mesh ends the follower with exit code 0.
A follower that dies ends rank 0's service with GroupBroken, and a decode worker that is a group takes
P/D handoffs on either rank (on a tiny Mixtral). Also the wire record of
the expert-load report, round-tripped."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import SamplingParams
from deepinfer.grammar import ConstraintSpec
from deepinfer.launch.mesh import InprocMesh
from deepinfer.launch.topology import Topology
from deepinfer.loading.fetch import fetch_smollm2_moe
from deepinfer.protocol import messages as m
from deepinfer.protocol.client import AsyncClient
from deepinfer.protocol.codec import decode, encode
from deepinfer.services.group.channel import GroupBroken
from deepinfer.services.group.engine import GroupEngine
from deepinfer.services.group.follower import EXIT_STOPPED
from tests.engine.moe_models import build_hf_moe, save

QUESTIONS = ["What is 2 + 2?", "Name a colour.", "Write one word about the sea.", "Who wrote Hamlet?"]
MAX_TOKENS = 8
KV_MB = 32
WORDS = "[a-z]{1,4}( [a-z]{1,4}){1,2}"


def test_expert_load_round_trips() -> None:
    msg = m.ExpertLoad("worker-0", 3, 5.0, [[1, 0, 7], [2, 2, 4]], [10, 6])
    assert decode(*encode(msg)) == msg
    assert decode(*encode(m.ExpertLoad("w", 0, 0.5))) == m.ExpertLoad("w", 0, 0.5, [], [])


@pytest.fixture(scope="module")
def moe_path(smollm2_path) -> Path:
    return fetch_smollm2_moe(progress=False)


@pytest.fixture(scope="module")
def reference(moe_path) -> list[list[int]]:
    engine = LLMEngine.load(moe_path, EngineConfig(kv_cache_bytes=KV_MB * 1024 * 1024))
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    return [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))]


async def until(check: Any, timeout_s: float = 60.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


@pytest.mark.smollm2
def test_an_expert_parallel_worker_answers_like_the_engine(moe_path, reference, tmp_path):
    topo = Topology.local(str(moe_path), "ipc", run_dir=tmp_path, disaggregated=False, ep=2, threads=2,
                          kv_cache_mb=KV_MB)
    path = tmp_path / "topology.toml"
    path.write_text(topo.to_toml())
    follower = subprocess.Popen([sys.executable, "-m", "deepinfer.launch.cli", "service", "worker", "--topology",
                                 str(path), "--name", "worker-0", "--rank", "1"])

    async def run() -> tuple[list[Any], m.ExpertLoad]:
        mesh = InprocMesh(topo)  # rank 0 waits here for rank 1 to join
        worker, router = mesh.service("worker-0"), mesh.service("router")
        assert isinstance(worker.engine, GroupEngine) and worker.engine.local.ep_group is not None
        worker.expert_load_period_s = 0.5
        await mesh.start()
        try:
            group = worker.engine
            free = group.num_free_blocks
            assert free == 2 * group.local.num_free_blocks
            await until(lambda: getattr(router.core.table.instances.get("worker-0"), "load", None) is not None)
            assert router.core.table.instances["worker-0"].load.total_blocks == group.pool.num_blocks == free
            async with AsyncClient(topo.frontend, ctx=mesh.ctx, timeout_s=300) as c:
                results = await asyncio.gather(*[
                    c.generate(messages=[{"role": "user", "content": q}], max_tokens=MAX_TOKENS) for q in QUESTIONS])
            await until(lambda: group.num_free_blocks == free and not group.has_unfinished())
            await until(lambda: sum(map(sum, getattr(router.expert_load.get("worker-0"), "expert_tokens", []))) > 0)
            return results, router.expert_load["worker-0"]
        finally:
            await mesh.stop()

    try:
        results, load = asyncio.run(run())
        code = follower.wait(timeout=120)
    finally:
        if follower.poll() is None:
            follower.kill()
    assert [r.token_ids for r in results] == reference
    assert code == EXIT_STOPPED
    assert load.worker == "worker-0" and len(load.rank_tokens) == 2
    assert all(len(layer) == 16 for layer in load.expert_tokens)  # smollm2-moe's default: 16 experts a layer


@pytest.fixture(scope="module")
def tiny_moe_with_tokenizer(tmp_path_factory, moe_path) -> Path:
    """A tiny random Mixtral with smollm2-moe's tokenizer beside it (and its vocabulary, so that constrained
    output can be any of the tokenizer's tokens), so the mesh runs end to end in seconds."""
    path = save(build_hf_moe("mixtral-8e-top2", vocab_size=49152), tmp_path_factory.mktemp("tiny-moe"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(moe_path / name, path / name)
    return path


@pytest.mark.smollm2
def test_a_dead_follower_ends_the_worker(tiny_moe_with_tokenizer, tmp_path):
    """The follower dies mid-generation: rank 0's service ends at once with GroupBroken (its process would
    exit nonzero), so the supervisor restarts the group and the router moves the requests."""
    topo = Topology.local(str(tiny_moe_with_tokenizer), "ipc", run_dir=tmp_path, disaggregated=False, ep=2,
                          threads=2, kv_cache_mb=4)
    path = tmp_path / "topology.toml"
    path.write_text(topo.to_toml())
    follower = subprocess.Popen([sys.executable, "-m", "deepinfer.launch.cli", "service", "worker", "--topology",
                                 str(path), "--name", "worker-0", "--rank", "1"])

    async def run() -> BaseException | None:
        mesh = InprocMesh(topo)
        index = [s.instance for s in mesh.services].index("worker-0")
        await mesh.start()
        try:
            async with AsyncClient(topo.frontend, ctx=mesh.ctx, timeout_s=120) as c:
                calls = [asyncio.ensure_future(c.generate(prompt_token_ids=[5 + i, 40, 41, 42], max_tokens=200,
                                                          ignore_eos=True)) for i in range(4)]
                group = mesh.service("worker-0").engine
                await until(lambda: group.stats.tokens_generated > 8)
                follower.kill()
                task = mesh._tasks[index]
                await until(task.done)
                for call in calls:
                    call.cancel()
                await asyncio.gather(*calls, return_exceptions=True)
                return task.exception()
        finally:
            await mesh.stop()

    try:
        error = asyncio.run(run())
    finally:
        follower.kill()
        follower.wait()
    assert isinstance(error, GroupBroken)


def _free_master() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.smollm2
@pytest.mark.parametrize("prefill_ep", [1, 2], ids=["plain-prefill", "prefill-group"])
def test_a_decode_worker_group_takes_handoffs(tiny_moe_with_tokenizer, tmp_path, prefill_ep):
    """P/D: a prefill worker (plain, or itself a 2-rank group) hands each request's KV to a decode worker
    that is a 2-rank group; the KV leaves from whichever prefill rank computed it, lands on whichever decode
    rank reserved it, and the answers equal one engine's. Every other request is constrained (a regex): its
    grammar state crosses the handoff and the group's control channel to whichever rank decodes it, and its
    answer equals one engine's under the same constraint and matches the regex. One process can lead only one group (one
    torch.distributed membership per process), so a prefill group runs as its own two processes, as `up`
    runs it, and the rest of the mesh in this one."""
    model = tiny_moe_with_tokenizer
    topo = Topology.local(str(model), "ipc", run_dir=tmp_path, disaggregated=True, threads=1, kv_cache_mb=4,
                          kvcache=False)
    prefill, decode_ = topo.workers
    if prefill_ep > 1:
        prefill = dataclasses.replace(prefill, ep=prefill_ep, ep_master=_free_master())
    topo = dataclasses.replace(topo, workers=(prefill, dataclasses.replace(decode_, ep=2, ep_master=_free_master())))
    path = tmp_path / "topology.toml"
    path.write_text(topo.to_toml())
    prompts = [[5 + i, 40 + i, 41, 42, 43, 44, 45, 46, 47, 48, 49] for i in range(6)]
    engine = LLMEngine.load(model, EngineConfig(kv_cache_bytes=4 * 1024 * 1024, num_threads=1))
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    constrained = SamplingParams(max_tokens=10, ignore_eos=True, constraint=ConstraintSpec.regex(WORDS))
    reference = [o.token_ids for o in engine.generate(prompts, [constrained if i % 2 else params
                                                                 for i in range(len(prompts))])]

    def rank(name: str, r: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-m", "deepinfer.launch.cli", "service", "worker", "--topology",
                                 str(path), "--name", name, *(["--rank", str(r)] if r else [])])

    followers = [rank(w.name, 1) for w in topo.workers if w.ep > 1]
    apart = [rank(prefill.name, 0)] if prefill_ep > 1 else []  # the prefill group's leader

    async def run() -> tuple[list[Any], int, int, int | None]:
        mesh = InprocMesh(topo, skip=[prefill.name] if apart else [])
        await mesh.start()
        try:
            group = mesh.service("decode-0").engine
            free = group.num_free_blocks
            table = mesh.service("router").core.table
            await until(lambda: table.has_live("prefill", time.monotonic()), timeout_s=120)  # the group apart
            async with AsyncClient(topo.frontend, ctx=mesh.ctx, timeout_s=120) as c:
                results = await asyncio.gather(*[
                    c.generate(prompt_token_ids=p, max_tokens=10, ignore_eos=True, regex=WORDS if i % 2 else None)
                    for i, p in enumerate(prompts)])
            await until(lambda: group.num_free_blocks == free and not group.has_unfinished())
            sent = None if apart else mesh.service(prefill.name).engine.stats.handoffs_out
            return results, group.stats.handoffs_in, group.local.stats.handoffs_in, sent
        finally:
            await mesh.stop()

    try:
        results, handoffs, on_rank0, sent = asyncio.run(run())
        for p in apart:
            p.send_signal(signal.SIGTERM)  # its drain ends the group: its follower exits 0
        codes = [f.wait(timeout=120) for f in [*followers, *apart]]
    finally:
        for f in [*followers, *apart]:
            if f.poll() is None:
                f.kill()
    assert [r.token_ids for r in results] == reference
    assert all(re.fullmatch(WORDS, r.text) for r in results[1::2])
    assert handoffs == len(prompts) > on_rank0  # some went to the follower
    assert sent in (None, len(prompts))
    assert codes[:len(followers)] == [EXIT_STOPPED] * len(followers)
    assert codes[len(followers):] == [0] * len(apart)
