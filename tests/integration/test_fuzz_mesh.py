"""10^5 random frames at every socket of a live mesh (real processes over ipc://, as `up` runs it): no
service crashes or restarts, none grows without bound, and afterwards the mesh answers exactly as before.

What is sent: random multipart messages (random bytes; a real type byte with a random body; a real type
byte with well-formed msgpack of the wrong shape; empty frames), from DEALERs and a PUSH with random
identities, to the router's front and back, a tokenizer's detokenize PULL, a decode worker's KV socket and
the cache daemon. Nothing reads the replies (the router must then treat the fuzzer as a slow client)."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from deepinfer.launch.topology import Topology
from deepinfer.protocol.client import Client
from deepinfer.protocol.records import registered_messages
from tests.integration.supervised import supervised_mesh

pytestmark = pytest.mark.smollm2

FRAMES = int(os.environ.get("DEEPINFER_MESH_FUZZ_FRAMES", "100000"))
PROMPT = list(range(200, 230))
RSS_GROWTH_LIMIT_KIB = 200 * 1024  # per process: logs and caches warm up, but 10^5 messages must not pile up


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def random_message(rng: random.Random) -> list[bytes]:
    types = sorted(registered_messages())
    kind = rng.randrange(4)
    if kind == 0:  # bytes
        return [rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randrange(1, 4))]
    if kind == 1:  # a real type, a random body
        return [bytes([rng.choice(types)]), rng.randbytes(rng.randrange(0, 128))]
    if kind == 2:  # a real type, well-formed msgpack of the wrong shape
        body = rng.choice([[1, "x", None], {"a": [1, 2]}, "text", 2**63, [[[]]] * 5, list(range(50))])
        return [bytes([rng.choice(types)]), msgpack.packb(body)]
    return [b""] * rng.randrange(1, 4)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the services' RSS from /proc")
def test_random_frames_at_every_socket_leave_the_mesh_serving(smollm2_path, tmp_path):
    topo = Topology.local(str(smollm2_path), "ipc", tmp_path, disaggregated=True, threads=1, kv_cache_mb=64)
    with supervised_mesh(topo, tmp_path) as sup:
        with Client(topo.frontend, timeout_s=120) as c:
            want = c.generate(prompt_token_ids=PROMPT, max_tokens=8, ignore_eos=True).token_ids
        before = {ch.name: rss_kib(ch.proc.pid) for ch in sup.children}
        ctx = zmq.Context()
        rng = random.Random(1234)
        targets = [(zmq.DEALER, topo.frontend), (zmq.DEALER, topo.backend), (zmq.PUSH, topo.tokenizers[0].detok),
                   (zmq.DEALER, topo.worker("decode-0").kv), (zmq.DEALER, topo.kvcaches[0].endpoint)]
        socks = []
        for kind, endpoint in targets:
            s = ctx.socket(kind)
            s.setsockopt(zmq.LINGER, 0)
            if kind == zmq.DEALER:
                s.setsockopt(zmq.IDENTITY, f"fuzz-{rng.randrange(1 << 30)}".encode())
            s.connect(endpoint)
            socks.append(s)
        sent = 0
        while sent < FRAMES:
            s = socks[sent % len(socks)]
            frames = random_message(rng)
            for _ in range(200):  # a full queue: the peer is busy with what came before
                try:
                    s.send_multipart(frames, flags=zmq.NOBLOCK)
                    break
                except zmq.Again:
                    time.sleep(0.01)
            sent += len(frames)
        time.sleep(2.0)  # let the services work through their queues
        for s in socks:
            s.close(linger=0)
        ctx.term()
        sup.wait_ready(timeout_s=120)
        with Client(topo.frontend, timeout_s=120) as c:
            got = c.generate(prompt_token_ids=PROMPT, max_tokens=8, ignore_eos=True)
        assert got.token_ids == want, (got, want)
        for ch in sup.children:
            assert ch.restarts == 0, f"{ch.name} restarted"
            grew = rss_kib(ch.proc.pid) - before[ch.name]
            assert grew < RSS_GROWTH_LIMIT_KIB, f"{ch.name} grew by {grew} KiB"
