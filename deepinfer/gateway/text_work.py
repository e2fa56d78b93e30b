"""The gateway's tokenizer work, done so that it can run in a thread without stalling the event loop.

A Hugging Face `tokenizers` backend holds the GIL through `encode` (4 MiB of text: ~3 s during which no
other Python thread runs) but releases it in `encode_batch` / `decode_batch`: those are what the gateway
calls, on its offload threads, adding the special tokens as `text.tokenizer.Tokenizer.encode` does. A
tokenizer without such a backend (a test's) is called as it is.

`max_prompt_chars`: no prompt longer than this fits a context of `max_model_len` tokens — each token
decodes to at most the longest vocabulary entry's characters (byte-level and SentencePiece vocabularies
name a token by at most as many characters as it decodes to), doubled for a normaliser that composes
characters (NFC). A prompt past it is refused before anything tokenises it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

NORMALIZER_MARGIN = 2


class TextWork:
    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend", None)
        if not hasattr(self.backend, "encode_batch"):
            self.backend = None
        self.max_prompt_chars: int | None = None
        if self.backend is not None:
            longest = max((len(t) for t in self.backend.get_vocab(with_added_tokens=True)), default=1)
            self.max_prompt_chars = max_model_len * max(1, longest) * NORMALIZER_MARGIN

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.backend is None:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        ids = list(self.backend.encode_batch([text], add_special_tokens=False)[0].ids)
        if add_special_tokens:
            if getattr(self.tokenizer, "add_bos", False):
                ids.insert(0, self.tokenizer.bos_token_id)
            if getattr(self.tokenizer, "add_eos", False):
                ids.append(self.tokenizer.eos_token_ids[0])
        return ids

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The chat template (Python: the GIL is shared with the loop at its switch interval), then encoded.
        `tools`: for a template that renders them itself (its `tools` variable)."""
        extra = {} if tools is None else {"tools": tools}
        if self.backend is None:
            return list(self.tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt, **extra))
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt, **extra)
        return self.encode(text, add_special_tokens=False)  # the template writes any BOS itself

    def decode(self, ids: Sequence[int]) -> str:
        if self.backend is None:
            return str(self.tokenizer.decode(list(ids)))
        return str(self.backend.decode_batch([list(ids)], skip_special_tokens=False)[0])
