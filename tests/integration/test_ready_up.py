"""`deepinfer-launch up --http` as a load balancer and a newcomer's first command meet it (issue 38): real processes,
the worker slowed at its start (held at interpreter start-up until the test opens a gate, by a `sitecustomize`
on the children's PYTHONPATH: no knob in the product). While the router answers but the worker is not up, the
gateway's /ready says 503 and why, a request sent then is indeed refused, and `generate --endpoint` started then
waits instead of failing. Once the gate opens, the first request after the first 200 of /ready is served (no
503), and so is `generate`'s. Nothing asserts on wall time; every wait is bounded only so that a regression fails
instead of hanging."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from deepinfer.launch.topology import free_local_ports

WAIT_S = 300.0
GATE_ENV = "DEEPINFER_TEST_WORKER_GATE"
# Runs first in every child Python: a worker service waits for the gate file before it imports anything.
SITECUSTOMIZE = f"""
import os, sys, time
gate = os.environ.get({GATE_ENV!r})
if gate and sys.argv[1:3] == ["service", "worker"]:
    while not os.path.exists(gate):
        time.sleep(0.05)
"""
CHAT = {"model": "", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}


def until(condition, what: str, proc: subprocess.Popen) -> None:  # type: ignore[no-untyped-def,type-arg]
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert proc.poll() is None, f"`up` exited ({proc.returncode}) while waiting for {what}"
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


def get_ready(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url + "/ready", timeout=30)
    except httpx.TransportError:  # the gateway is not listening yet
        return None


@pytest.mark.smollm2
def test_ready_means_served_with_a_worker_slow_to_start(smollm2_path, tmp_path):
    site, gate, run_dir = tmp_path / "site", tmp_path / "gate", tmp_path / "run"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, GATE_ENV: str(gate),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    port = free_local_ports(1)[0]
    url, frontend = f"http://127.0.0.1:{port}", f"ipc://{run_dir}/router-frontend.sock"
    stderr = open(tmp_path / "up.err", "w")
    up = subprocess.Popen(
        [sys.executable, "-m", "deepinfer.launch.cli", "up", "--model", str(smollm2_path), "--threads", "1",
         "--kv-cache-mb", "64", "--no-kvcache", "--run-dir", str(run_dir), "--http", f"127.0.0.1:{port}"],
        stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    generate = None
    try:
        # The router answers the gateway's question, and says what a request would miss: the worker.
        seen: list[httpx.Response] = []
        until(lambda: (r := get_ready(url)) is not None and seen.append(r) is None and "reason" in r.json(),
              "the gateway relaying the router's answer", up)
        assert seen[-1].status_code == 503
        assert seen[-1].json() == {"status": "not ready", "reason": "no live prefill/decode workers"}
        assert httpx.get(url + "/health").status_code == 200  # the process is up all the same
        refused = httpx.post(url + "/v1/chat/completions", json={**CHAT, "model": str(smollm2_path)}, timeout=60)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "unavailable"
        # A newcomer's command against the fresh mesh: it waits rather than failing.
        generate_err = tmp_path / "generate.err"
        with open(generate_err, "w") as err_file:
            generate = subprocess.Popen(
                [sys.executable, "-m", "deepinfer.launch.cli", "generate", "--endpoint", frontend, "--chat",
                 "--max-tokens", "8", "--prompt", "What is the capital of France?"],
                stdout=subprocess.PIPE, stderr=err_file, text=True)
        until(lambda: "waiting up to" in generate_err.read_text() or generate.poll() is not None,
              "generate finding the mesh unable to serve yet", up)
        assert generate.poll() is None, generate_err.read_text()  # it waits
        gate.touch()  # the worker starts now

        def ready() -> bool:
            r = get_ready(url)
            if r is not None and r.status_code == 503:
                assert r.json()["status"] == "not ready"
            return r is not None and r.status_code == 200

        until(ready, "/ready saying 200", up)
        # The first request after the first 200 is served, and so are a few at once.
        served = httpx.post(url + "/v1/chat/completions", json={**CHAT, "model": str(smollm2_path)}, timeout=120)
        assert served.status_code == 200, served.text
        assert "Paris" in served.json()["choices"][0]["message"]["content"]
        out, _ = generate.communicate(timeout=WAIT_S)
        assert generate.returncode == 0, generate_err.read_text()
        assert "Paris" in out
        # `up` announced the mesh once it could serve: its lines, then the gateway's URL.
        first = up.stdout.readline()
        assert "ready" in first and up.stdout.readline().strip() == frontend
        assert up.stdout.readline().strip() == f"OpenAI-compatible HTTP API: {url}/v1"
    finally:
        gate.touch()
        if generate is not None and generate.poll() is None:
            generate.kill()
            generate.wait()
        up.send_signal(signal.SIGTERM)
        code = up.wait(timeout=120)
        stderr.close()
    assert code == 0
    said = [line for line in (tmp_path / "up.err").read_text().splitlines() if line.startswith("layout: ")]
    assert len(said) == 1 and said[0].startswith("layout: 1 co-located worker, 1 thread each: "), said
