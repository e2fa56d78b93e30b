"""Which KV-cache namespace a model's blocks belong to, computable by any service without loading weights.

`model_identity(path, block_size, kv_cache_dtype)` is what a service asks for: the model's path, config, KV
spec and namespace, computed once per process (every service of an in-process mesh shares it) and, for the
expensive parts, once per host (the fingerprints are remembered on disk).

The workers, the tokenizers (which hash prompts for the router) and the cache daemon (which keeps
blocks on disk across restarts) must all derive the same namespace. Only the workers load weights, so
the namespace names the model by its *source files* — a sha256 over the GGUF file, or over a Hugging
Face directory's config.json and safetensors shards — rather than by the dequantized tensors. Hashing
a model's files takes about a second per GB, so the result is remembered in-process and in a small
file under the user's cache directory, keyed by the files' paths, sizes and modification times.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from deepinfer.cache.hashing import CacheNamespace
from deepinfer.config.engine import kv_cache_dtype_name
from deepinfer.config.kv import KvSpec
from deepinfer.config.model import ModelConfig
from deepinfer.config.paths import default_cache_dir

_memo: dict[str, str] = {}


@dataclass(frozen=True)
class ModelIdentity:
    """One model as every service names it: where its files are, its architecture, the KV spec of its blocks
    at the mesh's block size and dtype, and the namespace those blocks are hashed in."""

    path: Path
    config: ModelConfig
    kv: KvSpec
    namespace: CacheNamespace


@lru_cache(maxsize=16)
def model_identity(path: Path, block_size: int, kv_cache_dtype: str) -> ModelIdentity:
    """The identity of the model at `path` (what `fetch.resolve_model` gives for a name or a path). The
    namespace's tokenizer part is the tokenizer's own fingerprint (`Tokenizer.fingerprint`), remembered per
    host so that a service that does not tokenize (the cache daemon) loads the tokenizer at most once per set
    of files."""
    config = model_config_at(path)
    kv = KvSpec.for_model(config, block_size, kv_cache_dtype_name(kv_cache_dtype))
    return ModelIdentity(path, config, kv, cache_namespace(path, kv, tokenizer_fingerprint(path)))


def model_files(path: Path) -> list[Path]:
    """The files whose bytes decide the model's KV: a .gguf file, or config.json and the shards."""
    if path.is_file():
        return [path]
    files = [path / "config.json", *sorted(path.glob("*.safetensors"))]
    missing = [f for f in files if not f.is_file()]
    if missing or len(files) < 2:
        raise FileNotFoundError(f"no model files under {path} (need config.json and *.safetensors)")
    return files


def source_fingerprint(path: str | os.PathLike[str]) -> str:
    """sha256 hex over each model file's name, size and bytes, in a fixed order."""
    files = model_files(Path(path).resolve())

    def compute() -> str:
        h = hashlib.sha256()
        for f in files:
            h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
            with open(f, "rb") as fh:
                while chunk := fh.read(8 << 20):
                    h.update(chunk)
        return h.hexdigest()

    return _remembered("", files, compute)


def tokenizer_files(path: Path) -> list[Path]:
    """The files a tokenizer is read from: a .gguf file, or every file of a model directory but the weights."""
    if path.is_file():
        return [path]
    return sorted(f for f in path.iterdir() if f.is_file() and f.suffix != ".safetensors")


def tokenizer_fingerprint(path: str | os.PathLike[str]) -> str:
    """`Tokenizer.load(path).fingerprint`, loading the tokenizer only when these files' fingerprint is not
    remembered yet (a tokenizer takes about a second to load; the namespace only needs its fingerprint)."""
    from deepinfer.text.tokenizer import Tokenizer

    resolved = Path(path).resolve()
    return _remembered("tokenizer-", tokenizer_files(resolved), lambda: Tokenizer.load(resolved).fingerprint)


def _remembered(kind: str, files: list[Path], compute: Callable[[], str]) -> str:
    """A sha256 hex value derived from `files`, remembered in-process and in the user's cache directory, keyed by
    `kind` and the files' paths, sizes and modification times (a changed file is a new key)."""
    stamp = json.dumps([[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files])
    key = kind + hashlib.sha256(stamp.encode()).hexdigest()
    if key in _memo:
        return _memo[key]
    memo_file = default_cache_dir() / "fingerprints" / key
    try:
        value = memo_file.read_text().strip()
    except OSError:
        value = ""
    if len(value) != 64:
        value = compute()
        try:  # a read-only or full cache directory only costs the next start the work again
            memo_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo_file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(value)
            os.replace(tmp, memo_file)
        except OSError:
            pass
    _memo[key] = value
    return value


def cache_namespace(model_path: str | os.PathLike[str], kv: KvSpec, tokenizer_fingerprint: str) -> CacheNamespace:
    """The namespace of `kv`'s blocks of this model: its dtype name and layout string are the namespace's
    kv_dtype and kv_layout (for a Llama-family fp32 spec, the strings this module wrote before KvSpec)."""
    return CacheNamespace(
        model_fingerprint=source_fingerprint(model_path),
        tokenizer_fingerprint=tokenizer_fingerprint,
        kv_dtype=kv.dtype_name,
        kv_layout=kv.layout,
        block_size=kv.block_size,
    )


def model_config_at(path: str | os.PathLike[str]) -> ModelConfig:
    """The model's config, read without loading weights."""
    from deepinfer.config.gguf_metadata import open_gguf
    from deepinfer.loading.gguf_model import config_from_gguf

    p = Path(path)
    if p.is_dir():
        return ModelConfig.from_hf_dict(json.loads((p / "config.json").read_text()))
    return config_from_gguf(open_gguf(p))
