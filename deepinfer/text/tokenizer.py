"""Text ⇄ token ids: a Hugging Face `tokenizers` backend plus BOS/EOS handling and the chat template.

Sources: a model directory (tokenizer.json, tokenizer_config.json, chat_template.jinja) or a GGUF
file, whose vocabulary, merges and token types become a byte-level BPE tokenizer equivalent to the
one the model was trained with. Special tokens are added by this class, never by the backend's
post-processor, so `encode` behaves the same whatever the source.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import meta, nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

from deepinfer.config.gguf_metadata import GgufFile, metadata, open_gguf

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2 differs from Llama 3 only in splitting numbers into single digits.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# GGUF `tokenizer.ggml.pre` → the regex that splits text before byte-level BPE.
_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Pre-tokenizers that isolate every digit, then apply GPT-2's split (SmolLM2's tokenizer.json).
_DIGIT_SPLITTING = ("smollm", "starcoder", "refact")
# DeepSeek's tokenizer.json files chain several Split regexes (each splits what the previous left),
# the older ones then Digits(individual_digits=True), `_ISOLATE_DIGITS` below (llama.cpp: a `\p{N}`
# regex; `\p{N}+` for deepseek-llm, the same tokens unless a merge joins two digits).
# Non-ASCII characters are written as escapes so look-alikes (U+212A KELVIN SIGN next to K) stay
# apparent; the strings equal tokenizer.json's.
_ISOLATE_DIGITS = "<Digits(individual_digits=True)>"
_DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
# deepseek-llm-7b-base and DeepSeek-V2: cased letters listed range by range (not \p{L}).
_DEEPSEEK_LLM_LETTERS = (
    r"\s?[A-Za-z"
    "\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd"
    "\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d"
    "\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4"
    "\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec"
    "\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b"
    "\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787"
    "\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)
_DEEPSEEK_LLM_PUNCTUATION = r"\s?[!-/:-~" "\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"
_DEEPSEEK_LLM = ("[\r\n]", _DEEPSEEK_LLM_LETTERS, _DEEPSEEK_LLM_PUNCTUATION, r"\s+$", _DEEPSEEK_CJK, _ISOLATE_DIGITS)
# deepseek-coder-*-base (and -instruct).
_DEEPSEEK_CODER = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK, _ISOLATE_DIGITS)
# DeepSeek-V3 and R1: numbers in runs of up to three, Han and kana runs, then a Llama-3-like split.
# tokenizer.json's regex holds CR and LF themselves, not `\r\n` escapes.
_DEEPSEEK_V3_WORDS = (
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
).replace(r"\r\n", "\r\n")
_DEEPSEEK_V3 = (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+", _DEEPSEEK_V3_WORDS)
# GGUF `tokenizer.ggml.pre` → tokenizer.json's sequence of splits. None is in `_NFC` or
# `_IGNORE_MERGES`: DeepSeek-V3's tokenizer.json has an empty normalizer and no `ignore_merges`,
# and llama.cpp neither normalizes nor ignores merges for any of the three.
_SPLIT_SEQUENCES = {
    "deepseek-llm": _DEEPSEEK_LLM,
    "deepseek-coder": _DEEPSEEK_CODER,
    "deepseek-v3": _DEEPSEEK_V3,
}
_GPT2 = ("gpt2", "default")
# llama.cpp looks a whole pre-token up in the vocabulary before merging only for Llama 3.
_IGNORE_MERGES = ("llama-bpe", "llama3", "llama-v3")
_NFC = ("qwen2", "deepseek-r1-qwen")
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


class Tokenizer:
    """Encode, decode and render chats for one model."""

    def __init__(
        self,
        backend: Backend,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        extra_eos_ids: Sequence[int] = (),
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._bos_id = None if bos_token is None else backend.token_to_id(bos_token)
        eos_id = None if eos_token is None else backend.token_to_id(eos_token)
        self._eos_ids = tuple(dict.fromkeys([i for i in (eos_id, *extra_eos_ids) if i is not None]))
        self.add_bos = add_bos and self._bos_id is not None
        self.add_eos = add_eos and eos_id is not None

    # ----- construction -----

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """From a model directory or a `.gguf` file."""
        source = Path(path)
        if source.is_dir():
            return cls.from_dir(source)
        if source.is_file() and source.suffix == ".gguf":
            return cls.from_gguf(source)
        raise FileNotFoundError(
            f"no tokenizer at {str(source)!r}: expected a directory with tokenizer.json or a .gguf file"
        )

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """From tokenizer.json plus, when present, tokenizer_config.json, chat_template.jinja and
        generation_config.json (extra EOS ids)."""
        root = Path(path)
        if not (root / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer.json in {str(root)!r}")
        backend = Backend.from_file(str(root / "tokenizer.json"))
        config = _read_json(root / "tokenizer_config.json")
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        adds_bos, adds_eos = _post_processor_adds(backend, bos, eos)
        # Special tokens now come from this class alone.
        backend.post_processor = None
        generation_eos = _read_json(root / "generation_config.json").get("eos_token_id")
        extra = generation_eos if isinstance(generation_eos, list) else [generation_eos]
        return cls(
            backend,
            chat_template=_dir_chat_template(root, config),
            bos_token=bos,
            eos_token=eos,
            add_bos=bool(config.get("add_bos_token", adds_bos)),
            add_eos=bool(config.get("add_eos_token", adds_eos)),
            extra_eos_ids=[int(i) for i in extra if i is not None],
        )

    @classmethod
    def from_gguf(cls, source: GgufFile | str | os.PathLike[str]) -> Tokenizer:
        """A byte-level BPE tokenizer from a GGUF file's `tokenizer.ggml.*` metadata."""
        reader = source if isinstance(source, GgufFile) else open_gguf(source)
        kind = metadata(reader, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported; only byte-level BPE ('gpt2')")
        pre = metadata(reader, "tokenizer.ggml.pre", "default")
        tokens: list[str] = metadata(reader, "tokenizer.ggml.tokens")
        vocab: dict[str, int] = {}
        for i, token in enumerate(tokens):
            vocab.setdefault(token, i)
        merges = [_merge_pair(m) for m in metadata(reader, "tokenizer.ggml.merges", [])]
        backend = Backend(models.BPE(vocab, merges, ignore_merges=pre in _IGNORE_MERGES))
        backend.pre_tokenizer = _gguf_pre_tokenizer(pre)
        if pre in _NFC:
            backend.normalizer = normalizers.NFC()
        backend.decoder = decoders.ByteLevel()
        types = metadata(reader, "tokenizer.ggml.token_type")
        if types is not None:
            # Control and user-defined tokens are matched whole in raw text, never split by BPE.
            kinds = [int(k) for k in types]
            control = [t for t, k in zip(tokens, kinds, strict=True) if k == _CONTROL]
            user = [t for t, k in zip(tokens, kinds, strict=True) if k == _USER_DEFINED]
            backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
            backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

        def token(key: str) -> str | None:
            index = metadata(reader, f"tokenizer.ggml.{key}")
            return None if index is None else tokens[int(index)]

        extra = [metadata(reader, f"tokenizer.ggml.{k}") for k in ("eot_token_id", "eom_token_id")]
        return cls(
            backend,
            chat_template=metadata(reader, "tokenizer.chat_template"),
            bos_token=token("bos_token_id"),
            eos_token=token("eos_token_id"),
            add_bos=bool(metadata(reader, "tokenizer.ggml.add_bos_token", False)),
            add_eos=bool(metadata(reader, "tokenizer.ggml.add_eos_token", False)),
            extra_eos_ids=[int(i) for i in extra if i is not None],
        )

    # ----- use -----

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.add_bos:
                ids.insert(0, self._bos_id)
            if self.add_eos:
                ids.append(self._eos_ids[0])
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` as transformers does; extra keyword arguments are template variables."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        variables = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **kwargs}
        return _compile(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        # The template writes any BOS itself.
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_ids

    @cached_property
    def fingerprint(self) -> str:
        """sha256 hex of everything that decides ids and prompts: backend JSON, specials, template.
        Computed once: a Tokenizer is not changed after construction."""
        head = {"add_bos": self.add_bos, "add_eos": self.add_eos, "bos": self._bos_id, "eos": self._eos_ids}
        h = hashlib.sha256(json.dumps(head, sort_keys=True).encode())
        h.update(b"\0" + self.backend.to_str().encode() + b"\0" + (self.chat_template or "").encode())
        return h.hexdigest()


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json spells a special token as a string or as a serialised AddedToken.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _post_processor_adds(backend: Backend, bos: str | None, eos: str | None) -> tuple[bool, bool]:
    with_special = backend.encode("a", add_special_tokens=True).ids
    plain = backend.encode("a", add_special_tokens=False).ids
    if len(with_special) == len(plain):
        return False, False
    bos_id = None if bos is None else backend.token_to_id(bos)
    eos_id = None if eos is None else backend.token_to_id(eos)
    return with_special[0] == bos_id, with_special[-1] == eos_id


def _dir_chat_template(root: Path, config: dict[str, Any]) -> str | None:
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text()
    template = _read_json(root / "chat_template.json").get("chat_template", config.get("chat_template"))
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


def _merge_pair(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep or " " in right:
        raise ValueError(f"malformed GGUF merge {merge!r}")
    return left, right


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _DIGIT_SPLITTING:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    if pre in _GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre in _SPLIT_SEQUENCES:
        steps = [
            pre_tokenizers.Digits(individual_digits=True)
            if step == _ISOLATE_DIGITS
            else pre_tokenizers.Split(Regex(step), behavior="isolated")
            for step in _SPLIT_SEQUENCES[pre]
        ]
        return pre_tokenizers.Sequence([*steps, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    known = ", ".join(sorted([*_DIGIT_SPLITTING, *_GPT2, *_SPLITS, *_SPLIT_SEQUENCES]))
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: {known}")


# ----- chat templates -----


class _GenerationTag(Extension):
    """`{% generation %}…{% endgeneration %}` marks assistant text for training masks; here it is a no-op."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes; chat templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    # Templates come with model files, so they are untrusted: sandboxed, immutable containers.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    return _environment().from_string(template)


def template_variables(template: str) -> frozenset[str]:
    """The variables a chat template reads without setting them (`messages`, `tools`, ...); raises
    jinja2.TemplateError for a template that does not parse."""
    return frozenset(meta.find_undeclared_variables(_environment().parse(template)))
