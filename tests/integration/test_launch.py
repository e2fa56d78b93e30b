"""The launcher: topology files, systemd units, `deepinfer-launch up` as a user runs it."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from deepinfer.launch.systemd import unit_files, write_units
from deepinfer.launch.topology import BalancerConfig, Topology, TopologyError
from deepinfer.protocol.client import Client
from deepinfer.services.base import DRAIN_TIMEOUT_S


def test_topology_round_trips_through_toml(tmp_path):
    topo = Topology.local("smollm2", "ipc", tmp_path, num_prefill=2, num_decode=1, num_tokenizers=2, threads=1)
    path = tmp_path / "t.toml"
    path.write_text(topo.to_toml())
    assert Topology.load(path) == topo
    assert [w.role for w in topo.workers] == ["prefill", "prefill", "decode"]


def test_multi_host_topology_with_tcp_endpoints(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text("""
model = "smollm2"
[router]
frontend = "tcp://10.0.0.1:5550"
backend = "tcp://10.0.0.1:5551"
heartbeat_timeout_s = 3.0
[[tokenizer]]
name = "tok-a"
detok = "tcp://10.0.0.1:5560"
[[worker]]
name = "p0"
role = "prefill"
kv = "tcp://10.0.0.2:5570"
[[worker]]
name = "d0"
role = "decode"
kv = "tcp://10.0.0.3:5570"
threads = 8
kvcache = "kv-b"
[[kvcache]]
name = "kv-b"
endpoint = "tcp://10.0.0.3:5580"
dir = "/mnt/nvme/kv"
disk_mb = 100000
""")
    topo = Topology.load(path)
    assert topo.router.heartbeat_timeout_s == 3.0 and topo.router.block_size == topo.block_size
    assert topo.worker("d0").threads == 8 and topo.tokenizer("tok-a").detok.startswith("tcp://")
    assert topo.worker("d0").kvcache == "kv-b" and topo.worker("p0").kvcache is None
    assert topo.kvcache("kv-b").dir == "/mnt/nvme/kv" and topo.kvcache("kv-b").disk_mb == 100000
    assert topo.block_size == 16


@pytest.mark.parametrize("text, match", [
    ('[router]\nfrontend="a"\nbackend="b"\n', "tokenizer"),
    ('[router]\nfrontend="a"\nbackend="b"\n[[tokenizer]]\nname="t"\ndetok="x"\n', "worker"),
    ('[[tokenizer]]\nname="t"\ndetok="x"\n', "malformed"),
    ('[router]\nfrontend="a"\nbackend="b"\n[[tokenizer]]\nname="t"\ndetok="x"\n'
     '[[worker]]\nname="w"\nrole="worker"\nkv="k"\nkvcache="nope"\n', "no kvcache named 'nope'"),
])
def test_bad_topologies_are_refused_with_a_reason(tmp_path, text, match):
    path = tmp_path / "t.toml"
    path.write_text(text)
    with pytest.raises(TopologyError, match=match):
        Topology.load(path)


SPEC_TOPOLOGY = """
model = "smollm2"
[router]
frontend = "tcp://10.0.0.1:5550"
backend = "tcp://10.0.0.1:5551"
[[tokenizer]]
name = "tok-a"
detok = "tcp://10.0.0.1:5560"
[[worker]]
name = "p0"
role = "prefill"
kv = "tcp://10.0.0.2:5570"
[[worker]]
name = "d0"
role = "decode"
kv = "tcp://10.0.0.3:5570"
"""


def test_topology_speculation_keys_reach_the_engine_config(tmp_path):
    from deepinfer.launch.mesh import engine_config

    path = tmp_path / "t.toml"
    path.write_text(SPEC_TOPOLOGY + 'speculative = "draft:/models/small"\nnum_speculative_tokens = 6\n'
                    "adaptive_speculation = false\n")
    topo = Topology.load(path)
    d0, p0 = topo.worker("d0"), topo.worker("p0")
    assert (d0.speculative, d0.num_speculative_tokens, d0.adaptive_speculation) == ("draft:/models/small", 6, False)
    assert (p0.speculative, p0.num_speculative_tokens, p0.adaptive_speculation) == (None, 4, True)
    config = engine_config(d0)
    assert (config.speculative, config.num_speculative_tokens, config.adaptive_speculation) == (
        "draft:/models/small", 6, False)
    assert engine_config(p0).speculative is None
    again = tmp_path / "again.toml"
    again.write_text(topo.to_toml())
    assert Topology.load(again) == topo


@pytest.mark.parametrize("colocated", [False, True])
def test_local_topology_speculates_where_decoding_happens(tmp_path, colocated):
    topo = Topology.local("smollm2", "ipc", tmp_path, disaggregated=not colocated, speculative="self:8",
                          num_speculative_tokens=3, adaptive_speculation=False)
    spec = {w.role: (w.speculative, w.num_speculative_tokens, w.adaptive_speculation) for w in topo.workers}
    if colocated:
        assert spec == {"worker": ("self:8", 3, False)}
    else:  # a prefill worker stops after the first token: nothing to speculate on
        assert spec == {"prefill": (None, 4, True), "decode": ("self:8", 3, False)}
    path = tmp_path / "t.toml"
    path.write_text(topo.to_toml())
    assert Topology.load(path) == topo


@pytest.mark.parametrize("keys, match", [
    ('speculative = "foo"', "worker d0: speculative = 'foo': unknown speculative method"),
    ('speculative = "self:0"', "worker d0: speculative = 'self:0': self-draft needs a positive layer count"),
    ('speculative = "ngram:3"', "takes no argument"),
    ('speculative = "draft:"', "needs a path"),
    ("speculative = 4", "worker d0: speculative = 4: must be a string"),
    ("num_speculative_tokens = 0", r"worker d0: num_speculative_tokens = 0: must be an integer in \[1, 32\]"),
    ("num_speculative_tokens = 33", "num_speculative_tokens = 33"),
    ('num_speculative_tokens = "4"', "num_speculative_tokens = '4'"),
    ("num_speculative_tokens = true", "num_speculative_tokens = True"),
    ('adaptive_speculation = "yes"', "worker d0: adaptive_speculation = 'yes': must be true or false"),
])
def test_bad_speculation_keys_are_refused_naming_the_key(tmp_path, keys, match):
    path = tmp_path / "t.toml"
    path.write_text(SPEC_TOPOLOGY + keys + "\n")
    with pytest.raises(TopologyError, match=match):
        Topology.load(path)


def launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepinfer.launch.cli", *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("command", ["up", "generate", "chat"])
def test_speculation_options_are_offered(command):
    out = launch(command, "--help")
    assert out.returncode == 0, out.stderr
    for option in ("--speculative METHOD", "--num-speculative-tokens", "--no-adaptive-speculation"):
        assert option in out.stdout
    assert "ngram" in out.stdout and "draft:PATH" in out.stdout


@pytest.mark.parametrize("args, message", [
    (["up", "--speculative", "foo"], "Invalid value for '--speculative': unknown speculative method 'foo'"),
    (["up", "--speculative", "self:x"], "self-draft needs a positive layer count"),
    (["up", "--num-speculative-tokens", "0"], "--num-speculative-tokens"),
    (["up", "--topology", "{topology}", "--speculative", "ngram"], "set `speculative` per worker in the file"),
])
def test_bad_speculation_options_fail_before_anything_starts(tmp_path, args, message):
    path = tmp_path / "t.toml"
    path.write_text(SPEC_TOPOLOGY)
    out = launch(*(a.format(topology=path) for a in args), "--run-dir", str(tmp_path / "run"))
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()  # refused while parsing: no mesh, no run directory


def test_systemd_units(tmp_path):
    # With a [balancer] table: its unit is checked (hardened, verified) like the others.
    topo = Topology.local("smollm2", "ipc", tmp_path, balancer=BalancerConfig())
    path = tmp_path / "topology.toml"
    path.write_text(topo.to_toml())
    files = unit_files(path, topo, launcher="/usr/bin/deepinfer-launch")
    assert set(files) == {"deepinfer.target", "deepinfer-router@.service", "deepinfer-tokenizer@.service",
                          "deepinfer-worker@.service", "deepinfer-kvcache@.service", "deepinfer-balancer@.service"}
    target = files["deepinfer.target"]
    for name in ("deepinfer-router@router.service", "deepinfer-tokenizer@tokenizer-0.service",
                 "deepinfer-worker@prefill-0.service", "deepinfer-worker@decode-0.service",
                 "deepinfer-kvcache@kvcache-0.service", "deepinfer-balancer@balancer.service"):
        assert name in target
    balancer = files["deepinfer-balancer@.service"]
    assert "service balancer --topology" in balancer and "--name %i" in balancer
    assert "Restart=on-failure" in balancer and "PrivateDevices=yes" in balancer  # it plans; no GPU
    worker = files["deepinfer-worker@.service"]
    assert "service worker --topology" in worker and "--name %i" in worker and "Restart=on-failure" in worker
    for name, text in files.items():
        if name.endswith(".service"):
            assert_hardened(text)
    assert "PrivateDevices=yes" not in worker  # a worker may drive a GPU
    assert "PrivateDevices=yes" in files["deepinfer-router@.service"]
    out = tmp_path / "units"
    write_units(path, out)
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed: unit files were written but not verified")
    # verify needs concrete instances of the templates next to them
    for inst, template in (("deepinfer-router@router.service", "deepinfer-router@.service"),
                           ("deepinfer-worker@prefill-0.service", "deepinfer-worker@.service"),
                           ("deepinfer-tokenizer@tokenizer-0.service", "deepinfer-tokenizer@.service"),
                           ("deepinfer-kvcache@kvcache-0.service", "deepinfer-kvcache@.service"),
                           ("deepinfer-balancer@balancer.service", "deepinfer-balancer@.service")):
        shutil.copy(out / template, out / inst)
    res = subprocess.run(["systemd-analyze", "verify", "--man=no", *(str(p) for p in sorted(out.iterdir()))],
                         capture_output=True, text=True)
    problems = [line for line in res.stderr.splitlines() if "deepinfer" in line]
    assert res.returncode == 0 and not problems, res.stderr


def unit_settings(text: str) -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            settings.setdefault(key, []).append(value)
    return settings


def assert_hardened(text: str, user: str = "deepinfer") -> None:
    s = unit_settings(text)
    assert s["User"] == [user]
    assert int(s["TimeoutStopSec"][0]) > DRAIN_TIMEOUT_S  # a drain ends before systemd kills
    for key, value in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "PrivateTmp": "yes",
                       "RuntimeDirectory": "deepinfer", "RuntimeDirectoryMode": "0700",
                       "CacheDirectory": "deepinfer", "UMask": "0077", "RestrictSUIDSGID": "yes"}.items():
        assert s[key] == [value], key
    assert s["ProtectHome"][0] in ("yes", "read-only")
    assert "DEEPINFER_CACHE_DIR=%C/deepinfer" in s["Environment"]  # model, kernels, KV disk tier: writable


def test_systemd_units_run_as_the_given_user_and_may_write_what_the_topology_names(tmp_path):
    path = tmp_path / "topology.toml"
    path.write_text(SPEC_TOPOLOGY.replace("tcp://10.0.0.1:5550", "ipc:///run/deepinfer/front.sock")
                    + '[[kvcache]]\nname = "kv"\nendpoint = "tcp://10.0.0.3:5580"\ndir = "/srv/kv"\n')
    files = unit_files(path, Topology.load(path), launcher="/usr/bin/deepinfer-launch", user="llm")
    for name, text in files.items():
        if name.endswith(".service"):
            assert_hardened(text, user="llm")
            assert unit_settings(text)["ReadWritePaths"] == ["-/run/deepinfer", "-/srv/kv"]
            assert unit_settings(text)["ProtectHome"] == ["yes"]
    home = tmp_path / "home.toml"
    home.write_text(SPEC_TOPOLOGY.replace('model = "smollm2"', 'model = "/home/alice/models/m"'))
    router = unit_files(home, Topology.load(home), launcher="/usr/bin/deepinfer-launch")["deepinfer-router@.service"]
    assert unit_settings(router)["ProtectHome"] == ["read-only"]  # the model stays readable


@pytest.mark.smollm2
def test_up_serves_then_drains_on_sigterm(smollm2_path, tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "deepinfer.launch.cli", "up", "--model", str(smollm2_path), "--threads", "1",
         "--kv-cache-mb", "64", "--run-dir", str(tmp_path), "--prefill", "1", "--decode", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    in_flight: list[object] = []
    try:
        first = proc.stdout.readline()
        assert "ready" in first, first
        endpoint = proc.stdout.readline().strip()
        assert endpoint == f"ipc://{tmp_path}/router-frontend.sock"
        with Client(endpoint, timeout_s=60) as c:
            r = c.generate(messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=12)
        assert "Paris" in r.text
        children = subprocess.run(["pgrep", "-f", "--", f"--topology {tmp_path}/topology.toml"], capture_output=True,
                                  text=True).stdout.split()
        assert len(children) == 5  # router, tokenizer, prefill, decode, kvcache

        def long_request() -> None:
            with Client(endpoint, timeout_s=120) as c2:
                in_flight.append(c2.generate(prompt="Count to 100:", max_tokens=60, ignore_eos=True))

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(1.0)  # admitted and decoding
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    t.join(timeout=60)
    # Draining: the request admitted before SIGTERM still completes, then everything exits.
    assert len(in_flight) == 1 and len(in_flight[0].token_ids) == 60
    assert code == 0
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", "--", f"--topology {tmp_path}/topology.toml"], capture_output=True, text=True)
    assert left.stdout.split() == []
    assert (Path(tmp_path) / "router.log").exists()


@pytest.mark.smollm2
def test_chat_streams_answers_and_keeps_history(smollm2_path):
    res = subprocess.run(
        [sys.executable, "-m", "deepinfer.launch.cli", "chat", "--model", str(smollm2_path), "--max-tokens", "24"],
        input="What is the capital of France?\nAnd of Italy?\n\n", capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    answers = [a.strip() for a in res.stdout.split("> ")[1:3]]
    assert "Paris" in answers[0] and answers[1]  # two turns answered (the second sees the first in its history)


@pytest.mark.smollm2
def test_up_inproc_serves_on_an_ipc_front(smollm2_path, tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "deepinfer.launch.cli", "up", "--inproc", "--model", str(smollm2_path),
         "--threads", "1", "--kv-cache-mb", "64", "--run-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert "ready" in proc.stdout.readline()
        endpoint = proc.stdout.readline().strip()
        with Client(endpoint, timeout_s=60) as c:
            r = c.generate(prompt_token_ids=[1, 2, 3], max_tokens=6, ignore_eos=True)
        assert len(r.token_ids) == 6
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


# -- the HTTP gateway role -------------------------------------------------------------------------------------


def test_systemd_units_of_a_gateway_and_every_unit_shares_the_metrics_dir(tmp_path):
    topo = Topology.local("smollm2", "ipc", tmp_path, http="0.0.0.0:8000")
    path = tmp_path / "topology.toml"
    path.write_text(topo.to_toml())
    files = unit_files(path, topo, launcher="/usr/bin/deepinfer-launch")
    gateway = files["deepinfer-gateway@.service"]
    assert "service gateway --topology" in gateway and "--name %i" in gateway
    assert "After=network-online.target deepinfer-router@router.service" in gateway
    assert "deepinfer-gateway@gateway-0.service" in files["deepinfer.target"]
    assert "PrivateDevices=yes" in gateway  # it needs no device
    for name, text in files.items():
        if name.endswith(".service"):
            assert_hardened(text)
            assert "PROMETHEUS_MULTIPROC_DIR=/run/deepinfer/metrics" in unit_settings(text)["Environment"]
    assert "deepinfer-gateway@.service" not in unit_files(path, Topology.local("smollm2", "ipc", tmp_path))


def test_keys_give_every_gateway_a_tenant_key(tmp_path):
    from deepinfer.launch.keys import gateway_client_keys, make_keys
    from deepinfer.launch.topology import SecuritySpec

    topo = Topology.local("smollm2", "ipc", tmp_path, http="127.0.0.1:8000")
    make_keys(tmp_path / "keys", topo)
    allowed = (tmp_path / "keys" / "clients" / "allowed").read_text()
    assert (tmp_path / "keys" / "clients" / "gateway-0.key_secret").exists() and "gateway-0" in allowed
    assert gateway_client_keys(topo, "gateway-0") == {}  # no [security]: nothing to present
    secured = dataclasses.replace(topo, frontend="tcp://127.0.0.1:5550", security=SecuritySpec(str(tmp_path / "keys")))
    keys = gateway_client_keys(secured, "gateway-0")
    assert keys["curve_keys"].public.decode() in allowed and keys["server_key"]


@pytest.mark.parametrize("args, message", [
    (["up", "--http", "8000"], "Invalid value for '--http': must be host:port"),
    (["up", "--http", "127.0.0.1:8000", "--inproc"], "drop --inproc"),
    (["up", "--topology", "{topology}", "--http", "127.0.0.1:8000"], "add a [[gateway]] table"),
    (["service", "gateway", "--topology", "{topology}", "--name", "nope"], "no gateway named 'nope'"),
])
def test_bad_gateway_options_fail_before_anything_starts(tmp_path, args, message):
    topology = tmp_path / "t.toml"
    topology.write_text(Topology.local("smollm2", "ipc", tmp_path).to_toml())
    res = subprocess.run([sys.executable, "-m", "deepinfer.launch.cli", *(a.format(topology=topology) for a in args)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and message in res.stderr, res.stderr


@pytest.mark.smollm2
def test_up_with_http_serves_the_openai_sdk(smollm2_path, tmp_path):
    import httpx
    import openai

    from deepinfer.launch.topology import free_local_ports

    port = free_local_ports(1)[0]
    proc = subprocess.Popen(
        [sys.executable, "-m", "deepinfer.launch.cli", "up", "--model", str(smollm2_path), "--threads", "1",
         "--kv-cache-mb", "64", "--run-dir", str(tmp_path), "--colocated", "--no-kvcache",
         "--http", f"127.0.0.1:{port}"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert "ready" in proc.stdout.readline()
        assert proc.stdout.readline().strip() == f"ipc://{tmp_path}/router-frontend.sock"
        url = proc.stdout.readline().strip().rpartition(" ")[2]
        assert url == f"http://127.0.0.1:{port}/v1"
        sdk = openai.OpenAI(base_url=url, api_key="EMPTY", max_retries=0, timeout=120)
        r = sdk.chat.completions.create(model=str(smollm2_path), max_tokens=12, temperature=0,
                                        messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in r.choices[0].message.content
        assert [m.id for m in sdk.models.list()] == [str(smollm2_path)]
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'deepinfer_http_requests_total{endpoint="/v1/chat/completions",status="200"}' in metrics
        children = subprocess.run(["pgrep", "-f", "--", f"--topology {tmp_path}/topology.toml"], capture_output=True,
                                  text=True).stdout.split()
        assert len(children) == 4  # router, tokenizer, worker, gateway
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    assert code == 0
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", "--", f"--topology {tmp_path}/topology.toml"], capture_output=True, text=True)
    assert left.stdout.split() == []
    assert (tmp_path / "gateway-0.log").exists()


def test_the_standalone_metrics_exporter_serves_the_host_s_samples(tmp_path):
    import httpx

    from deepinfer.launch.topology import free_local_ports

    port = free_local_ports(1)[0]
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    writer = ("from deepinfer.metrics import record_http_request; record_http_request('/v1/models', 200, 0.01)")
    subprocess.run([sys.executable, "-c", writer], env=env, check=True, timeout=120)  # a process that exited
    proc = subprocess.Popen([sys.executable, "-m", "deepinfer.launch.cli", "metrics", "--listen", f"127.0.0.1:{port}",
                             "--dir", str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == f"metrics on http://127.0.0.1:{port}/metrics"
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'deepinfer_http_requests_total{endpoint="/v1/models",status="200"} 1.0' in text
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


@pytest.mark.smollm2
def test_a_gateway_reaches_a_secured_router_with_its_own_tenant_key(smollm2_path, tmp_path):
    """`keys` gives the [[gateway]] its tenant key pair; `up --topology` with [security] runs it, and the openai
    SDK is served through it over CURVE (the router's front takes listed keys only)."""
    import openai

    from deepinfer.launch.topology import GatewaySpec, free_local_ports
    from tests.integration.test_auth import tcp_topology

    keys, port = tmp_path / "keys", free_local_ports(1)[0]
    topo = dataclasses.replace(tcp_topology(str(smollm2_path), keys),
                               gateways=(GatewaySpec("gw", f"127.0.0.1:{port}", served_model_name="smol"),))
    path = tmp_path / "mesh.toml"
    path.write_text(topo.to_toml())
    cli = [sys.executable, "-m", "deepinfer.launch.cli"]
    assert subprocess.run([*cli, "keys", str(keys), "--topology", str(path)], capture_output=True).returncode == 0
    up = subprocess.Popen([*cli, "up", "--topology", str(path), "--run-dir", str(tmp_path / "run")],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert "ready" in up.stdout.readline()  # the gateway's /ready included: it holds a CURVE connection
        assert up.stdout.readline().strip() == topo.frontend
        assert up.stdout.readline().strip().endswith(f"http://127.0.0.1:{port}/v1")
        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="EMPTY", max_retries=0, timeout=120)
        r = sdk.completions.create(model="smol", prompt="The capital of France is", max_tokens=6, temperature=0)
        assert r.usage.completion_tokens == 6
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=120) == 0
