"""Expert parallelism across real processes: two ranks (spawned, gloo over tcp on 127.0.0.1, one torch
thread each) serving tiny seeded random Mixtral, Qwen2-MoE and DeepSeek-V3 (MLA, group-limited routing)
models, each rank holding half the experts.

* Requests split across the ranks (different lengths, one rank idle at first and finishing early, so it
  joins steps with empty batches) give greedy outputs token for token equal to one engine holding every
  expert; so do all requests on one rank, replicated experts, and n-gram speculation.
* The per-expert counts summed over the ranks equal the single engine's counts.
* A rank that dies mid-run makes the survivor's `step()` raise `ExpertParallelError` (and refuse to
  step again) instead of hanging.

The ranks run all scenarios in one spawn (process start-up dominates on a small machine).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer.config.engine import EngineConfig
from deepinfer.config.model import ConfigError
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.ep.experts import ExpertParallelExperts
from deepinfer.engine.ep.group import EpGroup, ExpertParallelError, cpu_threads_per_rank, init_ep_group
from deepinfer.engine.ep.placement import ExpertPlacement
from deepinfer.engine.models.moe import moe_blocks
from deepinfer.engine.request import SamplingParams
from deepinfer.loading.weights import load_model_weights
from tests.engine.deepseek_models import build_hf_deepseek
from tests.engine.deepseek_models import save as save_deepseek
from tests.engine.moe_models import VOCAB, build_hf_moe, save

WORLD = 2
TIMEOUT_S = 20.0  # gloo's: a dead peer is usually noticed at once (closed socket), at worst after this
JOIN_LIMIT_S = 600.0  # the parent's guard against a hung child, far above any expected run
MODELS = {"mixtral": "mixtral-8e-top2", "qwen2moe": "qwen2moe-shared-norm-dense1"}
DEEPSEEK = "v3-qlora-dense1-yarn"


def engine_config(speculative: str | None = None) -> EngineConfig:
    # Fixed draft lengths: the adaptive controller would pick them from measured (machine-dependent) times.
    # No redundant replicas: the shares checked below are the static table's contiguous blocks.
    return EngineConfig(block_size=4, num_kv_blocks=160, max_num_batched_tokens=48, use_native_kernels=False,
                        speculative=speculative, num_speculative_tokens=3, adaptive_speculation=False,
                        redundant_experts=0)


@dataclass(frozen=True)
class Req:
    rid: str
    length: int
    max_tokens: int
    rank: int = 0
    join_step: int = 0  # the lockstep step at which its rank adds it

    def prompt(self) -> list[int]:
        rng = random.Random(self.length * 31 + self.max_tokens)
        # Repeats make n-gram speculation find drafts.
        head = [rng.randrange(3, VOCAB) for _ in range(max(1, self.length // 2))]
        return (head * 3)[: self.length]


@dataclass(frozen=True)
class Scenario:
    model: str
    requests: tuple[Req, ...]
    redundant: int = 0
    speculative: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# Rank 1 starts idle (its request joins at step 3) and finishes long before rank 0.
SPLIT = (Req("a", 5, 14, rank=0), Req("b", 17, 20, rank=0), Req("c", 33, 6, rank=0),
         Req("d", 9, 4, rank=1, join_step=3))
ONE_RANK = tuple(Req(r.rid, r.length, r.max_tokens, rank=1) for r in SPLIT)
SCENARIOS: dict[str, Scenario] = {
    "mixtral-split": Scenario("mixtral", SPLIT),
    "mixtral-one-rank": Scenario("mixtral", ONE_RANK),
    "mixtral-replicas": Scenario("mixtral", SPLIT, redundant=3),
    "mixtral-ngram": Scenario("mixtral", SPLIT, speculative="ngram"),
    "qwen2moe-split": Scenario("qwen2moe", SPLIT),
    # DeepSeek-V3: MLA attention, a dense first layer, a shared expert, group-limited sigmoid routing.
    "deepseek-split": Scenario("deepseek", SPLIT),
}


def params(r: Req) -> SamplingParams:
    return SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- inside a rank ----------------------------------------------------------------------------------


def lockstep(engine: LLMEngine, group: EpGroup, requests: list[Req]) -> dict[str, list[int]]:
    """Step every rank together until no rank has work: after each step the ranks vote over the control
    group (the job of a group leader in a service)."""
    final: dict[str, list[int]] = {}
    step = 0
    while True:
        for r in requests:
            if r.join_step == step:
                engine.add_request(r.rid, r.prompt(), params(r))
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.token_ids
        step += 1
        busy = engine.has_unfinished() or any(r.join_step >= step for r in requests)
        vote = torch.tensor([int(busy)])
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=group.cpu_group)
        if not vote.item():
            return final


def held(engine: LLMEngine) -> list[list[int]]:
    """Per MoE layer, the logical experts this rank's executor holds."""
    banks = [b.experts.bank for b in moe_blocks(engine.runner.model)]  # type: ignore[attr-defined]
    return [[] if bank is None else bank.ids.tolist() for bank in banks]


