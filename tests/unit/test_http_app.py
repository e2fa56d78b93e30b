"""The gateway's app over a fake router connection (Starlette's in-process test client): whatever a request's
producer raises reaches its consumer — before the first record as a status (a request the wire cannot carry is
400/413, never a 500), after it as the stream's error event — and no stream waits on an error; the
streams of one request all end when one fails; a draining gateway refuses new generations with 503 and
Retry-After, says not ready, and calls back once the last answering request is done."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from deepinfer.gateway.app import Gateway, build_app
from deepinfer.gateway.limits import HttpLimits
from deepinfer.protocol import messages as m
from deepinfer.protocol.client import InvalidRequestError, MeshError
from deepinfer.protocol.errors import ProtocolError


class Tokenizer:
    vocab_size = 100

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 100 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + i % 26) for i in ids)

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        return self.encode("".join(msg["content"] for msg in messages))


def delta(text: str) -> m.StreamDelta:
    return m.StreamDelta("r", text, [1])


def finished(text: str) -> m.RequestFinished:
    return m.RequestFinished("r", text, [1], "stop", m.UsageWire(2, 1), m.Timings(0.1))


class FakeClient:
    """Each request gets the next script: records to yield, then an exception to raise (or None: finish)."""

    connected = True

    def __init__(self, scripts: list[tuple[list[Any], BaseException | None]]) -> None:
        self.scripts = scripts
        self.open = 0  # requests under way: a stream left (or cancelled) closes its own
        self.calls = 0

    async def stream(self, **kwargs: Any) -> AsyncIterator[Any]:
        records, error = self.scripts[min(self.calls, len(self.scripts) - 1)]
        self.calls += 1
        self.open += 1
        try:
            for record in records:
                await asyncio.sleep(0)
                yield record
            if error is not None:
                raise error
            await asyncio.sleep(3600)  # a request that never ends by itself: only leaving it ends it
        finally:
            self.open -= 1

    async def generate(self, **kwargs: Any) -> m.RequestFinished:
        records, error = self.scripts[min(self.calls, len(self.scripts) - 1)]
        self.calls += 1
        if error is not None:
            raise error
        return finished("ok")


def serve(scripts: list[tuple[list[Any], BaseException | None]], **limits: Any) -> tuple[TestClient, Gateway, Any]:
    gw = Gateway("inproc://nobody", "tiny", Tokenizer(), 1000, limits=HttpLimits(**limits))
    client = FakeClient(scripts)
    gw.routers.pick = lambda: client  # type: ignore[method-assign]
    return TestClient(build_app(gw), raise_server_exceptions=False), gw, client


BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 3}
UNCARRIABLE = [
    (OverflowError("int too big to convert"), 400),
    (ValueError("the wire refused it"), 400),
    (ProtocolError("bad_field", "max_tokens out of range"), 400),
    (ProtocolError("too_large", "over 8 MiB"), 413),
    (InvalidRequestError("invalid_request: an integer of 2**64"), 400),
]


@pytest.mark.parametrize("exc, status", UNCARRIABLE)
@pytest.mark.parametrize("stream", [False, True])
def test_an_error_before_the_first_record_is_its_status(exc, status, stream):
    http, _, client = serve([([], exc)])
    r = http.post("/v1/completions", json={**BODY, "stream": stream})
    assert r.status_code == status, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert client.open == 0


@pytest.mark.parametrize("exc", [OverflowError("late"), RuntimeError("a bug"), MeshError("worker_lost: gone")])
def test_an_error_mid_stream_ends_it_with_an_error_event(exc):
    http, _, client = serve([([delta("a"), delta("b")], exc)])
    r = http.post("/v1/completions", json={**BODY, "stream": True})
    assert r.status_code == 200
    events = [json.loads(e.removeprefix("data: ")) for e in r.text.split("\n\n") if e and e != "data: [DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "ab"
    assert set(events[-1]["error"]) == {"message", "type", "param", "code"}
    assert client.open == 0


def test_one_failing_choice_ends_the_other_choices_streams():
    # Choice 0 streams and would never end; choice 1 fails after a record: the response ends, and choice 0's
    # request is left (aborted).
    http, _, client = serve([([delta("a")], None), ([delta("b")], OverflowError("late"))])
    r = http.post("/v1/completions", json={**BODY, "stream": True, "n": 2})
    assert r.status_code == 200 and '"error"' in r.text
    assert client.open == 0


def test_an_uncarriable_non_streamed_request_is_400_not_500():
    http, _, _ = serve([([], OverflowError("int too big"))])
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 3, "n": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"


def test_a_draining_gateway_refuses_new_generations_and_says_not_ready():
    http, gw, _ = serve([([], None)])
    assert http.post("/v1/completions", json=BODY).status_code == 200
    drained = []

    async def drain() -> None:
        release = gw.lease()  # a request still answering
        gw.begin_drain(lambda: drained.append(True), timeout_s=60)
        await asyncio.sleep(0)
        assert not drained
        release()
        await gw._drain_task

    asyncio.run(drain())
    assert drained == [True]
    r = http.post("/v1/completions", json=BODY)
    assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable" and int(r.headers["retry-after"]) >= 1
    ready = http.get("/ready")
    assert ready.status_code == 503 and ready.json()["status"] == "draining"
    assert http.get("/health").status_code == 200


def test_a_body_past_the_limit_is_413_and_the_connection_closes():
    http, _, _ = serve([([], None)], max_body_bytes=100)
    r = http.post("/v1/completions", json={**BODY, "prompt": "x" * 200})
    assert r.status_code == 413 and r.headers["connection"] == "close"
    assert r.json()["error"]["code"] == "request_too_large"
