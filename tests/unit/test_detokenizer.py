"""Incremental detokenization: whole characters only, stop strings across token boundaries, bounded work."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from deepinfer.text.detokenizer import IncrementalDetokenizer, TextDelta
from deepinfer.text.tokenizer import Tokenizer

TEXTS = [
    "plain ascii text, nothing special",
    "emoji 😀👍🏽🇺🇸 in a row",
    "中文字符测试，你好世界。",
    "mixed: café 😀 中文 ok\n\tend",
]


@pytest.fixture(scope="module")
def byte_tokenizer() -> Tokenizer:
    """Byte-level BPE with hardly any merges: every multi-byte character spans several tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    backend = Backend(models.BPE(vocab, merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<|end|>", special=True, normalized=False)])
    return Tokenizer(backend, eos_token="<|end|>")


def _run(det: IncrementalDetokenizer, ids: Sequence[int], sizes: Sequence[int] | None = None) -> list[TextDelta]:
    out, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)] if sizes else 1
        out.append(det.push(ids[i : i + n]))
        i, k = i + n, k + 1
    out.append(det.flush())
    return out


@pytest.mark.parametrize("sizes", [[1], [2], [3], [5], [1, 4, 2, 7]], ids=str)
def test_deltas_concatenate_to_full_decode(byte_tokenizer: Tokenizer, sizes: list[int]) -> None:
    for text in TEXTS:
        ids = byte_tokenizer.encode(text)
        deltas = _run(IncrementalDetokenizer(byte_tokenizer), ids, sizes)
        assert "".join(d.text for d in deltas) == byte_tokenizer.decode(ids) == text
        assert not any("\ufffd" in d.text for d in deltas)
        assert not any(d.stopped for d in deltas)


def test_partial_character_is_held_until_complete(byte_tokenizer: Tokenizer) -> None:
    ids = byte_tokenizer.encode("😀")
    assert len(ids) == 4
    det = IncrementalDetokenizer(byte_tokenizer)
    assert [det.push([i]).text for i in ids] == ["", "", "", "😀"]


def test_flush_releases_an_incomplete_character(byte_tokenizer: Tokenizer) -> None:
    det = IncrementalDetokenizer(byte_tokenizer)
    ids = byte_tokenizer.encode("a😀")
    assert det.push(ids[:3]).text == "a"
    assert det.flush().text == "\ufffd"


def test_stop_string_across_token_boundaries(byte_tokenizer: Tokenizer) -> None:
    ids = byte_tokenizer.encode("hello world. STOP and more")
    det = IncrementalDetokenizer(byte_tokenizer, stop=["STOP"])
    deltas = [det.push([i]) for i in ids]
    stop_at = next(k for k, d in enumerate(deltas) if d.stopped)
    assert "".join(d.text for d in deltas) == "hello world. "
    assert deltas[stop_at].stop_string == "STOP" and det.stopped
    # "S", "T", "O" were held as a possible stop; the stop completes at "P".
    assert byte_tokenizer.decode(ids[: stop_at + 1]).endswith("STOP")
    assert all(d.stopped and d.text == "" for d in deltas[stop_at + 1 :])
    assert det.flush() == TextDelta("", True, "STOP")


def test_held_prefix_is_released_when_it_is_no_stop(byte_tokenizer: Tokenizer) -> None:
    ids = byte_tokenizer.encode("a STAR")
    det = IncrementalDetokenizer(byte_tokenizer, stop=["STOP"])
    texts = [det.push([i]).text for i in ids]
    assert texts == ["a", " ", "", "", "STA", "R"]
    det = IncrementalDetokenizer(byte_tokenizer, stop=["STOP"])
    assert det.push(byte_tokenizer.encode("end ST")).text == "end "
    assert det.flush().text == "ST"


def test_earliest_stop_string_wins(byte_tokenizer: Tokenizer) -> None:
    det = IncrementalDetokenizer(byte_tokenizer, stop=["world", "lo w"])
    delta = det.push(byte_tokenizer.encode("hello world"))
    assert delta == TextDelta("hel", True, "lo w")


