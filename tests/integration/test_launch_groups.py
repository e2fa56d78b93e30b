"""The command line for expert-parallel groups: `up --ep N` builds groups (and refuses where it cannot),
`service worker --rank R` starts a follower through `run_follower`, and the embedded mesh refuses --ep."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from deepinfer.launch import cli
from deepinfer.launch.topology import Topology

GROUP_TOPOLOGY = """
[router]
frontend = "tcp://127.0.0.1:5550"
backend = "tcp://127.0.0.1:5551"
[[tokenizer]]
name = "tok"
detok = "tcp://127.0.0.1:5560"
[[worker]]
name = "w"
role = "worker"
kv = "tcp://127.0.0.1:5570"
ep = 2
ep_master = "127.0.0.1:29500"
"""


def run(*args: str) -> Any:
    return CliRunner().invoke(cli.main, list(args))


@pytest.fixture
def topology(tmp_path: Path) -> Path:
    path = tmp_path / "t.toml"
    path.write_text(GROUP_TOPOLOGY)
    return path


def test_up_ep_makes_every_generated_worker_a_group(tmp_path, monkeypatch):
    seen: list[Topology] = []
    monkeypatch.setattr(cli, "_supervise", lambda path, log_dir, logs: seen.append(Topology.load(path)))
    out = run("up", "--ep", "2", "--run-dir", str(tmp_path / "run"))
    assert out.exit_code == 0, out.output
    (topo,) = seen
    assert [(w.name, w.ep) for w in topo.workers] == [("prefill-0", 2), ("decode-0", 2)]
    assert len({w.ep_master for w in topo.workers}) == 2
    out = run("up", "--run-dir", str(tmp_path / "run"))  # without --ep: single-rank workers, as before
    assert out.exit_code == 0 and all(w.ep == 1 for w in seen[1].workers)


@pytest.mark.parametrize("args, message", [
    (["up", "--topology", "{topology}", "--ep", "2"], "with --topology, set `ep` and `ep_master` per worker"),
    (["up", "--inproc", "--ep", "2"], "an --ep group needs a process per rank: drop --inproc"),
    (["up", "--ep", "0"], "Invalid value for '--ep'"),
    (["generate", "--ep", "2", "--prompt", "hi"], "start `deepinfer-launch up --ep 2` and pass its --endpoint"),
    (["chat", "--ep", "3"], "the embedded mesh is this one process"),
])
def test_ep_is_refused_where_it_cannot_apply_before_anything_starts(tmp_path, topology, args, message):
    out = run(*(a.format(topology=topology) for a in args), *(["--run-dir", str(tmp_path / "run")]
                                                              if args[0] == "up" else []))
    assert out.exit_code == 2 and message in out.output, out.output
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("args, message", [
    (["--name", "w", "--rank", "2"], "worker w has ep = 2, so its ranks are 0..1"),
    (["--name", "w", "--rank", "-1"], "so its ranks are 0..1"),
    (["--name", "nobody", "--rank", "1"], "no worker named 'nobody'"),
])
def test_service_rank_must_be_a_rank_of_the_worker(topology, args, message):
    out = run("service", "worker", "--topology", str(topology), *args)
    assert out.exit_code == 2 and message in out.output, out.output


def test_only_a_worker_has_ranks(topology):
    out = run("service", "tokenizer", "--topology", str(topology), "--name", "tok", "--rank", "1")
    assert out.exit_code == 2 and "a tokenizer has none" in out.output, out.output


def test_a_follower_rank_runs_run_follower_and_exits_with_its_code(topology, monkeypatch):
    calls: list[tuple[Topology, str, int]] = []
    follower = types.ModuleType("deepinfer.parallel.follower")
    follower.run_follower = lambda topo, name, rank: calls.append((topo, name, rank)) or 3  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deepinfer.parallel.follower", follower)
    out = run("service", "worker", "--topology", str(topology), "--name", "w", "--rank", "1")
    assert out.exit_code == 3, out.output  # nonzero: the group broke, so the supervisor/systemd restarts it
    assert [(name, rank) for _, name, rank in calls] == [("w", 1)]
    assert calls[0][0] == Topology.load(topology)
