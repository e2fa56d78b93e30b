"""The soak's valid load: client threads sharing one `deepinfer.Client`, each request's end classified.

Every request the load sends ends in exactly one of these outcomes (`Outcome.kind`):

* ``finished``: it finished; its greedy tokens are compared with the undisturbed answer (`mismatches`).
* ``abandoned``: a stream the client closed after a few tokens (an abort); the tokens it got are compared.
* ``timeout``: a request sent with a deadline too short to meet ended with the router's "timeout" error.
* ``refused:<code>``: the router refused it with a typed, retryable error ("overloaded", "unavailable"):
  the caller was told, nothing hung. Counted apart from finished so a reader sees how often.
* ``lost:<why>``: anything else, which is what the soak must never see: no answer within the client's
  timeout (a hang: ``lost:no_answer``), the connection to the router lost (``lost:router_lost``), or an
  error a valid request should not get under these faults (``lost:worker_lost``, ``lost:internal``,
  ``lost:bad_message``, ``lost:invalid_request``, ...: a death or drain must move the request, not fail it).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from deepinfer import Client, MeshError
from deepinfer.protocol.client_errors import RequestTimeoutError, RouterLostError
from deepinfer.protocol.messages import RequestFinished, StreamDelta

PROMPTS = [list(range(300, 300 + 64)) + [400 + i] * (8 + i % 5) for i in range(24)]  # shared 64-token prefix
REF_TOKENS = 32  # greedy tokens of each prompt's undisturbed answer; longer outputs are compared on these
RETRYABLE = {"overloaded", "unavailable"}  # typed refusals a caller is told to retry: not lost


def undisturbed_answers(client: Client) -> dict[int, list[int]]:
    """Each prompt's greedy answer (REF_TOKENS tokens) on the quiet mesh, before any load or fault."""
    results = client.generate_many([dict(prompt_token_ids=p, max_tokens=REF_TOKENS, ignore_eos=True)
                                    for p in PROMPTS])
    answers = {}
    for i, r in enumerate(results):
        if isinstance(r, MeshError):
            raise SystemExit(f"the undisturbed pass failed on prompt {i}: {r}")
        answers[i] = list(r.token_ids)
    return answers


def classify_error(exc: MeshError, expected: set[str]) -> str:
    """The outcome of a request that raised `exc`; `expected` are the error codes its kind may end with."""
    if isinstance(exc, RequestTimeoutError) and str(exc).startswith("no answer"):
        return "lost:no_answer"  # the client's own timeout: the router never ended it
    if isinstance(exc, RouterLostError):
        return "lost:router_lost"
    if exc.code in expected:
        return exc.code
    if exc.code in RETRYABLE:
        return f"refused:{exc.code}"
    return f"lost:{exc.code}"


@dataclass
class Outcome:
    t: float  # when the request was sent, seconds since the load started
    kind: str  # the mix's kind: stream, generate, abandon, deadline
    outcome: str  # see the module docstring
    ttft_s: float | None = None  # streams: first token's arrival after sending
    detail: str = ""  # for lost requests and mismatches: what happened


class Load:
    """`threads` client threads sharing `client`, each looping over the mix until `stop` is set."""

    MIX = {"stream": 4, "generate": 2, "abandon": 3, "deadline": 1}

    def __init__(self, client: Client, threads: int, seed: int, answers: dict[int, list[int]]) -> None:
        self.client, self.answers, self.stop = client, answers, threading.Event()
        self.records: list[Outcome] = []
        self.tokens = 0  # generated tokens the clients received (for the tokens/s-over-time figure)
        self.mismatches: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.t0 = time.monotonic()
        self.threads = [threading.Thread(target=self._run, args=(seed + i,), daemon=True, name=f"load-{i}")
                        for i in range(threads)]

    def start(self) -> None:
        self.t0 = time.monotonic()
        for t in self.threads:
            t.start()

    def outcomes(self) -> Counter[str]:
        with self.lock:
            return Counter(f"{r.kind}:{r.outcome}" for r in self.records)

    def check_tokens(self, i: int, got: list[int], t: float, what: str) -> bool:
        """`got` agrees with prompt i's undisturbed answer on their common length; a mismatch is recorded."""
        want = self.answers[i]
        n = min(len(got), len(want))
        if got[:n] == want[:n]:
            return True
        with self.lock:
            self.mismatches.append({"t": round(t, 1), "what": what, "prompt": i, "got": got[:n], "want": want[:n]})
        return False

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            i = rng.randrange(len(PROMPTS))
            kind = rng.choices(list(self.MIX), list(self.MIX.values()))[0]
            t = time.monotonic() - self.t0
            rec = Outcome(t, kind, "")
            try:
                if kind == "stream":
                    tokens, rec.ttft_s, finished = self._stream(i, REF_TOKENS, None)
                    rec.outcome = "finished"
                    if finished is not None and finished.token_ids != tokens:
                        rec.outcome, rec.detail = "lost:stream_gap", f"deltas {tokens} != final {finished.token_ids}"
                    elif not self.check_tokens(i, tokens, t, "stream"):
                        rec.detail = "greedy mismatch"
                elif kind == "generate":
                    out = self.client.generate(prompt_token_ids=PROMPTS[i], max_tokens=REF_TOKENS, ignore_eos=True)
                    self._add_tokens(len(out.token_ids))
                    rec.outcome = "finished"
                    if not self.check_tokens(i, list(out.token_ids), t, "generate"):
                        rec.detail = "greedy mismatch"
                elif kind == "abandon":
                    tokens, rec.ttft_s, finished = self._stream(i, 64, rng.randrange(1, 6))
                    rec.outcome = "abandoned" if finished is None else "finished"
                    self.check_tokens(i, tokens, t, "abandoned stream")
                else:
                    self.client.generate(prompt_token_ids=PROMPTS[i], max_tokens=200, ignore_eos=True, timeout_s=0.3)
                    rec.outcome = "finished"
            except MeshError as exc:
                rec.outcome = classify_error(exc, {"timeout"} if kind == "deadline" else set())
                if rec.outcome.startswith(("lost", "refused")):
                    rec.detail = f"{type(exc).__name__} request_id={exc.request_id}: {exc}"
            with self.lock:
                self.records.append(rec)
            if rec.outcome.startswith(("lost", "refused")):
                time.sleep(0.1)

    def _stream(self, i: int, max_tokens: int, stop_after: int | None
                ) -> tuple[list[int], float | None, RequestFinished | None]:
        """A greedy stream of prompt i: (the deltas' tokens, time to the first token, its RequestFinished or
        None when the client stopped reading after `stop_after` deltas, which closes the stream: an abort)."""
        tokens: list[int] = []
        ttft = None
        sent = time.monotonic()
        stream = self.client.stream(prompt_token_ids=PROMPTS[i], max_tokens=max_tokens, ignore_eos=True)
        try:
            for n, msg in enumerate(stream, 1):
                if isinstance(msg, StreamDelta) and msg.token_ids:
                    if ttft is None:
                        ttft = time.monotonic() - sent
                    tokens += msg.token_ids
                    self._add_tokens(len(msg.token_ids))
                if isinstance(msg, RequestFinished):
                    return tokens, ttft, msg
                if stop_after is not None and n >= stop_after:
                    break
        finally:
            stream.close()
        return tokens, ttft, None

    def _add_tokens(self, n: int) -> None:
        with self.lock:
            self.tokens += n
