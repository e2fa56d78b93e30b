"""Fail closed (issue 30): a topology with a tcp:// endpoint and no [security] is refused wherever services
start from it (`up`, `service`, `systemd` units), with a reason naming the open endpoints, unless the operator
said otherwise: `insecure = true` in the file, or `--insecure` to `up` and `service` (`up` hands it to the
services it starts in a copy of the file that says so). Loading such a file is never refused: `keys` needs to."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from deepinfer.launch import cli, cli_up, mesh
from deepinfer.launch.sections import SecuritySpec
from deepinfer.launch.supervisor import Supervisor
from deepinfer.launch.topology import Topology, TopologyError

TCP = """
model = "smollm2"
[router]
frontend = "tcp://127.0.0.1:5550"
backend = "tcp://10.0.0.1:5551"
[[tokenizer]]
name = "tok"
detok = "tcp://10.0.0.1:5560"
[[worker]]
name = "w"
role = "worker"
kv = "tcp://10.0.0.2:5570"
"""


def write(tmp_path: Path, text: str, name: str = "t.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_tcp_without_security_is_refused_naming_the_open_endpoints(tmp_path):
    topo = Topology.load(write(tmp_path, TCP))  # loading is never refused
    assert [what for what, _ in topo.unsecured_endpoints()] == ["router frontend", "router backend",
                                                               "tokenizer tok detok", "worker w kv"]
    with pytest.raises(TopologyError) as exc:
        topo.check_secured()
    text = str(exc.value)
    assert "router frontend tcp://127.0.0.1:5550" in text and "and 1 more" in text  # loopback is open too
    assert "[security]" in text and "--insecure" in text and "insecure = true" in text
    topo.check_secured(insecure=True)  # the operator's flag
    dataclasses.replace(topo, insecure=True).check_secured()  # or the file's word
    dataclasses.replace(topo, security=SecuritySpec(str(tmp_path / "keys"))).check_secured()  # or CURVE
    Topology.local("smollm2", "ipc", tmp_path).check_secured()  # ipc and inproc are never refused
    Topology.local("smollm2", "inproc").check_secured()


def test_the_insecure_key_round_trips_and_is_checked(tmp_path):
    topo = Topology.load(write(tmp_path, "insecure = true\n" + TCP))
    assert topo.insecure and Topology.load(write(tmp_path, topo.to_toml(), "again.toml")) == topo
    assert "insecure" not in Topology.load(write(tmp_path, TCP)).to_toml()
    with pytest.raises(TopologyError, match="insecure"):
        Topology.load(write(tmp_path, 'insecure = "yes"\n' + TCP))
    with pytest.raises(TopologyError, match="contradict"):
        Topology.load(write(tmp_path, f'insecure = true\n{TCP}[security]\nkeys_dir = "{tmp_path}"\n'))


def test_service_refuses_an_open_topology_unless_told_otherwise(tmp_path, monkeypatch):
    started: list[tuple[str, str]] = []
    monkeypatch.setattr(mesh, "run_service", lambda topo, role, name: started.append((role, name)))
    path = write(tmp_path, TCP)
    refused = CliRunner().invoke(cli.main, ["service", "router", "--topology", str(path), "--name", "router"])
    assert refused.exit_code == 1 and "refusing to run tcp:// endpoints without [security]" in refused.output
    # Usage errors still come first: the command line is checked before the mesh it would join.
    usage = CliRunner().invoke(cli.main, ["service", "worker", "--topology", str(path)])
    assert usage.exit_code == 2 and "give --name or --index" in usage.output
    assert started == []
    ok = CliRunner().invoke(cli.main, ["service", "router", "--topology", str(path), "--index", "0", "--insecure"])
    assert ok.exit_code == 0, ok.output
    said = write(tmp_path, "insecure = true\n" + TCP, "said.toml")
    ok = CliRunner().invoke(cli.main, ["service", "router", "--topology", str(said), "--index", "0"])
    assert ok.exit_code == 0, ok.output
    assert started == [("router", "router")] * 2


def test_systemd_units_need_the_file_to_say_insecure(tmp_path):
    out = tmp_path / "units"
    refused = CliRunner().invoke(cli.main, ["systemd", "--topology", str(write(tmp_path, TCP)), "--out", str(out)])
    assert refused.exit_code == 1 and "set `insecure = true` at the top" in refused.output
    assert "--insecure" not in refused.output and not out.exists()  # every unit reads the file, not a flag
    said = write(tmp_path, "insecure = true\n" + TCP, "said.toml")
    assert CliRunner().invoke(cli.main, ["systemd", "--topology", str(said), "--out", str(out)]).exit_code == 0
    assert any(out.iterdir())


def test_up_refuses_before_making_anything_and_hands_insecure_to_its_services(tmp_path, monkeypatch):
    seen: dict[str, Any] = {}

    def supervise(topology: Path, log_dir: Path, logs: str) -> None:  # what `up` would start, recorded
        seen.update(path=topology, topo=Topology.load(topology))
        sup = Supervisor(topology, log_dir=tmp_path)
        seen["command"] = sup.command(sup.children[0])

    monkeypatch.setattr(cli_up, "_supervise", supervise)
    path, run = write(tmp_path, TCP), tmp_path / "run"
    refused = CliRunner().invoke(cli.main, ["up", "--topology", str(path), "--run-dir", str(run)])
    assert refused.exit_code == 1 and "without [security]" in refused.output
    assert not run.exists() and not seen
    ok = CliRunner().invoke(cli.main, ["up", "--topology", str(path), "--run-dir", str(run), "--insecure"])
    assert ok.exit_code == 0, ok.output
    supervised, command = seen["path"], seen["command"]
    assert supervised.parent == run and seen["topo"] == dataclasses.replace(Topology.load(path), insecure=True)
    assert command[command.index("--topology") + 1] == str(supervised)  # what each service it starts reads
    assert not supervised.exists()  # made by this run, removed at its end
