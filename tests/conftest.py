"""Shared fixtures.

* `smollm2_path` — the real SmolLM2-135M-Instruct Q4_1 GGUF, fetched into the cache on first use
  (tests using it are marked `smollm2`).
* every test gets its own KV-cache disk directory (`$DEEPINFER_KVCACHE_DIR`, inherited by the processes
  it starts), so no test reads blocks another test left behind and nothing is written to the user's
  cache directory.
* every test starts with structlog's defaults: an in-process CLI call (also from a module-scoped fixture)
  installs a WARNING filter, which would otherwise hide the info events a later test captures.
* hypothesis runs without its per-example deadline: a deadline is a timed assertion, and on a shared
  2-core machine any example can be slow.
* `tiny_hf_model` — a factory for tiny random-weight Hugging Face models (`llama` or `qwen2`) saved
  with `save_pretrained`; each distinct configuration is built once per session.
* tiers: every test under tests/integration/ and tests/service/ is marked `mesh` (it starts services, most
  of them as real processes), the expert-parallel group tests `ranks` (a torch.distributed group of
  processes), the tests that compare against Hugging Face transformers on real weights `oracle`. The fast
  tier a developer iterates with is `pytest -m "not mesh and not ranks" --oracle-memo`.
* kernel builds, the reduced ones tests ask for included, go to the user's kernel cache as the engine's do (named by
  source, flags and compiler): a second run reuses them. Tests of the cache itself use a private one.
* `--oracle-memo`: transformers' answers are kept on disk between runs (tests/oracle_memo.py); off by default,
  so the full suite (and CI) asks transformers afresh.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
from hypothesis import settings

from deepinfer.kernels.amx import allow_amx, amx_allowed
from deepinfer.loading.fetch import fetch_smollm2

TINY_CONFIG: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@dataclass(frozen=True)
class TinyModel:
    path: Path  # the save_pretrained directory
    config: Any  # the transformers config
    state_dict: dict[str, torch.Tensor]  # Hugging Face names, fp32


# Tier markers by module (see the docstring); pyproject.toml declares them.
MESH_DIRS = ("integration", "service")
RANKS_MODULES = {"test_ep_exact", "test_expert_move_group", "test_expert_parallel", "test_group_engine",
                 "test_group_cache"}
ORACLE_MODULES = {"test_oracle_tiny", "test_oracle_smollm2", "test_oracle_moe", "test_oracle_deepseek",
                  "test_spec_smollm2", "test_smollm2_moe"}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--oracle-memo", action="store_true",
                     help="keep transformers' oracle answers on disk between runs (tests/oracle_memo.py)")


def pytest_configure(config: pytest.Config) -> None:
    from tests import oracle_memo

    oracle_memo.enable(bool(config.getoption("--oracle-memo")))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.fspath))
        if path.parent.name in MESH_DIRS:
            item.add_marker(pytest.mark.mesh)
        if path.stem in RANKS_MODULES:
            item.add_marker(pytest.mark.ranks)
        if path.stem in ORACLE_MODULES:
            item.add_marker(pytest.mark.oracle)


settings.register_profile("deepinfer", deadline=None)
settings.load_profile("deepinfer")


@pytest.fixture(autouse=True)
def private_kvcache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "kvcache"
    monkeypatch.setenv("DEEPINFER_KVCACHE_DIR", str(path))
    return path


@pytest.fixture(autouse=True)
def default_structlog() -> Iterator[None]:
    # Reset, not restore a snapshot: a module- or session-scoped fixture (set up before this one) may
    # have configured structlog through the CLI, and a snapshot taken here would keep its filter.
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


@pytest.fixture
def restore_amx_switch() -> Iterator[None]:
    """The process-wide AMX switch (deepinfer/kernels/amx.py) as it was before the test."""
    before = amx_allowed()
    try:
        yield
    finally:
        allow_amx(before)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return fetch_smollm2(progress=False)


@pytest.fixture(scope="session")
def smollm2_oracle(smollm2_path: Path) -> Any:
    """SmolLM2 and transformers on its weights, loaded once per session (tests/engine/oracle.py
    `SmolLM2Oracle`): every test module comparing against the oracle shares one copy and one greedy memo."""
    from tests.engine.oracle import SmolLM2Oracle

    return SmolLM2Oracle(smollm2_path)


@pytest.fixture(scope="session")
def tiny_hf_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., TinyModel]:
    built: dict[tuple[Any, ...], TinyModel] = {}

    def make(architecture: str = "llama", *, seed: int = 0, max_shard_size: str | None = None, **overrides: Any):
        key = (architecture, seed, max_shard_size, tuple(sorted(overrides.items())))
        if key not in built:
            built[key] = _build(tmp_path_factory.mktemp(architecture), architecture, seed, max_shard_size, overrides)
        return built[key]

    return make


def _build(
    path: Path, architecture: str, seed: int, max_shard_size: str | None, overrides: dict[str, Any]
) -> TinyModel:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    config_class, model_class = classes[architecture]
    config = config_class(**{**TINY_CONFIG, **overrides})
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        # Default init leaves norms at 1 and biases at 0; random values catch any swapped tensor.
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    state = {k: v.detach().clone().float() for k, v in model.state_dict().items()}
    return TinyModel(path, config, state)
