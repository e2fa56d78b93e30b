"""Fault tests with real processes, continued, on one mesh of two co-located workers (role "worker", no P/D)
and two tokenizers under the supervisor, as `up --colocated` runs it:

* kill -9 one worker while it holds several streams; the other one takes them over and every stream completes
  with the output of an undisturbed engine, delta by delta, without a gap or a repeated token (as test_faults
  checks for a decode worker);
* a rolling restart under steady load: `deepinfer-launch drain NAME --serving` on each worker in turn (the
  first one's streams finish where they run, the second one's move to the other worker at once: --timeout 0),
  the supervisor restarting each: no request is lost, every output equals the undisturbed one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import sys
import time

import pytest

from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import SamplingParams
from deepinfer.launch.topology import RouterConfig, Topology
from deepinfer.protocol import messages as m
from deepinfer.protocol.client import AsyncClient, Client
from tests.integration.supervised import metric, supervised_mesh, wait_every_child_serving
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


@pytest.fixture(scope="module")
def module_mesh(smollm2_path, tmp_path_factory):
    """Two co-located workers (each prefills and decodes its own requests) and two tokenizers."""
    run_dir = tmp_path_factory.mktemp("colocated")
    topo = Topology.local(str(smollm2_path), "ipc", run_dir, disaggregated=False, num_tokenizers=2, threads=1,
                          kv_cache_mb=64)
    (first,) = topo.workers
    second = dataclasses.replace(first, name="worker-1", kv=f"ipc://{run_dir}/worker-1-kv.sock")
    # Least-loaded placement spreads the streams over both workers, so each holds some when it is killed or
    # drained (cache-aware placement keeps repeated prompts where their prefix is cached: on one worker).
    router = RouterConfig(heartbeat_timeout_s=1.5, placement="least_loaded")
    topo = dataclasses.replace(topo, workers=(first, second), router=router)
    with supervised_mesh(topo, run_dir, metrics=True) as sup:
        yield sup


@pytest.fixture
def colocated_mesh(module_mesh):
    """The module's mesh with every service serving again (the last test's victim restarted)."""
    wait_every_child_serving(module_mesh, timeout_s=300)
    module_mesh.wait_ready(timeout_s=120)
    return module_mesh


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


ROLL_LANES = 4  # streams kept in flight during the rolling restart, each starting the next as one ends
ROLL_TOKENS = 32  # per stream: greedy, so its output is the first ROLL_TOKENS of the undisturbed run's


def test_rolling_restart_of_every_worker_under_steady_load_loses_no_request(colocated_mesh, colocated_reference):
    prompts, want = colocated_reference
    mesh = colocated_mesh
    exits: list[tuple[str, int]] = []
    notify = mesh.on_exit

    def on_exit(name: str, role: str, pid: int, returncode: int) -> None:  # the supervisor's polling thread
        exits.append((name, returncode))
        notify(name, role, pid, returncode)

    mesh.on_exit = on_exit
    results: list[tuple[int, list[int], object]] = []
    said: list[str] = []  # each worker's last drain's output
    drains: list[str] = []  # every drain run, by worker

    async def lane(client: AsyncClient, first: int, stop: asyncio.Event) -> None:
        i = first
        while not stop.is_set():
            p, tokens, end = i % len(prompts), [], None
            try:
                async for msg in client.stream(prompt_token_ids=prompts[p], max_tokens=ROLL_TOKENS, ignore_eos=True):
                    if isinstance(msg, m.StreamDelta):
                        assert msg.offset == len(tokens), (p, msg.offset, len(tokens))  # no gap, no repeat
                        tokens += msg.token_ids
                    else:
                        end = msg
            except Exception as exc:  # a lost request: reported below with the others
                end = exc
            results.append((p, tokens, end))
            i += ROLL_LANES

    async def drain(name: str, *options: str) -> None:
        """`deepinfer-launch drain NAME --serving` once NAME runs streams (its heartbeat's gauge says so). The
        gauge is half a second old and the command takes a moment to start, so the streams it saw may have ended
        (and the router placed the next ones on the other worker) by the time the drain lands: such a drain found
        the worker idle and proves nothing about streams finishing on it, so it is tried again, up to 3 times."""
        for _ in range(3):
            deadline = time.monotonic() + 240  # a guard, not a timing
            while (metric(mesh.log_dir, RUNNING, instance=name) or 0) < 1:
                assert time.monotonic() < deadline, f"{name} never ran a stream"
                await asyncio.sleep(0.05)
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "deepinfer.launch.cli", "drain", name, "--topology", str(mesh.topology_path),
                "--serving", *options, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await proc.communicate()
            assert proc.returncode == 0, (out.decode(), err.decode())
            drains.append(name)
            if "; 0 request(s) in flight" not in out.decode().splitlines()[0]:
                break
        said.append(out.decode())

    async def roll() -> None:
        stop = asyncio.Event()
        async with AsyncClient(mesh.topology.frontend, timeout_s=300) as client:
            lanes = [asyncio.ensure_future(lane(client, k, stop)) for k in range(ROLL_LANES)]
            try:
                await drain("worker-0")  # its streams finish on it
                await drain("worker-1", "--timeout", "0")  # its streams move to worker-0 now
            finally:
                stop.set()
                await asyncio.gather(*lanes)

    try:
        asyncio.run(roll())
    finally:
        mesh.on_exit = notify
    print(*said, sep="")
    lost = [(p, end) for p, _, end in results if not isinstance(end, m.RequestFinished)]
    assert not lost, lost
    for p, tokens, end in results:
        assert tokens == end.token_ids == want[p][:ROLL_TOKENS], p
    assert exits == [(name, 0) for name in drains]  # each drain: the worker left with 0, restarted by the supervisor
    for name, text in zip(("worker-0", "worker-1"), said, strict=True):
        assert f"{name} drained" in text and f"{name} serving again" in text, text
        assert "; 0 request(s) in flight" not in text.splitlines()[0], text  # drained under load
    # The router counted both drains (its counters reach the metrics every half second).
    deadline = time.monotonic() + 60
    while (metric(mesh.log_dir, "deepinfer_router_events_total", event="drains_finished") or 0) < len(drains):
        assert time.monotonic() < deadline, "the router did not count the drains"
        time.sleep(0.2)
    moved = metric(mesh.log_dir, "deepinfer_router_migrations_total", cause="drain") or 0
    print(f"{len(results)} requests through the rolling restart; {moved:.0f} moved at worker-1's drain timeout")
