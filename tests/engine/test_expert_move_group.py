"""Expert placement moves on a worker group of two ranks in real processes (the leader's `GroupEngine`
here, one follower spawned; gloo on 127.0.0.1, one torch thread each) serving a tiny Mixtral whose
default placement has one redundant replica per layer.

In one group, in order:

1. requests with no move: the reference run;
2. the same requests, with a move (experts moved between and within ranks, replicas added and dropped)
   begun after their first step: every rank switches at the same step, mid-flight; greedy outputs equal
   the run that never moved and a single engine's; no request fails; each rank's bank rows then hold
   exactly the new placement's experts as loaded;
3. a move while idle: `keepalive()` alone completes it;
4. a move whose experts changed on disk (digest mismatch), then one whose model file is gone: each ends
   `MoveResult(ok=False)` and the group keeps serving on the old version;
5. refusals: a version not newer, another group shape, a move while one is pending.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.ep.move import MoveResult, PlacementRefused, expert_digest
from deepinfer.engine.ep.placement import ExpertPlacement
from deepinfer.engine.models.moe import moe_blocks
from deepinfer.engine.request import FinishReason, RequestOutput, SamplingParams
from deepinfer.loading.weights import load_model_weights
from deepinfer.services.group.channel import join_group
from deepinfer.services.group.engine import GroupEngine
from deepinfer.services.group.follower import EXIT_STOPPED, follow
from tests.engine.moe_models import build_hf_moe, save
from tests.engine.test_group_engine import CONFIG, TIMEOUT_S, free_port, make_engine, prompts

pytestmark = pytest.mark.timeout(300)

PARAMS = SamplingParams(max_tokens=40, ignore_eos=True)
BASE = ExpertPlacement.static(3, 8, 2, redundant=1)  # the engines' default: [0 1 2 3 -] [4 5 6 7 0]
V1 = ExpertPlacement(2, 8, 5, (
    (0, 5, 2, 3, 4, 1, 4, 6, 7, 5),  # 1 leaves rank 0; 4 and 5 swap rows on rank 1 and get replicas on rank 0
    (7, 1, 2, 3, 6, 4, 5, 0, -1, 1),  # 7 and 6 come to rank 0; 0 moves row on rank 1, a slot empties
    BASE.layers[2],
), version=1)
V2 = ExpertPlacement(2, 8, 5, (*V1.layers[:2], (0, 1, 2, 3, 7, 4, 5, 6, -1, 0)), version=2)  # idle move
V3 = ExpertPlacement(2, 8, 5, ((0, 5, 2, 3, 6, *V2.layers[0][5:]), *V2.layers[1:]), version=3)  # 6 to rank 0
CHANGED = "model.layers.0.block_sparse_moe.experts.6.w1.weight"  # what V3 reads on rank 0


def follower_main(path: str, master: str, out: str) -> None:
    """A follower that records its placement version at every step and, at the end, which expert each
    bank row holds and whether its weights are that expert's as loaded."""
    torch.set_num_threads(1)
    channel, ep_group = join_group(2, 1, master, timeout_s=TIMEOUT_S)
    engine = make_engine(path, ep_group)
    versions = trace_versions(engine)
    code = follow(channel, engine)
    Path(out).write_text(json.dumps({"versions": versions, "banks": bank_rows(engine)}))
    os._exit(code)


def trace_versions(engine: LLMEngine) -> list[int]:
    versions: list[int] = []
    step = engine.step

    def traced() -> list[RequestOutput]:
        assert engine.ep_placement is not None
        versions.append(engine.ep_placement.version)
        return step()

    engine.step = traced  # type: ignore[method-assign]
    return versions


def bank_rows(engine: LLMEngine) -> list[list[Any]]:
    """Per MoE layer, per row: [expert, the row holds that expert's weights as loaded (zeros if empty)]."""
    stager = engine._ep_moves
    assert stager is not None
    layers = []
    for m, block in enumerate(moe_blocks(engine.runner.model)):
        bank = block.experts.bank  # type: ignore[attr-defined]
        half = bank.gate_up.shape[1] // 2
        rows = []
        for row, e in enumerate(bank.slots.tolist()):
            if e == -1:
                rows.append([e, not bank.gate_up[row].any() and not bank.down[row].any()])
            else:
                gate_up = bank.gate_up[row]
                digest = expert_digest(gate_up[:half], gate_up[half:], bank.down[row])
                rows.append([e, digest == stager.digests[m][e]])
        layers.append(rows)
    return layers


def run(group: GroupEngine, requests: dict[str, list[int]], move: ExpertPlacement | None = None) -> dict[str, Any]:
    for rid, prompt in requests.items():
        group.add_request(rid, prompt, PARAMS)
    final: dict[str, RequestOutput] = {}
    steps = 0
    while group.has_unfinished():
        for out in group.step():
            if out.finished:
                final[out.request_id] = out
        steps += 1
        if move is not None and steps == 1:
            group.begin_placement(move)
    return final


