"""The tiered KV cache through the whole mesh, on the real model: every tier a prompt's prefix can come
from gives the same greedy tokens as computing it (the engine with prefix caching off is the reference),
and usage reports where the cached tokens came from.

Tiers are reached for real: the device tier by repeating a prompt; the cache daemon's DRAM by emptying
the workers' device caches (an operator reset) after write-behind stored the blocks; its disk by a DRAM
tier too small to keep them. Restarting and killing the daemon are in test_cache_faults.py."""

from __future__ import annotations

import asyncio

import pytest

from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import SamplingParams
from deepinfer.launch.mesh import InprocMesh
from deepinfer.launch.topology import RouterConfig, Topology
from deepinfer.protocol import messages as m
from deepinfer.protocol.client import AsyncClient

pytestmark = pytest.mark.smollm2

SYSTEM = ("You are a careful assistant for a shipping company. Answer in one short sentence. "
          "Our warehouses are in Rotterdam, Singapore and Houston; parcels over 30 kg travel by sea; "
          "refunds take five working days; customers may change the address until the parcel leaves. ") * 3
QUESTION = "Where are the warehouses?"
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def engine(smollm2_path):
    """The reference: the engine computing everything (no prefix caching)."""
    return LLMEngine.load(smollm2_path, EngineConfig(kv_cache_bytes=64 << 20, enable_prefix_caching=False))


def chat(question: str = QUESTION) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def reference(engine: LLMEngine, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    ids = engine.tokenizer.encode_chat(messages)
    return ids, engine.generate([ids], SamplingParams(max_tokens=MAX_TOKENS))[0].token_ids


def topology(path, cache_dir, disaggregated: bool = False, host_mb: int = 64, kv_cache_dtype: str = "float32",
             **router) -> Topology:
    topo = Topology.local(str(path), "inproc", disaggregated=disaggregated, threads=1, kv_cache_mb=64,
                          cache_dir=cache_dir, host_cache_mb=host_mb, disk_cache_mb=256, kv_cache_dtype=kv_cache_dtype)
    return Topology(topo.model, topo.frontend, topo.backend, topo.tokenizers, topo.workers, RouterConfig(**router),
                    topo.kvcaches, kv_cache_dtype=kv_cache_dtype)


def workers(mesh: InprocMesh) -> list:
    return [s for s in mesh.services if hasattr(s, "engine")]


async def reset_devices(mesh: InprocMesh) -> None:
    for w in workers(mesh):
        await w._thread.call(w.engine.reset_prefix_cache)


async def stored(mesh: InprocMesh, hashes: list[bytes], tiers: set[str], timeout_s: float = 30.0) -> None:
    """Wait until write-behind put every block in one of `tiers` and the daemon's disk queue is empty."""
    daemon = mesh.service("kvcache-0")
    for _ in range(int(timeout_s / 0.05)):
        if all(t in tiers for t in daemon.store.lookup(hashes)) and not daemon.store.pending_writes():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"blocks not stored: {daemon.store.lookup(hashes)}")


