"""`load_on_a_passing_thread`: the worker loads its engine on a thread that ends with the load, so no
thread but the engine's keeps an OpenMP pool (see bench/bench_openmp_masters.py for why that matters)."""

from __future__ import annotations

import threading

import pytest

from deepinfer.services.engine_thread import load_on_a_passing_thread


def test_the_load_runs_on_another_thread_that_has_ended_when_it_returns():
    seen: list[threading.Thread] = []

    def load() -> str:
        seen.append(threading.current_thread())
        return "engine"

    assert load_on_a_passing_thread(load, "w-load") == "engine"
    assert seen[0] is not threading.current_thread() and seen[0].name == "w-load"
    assert not seen[0].is_alive()


def test_the_loads_exception_reaches_the_caller():
    def load() -> None:
        raise FileNotFoundError("no model at /nowhere")

    with pytest.raises(FileNotFoundError, match="/nowhere"):
        load_on_a_passing_thread(load)
