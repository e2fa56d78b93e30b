"""Limits and options seen from a client of a whole mesh on the real model: `max_tokens` that does not fit
the context with the prompt is refused with the typed error and leaves nothing behind (router, tokenizer,
workers' KV pools); requests that break the wire's limits (a 3 MiB and a 9 MiB prompt, max_tokens=2**64) end
alone with their own typed errors while innocent streams on the same client connection finish with their
undisturbed tokens (isolation by request, issue 30); and `chat --keys` talks to a CURVE-secured mesh as
`generate --keys` does. Bounded waits only."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from deepinfer.launch.keys import make_keys
from deepinfer.launch.mesh import InprocMesh
from deepinfer.launch.topology import Topology
from deepinfer.protocol import messages as m
from deepinfer.protocol.auth import load_client_keys
from deepinfer.protocol.client import AsyncClient, InvalidRequestError, RequestTooLargeError
from deepinfer.protocol.framing import encode_frames
from deepinfer.protocol.limits import Limits, MiB
from deepinfer.protocol.sockets import arecv_msg, make_dealer
from tests.integration.test_auth import tcp_topology
from tests.integration.test_mesh import settle, worker_engines

pytestmark = pytest.mark.smollm2


INNOCENT = [[1, 504, 3250, 314], [1, 2683, 253, 2843, 28], [1, 7053, 260, 1785, 282, 1046]]
UNBOUNDED = Limits(max_payload=64 * MiB, max_frame=64 * MiB, max_total=64 * MiB, max_str_len=64 * MiB)


async def innocent_streams(c: AsyncClient, started: asyncio.Event | None = None) -> list[list[int]]:
    """Stream each INNOCENT prompt at once (greedy, 12 tokens each); `started` is set once every stream has
    its first delta. Returns each stream's tokens, checked against its RequestFinished."""
    first = [asyncio.Event() for _ in INNOCENT]

    async def one(ids: list[int], got_first: asyncio.Event) -> list[int]:
        tokens: list[int] = []
        async for msg in c.stream(prompt_token_ids=ids, max_tokens=12, ignore_eos=True):
            if isinstance(msg, m.StreamDelta):
                tokens += msg.token_ids
                got_first.set()
            else:
                assert msg.token_ids == tokens
        return tokens

    async def all_started() -> None:
        await asyncio.gather(*(e.wait() for e in first))
        if started is not None:
            started.set()

    watcher = asyncio.ensure_future(all_started())
    try:
        return list(await asyncio.gather(*(one(ids, e) for ids, e in zip(INNOCENT, first))))
    finally:
        watcher.cancel()


async def harm_on_the_same_connection(c: AsyncClient) -> list[str]:
    """What a careless caller sends on the client the innocent streams share: each must end with its own typed
    error at once (the client refuses it before sending), unary or streamed."""
    codes = []
    for kw in (dict(prompt="x" * (3 * MiB)), dict(prompt="x" * (9 * MiB)),
               dict(prompt_token_ids=[1, 2], max_tokens=2**64)):
        with pytest.raises(InvalidRequestError) as exc:
            await c.generate(**kw)
        codes.append(exc.value.code)
    with pytest.raises(RequestTooLargeError):
        async for _ in c.stream(prompt="y" * (3 * MiB)):
            pass
    return codes


async def harm_at_the_router(frontend: str, ctx) -> list[m.ErrorReply]:  # type: ignore[no-untyped-def]
    """The same oversized prompts from a raw sender that does not check (the router's own refusal by id)."""
    raw = make_dealer(ctx, frontend, b"raw-sender")
    try:
        for rid, size in (("raw-3mib", 3 * MiB), ("raw-9mib", 9 * MiB)):
            await raw.send_multipart(encode_frames(m.GenerateRequest(rid, prompt="x" * size), UNBOUNDED), copy=False)
        replies = []
        for _ in range(2):
            assert await raw.poll(60_000), "the router never answered the raw oversized requests"
            replies.append(await arecv_msg(raw))
        return replies
    finally:
        raw.close(linger=0)


