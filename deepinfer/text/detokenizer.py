"""Incremental detokenization: token ids in batches → text deltas, with stop strings.

Each call decodes only a short window: the tokens of the previous delta (context, so decoders that
depend on neighbours stay right) plus the new ones, and takes the text past the context's own
decoding. A delta never ends in an incomplete UTF-8 character: a trailing run of U+FFFD is held
back, with its tokens, until later tokens complete the character.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

# Tokens of prompt context decoded before the first generated token.
PROMPT_CONTEXT_TOKENS = 6
# A trailing U+FFFD still there after this many held tokens is a real replacement character (the
# model produced invalid bytes), not a character waiting for its last bytes; it is released.
MAX_HELD_TOKENS = 16
_MAX_CHAR_TOKENS = 4  # a UTF-8 character has at most 4 bytes, so at most 4 byte-level tokens of its own


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


@dataclass(frozen=True)
class TextDelta:
    text: str  # new text since the previous call
    stopped: bool = False  # a stop string was found: `text` ends just before it and nothing follows
    stop_string: str | None = None


class IncrementalDetokenizer:
    """Turns one sequence's generated ids into text deltas; O(new tokens) per call."""

    def __init__(
        self,
        tokenizer: Decoder,
        *,
        prompt_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        skip_special_tokens: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # _ids[:_read] is context already turned into text; _ids[_read:] are newer tokens, of whose
        # text the first _sent characters are already emitted.
        self._ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        self._read = len(self._ids)
        self._sent = 0
        self._stops = tuple(s for s in stop if s)
        self._longest_stop = max((len(s) for s in self._stops), default=0)
        self._held_text = ""  # decoded, but possibly the start of a stop string
        self.stopped = False
        self.stop_string: str | None = None

    def push(self, token_ids: Sequence[int]) -> TextDelta:
        """Feed newly generated ids; returns the text that is now certain."""
        if self.stopped:
            return TextDelta("", True, self.stop_string)
        self._ids.extend(token_ids)
        return self._release(self._decode_new(final=False), final=False)

    def flush(self) -> TextDelta:
        """The sequence ended: release everything held back (an incomplete character as U+FFFD)."""
        if self.stopped:
            return TextDelta("", True, self.stop_string)
        return self._release(self._decode_new(final=True), final=True)

    def _decode_new(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        start = len(self._decode(self._ids[: self._read])) + self._sent
        text = self._decode(self._ids)
        if final or len(self._ids) - self._read >= MAX_HELD_TOKENS:
            # The window may end mid-character; no context may carry that into a later window.
            self._ids, self._read, self._sent = [], 0, 0
            return text[start:]
        # Text before a trailing run of U+FFFD is final; the run may still become a character.
        settled = len(text.rstrip("\ufffd"))
        new = text[start:settled]
        if settled == len(text) and new:
            # All whole characters: the unread tokens become the context of the next window.
            self._ids = self._ids[self._read :]
            self._read, self._sent = len(self._ids), 0
        else:
            self._sent += len(new)
            if new:
                self._move_to_whole(text[:settled])
        return new

    def _move_to_whole(self, settled: str) -> None:
        """The window ends in part of a character, after whole ones that are now sent: make the tokens before
        that part the next window's context, so a run of characters that every push splits (emoji, CJK: several
        tokens each) keeps the window short instead of reaching MAX_HELD_TOKENS and breaking a character."""
        unread = len(self._ids) - self._read
        for k in range(1, min(_MAX_CHAR_TOKENS, unread - 1) + 1):
            if self._decode(self._ids[: len(self._ids) - k]) == settled:  # the last k tokens: only the part
                self._ids = self._ids[self._read :]
                self._read, self._sent = len(self._ids) - k, 0
                return

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""

    def _release(self, new: str, final: bool) -> TextDelta:
        text = self._held_text + new
        if not self._stops:
            return TextDelta(text)
        # No stop string can begin in text emitted earlier: a suffix that starts one is always held,
        # so searching `text` (held + new) finds every occurrence.
        hits = [(text.find(s), s) for s in self._stops if s in text]
        if hits:
            at, stop = min(hits, key=lambda hit: hit[0])
            self.stopped, self.stop_string, self._held_text = True, stop, ""
            return TextDelta(text[:at], True, stop)
        keep = 0 if final else self._stop_prefix_length(text)
        self._held_text = text[len(text) - keep :] if keep else ""
        return TextDelta(text[: len(text) - keep])

    def _stop_prefix_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that a stop string starts with."""
        for k in range(min(len(text), self._longest_stop - 1), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
