"""Limits and options seen from a client of a whole mesh on the real model: `max_tokens` that does not fit
the context with the prompt is refused with the typed error and leaves nothing behind (router, tokenizer,
workers' KV pools), and `chat --keys` talks to a CURVE-secured mesh as `generate --keys` does. Bounded waits
only."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from deepinfer.launch.keys import make_keys
from deepinfer.launch.mesh import InprocMesh
from deepinfer.launch.topology import Topology
from deepinfer.protocol.auth import load_client_keys
from deepinfer.protocol.client import AsyncClient, InvalidRequestError
from tests.integration.test_auth import tcp_topology
from tests.integration.test_mesh import settle, worker_engines

pytestmark = pytest.mark.smollm2


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
            await settle(mesh, free)
            router = mesh.service("router")
            metrics = router.core.metrics
            state = (router.core.num_inflight, metrics.admitted,
                     sum(metrics.finished.values()) + sum(metrics.errors.values()),
                     [mesh.service(t.name).core.num_inflight for t in topo.tokenizers])
        finally:
            await mesh.stop()
        return limit, errors, ok, state

    limit, errors, ok, (inflight, admitted, ended, tokenizers_inflight) = asyncio.run(run())
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
