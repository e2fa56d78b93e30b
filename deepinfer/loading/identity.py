"""Which KV-cache namespace a model's blocks belong to, computable by any service without loading weights.

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
from pathlib import Path

from deepinfer.cache.hashing import CacheNamespace
from deepinfer.config.kv import KvSpec
from deepinfer.config.model import ModelConfig
from deepinfer.config.paths import default_cache_dir

_memo: dict[str, str] = {}


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
    stamp = json.dumps([[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files])
    key = hashlib.sha256(stamp.encode()).hexdigest()
    if key in _memo:
        return _memo[key]
    memo_file = default_cache_dir() / "fingerprints" / key
    try:
        value = memo_file.read_text().strip()
    except OSError:
        value = ""
    if len(value) != 64:
        h = hashlib.sha256()
        for f in files:
            h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
            with open(f, "rb") as fh:
                while chunk := fh.read(8 << 20):
                    h.update(chunk)
        value = h.hexdigest()
        try:  # a read-only or full cache directory only costs the next start the hashing again
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
