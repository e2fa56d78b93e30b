"""Logprobs, prompt logprobs, logit_bias and the protocol-8 error codes through the whole mesh (in one process,
on the real model), co-located and disaggregated: what the client gets equals what the engine computes.

* A streamed request's per-delta logprobs (one per token) concatenate to RequestFinished.logprobs, their ids
  are the tokens, and their values are the engine's — also with speculation on (several tokens a step) and
  with a stop string cutting a delta.
* Prompt logprobs arrive once, with the prompt's ids, on the first StreamDelta, and on RequestFinished, equal
  to the engine's; in P/D the prefill worker computes them and they travel with the KV.
* Greedy output with logit_bias equals the engine's; invalid logit_bias / prompt_logprobs are refused with
  InvalidRequestError and every worker's pool is whole afterwards.
* "unauthorized" and "unavailable" reach the client as UnauthorizedError and UnavailableError.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import Logprob, SamplingParams
from deepinfer.launch.mesh import InprocMesh
from deepinfer.launch.topology import Topology
from deepinfer.protocol import messages as m
from deepinfer.protocol.client import AsyncClient, InvalidRequestError, UnauthorizedError, UnavailableError
from tests.integration.test_mesh import settle, worker_engines

pytestmark = pytest.mark.smollm2

QUESTIONS = ["What is 2 + 2?", "Name a colour.", "Write one sentence about the sea.", "Who wrote Hamlet?"]
MAX_TOKENS = 12
TOL = 2e-3  # the mesh's workers chunk prompts as the reference engine does; allow for kernel-order noise
BIAS_TOKEN_RANK = 1  # logit_bias favours the reference's second choice for the first token (and bans the first)


@pytest.fixture(scope="module")
def reference(smollm2_path):
    """The in-process engine: prompts, outputs with logprobs and prompt logprobs, and a biased greedy run."""
    engine = LLMEngine.load(smollm2_path, EngineConfig(kv_cache_bytes=64 * 1024 * 1024))
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, logprobs=2, prompt_logprobs=3))
    first = outs[3].logprobs[0].top
    bias = {first[BIAS_TOKEN_RANK][0]: 6.0, first[0][0]: -100.0}
    [biased] = engine.generate([prompts[3]], SamplingParams(max_tokens=MAX_TOKENS, logit_bias=bias))
    return dict(prompts=prompts, outs=outs, bias=bias, biased=biased.token_ids,
                vocab=engine.model_config.vocab_size)


def wire_values(lps: list[m.LogprobWire | None] | None) -> list[float | None]:
    assert lps is not None
    return [None if lp is None else lp.logprob for lp in lps]


def engine_values(lps: list[Logprob | None] | None) -> list[float | None]:
    assert lps is not None
    return [None if lp is None else lp.logprob for lp in lps]


def assert_close(got: list[float | None], want: list[float | None]) -> None:
    assert len(got) == len(want)
    assert [g is None for g in got] == [w is None for w in want]
    assert [g for g in got if g is not None] == pytest.approx([w for w in want if w is not None], abs=TOL)


def assert_prompt_logprobs(ids: list[int] | None, lps: list[m.LogprobWire | None] | None, prompt: list[int],
                           ref: list[Logprob | None] | None) -> None:
    assert ids == prompt
    assert lps is not None and lps[0] is None and [lp.token_id for lp in lps[1:]] == prompt[1:]
    assert all(len(lp.top) == 3 for lp in lps[1:])
    assert_close(wire_values(lps), engine_values(ref))


@pytest.mark.parametrize(("disaggregated", "speculative"), [(False, "ngram"), (True, None), (True, "ngram")],
                         ids=["colocated-ngram", "disaggregated", "disaggregated-ngram"])
def test_logprobs_prompt_logprobs_and_logit_bias_through_the_mesh(smollm2_path, reference, disaggregated,
                                                                  speculative):
    prompts, outs = reference["prompts"], reference["outs"]
    stop_text = None

    async def run():
        nonlocal stop_text
        topo = Topology.local(str(smollm2_path), "inproc", disaggregated=disaggregated, threads=1, kv_cache_mb=64,
                              speculative=speculative)
        mesh = InprocMesh(topo)
        await mesh.start()
        free = [e.num_free_blocks for e in worker_engines(mesh)]
        got: dict[str, object] = {}
        try:
            async with AsyncClient(topo.frontend, ctx=mesh.ctx, timeout_s=120) as c:
                asked = dict(max_tokens=MAX_TOKENS, logprobs=2, prompt_logprobs=3)
                got["stream"] = [x async for x in c.stream(prompt_token_ids=prompts[0], **asked)]
                got["plain"] = await c.generate(prompt_token_ids=prompts[1], **asked)
                got["again"] = await c.generate(prompt_token_ids=prompts[0], **asked)  # its prefix is cached now
                text = outs[2].text or ""
                stop_text = text[len(text) // 2: len(text) // 2 + 3]
                got["stopped"] = [x async for x in c.stream(prompt_token_ids=prompts[2], max_tokens=MAX_TOKENS,
                                                            logprobs=1, stop=[stop_text])]
                got["biased"] = await c.generate(prompt_token_ids=prompts[3], max_tokens=MAX_TOKENS,
                                                 logit_bias=reference["bias"])
                refused = []
                for bad in (dict(logit_bias={reference["vocab"] + 5: 1.0}), dict(logit_bias={5: 101.0}),
                            dict(logit_bias={i: 1.0 for i in range(301)}), dict(prompt_logprobs=21),
                            dict(prompt_logprobs=-1)):
                    with pytest.raises(InvalidRequestError) as exc:
                        await c.generate(prompt_token_ids=prompts[0], max_tokens=4, **bad)
                    refused.append(str(exc.value))
                got["refused"] = refused
            await settle(mesh, free)
        finally:
            await mesh.stop()
        return got

    got = asyncio.run(run())

    # Streamed: per-delta logprobs, prompt logprobs on the first delta only.
    *deltas, final = got["stream"]
    assert isinstance(final, m.RequestFinished) and deltas
    assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)
    assert [lp for d in deltas for lp in d.logprobs] == final.logprobs
    assert [lp.token_id for lp in final.logprobs] == final.token_ids == outs[0].token_ids
    assert all(len(lp.top) == 2 for lp in final.logprobs)
    assert_close(wire_values(final.logprobs), engine_values(outs[0].logprobs))
    assert_prompt_logprobs(deltas[0].prompt_token_ids, deltas[0].prompt_logprobs, prompts[0], outs[0].prompt_logprobs)
    assert all(d.prompt_token_ids is None and d.prompt_logprobs is None for d in deltas[1:])
    assert_prompt_logprobs(final.prompt_token_ids, final.prompt_logprobs, prompts[0], outs[0].prompt_logprobs)

    # Not streamed, and again once the prefix cache holds the prompt.
    for key, i in (("plain", 1), ("again", 0)):
        fin = got[key]
        assert fin.token_ids == outs[i].token_ids and [lp.token_id for lp in fin.logprobs] == fin.token_ids
        assert_prompt_logprobs(fin.prompt_token_ids, fin.prompt_logprobs, prompts[i], outs[i].prompt_logprobs)

    # A stop string cuts a delta's text, never the pairing of tokens and logprobs.
    *deltas, final = got["stopped"]
    assert final.finish_reason == "stop" and final.stop_string == stop_text
    assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)
    assert [lp.token_id for lp in final.logprobs] == final.token_ids
    assert final.token_ids == outs[2].token_ids[: len(final.token_ids)]
    assert final.prompt_logprobs is None and final.prompt_token_ids is None

    assert got["biased"].token_ids == reference["biased"] != outs[3].token_ids
    assert all(e.startswith("invalid_request:") for e in got["refused"]), got["refused"]
    assert "logit_bias token id" in got["refused"][0]  # the worker's engine knows the vocabulary


def test_unauthorized_and_unavailable_reach_the_client_typed(smollm2_path):
    async def run():
        topo = Topology.local(str(smollm2_path), "inproc", disaggregated=False, threads=1, kv_cache_mb=64,
                              kvcache=False)
        topo = dataclasses.replace(topo, router=dataclasses.replace(topo.router, tenants={"key-a": "salt-a"},
                                                                    require_api_key=True))
        mesh = InprocMesh(topo, skip={"worker-0"})  # a router and a tokenizer, but no worker
        await mesh.start()
        try:
            async with AsyncClient(topo.frontend, ctx=mesh.ctx, timeout_s=30, api_key="key-a") as c:
                with pytest.raises(UnauthorizedError) as denied:
                    await c.generate("hi", max_tokens=2, api_key="nope")
                with pytest.raises(UnavailableError) as unavailable:
                    await c.generate("hi", max_tokens=2)  # the client's own key: admitted, but no worker
        finally:
            await mesh.stop()
        return denied.value, unavailable.value

    denied, unavailable = asyncio.run(run())
    assert denied.code == "unauthorized" and denied.retry_after_s is None
    assert unavailable.code == "unavailable" and unavailable.retry_after_s is not None
    assert "no live prefill/decode workers" in str(unavailable)
