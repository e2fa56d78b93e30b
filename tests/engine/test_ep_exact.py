"""The expert-parallel executor's output is bit-identical to one bank holding every expert, whatever the
placement, on two real ranks (spawned, gloo on 127.0.0.1).

Each trial draws a placement (static with 0, 2 or 5 redundant replicas, its slots shuffled across the
ranks), a top-k (1, 2 or 12 of 16) and a batch per rank (empty and one-row batches included, different on
the two ranks). Both wire layouts (dense rows with a per-forward size gather, sparse rows with a header)
must return exactly `run_experts` over the full bank. The test also shows it can fail: adding each rank's
partial sum in rank order (what the executor did before it returned every assignment's output) differs
from that in the last bits for some of the same trials.
"""

from __future__ import annotations

import json
import random
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from deepinfer.engine.ep.experts import BatchSizes, ExpertParallelExperts, dense_rows
from deepinfer.engine.ep.group import init_ep_group
from deepinfer.engine.ep.placement import ExpertPlacement
from deepinfer.engine.models.moe import ExpertBank, Routing, run_experts
from deepinfer.kernels import ep_route

HIDDEN, INTER, EXPERTS = 64, 24, 16
TRIALS = 14
# (rank 0, rank 1) batch rows, cycled over the trials. The last two, always with top-12, give an expert
# more rows on the rank computing it than in either rank's own batch, past 64 rows (where `linear` would
# switch from the few-rows kernel to the GEMM, a switch of last bits these trials caught).
ROWS = ((0, 5), (1, 0), (3, 16), (16, 2), (40, 40), (60, 60), (150, 90))


def _placement(trial: int) -> ExpertPlacement:
    rng = random.Random(trial)
    static = ExpertPlacement.static(1, EXPERTS, 2, rng.choice([0, 2, 5]))
    slots = list(static.layers[0])
    for _ in range(100):  # a shuffle that keeps one replica of an expert per rank
        rng.shuffle(slots)
        try:
            return ExpertPlacement(2, EXPERTS, static.slots_per_rank, (tuple(slots),))
        except ValueError:
            continue
    return static


def _batch(trial: int, rank: int) -> tuple[torch.Tensor, Routing]:
    rows = ROWS[trial % len(ROWS)][rank]
    top_k = 12 if trial % len(ROWS) >= 5 else random.Random(1000 + trial).choice([1, 2, 12])
    gen = torch.Generator().manual_seed(100 * trial + rank)
    x = torch.randn(rows, HIDDEN, generator=gen)
    weights, experts = torch.randn(rows, EXPERTS, generator=gen).softmax(-1).topk(top_k, dim=-1)
    tokens = torch.arange(rows).repeat_interleave(top_k)
    return x, Routing(tokens, experts.reshape(-1), weights.reshape(-1))


def _rank(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    group = init_ep_group(2, rank, f"127.0.0.1:{port}", timeout_s=60.0)
    gen = torch.Generator().manual_seed(0)
    full = ExpertBank._of(torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen),
                          torch.randn(EXPERTS, HIDDEN, INTER, generator=gen), list(range(EXPERTS)), EXPERTS)
    results = []
    for trial in range(TRIALS):
        placement = _placement(trial)
        x, routing = _batch(trial, rank)
        want = run_experts(x, routing, full)
        row: dict[str, bool] = {}
        for layout in ("dense", "sparse"):
            sizes = BatchSizes() if layout == "dense" else None
            executor = ExpertParallelExperts.from_bank(full, placement, 0, group, sizes=sizes)
            row[layout] = torch.equal(executor(x, routing), want)
        # The old combine: each rank's partial sum of its experts, added in rank order.
        dest = ep_route.split(routing, x.shape[0], executor._replica_ranks, executor._num_replicas,
                              executor.bank.slot_of, 0, rank, torch.zeros(EXPERTS, dtype=torch.int64)).dest
        by_rank = torch.zeros_like(x)
        for r in range(2):
            mine = dest == r
            by_rank = by_rank + run_experts(x, Routing(routing.token[mine], routing.expert[mine],
                                                       routing.weight[mine]), full)
        row["rank_order"] = torch.equal(by_rank, want)
        results.append(row)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    group.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_both_layouts_equal_one_bank_of_every_expert_bit_for_bit(tmp_path: Path) -> None:
    mp.start_processes(_rank, args=(_free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(2)]
    for rank, rows in enumerate(ranks):
        for trial, row in enumerate(rows):
            assert row["dense"] and row["sparse"], f"rank {rank} trial {trial}: {row}"
    # Rank-order partial sums are not the same bits: the equality above is a real constraint.
    assert any(not row["rank_order"] for rows in ranks for row in rows)


def test_layout_choice_follows_the_expected_share_of_ranks_a_token_reaches() -> None:
    assert dense_rows(2, 12) and dense_rows(2, 2) and dense_rows(2, 1)  # 1 - (1/2)^1 = 1/2
    assert not dense_rows(4, 2)  # 1 - (3/4)^2 = 0.44
    assert not dense_rows(32, 8)  # DeepSeek-V3 at EP 32: 0.22
    assert dense_rows(8, 8)  # 0.66
    assert not dense_rows(2, None)


def test_a_forward_that_skips_the_first_moe_layer_is_refused() -> None:
    sizes = BatchSizes()
    with pytest.raises(RuntimeError, match="gathered"):
        sizes.of(0, 3)
    sizes.rows = [3, 5]
    assert sizes.of(1, 5) == [3, 5]
    with pytest.raises(RuntimeError, match="gathered"):
        sizes.of(0, 4)
