"""Decode attention runs rows that share a block table's first block (a speculating sequence's verification
rows, sequences with a common cached prefix) one after another, so the later rows read the context from
cache. That changes only the order of the work: the same rows over copies of the blocks (no two rows
sharing a first block, so no grouping) give the same bits, at any thread count."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import native_available, paged_decode_attention

pytestmark = pytest.mark.skipif(not native_available(), reason="native paged attention kernel unavailable")


@pytest.mark.parametrize("context,threads", [(40, 1), (300, 2), (1300, 2), (1300, 3)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_grouped_rows_give_the_ungrouped_bits(context, threads, kv_dtype):
    torch.manual_seed(context + threads)
    heads, kv_heads, d, bs, rows = 9, 3, 64, 16, 5
    nb = (context + rows + bs - 1) // bs
    seqs = 3  # three speculating sequences of `rows` verification rows each, then one lone decode row
    total = seqs * rows + 1
    num_blocks = (seqs + 1) * nb
    k = torch.randn(num_blocks, bs, kv_heads, d).to(kv_dtype)
    v = torch.randn(num_blocks, bs, kv_heads, d).to(kv_dtype)
    lens = torch.tensor([context + r + 1 for _ in range(seqs) for r in range(rows)] + [context], dtype=torch.int32)
    shared = [list(range(s * nb, (s + 1) * nb)) for s in range(seqs + 1)]
    grouped = torch.tensor([shared[s] for s in range(seqs) for _ in range(rows)] + [shared[seqs]], dtype=torch.int32)
    # The same contexts in private copies: each verification row reads its own copy of its sequence's blocks.
    private = []
    for i in range(total):
        src = grouped[i].tolist()
        if i < seqs * rows:
            private.append(list(range(k.shape[0], k.shape[0] + nb)))
            k, v = torch.cat([k, k[src]]), torch.cat([v, v[src]])
        else:
            private.append(src)
    private_t = torch.tensor(private, dtype=torch.int32)
    q = torch.randn(total, heads, d)
    torch.set_num_threads(threads)
    a = paged_decode_attention(q, k, v, grouped, lens, d**-0.5)
    b = paged_decode_attention(q, k, v, private_t, lens, d**-0.5)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("context", [40, 300, 1300, 5000])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_a_row_gets_the_same_bits_in_any_batch(context, kv_dtype):
    """Batch invariance: a row's context is split into parts by its own length, so the row decoded alone, beside
    other requests of other lengths, or as one of its sequence's verification rows gets the same bits."""
    torch.manual_seed(context)
    heads, kv_heads, d, bs = 9, 3, 64, 16
    others = [7, 2000, 130, 900]
    lens = [context] + others
    nbs = [(c + bs - 1) // bs for c in lens]
    width = max(nbs)
    starts = [sum(nbs[:i]) for i in range(len(nbs))]
    k = torch.randn(sum(nbs), bs, kv_heads, d).to(kv_dtype)
    v = torch.randn(sum(nbs), bs, kv_heads, d).to(kv_dtype)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, (s, n) in enumerate(zip(starts, nbs)):
        table[i, :n] = torch.arange(s, s + n, dtype=torch.int32)
    q = torch.randn(len(lens), heads, d)
    alone = paged_decode_attention(q[:1], k, v, table[:1], torch.tensor(lens[:1], dtype=torch.int32), 0.125)
    batched = paged_decode_attention(q, k, v, table, torch.tensor(lens, dtype=torch.int32), 0.125)
    assert torch.equal(alone[0].view(torch.int32), batched[0].view(torch.int32))
    # as the last of five verification rows of its sequence (contexts context - 4 .. context)
    rows = torch.tensor([context - 4 + i for i in range(5)], dtype=torch.int32).clamp(min=1)
    verify = paged_decode_attention(q[:1].repeat(5, 1, 1), k, v, table[:1].repeat(5, 1), rows, 0.125)
    assert torch.equal(alone[0].view(torch.int32), verify[4].view(torch.int32))
