"""The OpenAI-compatible gateway in front of a real mesh (SmolLM2, every service in one process on a background
event loop, the router's front on an ipc:// socket), served by uvicorn on a free port in a thread, driven by the
real `openai` SDK and raw httpx: outputs equal the ZeroMQ client's token for token, streams concatenate to the
non-streamed text, errors reach the SDK as its exception types, a client that leaves aborts its requests."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from deepinfer.gateway.server import load_gateway
from deepinfer.launch.topology import Topology
from deepinfer.protocol.client import Client
from tests.integration.http_served import BackgroundGateway, BackgroundMesh, settle

pytestmark = pytest.mark.smollm2

MODEL = "smollm2-test"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def served(smollm2_path, tmp_path_factory) -> Iterator[tuple[BackgroundMesh, BackgroundGateway]]:
    run_dir = tmp_path_factory.mktemp("gw")
    topo = Topology.local(str(smollm2_path), "inproc", disaggregated=True, threads=1, kv_cache_mb=64)
    topo = dataclasses.replace(topo, frontend=f"ipc://{run_dir}/router-frontend.sock")
    gateway = BackgroundGateway(load_gateway(str(smollm2_path), topo.frontend, MODEL))
    gateway.start()  # before the mesh: /ready must say 503 until the router answers
    assert httpx.get(gateway.url + "/health").status_code == 200
    assert httpx.get(gateway.url + "/ready").status_code == 503
    mesh = BackgroundMesh(topo)
    mesh.start()
    try:
        gateway.wait_ready()
        yield mesh, gateway
    finally:
        gateway.stop()
        mesh.stop()


@pytest.fixture()
def sdk(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[1].url + "/v1", api_key="EMPTY", max_retries=0, timeout=120)


@pytest.fixture()
def zmq_client(served) -> Iterator[Client]:
    with Client(served[0].topology.frontend, timeout_s=120) as c:
        yield c


def test_ready_models_and_health(served):
    _, gw = served
    assert httpx.get(gw.url + "/ready").status_code == 200
    models = httpx.get(gw.url + "/v1/models").json()
    assert [c["id"] for c in models["data"]] == [MODEL]


def test_completion_equals_the_zmq_client_token_for_token(sdk, zmq_client, served):
    r = sdk.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0)
    ref = zmq_client.generate(prompt="The capital of France is", max_tokens=12)
    assert r.choices[0].text == ref.text
    assert r.usage.completion_tokens == len(ref.token_ids) and r.usage.prompt_tokens == ref.usage.prompt_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    ids = httpx.post(served[1].url + "/tokenize", json={"prompt": r.choices[0].text, "add_special_tokens": False})
    assert ids.status_code == 200


def test_chat_equals_the_zmq_client_and_streams_concatenate(sdk, zmq_client):
    r = sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0)
    ref = zmq_client.generate(messages=QUESTION, max_tokens=16)
    assert r.choices[0].message.content == ref.text and "Paris" in ref.text
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens == len(ref.token_ids)
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    streamed = "".join(c.choices[0].text for c in sdk.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0, stream=True))
    assert streamed == sdk.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20,
                                              temperature=0).choices[0].text


def test_sse_framing(served):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", served[1].url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for e in events[:-2]:
        assert e.startswith("data: ") and "\n" not in e
        json.loads(e.removeprefix("data: "))


def test_logprobs_and_top_logprobs(sdk, zmq_client):
    r = sdk.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    ref = zmq_client.generate(prompt="1, 2, 3,", max_tokens=5, logprobs=3)
    assert len(lp.tokens) == len(ref.token_ids) == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    for value, top, mine in zip(lp.token_logprobs, lp.top_logprobs, ref.logprobs):
        assert math.isclose(value, mine.logprob, abs_tol=1e-6) and len(top) >= 3
        assert max(top.values()) == pytest.approx(value)  # greedy: the chosen token is the best
    c = sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, temperature=0, logprobs=True,
                                    top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert "".join(t.token for t in content) == c.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in content)


def test_n_samples_with_a_seed_are_reproducible(sdk):
    kw = dict(model=MODEL, prompt="My favourite animal is", max_tokens=8, temperature=1.0, seed=7, n=2)
    a, b = sdk.completions.create(**kw), sdk.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    streamed = ["", ""]
    for chunk in sdk.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in a.choices]
    single = sdk.completions.create(**{**kw, "n": 1})
    assert single.choices[0].text == a.choices[0].text  # choice 0 uses the seed itself, choice 1 seed + 1
    batch = sdk.completions.create(model=MODEL, prompt=["Hello", "Goodbye"], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text  # greedy samples of one prompt agree


def test_token_prompts_and_echo(sdk, zmq_client, served):
    ids = httpx.post(served[1].url + "/tokenize", json={"prompt": "The sky is"}).json()
    assert ids["count"] == len(ids["tokens"]) and ids["max_model_len"] > 0
    back = httpx.post(served[1].url + "/detokenize", json={"tokens": ids["tokens"]}).json()
    assert back["prompt"] == "The sky is"
    r = sdk.completions.create(model=MODEL, prompt=ids["tokens"], max_tokens=6, temperature=0, echo=True)
    ref = zmq_client.generate(prompt_token_ids=ids["tokens"], max_tokens=6)
    assert r.choices[0].text == "The sky is" + ref.text
    chat_ids = httpx.post(served[1].url + "/tokenize", json={"messages": QUESTION}).json()["tokens"]
    assert chat_ids == zmq_client.generate(messages=QUESTION, max_tokens=1, prompt_logprobs=0).prompt_token_ids


def test_evaluate_the_prompt_only(sdk):
    """lm-evaluation-harness's loglikelihood: echo, logprobs, max_tokens 0 → the prompt's tokens and logprobs."""
    r = sdk.completions.create(model=MODEL, prompt="The quick brown fox jumps", max_tokens=0, echo=True, logprobs=1,
                               temperature=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == "The quick brown fox jumps" and "".join(lp.tokens) == r.choices[0].text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert r.usage.completion_tokens == 0 and r.choices[0].finish_reason == "length"


def test_errors_reach_the_sdk_as_its_exception_types(sdk, served):
    with pytest.raises(openai.NotFoundError) as e:
        sdk.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="temperature"):
        sdk.completions.create(model=MODEL, prompt="hi", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        sdk.chat.completions.create(model=MODEL, messages=QUESTION, response_format={"type": "yaml"})
    with pytest.raises(openai.BadRequestError, match="context"):
        sdk.completions.create(model=MODEL, prompt="x " * 9000, max_tokens=2)
    r = httpx.post(served[1].url + "/v1/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(served[1].url + "/v1/nothing").status_code == 404


def test_a_client_that_leaves_mid_stream_aborts_its_request(served):
    mesh, gw = served
    body = {"model": MODEL, "prompt": "Count to one thousand:", "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", gw.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert mesh.router_inflight() == 1
    # the connection closed after one event: the gateway aborts the mesh request
    settle(mesh)


def test_a_client_that_leaves_mid_request_aborts_it(served):
    mesh, gw = served
    body = {"model": MODEL, "prompt": "Count to one thousand:", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gw.url + "/v1/completions", json=body, timeout=1.5)
    settle(mesh)


def test_metrics_count_requests(served):
    _, gw = served
    httpx.get(gw.url + "/v1/models")
    text = httpx.get(gw.url + "/metrics").text
    assert 'deepinfer_http_requests_total{endpoint="/v1/models",status="200"}' in text


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path):
    from deepinfer.loading.weights import load_model_weights
    from tests.engine.oracle import hf_model_from_loaded

    loaded = load_model_weights(smollm2_path)
    return hf_model_from_loaded(loaded.config, loaded.state_dict)


def test_loglikelihood_equals_transformers(sdk, served, hf_smollm2):
    """What lm-evaluation-harness's loglikelihood asks (echo, logprobs, max_tokens 0, token id prompts in a
    batch): every prompt token's logprob equals transformers' log_softmax within 1e-3."""
    import torch

    texts = ["The capital of France is Paris.", "Rivers run to the sea, and the sea is never full."]
    prompts = [httpx.post(served[1].url + "/tokenize", json={"prompt": t}).json()["tokens"] for t in texts]
    r = sdk.completions.create(model=MODEL, prompt=prompts, max_tokens=0, echo=True, logprobs=1, temperature=0)
    for ids, choice in zip(prompts, r.choices, strict=True):
        with torch.inference_mode():
            ref = torch.log_softmax(hf_smollm2(torch.tensor([ids])).logits[0].float(), dim=-1)
        expect = [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))]
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(ids) and lp.token_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx(expect, abs=1e-3)
        best = [float(ref[i - 1].max()) for i in range(1, len(ids))]
        assert [max(top.values()) for top in lp.top_logprobs[1:]] == pytest.approx(best, abs=1e-3)


def test_tenants_limits_and_a_lost_router_map_to_the_sdk_s_errors(smollm2_path, tmp_path):
    """401 for a key the router does not know (it requires one), 429 with Retry-After past a tenant's in-flight
    cap, 503 once the router is gone (and /ready says so)."""
    from deepinfer.services.router_state import RouterConfig

    topo = Topology.local(str(smollm2_path), "inproc", disaggregated=False, threads=1, kv_cache_mb=64, kvcache=False)
    router = RouterConfig(tenants={"key-a": "salt-a"}, require_api_key=True, max_inflight_per_tenant={"key-a": 1},
                          retry_after_s=2.5)
    topo = dataclasses.replace(topo, frontend=f"ipc://{tmp_path}/router-frontend.sock", router=router)
    mesh, gateway = BackgroundMesh(topo), BackgroundGateway(load_gateway(str(smollm2_path), topo.frontend, MODEL))
    mesh.start()
    gateway.start()
    try:
        gateway.wait_ready()
        url = gateway.url + "/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="nope", max_retries=0).completions.create(model=MODEL, prompt="hi")
        tenant = openai.OpenAI(base_url=url, api_key="key-a", max_retries=0, timeout=120)
        assert tenant.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text is not None
        long = {"model": MODEL, "prompt": "Count to one thousand:", "max_tokens": 300, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", url + "/completions", json=long, headers={"Authorization": "Bearer key-a"},
                          timeout=60) as first:
            assert first.status_code == 200
            with pytest.raises(openai.RateLimitError) as e:
                tenant.completions.create(model=MODEL, prompt="hi", max_tokens=2)
            assert e.value.response.headers["retry-after"] == "3"
        settle(mesh)
    finally:
        mesh.stop()
    try:
        deadline = time.monotonic() + 30
        while httpx.get(gateway.url + "/ready").status_code != 503:
            assert time.monotonic() < deadline, "the gateway still says ready without a router"
            time.sleep(0.1)
        with pytest.raises(openai.InternalServerError) as e:
            tenant.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert e.value.status_code == 503
    finally:
        gateway.stop()


# ----- structured output -----

PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
DESCRIBE = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]


def test_the_sdk_parses_a_pydantic_model_and_the_zmq_client_gets_the_same_tokens(sdk, zmq_client):
    import jsonschema
    import pydantic

    class Person(pydantic.BaseModel):
        name: str
        age: int

    r = sdk.chat.completions.parse(model=MODEL, messages=DESCRIBE, response_format=Person, max_tokens=48,
                                   temperature=0)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and r.choices[0].finish_reason == "stop"
    # The same schema (pydantic's, strict) through the ZeroMQ client: the same greedy tokens.
    schema = openai.lib._pydantic.to_strict_json_schema(Person)
    ref = zmq_client.generate(messages=DESCRIBE, max_tokens=48, json_schema=schema)
    assert ref.text == r.choices[0].message.content and ref.finish_reason == "stop"
    jsonschema.validate(json.loads(ref.text), schema)


def test_a_streamed_schema_answer_concatenates_to_valid_json_and_regex_matches(sdk, zmq_client):
    import re

    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}
    stream = sdk.chat.completions.create(model=MODEL, messages=DESCRIBE, response_format=fmt, max_tokens=48,
                                         temperature=0.8, seed=7, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PERSON_SCHEMA)
    pattern = r"The capital of France is [A-Z][a-z]+\."
    out = zmq_client.generate(messages=QUESTION, max_tokens=24, regex=pattern)
    assert re.fullmatch(pattern, out.text), out.text


def test_a_schema_the_grammar_engine_refuses_is_a_400_with_its_reason(sdk, zmq_client):
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "object", "properties": 5}}}
    with pytest.raises(openai.BadRequestError, match="invalid constraint"):
        sdk.chat.completions.create(model=MODEL, messages=DESCRIBE, response_format=bad, max_tokens=8)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        sdk.chat.completions.create(model=MODEL, messages=DESCRIBE, response_format={"type": "yaml"}, max_tokens=8)
    # Beside them an innocent request is served as ever.
    assert zmq_client.generate(messages=QUESTION, max_tokens=4).token_ids


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 24}},
                   "required": ["timezone"], "additionalProperties": False}}}
WEATHER_ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]


def test_named_and_required_tool_choices_always_call_and_a_streamed_call_assembles(sdk):
    named = sdk.chat.completions.create(model=MODEL, messages=WEATHER_ASK, tools=[WEATHER_TOOL, TIME_TOOL],
                                        tool_choice={"type": "function", "function": {"name": "get_time"}},
                                        max_tokens=64, temperature=0)
    [call] = named.choices[0].message.tool_calls
    assert named.choices[0].finish_reason == "tool_calls" and call.function.name == "get_time"
    assert set(json.loads(call.function.arguments)) == {"timezone"}
    required = sdk.chat.completions.create(model=MODEL, messages=WEATHER_ASK, tools=[WEATHER_TOOL, TIME_TOOL],
                                           tool_choice="required", parallel_tool_calls=False, max_tokens=64,
                                           temperature=0.7, seed=3)
    [call] = required.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "get_time") and isinstance(json.loads(call.function.arguments), dict)
    # Streamed: the SDK's own accumulation of delta.tool_calls gives the same call as the unary answer.
    with sdk.chat.completions.stream(model=MODEL, messages=WEATHER_ASK, tools=[WEATHER_TOOL],
                                     tool_choice="required", parallel_tool_calls=False, max_tokens=64,
                                     temperature=0) as stream:
        final = stream.get_final_completion()
    unary = sdk.chat.completions.create(model=MODEL, messages=WEATHER_ASK, tools=[WEATHER_TOOL],
                                        tool_choice="required", parallel_tool_calls=False, max_tokens=64,
                                        temperature=0)
    got = [(c.function.name, json.loads(c.function.arguments)) for c in final.choices[0].message.tool_calls]
    want = [(c.function.name, json.loads(c.function.arguments)) for c in unary.choices[0].message.tool_calls]
    assert got == want and got[0][0] == "get_weather" and final.choices[0].finish_reason == "tool_calls"
    # The call's result goes back as a tool turn, and the model answers in text.
    history = [*WEATHER_ASK, unary.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": unary.choices[0].message.tool_calls[0].id, "content": "sunny, 21 C"}]
    answer = sdk.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER_TOOL], tool_choice="none",
                                         max_tokens=24, temperature=0)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_fifty_schemas_answer_valid_json_greedy_over_zeromq_and_sampled_over_http(zmq_client, served):
    """tests/structured_schemas.py's 50 schemas through the P/D mesh: every answer completes and validates."""
    import asyncio

    import jsonschema

    from tests.structured_schemas import SCHEMAS

    def ask(what: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"Give me {what} as JSON."}]

    # 8 at a time: the test mesh's 64 MiB KV pools hold about that many of these answers at once.
    async def over_http() -> list[dict]:
        slots = asyncio.Semaphore(8)
        async with httpx.AsyncClient(base_url=served[1].url, timeout=300) as http:
            async def one(i: int, what: str, schema: dict) -> dict:
                async with slots:
                    return (await http.post("/v1/chat/completions", json={
                        "model": MODEL, "messages": ask(what), "max_tokens": 160, "temperature": 1.0, "seed": i,
                        "response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}",
                                                                                   "schema": schema}}})).json()
            return await asyncio.gather(*[one(i, what, schema) for i, (what, schema) in enumerate(SCHEMAS)])

    greedy = [r for at in range(0, len(SCHEMAS), 8) for r in zmq_client.generate_many(
        [dict(messages=ask(what), max_tokens=160, json_schema=schema, strict=False)
         for what, schema in SCHEMAS[at : at + 8]])]
    sampled = asyncio.run(over_http())
    check = jsonschema.Draft202012Validator.FORMAT_CHECKER
    for (what, schema), g, s in zip(SCHEMAS, greedy, sampled, strict=True):
        assert g.finish_reason == "stop", (what, g.text)
        jsonschema.validate(json.loads(g.text), schema, format_checker=check)
        assert "choices" in s, (what, s)
        choice = s["choices"][0]
        assert choice["finish_reason"] == "stop", (what, choice)
        jsonschema.validate(json.loads(choice["message"]["content"]), schema, format_checker=check)
