"""The HTTP gateway under attack (issue 30), in front of one real SmolLM2 mesh (a worker, every service in this
process, the router's front on ipc://) that requires API keys, served by uvicorn with the gateway process's
protocol and short deadlines. Each harmful thing happens while innocent SSE streams ("lanes") run again and
again, from before it starts until after it ends; every innocent stream must end with the tokens of the
undisturbed run: a 64 MiB body, 200 slowloris sockets, an HTTP client that stops reading, a 1,024-prompt ×
n=128 POST, deep JSON, 5,000-digit and 2**64 integers, 3 MiB and 9 MiB prompts, a huge /tokenize, rotating
unknown keys. Then: HTTP clients that leave (queued, running, n > 1, non-streamed) free every request,
running sequence and KV block on the worker (read through /metrics); a gateway process told SIGTERM drains;
and generated bodies never get a 5xx or hang."""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from deepinfer import metrics
from deepinfer.gateway.limits import HttpLimits
from deepinfer.gateway.server import load_gateway
from deepinfer.launch.sections import GatewaySpec
from deepinfer.launch.topology import Topology, free_local_ports
from deepinfer.services.router_state import RouterConfig
from tests.integration.http_served import BackgroundGateway, BackgroundMesh, settle
from tests.integration.http_served import sse_text as served_sse_text

pytestmark = pytest.mark.smollm2

MODEL = "smollm2-test"
KEY = "key-a"
AUTH = {"Authorization": f"Bearer {KEY}"}
WAIT_S = 120  # a bound on waiting for what must happen (never asserted as a duration)
# Short deadlines so the slow attacks end within the test; a small send buffer so a client that stops
# reading stalls the gateway's writes after kilobytes, not the kernel's megabytes.
LIMITS = HttpLimits(header_timeout_s=1.0, body_timeout_s=1.0, write_stall_timeout_s=5.0, max_sequences=16,
                    max_stream_backlog=4, send_buffer_bytes=16384)
LANES = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,"]
LANE_BODY = dict(model=MODEL, max_tokens=16, temperature=0, ignore_eos=True, stream=True)
# The test's own requests (lanes and attackers have theirs); idle connections are dropped well before the
# gateway's keep-alive timeout closes them (a request on a connection closing under it would fail).
HTTP = httpx.Client(timeout=WAIT_S, limits=httpx.Limits(keepalive_expiry=1.0))


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    monkeypatch.delenv(metrics.MULTIPROC_ENV, raising=False)  # /metrics shows this process's registry


@pytest.fixture(scope="module")
def hardened(smollm2_path, tmp_path_factory) -> Iterator[tuple[BackgroundMesh, BackgroundGateway]]:
    run_dir = tmp_path_factory.mktemp("gwh")
    topo = Topology.local(str(smollm2_path), "inproc", disaggregated=False, threads=1, kv_cache_mb=64, kvcache=False,
                          max_num_seqs=4)
    topo = dataclasses.replace(topo, frontend=f"ipc://{run_dir}/router-frontend.sock",
                               router=RouterConfig(tenants={KEY: "salt-a"}, require_api_key=True))
    mesh = BackgroundMesh(topo)
    mesh.start()
    gateway = BackgroundGateway(load_gateway(str(smollm2_path), topo.frontend, MODEL, limits=LIMITS,
                                             tenant_keys=frozenset({KEY}), require_api_key=True))
    gateway.start()
    try:
        gateway.wait_ready()
        yield mesh, gateway
    finally:
        gateway.stop()
        mesh.stop()


def sse_text(url: str, body: dict[str, Any], flowing: threading.Event | None = None) -> str:
    return served_sse_text(url, body, AUTH, WAIT_S, flowing)


@pytest.fixture(scope="module")
def undisturbed(hardened) -> list[str]:
    return [sse_text(hardened[1].url, {**LANE_BODY, "prompt": p}) for p in LANES]


