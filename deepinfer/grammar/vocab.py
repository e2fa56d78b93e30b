"""The model's vocabulary as llguidance sees it, built from the project's own tokenizer (no transformers)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance

from deepinfer.text.tokenizer import Tokenizer

# Building one takes ~0.4-1 s (llguidance walks every token's bytes); a process serves one or two models.
_MAX_CACHED = 4


@dataclass(frozen=True, slots=True)
class GrammarVocab:
    """An `llguidance.LLTokenizer` plus what masks are sized by.

    Invariants: `n_vocab` is the model's logits width, at least the tokenizer's size (ids past the tokenizer's
    last token stand for no text, so no grammar ever allows them); `eos_token_ids` are the ids the engine ends
    a request on, and a constraint allows them exactly when its grammar may end. Immutable and safe to share
    between threads.
    """

    llg: llguidance.LLTokenizer
    n_vocab: int
    eos_token_ids: tuple[int, ...]
    fingerprint: str

    @property
    def mask_words(self) -> int:
        """int32 words in one bitmask row: bit i of word w allows token 32 * w + i."""
        return (self.n_vocab + 31) // 32


_cache: OrderedDict[tuple[str, int, tuple[int, ...]], GrammarVocab] = OrderedDict()
_cache_lock = threading.Lock()


def grammar_vocab(tokenizer: Tokenizer, *, n_vocab: int, eos_token_ids: Sequence[int] | None = None) -> GrammarVocab:
    """The llguidance vocabulary for `tokenizer` with masks `n_vocab` wide, built once per (tokenizer, n_vocab,
    EOS ids) and cached.

    `eos_token_ids` defaults to the tokenizer's; pass the engine's own when they differ (the engine ends a request
    on these, so these are what a finished grammar allows). Raises ValueError when `n_vocab` is smaller than the
    tokenizer or there is no EOS id. Thread-safe; a miss blocks every caller for the build, so call it at startup
    or off the step loop.
    """
    eos = tuple(dict.fromkeys(tokenizer.eos_token_ids if eos_token_ids is None else eos_token_ids))
    if not eos:
        raise ValueError("a grammar needs at least one EOS token id to end on")
    if n_vocab < tokenizer.vocab_size:
        raise ValueError(f"n_vocab {n_vocab} is smaller than the tokenizer's {tokenizer.vocab_size} tokens")
    if any(not 0 <= i < n_vocab for i in eos):
        raise ValueError(f"EOS ids {eos} fall outside the vocabulary of {n_vocab}")
    key = (tokenizer.fingerprint, n_vocab, eos)
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit
        # The tokenizer's JSON already has the post-processor removed (specials are added by Tokenizer), which
        # is what llguidance wants: it tokenizes forced text itself and must not add BOS/EOS.
        llt = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=n_vocab, eos_token=list(eos))
        vocab = GrammarVocab(llt, n_vocab, eos, tokenizer.fingerprint)
        _cache[key] = vocab
        while len(_cache) > _MAX_CACHED:
            _cache.popitem(last=False)
        return vocab
