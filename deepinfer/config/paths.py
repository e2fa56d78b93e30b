"""Where DeepInfer keeps its files on a host: one cache directory for fetched and derived models, model
fingerprints, compiled kernels' defaults and the KV cache's disk tier defaults."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """`$DEEPINFER_CACHE_DIR`, else `$XDG_CACHE_HOME/deepinfer`, else `~/.cache/deepinfer`."""
    if os.environ.get("DEEPINFER_CACHE_DIR"):
        return Path(os.environ["DEEPINFER_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "deepinfer"
    return Path.home() / ".cache" / "deepinfer"
