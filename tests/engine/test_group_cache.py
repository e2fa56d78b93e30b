"""A worker group's side of the cache daemon (group_cache.py), driven in process: the leader here, one
follower spawned (test_group_engine's harness), on a tiny dense Llama.

The lookup and import for a request go to the rank its route chose, and `add_request` puts the request
there (nothing lands on another rank); write-behind exports come from the rank holding each block, a chain
split over ranks in one call; a reset empties every rank; routes not followed by an add are dropped; bad KV
fails the import with the engine's error and leaves the group going; a follower gone mid-import breaks the
group. Every path gives back every block on every rank."""

from __future__ import annotations

import os
import random
import signal

import pytest
import torch

from deepinfer.engine.handoff import HandoffError
from deepinfer.engine.request import SamplingParams
from deepinfer.services.group import cache as group_cache
from deepinfer.services.group.channel import GroupBroken
from deepinfer.services.group.engine import GroupEngine
from tests.engine.test_group_engine import CONFIG, PARAMS, group_of_two, make_engine, model, run  # noqa: F401

BS = CONFIG["block_size"]
LONG = SamplingParams(max_tokens=30, ignore_eos=True)


def prompt(seed: int, blocks: int = 4) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 96) for _ in range(blocks * BS + 3)]


def cacheable(engine, ids: list[int]) -> list[bytes]:
    """The blocks a hit may cover, as CacheClient asks for them: full blocks, never the last prompt token."""
    return engine.block_hashes(ids)[: (len(ids) - 1) // BS]


def rank_free(group: GroupEngine) -> list[int]:
    return [load.free_blocks for load in group._rank_loads()]


@pytest.fixture(scope="module")
def stored(model):  # noqa: F811
    """A prompt's greedy answer computed cold by one engine, and the KV of its cacheable blocks (what the
    daemon would hand back)."""
    engine = make_engine(str(model))
    ids = prompt(7)
    want = engine.generate([ids], PARAMS)[0].token_ids
    hashes = cacheable(engine, ids)
    names, kv = engine.export_cached_blocks(hashes)
    assert names == hashes and kv is not None
    return ids, want, hashes, kv


def busy_rank0(group: GroupEngine) -> None:
    """A long request on rank 0, so the next placement picks rank 1."""
    group.add_request("busy", prompt(99, blocks=1), LONG)
    assert group.rank_of("busy") == 0


def test_import_goes_to_the_routed_rank_and_the_request_follows(model, stored):  # noqa: F811
    ids, want, hashes, kv = stored
    with group_of_two(model) as (group, _):
        free = rank_free(group)
        busy_rank0(group)
        target = group.cache_route("r", hashes)
        assert target.rank == 1 and target.cached_prefix_blocks(hashes) == 0
        # Two tier runs, as CacheClient imports them: the second holds the first as its resident head.
        assert target.import_cached_blocks(hashes[:2], list(kv[:2]), "host") == 2
        assert target.import_cached_blocks(hashes[2:], kv[2:], "disk", keep_resident=hashes[:2]) == 2
        assert target.cached_prefix_blocks(hashes) == len(hashes)
        assert group.local.cached_prefix_blocks(hashes) == 0  # nothing landed on rank 0
        group.add_request("r", ids, PARAMS)
        assert group.rank_of("r") == 1 and group.cache.num_routes == 0
        final = run(group)
        assert final["r"].token_ids == want
        assert final["r"].usage.cached_by_tier == {"host": 2 * BS, "disk": 2 * BS}
        # Write-behind: the blocks come back from rank 1, as imported.
        names, back = group.export_cached_blocks(hashes)
        assert names == hashes and torch.equal(back, kv)
        assert rank_free(group) == free and not group.live_ids()


def test_a_route_counts_as_load_and_is_decided_once(model, stored):  # noqa: F811
    _, _, hashes, _ = stored
    with group_of_two(model) as (group, _):
        first = group.cache_route("a", hashes)
        second = group.cache_route("b", hashes)  # "a" is routed to rank 0, not added yet: "b" goes to 1
        assert (first.rank, second.rank) == (0, 1)
        assert group.cache_route("a", hashes).rank == 0  # asked again: the same rank
        group.add_request("b", prompt(7), PARAMS)
        group.add_request("a", prompt(7), PARAMS)
        assert (group.rank_of("a"), group.rank_of("b")) == (0, 1)
        run(group)


def test_export_takes_each_block_from_the_rank_holding_it(model):  # noqa: F811
    with group_of_two(model) as (group, _):
        free = rank_free(group)
        a, b = prompt(1), prompt(2)
        group.add_request("a", a, PARAMS)
        group.add_request("b", b, PARAMS)
        assert (group.rank_of("a"), group.rank_of("b")) == (0, 1)
        run(group)
        ha, hb = cacheable(group, a), cacheable(group, b)
        assert group.local.export_cached_blocks(hb) == ([], None)  # b's blocks are on rank 1 only
        names_a, kv_a = group.export_cached_blocks(ha)
        names_b, kv_b = group.export_cached_blocks(hb)
        assert (names_a, names_b) == (ha, hb)
        names, kv = group.export_cached_blocks([*hb, *ha])  # both ranks in one call, in the order asked
        assert names == [*hb, *ha] and torch.equal(kv, torch.cat([kv_b, kv_a]))
        # The follower computed b's KV as one engine does.
        single = make_engine(str(model))
        single.generate([b], PARAMS)
        torch.testing.assert_close(kv_b, single.export_cached_blocks(hb)[1])

        assert group.reset_prefix_cache() >= len(ha) + len(hb)
        assert group.export_cached_blocks([*ha, *hb]) == ([], None)
        assert not group.pool.cached_hashes()
        assert rank_free(group) == free


def test_abort_bad_kv_and_stale_routes_leave_every_block(model, stored, monkeypatch):  # noqa: F811
    ids, _, hashes, kv = stored
    with group_of_two(model) as (group, _):
        free = rank_free(group)
        busy_rank0(group)
        target = group.cache_route("x", hashes)
        assert target.rank == 1 and target.import_cached_blocks(hashes, kv, "host") == len(hashes)
        group.abort("x")  # aborted while its prefix loaded: never added
        assert group.cache.num_routes == 0
        with pytest.raises(HandoffError):  # the follower's own check, raised here as the engine's type
            group.cache_route("y", hashes).import_cached_blocks(hashes, kv[:, :1], "host")
        monkeypatch.setattr(group_cache, "ROUTE_TTL_S", 0.0)
        group.cache_route("z", hashes)
        assert group.cache.num_routes == 1  # "y" (never added) expired
        group.abort("busy")
        group.abort("z")
        run(group)
        assert rank_free(group) == free and group.broken is None and not group.live_ids()
        # The imported blocks stay cached on rank 1, free: the next request with that prefix hits them.
        group.add_request("again", ids, PARAMS)
        assert group.rank_of("again") == 1
        assert run(group)["again"].usage.cached_by_tier == {"host": len(hashes) * BS}


def test_a_follower_gone_mid_import_breaks_the_group(model, stored):  # noqa: F811
    _, _, hashes, kv = stored
    with group_of_two(model) as (group, proc):
        busy_rank0(group)
        target = group.cache_route("r", hashes)
        assert target.rank == 1
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        with pytest.raises(GroupBroken):
            target.import_cached_blocks(hashes, kv, "host")
        with pytest.raises(GroupBroken):  # and stays broken, as after any other failed round
            group.add_request("r", prompt(7), PARAMS)
