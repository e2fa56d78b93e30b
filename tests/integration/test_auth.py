"""CURVE on tcp:// endpoints (protocol.auth, launch.keys): keys from `deepinfer-launch keys`, every bound socket
with its own allow-list, routing ids bound to keys. Each forged message of issue 9 — a Heartbeat with a new
incarnation and a Hello on the router's backend, Shutdown to a tokenizer's detokenize socket, KvTransfer to a
decode worker's KV socket, CacheStore to the cache daemon — from a peer without a key and from one with another
role's key is refused and counted, and requests are served as before. Bounded waits only."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import stat
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
import zmq.asyncio
from click.testing import CliRunner

from deepinfer.launch.cli import main
from deepinfer.launch.keys import make_keys, service_auth
from deepinfer.launch.systemd import unit_files
from deepinfer.launch.topology import KvCacheSpec, SecuritySpec, TokenizerSpec, Topology, WorkerSpec
from deepinfer.protocol import messages as m
from deepinfer.protocol.auth import KeyPair, load_client_keys, load_public_key
from deepinfer.protocol.client import AsyncClient, MeshError
from deepinfer.protocol.sockets import send_msg
from deepinfer.services.base import Service
from deepinfer.services.router import RouterService


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tcp_topology(model: str, keys_dir: Path | None) -> Topology:
    ep = lambda: f"tcp://127.0.0.1:{free_port()}"  # noqa: E731
    return Topology(model, ep(), ep(), (TokenizerSpec("tokenizer-0", ep()),),
                    (WorkerSpec("worker-0", "worker", ep(), threads=1, kv_cache_mb=64, kvcache="kvcache-0"),),
                    kvcaches=(KvCacheSpec("kvcache-0", ep(), host_mb=64, disk_mb=64),),
                    security=None if keys_dir is None else SecuritySpec(str(keys_dir)))


async def until(check: Any, timeout_s: float = 30.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


async def refused_once_more(allow: Any, send: Any) -> None:
    """Run `send` (a forgery) and wait, bounded, until `allow` has counted one more refusal."""
    before = allow.refused
    send()
    await until(lambda: allow.refused > before)


def service_keys(keys_dir: Path, name: str) -> KeyPair:
    return KeyPair.load(keys_dir / "services" / f"{name}.key_secret")


class Forger:
    """A peer that sends one message to a secured socket: without a key (`keys` None) or with someone else's."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sockets: list[Any] = []

    def send(self, kind: int, endpoint: str, msg: Any, keys: KeyPair | None = None, server: bytes | None = None,
             identity: str = "forger") -> None:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.DEALER:
            sock.setsockopt(zmq.ROUTING_ID, identity.encode())
        if keys is not None:
            sock.setsockopt(zmq.CURVE_SERVERKEY, server)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
        self.sockets.append(sock)
        sock.connect(endpoint)
        # A PUSH queues nothing before a handshake that never succeeds: then the message cannot even leave.
        with contextlib.suppress(zmq.Again):
            send_msg(sock, msg, flags=zmq.NOBLOCK)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


# -- keys --------------------------------------------------------------------------------------------------------


def test_keys_command_makes_private_key_pairs_per_instance(tmp_path):
    topo_file = tmp_path / "mesh.toml"
    topo_file.write_text(tcp_topology("smollm2", None).to_toml())
    keys = tmp_path / "keys"
    result = CliRunner().invoke(main, ["keys", str(keys), "--topology", str(topo_file)])
    assert result.exit_code == 0, result.output
    names = {p.name for p in (keys / "services").iterdir()}
    for owner in ("router", "tokenizer-0", "worker-0", "kvcache-0", "supervisor"):
        assert {f"{owner}.key", f"{owner}.key_secret"} <= names
    assert stat.S_IMODE(os.stat(keys).st_mode) == 0o700
    for secret in [*keys.glob("services/*.key_secret"), *keys.glob("clients/*.key_secret")]:
        assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    client, router_key = load_client_keys(keys)
    assert router_key == load_public_key(keys / "services" / "router.key")
    assert client.public.decode() in (keys / "clients" / "allowed").read_text()
    # Tenant keys stay apart from service keys: a client key authenticates nothing but the router's front.
    assert client.public not in {load_public_key(p) for p in keys.glob("services/*.key")}
    # Running it again keeps every key (a grown topology only adds some).
    before = (keys / "services" / "router.key_secret").read_text()
    assert CliRunner().invoke(main, ["keys", str(keys), "--topology", str(topo_file)]).exit_code == 0
    assert (keys / "services" / "router.key_secret").read_text() == before
    # A secret file others may read is refused.
    os.chmod(keys / "services" / "router.key_secret", 0o644)
    with pytest.raises(PermissionError):
        KeyPair.load(keys / "services" / "router.key_secret")


