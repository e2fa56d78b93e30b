"""Tokenizer parity with transformers: ids, decoding and chat templates.

The reference for SmolLM2 is transformers' tokenizer built from the same GGUF, with its
pre-tokenizer set to the one in SmolLM2's own tokenizer.json (Digits(individual_digits) then
ByteLevel). transformers' GGUF converter has no entry for `tokenizer.ggml.pre = smollm` and falls back
to plain GPT-2 splitting, which differs wherever a digit follows whitespace ("x  \\n 5").
"""

from __future__ import annotations

import hashlib
import inspect
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
import pytest
from gguf import GGUFWriter
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from deepinfer.config.gguf_metadata import metadata, open_gguf
from deepinfer.text.tokenizer import Tokenizer
from tests import oracle_memo

CORPUS = [
    "Hello, world!",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "    indented\n\n\n\ttabs\t\tand   spaces   ",
    "你好，世界！这是一个测试。",
    "Emoji: 😀👍🏽🇺🇸 ❤️ 🤖",
    "Numbers 12345, 3.14159 and 1,000,000; x  \n 5 and 2024-01-01",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "inline<|im_end|>special<|endoftext|>tokens <jupyter_code>x",
    "Ünïcödé naïve café résumé Ångström",
    "  leading spaces",
    "trailing spaces   ",
    "",
    " ",
    "\n",
    "a\r\nb",
    "I'm sure they'll say it's fine, don't you think?",
    "Ελληνικά Русский 日本語 한국어 العربية",
    "x=1;y=22;z=333;w=4444",
    "https://example.com/path?q=1&r=2#frag",
    '{"key": [1, 2, {"nested": null}]}',
]
SYSTEM = {"role": "system", "content": "You are terse."}
CHAT = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3? 😀"},
]


def _smollm2_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )


@pytest.fixture(scope="module")
def ours(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_path)


