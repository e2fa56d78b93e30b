"""systemd units for a topology: one template per role, one instance per service in the topology.

    deepinfer-launch systemd --topology /etc/deepinfer/topology.toml --out /etc/systemd/system [--user deepinfer]
    systemctl daemon-reload && systemctl enable --now deepinfer.target

Templates take the service's name in the topology as the instance (`deepinfer-worker@prefill-0`), so one
template serves every device of a host. Tokenizers and workers start after the router (they connect to it,
and retry until the handshake succeeds anyway); every unit restarts on failure with a delay and is
part of `deepinfer.target`, which stops them all together.

Every unit runs as an unprivileged user (default `deepinfer`, which must exist: `useradd --system deepinfer`)
in a read-only view of the system: writable are only its cache directory (`/var/cache/deepinfer`: the
fetched model, compiled kernels and, unless the topology names another `dir`, the KV disk tier), its runtime
directory (`/run/deepinfer`, mode 0700, where ipc:// sockets belong), a private /tmp, and the directories the
topology names for KV disk tiers and ipc sockets. A stop drains (`Service.drain`); systemd waits longer than
the drain timeout before it kills.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from deepinfer.launch.topology import Topology
from deepinfer.services.base import DRAIN_TIMEOUT_S

DEFAULT_USER = "deepinfer"
STOP_MARGIN_S = 30  # TimeoutStopSec = the drain timeout + this: systemd only SIGKILLs a drain that overran
HOME_DIRS = ("/home", "/root", "/run/user")  # what ProtectHome= hides

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
User={user}
ExecStart={exec_start}
Restart=on-failure
RestartSec=2
TimeoutStopSec={stop_s}
KillSignal=SIGTERM
Environment=PYTHONUNBUFFERED=1
Environment=DEEPINFER_CACHE_DIR=%C/deepinfer
LimitNOFILE=65536
CacheDirectory=deepinfer
CacheDirectoryMode=0700
RuntimeDirectory=deepinfer
RuntimeDirectoryMode=0700
# Shared by every unit of the mesh: one unit stopping must not remove the others' sockets.
RuntimeDirectoryPreserve=yes
UMask=0077
NoNewPrivileges=yes
CapabilityBoundingSet=
ProtectSystem=strict
{read_write}ProtectHome={protect_home}
PrivateTmp=yes
{private_devices}ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
RestrictNamespaces=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK
SystemCallArchitectures=native

[Install]
WantedBy=deepinfer.target
"""


def _writable_dirs(topology: Topology) -> list[str]:
    """Directories the services write besides their cache and runtime directories: KV disk tiers the
    topology names, and the directories of its ipc:// sockets."""
    endpoints = [topology.frontend, topology.backend, *(t.detok for t in topology.tokenizers),
                 *(w.kv for w in topology.workers), *(k.endpoint for k in topology.kvcaches)]
    dirs = [str(Path(e.removeprefix("ipc://")).parent) for e in endpoints if e.startswith("ipc://")]
    dirs += [k.dir for k in topology.kvcaches if k.dir is not None]
    return sorted(set(dirs))


def _under_home(path: str) -> bool:
    return any(path == h or path.startswith(h + "/") for h in HOME_DIRS)


def unit_files(topology_path: Path, topology: Topology, launcher: str | None = None,
               user: str = DEFAULT_USER) -> dict[str, str]:
    """File name → contents: the target, the four templates, and nothing per instance (instances are
    enabled through the target's Wants=)."""
    launcher = launcher or f"{shlex.quote(sys.executable)} -m deepinfer.launch.cli"
    topo = shlex.quote(str(topology_path.resolve()))
    writable = _writable_dirs(topology)
    # Home directories stay hidden unless the topology, the model or a directory it names lives there.
    read = [str(topology_path.resolve()), topology.model, shlex.split(launcher)[0], *writable]
    protect_home = "read-only" if any(_under_home(p) for p in read) else "yes"
    # "-": a directory that does not exist yet is skipped rather than failing the start.
    read_write = "".join(f"ReadWritePaths=-{d}\n" for d in writable)

    def template(role: str, after: str = "deepinfer-router@router.service") -> str:
        # Workers may drive a GPU; the other roles need no device at all.
        private_devices = "" if role == "worker" else "PrivateDevices=yes\n"
        return _TEMPLATE.format(role=role, after=after, user=user, stop_s=int(DRAIN_TIMEOUT_S) + STOP_MARGIN_S,
                                exec_start=f"{launcher} service {role} --topology {topo} --name %i",
                                read_write=read_write, protect_home=protect_home, private_devices=private_devices)

    instances = ["deepinfer-router@router.service"]
    instances += [f"deepinfer-tokenizer@{t.name}.service" for t in topology.tokenizers]
    instances += [f"deepinfer-worker@{w.name}.service" for w in topology.workers]
    instances += [f"deepinfer-kvcache@{k.name}.service" for k in topology.kvcaches]
    return {
        "deepinfer.target": _TARGET.format(wants=" ".join(instances)),
        "deepinfer-router@.service": template("router", after=""),
        "deepinfer-tokenizer@.service": template("tokenizer"),
        "deepinfer-worker@.service": template("worker"),
        # Workers do not wait for the cache daemon: without it they compute every prompt in full.
        "deepinfer-kvcache@.service": template("kvcache"),
    }


def write_units(topology_path: Path, out_dir: Path, launcher: str | None = None,
                user: str = DEFAULT_USER) -> list[Path]:
    topology = Topology.load(topology_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in unit_files(topology_path, topology, launcher, user).items():
        path = out_dir / name
        path.write_text(text)
        written.append(path)
    return written