class Lanes:
    """Streams each of LANES again and again from before the block's harm starts (each has text flowing)
    until after it ends, so one of every lane is in flight throughout; each must equal the undisturbed run."""

    def __init__(self, url: str, undisturbed: list[str]) -> None:
        self.url, self.undisturbed = url, undisturbed
        self.flowing = [threading.Event() for _ in LANES]
        self.done = threading.Event()
        self.completed = [0] * len(LANES)
        self.failures: list[BaseException] = []
        self.threads = [threading.Thread(target=self._lane, args=(i,), daemon=True) for i in range(len(LANES))]

    def _lane(self, i: int) -> None:
        try:
            while True:
                ending = self.done.is_set()
                assert sse_text(self.url, {**LANE_BODY, "prompt": LANES[i]}, self.flowing[i]) == self.undisturbed[i]
                self.completed[i] += 1
                if ending:  # this one started after the harm ended: every moment of it had a lane in flight
                    return
        except BaseException as exc:  # reported by __exit__
            self.failures.append(exc)
            self.flowing[i].set()

    def __enter__(self) -> Lanes:
        for t in self.threads:
            t.start()
        for f in self.flowing:
            assert f.wait(WAIT_S), "a lane never started"
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        for t in self.threads:
            t.join(WAIT_S * 2)
        if self.failures:
            raise self.failures[0]
        assert not any(t.is_alive() for t in self.threads), "a lane hung"
        assert all(n >= 2 for n in self.completed), self.completed


@pytest.fixture()
def lanes(hardened, undisturbed) -> Lanes:
    return Lanes(hardened[1].url, undisturbed)


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = HTTP.get(url + "/metrics", headers=AUTH).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def refusals(url: str, cause: str) -> float:
    return scrape(url).get(("deepinfer_http_refusals_total", frozenset({("cause", cause)})), 0.0)


def wait_until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=WAIT_S)