def test_topology_security_round_trips_and_is_optional(tmp_path):
    plain = tcp_topology("smollm2", None)
    path = tmp_path / "plain.toml"
    path.write_text(plain.to_toml())
    assert Topology.load(path).security is None
    assert service_auth(plain, "router", "router").keypair is None
    path.write_text(plain.to_toml() + '\n[security]\nkeys_dir = "keys"\n')
    assert Topology.load(path).security == SecuritySpec(str(tmp_path / "keys"))


# -- the router's backend, service level (no model) -----------------------------------------------------------------


class FakeTokenizer(Service):
    role = "tokenizer"


def test_router_backend_refuses_strangers_and_keys_claiming_other_instances(tmp_path):
    keys = tmp_path / "keys"
    topo = tcp_topology("smollm2", keys)
    make_keys(keys, topo)

    async def run() -> None:
        ctx = zmq.asyncio.Context()
        router = RouterService("router", topo.frontend, topo.backend, ctx, auth=service_auth(topo, "router", "router"))
        router_task = asyncio.ensure_future(router.run())
        tok = FakeTokenizer("tokenizer-0", topo.backend, ctx, heartbeat_s=0.1, block_hash_scheme="s",
                            auth=service_auth(topo, "tokenizer", "tokenizer-0"))
        tok_task = asyncio.ensure_future(tok.run())
        await until(lambda: b"tokenizer-0" in router.greeted and router.core.table.get("tokenizer-0").load)
        incarnation = router.core.table.get("tokenizer-0").incarnation
        backend = router.auth.allow["backend"]
        router_key = load_public_key(keys / "services" / "router.key")
        beat = m.Heartbeat("tokenizer", "tokenizer-0", "forged-incarnation", 1, 10**6)
        hello = m.Hello(m.PROTOCOL_VERSION, "tokenizer", "tokenizer-1", None, "s", {"incarnation": "x"})
        client, _ = load_client_keys(keys)
        forger = Forger()
        try:
            other_service = service_keys(keys, "kvcache-0")
            for n, (msg, identity) in enumerate(((beat, "tokenizer-0"), (hello, "tokenizer-1")), start=1):
                send = partial(forger.send, zmq.DEALER, topo.backend, msg)
                await refused_once_more(backend, partial(send, identity=identity))  # no key
                await refused_once_more(backend, partial(send, client, router_key, identity))  # a tenant's key
                # A service's valid key (the cache daemon's) claiming another instance's routing id (one not
                # connected now: libzmq itself drops a second connection under a connected one's, uncounted; so
                # each round claims a name no earlier forger may still be connected under).
                await refused_once_more(backend, partial(send, other_service, router_key, f"tokenizer-{n}"))
            await asyncio.sleep(0.3)  # several of the real tokenizer's heartbeats pass meanwhile
            assert router.core.table.get("tokenizer-0").incarnation == incarnation
            assert b"tokenizer-1" not in router.greeted and "tokenizer-1" not in router.core.table.instances
            assert not tok_task.done()
        finally:
            forger.close()
            tok.stop()
            router.stop()
            await asyncio.gather(tok_task, router_task)
            ctx.term()

    asyncio.run(run())


# -- a whole secured mesh on the real model ---------------------------------------------------------------------------


LANES = [[{"role": "user", "content": f"Name a colour and an animal, number {i}."}] for i in range(3)]
LANE_PARAMS = dict(max_tokens=24, ignore_eos=True)


async def streaming_lanes_through(c: AsyncClient, undisturbed: list[list[int]], during: Any) -> list[int]:
    """Stream each of LANES again and again, from before `during()` starts (each lane has tokens flowing)
    until it has returned: so a request of every lane is in flight throughout. Every request must end with
    the tokens of `undisturbed`, delivered delta by delta without a gap or a repeat. Returns per lane the
    number of requests it completed."""
    flowing = [asyncio.Event() for _ in LANES]
    done = asyncio.Event()
    completed = [0] * len(LANES)

    async def lane(i: int) -> None:
        while True:
            tokens: list[int] = []
            end: Any = None
            async for msg in c.stream(messages=LANES[i], **LANE_PARAMS):
                if isinstance(msg, m.StreamDelta):
                    assert msg.offset == len(tokens), (i, msg.offset, len(tokens))
                    tokens += msg.token_ids
                    flowing[i].set()
                else:
                    end = msg
            assert isinstance(end, m.RequestFinished), (i, end)
            assert end.token_ids == undisturbed[i] and tokens == undisturbed[i], i
            completed[i] += 1
            if done.is_set():  # this request was in flight when `during` returned
                return

    lanes = [asyncio.ensure_future(lane(i)) for i in range(len(LANES))]
    try:
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in flowing)), 120)  # a guard, not a timing
        await during()
        done.set()
        await asyncio.wait_for(asyncio.gather(*lanes), 120)
    finally:
        for t in lanes:
            t.cancel()
    return completed


