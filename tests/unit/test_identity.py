"""The model's identity: the tokenizer part of the cache namespace is the tokenizer's own fingerprint, and a
service that only needs the fingerprint loads the tokenizer at most once per host (remembered on disk)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer.config.kv import KvSpec
from deepinfer.loading import identity
from deepinfer.loading.identity import cache_namespace, model_config_at, model_identity, tokenizer_fingerprint
from deepinfer.text.tokenizer import Tokenizer

pytestmark = pytest.mark.smollm2


def test_the_remembered_tokenizer_fingerprint_is_the_tokenizers(smollm2_path: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))  # nothing remembered yet
    monkeypatch.setattr(identity, "_memo", {})
    want = Tokenizer.load(smollm2_path).fingerprint
    assert tokenizer_fingerprint(smollm2_path) == want

    def no_load(*_: object) -> Tokenizer:
        raise AssertionError("the tokenizer was loaded although its fingerprint is remembered")

    monkeypatch.setattr(identity, "_memo", {})  # a new process: only the file under the cache directory is left
    monkeypatch.setattr(Tokenizer, "load", no_load)
    assert tokenizer_fingerprint(smollm2_path) == want
    assert any(f.name.startswith("tokenizer-") for f in (tmp_path / "fingerprints").iterdir())


def test_model_identity_names_the_blocks_as_the_engine_does(smollm2_path: Path) -> None:
    """Every service's namespace (model_identity) equals the one an engine with the model's tokenizer derives."""
    ident = model_identity(smollm2_path, 16, "fp16")
    kv = KvSpec.for_model(model_config_at(smollm2_path), 16, "float16")
    assert ident.kv == kv and ident.config == model_config_at(smollm2_path)
    assert ident.namespace == cache_namespace(smollm2_path, kv, Tokenizer.load(smollm2_path).fingerprint)
    assert model_identity(smollm2_path, 16, "fp16") is ident  # once per process