@pytest.mark.parametrize("disaggregated", [False, True], ids=["colocated", "disaggregated"])
def test_max_tokens_beyond_the_context_is_a_typed_error_that_leaks_nothing(smollm2_path, disaggregated):
    async def run():
        topo = Topology.local(str(smollm2_path), "inproc", disaggregated=disaggregated, threads=1, kv_cache_mb=64)
        mesh = InprocMesh(topo)
        await mesh.start()
        free = [e.num_free_blocks for e in worker_engines(mesh)]
        try:
            tokenizer = mesh.service("tokenizer-0")
            limit = tokenizer.core.max_model_len
            errors = []
            async with AsyncClient(topo.frontend, ctx=mesh.ctx, timeout_s=60) as c:
                # One token over (3 prompt ids + limit - 2), far over, and a text prompt; unary and streamed.
                for kw in (dict(prompt_token_ids=[1, 2, 3], max_tokens=limit - 2),
                           dict(prompt="Hello there", max_tokens=10 * limit),
                           dict(messages=[{"role": "user", "content": "Hi"}], max_tokens=limit)):
                    with pytest.raises(InvalidRequestError) as exc:
                        await c.generate(**kw)
                    errors.append(str(exc.value))
                with pytest.raises(InvalidRequestError):
                    async for _ in c.stream(prompt_token_ids=[1, 2, 3], max_tokens=limit - 2):
                        pass
                # The mesh serves on: a request that fits.
                ok = await c.generate(prompt_token_ids=[1, 2, 3], max_tokens=4, ignore_eos=True)
                # Isolation by request (on the P/D mesh only, the longer path; CI time is a budget): innocent
                # streams, undisturbed, then beside harmful requests on the same client connection (and
                # oversized ones from a raw sender at the router).
                isolation = None
                if disaggregated:
                    undisturbed = await innocent_streams(c)
                    started = asyncio.Event()
                    streams = asyncio.ensure_future(innocent_streams(c, started))
                    await asyncio.wait_for(started.wait(), 120)
                    codes = await harm_on_the_same_connection(c)
                    raw = await harm_at_the_router(topo.frontend, mesh.ctx)
                    isolation = undisturbed, await streams, codes, raw
            await settle(mesh, free)
            router = mesh.service("router")
            metrics = router.core.metrics
            state = (router.core.num_inflight, metrics.admitted,
                     sum(metrics.finished.values()) + sum(metrics.errors.values()),
                     [mesh.service(t.name).core.num_inflight for t in topo.tokenizers])
        finally:
            await mesh.stop()
        return limit, errors, ok, state, isolation

    limit, errors, ok, (inflight, admitted, ended, tokenizers_inflight), isolation = asyncio.run(run())
    if isolation is not None:
        undisturbed, disturbed, codes, raw = isolation
        assert disturbed == undisturbed and all(len(t) == 12 for t in undisturbed)
        assert codes == ["request_too_large", "request_too_large", "invalid_request"]
        assert sorted((r.request_id, r.code) for r in raw) == [("raw-3mib", "request_too_large"),
                                                               ("raw-9mib", "request_too_large")]
    assert all(e.startswith("invalid_request:") and "context" in e for e in errors), errors
    assert f"ask for at most {limit - 3}" in errors[0], errors[0]
    assert len(ok.token_ids) == 4
    assert inflight == 0 and admitted == ended  # every admitted request ended exactly once
    assert tokenizers_inflight == [0] * len(tokenizers_inflight)


def test_chat_with_keys_talks_to_a_secured_mesh(tmp_path, smollm2_path):
    keys = tmp_path / "keys"
    topo = tcp_topology(str(smollm2_path), keys)
    make_keys(keys, topo)
    client_keys, router_key = load_client_keys(keys)
    question = "The capital of France is"

    def chat(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "deepinfer.launch.cli", "chat", *args], input=stdin,
                              capture_output=True, text=True, timeout=180)

    async def run():
        mesh = InprocMesh(topo)
        await mesh.start()
        try:
            async with AsyncClient(topo.frontend, timeout_s=120, curve_keys=client_keys, server_key=router_key) as c:
                expected = await c.generate(messages=[{"role": "user", "content": question}], max_tokens=6)
            ask = ("--endpoint", topo.frontend, "--max-tokens", "6")
            served = await asyncio.to_thread(chat, *ask, "--keys", str(keys), stdin=f"{question}\n\n")
            misused = await asyncio.to_thread(chat, "--max-tokens", "6", "--keys", str(keys), stdin="\n")
        finally:
            await mesh.stop()
        return expected, served, misused

    expected, served, misused = asyncio.run(run())
    assert served.returncode == 0, served.stderr
    assert "error" not in served.stderr
    assert expected.text and expected.text in served.stdout, (expected.text, served.stdout)
    assert misused.returncode == 2 and "--keys secures a tcp://" in misused.stderr