@pytest.mark.smollm2
def test_secured_mesh_serves_and_refuses_every_forgery(tmp_path, smollm2_path):
    from deepinfer.launch.mesh import InprocMesh

    keys = tmp_path / "keys"
    topo = tcp_topology(str(smollm2_path), keys)
    make_keys(keys, topo)
    client_keys, router_key = load_client_keys(keys)
    question = [{"role": "user", "content": "Name a colour."}]

    async def run() -> None:
        mesh = InprocMesh(topo)
        await mesh.start()
        forger = Forger()
        try:
            async with AsyncClient(topo.frontend, timeout_s=120, curve_keys=client_keys,
                                   server_key=router_key) as c:
                before = await c.generate(messages=question, max_tokens=6)
                undisturbed = [(await c.generate(messages=q, **LANE_PARAMS)).token_ids for q in LANES]
            # A client without a key is not served (its handshake never completes: bounded wait, then give up).
            with pytest.raises((MeshError, TimeoutError)):
                async with AsyncClient(topo.frontend, timeout_s=2, connect_timeout_s=2) as c:
                    await c.generate(messages=question, max_tokens=2)

            router, tok = mesh.service("router"), mesh.service("tokenizer-0")
            worker, daemon = mesh.service("worker-0"), mesh.service("kvcache-0")
            public = {n: load_public_key(keys / "services" / f"{n}.key") for n in ("tokenizer-0", "worker-0",
                                                                                    "kvcache-0", "router")}
            kv = torch.zeros((1, 4), dtype=torch.float32)
            transfer = m.KvTransfer("r-1", "lease", 1, [1, 2, 3], [], m.SamplingParamsWire(), 16, "x", kv,
                                    "tokenizer-0")
            store = m.CacheStore("r-1", "ns", [b"\x00" * 32], kv)
            incarnation = router.core.table.get("worker-0").incarnation
            wrong = service_keys(keys, "kvcache-0")  # a valid key of another role
            cases = [
                (zmq.DEALER, topo.backend, m.Heartbeat("worker", "worker-0", "forged", 1, 10**6), "worker-0",
                 router.auth.allow["backend"], "router", client_keys),
                (zmq.DEALER, topo.backend, m.Hello(m.PROTOCOL_VERSION, "tokenizer", "tokenizer-9"), "tokenizer-9",
                 router.auth.allow["backend"], "router", client_keys),
                (zmq.PUSH, topo.tokenizer("tokenizer-0").detok, m.Shutdown(False, "forged"), "",
                 tok.auth.allow["detok"], "tokenizer-0", wrong),
                (zmq.DEALER, topo.worker("worker-0").kv, transfer, "prefill-0", worker.auth.allow["kv"], "worker-0",
                 wrong),
                (zmq.DEALER, topo.kvcache("kvcache-0").endpoint, store, "worker-0", daemon.auth.allow["cache"],
                 "kvcache-0", service_keys(keys, "tokenizer-0")),
            ]

            async def forge() -> None:
                for kind, endpoint, msg, identity, allow, server, other_key in cases:
                    for keys_used in (None, other_key):
                        server_key = public[server] if keys_used else None
                        await refused_once_more(allow, partial(forger.send, kind, endpoint, msg, keys_used,
                                                               server_key, identity or "forger"))
                # A valid service key (the cache daemon's) on the backend claiming another routing id: refused by
                # the routing-id check (an id not connected now: libzmq drops a duplicate of a connected one
                # uncounted).
                beat = m.Heartbeat("worker", "worker-1", "forged", 1, 10**6)
                await refused_once_more(router.auth.allow["backend"], lambda: forger.send(
                    zmq.DEALER, topo.backend, beat, wrong, public["router"], "worker-1"))

            # Every forgery is sent while requests stream: each lane streams its prompt again and again from
            # before the first forgery until after the last, and every request it ran must equal the undisturbed
            # run, delta by delta.
            async with AsyncClient(topo.frontend, timeout_s=120, curve_keys=client_keys,
                                   server_key=router_key) as c:
                completed = await streaming_lanes_through(c, undisturbed, forge)
            print("requests completed per lane while forging:", completed)
            assert all(n >= 1 for n in completed), completed

            assert router.core.table.get("worker-0").incarnation == incarnation
            assert "tokenizer-9" not in router.core.table.instances
            assert all(not t.done() for t in mesh._tasks)  # no Shutdown got through, nothing crashed
            async with AsyncClient(topo.frontend, timeout_s=120, curve_keys=client_keys,
                                   server_key=router_key) as c:
                after = await c.generate(messages=question, max_tokens=6)
            assert after.token_ids == before.token_ids
        finally:
            forger.close()
            await mesh.stop()

    asyncio.run(run())


