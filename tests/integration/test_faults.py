"""Fault tests with real processes: kill -9 and SIGSTOP a decode worker, kill -9 a tokenizer, the router
and prefill workers, all under load.

The mesh runs as one process per service (ipc://) under the supervisor, as `deepinfer-launch up` runs it,
with two prefill workers, two decode workers and two tokenizers; the tests share it, each starting once the
last one's victims are back. A lost decode worker's or tokenizer's requests move to the
other one (the supervisor tells the router the moment a child exits; a stopped one is found by its missed
heartbeats): every stream completes with the output of an undisturbed run, without a gap or a repeated
token, seeded sampling included. A killed router loses no stream: its successor is greeted by every service
again (the tokenizers drop what they held for the old one; the decode workers keep the streams they were
decoding and report them), and each client resumes its streams on it from the last token it received — one its
decode worker kept is taken back from there, the others are computed again — each finishing with the
undisturbed run's output.

Prefill workers killed mid-prefill: with a spare, their requests move to it; with none (both killed), they
wait parked for a restarted one; killed once every stream decodes, decoding goes on untouched (no request
moves). Each stream's output equals the undisturbed run's, token for token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import secrets
import signal
import time

import pytest

from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import SamplingParams
from deepinfer.launch.topology import RouterConfig, Topology
from deepinfer.protocol import messages as m
from deepinfer.protocol.client import AsyncClient, Client
from deepinfer.protocol.client_requests import build_request
from deepinfer.services.wire import to_engine_params
from tests.integration.supervised import metric, supervised_mesh, wait_every_child_serving

pytestmark = pytest.mark.smollm2

NUM_STREAMS = 16
# The prefill workers' max_num_batched_tokens: a step of 32 tokens costs at least a read of the weights, so a
# long prompt's prefill lasts well past a heartbeat's period (which the kill waits for) on any machine.
PREFILL_CHUNK = 32
MAX_TOKENS = 40
SEEDED = {3: 11, 9: 12}  # stream index → seed: these sample (temperature 0.8), the others are greedy
# Streams whose output is constrained (structured output), long enough to be cut by max_tokens mid-match: a moved
# stream's grammar state is rebuilt from its output so far, and its tokens go on as if nothing had happened.
CONSTRAINED = {
    5: {"json_schema": {"type": "object", "properties": {"fact": {"type": "string", "minLength": 400}},
                        "required": ["fact"]}},
    9: {"regex": r"The sea( [a-z]+,?){40,80}\."},
}


def params(i: int) -> dict:
    out = dict(max_tokens=MAX_TOKENS, ignore_eos=True, **CONSTRAINED.get(i, {}))
    if i in SEEDED:
        out.update(temperature=0.8, seed=SEEDED[i])
    return out


def engine_params(i: int) -> SamplingParams:
    """params(i) as the reference engine takes them."""
    return to_engine_params(build_request("ref", None, None, [1], False, 0, None, None, params(i)).params)


@pytest.fixture(scope="module")
def reference_engine(smollm2_path):
    """The undisturbed single engine every output is compared with."""
    return LLMEngine.load(smollm2_path, EngineConfig(kv_cache_bytes=64 << 20))


@pytest.fixture(scope="module")
def prompts_and_reference(reference_engine):
    """16 prompts and what an undisturbed single engine answers to each."""
    engine = reference_engine
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": f"Tell me fact number {i} about the sea."}])
               for i in range(NUM_STREAMS)]
    outs = [engine.generate([p], engine_params(i))[0].token_ids for i, p in enumerate(prompts)]
    return prompts, outs


@pytest.fixture(scope="module")
def module_mesh(smollm2_path, tmp_path_factory):
    """One mesh for the module's tests: each test's fault is one the mesh heals from (the supervisor restarts a
    killed child, a stopped one is continued), which the `mesh` fixture waits for before the next test."""
    run_dir = tmp_path_factory.mktemp("faults")
    topo = Topology.local(str(smollm2_path), "ipc", run_dir, disaggregated=True, num_prefill=2, num_decode=2,
                          num_tokenizers=2, threads=1, kv_cache_mb=64)
    # The prefill workers compute a prompt in chunks of PREFILL_CHUNK tokens: a long prompt's prefill spans
    # steps (progress), so a kill can find it half done on any machine, and no step is long enough on a loaded
    # one to pass for a wedged worker.
    workers = tuple(dataclasses.replace(w, max_num_batched_tokens=PREFILL_CHUNK) if w.role == "prefill" else w
                    for w in topo.workers)
    # Requests whose every prefill worker died wait for a restarted one: give a restart on a loaded machine
    # (model load included) ample time before they would end with worker_lost.
    topo = dataclasses.replace(topo, workers=workers,
                               router=RouterConfig(heartbeat_timeout_s=1.5, placement_timeout_s=120.0))
    with supervised_mesh(topo, run_dir, metrics=True) as sup:
        yield sup


@pytest.fixture
def mesh(module_mesh):
    """The module's mesh with every service alive and welcomed by the router (the last test's victim
    included) and a path through it serving."""
    wait_every_child_serving(module_mesh, timeout_s=300)
    module_mesh.wait_ready(timeout_s=120)
    return module_mesh


async def streams_through_a_fault(endpoint: str, prompts: list[list[int]], fault, spec=params,
                                  fault_after: int | None = None,
                                  connect_timeout_s: float = 10.0) -> list[tuple[list[int], object]]:
    """Stream every prompt (stream i with the sampling parameters `spec(i)`); once `fault_after` of them (default
    a third) have tokens flowing, run `fault()`. Returns per stream the tokens of its deltas, in order, and how
    it ended (the RequestFinished or the exception)."""
    fault_after = len(prompts) // 3 if fault_after is None else fault_after
    results: list[tuple[list[int], object]] = [([], None) for _ in prompts]
    async with AsyncClient(endpoint, timeout_s=300, connect_timeout_s=connect_timeout_s) as c:
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
                            if len(flowing) >= fault_after:
                                ready.set()
                    else:
                        results[i] = (tokens, msg)
            except Exception as exc:
                results[i] = (tokens, exc)

        tasks = [asyncio.ensure_future(one(i)) for i in range(len(prompts))]
        if fault_after == 0:
            ready.set()
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
LONG_MAX_TOKENS = 160


def router_kill_params(i: int) -> dict:
    return dict(params(i), max_tokens=LONG_MAX_TOKENS) if i in LONG else params(i)


def dropped_counts(log_dir, names, field: str = "count") -> dict[str, list[int]]:
    """Per service, the `count` (or `kept`, a worker's) of each "dropped the old router's requests" line in its
    log."""
    pattern = re.compile(rf"dropped the old router's requests.*?\b{field}=(\d+)")
    return {n: [int(c) for c in pattern.findall((log_dir / f"{n}.log").read_text())] for n in names}


def resumes(mesh, case: str) -> float:
    return metric(mesh.log_dir, "deepinfer_router_resumes_total", case=case) or 0.0


def test_kill_9_router_loses_no_stream_and_its_successor_is_greeted_and_serves(mesh, prompts_and_reference,
                                                                              reference_engine):
    prompts, short = prompts_and_reference
    want = [list(w) for w in short]
    for i in LONG:
        long = dataclasses.replace(engine_params(i), max_tokens=LONG_MAX_TOKENS)
        want[i] = reference_engine.generate([prompts[i]], long)[0].token_ids
    router = mesh.child("router")
    restarts = router.restarts

    async def kill() -> None:
        os.kill(router.proc.pid, signal.SIGKILL)

    # The clients wait for the supervisor's new router (a process start on a loaded machine) to resume on.
    results = asyncio.run(streams_through_a_fault(mesh.topology.frontend, prompts, kill, router_kill_params,
                                                  connect_timeout_s=120.0))
    assert_undisturbed(results, want)
    # Every long stream was in flight at the kill, so each was resumed on the new router: reclaimed from the
    # decode worker that kept it running (those decoding then), or computed again (those still prefilling).
    deadline = time.monotonic() + 60
    while resumes(mesh, "reclaimed") + resumes(mesh, "readmitted") < len(LONG):
        assert time.monotonic() < deadline, "the long streams were not all resumed"
        time.sleep(0.1)
    reclaimed, readmitted = resumes(mesh, "reclaimed"), resumes(mesh, "readmitted")
    print(f"streams resumed on the new router: {reclaimed:g} reclaimed, {readmitted:g} computed again")
    assert reclaimed >= 1
    deadline = time.monotonic() + 120
    while router.restarts == restarts and time.monotonic() < deadline:
        time.sleep(0.1)
    restarted = time.monotonic()
    mesh.wait_ready(timeout_s=120)
    print(f"first request through the restarted router {time.monotonic() - restarted:.1f}s after its restart")
    with Client(mesh.topology.frontend, timeout_s=60) as c:
        outs = c.generate_many([dict(prompt_token_ids=p, **params(i)) for i, p in enumerate(prompts[:4])])
    assert [o.token_ids for o in outs] == short[:4]
    # Every service said Hello again.
    for name in ("tokenizer-0", "tokenizer-1", "prefill-0", "decode-0", "decode-1", "kvcache-0"):
        assert "rejoined the restarted router" in (mesh.log_dir / f"{name}.log").read_text(), name
    # The services met the new router with the long streams in flight: the tokenizers dropped their state of
    # them, and the decode workers kept those they were decoding (what the reclaims above took back).
    workers, tokenizers = ("prefill-0", "decode-0", "decode-1"), ("tokenizer-0", "tokenizer-1")
    deadline = time.monotonic() + 60
    while not all(dropped_counts(mesh.log_dir, (n,))[n] for n in workers + tokenizers):
        assert time.monotonic() < deadline, dropped_counts(mesh.log_dir, workers + tokenizers)
        time.sleep(0.2)
    dropped = dropped_counts(mesh.log_dir, workers + tokenizers)
    kept = dropped_counts(mesh.log_dir, workers, "kept")
    print("dropped the old router's requests:", dropped, "kept:", kept)
    assert sum(sum(kept[n]) for n in ("decode-0", "decode-1")) >= reclaimed, kept
    assert sum(sum(dropped[n]) for n in tokenizers) > 0, dropped
    # ... and every KV block is free again on every worker (their heartbeats' gauges; a guard, not a timing).
    deadline = time.monotonic() + 120
    while (used := {n: metric(mesh.log_dir, "deepinfer_kv_blocks_used", instance=n) for n in workers}) != \
            dict.fromkeys(workers, 0.0):
        assert time.monotonic() < deadline, used
        time.sleep(0.2)


# ----- prefill workers -----

LONG_PROMPT_STREAMS = 3
LONG_PROMPT_TOKENS = 8  # what matters here is the prefill: a short answer keeps the reference cheap
PREFILLS = ("prefill-0", "prefill-1")
MIGRATIONS = "deepinfer_router_migrations_total"


def greedy_short(i: int) -> dict:
    return dict(max_tokens=LONG_PROMPT_TOKENS, ignore_eos=True)


def long_prompts(engine: LLMEngine, topic: str) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts of ~500 tokens, so that a prefill worker computes each over many steps, and the undisturbed
    engine's greedy answer to each. Each starts with a fresh nonce: no prefix of theirs is cached (the cache
    daemon's disk tier outlives a test run), so the prefill workers compute them whole."""
    nonce = secrets.token_hex(4)
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": f"{nonce}: note {i} on {topic}: " + " ".join(
        f"{topic} fact {i}.{k} is worth a line." for k in range(50))}]) for i in range(LONG_PROMPT_STREAMS)]
    outs = engine.generate(prompts, SamplingParams(**greedy_short(0)))
    return prompts, [o.token_ids for o in outs]


