"""The expert balancer in the launcher: the `[balancer]` table (strict parsing, TOML round trip), a worker's
`redundant_experts` reaching its engine, the supervisor's child, the systemd unit, its service key, and
`up`'s options (on by default for --ep groups of an MoE model, off with --no-balancer or a dense model)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from deepinfer.launch import cli, cli_up
from deepinfer.launch.keys import key_owners, make_keys, service_auth
from deepinfer.launch.mesh import engine_config
from deepinfer.launch.supervisor import Supervisor
from deepinfer.launch.systemd import unit_files
from deepinfer.launch.topology import BalancerConfig, Topology, TopologyError
from deepinfer.services.balancer_config import BALANCER_DEFAULTS

MINIMAL = """
[router]
frontend = "tcp://10.0.0.1:5550"
backend = "tcp://10.0.0.1:5551"
[[tokenizer]]
name = "tok"
detok = "tcp://10.0.0.1:5560"
[[worker]]
name = "w"
role = "worker"
kv = "tcp://10.0.0.2:5570"
ep = 2
ep_master = "10.0.0.2:29500"
redundant_experts = 3
"""


def load(tmp_path: Path, text: str) -> Topology:
    path = tmp_path / "t.toml"
    path.write_text(text)
    return Topology.load(path)


def test_a_balancer_table_reads_and_round_trips(tmp_path):
    topo = load(tmp_path, MINIMAL + "[balancer]\ninterval_s = 5\nwindow_s = 30.5\nthreshold = 0.1\nmax_moves = 4\n"
                                    "max_moves_total = 20\nmove_timeout_s = 12.0\n")
    assert topo.balancer == BalancerConfig(interval_s=5.0, window_s=30.5, threshold=0.1, max_moves=4,
                                           max_moves_total=20, move_timeout_s=12.0)
    assert "max_moves = 4" in topo.to_toml() and "max_moves_total = 20" in topo.to_toml()
    assert load(tmp_path, topo.to_toml()) == topo
    defaults = load(tmp_path, MINIMAL + "[balancer]\n")  # an empty table: every default
    assert defaults.balancer == BALANCER_DEFAULTS
    assert "[balancer]" in defaults.to_toml() and load(tmp_path, defaults.to_toml()) == defaults
    none = load(tmp_path, MINIMAL)
    assert none.balancer is None and "[balancer]" not in none.to_toml()


@pytest.mark.parametrize("table, match", [
    ("intervals = 3", "balancer: unknown key 'intervals'"),
    ('interval_s = "3"', "balancer: interval_s = '3': must be a number"),
    ("max_moves = 1.5", "balancer: max_moves = 1.5: must be an integer"),
    ("interval_s = 0", "balancer: interval_s, window_s and move_timeout_s must be positive"),
    ("threshold = -0.1", "balancer: threshold = -0.1: must not be negative"),
    ("max_moves = 0", "balancer: max_moves = 0: must be at least 1"),
    ("max_moves_total = 0", "balancer: max_moves_total = 0: must be at least 1"),
    ("max_moves_total = -4", "balancer: max_moves_total = -4: must be at least 1"),
    ("max_moves_total = 2.5", "balancer: max_moves_total = 2.5: must be an integer"),
    ('max_moves_total = "64"', "balancer: max_moves_total = '64': must be an integer"),
])
def test_bad_balancer_keys_are_refused_naming_the_key(tmp_path, table, match):
    with pytest.raises(TopologyError, match=match):
        load(tmp_path, MINIMAL + "[balancer]\n" + table + "\n")


def test_the_default_move_bounds_are_finite_and_checked_in_python_too():
    # Out of the box one decision may not reload every slot of every layer.
    assert BALANCER_DEFAULTS.max_moves == 8 and BALANCER_DEFAULTS.max_moves_total == 64
    for bad, match in (({"max_moves": 0}, "max_moves = 0"), ({"max_moves_total": 0}, "max_moves_total = 0"),
                       ({"max_moves": None}, "max_moves = None: must be an integer"),
                       ({"max_moves_total": 1.5}, "max_moves_total = 1.5: must be an integer")):
        with pytest.raises(ValueError, match=match):
            BalancerConfig(**bad)


def test_the_balancer_name_is_taken_and_redundant_experts_is_checked(tmp_path):
    clash = MINIMAL.replace('name = "tok"', 'name = "balancer"')
    assert load(tmp_path, clash).balancer is None  # a tokenizer may be called so when no balancer runs
    with pytest.raises(TopologyError, match="service names must be unique"):
        load(tmp_path, clash + "[balancer]\n")
    with pytest.raises(TopologyError, match="worker w: redundant_experts = -1: must not be negative"):
        load(tmp_path, MINIMAL.replace("redundant_experts = 3", "redundant_experts = -1"))


def test_redundant_experts_reaches_the_engine_config(tmp_path):
    topo = load(tmp_path, MINIMAL)
    assert engine_config(topo.worker("w")).redundant_experts == 3
    automatic = load(tmp_path, MINIMAL.replace("redundant_experts = 3\n", ""))
    assert automatic.worker("w").redundant_experts is None
    assert engine_config(automatic.worker("w")).redundant_experts is None


def test_supervisor_systemd_and_keys_run_the_balancer_when_the_topology_has_one(tmp_path):
    path = tmp_path / "t.toml"
    for with_balancer in (True, False):
        path.write_text(MINIMAL + ("[balancer]\n" if with_balancer else ""))
        topo = Topology.load(path)
        sup = Supervisor(path)
        balancers = [c for c in sup.children if c.role == "balancer"]
        units = unit_files(path, topo, launcher="deepinfer-launch")
        if not with_balancer:
            assert not balancers and "deepinfer-balancer@.service" not in units and "balancer" not in key_owners(topo)
            continue
        assert [(c.name, c.threads) for c in balancers] == [("balancer", 1)]
        assert sup.command(balancers[0])[3:] == ["service", "balancer", "--topology", str(path), "--name", "balancer"]
        unit = units["deepinfer-balancer@.service"]
        assert "service balancer --topology" in unit and "--name %i" in unit and "PrivateDevices=yes" in unit
        assert "deepinfer-balancer@balancer.service" in units["deepinfer.target"]
        assert "balancer" in key_owners(topo)


def test_a_secured_mesh_gives_the_balancer_a_key_the_router_allows(tmp_path):
    plain = load(tmp_path, MINIMAL + "[balancer]\n")
    make_keys(tmp_path / "keys", plain)
    topo = load(tmp_path, MINIMAL + f'[balancer]\n[security]\nkeys_dir = "{tmp_path / "keys"}"\n')
    mine = service_auth(topo, "balancer", "balancer")
    assert mine.keypair is not None and not mine.allow and "router" in mine.server_keys  # binds nothing
    backend = service_auth(topo, "router", "router").allow["backend"]
    assert backend.rule_for(mine.keypair.public) == "balancer"


def test_service_balancer_needs_a_balancer_table(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text(MINIMAL)
    result = CliRunner().invoke(cli.main, ["service", "balancer", "--topology", str(path), "--index", "0"])
    assert result.exit_code == 2 and "give --name or --index in [0, 0) for balancer" in result.output


# -- up ---------------------------------------------------------------------------------------------------------

MIXTRAL = dict(model_type="mixtral", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
               intermediate_size=128, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2)


def model_dir(tmp_path: Path, moe: bool) -> Path:
    """A model directory holding only its config.json: `up` reads no weights to decide on a balancer."""
    path = tmp_path / ("moe" if moe else "dense")
    path.mkdir(exist_ok=True)
    config = dict(MIXTRAL) if moe else {**MIXTRAL, "model_type": "llama"}
    if not moe:
        del config["num_local_experts"], config["num_experts_per_tok"]
    (path / "config.json").write_text(json.dumps(config))
    return path


def up_topology(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> Topology:
    """The topology `up ARGS` would supervise (the supervisor itself is not started)."""
    seen: dict[str, Any] = {}
    monkeypatch.setattr(cli_up, "_supervise", lambda topology, log_dir, logs: seen.update(t=Topology.load(topology)))
    result = CliRunner().invoke(cli.main, ["up", "--run-dir", str(tmp_path / "run"), "--no-kvcache", *args])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return seen["t"]


def test_up_runs_a_balancer_for_moe_groups_only(tmp_path, monkeypatch):
    moe, dense = str(model_dir(tmp_path, True)), str(model_dir(tmp_path, False))
    topo = up_topology(tmp_path, monkeypatch, "--model", moe, "--ep", "2", "--redundant-experts", "2",
                       "--balancer-interval", "7", "--balancer-window", "70")
    assert topo.balancer == BalancerConfig(interval_s=7.0, window_s=70.0)
    assert {w.redundant_experts for w in topo.workers} == {2}
    assert up_topology(tmp_path, monkeypatch, "--model", moe, "--ep", "2").balancer == BALANCER_DEFAULTS
    assert up_topology(tmp_path, monkeypatch, "--model", moe, "--ep", "2", "--no-balancer").balancer is None
    assert up_topology(tmp_path, monkeypatch, "--model", moe).balancer is None  # no groups: nothing to balance
    assert up_topology(tmp_path, monkeypatch, "--model", dense, "--ep", "2").balancer is None
    plain = up_topology(tmp_path, monkeypatch, "--model", moe)
    assert {w.redundant_experts for w in plain.workers} == {None}


@pytest.mark.parametrize("option", [["--no-balancer"], ["--balancer-interval", "3"], ["--redundant-experts", "1"]])
def test_up_refuses_balancer_options_with_a_topology_file(tmp_path, option):
    path = tmp_path / "t.toml"
    path.write_text(MINIMAL)
    result = CliRunner().invoke(cli.main, ["up", "--topology", str(path), *option])
    assert result.exit_code == 2 and "with --topology" in result.output


def test_up_refuses_bad_balancer_values(tmp_path):
    for option in (["--balancer-interval", "0"], ["--balancer-window", "-1"], ["--redundant-experts", "-1"]):
        result = CliRunner().invoke(cli.main, ["up", *option])
        assert result.exit_code == 2, option


def test_up_passes_weights_and_kv_dtype_to_its_topology_and_refuses_them_with_a_file(tmp_path, monkeypatch):
    dense = str(model_dir(tmp_path, False))
    topo = up_topology(tmp_path, monkeypatch, "--model", dense, "--weights", "q8_0", "--kv-cache-dtype", "fp16")
    assert {w.weights for w in topo.workers} == {"q8_0"} and topo.kv_cache_dtype == "float16"
    plain = up_topology(tmp_path, monkeypatch, "--model", dense)
    assert {w.weights for w in plain.workers} == {"auto"} and plain.kv_cache_dtype == "float32"
    path = tmp_path / "t.toml"
    path.write_text(MINIMAL)
    for option in (["--weights", "fp32"], ["--kv-cache-dtype", "fp16"]):
        result = CliRunner().invoke(cli.main, ["up", "--topology", str(path), *option])
        assert result.exit_code == 2 and "with --topology" in result.output, option


def test_native_weights_for_a_hugging_face_model_are_refused_before_anything_starts(tmp_path):
    dense = str(model_dir(tmp_path, False))
    for command in (["up", "--run-dir", str(tmp_path / "run")], ["generate", "--prompt", "Hi"]):
        result = CliRunner().invoke(cli.main, [*command, "--model", dense, "--weights", "native"])
        assert result.exit_code == 2 and "use --weights q8_0" in result.output, (command, result.output)
