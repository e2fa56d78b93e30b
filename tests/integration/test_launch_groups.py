"""The command line for expert-parallel groups: `up --ep N` builds groups (and refuses where it cannot),
`service worker --rank R` starts a follower through `run_follower`, the embedded mesh refuses --ep, and
`systemd` writes a unit per rank, the ranks of a group bound together."""

from __future__ import annotations

import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from deepinfer.launch import cli, cli_up
from deepinfer.launch.mesh import engine_config
from deepinfer.launch.systemd import unit_files, write_units
from deepinfer.launch.topology import Topology, TopologyError
from tests.integration.test_launch import assert_hardened, unit_settings

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
    monkeypatch.setattr(cli_up, "_supervise", lambda path, log_dir, logs: seen.append(Topology.load(path)))
    out = run("up", "--ep", "2", "--prefill", "1", "--decode", "1", "--run-dir", str(tmp_path / "run"))
    assert out.exit_code == 0, out.output
    (topo,) = seen
    assert [(w.name, w.ep) for w in topo.workers] == [("prefill-0", 2), ("decode-0", 2)]
    assert len({w.ep_master for w in topo.workers}) == 2
    assert [k.name for k in topo.kvcaches] == ["kvcache-0"] and all(w.kvcache == "kvcache-0" for w in topo.workers)
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
    calls: list[tuple[Topology, str, int, Any]] = []
    follower = types.ModuleType("deepinfer.services.group.follower")
    follower.run_follower = lambda *call: calls.append(call) or 3  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deepinfer.services.group.follower", follower)
    out = run("service", "worker", "--topology", str(topology), "--name", "w", "--rank", "1", "--insecure")
    assert out.exit_code == 3, out.output  # nonzero: the group broke, so the supervisor/systemd restarts it
    assert [(name, rank) for _, name, rank, _ in calls] == [("w", 1)]
    assert calls[0][0] == Topology.load(topology)
    assert calls[0][3] == engine_config(Topology.load(topology).worker("w"), rank=1)  # the rank's own settings


# -- systemd: a unit per rank ------------------------------------------------------------------------------------

def rank_units(name: str, ep: int) -> list[str]:
    return [f"deepinfer-worker-{name}-rank{r}.service" for r in range(ep)]


def test_systemd_writes_a_unit_per_rank_bound_to_its_group(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text(GROUP_TOPOLOGY.replace("ep = 2", "ep = 3") + '[[worker]]\nname = "solo"\nrole = "worker"\n'
                    'kv = "tcp://127.0.0.1:5571"\nthreads = 2\n')
    files = unit_files(path, Topology.load(path), launcher="/usr/bin/deepinfer-launch")
    ranks = rank_units("w", 3)
    assert set(files) == {"deepinfer.target", "deepinfer-router@.service", "deepinfer-tokenizer@.service",
                          "deepinfer-worker@.service", "deepinfer-kvcache@.service", *ranks}
    wants = unit_settings(files["deepinfer.target"])["Wants"][0].split()
    assert set(ranks) <= set(wants) and "deepinfer-worker@solo.service" in wants  # one rank: the template, as before
    assert not any("deepinfer-worker@w." in u for u in wants)
    for r, unit in enumerate(ranks):
        s = unit_settings(files[unit])
        assert_hardened(files[unit])
        assert s["ExecStart"] == [f"/usr/bin/deepinfer-launch service worker --topology {path.resolve()} --name w "
                                  f"--rank {r}"]
        assert s["Restart"] == ["on-failure"] and s["PartOf"] == ["deepinfer.target"]
        assert "PrivateDevices" not in s  # a rank may drive a GPU
        assert "deepinfer-router@router.service" in s["After"][0]
    # Rank 0 and every follower are bound both ways; rank 0 starts after its followers and so stops first.
    leader = unit_settings(files[ranks[0]])
    assert leader["BindsTo"] == [" ".join(ranks[1:])] and leader["After"][1:] == [" ".join(ranks[1:])]
    for unit in ranks[1:]:
        assert unit_settings(files[unit])["BindsTo"] == [ranks[0]]
        assert len(unit_settings(files[unit])["After"]) == 1
    out = tmp_path / "units"
    write_units(path, out)
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed: unit files were written but not verified")
    res = subprocess.run(["systemd-analyze", "verify", "--man=no", *(str(out / u) for u in ranks)],
                         capture_output=True, text=True)
    problems = [line for line in res.stderr.splitlines() if "deepinfer-worker-w" in line]
    assert res.returncode == 0 and not problems, res.stderr


def test_a_group_whose_name_cannot_name_a_unit_is_refused(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text(GROUP_TOPOLOGY.replace('name = "w"', 'name = "w/1"'))
    with pytest.raises(TopologyError, match="worker w/1: .* may hold only letters, digits"):
        unit_files(path, Topology.load(path))
