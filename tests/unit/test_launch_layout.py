"""`up`'s default layout: `choose_layout` from scripted machine facts (explicit choices win, contradictions are
refused), the host's facts, and `up` itself (the topology it supervises, the one line it says on stderr)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from deepinfer.launch import cli, cli_up
from deepinfer.launch.layout import (
    Layout,
    LayoutConflict,
    MachineFacts,
    choose_layout,
    count_accelerators,
    machine_facts,
)
from deepinfer.launch.topology import Topology

TWO_CORES = MachineFacts(cores=2, accelerators=0, memory_bytes=8 << 30)


@pytest.mark.parametrize("facts", [TWO_CORES, MachineFacts(1), MachineFacts(64, 0, 512 << 30),
                                   MachineFacts(16, 2, 128 << 30), MachineFacts(4, 1, None)])
def test_a_cpu_host_gets_one_co_located_worker_and_says_why(facts):
    layout = choose_layout(facts)
    assert (layout.disaggregated, layout.num_prefill, layout.num_decode) == (False, 0, 0)
    assert f"{facts.cores} core" in layout.reason and "--prefill/--decode" in layout.reason
    assert "0.62-0.66x" in layout.reason  # the measurement behind it
    if facts.accelerators:
        assert f"{facts.accelerators} accelerator" in layout.reason and "on the CPU" in layout.reason
    else:
        assert "no accelerator" in layout.reason
    assert ("GiB memory" in layout.reason) == (facts.memory_bytes is not None)


def test_two_cores_and_eight_gib_read_as_such():
    assert TWO_CORES.summary() == "2 cores, no accelerator, 8.0 GiB memory"
    assert MachineFacts(1, 1).summary() == "1 core, 1 accelerator (unused: `up` runs its workers on the CPU)"


@pytest.mark.parametrize("given, expect", [
    (dict(colocated=True), Layout(False, 0, 0, "as asked (--colocated)")),
    (dict(num_prefill=1, num_decode=1), Layout(True, 1, 1, "as asked (--prefill 1 --decode 1)")),
    (dict(num_prefill=2), Layout(True, 2, 1, "as asked (--prefill 2 --decode 1)")),
    (dict(num_decode=3), Layout(True, 1, 3, "as asked (--prefill 1 --decode 3)")),
])
def test_explicit_choices_win_on_any_machine(given, expect):
    for facts in (TWO_CORES, MachineFacts(128, 8, 2 << 40)):
        assert choose_layout(facts, **given) == expect


@pytest.mark.parametrize("given", [dict(colocated=True, num_prefill=1), dict(colocated=True, num_decode=2),
                                   dict(num_prefill=0), dict(num_decode=0)])
def test_contradictions_are_refused(given):
    with pytest.raises(LayoutConflict):
        choose_layout(TWO_CORES, **given)


def test_the_host_s_facts(tmp_path):
    facts = machine_facts()
    assert facts.cores >= 1 and (facts.memory_bytes is None or facts.memory_bytes > 0)
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia12", "sda"):
        (tmp_path / name).touch()
    assert count_accelerators(tmp_path) == 3
    assert count_accelerators(tmp_path / "missing") == 0


# --- `up` -----------------------------------------------------------------------------------------------------


def up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str, facts: MachineFacts = TWO_CORES) -> Any:
    """`up ARGS` on a machine with `facts` up to the supervisor (not started): (the topology, the result)."""
    seen: dict[str, Any] = {}
    monkeypatch.setattr(cli_up, "_supervise", lambda topology, log_dir, logs: seen.update(t=Topology.load(topology)))
    monkeypatch.setattr("deepinfer.launch.layout.machine_facts", lambda: facts)
    result = CliRunner().invoke(cli.main, ["up", "--run-dir", str(tmp_path / "run"), "--no-kvcache", *args])
    return seen.get("t"), result


def roles(topology: Topology) -> list[tuple[str, str]]:
    return [(w.name, w.role) for w in topology.workers]


def test_up_runs_the_chosen_layout_and_says_so_on_stderr(tmp_path, monkeypatch):
    topo, result = up(tmp_path, monkeypatch)
    assert result.exit_code == 0, result.output
    assert roles(topo) == [("worker-0", "worker")]
    [line] = result.stderr.splitlines()
    assert line.startswith("layout: 1 co-located worker, 2 threads each: 2 cores, no accelerator, 8.0 GiB memory: ")
    assert result.stdout == ""  # stdout keeps the lines scripts read once the mesh is ready


def test_up_s_flags_win(tmp_path, monkeypatch):
    topo, result = up(tmp_path, monkeypatch, "--prefill", "1", "--decode", "1")
    assert roles(topo) == [("prefill-0", "prefill"), ("decode-0", "decode")]
    assert result.stderr.strip() == "layout: 1 prefill + 1 decode workers, 1 thread each: as asked (--prefill 1 " \
                                    "--decode 1)"
    topo, result = up(tmp_path, monkeypatch, "--colocated", facts=MachineFacts(64, 4, 1 << 40))
    assert roles(topo) == [("worker-0", "worker")] and "as asked (--colocated)" in result.stderr
    _, result = up(tmp_path, monkeypatch, "--colocated", "--decode", "2")
    assert result.exit_code == 2 and "give one or the other" in result.output


def test_a_topology_file_wins_and_refuses_layout_flags(tmp_path, monkeypatch):
    path = tmp_path / "pd.toml"
    path.write_text(Topology.local("smollm2", "ipc", tmp_path / "sockets", kvcache=False).to_toml())
    topo, result = up(tmp_path, monkeypatch, "--topology", str(path), "--no-kvcache")
    assert result.exit_code == 0, result.output
    assert roles(topo) == [("prefill-0", "prefill"), ("decode-0", "decode")]  # as the file says, on 2 cores
    assert f"the topology file {path}" in result.stderr
    for flag in (["--colocated"], ["--prefill", "2"], ["--decode", "1"]):
        _, result = up(tmp_path, monkeypatch, "--topology", str(path), *flag)
        assert result.exit_code == 2 and "set the [[worker]] tables per worker in the file" in result.output
