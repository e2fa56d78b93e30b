"""The measurement of a derived MoE against the dense model it came from: perplexity on a fixed text and the
expert load, by the plain-torch forward in `derive_moe` (what `deepinfer-launch fetch smollm2-moe --report` prints
and `bench/moe_skew.py` sweeps)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from deepinfer.loading.derive_moe import EVAL_TEXT, forward, load_moe_dir


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    """exp of the mean next-token cross-entropy over the sequence."""
    return math.exp(F.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:])).item())


def expert_load(routes: list[torch.Tensor], num_experts: int) -> np.ndarray:
    """[layers, E] tokens routed to each expert (a token counts once for each of its k experts)."""
    return np.stack([np.bincount(r.reshape(-1).numpy(), minlength=num_experts) for r in routes])


@dataclass(frozen=True)
class MoeReport:
    tokens: int
    dense_perplexity: float
    moe_perplexity: float
    load: np.ndarray  # [layers, E] tokens per expert

    @property
    def skew(self) -> np.ndarray:
        """Per layer: the busiest expert's load over the mean load (1.0 = perfectly even)."""
        return self.load.max(axis=1) / self.load.mean(axis=1)

    def format(self) -> str:
        lines = [
            f"fixed text: {self.tokens} tokens ({EVAL_TEXT.name})",
            f"perplexity: dense {self.dense_perplexity:.3f}  derived MoE {self.moe_perplexity:.3f} "
            f"(x{self.moe_perplexity / self.dense_perplexity:.2f})",
            f"expert load max/mean: worst layer {self.skew.max():.2f} (layer {int(self.skew.argmax())}), "
            f"mean over layers {self.skew.mean():.2f}",
            "tokens per expert, per layer:",
        ]
        lines += [f"  layer {i:2d}: {' '.join(f'{n:4d}' for n in row)}   max/mean {s:.2f}"
                  for i, (row, s) in enumerate(zip(self.load, self.skew))]
        return "\n".join(lines)


def moe_report(gguf: str | os.PathLike[str], moe_dir: str | os.PathLike[str], text: str | None = None) -> MoeReport:
    """Perplexity of the dense model and of the derived directory on the fixed text, and the expert load."""
    from deepinfer.loading.weights import load_model_weights
    from deepinfer.text.tokenizer import Tokenizer

    dense = load_model_weights(gguf)
    ids = Tokenizer.from_gguf(gguf).encode(EVAL_TEXT.read_text() if text is None else text)
    dense_logits, _ = forward(dense.config, dense.state_dict, ids)
    del dense
    moe = load_moe_dir(moe_dir)
    moe_logits, routes = forward(moe.config, moe.base, ids, moe)
    return MoeReport(len(ids), perplexity(dense_logits, ids), perplexity(moe_logits, ids),
                     expert_load(routes, moe.num_experts))
