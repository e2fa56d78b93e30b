"""systemd units for a topology: one template per role, one instance per service in the topology.

    deepinfer-launch systemd --topology /etc/deepinfer/topology.toml --out /etc/systemd/system
    systemctl daemon-reload && systemctl enable --now deepinfer.target

Templates take the service's name in the topology as the instance (`deepinfer-worker@prefill-0`), so one
template serves every device of a host. Tokenizers and workers start after the router (they connect to it,
and retry until the handshake succeeds anyway); every unit restarts on failure with a delay and is
part of `deepinfer.target`, which stops them all together.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from deepinfer.launch.topology import Topology

_TARGET = """[Unit]
Description=DeepInfer inference mesh
Wants={wants}

[Install]
WantedBy=multi-user.target
"""

_TEMPLATE = """[Unit]
Description=DeepInfer {role} %i
After=network-online.target {after}
Wants=network-online.target
PartOf=deepinfer.target

[Service]
Type=exec
ExecStart={exec_start}
Restart=on-failure
RestartSec=2
TimeoutStopSec=60
KillSignal=SIGTERM
Environment=PYTHONUNBUFFERED=1
LimitNOFILE=65536

[Install]
WantedBy=deepinfer.target
"""


def unit_files(topology_path: Path, topology: Topology, launcher: str | None = None) -> dict[str, str]:
    """File name → contents: the target, the four templates, and nothing per instance (instances are
    enabled through the target's Wants=)."""
    launcher = launcher or f"{shlex.quote(sys.executable)} -m deepinfer.launch.cli"
    topo = shlex.quote(str(topology_path.resolve()))

    def exec_start(role: str) -> str:
        return f"{launcher} service {role} --topology {topo} --name %i"

    instances = ["deepinfer-router@router.service"]
    instances += [f"deepinfer-tokenizer@{t.name}.service" for t in topology.tokenizers]
    instances += [f"deepinfer-worker@{w.name}.service" for w in topology.workers]
    instances += [f"deepinfer-kvcache@{k.name}.service" for k in topology.kvcaches]
    return {
        "deepinfer.target": _TARGET.format(wants=" ".join(instances)),
        "deepinfer-router@.service": _TEMPLATE.format(role="router", after="", exec_start=exec_start("router")),
        "deepinfer-tokenizer@.service": _TEMPLATE.format(
            role="tokenizer", after="deepinfer-router@router.service", exec_start=exec_start("tokenizer")),
        "deepinfer-worker@.service": _TEMPLATE.format(
            role="worker", after="deepinfer-router@router.service",
            exec_start=exec_start("worker")),
        # Workers do not wait for the cache daemon: without it they compute every prompt in full.
        "deepinfer-kvcache@.service": _TEMPLATE.format(
            role="kvcache", after="deepinfer-router@router.service", exec_start=exec_start("kvcache")),
    }


def write_units(topology_path: Path, out_dir: Path, launcher: str | None = None) -> list[Path]:
    topology = Topology.load(topology_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in unit_files(topology_path, topology, launcher).items():
        path = out_dir / name
        path.write_text(text)
        written.append(path)
    return written