def settle(group: GroupEngine) -> list[MoveResult]:
    """Idle rounds (as the worker's engine thread runs them) until a move ends."""
    for _ in range(20000):  # a guard against a hang, not a time limit: each pass waits 5 ms at most
        group.keepalive()
        results = group.take_placement_results()
        if results:
            return results
        time.sleep(0.005)
    raise AssertionError("the move never ended")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(build_hf_moe("mixtral-8e-top2", seed=5), tmp_path_factory.mktemp("mixtral"))


def test_moves_on_a_group_of_two(mixtral: Path, tmp_path: Path) -> None:
    path = tmp_path / "model"  # this test changes the files: a copy of its own
    shutil.copytree(mixtral, path)
    loaded = load_model_weights(path)
    requests = {f"r{i}": p for i, p in enumerate(prompts(6, seed=4))}
    single = LLMEngine(loaded, None, EngineConfig(**CONFIG))
    expected = {rid: o.token_ids for rid, o in zip(requests, single.generate(list(requests.values()), PARAMS))}

    master = f"127.0.0.1:{free_port()}"
    out = tmp_path / "follower.json"
    proc = mp.get_context("spawn").Process(target=follower_main, args=(str(path), master, str(out)), daemon=True)
    proc.start()
    channel, ep_group = join_group(2, 0, master, timeout_s=TIMEOUT_S)
    group = GroupEngine(make_engine(str(path), ep_group), channel, ep_group=ep_group)
    versions = trace_versions(group.local)
    try:
        group.greet()
        assert group.placement == BASE and group.placement_version == 0

        # 1. No move: the reference.
        still = run(group, {f"still-{rid}": p for rid, p in requests.items()})
        assert {rid.removeprefix("still-"): o.token_ids for rid, o in still.items()} == expected

        # 2. A move begun mid-flight.
        before = len(versions)
        moved = run(group, requests, move=V1)
        assert group.take_placement_results() == [MoveResult(1, True)]
        assert group.placement == V1
        assert {rid: o.token_ids for rid, o in moved.items()} == expected
        assert all(o.finish_reason is FinishReason.LENGTH and o.error is None for o in moved.values())
        mine = versions[before:]
        assert mine[0] == 0 and mine[-1] == 1 and mine == sorted(mine)  # switched while requests ran
        check_leader_banks(group, loaded.state_dict, V1)

        # 3. An idle move: keepalive completes it.
        group.begin_placement(V2)
        assert settle(group) == [MoveResult(2, True)]
        assert group.placement == V2
        check_leader_banks(group, loaded.state_dict, V2)

        # 4. Staging failures keep the old placement: changed weights, then a missing file.
        tensors = load_file(str(path / "model.safetensors"))
        tensors[CHANGED] = tensors[CHANGED] + 1.0
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        group.begin_placement(V3)
        [failed] = settle(group)
        assert (failed.version, failed.ok) == (3, False)
        assert "expert 6 of model layer 0" in failed.reason and "changed on disk" in failed.reason
        assert group.placement == V2
        (path / "model.safetensors").unlink()
        group.begin_placement(V3)
        [missing] = settle(group)
        assert (missing.version, missing.ok) == (3, False) and "FileNotFoundError" in missing.reason
        after = run(group, {f"after-{rid}": p for rid, p in list(requests.items())[:3]})
        assert {rid.removeprefix("after-"): o.token_ids for rid, o in after.items()} == \
            {rid: expected[rid] for rid in list(requests)[:3]}
        assert group.placement == V2 and versions[-1] == 2

        # 5. Refusals.
        with pytest.raises(PlacementRefused, match="not newer"):
            group.begin_placement(V2)
        with pytest.raises(PlacementRefused, match="ranks of"):
            group.begin_placement(ExpertPlacement.static(3, 8, 2).with_layers(ExpertPlacement.static(3, 8, 2).layers))
        group.begin_placement(ExpertPlacement(2, 8, 5, V2.layers, version=9))
        with pytest.raises(PlacementRefused, match="in progress"):
            group.begin_placement(ExpertPlacement(2, 8, 5, V2.layers, version=10))
        [no_files] = settle(group)  # nothing changes on any rank: ready at once, though the files are gone
        assert no_files == MoveResult(9, True)
    finally:
        group.close()
        proc.join(timeout=TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == EXIT_STOPPED
    follower = json.loads(out.read_text())
    assert follower["versions"] == versions  # every step, the same version on both ranks
    assert set(versions) == {0, 1, 2}  # version 9 came after the last step
    for m, rows in enumerate(follower["banks"]):
        assert [e for e, _ in rows] == list(V2.layers[m][5:])
        assert all(ok for _, ok in rows)


def check_leader_banks(group: GroupEngine, state: dict[str, torch.Tensor], placement: ExpertPlacement) -> None:
    spr = placement.slots_per_rank
    for m, block in enumerate(moe_blocks(group.local.runner.model)):
        bank = block.experts.bank  # type: ignore[attr-defined]
        assert bank.slots.tolist() == list(placement.layers[m][:spr])
        for row, e in enumerate(bank.slots.tolist()):
            if e == -1:
                assert not bank.gate_up[row].any()
                continue
            p = f"layers.{m}.experts.{e}."
            assert torch.equal(bank.gate_up[row], torch.cat([state[p + "gate_proj"], state[p + "up_proj"]]))
            assert torch.equal(bank.down[row], state[p + "down_proj"])
