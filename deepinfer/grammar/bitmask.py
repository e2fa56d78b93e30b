"""Token bitmasks and applying them to logits, in plain torch (no torch.compile, no custom kernel).

Layout (llguidance's): one int32 row of `ceil(vocab / 32)` words per batch row; bit i of word w allows token
32 * w + i. A little-endian machine stores token 8 * b + j as bit j of byte b of the row, which is what lets
the masking below work a byte at a time.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

if sys.byteorder != "little":  # pragma: no cover - every supported CPU is little-endian
    raise ImportError("deepinfer.grammar's bitmasks assume a little-endian machine")

# Byte value -> the additive mask of its 8 tokens (0 for a set bit, -inf for a clear one), per dtype. Turning a
# row into a float mask is then one embedding lookup of its bytes (~35 us for 49k tokens on one core), where
# shifting bits out with broadcast ops and masked_fill costs ~5x that.
_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    table = _TABLES.get((dtype, device))
    if table is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        table = torch.zeros(256, 8, dtype=dtype).masked_fill_(bits == 0, float("-inf")).to(device)
        _TABLES[(dtype, device)] = table
    return table


def mask_words(n_vocab: int) -> int:
    return (n_vocab + 31) // 32


def new_bitmask(batch: int, n_vocab: int) -> torch.Tensor:
    """A [batch, mask_words] int32 bitmask with every token allowed."""
    return torch.full((batch, mask_words(n_vocab)), -1, dtype=torch.int32)


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set to -inf, in place, every logit of `logits[r]` whose bit in `bitmask[r]` is clear, for r in `rows`.

    `logits` is a float [batch, vocab] tensor, `bitmask` a CPU int32 [>= batch, >= ceil(vocab / 32)] tensor
    aligned with it row for row; rows not listed are not read or written, so unconstrained requests share the
    batch untouched. `rows` must be distinct. Allowed logits keep their exact value (0 is added); a masked logit
    becomes -inf whatever it was, unless it was +inf or NaN (a model never produces those).
    """
    if not rows:
        return
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"expected 2-D logits and a 2-D int32 bitmask, got {tuple(logits.shape)} and "
                         f"{bitmask.dtype} {tuple(bitmask.shape)}")
    vocab = logits.shape[1]
    if bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"a bitmask of {bitmask.shape[1]} words covers {bitmask.shape[1] * 32} tokens, not {vocab}")
    index = torch.as_tensor(rows, dtype=torch.long)
    words = bitmask.index_select(0, index)[:, : mask_words(vocab)].contiguous()
    row_bytes = words.view(torch.uint8).long().to(logits.device)
    table = _table(logits.dtype, logits.device)
    additive = torch.nn.functional.embedding(row_bytes, table).view(len(rows), -1)[:, :vocab]
    logits.index_add_(0, index.to(logits.device), additive)
