"""The pure and single-process parts of an expert placement move (deepinfer/engine/ep/move.py):
banks with empty rows, which local slots a move changes, what a group refuses, the weight source reading
experts straight from the model files (per-expert and fused tensors), a rank's stage-then-switch on one
process (no collectives: the executors are built on a group that is never joined), the digest check that
refuses changed files, and the leader's bookkeeping with a fake engine."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer.config.engine import EngineConfig
from deepinfer.config.model import ConfigError
from deepinfer.engine.ep.experts import ExpertParallelExperts, redundant_replicas
from deepinfer.engine.ep.group import EpGroup
from deepinfer.engine.ep.move import (
    ExpertSource,
    MoveResult,
    PlacementRefused,
    PlacementStager,
    changed_rows,
    check_successor,
    expert_digests,
    moe_layer_indices,
)
from deepinfer.engine.ep.placement import ExpertPlacement
from deepinfer.engine.models.moe import ExpertBank, route_softmax_topk, run_experts
from deepinfer.loading.weights import load_model_weights
from deepinfer.services.group.control import Op
from deepinfer.services.group.moves import PlacementMoves
from tests.engine.moe_models import build_hf_moe, save

pytestmark = pytest.mark.timeout(300)

E, H, W = 6, 8, 5  # experts, hidden, expert intermediate


def random_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for e in range(E):
        sd[f"layers.0.experts.{e}.gate_proj"] = torch.randn(W, H, generator=g)
        sd[f"layers.0.experts.{e}.up_proj"] = torch.randn(W, H, generator=g)
        sd[f"layers.0.experts.{e}.down_proj"] = torch.randn(H, W, generator=g)
    return sd


def test_a_bank_with_empty_rows_computes_only_its_experts() -> None:
    sd = random_state()
    full = ExpertBank.from_state(sd, "layers.0.", E)
    bank = full.slotted([4, -1, 1, -1])
    assert bank.slots.tolist() == [4, -1, 1, -1] and bank.ids.tolist() == [4, 1]
    assert bank.slot_of.tolist() == [-1, 2, -1, -1, 0, -1]
    assert not bank.gate_up[1].any() and not bank.down[3].any()
    x = torch.randn(20, H, generator=torch.Generator().manual_seed(1))
    routing = route_softmax_topk(torch.randn(20, E, generator=torch.Generator().manual_seed(2)), 2, True)
    expected = run_experts(x, routing, ExpertBank.from_state(sd, "layers.0.", E, [4, 1]))
    assert torch.equal(run_experts(x, routing, bank), expected)
    # A rank holding nothing of a layer: every row empty, nothing computed.
    assert not run_experts(x, routing, full.slotted([-1, -1])).any()
    with pytest.raises(ValueError, match="distinct"):
        full.slotted([1, 1])


def test_install_rewrites_rows_in_place() -> None:
    sd = random_state()
    full = ExpertBank.from_state(sd, "layers.0.", E)
    bank = full.slotted([0, 1, -1])
    gate_up, slot_of = bank.gate_up, bank.slot_of
    # Expert 1 moves from row 1 to row 2, expert 5 arrives in row 1, expert 0 leaves row 0.
    bank.install({0: (-1, None, None), 1: (5, full.gate_up[5], full.down[5]), 2: (1, full.gate_up[1], full.down[1])})
    assert bank.gate_up is gate_up and bank.slot_of is slot_of  # same storage: executors keep their references
    assert bank.slots.tolist() == [-1, 5, 1] and bank.slot_of.tolist() == [-1, 2, -1, -1, -1, 1]
    assert torch.equal(bank.gate_up[1], full.gate_up[5]) and torch.equal(bank.down[2], full.down[1])
    assert not bank.gate_up[0].any()
    with pytest.raises(ValueError, match="distinct"):  # refused before anything is written
        bank.install({0: (5, full.gate_up[5], full.down[5])})
    assert bank.slots.tolist() == [-1, 5, 1]


def test_changed_rows_and_successor_checks() -> None:
    current = ExpertPlacement(2, 4, 3, ((0, 1, -1, 2, 3, -1),))
    new = ExpertPlacement(2, 4, 3, ((0, 3, 1, 2, -1, 0),), version=1)
    assert changed_rows(current, new, 0, 0) == {1: 3, 2: 1}
    assert changed_rows(current, new, 0, 1) == {1: -1, 2: 0}
    check_successor(current, new)
    with pytest.raises(PlacementRefused, match="not newer"):
        check_successor(new, current)
    with pytest.raises(PlacementRefused, match="not newer"):
        check_successor(new, new)
    with pytest.raises(PlacementRefused, match="ranks of"):
        check_successor(current, ExpertPlacement.static(1, 4, 2).with_layers([[0, 1, 2, 3]]))
    with pytest.raises(PlacementRefused, match="not an expert-parallel"):
        check_successor(None, new)


def test_redundant_replicas_default_and_limits() -> None:
    assert redundant_replicas(None, 8, 2) == 1
    assert redundant_replicas(None, 64, 4) == 8
    assert redundant_replicas(None, 2, 2) == 1
    assert redundant_replicas(None, 4, 1) == 0  # a single rank holds no replicas
    assert redundant_replicas(0, 8, 2) == 0 and redundant_replicas(8, 8, 2) == 8
    with pytest.raises(ConfigError, match="at most 8"):
        redundant_replicas(9, 8, 2)
    with pytest.raises(ConfigError, match="negative"):
        EngineConfig(redundant_experts=-1)


# -- the weight source and one rank's stager -----------------------------------------------------------------


@pytest.fixture(scope="module", params=["per-expert", "fused"])
def mixtral_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    fused = request.param == "fused"
    return save(build_hf_moe("mixtral-8e-top2", seed=3), tmp_path_factory.mktemp(request.param), fused=fused)


def test_source_reads_experts_as_loaded(mixtral_dir: Path) -> None:
    loaded = load_model_weights(mixtral_dir)
    source = ExpertSource(mixtral_dir, loaded.config)
    got = source.read(2, [6, 1])
    for e in (6, 1):
        for t, proj in zip(got[e], ("gate_proj", "up_proj", "down_proj")):
            assert torch.equal(t, loaded.state_dict[f"layers.2.experts.{e}.{proj}"])
    with pytest.raises(KeyError):
        source.read(7, [0])  # no such layer


class FakeGroup(EpGroup):
    def __init__(self, rank: int) -> None:
        super().__init__(2, rank, torch.device("cpu"), data=None, cpu_group=None)  # type: ignore[arg-type]


def rank_stager(path: Path, rank: int, placement: ExpertPlacement) -> tuple[PlacementStager, Any]:
    loaded = load_model_weights(path)
    layers = moe_layer_indices(loaded.config)
    executors = [ExpertParallelExperts.from_state(loaded.state_dict, f"layers.{i}.", placement, m, FakeGroup(rank))
                 for m, i in enumerate(layers)]
    digests = expert_digests(loaded.state_dict, loaded.config)
    return PlacementStager(executors, placement, ExpertSource(path, loaded.config), digests, rank), loaded


def test_stage_then_switch_rewrites_the_banks(mixtral_dir: Path) -> None:
    current = ExpertPlacement.static(3, 8, 2, redundant=1)  # rank 1: [4, 5, 6, 7, 0]
    layers = [list(s) for s in current.layers]
    spr = current.slots_per_rank
    layers[0][spr : 2 * spr] = [5, 4, 6, 7, 3]  # 4 and 5 trade rows, 3 replaces the replica of 0
    layers[0][:spr] = [0, 1, 2, 3, -1]
    layers[2][spr : 2 * spr] = [4, 5, 6, 7, -1]  # layer 2: the replica of 0 goes
    new = current.with_layers(layers)
    stager, loaded = rank_stager(mixtral_dir, 1, current)
    before = [ex.bank.gate_up.clone() for ex in stager.executors]
    stager.stage(new)
    assert stager.wait(60)
    assert stager.status() == (new.version, None)
    for ex, old in zip(stager.executors, before):  # staging wrote nothing yet
        assert torch.equal(ex.bank.gate_up, old)
    assert stager.switch(new.version) is new and stager.placement is new
    for m, ex in enumerate(stager.executors):
        assert ex.bank.slots.tolist() == list(new.layers[m][spr : 2 * spr])
        for row, e in enumerate(ex.bank.slots.tolist()):
            if e == -1:
                assert not ex.bank.gate_up[row].any() and not ex.bank.down[row].any()
                continue
            sd = loaded.state_dict
            want = torch.cat([sd[f"layers.{m}.experts.{e}.gate_proj"], sd[f"layers.{m}.experts.{e}.up_proj"]])
            assert torch.equal(ex.bank.gate_up[row], want)
            assert torch.equal(ex.bank.down[row], sd[f"layers.{m}.experts.{e}.down_proj"])
        assert ex._num_replicas.tolist() == [len(r) for r in new.replica_ranks(m)]
    assert stager.status() == (None, None)
    with pytest.raises(RuntimeError, match="no placement version"):  # nothing staged any more
        stager.switch(new.version)


def test_changed_weights_fail_the_staging(mixtral_dir: Path) -> None:
    current = ExpertPlacement.static(3, 8, 2)
    new = current.with_layers([[0, 1, 2, 3, 7, 5, 6, 4]] * 3)  # rank 1 keeps its experts, in other rows
    stager, _ = rank_stager(mixtral_dir, 0, current)
    # Rank 0 takes experts 7 and 4 from the files; pretend it was loaded with something else for expert 4.
    newer = current.with_layers([[0, 4, 2, 3, 7, 5, 6, 1]] * 3)
    stager.digests[1][4] = b"not what the files hold"  # type: ignore[index]
    stager.stage(newer)
    assert stager.wait(60)
    version, error = stager.status()
    assert version is None and error is not None
    assert "expert 4 of model layer 1" in error and "changed on disk" in error
    with pytest.raises(RuntimeError):
        stager.switch(newer.version)
    assert stager.executors[1].bank.slots.tolist() == [0, 1, 2, 3]  # the old placement stands
    stager.drop()
    assert stager.status() == (None, None)
    # A rank with nothing to load from the files is ready at once (rows move within the rank only).
    stager_1, _ = rank_stager(mixtral_dir, 1, current)
    stager_1.stage(new)
    assert stager_1.wait(60) and stager_1.status() == (new.version, None)


def test_close_ends_every_loading_thread(mixtral_dir: Path) -> None:
    """A process exits only after `close`: a loading thread alive at interpreter exit aborts the process."""
    current = ExpertPlacement.static(3, 8, 2)
    stager, _ = rank_stager(mixtral_dir, 0, current)
    first = current.with_layers([[0, 4, 2, 3, 7, 5, 6, 1]] * 3)
    stager.stage(first)
    stager.stage(first)  # staging again drops the first staging, whose thread may still be loading
    threads = [t for t in threading.enumerate() if t.name.startswith("stage-placement")]
    assert threads
    assert stager.close(60)
    assert not any(t.is_alive() for t in threads)
    assert stager.status() == (None, None)


# -- the leader's bookkeeping -------------------------------------------------------------------------------


class FakeLocal:
    def __init__(self, placement: ExpertPlacement | None) -> None:
        self.ep_placement = placement
        self.staged: tuple[int | None, str | None] = (None, None)
        self.calls: list[Any] = []

    def stage_placement(self, placement: ExpertPlacement) -> None:
        self.calls.append(("stage", placement.version))

    def staged_placement(self) -> tuple[int | None, str | None]:
        return self.staged

    def drop_staged_placement(self) -> None:
        self.calls.append(("drop",))


def test_moves_switch_once_every_rank_is_ready() -> None:
    current = ExpertPlacement.static(2, 8, 3)
    local = FakeLocal(current)
    queued: list[tuple[int, list[Any]]] = []
    moves = PlacementMoves(local, 3, lambda r, c: queued.append((r, c)))
    new = current.with_layers(current.layers)
    moves.begin(new)
    assert local.calls == [("stage", 1)]
    assert queued == [(1, [Op.STAGE, new.to_dict()]), (2, [Op.STAGE, new.to_dict()])]
    with pytest.raises(PlacementRefused, match="in progress"):
        moves.begin(new.with_layers(new.layers))
    moves.after_round(None, {1: [1, None], 2: [None, None]})
    assert moves.switch_due() is None
    local.staged = (1, None)
    moves.after_round(None, {1: [1, None], 2: [None, None]})
    assert moves.switch_due() is None
    moves.after_round(None, {1: [1, None], 2: [1, None]})
    assert moves.switch_due() == 1
    moves.after_round(1, {1: [None, None], 2: [None, None]})
    assert moves.pending is None and moves.switch_due() is None
    assert moves.take_results() == [MoveResult(1, True)] and moves.take_results() == []


def test_a_staging_error_unstages_everyone() -> None:
    current = ExpertPlacement.static(2, 8, 2)
    local = FakeLocal(current)
    queued: list[tuple[int, list[Any]]] = []
    moves = PlacementMoves(local, 2, lambda r, c: queued.append((r, c)))
    moves.begin(current.with_layers(current.layers))
    local.staged = (1, None)
    moves.after_round(None, {1: [None, "rank 1: the files changed"]})
    assert queued[-1] == (1, [Op.UNSTAGE]) and local.calls[-1] == ("drop",)
    [result] = moves.take_results()
    assert not result.ok and result.version == 1 and "files changed" in result.reason
    assert moves.pending is None and moves.switch_due() is None


def test_a_dense_group_refuses_moves() -> None:
    moves = PlacementMoves(FakeLocal(None), 2, lambda r, c: None)
    with pytest.raises(PlacementRefused, match="not an expert-parallel"):
        moves.begin(ExpertPlacement.static(2, 8, 2, redundant=0).with_layers([[0, 1, 2, 3, 4, 5, 6, 7]] * 2))
