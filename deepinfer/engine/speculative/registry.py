"""The proposer registry: which guesser each `--speculative` kind builds.

A new guesser is one `Proposer` class plus one `register_proposer` call in its own module of this
package, and its kind in the grammar (`deepinfer.config.engine.KINDS`: the config layer parses the
method string before any engine exists and cannot import this one). tests/unit/test_spec_registry.py
keeps the grammar's kinds and the registered ones equal.

Contract:
* `register_proposer(kind, cls, build)` makes `kind` build its guesser as `build(ProposerArgs) -> cls
  instance`; a kind registers once. `cls.cheap` is known before anything is built.
* Every module of this package is imported on the first lookup, so a module's registration runs
  without any list naming it; a guesser outside the package registers by being imported first.
* A lookup of a kind with no registration raises ConfigError naming it, so an engine refuses at build
  time a method its grammar accepts but nothing builds.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer.config.engine import EngineConfig, SpeculativeSpec
from deepinfer.config.model import ConfigError
from deepinfer.engine.speculative.base import Proposer


@dataclass(frozen=True)
class ProposerArgs:
    """What a guesser is built from: the parsed method (its `num_layers` or `path`, per the kind's
    argument), the engine's config, and the engine's model (`target`) and KV tensor (`kv`) that a draft
    model builds on (None where no engine exists, as in the benchmarks)."""

    spec: SpeculativeSpec
    config: EngineConfig
    target: object | None = None
    kv: torch.Tensor | None = None


Build = Callable[[ProposerArgs], Proposer]


@dataclass(frozen=True)
class Registration:
    """A kind's guesser: its class (`cls.cheap` says whether it runs a model) and how to build one."""

    cls: type[Proposer]
    build: Build


_REGISTRY: dict[str, Registration] = {}
_discovered = False


def register_proposer(kind: str, cls: type[Proposer], build: Build) -> None:
    """Make `kind` build a `cls` with `build` (see the module docstring); ValueError if taken."""
    if kind in _REGISTRY:
        raise ValueError(f"speculative kind {kind!r} is already registered to {_REGISTRY[kind].cls.__name__}")
    _REGISTRY[kind] = Registration(cls, build)


def registration(kind: str) -> Registration:
    """The registration of `kind`; ConfigError if no guesser is registered for it."""
    _discover()
    if kind not in _REGISTRY:
        raise ConfigError(f"speculative method {kind!r} has no registered proposer "
                          f"(registered: {', '.join(sorted(_REGISTRY))})")
    return _REGISTRY[kind]


def registered_kinds() -> frozenset[str]:
    """Every kind a guesser is registered for."""
    _discover()
    return frozenset(_REGISTRY)


def _discover() -> None:
    """Import every module of this package once, running each proposer module's registration."""
    global _discovered
    if _discovered:
        return
    package = __name__.rpartition(".")[0]
    for module in pkgutil.iter_modules(importlib.import_module(package).__path__):
        importlib.import_module(f"{package}.{module.name}")
    _discovered = True
