"""Fault tests with real processes: kill -9 and SIGSTOP a decode worker, kill -9 a tokenizer and the
router, all under load.

The mesh runs as one process per service (ipc://) under the supervisor, as `deepinfer-launch up` runs it,
with two decode workers and two tokenizers; the tests share it, each starting once the last one's victim is
back. A lost decode worker's or tokenizer's requests move to the
other one (the supervisor tells the router the moment a child exits; a stopped one is found by its missed
heartbeats): every stream completes with the output of an undisturbed run, without a gap or a repeated
token, seeded sampling included. A killed router loses its requests (their clients get RouterLostError);
its successor is greeted by every service again and serves new requests, the workers and tokenizers
abort the requests they still held for the old one, and every KV block is free again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import signal
import time

import pytest

from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import SamplingParams
from deepinfer.launch.topology import RouterConfig, Topology
from deepinfer.protocol import messages as m
from deepinfer.protocol.client import AsyncClient, Client, RouterLostError
from tests.integration.supervised import metric, supervised_mesh, wait_every_child_serving

pytestmark = pytest.mark.smollm2

NUM_STREAMS = 16
MAX_TOKENS = 40
SEEDED = {3: 11, 9: 12}  # stream index → seed: these sample (temperature 0.8), the others are greedy


def params(i: int) -> dict:
    if i in SEEDED:
        return dict(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.8, seed=SEEDED[i])
    return dict(max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts_and_reference(smollm2_path):
    """16 prompts and what an undisturbed single engine answers to each."""
    engine = LLMEngine.load(smollm2_path, EngineConfig(kv_cache_bytes=64 << 20))
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": f"Tell me fact number {i} about the sea."}])
               for i in range(NUM_STREAMS)]
    outs = [engine.generate([p], SamplingParams(**params(i)))[0].token_ids for i, p in enumerate(prompts)]
    return prompts, outs


@pytest.fixture(scope="module")
def module_mesh(smollm2_path, tmp_path_factory):
    """One mesh for the module's tests: each test's fault is one the mesh heals from (the supervisor restarts a
    killed child, a stopped one is continued), which the `mesh` fixture waits for before the next test."""
    run_dir = tmp_path_factory.mktemp("faults")
    topo = Topology.local(str(smollm2_path), "ipc", run_dir, disaggregated=True, num_decode=2, num_tokenizers=2,
                          threads=1, kv_cache_mb=64)
    topo = dataclasses.replace(topo, router=RouterConfig(heartbeat_timeout_s=1.5))
    with supervised_mesh(topo, run_dir, metrics=True) as sup:
        yield sup


@pytest.fixture
def mesh(module_mesh):
    """The module's mesh with every service alive and welcomed by the router (the last test's victim
    included) and a path through it serving."""
    wait_every_child_serving(module_mesh, timeout_s=300)
    module_mesh.wait_ready(timeout_s=120)
    return module_mesh


async def streams_through_a_fault(endpoint: str, prompts: list[list[int]], fault,
                                  spec=params) -> list[tuple[list[int], object]]:
    """Stream every prompt (stream i with the sampling parameters `spec(i)`); once a third of them have tokens
    flowing, run `fault()`. Returns per stream the tokens of its deltas, in order, and how it ended (the
    RequestFinished or the exception)."""
    results: list[tuple[list[int], object]] = [([], None) for _ in prompts]
    async with AsyncClient(endpoint, timeout_s=300) as c:
        flowing: set[int] = set()
        ready = asyncio.Event()

        async def one(i: int) -> None:
            tokens: list[int] = []
            try:
                async for msg in c.stream(prompt_token_ids=prompts[i], **spec(i)):
                    if isinstance(msg, m.StreamDelta):
                        assert msg.offset == len(tokens), (i, msg.offset, len(tokens))  # no gap, no repeat
                        tokens += msg.token_ids
                        if len(tokens) >= 2:
                            flowing.add(i)
                            if len(flowing) >= len(prompts) // 3:
                                ready.set()
                    else:
                        results[i] = (tokens, msg)
            except Exception as exc:
                results[i] = (tokens, exc)

        tasks = [asyncio.ensure_future(one(i)) for i in range(len(prompts))]
        await asyncio.wait_for(ready.wait(), 240)
        await fault()
        await asyncio.gather(*tasks)
    return results


def assert_undisturbed(results, want) -> None:
    for i, (tokens, end) in enumerate(results):
        assert isinstance(end, m.RequestFinished), (i, end)
        assert end.token_ids == want[i], i
        assert tokens == want[i], i  # what the stream delivered, delta by delta


def test_kill_9_decode_worker_moves_its_streams_to_the_other(mesh, prompts_and_reference):
    prompts, want = prompts_and_reference
    decode = mesh.child("decode-0")
    restarts = decode.restarts

    async def kill() -> None:
        os.kill(decode.proc.pid, signal.SIGKILL)

    results = asyncio.run(streams_through_a_fault(mesh.topology.frontend, prompts, kill))
    assert_undisturbed(results, want)
    router_log = (mesh.log_dir / "router.log").read_text()
    assert "service exited" in router_log and "decode-0" in router_log
    # The supervisor restarts the worker; it re-registers and serves again.
    deadline = time.monotonic() + 120
    while decode.restarts == restarts and time.monotonic() < deadline:
        time.sleep(0.2)
    assert decode.restarts > restarts
    mesh.wait_ready(timeout_s=120)
    with Client(mesh.topology.frontend, timeout_s=60) as c:
        assert len(c.generate(prompt="Hello", max_tokens=5, ignore_eos=True).token_ids) == 5


def test_sigstop_worker_is_declared_dead_its_streams_move_and_its_late_messages_are_dropped(
        mesh, prompts_and_reference):
    prompts, want = prompts_and_reference
    decode = mesh.child("decode-0")

    async def stop() -> None:
        os.kill(decode.proc.pid, signal.SIGSTOP)

    try:
        results = asyncio.run(streams_through_a_fault(mesh.topology.frontend, prompts, stop))
    finally:
        os.kill(decode.proc.pid, signal.SIGCONT)
    assert_undisturbed(results, want)
    # After SIGCONT the worker's late token batches for the old request ids must not reach any stream,
    # and the worker (same incarnation) serves new work again.
    time.sleep(2.0)
    mesh.wait_ready(timeout_s=60)
    with Client(mesh.topology.frontend, timeout_s=60) as c:
        outs = c.generate_many([dict(prompt_token_ids=p, **params(i)) for i, p in enumerate(prompts[:4])])
    assert [o.token_ids for o in outs] == want[:4]


def test_kill_9_tokenizer_moves_its_streams_to_the_other(mesh, prompts_and_reference):
    prompts, want = prompts_and_reference
    tokenizer = mesh.child("tokenizer-0")

    async def kill() -> None:
        os.kill(tokenizer.proc.pid, signal.SIGKILL)

    results = asyncio.run(streams_through_a_fault(mesh.topology.frontend, prompts, kill))
    assert_undisturbed(results, want)


LONG = (0, 1, 4, 5, 6, 7)  # greedy streams the router-kill test makes long: still running when it is killed
LONG_MAX_TOKENS = 500


def router_kill_params(i: int) -> dict:
    return dict(params(i), max_tokens=LONG_MAX_TOKENS) if i in LONG else params(i)


def dropped_counts(log_dir, names) -> dict[str, list[int]]:
    """Per service, the `count` of each "dropped the old router's requests" line in its log."""
    pattern = re.compile(r"dropped the old router's requests.*?\bcount=(\d+)")
    return {n: [int(c) for c in pattern.findall((log_dir / f"{n}.log").read_text())] for n in names}


def test_kill_9_router_then_its_successor_is_greeted_and_serves(mesh, prompts_and_reference):
    prompts, want = prompts_and_reference
    router = mesh.child("router")
    restarts = router.restarts

    async def kill() -> None:
        os.kill(router.proc.pid, signal.SIGKILL)

    results = asyncio.run(streams_through_a_fault(mesh.topology.frontend, prompts, kill, router_kill_params))
    lost = [i for i, (_, end) in enumerate(results) if not isinstance(end, m.RequestFinished)]
    assert set(LONG) <= set(lost), "the kill came while the long streams were flowing"
    for i, (tokens, end) in enumerate(results):
        if i in lost:
            assert isinstance(end, RouterLostError), (i, end)  # typed, and long before the client's timeout
            n = min(len(tokens), len(want[i]))  # the long ones' reference is their first MAX_TOKENS tokens
            assert tokens[:n] == want[i][:n], i
        else:
            assert end.token_ids == want[i]
    deadline = time.monotonic() + 120
    while router.restarts == restarts and time.monotonic() < deadline:
        time.sleep(0.1)
    restarted = time.monotonic()
    mesh.wait_ready(timeout_s=120)
    print(f"first request through the restarted router {time.monotonic() - restarted:.1f}s after its restart")
    with Client(mesh.topology.frontend, timeout_s=60) as c:
        outs = c.generate_many([dict(prompt_token_ids=p, **params(i)) for i, p in enumerate(prompts[:4])])
    assert [o.token_ids for o in outs] == want[:4]
    # Every service said Hello again.
    for name in ("tokenizer-0", "tokenizer-1", "prefill-0", "decode-0", "decode-1", "kvcache-0"):
        assert "rejoined the restarted router" in (mesh.log_dir / f"{name}.log").read_text(), name
    # The old router's work was aborted, not run to its end: the long streams were still held when the
    # services met the new router, and at least one worker and one tokenizer dropped some of them.
    workers, tokenizers = ("prefill-0", "decode-0", "decode-1"), ("tokenizer-0", "tokenizer-1")
    deadline = time.monotonic() + 60
    while not all(dropped_counts(mesh.log_dir, (n,))[n] for n in workers + tokenizers):
        assert time.monotonic() < deadline, dropped_counts(mesh.log_dir, workers + tokenizers)
        time.sleep(0.2)
    dropped = dropped_counts(mesh.log_dir, workers + tokenizers)
    print("dropped the old router's requests:", dropped)
    assert sum(sum(dropped[n]) for n in workers) > 0, dropped
    assert sum(sum(dropped[n]) for n in tokenizers) > 0, dropped
    # ... and every KV block is free again on every worker (their heartbeats' gauges; a guard, not a timing).
    deadline = time.monotonic() + 120
    while (used := {n: metric(mesh.log_dir, "deepinfer_kv_blocks_used", instance=n) for n in workers}) != \
            dict.fromkeys(workers, 0.0):
        assert time.monotonic() < deadline, used
        time.sleep(0.2)
