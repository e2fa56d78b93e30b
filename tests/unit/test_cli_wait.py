"""`generate` and `chat` wait for a mesh that cannot serve yet: requests refused as "unavailable" (never admitted)
are sent again, each in its place, until served or until --wait has passed; other errors are not retried."""

from __future__ import annotations

from typing import Any

import pytest

from deepinfer.launch.cli_generate import generate_all, when_servable
from deepinfer.protocol.client import InvalidRequestError, UnavailableError

HINT_S = 0.01  # the router's retry hint in these scripts: short, so the tests do not sleep long


class ScriptedClient:
    """generate_many answers from a script: per call, the set of prompts refused as unavailable."""

    def __init__(self, refusals: list[set[str]]) -> None:
        self.refusals = refusals
        self.sent: list[list[str]] = []

    def generate_many(self, requests: list[dict[str, Any]]) -> list[Any]:
        prompts = [r["prompt"] for r in requests]
        refused = self.refusals[min(len(self.sent), len(self.refusals) - 1)]
        self.sent.append(prompts)
        return [UnavailableError("unavailable: no live prefill/decode workers", p, HINT_S) if p in refused
                else InvalidRequestError("invalid_request: empty", p) if p == "bad" else f"done {p}"
                for p in prompts]


def test_refused_requests_are_sent_again_in_their_places(capsys):
    client = ScriptedClient([{"a", "b", "c"}, {"b"}, set()])
    out = generate_all(client, [{"prompt": p} for p in ("a", "b", "bad", "c")], 60, "ipc:///x")
    assert out[0] == "done a" and out[1] == "done b" and out[3] == "done c"
    assert isinstance(out[2], InvalidRequestError)  # not retried: it would fail again
    assert client.sent == [["a", "b", "bad", "c"], ["a", "b", "c"], ["b"]]
    assert capsys.readouterr().err.count("waiting up to 60s for the mesh at ipc:///x to serve") == 1


def test_past_the_wait_the_refusal_stays_in_its_place():
    client = ScriptedClient([{"a"}])
    out = generate_all(client, [{"prompt": "a"}, {"prompt": "b"}], 0, "ipc:///x")
    assert isinstance(out[0], UnavailableError) and out[1] == "done b" and len(client.sent) == 1


def test_when_servable_retries_only_unavailable():
    tries: list[int] = []

    def send() -> str:
        tries.append(1)
        if len(tries) < 3:
            raise UnavailableError("unavailable: no live tokenizer", "r", HINT_S)
        return "served"

    assert when_servable(send, 60, "ipc:///x") == "served" and len(tries) == 3

    def invalid() -> str:
        tries.append(1)
        raise InvalidRequestError("invalid_request: no", "r")

    with pytest.raises(InvalidRequestError):
        when_servable(invalid, 60, "ipc:///x")
    assert len(tries) == 4