def cacheable(engine: LLMEngine, ids: list[int], salt: str | None = None) -> list[bytes]:
    """Hashes of the blocks a hit may cover: full blocks, never the last prompt token."""
    return engine.block_hashes(ids, salt)[: (len(ids) - 1) // engine.config.block_size]


def test_cold_device_dram_and_next_turn_hits_give_the_same_tokens(smollm2_path, engine, tmp_path, monkeypatch):
    monkeypatch.setattr(m, "MAX_FETCH_BLOCKS", 4)  # the DRAM hit then takes several replies, as long prompts do
    ids, want = reference(engine, chat())
    hashes = cacheable(engine, ids)
    n = len(hashes) * engine.config.block_size

    async def run():
        mesh = InprocMesh(topology(smollm2_path, tmp_path / "kv"))
        await mesh.start()
        try:
            async with AsyncClient(mesh.topology.frontend, ctx=mesh.ctx, timeout_s=120) as c:
                cold = await c.generate(messages=chat(), max_tokens=MAX_TOKENS)
                device = await c.generate(messages=chat(), max_tokens=MAX_TOKENS)
                await stored(mesh, hashes, {"host"})
                await reset_devices(mesh)
                host = await c.generate(messages=chat(), max_tokens=MAX_TOKENS)
                turn2 = chat() + [{"role": "assistant", "content": cold.text},
                                  {"role": "user", "content": "And which one is in Asia?"}]
                second = await c.generate(messages=turn2, max_tokens=MAX_TOKENS)
            return cold, device, host, second
        finally:
            await mesh.stop()

    cold, device, host, second = asyncio.run(run())
    assert cold.token_ids == device.token_ids == host.token_ids == want
    assert cold.usage.cached_tokens == 0
    assert (device.usage.cached_tokens, device.usage.cached_by_tier) == (n, {"device": n})
    assert (host.usage.cached_tokens, host.usage.cached_by_tier) == (n, {"host": n})
    # The next turn reuses the first turn's prompt and its answer (written back when it finished).
    turn2_ids, turn2_want = reference(engine, chat() + [{"role": "assistant", "content": cold.text},
                                                         {"role": "user", "content": "And which one is in Asia?"}])
    assert second.token_ids == turn2_want
    assert second.usage.cached_tokens > len(ids)


async def cold_then_cached(mesh: InprocMesh, messages: list[dict[str, str]], hashes: list[bytes]) -> tuple:
    """The request computed once, then again after write-behind stored its blocks and the workers' device
    caches were emptied: the second is served from the daemon's tiers."""
    async with AsyncClient(mesh.topology.frontend, ctx=mesh.ctx, timeout_s=120) as c:
        cold = await c.generate(messages=messages, max_tokens=MAX_TOKENS)
        await stored(mesh, hashes, {"host", "disk"})
        await reset_devices(mesh)
        return cold, await c.generate(messages=messages, max_tokens=MAX_TOKENS)


def test_disk_hit_after_eviction_from_dram_through_a_pd_transfer(smollm2_path, engine, tmp_path):
    ids, want = reference(engine, chat("How long do refunds take?"))
    hashes = cacheable(engine, ids)
    n = len(hashes) * engine.config.block_size

    async def run():
        # 1 MB of DRAM holds one 737 KB block: the rest of the prefix is evicted to the disk tier only.
        mesh = InprocMesh(topology(smollm2_path, tmp_path / "kv", disaggregated=True, host_mb=1))
        await mesh.start()
        try:
            cold, disk = await cold_then_cached(mesh, chat("How long do refunds take?"), hashes)
            stats = mesh.service("kvcache-0").store.stats()
            return cold, disk, stats
        finally:
            await mesh.stop()

    cold, disk, stats = asyncio.run(run())
    assert cold.token_ids == disk.token_ids == want
    assert disk.usage.cached_tokens == n
    assert disk.usage.cached_by_tier.get("disk", 0) >= n - 2 * engine.config.block_size
    assert sum(disk.usage.cached_by_tier.values()) == n


def test_jobs_that_wait_have_their_disk_held_prefix_prefetched_and_answer_the_same(smollm2_path, engine, tmp_path):
    questions = [f"Question {i}: how long do refunds take?" for i in range(4)]
    wants = [reference(engine, chat(q))[1] for q in questions]
    ids, _ = reference(engine, chat("Where is the nearest warehouse?"))
    shared = cacheable(engine, ids)[:-1]  # the system prompt's blocks, common to every question

    async def run():
        # 1 MB of DRAM: the shared prefix lives on the disk tier, read into DRAM only when asked for.
        mesh = InprocMesh(topology(smollm2_path, tmp_path / "kv", host_mb=1))
        await mesh.start()
        try:
            async with AsyncClient(mesh.topology.frontend, ctx=mesh.ctx, timeout_s=120) as c:
                await c.generate(messages=chat("Where is the nearest warehouse?"), max_tokens=MAX_TOKENS)
                await stored(mesh, shared, {"host", "disk"})
                await reset_devices(mesh)
                outs = await asyncio.gather(*(c.generate(messages=chat(q), max_tokens=MAX_TOKENS)
                                              for q in questions))
            [worker] = workers(mesh)
            return outs, worker.cache.stats.prefetches
        finally:
            await mesh.stop()

    outs, sent = asyncio.run(run())
    assert [o.token_ids for o in outs] == wants
    assert all(o.usage.cached_tokens >= len(shared) * engine.config.block_size for o in outs)
    # Four prompts at once: those queued behind the first asked the daemon to prefetch (whether it then read
    # anything from disk depends on whether the first one's fetch had already: tests/service covers that).
    assert sent >= 1


def test_an_fp16_kv_cache_moves_half_the_bytes_through_every_tier_and_the_pd_transfer(smollm2_path, engine,
                                                                                       tmp_path):
    """`kv_cache_dtype = "float16"` for the whole mesh: the workers' pools, the P/D transfer and the daemon's
    DRAM and disk tiers all hold fp16 blocks (half the bytes of fp32's), in a namespace of their own, and
    cold, DRAM and disk hits give the tokens of an engine with an fp16 cache computing everything."""
    engine16 = LLMEngine.load(smollm2_path, EngineConfig(kv_cache_bytes=64 << 20, enable_prefix_caching=False,
                                                         kv_cache_dtype="float16"))
    ids, want = reference(engine16, chat("How long do refunds take?"))
    hashes = cacheable(engine16, ids)
    n = len(hashes) * engine16.config.block_size

    async def run():
        # 1 MB of DRAM holds two 369 KB fp16 blocks: the rest of the prefix is on the disk tier only.
        mesh = InprocMesh(topology(smollm2_path, tmp_path / "kv", disaggregated=True, host_mb=1,
                                   kv_cache_dtype="float16"))
        await mesh.start()
        try:
            cold, hit = await cold_then_cached(mesh, chat("How long do refunds take?"), hashes)
            daemon = mesh.service("kvcache-0")
            return cold, hit, daemon.kv, [w.engine.kv_spec for w in workers(mesh)]
        finally:
            await mesh.stop()

    cold, hit, daemon_kv, worker_kvs = asyncio.run(run())
    assert cold.token_ids == hit.token_ids == want
    assert hit.usage.cached_tokens == n and hit.usage.cached_by_tier.get("disk", 0) > 0
    assert all(kv == daemon_kv == engine16.kv_spec for kv in worker_kvs)
    assert daemon_kv.dtype_name == "float16" and daemon_kv.block_nbytes * 2 == engine.kv_spec.block_nbytes
    assert engine16.cache_namespace != engine.cache_namespace  # the fp32 reference's


def test_tenants_share_blocks_within_a_tenant_and_never_across(smollm2_path, engine, tmp_path):
    ids, want = reference(engine, chat())
    n = len(cacheable(engine, ids)) * engine.config.block_size

    async def run():
        mesh = InprocMesh(topology(smollm2_path, tmp_path / "kv", tenants={"key-a": "salt-a", "key-b": "salt-b"}))
        await mesh.start()
        try:
            ep = mesh.topology.frontend
            async with (AsyncClient(ep, ctx=mesh.ctx, timeout_s=120, api_key="key-a") as a,
                        AsyncClient(ep, ctx=mesh.ctx, timeout_s=120, api_key="key-b") as b):
                a1 = await a.generate(messages=chat(), max_tokens=MAX_TOKENS)
                a2 = await a.generate(messages=chat(), max_tokens=MAX_TOKENS)
                b1 = await b.generate(messages=chat(), max_tokens=MAX_TOKENS)
                b2 = await b.generate(messages=chat(), max_tokens=MAX_TOKENS)
            return a1, a2, b1, b2
        finally:
            await mesh.stop()

    a1, a2, b1, b2 = asyncio.run(run())
    assert a1.token_ids == a2.token_ids == b1.token_ids == b2.token_ids == want
    assert (a1.usage.cached_tokens, a2.usage.cached_tokens) == (0, n)
    assert (b1.usage.cached_tokens, b2.usage.cached_tokens) == (0, n)  # tenant b never hit a's blocks


def test_requests_are_served_while_the_cache_daemon_is_down(smollm2_path, engine, tmp_path):
    ids, want = reference(engine, chat())

    async def run():
        mesh = InprocMesh(topology(smollm2_path, tmp_path / "kv"))
        await mesh.start()
        try:
            async with AsyncClient(mesh.topology.frontend, ctx=mesh.ctx, timeout_s=120) as c:
                mesh.service("kvcache-0").stop()
                await asyncio.sleep(0.5)
                outs = [await c.generate(messages=chat(), max_tokens=MAX_TOKENS)]
                await reset_devices(mesh)
                outs.append(await c.generate(messages=chat(), max_tokens=MAX_TOKENS))
            client = workers(mesh)[0].cache
            return outs, client.up, client.stats
        finally:
            await mesh.stop()

    outs, up, stats = asyncio.run(run())
    assert [o.token_ids for o in outs] == [want, want]
    assert all(o.usage.cached_tokens == 0 for o in outs)
    assert not up and stats.timeouts >= 1


def test_damaged_disk_blocks_are_detected_quarantined_and_recomputed(smollm2_path, engine, tmp_path):
    """Four kinds of damage to the disk tier's files, each on a block further along one prompt's prefix. Each
    round empties the device cache and asks again: the fetch stops at the first damaged block (quarantined,
    counted), everything after it is computed, the tokens stay right, and write-behind repairs the block."""
    from deepinfer.cache.block_file import HEADER_BYTES

    messages = [{"role": "system", "content": SYSTEM * 2}, {"role": "user", "content": QUESTION}]
    ids, want = reference(engine, messages)
    hashes = cacheable(engine, ids)
    bs = engine.config.block_size
    assert len(hashes) > 16

    def damage(root, k: int, kind: str) -> None:
        files = {p.stem: p for p in root.rglob("*.kvb")}
        target, neighbour = files[hashes[k].hex()], files[hashes[k + 1].hex()]
        raw = bytearray(target.read_bytes())
        if kind == "flip":
            raw[HEADER_BYTES + 1000] ^= 0x01
            target.write_bytes(bytes(raw))
        elif kind == "truncate":
            target.write_bytes(bytes(raw[: len(raw) // 3]))
        elif kind == "swap":  # headers intact, payloads exchanged
            other = bytearray(neighbour.read_bytes())
            target.write_bytes(bytes(raw[:HEADER_BYTES] + other[HEADER_BYTES:]))
            neighbour.write_bytes(bytes(other[:HEADER_BYTES] + raw[HEADER_BYTES:]))
        else:  # a valid block under the wrong name
            target.write_bytes(neighbour.read_bytes())

    rounds = [(3, "flip"), (6, "truncate"), (9, "wrong_name"), (13, "swap")]  # swap damages 14 too: last

    async def run():
        # 1 MB of DRAM holds one block: the prefix is read back from the files.
        mesh = InprocMesh(topology(smollm2_path, tmp_path / "kv", host_mb=1))
        await mesh.start()
        results = []
        try:
            async with AsyncClient(mesh.topology.frontend, ctx=mesh.ctx, timeout_s=120) as c:
                await c.generate(messages=messages, max_tokens=MAX_TOKENS)
                await stored(mesh, hashes, {"host", "disk"})
                daemon = mesh.service("kvcache-0")
                for k, kind in rounds:
                    await stored(mesh, hashes, {"host", "disk"})
                    daemon.store.host.clear()  # the one block DRAM holds may be the one damaged next
                    damage(tmp_path / "kv", k, kind)
                    await reset_devices(mesh)
                    r = await c.generate(messages=messages, max_tokens=MAX_TOKENS)
                    quarantined = sum(v for key, v in daemon.store.stats().items() if "quarantine" in key)
                    results.append((r, quarantined))
        finally:
            await mesh.stop()
        return results

    results = asyncio.run(run())
    for i, ((k, kind), (r, quarantined)) in enumerate(zip(rounds, results)):
        assert r.token_ids == want, kind
        assert r.usage.cached_tokens == k * bs, (kind, r.usage)
        assert quarantined >= i + 1, kind