def rank_scenarios(rank: int, master: str, model_dirs: dict[str, str], out: str) -> None:
    torch.set_num_threads(1)
    group = init_ep_group(WORLD, rank, master, timeout_s=TIMEOUT_S)
    results: dict[str, Any] = {}
    try:
        loaded = {name: load_model_weights(Path(d)) for name, d in model_dirs.items()}
        for name, sc in SCENARIOS.items():
            placement = None
            if sc.redundant:
                layers = sum(loaded[sc.model].config.moe.is_sparse_layer(i)  # type: ignore[union-attr]
                             for i in range(loaded[sc.model].config.num_layers))
                placement = ExpertPlacement.static(layers, loaded[sc.model].config.moe.num_experts,  # type: ignore[union-attr]
                                                   WORLD, sc.redundant)
            engine = LLMEngine(loaded[sc.model], config=engine_config(sc.speculative), ep_group=group,
                               ep_placement=placement)
            outputs = lockstep(engine, group, [r for r in sc.requests if r.rank == rank])
            stats = engine.ep_stats()
            assert stats is not None
            results[name] = {"outputs": outputs, "counts": engine.expert_counts().tolist(), "held": held(engine),
                             "empty_steps": engine.stats.ep_empty_steps, "exchanges": stats.exchanges,
                             "rows_sent": stats.rows_sent, "rows_received": stats.rows_received}
        # Refusals, checked on a live group.
        engine = LLMEngine(loaded["mixtral"], config=engine_config(), ep_group=group)
        # A share built straight from the state dict is the share copied out of the full bank.
        assert engine.ep_placement is not None
        sd = {k: v.float() for k, v in loaded["mixtral"].state_dict.items()}
        direct = ExpertParallelExperts.from_state(sd, "layers.1.", engine.ep_placement, 1, group)
        sharded = moe_blocks(engine.runner.model)[1].experts
        assert isinstance(sharded, ExpertParallelExperts) and direct.bank is not None and sharded.bank is not None
        results["from_state_matches"] = bool(torch.equal(direct.bank.gate_up, sharded.bank.gate_up)
                                             and torch.equal(direct.bank.down, sharded.bank.down))
        try:
            engine.prompt_logits([5, 6, 7])
        except NotImplementedError as exc:
            results["prompt_logits_refused"] = str(exc)
        try:
            engine.generate([[5, 6, 7]])
        except NotImplementedError as exc:
            results["generate_refused"] = str(exc)
        try:
            LLMEngine(loaded["mixtral"], config=engine_config("self:1"), ep_group=group)
        except ConfigError as exc:
            results["self_draft_refused"] = str(exc)
    finally:
        group.close()
    Path(out).write_text(json.dumps(results))


def rank_dies(rank: int, master: str, model_dir: str, out: str) -> None:
    """Rank 1 steps three times and kills itself; rank 0 keeps stepping and records what step() raised."""
    torch.set_num_threads(1)
    group = init_ep_group(WORLD, rank, master, timeout_s=TIMEOUT_S)
    engine = LLMEngine(load_model_weights(Path(model_dir)), config=engine_config(), ep_group=group)
    engine.add_request("long", Req("long", 7, 400).prompt(), SamplingParams(max_tokens=400, ignore_eos=True))
    result: dict[str, Any] = {}
    for step in range(400):
        if rank == 1 and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            engine.step()
        except ExpertParallelError as exc:
            result = {"raised": type(exc).__name__, "message": str(exc), "step": step,
                      "outputs": [(o.request_id, o.finished, o.finish_reason.value) for o in exc.outputs]}
            break
    try:
        engine.step()
    except ExpertParallelError as exc:
        result["refused_after"] = str(exc)
    group.close()
    Path(out).write_text(json.dumps(result))