def test_up_on_a_secured_topology_serves_clients_with_a_tenant_key_only(tmp_path, smollm2_path):
    """As an operator runs it: `keys`, then `up --topology` with [security] (a process per service, the supervisor's
    exit notes keyed too), then `generate --keys` from another process; a client without keys gets an error."""
    import json
    import signal
    import subprocess
    import sys

    keys, run_dir = tmp_path / "keys", tmp_path / "run"
    topo = tcp_topology(str(smollm2_path), keys)
    topo_file = tmp_path / "mesh.toml"
    topo_file.write_text(topo.to_toml())

    def cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "deepinfer.launch.cli", *args], capture_output=True, text=True,
                              timeout=timeout)

    assert cli("keys", str(keys), "--topology", str(topo_file)).returncode == 0
    up = subprocess.Popen([sys.executable, "-m", "deepinfer.launch.cli", "up", "--topology", str(topo_file),
                           "--run-dir", str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        # Ready means the launcher's own probe got through: on a secured front it must use a tenant key too.
        assert "ready" in up.stdout.readline()
        assert up.stdout.readline().strip() == topo.frontend
        ask = ("generate", "--endpoint", topo.frontend, "--prompt", "The capital of France is", "--max-tokens", "6",
               "--json")
        served = cli(*ask, "--keys", str(keys))
        # No key: the router's CURVE handshake never completes, which looks like a router not up yet (waited for).
        stranger = cli(*ask, "--wait", "10")
        misused = cli("generate", *ask[3:], "--keys", str(keys))  # --keys without a tcp --endpoint
    finally:
        up.send_signal(signal.SIGTERM)
        code = up.wait(timeout=120)
    assert served.returncode == 0, served.stderr
    assert len(json.loads(served.stdout)["token_ids"]) == 6
    assert stranger.returncode == 1 and "give --keys" in stranger.stderr and "Traceback" not in stranger.stderr
    assert misused.returncode == 2 and "--keys secures a tcp://" in misused.stderr
    assert code == 0


def _systemd_credentials(unit_text: str, instance: str, into: Path) -> Path:
    """What systemd does with a unit's LoadCredential= lines for `instance`: copies each file (as root, before
    dropping privileges) into a private directory under its credential id, mode 0400 like systemd's."""
    into.mkdir(mode=0o700)
    for line in unit_text.splitlines():
        if line.startswith("LoadCredential="):
            cred, source = line.removeprefix("LoadCredential=").split(":", 1)
            target = into / cred
            shutil.copyfile(source.replace("%i", instance), target)
            os.chmod(target, 0o400)
    return into


def test_systemd_units_pass_each_service_only_its_own_secret_as_a_credential(tmp_path, monkeypatch):
    topo = tcp_topology("smollm2", tmp_path / "keys")
    make_keys(tmp_path / "keys", topo)
    path = tmp_path / "mesh.toml"
    path.write_text(topo.to_toml())
    files = unit_files(path, Topology.load(path), launcher="/usr/bin/deepinfer-launch")
    for role, instance in (("router", "router"), ("tokenizer", "tokenizer-0"), ("worker", "worker-0"),
                           ("kvcache", "kvcache-0")):
        text = files[f"deepinfer-{role}@.service"]
        secrets = [line for line in text.splitlines() if line.startswith("LoadCredential=key_secret:")]
        assert secrets == [f"LoadCredential=key_secret:{tmp_path / 'keys' / 'services' / '%i.key_secret'}"]
        # No other secret reaches the unit: every other credential is a public key or the tenants' list.
        assert all(line.split(":", 1)[1].endswith((".key", "allowed")) for line in text.splitlines()
                   if line.startswith("LoadCredential=") and line not in secrets)
        creds = _systemd_credentials(text, instance, tmp_path / f"creds-{instance}")
        from_dir = service_auth(topo, role, instance)
        monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
        from_creds = service_auth(topo, role, instance)
        monkeypatch.delenv("CREDENTIALS_DIRECTORY")
        assert from_creds.keypair is not None and from_dir.keypair is not None
        assert from_creds.keypair.public == from_dir.keypair.public
        assert from_creds.keypair.secret == from_dir.keypair.secret
        assert dict(from_creds.server_keys) == dict(from_dir.server_keys)
        assert {k: v.rules for k, v in from_creds.allow.items()} == {k: v.rules for k, v in from_dir.allow.items()}
    assert "LoadCredential=clients.allowed:" in files["deepinfer-router@.service"]
    # Without [security] a unit has no credentials.
    plain = tcp_topology("smollm2", None)
    assert "LoadCredential" not in "".join(unit_files(path, plain, launcher="/usr/bin/deepinfer-launch").values())
