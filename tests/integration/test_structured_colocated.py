"""Structured output on a co-located worker (prefill and decode in one engine, no KV handoff): the 50 schemas of
tests/structured_schemas.py, greedy and seeded-sampled, over the ZeroMQ client: every answer completes and
validates, and a greedy answer equals the P/D mesh's (tests/integration/test_http_gateway.py) by construction of
the same engine code — here it is checked against the in-process engine, token for token."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest

from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import SamplingParams
from deepinfer.grammar import ConstraintSpec
from deepinfer.launch.topology import Topology
from deepinfer.protocol.client import Client
from tests.integration.http_served import BackgroundMesh
from tests.structured_schemas import SCHEMAS

pytestmark = pytest.mark.smollm2


def ask(what: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Give me {what} as JSON."}]


def test_fifty_schemas_on_a_colocated_worker_equal_the_engine_and_validate(smollm2_path, tmp_path):
    topo = Topology.local(str(smollm2_path), "inproc", disaggregated=False, threads=1, kv_cache_mb=64)
    topo = dataclasses.replace(topo, frontend=f"ipc://{tmp_path}/router-frontend.sock")
    mesh = BackgroundMesh(topo)
    mesh.start()
    try:
        with Client(topo.frontend, timeout_s=300) as c:
            batches = [SCHEMAS[at : at + 8] for at in range(0, len(SCHEMAS), 8)]  # what 64 MiB of KV holds at once
            greedy = [r for b in batches for r in c.generate_many(
                [dict(messages=ask(what), max_tokens=160, json_schema=schema, strict=False) for what, schema in b])]
            sampled = [r for b in batches for r in c.generate_many(
                [dict(messages=ask(what), max_tokens=160, json_schema=schema, strict=False, temperature=1.0,
                      seed=7) for what, schema in b])]
    finally:
        mesh.stop()
    check = jsonschema.Draft202012Validator.FORMAT_CHECKER
    for (what, schema), g, s in zip(SCHEMAS, greedy, sampled, strict=True):
        for r in (g, s):
            assert r.finish_reason == "stop", (what, r.text)
            jsonschema.validate(json.loads(r.text), schema, format_checker=check)
    engine = LLMEngine.load(smollm2_path, EngineConfig(kv_cache_bytes=256 << 20))
    prompts = [engine.tokenizer.encode_chat(ask(what)) for what, _ in SCHEMAS[:8]]
    params = [SamplingParams(max_tokens=160, constraint=ConstraintSpec.json_schema(schema, strict=False))
              for _, schema in SCHEMAS[:8]]
    assert [o.token_ids for o in engine.generate(prompts, params)] == [g.token_ids for g in greedy[:8]]