def read_all(s: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (ConnectionResetError, BrokenPipeError):
        pass
    return out


def post(url: str, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return HTTP.post(url + path, content=content, headers={"content-type": "application/json", **AUTH,
                                                             **(headers or {})})


def assert_error(r: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code, error
    return error


# -- harm, while the lanes stream -------------------------------------------------------------------------------


def test_a_64_mib_body_is_refused_while_reading(hardened, lanes):
    url = hardened[1].url
    before = refusals(url, "body_too_large")
    with lanes:
        with connect(url) as s:  # declared: refused before a byte of it is read
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer key-a\r\n"
                      b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % (64 << 20))
            reply = read_all(s)
        assert reply.startswith(b"HTTP/1.1 413 ") and b"request_too_large" in reply

        def chunks() -> Iterator[bytes]:  # undeclared (chunked): refused once the limit is passed
            for _ in range(64):
                yield b" " * (1 << 20)

        try:
            r = httpx.post(url + "/v1/completions", content=chunks(), headers=AUTH, timeout=WAIT_S)
            assert r.status_code == 413
        except httpx.TransportError:  # the gateway closed while the rest was still being sent
            pass
    assert refusals(url, "body_too_large") == before + 2
    assert httpx.get(url + "/health").status_code == 200


def test_200_slowloris_sockets_are_cut_off(hardened, lanes):
    url = hardened[1].url
    before = refusals(url, "header_timeout")
    with lanes:
        loris = [connect(url) for _ in range(200)]
        for s in loris:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
            s.setblocking(False)
        answers: dict[socket.socket, bytes] = {}
        deadline = time.monotonic() + WAIT_S
        while len(answers) < len(loris):  # trickle a header byte to each until the gateway answers it
            assert time.monotonic() < deadline, f"{len(loris) - len(answers)} slowloris sockets still held"
            for s in loris:
                if s not in answers:
                    try:
                        s.send(b"x")
                    except OSError:
                        answers[s] = b""
            readable, _, _ = select.select([s for s in loris if s not in answers], [], [], 0.2)
            for s in readable:
                try:
                    answers[s] = s.recv(4096)
                except OSError:
                    answers[s] = b""
        for s in loris:
            s.close()
    assert all(a.startswith(b"HTTP/1.1 408 ") or a == b"" for a in answers.values())
    assert refusals(url, "header_timeout") >= before + 200


def test_an_http_client_that_stops_reading_loses_only_its_own_stream(hardened, lanes):
    mesh, gw = hardened
    url = gw.url
    slow_before, stall_before = refusals(url, "slow_client"), refusals(url, "write_stall")
    prompt = "The quick brown fox jumps over the lazy dog. " * 12  # its echo with logprobs fills the buffers
    body = json.dumps({"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 20, "max_tokens": 2000,
                       "ignore_eos": True, "temperature": 0, "stream": True}).encode()
    with lanes:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        host, port = url.removeprefix("http://").split(":")
        s.connect((host, int(port)))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer key-a\r\n"
                  b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        # It reads nothing: its stream's backlog passes the bound (its request is aborted alone), and the
        # gateway's writes to it stall (its connection is reset).
        wait_until(lambda: refusals(url, "slow_client") > slow_before, "the slow stream was never aborted")
        wait_until(lambda: refusals(url, "write_stall") > stall_before, "the stalled connection was kept")
        read_all(s)  # ends: the connection was reset
        s.close()
    settle(mesh)  # its mesh request is gone too


def test_a_1024_prompt_n_128_post_is_refused_before_the_mesh_sees_it(hardened, lanes):
    mesh, gw = hardened
    with lanes:
        for stream in (False, True):
            r = post(gw.url, "/v1/completions", {"model": MODEL, "prompt": ["hi"] * 1024, "n": 128,
                                                 "max_tokens": 4, "stream": stream})
            assert assert_error(r, 400)["param"] == "n"
            assert mesh.router_inflight() <= len(LANES)
    assert refusals(gw.url, "too_many_sequences") >= 2


def test_deep_json_and_huge_integers_are_400_on_every_path(hardened, lanes):
    url = hardened[1].url
    deep = b'{"model": "' + MODEL.encode() + b'", "prompt": "hi", "stop": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    huge = b'{"model": "%s", "prompt": "hi", "max_tokens": %s}' % (MODEL.encode(), b"9" * 5000)
    with lanes:
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
            assert_error(post(url, path, deep), 400)
            assert_error(post(url, path, huge), 400)
        for stream in (False, True):
            base = {"model": MODEL, "prompt": "hi", "stream": stream}
            for extra in ({"max_tokens": 2**64}, {"max_tokens": 2**63}, {"seed": -(2**63) - 1},
                          {"logit_bias": {str(2**64): 1}}, {"stop_token_ids": [2**63]}, {"n": 2**64 - 1},
                          {"max_tokens": 2**64 - 1}):
                assert_error(post(url, "/v1/completions", {**base, **extra}), 400)
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream,
                    "max_tokens": 2**63}
            assert_error(post(url, "/v1/chat/completions", chat), 400)
    assert refusals(url, "invalid_json") >= 8


def test_3_and_9_mib_prompts_get_their_own_refusals(hardened, lanes):
    url = hardened[1].url
    three = "漢" * (1 << 20)  # 3 MiB of UTF-8: under the body limit, over the router's client limit
    with lanes:
        for stream in (False, True):
            body = json.dumps({"model": MODEL, "prompt": three, "max_tokens": 2, "stream": stream},
                              ensure_ascii=False).encode()
            assert_error(post(url, "/v1/completions", body), 413, "request_too_large")
            nine = {"model": MODEL, "prompt": "x" * (9 << 20), "max_tokens": 2, "stream": stream}
            try:  # refused on its declared length: the gateway may close before all of it was sent
                assert_error(post(url, "/v1/completions", nine), 413, "request_too_large")
            except httpx.TransportError:
                pass
    assert refusals(url, "body_too_large") >= 2


def test_a_huge_tokenize_does_not_stall_the_streams(hardened, lanes):
    url = hardened[1].url
    text = "hello world, this is a long document. " * 15_000  # ~570 k characters, ~135 k tokens
    with lanes:
        r = post(url, "/tokenize", {"prompt": text, "add_special_tokens": False})
        assert r.status_code == 200 and r.json()["count"] > 50_000
        assert post(url, "/detokenize", {"tokens": r.json()["tokens"]}).json()["prompt"] == text


def test_keys_guard_every_route_but_the_probes_and_rotating_keys_get_nowhere(hardened, lanes):
    mesh, gw = hardened
    url = gw.url
    for bad in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic a2V5LWE="}):
        for method, path, body in (("POST", "/v1/completions", {"model": MODEL, "prompt": "hi"}),
                                   ("POST", "/v1/chat/completions", {"model": MODEL, "messages": []}),
                                   ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [1]}),
                                   ("GET", "/metrics", None), ("GET", "/v1/models", None)):
            r = HTTP.request(method, url + path, json=body, headers=bad)
            assert_error(r, 401, "unauthorized")
            assert r.headers["www-authenticate"] == "Bearer"
    for path in ("/health", "/ready"):
        assert httpx.get(url + path).status_code == 200
    for path in ("/metrics", "/v1/models"):
        assert httpx.get(url + path, headers=AUTH).status_code == 200
    before = refusals(url, "unauthorized")
    with lanes:
        def rotate(i: int) -> None:
            with httpx.Client(timeout=WAIT_S) as client:
                for j in range(20):
                    r = client.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                                    headers={"Authorization": f"Bearer stranger-{i}-{j}"})
                    assert r.status_code == 401

        threads = [threading.Thread(target=rotate, args=(i,)) for i in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        assert mesh.router_inflight() <= len(LANES)
    assert refusals(url, "unauthorized") >= before + 200


# -- clients that leave -----------------------------------------------------------------------------------------


def worker_gauges(url: str) -> dict[str, float]:
    snap = scrape(url)
    want = {"deepinfer_num_requests_running", "deepinfer_num_requests_waiting", "deepinfer_kv_blocks_used"}
    out = {name: 0.0 for name in want}
    for (name, labels), value in snap.items():
        if name in want and ("instance", "worker-0") in labels:
            out[name] += value
    return out


def test_clients_that_leave_free_every_request_sequence_and_block(hardened):
    mesh, gw = hardened
    url = gw.url
    settle(mesh)
    long = {"model": MODEL, "prompt": "Count to one thousand:", "max_tokens": 1000, "ignore_eos": True}
    leaving = []
    for i in range(6):  # streams: the worker runs 4 sequences at most, so 2 of these wait
        s = connect(url)
        body = json.dumps({**long, "stream": True, "seed": i}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer key-a\r\n"
                  b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        leaving.append(s)
    for stream in (False, True):  # n > 1, streamed and not
        s = connect(url)
        body = json.dumps({**long, "n": 3, "temperature": 1.0, "stream": stream}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer key-a\r\n"
                  b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        leaving.append(s)
    wait_until(lambda: mesh.router_inflight() == 12, "not every request reached the router")
    wait_until(lambda: (g := worker_gauges(url))["deepinfer_num_requests_running"] == 4
               and g["deepinfer_num_requests_waiting"] >= 1 and g["deepinfer_kv_blocks_used"] > 0,
               "the worker never ran and queued them")
    for s in leaving:
        s.close()
    settle(mesh)
    wait_until(lambda: set(worker_gauges(url).values()) == {0.0}, "the worker still holds sequences or blocks")


# -- draining ---------------------------------------------------------------------------------------------------


def test_sigterm_drains_the_gateway_process(hardened, undisturbed, tmp_path):
    """A real gateway process (the launcher's command) on the mesh: after SIGTERM it answers 503 with
    Retry-After to new generation requests and says not ready, the streams in flight finish with their
    tokens, and it exits once none is left."""
    mesh, _ = hardened
    port = free_local_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    topo = dataclasses.replace(mesh.topology, gateways=(GatewaySpec("gateway-t", f"127.0.0.1:{port}",
                                                                    served_model_name=MODEL),))
    path = tmp_path / "topology.toml"
    path.write_text(topo.to_toml())
    proc = subprocess.Popen([sys.executable, "-m", "deepinfer.launch.cli", "service", "gateway", "--topology",
                             str(path), "--name", "gateway-t"], env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        def ready() -> bool:
            assert proc.poll() is None, "the gateway process exited"
            try:
                return httpx.get(url + "/ready").status_code == 200
            except httpx.TransportError:
                return False

        wait_until(ready, "the gateway process never became ready")
        assert httpx.get(url + "/v1/models").status_code == 401  # the topology's keys are required
        finished: list[str] = []
        flowing = threading.Event()
        lane = threading.Thread(target=lambda: finished.append(sse_text(url, {**LANE_BODY, "prompt": LANES[0]},
                                                                        flowing)))
        lane.start()
        # A stream that holds the drain open until this test lets it go.
        holder = httpx.stream("POST", url + "/v1/completions", headers=AUTH, timeout=WAIT_S,
                              json={**LANE_BODY, "prompt": LANES[1], "max_tokens": 2000})
        held = holder.__enter__()
        assert held.status_code == 200 and next(held.iter_lines()).startswith("data: ")
        assert flowing.wait(WAIT_S)
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: httpx.get(url + "/ready").status_code == 503, "still ready while draining")
        assert httpx.get(url + "/ready").json()["status"] == "draining"
        r = post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert_error(r, 503, "unavailable")
        assert int(r.headers["retry-after"]) >= 1
        lane.join(WAIT_S)
        assert finished == [undisturbed[0]]
        assert proc.poll() is None  # the held stream is still in flight
        holder.__exit__(None, None, None)  # it leaves: nothing is in flight any more
        assert proc.wait(WAIT_S) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT_S)
    settle(mesh)


# -- fuzz -------------------------------------------------------------------------------------------------------

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=12))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                          max_size=3), max_leaves=8)
TEXT = st.text(min_size=1, max_size=40) | st.sampled_from(["\ud800", "a\udfffb"])  # and lone surrogates
IDS = st.lists(st.integers(0, 49_151), min_size=1, max_size=6) | st.lists(st.integers(-5, 2**64), max_size=6)
MESSAGES = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
    "content": TEXT | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": TEXT}),
                               max_size=2) | st.none()}), min_size=1, max_size=3)
