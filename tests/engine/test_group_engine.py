"""A worker group of two ranks in real processes: the leader (`GroupEngine`) in this process, one follower
(`follow`) spawned, joined over gloo on 127.0.0.1, one torch thread each, on a tiny dense Llama (data-
parallel attention only) and a tiny Mixtral (expert-parallel: each rank holds half the experts).

Greedy outputs of requests spread over both ranks equal a single engine's (and the Mixtral group's expert
counts the single engine's); an abort on the follower frees its blocks; a P/D handoff exports from and
installs into the follower; a follower that dies breaks the group at the leader's next step (no hang),
and a follower exits 0 when its leader ends the group and 1 when the leader vanishes."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import random
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import FinishReason, RequestOutput, SamplingParams
from deepinfer.loading.weights import load_model_weights
from deepinfer.services.group.channel import GroupBroken, join_group
from deepinfer.services.group.engine import GroupEngine, rank_engine
from deepinfer.services.group.follower import EXIT_BROKEN, EXIT_STOPPED, follow
from tests.engine.moe_models import build_hf_moe, save

TIMEOUT_S = 60.0  # the channel's: a rank that hangs fails the test instead of hanging it
CONFIG = dict(num_kv_blocks=48, block_size=8, max_num_seqs=8, num_threads=1)
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_engine(path: str, ep_group: Any = None) -> LLMEngine:
    return rank_engine(load_model_weights(path), None, EngineConfig(**CONFIG), ep_group)


def follower_main(path: str, master: str) -> None:
    torch.set_num_threads(1)
    channel, ep_group = join_group(2, 1, master, timeout_s=TIMEOUT_S)
    os._exit(follow(channel, make_engine(path, ep_group)))


def vanishing_leader_main(path: str, master: str) -> None:
    torch.set_num_threads(1)
    channel, ep_group = join_group(2, 0, master, timeout_s=TIMEOUT_S)
    GroupEngine(make_engine(path, ep_group), channel, ep_group=ep_group).greet()
    os._exit(3)


@contextlib.contextmanager
def group_of_two(path: Path) -> Iterator[tuple[GroupEngine, mp.process.BaseProcess]]:
    master = f"127.0.0.1:{free_port()}"
    proc = mp.get_context("spawn").Process(target=follower_main, args=(str(path), master), daemon=True)
    proc.start()
    channel, ep_group = join_group(2, 0, master, timeout_s=TIMEOUT_S)
    group = GroupEngine(make_engine(str(path), ep_group), channel, ep_group=ep_group)
    try:
        group.greet()
        yield group, proc
    finally:
        group.close()
        proc.join(timeout=TIMEOUT_S)
        if proc.is_alive():
            proc.kill()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 96) for _ in range(rng.randrange(5, 30))] for _ in range(n)]


def run(engine: GroupEngine | LLMEngine) -> dict[str, RequestOutput]:
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


@pytest.fixture(scope="module")
def model(tiny_hf_model) -> Path:
    return tiny_hf_model("llama").path


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    return save(build_hf_moe("mixtral-8e-top2"), tmp_path_factory.mktemp("mixtral"))


@pytest.fixture(scope="module")
def reference(model) -> list[list[int]]:
    engine = make_engine(str(model))
    return [o.token_ids for o in engine.generate(prompts(6), PARAMS)]


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_requests_spread_over_ranks_equal_one_engine(request, kind):
    path = request.getfixturevalue({"llama": "model", "mixtral": "mixtral"}[kind])
    single = make_engine(str(path))
    expected = [o.token_ids for o in single.generate(prompts(6), PARAMS)]
    with group_of_two(path) as (group, _):
        assert (group.local.ep_group is not None) == (kind == "mixtral")
        free = group.num_free_blocks
        for i, p in enumerate(prompts(6)):
            group.add_request(f"r{i}", p, PARAMS)
        assert {group.rank_of(f"r{i}") for i in range(6)} == {0, 1}
        final = run(group)
        assert [final[f"r{i}"].token_ids for i in range(6)] == expected
        assert all(final[f"r{i}"].finish_reason is FinishReason.LENGTH for i in range(6))
        assert group.num_free_blocks == free and not group.live_ids()
        assert group.stats.tokens_generated == 6 * PARAMS.max_tokens > group.local.stats.tokens_generated
        counts, per_rank, computed = group.take_expert_load()
        assert sum(per_rank) == single.stats.tokens_computed and min(per_rank) > 0
        if kind == "mixtral":  # every rank counts its own tokens' choices: summed, the single engine's
            assert counts == single.expert_counts().tolist()
            # Every assignment is computed by exactly one rank's experts, whoever's token it was.
            assert [sum(layer) for layer in computed] == [sum(layer) for layer in counts]
            assert all(len(layer) == 2 for layer in computed)
        else:
            assert counts is None and computed == []


def test_abort_on_the_follower_frees_its_blocks(model):
    with group_of_two(model) as (group, _):
        free = group.num_free_blocks
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        for i, p in enumerate(prompts(4, seed=1)):
            group.add_request(f"a{i}", p, params)
        group.step()
        group.step()
        victim = next(f"a{i}" for i in range(4) if group.rank_of(f"a{i}") == 1)
        assert group.num_free_blocks < free
        assert group.abort(victim)
        final = run(group)
        assert final[victim].finish_reason is FinishReason.ABORT
        assert all(o.finish_reason is FinishReason.LENGTH for rid, o in final.items() if rid != victim)
        assert group.num_free_blocks == free and not group.live_ids()


def test_handoff_exports_from_and_installs_into_the_follower(model, reference, monkeypatch):
    prompt = prompts(6)[2]
    with group_of_two(model) as (group, _):
        free = group.num_free_blocks
        monkeypatch.setattr(group, "_place", lambda ids, salt: 1)
        monkeypatch.setattr(group, "_place_reservation", lambda: 1)
        group.add_request("p", prompt, PARAMS, prefill_only=True)
        handoff = run(group)["p"]
        assert handoff.handoff and group.num_held == 1
        kv = group.export_kv("p")
        assert kv.shape[1:] == group.kv_spec.block_shape
        assert group.release("p") and group.num_held == 0

        assert group.reserve("d", -(-(len(prompt) + PARAMS.max_tokens) // 8), lease_s=30.0)
        assert group.live_ids() == {"d"}
        first = handoff.new_token_ids[0]
        group.add_prefilled_request("d", prompt, first, PARAMS, kv, reservation_id="d")
        assert group.rank_of("d") == 1
        assert run(group)["d"].token_ids == reference[2]
        assert group.num_free_blocks == free and not group.live_ids()

        # The follower's export is the KV a single engine computes for the prompt.
        single = make_engine(str(model))
        single.add_request("p", prompt, PARAMS, prefill_only=True)
        run(single)
        torch.testing.assert_close(kv, single.export_kv("p"))


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_a_dead_follower_breaks_the_group_at_the_next_step(request, kind):
    path = request.getfixturevalue({"llama": "model", "mixtral": "mixtral"}[kind])
    with group_of_two(path) as (group, proc):
        for i, p in enumerate(prompts(4, seed=2)):
            group.add_request(f"k{i}", p, SamplingParams(max_tokens=40, ignore_eos=True))
        group.step()
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        with pytest.raises(GroupBroken):
            group.step()
        with pytest.raises(GroupBroken):  # and stays broken
            group.add_request("late", [5, 6, 7], PARAMS)


def test_follower_exit_codes(model):
    with group_of_two(model) as (group, proc):
        group.add_request("x", prompts(1)[0], PARAMS)
        run(group)
    assert proc.exitcode == EXIT_STOPPED  # the leader closed the group

    # A leader process that dies without a word: its follower notices at once and exits 1.
    master = f"127.0.0.1:{free_port()}"
    spawn = mp.get_context("spawn")
    follower = spawn.Process(target=follower_main, args=(str(model), master), daemon=True)
    leader = spawn.Process(target=vanishing_leader_main, args=(str(model), master), daemon=True)
    follower.start()
    leader.start()
    leader.join(timeout=TIMEOUT_S)
    follower.join(timeout=TIMEOUT_S)
    assert (leader.exitcode, follower.exitcode) == (3, EXIT_BROKEN)
