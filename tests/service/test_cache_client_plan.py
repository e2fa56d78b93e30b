"""A worker's cache client plans each fetch (cache.fetch_plan): it asks the daemon where the prefix is, then
fetches only what loads faster than it computes, asking the daemon to send what it has read within the time
computing those blocks would take. The daemon here is a scripted peer on a real ZeroMQ socket; the engine is a
stand-in for the few calls the client makes of it (hashes, the device-held head, the namespace)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
import zmq.asyncio

from deepinfer.cache.fetch_plan import ALWAYS, DEADLINE_SLACK, FASTER, SLOWER
from deepinfer.protocol import messages as m
from deepinfer.protocol.sockets import arecv_routed, asend_msg, make_router
from deepinfer.services.cache_client import CacheClient

BS = 4
RATE = 80.0  # the worker's measured prefill tokens/s: a block computes in 50 ms
PROMPT = list(range(4 * BS + 1))  # four full blocks before the last token


class Engine:
    """What CacheClient.load_prefix calls on a ServingEngine; nothing on the device."""

    config = SimpleNamespace(enable_prefix_caching=True, block_size=BS)
    cache_namespace = SimpleNamespace(id="ns")

    def block_hashes(self, token_ids: list[int], cache_salt: str | None = None) -> list[bytes]:
        return [bytes([i]) * 32 for i in range(len(token_ids) // BS)]

    def cache_route(self, request_id: str, hashes: list[bytes]) -> Any:
        return SimpleNamespace(cached_prefix_blocks=lambda hs: 0)


@dataclass
class Thread:
    tokens_per_s: float = RATE

    async def call(self, fn: Any) -> Any:
        return fn()


@dataclass
class Daemon:
    """Holds every block on disk; answers lookups at once and fetches with every asked block."""

    sock: Any
    seen: list[Any] = field(default_factory=list)

    async def serve(self) -> None:
        while True:
            peer, msg = await arecv_routed(self.sock)
            self.seen.append(msg)
            if isinstance(msg, m.CachePrefetch):
                continue  # no reply
            if isinstance(msg, m.CacheLookup):
                reply: Any = m.CacheLookupReply(msg.request_id, ["disk"] * len(msg.block_hashes))
            else:
                blocks = [torch.zeros(2) for _ in msg.block_hashes]
                reply = m.CacheBlocks(msg.request_id, msg.block_hashes, ["disk"] * len(blocks), blocks)
            await asend_msg(self.sock, reply, peer)


def load(tmp_path, disk_s_per_block: float | None, always: bool = False) -> tuple[Daemon, CacheClient, Any]:
    async def run() -> tuple[Daemon, CacheClient, Any]:
        ctx = zmq.asyncio.Context()
        endpoint = f"ipc://{tmp_path}/cache.sock"
        daemon = Daemon(make_router(ctx, endpoint))
        client = CacheClient("worker-0", endpoint, ctx, Engine(), Thread(),  # type: ignore[arg-type]
                             fetch_always=always)
        if disk_s_per_block is not None:
            client.planner.fetch_s_per_block["disk"] = disk_s_per_block
        tasks = [asyncio.ensure_future(daemon.serve()), asyncio.ensure_future(client.recv_forever())]
        try:
            _, importer = await asyncio.wait_for(client.load_prefix("r1", PROMPT, None), 10)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            client.close()
            daemon.sock.close(linger=0)
            ctx.destroy(linger=0)
        return daemon, client, importer

    return asyncio.run(run())


def test_a_prefix_faster_to_fetch_is_fetched_within_its_compute_time(tmp_path) -> None:
    daemon, client, importer = load(tmp_path, disk_s_per_block=0.005)
    lookup, fetch = daemon.seen
    assert isinstance(lookup, m.CacheLookup) and len(lookup.block_hashes) == 4
    assert isinstance(fetch, m.CacheFetch) and len(fetch.block_hashes) == 4
    assert 0.3 < fetch.deadline_s <= DEADLINE_SLACK * 4 * BS / RATE  # bounded by the time computing them takes
    assert importer is not None and client.stats.fetched_blocks == 4
    assert client.planner.decisions == {FASTER: 1}


def test_a_prefix_slower_to_fetch_is_computed_without_a_fetch(tmp_path) -> None:
    daemon, client, importer = load(tmp_path, disk_s_per_block=0.25)  # five times a block's compute time
    assert [type(msg) for msg in daemon.seen] == [m.CacheLookup]
    assert importer is None and client.stats.fetches == 0 and client.stats.fetch_misses == 0
    assert client.planner.decisions == {SLOWER: 1} and client.planner.computed_blocks == 4
    assert client.up  # a choice, not a failure: the daemon stays in use


def test_fetch_policy_always_fetches_a_prefix_slower_to_fetch(tmp_path) -> None:
    daemon, client, importer = load(tmp_path, disk_s_per_block=0.25, always=True)
    lookup, fetch = daemon.seen
    assert isinstance(fetch, m.CacheFetch) and len(fetch.block_hashes) == 4
    assert 0.9 < fetch.deadline_s <= client.planner.max_deadline_s  # the time left of the longest wait
    assert importer is not None and client.stats.fetched_blocks == 4
    assert client.planner.decisions == {ALWAYS: 1} and client.planner.computed_blocks == 0


def test_a_prefetch_names_the_prompts_full_blocks_and_waits_for_nothing(tmp_path) -> None:
    async def run() -> tuple[list[Any], int]:
        ctx = zmq.asyncio.Context()
        endpoint = f"ipc://{tmp_path}/cache.sock"
        daemon = Daemon(make_router(ctx, endpoint))
        client = CacheClient("worker-0", endpoint, ctx, Engine(), Thread())  # type: ignore[arg-type]
        task = asyncio.ensure_future(daemon.serve())
        try:
            await asyncio.wait_for(client.prefetch("r1", PROMPT, None), 10)  # returns at once: no reply comes
            await asyncio.wait_for(client.prefetch("r2", PROMPT[:BS], None), 10)  # no full block before the last
            for _ in range(400):
                if daemon.seen:
                    break
                await asyncio.sleep(0.01)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            client.close()
            daemon.sock.close(linger=0)
            ctx.destroy(linger=0)
        return daemon.seen, client.stats.prefetches

    seen, sent = asyncio.run(run())
    [prefetch] = seen
    assert isinstance(prefetch, m.CachePrefetch) and prefetch.namespace == "ns"
    assert prefetch.block_hashes == Engine().block_hashes(PROMPT)[:4] and sent == 1