SAMPLING = {  # plausible values (weighted over garbage below): a good share of the bodies reach the mesh
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1), "seed": st.integers(-(2**63), 2**64), "stop": TEXT | st.lists(TEXT, max_size=3),
    "stop_token_ids": IDS, "logit_bias": st.dictionaries(st.integers(-2, 2**64).map(str), st.floats(-100, 100),
                                                         max_size=3),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "ignore_eos": st.booleans(), "user": TEXT,
    "n": st.integers(1, 3), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
}
ROUTE_FIELDS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {  # route: (required, optional) fields
    "/v1/completions": ({"model": st.just(MODEL), "prompt": TEXT | st.lists(TEXT, min_size=1, max_size=3) | IDS,
                         "max_tokens": st.integers(0, 3)},
                        {**SAMPLING, "logprobs": st.integers(0, 21), "echo": st.booleans(),
                         "best_of": st.integers(1, 3), "suffix": TEXT}),
    "/v1/chat/completions": ({"model": st.just(MODEL), "messages": MESSAGES, "max_tokens": st.integers(1, 3)},
                             {**SAMPLING, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 21),
                              "max_completion_tokens": st.integers(0, 3),
                              "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json"])}),
                              "tool_choice": st.sampled_from(["none", "auto", "required"])}),
    "/tokenize": ({"prompt": TEXT}, {"model": st.just(MODEL), "add_special_tokens": st.booleans(),
                                     "add_generation_prompt": st.booleans(), "messages": MESSAGES}),
    "/detokenize": ({"tokens": IDS}, {"model": st.just(MODEL)}),
}


