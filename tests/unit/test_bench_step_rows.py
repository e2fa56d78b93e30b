"""bench/bench_step_rows.py's pieces: its guesser proposes exactly k tokens every step (so every verification
step has the rows the bench names), and the multiply-adds it divides by the FMA peak are the model's."""

from __future__ import annotations

from types import SimpleNamespace

from bench.bench_step_rows import RowsProposer, macs_per_row
from deepinfer.engine.request import SamplingParams
from deepinfer.engine.speculative.base import SpecContext


def ctx(ids: list[int]) -> SpecContext:
    return SpecContext("r", ids, 2, SamplingParams())


def test_the_guesser_proposes_exactly_k_tokens_from_the_last_tokens_previous_occurrence() -> None:
    [a, b, c] = RowsProposer().propose([ctx([5, 6, 7, 8, 5]), ctx([1, 2, 3]), ctx([4, 9, 4])], [2, 3, 4])
    assert a.token_ids == [6, 7]  # what followed the earlier 5
    assert b.token_ids == [3, 3, 3]  # no earlier 3: the last token repeated
    assert c.token_ids == [9, 4, 4, 4]  # what followed, then padded
    assert [len(p.token_ids) for p in RowsProposer().propose([ctx([1])] * 3, [1, 8, 16])] == [1, 8, 16]


def test_macs_per_row_counts_the_projections_and_the_lm_head() -> None:
    config = SimpleNamespace(num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576, intermediate_size=1536,
                             num_layers=30, vocab_size=49152)
    per_layer = 576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536
    assert macs_per_row(SimpleNamespace(model_config=config)) == 30 * per_layer + 49152 * 576  # type: ignore[arg-type]
