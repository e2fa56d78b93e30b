"""The whole mesh on the real model: in one process (every service a task over inproc://) and as
separate processes (ipc://), co-located and disaggregated. Greedy outputs equal the in-process
engine's; every request ends exactly once; aborts anywhere leave every worker's KV pool as it was."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import SamplingParams
from deepinfer.launch.mesh import InprocMesh
from deepinfer.launch.topology import Topology
from deepinfer.protocol import messages as m
from deepinfer.protocol.client import AsyncClient, InvalidRequestError

pytestmark = pytest.mark.smollm2

QUESTIONS = ["What is 2 + 2?", "Name a colour.", "Write one word about the sea.", "Who wrote Hamlet?",
             "Say hello in French.", "List three fruits."]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def reference(smollm2_path):
    """The in-process engine's greedy answers: the ground truth the mesh must reproduce."""
    engine = LLMEngine.load(smollm2_path, EngineConfig(kv_cache_bytes=64 * 1024 * 1024))
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    return [o.token_ids for o in outs]


def topology(path, disaggregated: bool, local_prefill_max_tokens: int = 0) -> Topology:
    topo = Topology.local(str(path), "inproc", disaggregated=disaggregated, threads=1, kv_cache_mb=64)
    router = dataclasses.replace(topo.router, local_prefill_max_tokens=local_prefill_max_tokens)
    return dataclasses.replace(topo, router=router)


def worker_engines(mesh: InprocMesh) -> list[LLMEngine]:
    return [s.engine for s in mesh.services if hasattr(s, "engine")]


async def settle(mesh: InprocMesh, free: list[int], timeout_s: float = 10.0) -> None:
    """Wait until every worker is idle with its whole pool free again."""
    for _ in range(int(timeout_s / 0.05)):
        engines = worker_engines(mesh)
        if [e.num_free_blocks for e in engines] == free and not any(
                e.has_unfinished() or e.num_held or e.num_reserved_blocks for e in engines):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"blocks not returned: {[e.num_free_blocks for e in worker_engines(mesh)]} != {free}")


@pytest.mark.parametrize(("disaggregated", "local_max"), [(False, 0), (True, 0), (True, 4096)],
                         ids=["colocated", "disaggregated", "conditional"])
def test_greedy_outputs_equal_the_engine(smollm2_path, reference, disaggregated, local_max):
    """`conditional`: a P/D pair whose router may prefill a request on its decode worker: the first request
    finds it idle and prefills there; the others, arriving while it runs, go to the prefill worker."""
    sites = {}

    async def run():
        mesh = InprocMesh(topology(smollm2_path, disaggregated, local_max))
        await mesh.start()
        free = [e.num_free_blocks for e in worker_engines(mesh)]
        try:
            async with AsyncClient(mesh.topology.frontend, ctx=mesh.ctx, timeout_s=120) as c:
                results = await asyncio.gather(*[
                    c.generate(messages=[{"role": "user", "content": q}], max_tokens=MAX_TOKENS) for q in QUESTIONS])
                streamed = [msg async for msg in c.stream(messages=[{"role": "user", "content": QUESTIONS[0]}],
                                                          max_tokens=MAX_TOKENS)]
            await settle(mesh, free)
            sites.update(next(s for s in mesh.services if hasattr(s, "core") and hasattr(s.core, "cache"))
                         .core.metrics.prefill_sites)
        finally:
            await mesh.stop()
        return results, streamed

    results, streamed = asyncio.run(run())
    assert [r.token_ids for r in results] == reference
    if local_max:
        assert sites["local"] >= 1 and sites["remote"] >= 1, sites
    else:
        assert not sites.get("local"), sites
    for r in results:
        assert r.usage.completion_tokens == len(r.token_ids) and r.usage.prompt_tokens > 0
        assert r.timings.ttft_s is not None and r.timings.e2e_s >= r.timings.ttft_s
    deltas, final = streamed[:-1], streamed[-1]
    assert isinstance(final, m.RequestFinished) and all(isinstance(d, m.StreamDelta) for d in deltas)
    assert [t for d in deltas for t in d.token_ids] == final.token_ids == reference[0]
    assert "".join(d.text for d in deltas) == final.text