# -- the parent -------------------------------------------------------------------------------------


def spawn(target: Any, args: tuple[Any, ...], tmp: Path, ok_exit: tuple[set[int], ...]) -> list[dict[str, Any]]:
    """Run `target(rank, master, *args, out)` on WORLD spawned ranks; their results as written."""
    ctx = mp.get_context("spawn")
    master = f"127.0.0.1:{free_port()}"
    outs = [tmp / f"rank{r}.json" for r in range(WORLD)]
    procs = [ctx.Process(target=target, args=(r, master, *args, str(outs[r]))) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(JOIN_LIMIT_S)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    for r, p in enumerate(procs):
        assert p.exitcode in ok_exit[r], f"rank {r} exited with {p.exitcode}"
    return [json.loads(o.read_text()) if o.exists() else {} for o in outs]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    dirs = {name: str(save(build_hf_moe(variant, seed=7), tmp_path_factory.mktemp(name)))
            for name, variant in MODELS.items()}
    dirs["deepseek"] = str(save_deepseek(build_hf_deepseek(DEEPSEEK, seed=7), tmp_path_factory.mktemp("deepseek")))
    return dirs


@pytest.fixture(scope="module")
def reference(model_dirs: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Each scenario's requests in one engine holding every expert: outputs and expert counts."""
    torch.set_num_threads(1)
    loaded = {name: load_model_weights(Path(d)) for name, d in model_dirs.items()}
    results = {}
    for name, sc in SCENARIOS.items():
        engine = LLMEngine(loaded[sc.model], config=engine_config(sc.speculative))
        outs = engine.generate([r.prompt() for r in sc.requests], [params(r) for r in sc.requests])
        results[name] = {"outputs": {r.rid: o.token_ids for r, o in zip(sc.requests, outs)},
                         "counts": engine.expert_counts().tolist()}
    return results


@pytest.fixture(scope="module")
def ranks(model_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn(rank_scenarios, (model_dirs,), tmp_path_factory.mktemp("ep"), ({0}, {0}))


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_outputs_equal_single_process(scenario: str, ranks: list[dict[str, Any]],
                                             reference: dict[str, dict[str, Any]]) -> None:
    got: dict[str, list[int]] = {}
    for r in range(WORLD):
        mine = {q.rid for q in SCENARIOS[scenario].requests if q.rank == r}
        assert set(ranks[r][scenario]["outputs"]) == mine
        got |= ranks[r][scenario]["outputs"]
    assert got == reference[scenario]["outputs"]


# With speculation the drafts a step takes depend on its batch (the token budget is shared), so the
# tokens forwarded, and their counts, differ between one engine and two; the outputs do not.
@pytest.mark.parametrize("scenario", [name for name, sc in SCENARIOS.items() if sc.speculative is None])
def test_expert_counts_sum_to_single_process(scenario: str, ranks: list[dict[str, Any]],
                                             reference: dict[str, dict[str, Any]]) -> None:
    summed = sum(torch.tensor(ranks[r][scenario]["counts"]) for r in range(WORLD))
    expected = torch.tensor(reference[scenario]["counts"])
    assert summed.shape == expected.shape and expected.sum() > 0
    assert torch.equal(summed, expected)


def test_each_rank_holds_its_share(ranks: list[dict[str, Any]]) -> None:
    # Mixtral: 8 experts in every one of 3 layers; Qwen2-MoE: 6 experts, layer 1 dense (2 MoE layers).
    assert ranks[0]["mixtral-split"]["held"] == [[0, 1, 2, 3]] * 3
    assert ranks[1]["mixtral-split"]["held"] == [[4, 5, 6, 7]] * 3
    assert ranks[0]["qwen2moe-split"]["held"] == [[0, 1, 2]] * 2
    assert ranks[1]["qwen2moe-split"]["held"] == [[3, 4, 5]] * 2
    # DeepSeek: 8 routed experts, layer 0 dense (one MoE layer per remaining layer).
    assert ranks[0]["deepseek-split"]["held"][0] == [0, 1, 2, 3]
    assert ranks[1]["deepseek-split"]["held"][0] == [4, 5, 6, 7]
    # Three replicas: one each of 0, 4 and 1, on the rank after their home.
    assert ranks[0]["mixtral-replicas"]["held"] == [[0, 1, 2, 3, 4]] * 3
    assert ranks[1]["mixtral-replicas"]["held"] == [[4, 5, 6, 7, 0, 1]] * 3
    assert all(ranks[r]["from_state_matches"] for r in range(WORLD))


def test_ranks_step_in_lockstep_and_idle_ranks_join_empty(ranks: list[dict[str, Any]]) -> None:
    for name in SCENARIOS:
        # Every rank ran the same MoE-layer exchanges: one per MoE layer per step, empty steps included.
        assert ranks[0][name]["exchanges"] == ranks[1][name]["exchanges"] > 0
    # Rank 1 waited three steps for its request, then finished early; with everything on rank 1, rank 0
    # only ever joined with empty batches yet still computed its experts for rank 1's tokens.
    assert ranks[1]["mixtral-split"]["empty_steps"] > 3
    for r in range(WORLD):  # tokens did cross between the ranks both ways
        assert ranks[r]["mixtral-split"]["rows_sent"] > 0 and ranks[r]["mixtral-split"]["rows_received"] > 0
    assert ranks[0]["mixtral-one-rank"]["rows_sent"] == 0
    assert ranks[0]["mixtral-one-rank"]["rows_received"] > 0
    assert ranks[1]["mixtral-one-rank"]["empty_steps"] == 0


def test_refusals_under_expert_parallelism(ranks: list[dict[str, Any]]) -> None:
    for r in range(WORLD):
        assert "collective" in ranks[r]["prompt_logits_refused"]
        assert "lockstep" in ranks[r]["generate_refused"]
        assert "ngram or suffix" in ranks[r]["self_draft_refused"]


def test_dead_rank_makes_survivor_step_raise(model_dirs: dict[str, str], tmp_path: Path) -> None:
    survivor, _ = spawn(rank_dies, (model_dirs["mixtral"],), tmp_path, ({0}, {-signal.SIGKILL}))
    assert survivor["raised"] == "ExpertParallelError"
    assert survivor["step"] >= 3
    # The step's request ended with an error output, carried by the exception; the engine stays refused.
    assert survivor["outputs"] == [["long", True, "error"]]
    assert "failed earlier" in survivor["refused_after"]


# -- without processes ------------------------------------------------------------------------------


def test_cpu_share_is_cores_over_ranks_at_least_one() -> None:
    assert [cpu_threads_per_rank(n, cores=16) for n in (1, 2, 3, 16, 32)] == [16, 8, 5, 1, 1]


@pytest.mark.parametrize("size, rank, master, device, match", [
    (2, 2, "127.0.0.1:1", "cpu", "outside a group"),
    (2, 0, "127.0.0.1", "cpu", "host:port"),
    (2, 0, ":29500", "cpu", "host:port"),
    (2, 0, "127.0.0.1:1", "mps", "cpu or cuda"),
])
def test_init_refuses_bad_arguments(size: int, rank: int, master: str, device: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        init_ep_group(size, rank, master, device)
    assert not dist.is_initialized()


def test_engine_refuses_a_dense_model_and_a_foreign_device(tiny_llama: Any) -> None:
    """Checked before any collective, so a group that was never joined will do."""
    fake = EpGroup(2, 0, torch.device("cpu"), data=None, cpu_group=None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="no sparse blocks"):
        LLMEngine(tiny_llama, config=engine_config(), ep_group=fake)
    on_gpu = EpGroup(2, 0, torch.device("cuda", 0), data=None, cpu_group=None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="not the expert-parallel group's"):
        LLMEngine(tiny_llama, config=engine_config(), ep_group=on_gpu)