class TransformersTokenizer:
    """transformers' tokenizer built from a GGUF, asked through the oracle memo (tests/oracle_memo.py): with
    `--oracle-memo` and a warm memo it is never built. `smollm2_pre`: with SmolLM2's own pre-tokenizer put in
    (see the module docstring); `unpatched_ids` asks the converter's plain one."""

    def __init__(self, gguf: Path, smollm2_pre: bool = False) -> None:
        self._gguf, self._smollm2_pre = gguf, smollm2_pre
        self._built: tuple[Any, Backend] | None = None
        self._key: str | None = None

    def _tokenizers(self) -> tuple[Any, Backend]:
        if self._built is None:
            from transformers import AutoTokenizer

            ref = AutoTokenizer.from_pretrained(self._gguf.parent, gguf_file=self._gguf.name)
            unpatched = Backend.from_str(ref.backend_tokenizer.to_str())
            if self._smollm2_pre:
                ref.backend_tokenizer.pre_tokenizer = _smollm2_pre_tokenizer()
            self._built = ref, unpatched
        return self._built

    def _ask(self, question: list[Any], answer: Callable[[Any, Backend], Any]) -> Any:
        def key() -> str:
            if self._key is None:
                source = inspect.getsource(TransformersTokenizer) + inspect.getsource(_smollm2_pre_tokenizer)
                self._key = hashlib.sha256(f"{oracle_memo.file_digest(self._gguf)}|{source}".encode()).hexdigest()
            return self._key

        return oracle_memo.remember("tokenizer", key, [self._smollm2_pre, *question],
                                    lambda: answer(*self._tokenizers()))

    def ids(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._ask(["ids", text, add_special_tokens],
                         lambda ref, _: ref(text, add_special_tokens=add_special_tokens)["input_ids"])

    def unpatched_ids(self, text: str) -> list[int]:
        return self._ask(["unpatched", text], lambda _, plain: plain.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._ask(["decode", ids, skip_special_tokens],
                         lambda ref, _: ref.decode(ids, skip_special_tokens=skip_special_tokens))

    def chat(self, messages: list[dict[str, str]], tokenize: bool, add_generation_prompt: bool) -> Any:
        return self._ask(["chat", messages, tokenize, add_generation_prompt],
                         lambda ref, _: ref.apply_chat_template(messages, tokenize=tokenize, return_dict=False,
                                                                add_generation_prompt=add_generation_prompt))

    def save(self, directory: Path) -> None:
        """What `save_pretrained` writes, written into `directory`."""
        def files(ref: Any, _: Backend) -> dict[str, str]:
            with tempfile.TemporaryDirectory() as tmp:
                ref.save_pretrained(tmp)
                return {p.name: p.read_text() for p in Path(tmp).iterdir()}

        for name, text in self._ask(["saved"], files).items():
            (directory / name).write_text(text)


@pytest.fixture(scope="module")
def reference(smollm2_path: Path) -> TransformersTokenizer:
    return TransformersTokenizer(smollm2_path, smollm2_pre=True)


@pytest.mark.smollm2
def test_ids_match_transformers(ours: Tokenizer, reference: TransformersTokenizer) -> None:
    for text in CORPUS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == reference.ids(text, special), text


@pytest.mark.smollm2
def test_unpatched_transformers_agrees_away_from_digits(ours: Tokenizer, reference: TransformersTokenizer) -> None:
    for text in CORPUS:
        if not any(ch.isdigit() for ch in text):
            assert ours.encode(text) == reference.unpatched_ids(text), text


@pytest.mark.smollm2
def test_decode_round_trips(ours: Tokenizer, reference: TransformersTokenizer) -> None:
    for text in CORPUS:
        ids = ours.encode(text)
        assert ours.decode(ids) == text
        assert ours.decode(ids) == reference.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)


@pytest.mark.smollm2
def test_special_tokens_are_never_split(ours: Tokenizer) -> None:
    ids = ours.encode("a<|im_start|>b<|im_end|><empty_output>")
    assert [1, 2, 16] == [i for i in ids if i < 17]
    assert ours.decode(ids, skip_special_tokens=True) == "ab"


@pytest.mark.smollm2
@pytest.mark.parametrize("with_system", [False, True], ids=["no-system", "system"])
@pytest.mark.parametrize("generation_prompt", [True, False], ids=["gen", "no-gen"])
def test_chat_template_matches_transformers(
    ours: Tokenizer, reference: TransformersTokenizer, with_system: bool, generation_prompt: bool
) -> None:
    messages = [SYSTEM, *CHAT] if with_system else CHAT
    want = reference.chat(messages, tokenize=False, add_generation_prompt=generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=generation_prompt) == want
    want_ids = reference.chat(messages, tokenize=True, add_generation_prompt=generation_prompt)
    assert ours.encode_chat(messages, add_generation_prompt=generation_prompt) == want_ids


@pytest.mark.smollm2
def test_properties(ours: Tokenizer, smollm2_path: Path) -> None:
    assert ours.vocab_size == 49152
    assert ours.eos_token_ids == (2,) and ours.bos_token_id == 1
    assert ours.encode("hi")[0] != 1  # the file says add_bos_token = false
    again = Tokenizer.load(smollm2_path)
    assert again.fingerprint == ours.fingerprint
    changed = Tokenizer(ours.backend, chat_template=(ours.chat_template or "") + " ", eos_token="<|im_end|>")
    assert changed.fingerprint != ours.fingerprint


@pytest.mark.smollm2
def test_from_dir_matches(ours: Tokenizer, reference: TransformersTokenizer, tmp_path: Path) -> None:
    reference.save(tmp_path)
    from_dir = Tokenizer.load(tmp_path)
    for text in CORPUS:
        assert from_dir.encode(text) == ours.encode(text), text
    assert from_dir.chat_template == ours.chat_template
    want = reference.chat(CHAT, tokenize=False, add_generation_prompt=True)
    assert from_dir.apply_chat_template(CHAT) == want
    assert from_dir.eos_token_ids == (2,) and from_dir.bos_token_id == 1


def write_tokenizer_gguf(path: Path, tokens: list[str], merges: list[str], types: list[int], pre: str, arch="llama"):
    w = GGUFWriter(path, arch)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.smollm2
@pytest.mark.parametrize(("pre", "arch"), [("llama-bpe", "llama"), ("qwen2", "qwen2")])
def test_other_pre_tokenizers_match_transformers_gguf(smollm2_path: Path, tmp_path: Path, pre: str, arch: str):
    """SmolLM2's vocabulary under another `tokenizer.ggml.pre`: same ids as transformers' converter."""
    reader = open_gguf(smollm2_path)
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    merges = metadata(reader, "tokenizer.ggml.merges")
    types = np.asarray(metadata(reader, "tokenizer.ggml.token_type")).tolist()
    write_tokenizer_gguf(tmp_path / "t.gguf", tokens, merges, types, pre, arch)
    ours = Tokenizer.from_gguf(tmp_path / "t.gguf")
    ref = TransformersTokenizer(tmp_path / "t.gguf")
    for text in CORPUS:
        assert ours.encode(text) == ref.ids(text, add_special_tokens=False), text


def test_unknown_pre_tokenizer_is_refused(tmp_path: Path) -> None:
    write_tokenizer_gguf(tmp_path / "t.gguf", ["a", "b", "ab"], ["a b"], [1, 1, 1], "mystery")
    with pytest.raises(ValueError, match="'mystery'"):
        Tokenizer.from_gguf(tmp_path / "t.gguf")


def test_tiny_gguf_tokenizer(tmp_path: Path) -> None:
    tokens = ["<s>", "a", "b", "ab", "Ġ", "Ġab", "1", "2", "<x>"]
    write_tokenizer_gguf(tmp_path / "t.gguf", tokens, ["a b", "Ġ ab"], [3, 1, 1, 1, 1, 1, 1, 1, 4], "smollm")
    tok = Tokenizer.from_gguf(tmp_path / "t.gguf")
    assert tok.encode("ab ab12<x><s>") == [3, 5, 6, 7, 8, 0]
    assert tok.decode([3, 5, 6, 7, 8, 0], skip_special_tokens=True) == "ab ab12<x>"


def test_missing_tokenizer_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        Tokenizer.load(tmp_path / "nothing.gguf")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.load(tmp_path)


def test_chat_template_sandbox_and_helpers() -> None:
    backend = Backend(models.BPE({"a": 0, "b": 1}, []))
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}"
        "{% if add_generation_prompt %}{{ raise_exception('no generation') }}{% endif %}"
    )
    tok = Tokenizer(backend, chat_template=template, bos_token="a")
    assert tok.apply_chat_template([{"role": "user", "content": "é<b>"}], add_generation_prompt=False) == 'a"é<b>"'
    with pytest.raises(jinja2.TemplateError, match="no generation"):
        tok.apply_chat_template([], add_generation_prompt=True)
    mutating = Tokenizer(backend, chat_template="{{ messages.append(1) }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        mutating.apply_chat_template([])

