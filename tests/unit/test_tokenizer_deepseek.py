"""GGUF `tokenizer.ggml.pre` values of DeepSeek models: deepseek-llm (DeepSeek LLM, V2), deepseek-coder
and deepseek-v3 (V3, R1) pre-tokenize and encode exactly as each model's own tokenizer.json.

The reference pre-tokenizers below are tokenizer.json's `pre_tokenizer` objects, written as the JSON
text those files hold, and loaded by the `tokenizers` library itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers, trainers

from deepinfer.text.tokenizer import Tokenizer
from tests.unit.test_tokenizer import write_tokenizer_gguf

_BYTE_LEVEL = '{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}'


def _split(regex_json: str) -> str:
    return f'{{"type": "Split", "pattern": {{"Regex": {regex_json}}}, "behavior": "Isolated", "invert": false}}'


def _sequence(*steps: str) -> dict:
    return json.loads(f'{{"type": "Sequence", "pretokenizers": [{", ".join(steps)}]}}')


_DIGITS = '{"type": "Digits", "individual_digits": true}'
_CJK = r'"[一-龥ࠀ-一가-퟿]+"'
# deepseek-ai/deepseek-llm-7b-base and DeepSeek-V2(-Lite) tokenizer.json. The letters with a singleton
# canonical decomposition (U+1F7D, U+1FBE, U+1FD3, U+1FDB, U+2126 OHM SIGN, U+212A KELVIN SIGN) are
# JSON escapes here: as characters, an editor or a copy may NFC them into other code points.
DEEPSEEK_LLM = _sequence(
    _split(r'"[\r\n]"'),
    _split(
        r'"\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌ'
        r'ῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+"'
    ),
    _split(r'"\\s?[!-/:-~！-／：-～‘-‟　-。]+"'),
    _split(r'"\\s+$"'),
    _split(_CJK),
    _DIGITS,
    _BYTE_LEVEL,
)
# deepseek-ai/deepseek-coder-6.7b-base tokenizer.json.
DEEPSEEK_CODER = _sequence(
    _split(r'"[\r\n]"'), _split(r'"\\s?\\p{L}+"'), _split(r'"\\s?\\p{P}+"'), _split(_CJK), _DIGITS, _BYTE_LEVEL
)
# deepseek-ai/DeepSeek-V3 tokenizer.json.
DEEPSEEK_V3 = _sequence(
    _split(r'"\\p{N}{1,3}"'),
    _split(r'"[一-龥぀-ゟ゠-ヿ]+"'),
    _split(
        r""""[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"""
        r' ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"'
    ),
    _BYTE_LEVEL,
)
REFERENCES = {"deepseek-llm": DEEPSEEK_LLM, "deepseek-coder": DEEPSEEK_CODER, "deepseek-v3": DEEPSEEK_V3}

TEXTS = [
    "I've been told he's there, 'RE you sure? We'Ve a'lL DON'T know.",
    "Call 1234567 or +1 (555) 010-9999; pi=3.14159, 12 345 678 ; x2y 00042",
    "我想在apple工作1314151天～深度求索就是好！这是一个测试。",
    "ひらがなとカタカナ、日本語のテキストです。コンピューター 「かぎかっこ」",
    'def f(x):\n    return {"a": [x**2, x // 3]}  # note\r\n\tif a != b && c <= d: pass\n\n\n',
    "emoji 🚀 (normal) 😶‍🌫️ ✅ 🦙🦙 👍🏽 trailing spaces   ",
    "Ünïcödé café (e\u0301) naïve ΑΒΓ αβγ Привет мир 안녕하세요 한국어 К 3\u212a \u2126mega ﬁne",
    "full-width：ＡＢＣ１２３！？ “quotes” ‘single’ — dash… ０９ ٣٤٥ ²³",
    "  leading\n\n  \n   mixed \t whitespace\r\n",
    "rocket🚀   lift ✅  ok ٣  z ²\t\tw",
]
CORPUS = "\n".join(TEXTS)
# A whole pre-token that is in the vocabulary but that no merge builds: it stays in pieces, as
# neither tokenizer.json sets `ignore_merges`.
UNMERGED = "Ġzyzzyva"


@pytest.fixture(scope="module")
def vocabulary() -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary learned on the texts with no split at all, so its merges cross
    every boundary a pre-tokenizer draws and a wrong split changes the ids."""
    trainer_backend = Backend(models.BPE())
    trainer_backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=900, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    trainer_backend.train_from_iterator([CORPUS] * 3, trainer)
    model = json.loads(trainer_backend.to_str())["model"]
    tokens = [*sorted(model["vocab"], key=model["vocab"].get), UNMERGED]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    assert len(merges) > 200
    return tokens, merges


def _write_gguf(path: Path, tokens: list[str], merges: list[str], pre: str) -> None:
    write_tokenizer_gguf(path, tokens, merges, [1] * len(tokens), pre, arch="deepseek2")


def _reference(tokens: list[str], merges: list[str], pre_tokenizer: dict) -> Backend:
    """The model's tokenizer.json, minus special tokens: same vocabulary, its pre-tokenizer."""
    document = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": {"type": "Sequence", "normalizers": []},
        "pre_tokenizer": pre_tokenizer,
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": merges,
        },
    }
    return Backend.from_str(json.dumps(document))


