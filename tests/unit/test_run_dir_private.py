"""ipc:// sockets are only as private as their directory: an existing `--run-dir`, and the directories a
hand-written topology puts its sockets in, are refused unless owned by this user with no group/other access
(never silently repaired)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from deepinfer.launch.cli import main as cli
from deepinfer.launch.supervisor import Supervisor, UnsafeRunDir, check_ipc_dirs, check_private_dir, ipc_dirs
from deepinfer.launch.topology import Topology


def _dir(tmp_path: Path, name: str, mode: int) -> Path:
    d = tmp_path / name
    d.mkdir()
    d.chmod(mode)
    return d


def _topology(tmp_path: Path, sockets: Path) -> Path:
    path = tmp_path / "topology.toml"
    path.write_text(Topology.local("smollm2", "ipc", sockets).to_toml())
    return path


def test_a_private_directory_is_accepted(tmp_path):
    check_private_dir(_dir(tmp_path, "run", 0o700))


@pytest.mark.parametrize("mode", [0o750, 0o705, 0o770, 0o777, 0o710])
def test_a_directory_group_or_others_may_enter_is_refused_naming_it_and_its_mode(tmp_path, mode):
    d = _dir(tmp_path, "run", mode)
    with pytest.raises(UnsafeRunDir) as err:
        check_private_dir(d)
    assert str(d) in str(err.value) and f"{mode:o}" in str(err.value)
    assert d.stat().st_mode & 0o777 == mode  # not repaired


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory another user owns needs root")
def test_a_directory_another_user_owns_is_refused(tmp_path):
    d = _dir(tmp_path, "run", 0o700)
    os.chown(d, 65534, 65534)
    with pytest.raises(UnsafeRunDir, match="owned by uid 65534"):
        check_private_dir(d)


def test_every_ipc_directory_of_a_topology_is_checked(tmp_path):
    good, bad = _dir(tmp_path, "good", 0o700), _dir(tmp_path, "bad", 0o755)
    topo = Topology.local("smollm2", "ipc", good)
    assert ipc_dirs(topo) == [good]
    check_ipc_dirs(topo)
    with pytest.raises(UnsafeRunDir, match=str(bad)):
        check_ipc_dirs(Topology.local("smollm2", "ipc", bad))
    check_ipc_dirs(Topology.local("smollm2", "inproc"))  # no ipc: nothing to check


def test_the_supervisor_starts_nothing_on_a_topology_whose_socket_directory_is_open(tmp_path):
    sup = Supervisor(_topology(tmp_path, _dir(tmp_path, "sockets", 0o755)), log_dir=tmp_path)
    with pytest.raises(UnsafeRunDir, match="755"):
        sup.start()
    assert all(c.proc is None for c in sup.children)


def test_up_refuses_an_existing_run_dir_others_may_enter(tmp_path):
    run = _dir(tmp_path, "run", 0o755)
    topology = _topology(tmp_path, _dir(tmp_path, "sockets", 0o700))
    result = CliRunner().invoke(cli, ["up", "--topology", str(topology), "--run-dir", str(run)])
    assert result.exit_code != 0
    assert str(run) in result.output and "755" in result.output, result.output


def test_up_refuses_a_hand_written_topology_whose_sockets_others_may_reach(tmp_path):
    sockets = _dir(tmp_path, "sockets", 0o775)
    topology = _topology(tmp_path, sockets)
    run = _dir(tmp_path, "run", 0o700)
    result = CliRunner().invoke(cli, ["up", "--topology", str(topology), "--run-dir", str(run)])
    assert result.exit_code != 0
    assert str(sockets) in result.output and "775" in result.output, result.output


def test_a_single_service_refuses_a_topology_whose_sockets_others_may_reach(tmp_path):
    """`deepinfer-launch service` (what a systemd unit or an operator runs) checks like `up` before it binds."""
    sockets = _dir(tmp_path, "sockets", 0o750)
    result = CliRunner().invoke(cli, ["service", "router", "--topology", str(_topology(tmp_path, sockets))])
    assert result.exit_code != 0
    assert str(sockets) in result.output and "750" in result.output, result.output
