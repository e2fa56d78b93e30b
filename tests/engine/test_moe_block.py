"""The sparse MLP block alone against a naive per-token reference, and the expert bank split the way
expert parallelism will split it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer.config.model import MoEConfig
from deepinfer.engine.models.moe import ExpertBank, SparseMoE, expert_linear, route_softmax_topk, run_experts

H, W, S = 24, 16, 20  # hidden, expert width, shared-expert width


def random_state(moe: MoEConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    sd = {"layers.0.router": w(moe.num_experts, H)}
    for e in range(moe.num_experts):
        sd |= {f"layers.0.experts.{e}.gate_proj": w(W, H), f"layers.0.experts.{e}.up_proj": w(W, H),
               f"layers.0.experts.{e}.down_proj": w(H, W)}
    if moe.shared_expert_intermediate_size:
        sd |= {"layers.0.shared_expert.gate_proj": w(S, H), "layers.0.shared_expert.up_proj": w(S, H),
               "layers.0.shared_expert.down_proj": w(H, S), "layers.0.shared_expert_gate": w(1, H)}
    return sd


def swiglu(x: torch.Tensor, sd: dict[str, torch.Tensor], p: str) -> torch.Tensor:
    return sd[p + "down_proj"] @ (F.silu(sd[p + "gate_proj"] @ x) * (sd[p + "up_proj"] @ x))


def naive(x: torch.Tensor, sd: dict[str, torch.Tensor], moe: MoEConfig) -> torch.Tensor:
    """Token by token, expert by expert: the definition the block must compute."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(sd["layers.0.router"] @ x[t], dim=-1)
        chosen = sorted(range(moe.num_experts), key=lambda e: -float(probs[e]))[: moe.num_experts_per_tok]
        total = sum(float(probs[e]) for e in chosen) if moe.norm_topk_prob else 1.0
        for e in chosen:
            out[t] += float(probs[e]) / total * swiglu(x[t], sd, f"layers.0.experts.{e}.")
        if moe.shared_expert_intermediate_size:
            gate = torch.sigmoid(sd["layers.0.shared_expert_gate"] @ x[t])
            out[t] += gate * swiglu(x[t], sd, "layers.0.shared_expert.")
    return out


CASES = {
    "mixtral-top2-of-8": MoEConfig(8, 2, W),
    "top1-of-4": MoEConfig(4, 1, W),
    "all-8-of-8": MoEConfig(8, 8, W),
    "qwen-unnormed-shared": MoEConfig(6, 3, W, norm_topk_prob=False, shared_expert_intermediate_size=S,
                                      shared_expert_gated=True),
    "qwen-normed-shared": MoEConfig(6, 2, W, shared_expert_intermediate_size=S, shared_expert_gated=True),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("tokens", [1, 5, 300])  # 300: past linear()'s small-batch path
def test_block_matches_naive_reference(case: str, tokens: int) -> None:
    moe = CASES[case]
    sd = random_state(moe)
    block = SparseMoE.from_state(sd, 0, moe)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens))
    torch.testing.assert_close(block(x), naive(x, sd, moe), atol=1e-5, rtol=1e-5)


def test_routing_is_token_major_and_renormalised() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 1.0]])
    r = route_softmax_topk(logits, 2, normalize=True)
    assert r.token.tolist() == [0, 0, 1, 1] and r.expert.tolist() == [1, 2, 0, 3]
    torch.testing.assert_close(r.weight.view(2, 2).sum(-1), torch.ones(2))
    raw = route_softmax_topk(logits, 2, normalize=False)
    torch.testing.assert_close(raw.weight, torch.softmax(logits, -1).gather(1, raw.expert.view(2, 2)).view(-1))


def test_banks_splitting_the_experts_sum_to_the_whole() -> None:
    """Each rank's bank computes its experts' share; the shares add up to the single-bank result."""
    moe = MoEConfig(8, 3, W)
    sd = random_state(moe, seed=1)
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(2))
    routing = route_softmax_topk(x @ sd["layers.0.router"].T, moe.num_experts_per_tok, normalize=True)
    whole = run_experts(x, routing, ExpertBank.from_state(sd, "layers.0.", 8))
    parts = [run_experts(x, routing, ExpertBank.from_state(sd, "layers.0.", 8, ids)) for ids in ([5, 0, 2], [7, 1],
                                                                                               [3, 4, 6])]
    torch.testing.assert_close(sum(parts), whole, atol=1e-6, rtol=1e-6)
    # A bank none of the tokens chose contributes exactly nothing.
    unused = sorted(set(range(8)) - set(routing.expert.tolist()))
    if unused:
        assert not run_experts(x, routing, ExpertBank.from_state(sd, "layers.0.", 8, unused)).any()


def test_bank_refuses_bad_expert_ids() -> None:
    sd = random_state(MoEConfig(4, 2, W))
    for ids in ([0, 0], [4], [-1], []):
        with pytest.raises(ValueError, match="expert ids"):
            ExpertBank.from_state(sd, "layers.0.", 4, ids)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(192, 576), (576, 96), (48, 64), (64, 24)])  # smollm2-moe's, the tests'
def test_an_expert_row_gets_the_same_bits_in_any_call(shape: tuple[int, int], threads: int) -> None:
    """Expert parallelism splits an expert's rows between calls differently from one process (replicas,
    local rows apart from received ones); the exact EP combine needs each row's product unchanged."""
    gen = torch.Generator().manual_seed(shape[0])
    w = torch.randn(shape, generator=gen)
    x = torch.randn(200, shape[1], generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        whole = expert_linear(x, w)
        torch.set_num_threads(threads)
        for start, rows in [(0, 1), (5, 2), (7, 3), (0, 4), (9, 17), (3, 64), (60, 65), (11, 128), (1, 199)]:
            assert torch.equal(expert_linear(x[start:start + rows], w), whole[start:start + rows]), (start, rows)
    finally:
        torch.set_num_threads(before)