def test_bad_requests_get_typed_errors_and_the_mesh_keeps_serving(smollm2_path, reference):
    async def run():
        mesh = InprocMesh(topology(smollm2_path, True))
        await mesh.start()
        try:
            async with AsyncClient(mesh.topology.frontend, ctx=mesh.ctx, timeout_s=60) as c:
                errors = []
                for kw in (dict(prompt="hi", max_tokens=0), dict(prompt="hi", top_p=0.0),
                           dict(prompt_token_ids=[1, 10**9]), dict(prompt="x " * 9000), dict(prompt="")):
                    with pytest.raises(InvalidRequestError) as exc:
                        await c.generate(**kw)
                    errors.append(str(exc.value))
                ok = await c.generate(messages=[{"role": "user", "content": QUESTIONS[1]}], max_tokens=MAX_TOKENS)
        finally:
            await mesh.stop()
        return errors, ok

    errors, ok = asyncio.run(run())
    assert all(e.startswith("invalid_request:") for e in errors), errors
    assert ok.token_ids == reference[1]


@pytest.mark.parametrize("disaggregated", [False, True], ids=["colocated", "disaggregated"])
def test_abort_at_every_point_ends_once_and_frees_blocks(smollm2_path, disaggregated):
    long_prompt = "Tell me a long story about a dragon. " * 40

    async def run():
        mesh = InprocMesh(topology(smollm2_path, disaggregated))
        await mesh.start()
        free = [e.num_free_blocks for e in worker_engines(mesh)]
        outcomes = []
        try:
            async with AsyncClient(mesh.topology.frontend, ctx=mesh.ctx, timeout_s=60) as c:
                # Cancel after 0 s (queued at the router / in the tokenizer), mid-prefill of a long prompt,
                # and mid-decode; the stream's own cleanup sends the AbortRequest.
                for delay, prompt in ((0.0, "hi"), (0.001, long_prompt), (0.05, long_prompt), (0.4, "Count to 100")):
                    task = asyncio.ensure_future(c.generate(prompt=prompt, max_tokens=200, ignore_eos=True))
                    await asyncio.sleep(delay)
                    task.cancel()
                    outcomes.append(await asyncio.gather(task, return_exceptions=True))
                # Mid-decode through a stream, then the same request aborted twice by hand.
                stream = c.stream(prompt="Count to 100", max_tokens=200, ignore_eos=True)
                got = [await stream.__anext__() for _ in range(3)]
                await stream.aclose()
                outcomes.append(got)
                after = await c.generate(prompt_token_ids=[1, 2, 3], max_tokens=4, ignore_eos=True)
            await settle(mesh, free)
            router = mesh.service("router")
            metrics = router.core.metrics
            counts = (metrics.admitted, sum(metrics.finished.values()) + sum(metrics.errors.values()),
                      router.core.num_inflight)
        finally:
            await mesh.stop()
        return outcomes, after, counts

    outcomes, after, (admitted, ended, inflight) = asyncio.run(run())
    assert len(after.token_ids) == 4
    assert inflight == 0 and admitted == ended  # every admitted request ended exactly once