def prefilling(mesh, names) -> int:
    """Requests the workers `names` run or queue, as their latest heartbeat's gauges say."""
    gauges = [metric(mesh.log_dir, f"deepinfer_num_requests_{what}", instance=n)
              for n in names for what in ("running", "waiting")]
    return int(sum(g or 0 for g in gauges))


def kill_mid_prefill(mesh, victims, busy_only: bool = False):
    """A fault: once the victims hold a request (prefilling: the prompts are long), kill -9 every victim
    (`busy_only`: the first ones seen holding one — where placement sends the prompts depends on the rates each
    prefill worker measured in earlier tests, so a named worker may get none of them)."""
    async def fault() -> None:
        deadline = time.monotonic() + 120
        while not (busy := [n for n in victims if prefilling(mesh, [n])]):
            assert time.monotonic() < deadline, "the prefill workers never held the requests"
            await asyncio.sleep(0.05)
        for name in busy[:1] if busy_only else victims:
            os.kill(mesh.child(name).proc.pid, signal.SIGKILL)
    return fault


def migrations(mesh, cause: str) -> float:
    return metric(mesh.log_dir, MIGRATIONS, cause=cause) or 0.0


def wait_for_migrations(mesh, cause: str, more_than: float) -> float:
    """The router's count of migrations by `cause` once it shows more than `more_than` (it refreshes its
    metrics every half second); a guard, not a timing."""
    deadline = time.monotonic() + 60
    while (n := migrations(mesh, cause)) <= more_than:
        assert time.monotonic() < deadline, f"no {cause} migration counted"
        time.sleep(0.1)
    return n