@pytest.fixture(params=sorted(REFERENCES))
def pair(request, vocabulary, tmp_path: Path) -> tuple[Tokenizer, Backend]:
    tokens, merges = vocabulary
    _write_gguf(tmp_path / "t.gguf", tokens, merges, request.param)
    return Tokenizer.from_gguf(tmp_path / "t.gguf"), _reference(tokens, merges, REFERENCES[request.param])


def test_pre_tokenizer_is_tokenizer_json(pair) -> None:
    """Same steps, same regexes, character for character."""
    ours, reference = pair
    assert json.loads(ours.backend.to_str())["pre_tokenizer"] == json.loads(reference.to_str())["pre_tokenizer"]


@pytest.mark.parametrize("text", [*TEXTS, CORPUS, "a zyzzyva"])
def test_pre_tokenizes_and_encodes_as_tokenizer_json(pair, text: str) -> None:
    ours, reference = pair
    got = ours.backend.pre_tokenizer.pre_tokenize_str(text)
    assert got == reference.pre_tokenizer.pre_tokenize_str(text)
    assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False).ids
    assert ours.decode(ours.encode(text, add_special_tokens=False)) == text


def test_the_models_split_differently(vocabulary, tmp_path: Path) -> None:
    """The texts tell the three apart (and from Llama 3's split), so the checks above can fail."""
    tokens, merges = vocabulary
    splits = {}
    for pre in [*REFERENCES, "llama-bpe"]:
        _write_gguf(tmp_path / f"{pre}.gguf", tokens, merges, pre)
        backend = Tokenizer.from_gguf(tmp_path / f"{pre}.gguf").backend
        splits[pre] = [backend.pre_tokenizer.pre_tokenize_str(t) for t in TEXTS]
    names = list(splits)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert splits[a] != splits[b], (a, b)


def test_digits_and_scripts(vocabulary, tmp_path: Path) -> None:
    """Spot checks of what each sequence does, stated by hand."""
    tokens, merges = vocabulary
    words = {}
    for pre in REFERENCES:
        _write_gguf(tmp_path / f"{pre}.gguf", tokens, merges, pre)
        backend = Tokenizer.from_gguf(tmp_path / f"{pre}.gguf").backend

        def split(text: str, backend=backend) -> list[str]:
            return [text[a:b] for _, (a, b) in backend.pre_tokenizer.pre_tokenize_str(text)]

        words[pre] = split
    assert words["deepseek-v3"]("1234567") == ["123", "456", "7"]
    assert words["deepseek-llm"]("1234567") == list("1234567")
    assert words["deepseek-coder"]("1234567") == list("1234567")
    # Han and kana runs stand alone in V3; the older CJK class also spans Hangul.
    assert words["deepseek-v3"]("ひらがなカタカナ漢字abc") == ["ひらがなカタカナ漢字", "abc"]
    assert words["deepseek-v3"]("한국어 text") == ["한국어", " text"]
    assert words["deepseek-llm"]("한국어 text") == ["한국어", " text"]
    # "，。" is one punctuation run, then the CJK class (U+0800-U+4E00) takes "。" back out of it.
    assert words["deepseek-llm"]("ｘ，。 ok  ") == ["ｘ", "，", "。", " ok", "  "]
    assert words["deepseek-coder"]("f(x);\n\ty") == ["f", "(", "x", ");", "\n", "\ty"]
    # The CJK class's U+0800-U+4E00 takes even a listed letter (U+212A KELVIN SIGN) from its space;
    # Cyrillic U+A641 (listed, outside that range) keeps it; Arabic (in neither class) stays a gap.
    assert words["deepseek-llm"](" \u212a1") == [" ", "\u212a", "1"]
    assert words["deepseek-llm"](" \ua641 x") == [" \ua641", " x"]
    assert words["deepseek-llm"](" \u0628") == [" \u0628"]


def test_unknown_pre_tokenizer_still_refused(vocabulary, tmp_path: Path) -> None:
    tokens, merges = vocabulary
    _write_gguf(tmp_path / "t.gguf", tokens, merges, "deepseek-v4-mystery")
    with pytest.raises(ValueError, match="'deepseek-v4-mystery' is not supported; supported: .*deepseek-coder"):
        Tokenizer.from_gguf(tmp_path / "t.gguf")