def rarely(draw: Any) -> bool:
    """True about one time in eight (hypothesis draws small integers most, so the rare case is the big one)."""
    return draw(st.integers(0, 7)) == 7


def fuzzed(good: Any) -> Any:
    return st.integers(0, 7).flatmap(lambda i: VALUES if i == 7 else good)  # mostly plausible, sometimes anything


def bodies(route: str) -> Any:
    """(route, body): JSON objects whose fields are mostly plausible (a few optional ones at a time), sometimes
    anything, a required one missing or an unknown key; and raw bytes that are no JSON object at all."""
    required, optional = ROUTE_FIELDS[route]
    chosen = st.lists(st.sampled_from(sorted(optional)), max_size=4, unique=True)
    drop = st.sets(st.sampled_from(sorted(required)), max_size=1)
    extra = st.dictionaries(st.sampled_from(["bogus", "max_tokens", "n"]), VALUES, max_size=1)

    @st.composite
    def objects(draw: Any) -> bytes:
        body = {k: draw(fuzzed(v)) for k, v in required.items()}
        body.update({k: draw(fuzzed(optional[k])) for k in draw(chosen)})
        for k in draw(drop) if rarely(draw) else ():
            del body[k]
        if rarely(draw):
            body.update(draw(extra))
        return json.dumps(body).encode()

    return st.tuples(st.just(route), st.one_of(objects(), objects(), objects(), st.binary(max_size=64)))


FUZZ_EXAMPLES = int(os.environ.get("DEEPINFER_FUZZ_EXAMPLES", "80"))  # more for a long hunt


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(case=st.one_of(*(bodies(route) for route in ROUTE_FIELDS)))
def test_generated_bodies_get_no_5xx_and_no_hang(hardened, case):
    route, body = case
    url = hardened[1].url
    with httpx.stream("POST", url + route, content=body, timeout=WAIT_S,
                      headers={"content-type": "application/json", **AUTH}) as r:
        text = r.read().decode()
    event(f"{route} {r.status_code}")  # --hypothesis-show-statistics shows how far the bodies got
    assert r.status_code < 500, (r.status_code, text[:500])
    if r.status_code != 200:
        assert set(json.loads(text)["error"]) == {"message", "type", "param", "code"}
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
        errors = [json.loads(e)["error"] for e in events if e.startswith('{"error"')]
        assert events[-1] == "[DONE]" or len(errors) == 1, text[-500:]
        assert all(e["type"] != "internal_error" for e in errors), errors
    else:
        json.loads(text)
