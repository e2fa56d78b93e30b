"""Sampling exactness of speculative decoding: with a draft model that samples, the rejection rule
must leave the distribution of every generated token exactly the target's.

Thousands of seeded requests of one prompt run with and without a draft model; the empirical
distributions of the tokens at positions 1-3 (drafted, verified) and of the pair at positions 1-2
are compared with a two-sample chi-square test at p = 0.001. The same test must reject a
deliberately wrong rule — resampling from the target's p instead of norm(max(0, p - q)) after a
rejection, the classic bug — so it has the power to catch one. The draft is the target with
perturbed weights: its q overlaps p but differs from it, the case where rule errors show.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import SamplingParams
from deepinfer.engine.speculative import verify as verify_module

N = 2000
PROMPT = [11, 57, 203, 9, 140, 77, 31]
PARAMS = dict(max_tokens=4, temperature=1.0, top_k=8, top_p=0.95, repetition_penalty=1.1, ignore_eos=True)


@pytest.fixture(scope="module")
def perturbed_draft_dir(tiny_llama_dir, tmp_path_factory):
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lm_head" in name or "layers.1.mlp" in name:
                param.add_(torch.randn(param.shape, generator=g) * param.std())
    path = tmp_path_factory.mktemp("perturbed-draft")
    model.save_pretrained(path)
    return path


def sample(loaded, speculative: str | None, n: int = N) -> tuple[list[list[int]], LLMEngine]:  # type: ignore[no-untyped-def]
    e = LLMEngine(loaded, None, EngineConfig(block_size=4, num_kv_blocks=1200, max_num_seqs=256,
                                              max_num_batched_tokens=4096, speculative=speculative,
                                              num_speculative_tokens=3, adaptive_speculation=False))
    outs = e.generate([PROMPT] * n, [SamplingParams(seed=i, **PARAMS) for i in range(n)])
    return [o.token_ids for o in outs], e


def chi_square_two_sample(a: Counter, b: Counter) -> tuple[float, int]:
    """Statistic and degrees of freedom; categories with fewer than 10 observations in total are
    pooled into one (the approximation needs non-tiny cells)."""
    keys = set(a) | set(b)
    small = [k for k in keys if a[k] + b[k] < 10]
    cells = [(a[k], b[k]) for k in keys if k not in small]
    if small:
        cells.append((sum(a[k] for k in small), sum(b[k] for k in small)))
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for x, y in cells:
        # The two-sample statistic for possibly unequal totals.
        stat += (x * math.sqrt(nb / na) - y * math.sqrt(na / nb)) ** 2 / (x + y)
    return stat, len(cells) - 1


def critical(dof: int, z: float = 3.09) -> float:
    """Chi-square quantile at p = 0.001 (Wilson-Hilferty)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def max_statistic(ref: list[list[int]], got: list[list[int]]) -> float:
    """The largest statistic / critical-value ratio over positions 1, 2, 3 and the pair (1, 2)."""
    worst = 0.0
    views = [lambda t, j=j: t[j] for j in (1, 2, 3)] + [lambda t: (t[1], t[2])]
    for view in views:
        stat, dof = chi_square_two_sample(Counter(map(view, ref)), Counter(map(view, got)))
        worst = max(worst, stat / critical(dof))
    return worst


@pytest.fixture(scope="module")
def plain(tiny_llama):
    return sample(tiny_llama, None)[0]


def test_draft_sampling_keeps_the_target_distribution(tiny_llama, perturbed_draft_dir, plain):
    got, e = sample(tiny_llama, f"draft:{perturbed_draft_dir}")
    rate = e.stats.spec_accepted_tokens / e.stats.spec_proposed_tokens
    assert 0.15 < rate < 0.95, rate  # the draft is neither useless nor the target itself
    assert got != plain  # different draws (the rule's own streams), same distribution:
    assert max_statistic(plain, got) < 1.0
    # ...and reproducible: a seeded request repeats itself for the same drafts.
    again, _ = sample(tiny_llama, f"draft:{perturbed_draft_dir}", n=200)
    assert again == got[:200]


def test_a_wrong_rejection_rule_is_caught(tiny_llama, perturbed_draft_dir, plain, monkeypatch):
    # The classic bug: after a rejection, draw from p instead of the residual max(0, p - q).
    monkeypatch.setattr(verify_module, "residual", lambda p, q: p.clone())
    got, _ = sample(tiny_llama, f"draft:{perturbed_draft_dir}")
    assert max_statistic(plain, got) > 1.0


def test_a_wrong_acceptance_test_is_caught(tiny_llama, perturbed_draft_dir, plain, monkeypatch):
    # Accepting with probability p(d), forgetting to divide by q(d): right only for a point mass.
    monkeypatch.setattr(verify_module, "accept_draft", lambda p_d, q_d, u: u < p_d)
    got, _ = sample(tiny_llama, f"draft:{perturbed_draft_dir}")
    assert max_statistic(plain, got) > 1.0
