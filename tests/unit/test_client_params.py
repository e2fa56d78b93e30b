"""The client's side of protocol version 8: logit_bias and prompt_logprobs pass through build_request, the new
error codes map to their own exceptions, and a per-request api_key overrides the client's."""

from __future__ import annotations

import asyncio
import threading

import pytest
import zmq

import deepinfer
from deepinfer.protocol import messages as m
from deepinfer.protocol.client import (
    AsyncClient,
    Client,
    InvalidRequestError,
    OverloadedError,
    UnauthorizedError,
    UnavailableError,
    build_request,
    error_from_reply,
    logit_bias_pairs,
)
from deepinfer.protocol.framing import decode_frames, encode_frames


def test_logit_bias_and_prompt_logprobs_pass_through_build_request() -> None:
    req = build_request("r", None, None, [1, 2], False, 0, None, None,
                        {"logit_bias": {"17": 5, 3: -100.0}, "prompt_logprobs": 2, "logprobs": 1})
    assert req.params.logit_bias == [(17, 5.0), (3, -100.0)]
    assert (req.params.prompt_logprobs, req.params.logprobs) == (2, 1)
    pairs = build_request("r", "hi", None, None, False, 0, None, None, {"logit_bias": [(4, 1.0)]})
    assert pairs.params.logit_bias == [(4, 1.0)]
    assert build_request("r", "hi", None, None, False, 0, None, None, {"logit_bias": None}).params.logit_bias == []
    encode_frames(req)  # it travels


@pytest.mark.parametrize("bad", [{"x": 1.0}, {True: 1.0}, {"5": "high"}, [(1.5, 2.0)]])
def test_logit_bias_keys_must_be_token_ids(bad: object) -> None:
    with pytest.raises(ValueError):
        logit_bias_pairs(bad)  # type: ignore[arg-type]


def test_new_error_codes_have_their_own_exceptions() -> None:
    cases = {"unauthorized": UnauthorizedError, "unavailable": UnavailableError, "overloaded": OverloadedError,
             "invalid_request": InvalidRequestError}
    for code, cls in cases.items():
        err = error_from_reply(m.ErrorReply("r1", code, "why", 2.0))
        assert type(err) is cls and err.code == code and err.request_id == "r1" and err.retry_after_s == 2.0
    assert deepinfer.UnauthorizedError is UnauthorizedError and deepinfer.UnavailableError is UnavailableError


def _fake_router(ctx: zmq.Context, endpoint: str, seen: list[m.GenerateRequest], n: int) -> None:
    """Answers the Hello, then records `n` requests and refuses each as unauthorized."""
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    try:
        while len(seen) < n:
            ident, *frames = sock.recv_multipart()
            msg = decode_frames(frames)
            if isinstance(msg, m.Hello):
                sock.send_multipart([ident, *encode_frames(m.Welcome(m.PROTOCOL_VERSION, True))])
            elif isinstance(msg, m.GenerateRequest):
                seen.append(msg)
                sock.send_multipart([ident, *encode_frames(m.ErrorReply(msg.request_id, "unauthorized", "no"))])
    finally:
        # It closes right after its last answer (the client must take an answer that came before the drop), but
        # only once that answer has left: linger without limit (ctx.term() waits for it; a client that went away
        # first has no pipe left, so nothing waits for it).
        sock.close(linger=-1)


def test_per_request_api_key_overrides_the_clients(tmp_path) -> None:
    endpoint = f"ipc://{tmp_path}/router.sock"
    ctx = zmq.Context()
    seen: list[m.GenerateRequest] = []
    thread = threading.Thread(target=_fake_router, args=(ctx, endpoint, seen, 4), daemon=True)
    thread.start()
    try:
        with Client(endpoint, timeout_s=10, api_key="own") as c:
            with pytest.raises(UnauthorizedError):
                c.generate("hi", api_key="tenant-b")
            with pytest.raises(UnauthorizedError):
                list(c.stream("hi"))

        async def run() -> None:
            async with AsyncClient(endpoint, timeout_s=10, api_key="own") as ac:
                with pytest.raises(UnauthorizedError):
                    await ac.generate("hi")
                with pytest.raises(UnauthorizedError):
                    async for _ in ac.stream("hi", api_key="tenant-c"):
                        pass

        asyncio.run(run())
        thread.join(timeout=10)
        assert [r.api_key for r in seen] == ["tenant-b", "own", "own", "tenant-c"]
    finally:
        ctx.term()
