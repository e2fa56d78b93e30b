"""The gateway's bounds without a mesh: bodies (size while reading, JSON depth, integer size), the sequences
and prompt bounds of a parsed request, the mapping of every producer error to a status (never a 500 for a
request the wire cannot carry), the offload pool's refusal when too much waits, the limits' configuration,
and the GIL-releasing tokenizer calls agreeing with the tokenizer's own."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from starlette.requests import Request

from deepinfer.gateway.errors import ApiError, from_exception
from deepinfer.gateway.json_body import INT_MAX, INT_MIN, parse_json, read_body
from deepinfer.gateway.limits import REFUSAL_CAUSES, HttpLimits
from deepinfer.gateway.offload import Offload
from deepinfer.gateway.openai_requests import ParseContext, parse_chat, parse_completion, parse_tokenize
from deepinfer.protocol.client import MeshError
from deepinfer.protocol.errors import ProtocolError

CTX = ParseContext("tiny", 100, lambda msgs: 10 * len(msgs), max_sequences=8, max_prompt_chars=1000)


def refused(fn, *args, status: int = 400, cause: str | None = None) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(*args)
    assert e.value.status == status, e.value
    assert e.value.cause == cause
    assert e.value.cause is None or e.value.cause in REFUSAL_CAUSES
    return e.value


# -- bodies -----------------------------------------------------------------------------------------------------


def test_json_within_bounds_parses():
    body = {"model": "tiny", "prompt": [[1, 2], [3]], "logit_bias": {"5": -1.5}, "seed": INT_MAX, "x": INT_MIN}
    assert parse_json(json.dumps(body).encode(), 32) == body
    assert parse_json(b"[" * 32 + b"]" * 32, 32) is not None
    assert parse_json(b'{"prompt": "\\ud83d\\ude00"}', 32) == {"prompt": "\U0001f600"}  # a pair is one character


@pytest.mark.parametrize("raw, what", [
    (b"[" * 33 + b"]" * 33, "nests deeper"),  # past the depth bound
    (b'{"a":' * 40 + b"1" + b"}" * 40, "nests deeper"),
    (b"[" * 100_000 + b"]" * 100_000, "nests deeper"),  # past Python's own recursion limit
    (b'{"max_tokens": ' + b"9" * 5000 + b"}", "not valid JSON"),  # past Python's int-from-str digits
    (b'{"max_tokens": ' + str(2**64).encode() + b"}", "64-bit"),
    (b'{"stop_token_ids": [1, ' + str(-(2**63) - 1).encode() + b"]}", "64-bit"),
    (b"[[[" + str(2**70).encode() + b"]]]", "64-bit"),
    (b'{"prompt": "a\\ud800b"}', "lone surrogate"),  # no UTF-8 encodes it: neither tokenizer nor wire takes it
    (b'{"messages": [{"\\udfff": "x"}]}', "lone surrogate"),
    (b"{nope", "not valid JSON"),
    (b"\xff\xfe\x00", "not valid JSON"),
])
def test_bodies_past_the_bounds_are_400_not_500(raw, what):
    err = refused(parse_json, raw, 32, cause="invalid_json")
    assert what in err.message and len(err.message) < 400


def request_with(chunks: list[bytes], headers: dict[str, str]) -> tuple[Request, list[int]]:
    """A Starlette request whose body arrives in `chunks`; the returned list counts the chunks read."""
    read = [0]

    async def receive() -> dict:
        i = read[0]
        read[0] += 1
        return {"type": "http.request", "body": chunks[i] if i < len(chunks) else b"",
                "more_body": i + 1 < len(chunks)}

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [(k.encode(), v.encode())
                                                                      for k, v in headers.items()]}
    return Request(scope, receive), read


def test_a_body_is_refused_413_while_it_is_read():
    req, read = request_with([b"x" * 600] * 100, {})  # chunked: no length declared
    with pytest.raises(ApiError) as e:
        asyncio.run(read_body(req, 1000))
    assert e.value.status == 413 and e.value.cause == "body_too_large" and e.value.headers["Connection"] == "close"
    assert read[0] == 2  # no further than the limit
    req, read = request_with([b"x"], {"content-length": str(64 << 20)})
    with pytest.raises(ApiError) as e:
        asyncio.run(read_body(req, 1000))
    assert e.value.status == 413 and read[0] == 0  # refused on its declared length, nothing read
    req, _ = request_with([b"x" * 10] * 3, {"content-length": "30"})
    assert asyncio.run(read_body(req, 1000)) == b"x" * 30
    req, _ = request_with([b""], {"content-length": "-1"})
    with pytest.raises(ApiError) as e:
        asyncio.run(read_body(req, 1000))
    assert e.value.status == 400


# -- requests ---------------------------------------------------------------------------------------------------


def test_n_times_prompts_is_capped():
    ok = parse_completion({"model": "tiny", "prompt": ["a", "b"], "n": 4}, CTX)
    assert len(ok.requests) == 8
    err = refused(parse_completion, {"model": "tiny", "prompt": ["a"] * 3, "n": 3}, CTX, cause="too_many_sequences")
    assert "9 choices" in err.message
    refused(parse_completion, {"model": "tiny", "prompt": ["a"] * 1024, "n": 128}, CTX, cause="too_many_sequences")
    refused(parse_chat, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 9}, CTX,
            cause="too_many_sequences")


def test_prompts_longer_than_the_context_can_hold_are_refused_before_tokenising():
    parse_completion({"model": "tiny", "prompt": "x" * 1000}, CTX)
    refused(parse_completion, {"model": "tiny", "prompt": "x" * 1001}, CTX, cause="prompt_too_long")
    refused(parse_chat, {"model": "tiny", "messages": [{"role": "user", "content": "x" * 600}] * 2}, CTX,
            cause="prompt_too_long")
    refused(parse_tokenize, {"prompt": "x" * 1001}, CTX, cause="prompt_too_long")
    refused(parse_tokenize, {"messages": [{"role": "user", "content": "x" * 1001}]}, CTX, cause="prompt_too_long")


@pytest.mark.parametrize("extra", [
    {"logit_bias": {str(2**64): 1.0}},
    {"logit_bias": {"-1": 1.0}},
    {"logit_bias": {"9" * 5000: 1.0}},
    {"stop_token_ids": [2**63]},
    {"max_tokens": "9" * 5000},
    {"temperature": [[[[[[1]]]]]]},
])
def test_values_the_wire_cannot_carry_are_400_with_short_messages(extra):
    err = refused(parse_completion, {"model": "tiny", "prompt": "hi", **extra}, CTX)
    assert len(err.message) < 300


def test_an_unknown_model_name_is_quoted_short():
    with pytest.raises(ApiError) as e:
        parse_completion({"model": "m" * 10_000, "prompt": "hi"}, CTX)
    assert e.value.status == 404 and len(e.value.message) < 200


# -- producer errors --------------------------------------------------------------------------------------------


class TooLarge(MeshError):
    code = "request_too_large"  # what the client raises before sending an oversized request


@pytest.mark.parametrize("exc, status, code", [
    (ProtocolError("too_large", "prompt over 8 MiB"), 413, "request_too_large"),
    (ProtocolError("bad_field", "max_tokens"), 400, "invalid_request"),
    (OverflowError("int too big to convert"), 400, "invalid_request"),
    (ValueError("Integer value out of range"), 400, "invalid_request"),
    (TooLarge("request_too_large: 3 MiB"), 413, "request_too_large"),
    (RuntimeError("a bug"), 500, "internal"),
])
def test_every_producer_error_maps_to_a_status(exc, status, code):
    err = from_exception(exc)
    assert (err.status, err.code) == (status, code)
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}
    if status in (400, 413):
        assert err.type == "invalid_request_error" and err.cause == "unencodable"


# -- the offload pool -------------------------------------------------------------------------------------------


def test_the_offload_pool_refuses_when_too_much_waits_and_never_a_finished_generation():
    release = threading.Event()

    async def run() -> None:
        pool = Offload(threads=1, max_waiting=2)
        try:
            jobs = [asyncio.ensure_future(pool.run(release.wait)) for _ in range(3)]  # one runs, two wait
            await asyncio.sleep(0)
            with pytest.raises(ApiError) as e:
                await pool.run(lambda: 1)
            assert e.value.status == 503 and e.value.cause == "busy" and "Retry-After" in e.value.headers
            answer = asyncio.ensure_future(pool.run(lambda: 42, refuse_when_busy=False))
            release.set()
            assert await asyncio.gather(*jobs) == [True] * 3
            assert await answer == 42
            assert await pool.run(lambda: 7) == 7  # the count fell back as the jobs ended
        finally:
            release.set()
            pool.close()

    asyncio.run(run())


# -- configuration ----------------------------------------------------------------------------------------------


def test_limits_from_a_topology_table():
    limits = HttpLimits.from_options({"max_body_bytes": 1024.0, "header_timeout_s": 2})
    assert limits.max_body_bytes == 1024 and isinstance(limits.max_body_bytes, int) and limits.header_timeout_s == 2
    for bad, match in (({"max_bodyy": 1}, "unknown key"), ({"max_body_bytes": 1.5}, "whole number"),
                       ({"max_connections": 0}, "positive"), ({"max_sequences": True}, "positive")):
        with pytest.raises(ValueError, match=match):
            HttpLimits.from_options(bad)


@pytest.mark.smollm2
def test_the_gil_releasing_tokenizer_calls_agree_with_the_tokenizer(smollm2_path):
    from deepinfer.gateway.text_work import TextWork
    from deepinfer.text.tokenizer import Tokenizer

    tok = Tokenizer.load(smollm2_path)
    work = TextWork(tok, 8192)
    text = "Hello, world! 123 héllo\n\n  indented <|im_start|> end"
    for special in (True, False):
        assert work.encode(text, special) == tok.encode(text, special)
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    assert work.encode_chat(chat) == tok.encode_chat(chat)
    ids = tok.encode(text)
    assert work.decode(ids) == tok.decode(ids)
    assert work.max_prompt_chars is not None and work.max_prompt_chars >= 8192 * 16
