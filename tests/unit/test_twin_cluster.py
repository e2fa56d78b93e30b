"""The cluster twin on short synthetic traces: deterministic, hit counts that agree with the cache's own
accounting, and a change to the real router core's policy changing where the twin's requests go."""

from __future__ import annotations

import random

import pytest

from deepinfer.services.router_cache import Chosen
from deepinfer.services.router_core import RouterConfig, RouterCore, RouterRequest
from deepinfer.twin.cluster import ClusterTwin, TwinConfig, TwinRequest
from deepinfer.twin.costs import CostModel, LinkCosts, StepCosts, TierCosts
from deepinfer.twin.worker import WorkerSettings

BLOCK = 16
KV_BLOCK_NBYTES = 737_280  # SmolLM2's fp32 KV block (16 tokens)


def costs() -> CostModel:
    link = LinkCosts
    return CostModel("test", "test", KV_BLOCK_NBYTES, StepCosts(0.01, 5e-4, 1e-8, 2e-3, 1e-6), link(2.6e-4, 1e12),
                     {"ipc": link(1e-4, 4e9)}, TierCosts(link(1e-5, 19e9), link(1e-5, 19e9)),
                     TierCosts(link(3e-4, 1e9), link(1e-3, 1.2e9)))


def trace(n: int = 40, seed: int = 0, gap_s: float = 0.3) -> list[TwinRequest]:
    """Conversations sharing system prompts: request i extends group i % 4's prefix by a turn of its own."""
    rng = random.Random(seed)
    systems = [[rng.randrange(256, 4000) for _ in range(160)] for _ in range(4)]
    return [TwinRequest(i * gap_s, tuple(systems[i % 4][: 64 + 16 * (i % 6)] + [rng.randrange(256, 4000)
                                                                             for _ in range(40)]), 6, i)
            for i in range(n)]


def settings(num_blocks: int = 600, **kw: object) -> WorkerSettings:
    return WorkerSettings(num_blocks=num_blocks, block_size=BLOCK, max_num_seqs=64, max_num_batched_tokens=512,
                          max_model_len=4096, real_block_nbytes=KV_BLOCK_NBYTES, **kw)  # type: ignore[arg-type]


def run(config: TwinConfig, reqs: list[TwinRequest],
        core: type[RouterCore] = RouterCore) -> tuple[list[dict], ClusterTwin]:
    twin = ClusterTwin(config, costs(), core)
    try:
        return twin.replay(reqs, warm=[[7] * 32, [9] * 32]), twin
    finally:
        twin.close()


@pytest.fixture
def disk_root(tmp_path):  # type: ignore[no-untyped-def]
    return tmp_path / "disk"


def test_same_input_same_output(disk_root) -> None:  # type: ignore[no-untyped-def]
    reqs = trace()
    cfg = lambda d: TwinConfig(settings(num_blocks=40), host_cache_bytes=30 * KV_BLOCK_NBYTES,  # noqa: E731
                               disk_cache_bytes=400 * KV_BLOCK_NBYTES, disk_root=d)
    a, _ = run(cfg(disk_root / "a"), reqs)
    b, _ = run(cfg(disk_root / "b"), reqs)
    assert a == b
    assert len(a) == len(reqs) and not [r for r in a if "error" in r]


def test_every_request_ends_with_its_tokens_and_tiers_sum_to_its_hits(disk_root) -> None:  # type: ignore[no-untyped-def]
    reqs = trace()
    rows, twin = run(TwinConfig(settings(num_blocks=40), host_cache_bytes=30 * KV_BLOCK_NBYTES,
                                disk_cache_bytes=400 * KV_BLOCK_NBYTES, disk_root=disk_root), reqs)
    for row, req in zip(rows, reqs):
        assert row["completion_tokens"] == req.max_tokens
        assert sum(row["cached_by_tier"].values()) == row["cached_tokens"]
        assert row["cached_tokens"] % BLOCK == 0 and row["cached_tokens"] < row["prompt_tokens"]
    tiers = {t for r in rows for t in r["cached_by_tier"]}
    assert {"device", "host"} <= tiers  # a 40-block pool forgets: the daemon serves the rest


def test_host_hits_are_the_blocks_the_store_served(disk_root) -> None:  # type: ignore[no-untyped-def]
    """With a host tier big enough to hold everything (no disk, so no prefetch), every host-tier token a
    request reports is a block the TieredStore counted as a host hit, and the other way round."""
    rows, twin = run(TwinConfig(settings(num_blocks=40), host_cache_bytes=1000 * KV_BLOCK_NBYTES,
                                disk_cache_bytes=0), trace())
    host_tokens = sum(r["cached_by_tier"].get("host", 0) for r in rows)
    assert host_tokens > 0
    assert host_tokens == BLOCK * twin.daemon.store.stats()["host_hits"]


def test_no_cache_no_hits() -> None:
    rows, _ = run(TwinConfig(settings(prefix_caching=False), kvcache=False), trace(n=12))
    assert all(r["cached_tokens"] == 0 for r in rows)


class AvoidFirstWorker(RouterCore):
    """A test-only policy change in the router core: never place a prefill on worker-0 while another can
    take it."""

    def _choose(self, st: RouterRequest, now: float, exclude=()) -> Chosen | None:  # type: ignore[no-untyped-def]
        return super()._choose(st, now, exclude=(*exclude, "worker-0")) or super()._choose(st, now, exclude)


def test_a_router_policy_change_changes_the_twins_placement(disk_root) -> None:  # type: ignore[no-untyped-def]
    reqs = trace(n=24, gap_s=0.05)
    cfg = TwinConfig(settings(), num_workers=2, router=RouterConfig(placement="least_loaded"), kvcache=False)
    base, base_twin = run(cfg, reqs)
    changed, changed_twin = run(cfg, reqs, AvoidFirstWorker)
    assert base_twin.workers["worker-0"].steps > 0 and base_twin.workers["worker-1"].steps > 0
    assert changed_twin.workers["worker-0"].steps == 0
    assert changed_twin.workers["worker-1"].tokens_generated == sum(r.max_tokens for r in reqs) + 2 * 2  # + warm
    # Everything on one worker: its device pool serves more of the shared prefixes than two pools did.
    assert sum(r["cached_tokens"] for r in changed) >= sum(r["cached_tokens"] for r in base)
