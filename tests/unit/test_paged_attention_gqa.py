"""The kernel's grouped GQA path (each K/V chunk loaded once for up to 4 query heads of a kv head):
every group shape it splits G into (2, 3, 4 heads and mixes of them), head dims with and without a
remainder of the 32-dim PV chunks, block sizes that leave a remainder of the 4-token QK groups, and
contexts that end inside a block, for fp32 and fp16 K/V, against the torch reference."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import paged_decode_attention, paged_decode_attention_reference
from tests.unit.test_paged_attention_kernel import _make, needs_native

TOL = {"rtol": 1e-5, "atol": 1e-5}
LENS = [1, 3, 16, 17, 45, 130, 257]


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [16, 4, 5])
@pytest.mark.parametrize("head_dim", [64, 128, 40])
@pytest.mark.parametrize("group", [2, 3, 4, 5, 6, 7, 8])
def test_grouped_heads_match_reference(group, head_dim, block_size, dtype):
    q, k, v, bt, cl = _make(batch=len(LENS), heads=2 * group, kv_heads=2, head_dim=head_dim,
                            block_size=block_size, context_lens=LENS, seed=group * 1000 + head_dim + block_size)
    k, v = k.to(dtype), v.to(dtype)
    scale = head_dim**-0.5
    out = paged_decode_attention(q, k, v, bt, cl, scale)
    torch.testing.assert_close(out, paged_decode_attention_reference(q, k, v, bt, cl, scale), **TOL)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_row_result_does_not_depend_on_its_batch(dtype):
    """A row computed alone equals the same row inside a batch, bit for bit (contexts short enough
    never to be split into parts, which would change the rounding legitimately)."""
    lens = [1, 7, 16, 29, 64, 100, 128]
    q, k, v, bt, cl = _make(batch=len(lens), heads=9, kv_heads=3, head_dim=64, block_size=16, context_lens=lens)
    k, v = k.to(dtype), v.to(dtype)
    full = paged_decode_attention(q, k, v, bt, cl, 0.125)
    for b in range(len(lens)):
        alone = paged_decode_attention(q[b : b + 1], k, v, bt[b : b + 1], cl[b : b + 1], 0.125)
        assert torch.equal(alone[0], full[b])
