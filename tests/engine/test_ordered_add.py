"""The ordered scatter-add kernel against torch's index_add_ over the gathered rows: the same bits."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import ordered_add as oa


def _case(seed: int, tokens: int, hidden: int, sizes: list[int], entries: int):
    gen = torch.Generator().manual_seed(seed)
    sources = [torch.randn(r, hidden, generator=gen) * 10 ** torch.randint(-3, 4, (r, 1), generator=gen)
               for r in sizes]
    out = torch.randn(tokens, hidden, generator=gen)
    token = torch.randint(0, tokens, (entries,), generator=gen)
    row = torch.randint(0, sum(sizes), (entries,), generator=gen)
    return out, token, row, sources


def test_the_kernel_builds_here() -> None:
    assert oa.native_available()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("tokens", "hidden", "sizes", "entries"), [
    (1, 1, [1], 1), (7, 576, [5, 0, 9], 40), (300, 576, [2000, 1500, 700], 4200), (16, 100, [3], 0),
    (64, 130, [40, 40], 500),  # a width that is not a whole number of column chunks
])
def test_equals_index_add_over_the_gathered_rows(threads: int, tokens: int, hidden: int, sizes: list[int],
                                                 entries: int) -> None:
    out, token, row, sources = _case(tokens + entries, tokens, hidden, sizes, entries)
    want = out.clone()
    oa.ordered_add_reference(want, token, row, sources)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        oa.ordered_add(out, token, row, sources)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out, want)


def test_a_token_adds_its_rows_in_entry_order() -> None:
    # 1e8 + 1 - 1e8 is 0 in fp32 but 1e8 - 1e8 + 1 is 1: the order shows in the result.
    out = torch.zeros(1, 3)
    rows = torch.tensor([[1e8] * 3, [1.0] * 3, [-1e8] * 3])
    oa.ordered_add(out, torch.zeros(3, dtype=torch.int64), torch.tensor([0, 1, 2]), [rows])
    assert out.tolist() == [[0.0] * 3]
    oa.ordered_add(out, torch.zeros(3, dtype=torch.int64), torch.tensor([0, 2, 1]), [rows[:2], rows[2:]])
    assert out.tolist() == [[1.0] * 3]


def test_strided_sources_and_a_strided_output() -> None:
    out, token, row, sources = _case(3, 9, 32, [12, 7], 50)
    wide = torch.zeros(9, 48)
    view = wide[:, 8:40]
    view.copy_(out)
    padded = [torch.cat([s, torch.ones(s.shape[0], 5)], dim=1)[:, :32] for s in sources]
    oa.ordered_add(view, token, row, padded)
    oa.ordered_add_reference(out, token, row, sources)
    assert torch.equal(view, out) and bool((wide[:, :8] == 0).all()) and bool((wide[:, 40:] == 0).all())


@pytest.mark.parametrize(("token", "row"), [([0, 9], [0, 1]), ([0, -1], [0, 1]), ([0, 1], [0, 19]), ([0, 1], [-1, 0])])
def test_an_index_out_of_range_is_refused_and_nothing_is_added(token: list[int], row: list[int]) -> None:
    out, _, _, sources = _case(5, 9, 16, [12, 7], 0)
    before = out.clone()
    with pytest.raises(IndexError):
        oa.ordered_add(out, torch.tensor(token), torch.tensor(row), sources)
    assert torch.equal(out, before)
