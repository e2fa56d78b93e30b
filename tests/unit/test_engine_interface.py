"""`ServingEngine` (deepinfer.engine.interface) is what the services call on an engine; `LLMEngine` and a
worker group's `GroupEngine` both implement it member for member, with the same parameters (names, kinds,
defaults), and so do what its members return (`PrefixTarget`, `CachedNames`). A call added to one engine
and to the interface but not to the other engine fails here. Read from the classes alone: no engine is built."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from typing import Any

import pytest

from deepinfer.cache.block_pool import BlockPool
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.interface import CachedNames, PrefixTarget, ServingEngine
from deepinfer.services.group.cache import RankCache
from deepinfer.services.group.engine import GroupEngine, GroupPool

IMPLEMENTATIONS = [
    (ServingEngine, LLMEngine),
    (ServingEngine, GroupEngine),
    (PrefixTarget, LLMEngine),  # LLMEngine.cache_route answers with the engine itself
    (PrefixTarget, RankCache),  # GroupEngine.cache_route's answer
    (CachedNames, BlockPool),  # LLMEngine.pool
    (CachedNames, GroupPool),  # GroupEngine.pool
]


def members(protocol: type) -> dict[str, Any]:
    """The protocol's own members: name → its function (a method) or property (an attribute)."""
    return {n: v for n, v in vars(protocol).items()
            if not n.startswith("_") and (inspect.isfunction(v) or isinstance(v, property))}


def instance_attributes(cls: type) -> set[str]:
    """Names `cls.__init__` assigns on `self` (and a dataclass's fields)."""
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    init = cls.__dict__.get("__init__")
    if init is None or dataclasses.is_dataclass(cls):  # a dataclass's __init__ is generated: its fields
        return names
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(init)))):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                names.add(t.attr)
    return names


def parameters(fn: Any) -> list[tuple[str, Any, Any]]:
    """(name, kind, default) of each parameter after `self`."""
    return [(p.name, p.kind, p.default) for p in list(inspect.signature(fn).parameters.values())[1:]]


def mismatches(protocol: type, cls: type) -> list[str]:
    """How `cls` fails `protocol`: members missing, a method where an attribute is due or the reverse, and
    methods whose parameters differ."""
    found = []
    attributes = instance_attributes(cls)
    for name, member in members(protocol).items():
        mine = inspect.getattr_static(cls, name, None)
        if isinstance(member, property):
            if not (isinstance(mine, property) or (mine is None and name in attributes)):
                found.append(f"{cls.__name__}.{name}: not an attribute or property ({mine!r})")
        elif not inspect.isfunction(mine):
            found.append(f"{cls.__name__}.{name}: not a method ({mine!r})")
        elif parameters(mine) != parameters(member):
            found.append(f"{cls.__name__}.{name}{inspect.signature(mine)} differs from "
                         f"{protocol.__name__}.{name}{inspect.signature(member)}")
    return found


@pytest.mark.parametrize(("protocol", "cls"), IMPLEMENTATIONS,
                         ids=[f"{c.__name__}-{p.__name__}" for p, c in IMPLEMENTATIONS])
def test_each_implementation_has_every_member_with_the_same_parameters(protocol: type, cls: type):
    assert mismatches(protocol, cls) == []


def test_the_interface_holds_the_services_calls():
    names = set(members(ServingEngine))
    assert {"config", "stats", "pool", "step", "has_unfinished", "add_request", "abort", "export_kv", "release",
            "reserve", "add_prefilled_request", "cache_route", "export_cached_blocks"} <= names
    assert {"keepalive", "load", "live_ids", "close"}.isdisjoint(names)  # a group's own calls stay its own
    for name, member in members(ServingEngine).items():  # each states its contract
        assert (member.fget if isinstance(member, property) else member).__doc__, name


def test_a_member_one_engine_lacks_or_spells_otherwise_is_caught():
    class Partial:
        def __init__(self) -> None:
            self.config = None

        @property
        def stats(self) -> None:
            return None

        def step(self) -> list:  # config, stats and step are fine; the rest is missing or wrong
            return []

        def abort(self, rid: str) -> bool:  # renamed parameter
            return False

        def release(self, request_id: str = "") -> bool:  # a default the interface does not have
            return False

        pool = None  # a class attribute, not one __init__ sets: not counted as the engine's
        fingerprint = property(lambda self: "")
        num_held = 0

        def kv_spec(self) -> None:  # a method where an attribute is due
            return None

    found = "\n".join(mismatches(ServingEngine, Partial))
    for name in ("abort", "release", "kv_spec", "pool", "num_held", "add_request", "cache_route"):
        assert f"Partial.{name}" in found, name
    for name in ("config", "stats", "step", "fingerprint"):
        assert f"Partial.{name}" not in found, name
