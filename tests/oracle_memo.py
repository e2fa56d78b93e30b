"""transformers' answers kept on disk between test runs, for the fast tier a developer iterates with.

Off unless pytest runs with `--oracle-memo` (tests/conftest.py turns it on): the full suite, which CI runs on a
clean clone, always asks transformers afresh. With it on, an oracle answer (a greedy continuation, a tensor's
hash) is looked up under a key made of everything that answer depends on, and computed and stored only on a
miss; the engine's side of every comparison runs as always, so a regression in our code still fails the test.

The key: the question (its kind and arguments, and the source of the code that asks it), the model's exact
weights and config (hashed from the tensors themselves, not a file name), and the environment that shapes the
answer — the versions of transformers, torch, tokenizers, gguf and numpy, torch's CPU capability (AVX2 and
AVX-512 kernels sum in different orders) and its thread count (intra-op reductions split by thread). A change
to any of them is a miss, never a stale answer. Entries are JSON files written through a temporary and a rename,
so a run killed mid-write leaves no torn entry.

Where: `$DEEPINFER_CACHE_DIR/oracle-memo` (by default `~/.cache/deepinfer/oracle-memo`); delete it to forget.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from deepinfer.config.paths import default_cache_dir

_enabled = False
_MODEL_KEY_ATTR = "_deepinfer_oracle_memo_key"


def enable(on: bool) -> None:
    global _enabled
    _enabled = on


def enabled() -> bool:
    return _enabled


def memo_dir() -> Path:
    return default_cache_dir() / "oracle-memo"


def tensors_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over the tensors' names, dtypes, shapes and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # the buffer itself: no copy of the weights
    return h.hexdigest()


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes (a GGUF the oracle reads directly)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def model_key(model: Any) -> str:
    """The key of a transformers model: its class, config and weights. Kept on the model once computed (a model's
    weights do not change during a test run); a stand-in that knows its key without building the model (see
    `LazyModel`) carries it already."""
    key = getattr(model, _MODEL_KEY_ATTR, None)
    if key is None:
        key = weights_key(type(model).__name__, model.config.to_json_string(use_diff=False), model.state_dict())
        setattr(model, _MODEL_KEY_ATTR, key)
    return key


def weights_key(kind: str, config: str, tensors: Mapping[str, torch.Tensor]) -> str:
    return hashlib.sha256(f"{kind}|{config}|{tensors_digest(tensors)}".encode()).hexdigest()


_PACKAGES = ("transformers", "torch", "tokenizers", "gguf", "numpy")  # what the oracles' answers are computed by


def _environment() -> str:
    return f"{_versions()}|cpu={torch.backends.cpu.get_cpu_capability()}|threads={torch.get_num_threads()}"


@functools.cache
def _versions() -> str:
    """The packages' versions, read once: they cannot change under a running test session."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "-"

    return "|".join(f"{name}={installed(name)}" for name in _PACKAGES)


def remember(kind: str, key: str | Callable[[], str], question: Any, compute: Callable[[], Any]) -> Any:
    """`compute()` (a JSON value), from the memo when it is on and holds the answer to (kind, key, question) in
    this environment; computed, and stored when the memo is on, otherwise. `key` may be a function, called only
    when the memo is on (hashing a model's weights costs time a memo-less run need not spend)."""
    return _remember(kind, key, question, compute, ".json", _read_json, _write_json)


def remember_tensor(kind: str, key: str | Callable[[], str], question: Any,
                    compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`remember` for an answer that is one tensor (e.g. logits), kept as a safetensors file."""
    return _remember(kind, key, question, compute, ".safetensors", _read_tensor, _write_tensor)


def _remember(kind: str, key: str | Callable[[], str], question: Any, compute: Callable[[], Any], suffix: str,
              read: Callable[[Path], Any], write: Callable[[Path, Any], None]) -> Any:
    if not _enabled:
        return compute()
    key = key() if callable(key) else key
    entry = hashlib.sha256(json.dumps([kind, key, question, _environment()]).encode()).hexdigest()
    path = memo_dir() / kind / entry[:2] / f"{entry}{suffix}"
    try:
        return read(path)
    except Exception:  # noqa: BLE001 - a miss, or an entry damaged in any way: asked afresh and replaced
        pass
    answer = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp, answer)
    os.replace(tmp, path)
    return answer


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def _write_json(path: Path, answer: Any) -> None:
    path.write_text(json.dumps(answer))


def _read_tensor(path: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(path))["answer"]


def _write_tensor(path: Path, answer: torch.Tensor) -> None:
    from safetensors.torch import save_file

    save_file({"answer": answer.detach().contiguous().cpu()}, str(path))


class LazyModel:
    """A transformers model built on first use, whose memo key is known before: with the memo on and warm, a test
    that only needs the oracle's remembered answers never builds it."""

    def __init__(self, key: str, build: Callable[[], Any]) -> None:
        setattr(self, _MODEL_KEY_ATTR, key)
        self._build = build
        self._model: Any = None

    @property
    def model(self) -> Any:
        if self._model is None:
            self._model = self._build()
        return self._model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # only for names not found on the stand-in itself
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.model, name)
