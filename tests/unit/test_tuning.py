"""Process tuning: glibc's malloc thresholds, applied unless the operator chose their own."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

from deepinfer.launch.supervisor import Supervisor
from deepinfer.launch.topology import Topology
from deepinfer.launch.tuning import MALLOC_ENV, tune_malloc


def test_thresholds_apply_on_glibc_unless_set_by_the_operator(monkeypatch):
    code = "from deepinfer.launch.tuning import tune_malloc; print(tune_malloc())"
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_ENV}
    applied = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    if platform.libc_ver()[0] == "glibc":
        assert applied.stdout.strip() == "True"
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert tune_malloc() is False


def test_supervised_children_start_with_the_thresholds_unless_the_operator_set_one(tmp_path, monkeypatch):
    path = tmp_path / "t.toml"
    path.write_text(Topology.local("smollm2", "ipc", tmp_path).to_toml())
    spawned: list[dict[str, str]] = []
    monkeypatch.setattr("subprocess.Popen", lambda cmd, env, **kw: spawned.append(env) or _Proc())
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1")
    Supervisor(path)._spawn(Supervisor(path).children[0])
    assert spawned[0]["MALLOC_MMAP_THRESHOLD_"] == MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]
    assert spawned[0]["MALLOC_TRIM_THRESHOLD_"] == "1"


class _Proc:
    pid = 0