def test_protocol_faults_at_the_edges(smollm2_path):
    """Garbage on the client front is refused and counted; a worker with another model is refused at the
    handshake with a reason; a decode reservation whose KV never comes is freed when its lease expires."""

    from deepinfer.protocol.sockets import arecv_msg, asend_msg, make_dealer

    async def run():
        mesh = InprocMesh(topology(smollm2_path, True))
        await mesh.start()
        router = mesh.service("router")
        decode = mesh.service("decode-0")
        try:
            client = make_dealer(mesh.ctx, mesh.topology.frontend, b"fuzzer")
            for frames in ([b"\x10", b"\xc1"], [b"\xff", b""], [b"\x10"], [b"\x10", b"\x92\x01"]):
                await client.send_multipart(frames)
            replies = [await arecv_msg(client) for _ in range(4)]
            client.close(linger=0)

            imposter = make_dealer(mesh.ctx, mesh.topology.backend, b"imposter")
            await asend_msg(imposter, m.Hello(m.PROTOCOL_VERSION, "decode", "imposter", "0" * 64, None))
            refused = await arecv_msg(imposter)
            await asend_msg(imposter, m.Hello(m.PROTOCOL_VERSION + 1, "decode", "imposter", None, None))
            old = await arecv_msg(imposter)
            imposter.close(linger=0)

            free = decode.engine.num_free_blocks
            peer = make_dealer(mesh.ctx, decode.kv_bind, b"prefill-fake")
            await asend_msg(peer, m.KvReserve("r-lease", 4, 50, 10, "prefill-fake", lease_s=0.3))
            granted = await arecv_msg(peer)
            reserved = decode.engine.num_free_blocks
            peer.close(linger=0)
            for _ in range(60):  # the worker's lease timer runs every second
                await asyncio.sleep(0.1)
                if decode.engine.num_free_blocks == free:
                    break
            after = decode.engine.num_free_blocks
            async with AsyncClient(mesh.topology.frontend, ctx=mesh.ctx, timeout_s=60) as c:
                ok = await c.generate(prompt="Hi", max_tokens=3, ignore_eos=True)
        finally:
            await mesh.stop()
        return replies, router.malformed, refused, old, granted, free, reserved, after, ok

    replies, malformed, refused, old, granted, free, reserved, after, ok = asyncio.run(run())
    assert all(isinstance(r, m.ErrorReply) and r.code == "bad_message" for r in replies)
    assert malformed == 4
    assert not refused.accepted and "fingerprint" in refused.reason
    assert not old.accepted and "protocol version" in old.reason
    assert granted.ok and reserved == free - 4 and after == free
    assert len(ok.token_ids) == 3


def test_abort_twice_mid_decode_ends_once(smollm2_path):
    """A raw client aborts one streaming request twice: one terminal RequestFinished("abort"), nothing after."""
    from deepinfer.protocol.sockets import arecv_msg, asend_msg, make_dealer

    async def run():
        mesh = InprocMesh(topology(smollm2_path, True))
        await mesh.start()
        free = [e.num_free_blocks for e in worker_engines(mesh)]
        try:
            sock = make_dealer(mesh.ctx, mesh.topology.frontend, b"raw-client")
            await asend_msg(sock, m.Hello(m.PROTOCOL_VERSION, "client", "raw"))
            assert (await arecv_msg(sock)).accepted
            await asend_msg(sock, m.GenerateRequest("dup", prompt="Count to 100:", stream=True,
                                                    params=m.SamplingParamsWire(max_tokens=300, ignore_eos=True)))
            got = [await arecv_msg(sock)]
            while sum(isinstance(x, m.StreamDelta) for x in got) < 3:
                got.append(await arecv_msg(sock))
            await asend_msg(sock, m.AbortRequest("dup"))
            await asend_msg(sock, m.AbortRequest("dup"))
            while not isinstance(got[-1], m.RequestFinished):
                got.append(await arecv_msg(sock))
            later = []
            while await sock.poll(timeout=1000):
                later.append(await arecv_msg(sock))
            sock.close(linger=0)
            await settle(mesh, free)
        finally:
            await mesh.stop()
        return got, later

    got, later = asyncio.run(run())
    final = got[-1]
    assert final.finish_reason == "abort" and 0 < len(final.token_ids) < 300
    assert [x for x in later if getattr(x, "request_id", None) == "dup"] == []


@pytest.mark.parametrize("disaggregated", [False, True], ids=["colocated", "disaggregated"])
def test_multiprocess_mesh_equals_the_engine(smollm2_path, reference, tmp_path, disaggregated):
    from deepinfer.launch.supervisor import Supervisor
    from deepinfer.protocol.client import Client

    topo = Topology.local(str(smollm2_path), "ipc", tmp_path, disaggregated=disaggregated, threads=1, kv_cache_mb=64)
    path = tmp_path / "topology.toml"
    path.write_text(topo.to_toml())
    sup = Supervisor(path, log_dir=tmp_path)
    sup.start()
    try:
        sup.wait_ready(timeout_s=300)
        with Client(topo.frontend, timeout_s=120) as c:
            results = c.generate_many([dict(messages=[{"role": "user", "content": q}], max_tokens=MAX_TOKENS)
                                       for q in QUESTIONS])
    finally:
        sup.stop()
    assert [r.token_ids for r in results] == reference
    assert all(c.restarts == 0 for c in sup.children)
