"""A MoE router's decision as the expert kernels read it: one record of assignments (token, expert, weight),
and the count of assignments per expert that the balancer's statistics start from."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Routing:
    """Assignment a sends token row `token[a]` to logical expert `expert[a]` with weight `weight[a]`."""

    token: torch.Tensor  # [A] int64
    expert: torch.Tensor  # [A] int64
    weight: torch.Tensor  # [A] fp32


def count_assignments(routing: Routing, num_experts: int) -> torch.Tensor:
    """Assignments per logical expert, [num_experts] int64: a token counts once for each expert it chose."""
    return torch.bincount(routing.expert, minlength=num_experts)