def test_kill_9_prefill_worker_mid_prefill_moves_its_requests_to_the_spare(mesh, reference_engine):
    prompts, want = long_prompts(reference_engine, "harbours")
    before = migrations(mesh, "prefill_death")
    fault = kill_mid_prefill(mesh, PREFILLS, busy_only=True)  # the other one is the spare
    results = asyncio.run(streams_through_a_fault(mesh.topology.frontend, prompts, fault, greedy_short, fault_after=0))
    assert_undisturbed(results, want)
    wait_for_migrations(mesh, "prefill_death", before)  # the kill caught requests in prefill: they moved


def test_kill_9_every_prefill_worker_mid_prefill_parks_their_requests_for_the_restarted_ones(
        mesh, reference_engine):
    prompts, want = long_prompts(reference_engine, "lighthouses")
    before = migrations(mesh, "prefill_death")
    kill, late = kill_mid_prefill(mesh, PREFILLS), []

    async def kill_then_ask() -> None:  # a request that arrives once the router knows no prefill worker lives
        await kill()
        deadline = time.monotonic() + 60
        while migrations(mesh, "prefill_death") <= before:
            assert time.monotonic() < deadline, "no prefill_death migration counted"
            await asyncio.sleep(0.1)
        async with AsyncClient(mesh.topology.frontend, timeout_s=300) as c:
            late.append(await c.generate(prompt_token_ids=prompts[0], **greedy_short(0)))

    results = asyncio.run(streams_through_a_fault(mesh.topology.frontend, prompts, kill_then_ask, greedy_short,
                                                  fault_after=0))
    assert_undisturbed(results, want)  # no spare: they waited for a restarted prefill worker and finished
    assert late[0].token_ids == want[0]  # admitted and parked beside them, not refused as unavailable


def test_kill_9_every_prefill_worker_once_every_stream_decodes_leaves_decoding_alone(
        mesh, prompts_and_reference):
    prompts, want = prompts_and_reference
    before = migrations(mesh, "prefill_death")

    async def kill() -> None:  # every stream has had two tokens: its KV is on its decode worker
        for name in PREFILLS:
            os.kill(mesh.child(name).proc.pid, signal.SIGKILL)

    results = asyncio.run(streams_through_a_fault(mesh.topology.frontend, prompts, kill, fault_after=len(prompts)))
    assert_undisturbed(results, want)
    wait_every_child_serving(mesh, timeout_s=300)  # (long after the router's metrics caught up with the kill)
    assert migrations(mesh, "prefill_death") == before  # no request moved