def test_multibyte_stop_string(byte_tokenizer: Tokenizer) -> None:
    ids = byte_tokenizer.encode("你好。再见")
    deltas = _run(IncrementalDetokenizer(byte_tokenizer, stop=["。再"]), ids)
    assert "".join(d.text for d in deltas) == "你好"
    assert any(d.stopped for d in deltas)
    assert not any("\ufffd" in d.text for d in deltas)


def test_prompt_context_is_not_emitted_or_stopped_on(byte_tokenizer: Tokenizer) -> None:
    prompt = byte_tokenizer.encode("say STOP then ")
    det = IncrementalDetokenizer(byte_tokenizer, prompt_ids=prompt, stop=["STOP"])
    deltas = _run(det, byte_tokenizer.encode("hello"), [2])
    assert "".join(d.text for d in deltas) == "hello"
    assert not det.stopped


def test_skip_special_tokens(byte_tokenizer: Tokenizer) -> None:
    end = byte_tokenizer.token_to_id("<|end|>")
    ids = [*byte_tokenizer.encode("ab"), end, *byte_tokenizer.encode("c")]
    assert "".join(d.text for d in _run(IncrementalDetokenizer(byte_tokenizer), ids)) == "ab<|end|>c"
    skipping = IncrementalDetokenizer(byte_tokenizer, skip_special_tokens=True)
    assert "".join(d.text for d in _run(skipping, ids)) == "abc"


def test_work_per_call_is_bounded(byte_tokenizer: Tokenizer) -> None:
    class Counting:
        decoded = 0

        def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
            Counting.decoded += len(ids)
            return byte_tokenizer.decode(ids, skip_special_tokens)

    ids = byte_tokenizer.encode("中文 😀 text " * 200)
    det = IncrementalDetokenizer(Counting())
    text = "".join(det.push([i]).text for i in ids) + det.flush().text
    assert text == byte_tokenizer.decode(ids)
    # Each call decodes the previous delta's tokens (≤ 4 for a held character) and the new one, twice.
    assert Counting.decoded <= 16 * len(ids)


@pytest.mark.smollm2
def test_real_tokenizer_random_batches(smollm2_path: Path) -> None:
    tok = Tokenizer.from_gguf(smollm2_path)
    rng = random.Random(0)
    text = "Résumé: 😀🤖 中文测试 — naïve café\n```python\nprint('hi')\n``` 👍🏽 " * 5
    ids = tok.encode(text)
    for _ in range(5):
        sizes = [rng.randint(1, 4) for _ in range(16)]
        deltas = _run(IncrementalDetokenizer(tok, stop=["STOP"]), ids, sizes)
        assert "".join(d.text for d in deltas) == tok.decode(ids) == text
        assert not any("\ufffd" in d.text for d in deltas)


def test_invalid_bytes_are_released_after_a_bound(byte_tokenizer: Tokenizer) -> None:
    invalid = byte_tokenizer.token_to_id("ÿ")  # the byte 0xFF, never valid UTF-8
    det = IncrementalDetokenizer(byte_tokenizer)
    texts = [det.push([invalid]).text for _ in range(40)]
    assert "".join(texts) + det.flush().text == "\ufffd" * 40
    assert sum(len(t) for t in texts[:30]) >= 16  # released while generation goes on


@pytest.mark.parametrize("size", [5, 7], ids=str)
def test_a_run_of_characters_split_at_every_push_is_never_broken(byte_tokenizer: Tokenizer, size: int) -> None:
    # 4 tokens a character, pushed 5 (or 7) at a time: no push ends on a character's end for 20 (28) tokens, past
    # the bound on held tokens. Found streaming a run of emoji through the mesh (each an incomplete character at
    # the end of nearly every batch): the window was released at the bound with its last character as U+FFFD.
    text = "😀" * 12
    ids = byte_tokenizer.encode(text)
    deltas = _run(IncrementalDetokenizer(byte_tokenizer), ids, [size])
    assert "".join(d.text for d in deltas) == text
    assert not any("\ufffd" in d.text for d in deltas)
