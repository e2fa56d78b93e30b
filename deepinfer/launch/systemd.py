"""systemd units for a topology: one template per role, one instance per service in the topology.

    deepinfer-launch systemd --topology /etc/deepinfer/topology.toml --out /etc/systemd/system [--user deepinfer]
    systemctl daemon-reload && systemctl enable --now deepinfer.target

On a cluster, each machine writes its own: `--host ADDRESS` (its address in the topology) makes the target want only
the services bound there (docs/cluster.md).

Templates take the service's name in the topology as the instance (`deepinfer-worker@prefill-0`), so one
template serves every device of a host. The expert balancer, when the topology has one, is
`deepinfer-balancer@balancer`; each HTTP gateway is `deepinfer-gateway@NAME`. Tokenizers, workers, the
balancer and gateways start after the router (they connect to it,
and retry until the handshake succeeds anyway); every unit restarts on failure with a delay and is
part of `deepinfer.target`, which stops them all together.

Every unit runs as an unprivileged user (default `deepinfer`, which must exist: `useradd --system deepinfer`)
in a read-only view of the system: writable are only its cache directory (`/var/cache/deepinfer`: the
fetched model, compiled kernels and, unless the topology names another `dir`, the KV disk tier), its runtime
directory (`/run/deepinfer`, mode 0700, where ipc:// sockets belong), a private /tmp, and the directories the
topology names for KV disk tiers and ipc sockets. Every unit writes its metrics samples to
`/run/deepinfer/metrics` (`PROMETHEUS_MULTIPROC_DIR`), which a gateway's GET /metrics aggregates for the
host (the directory lives until reboot: a unit's restart leaves its old samples' counters in the sums, as
counters should). A stop drains (`Service.drain`); systemd waits longer than
the drain timeout before it kills.

An expert-parallel worker (`ep = N > 1`) gets one concrete unit per rank instead of a template instance,
`deepinfer-worker-NAME-rankR.service` (rank 0 speaks for the group; R > 0 runs `--rank R`). A collective
cannot go on without every rank, so rank 0 and each follower are bound both ways (`BindsTo=`): stopping
any rank stops the group, and a rank's automatic restart (`Restart=on-failure`) restarts every unit bound
to it, so the group starts again whole. Rank 0 is ordered after its followers, so on a stop it drains
first, while they still compute with it. A group whose ranks are on several hosts (the worker's `rank_hosts`)
gets, with `--host`, the units of that host's ranks only, bound to each other; systemd cannot bind units of
two machines, so across hosts the group holds itself together: a rank that loses its group exits and its unit
restarts it, and a follower away from rank 0's host has `Restart=always`, since its leader's restart ends it
cleanly (exit 0).

With a `[security]` table, no unit reads the keys directory (it stays root's, 0700): each unit gets its own
secret key and every service's public key (and the router the tenants' list) as systemd credentials
(`LoadCredential=`, read by systemd before it drops privileges, private to the unit).
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

from deepinfer.launch.keys import CLIENTS_CREDENTIAL, SECRET_CREDENTIAL, key_owners
from deepinfer.launch.topology import Topology, TopologyError, WorkerSpec
from deepinfer.metrics.env import MULTIPROC_ENV
from deepinfer.protocol.auth import CLIENTS_ALLOWED, CLIENTS_DIR, SERVICES_DIR
from deepinfer.services.balancer_config import BALANCER_NAME
from deepinfer.services.base import DRAIN_TIMEOUT_S

DEFAULT_USER = "deepinfer"
METRICS_DIR = "/run/deepinfer/metrics"  # inside every unit's RuntimeDirectory: one per host
STOP_MARGIN_S = 30  # TimeoutStopSec = the drain timeout + this: systemd only SIGKILLs a drain that overran
HOME_DIRS = ("/home", "/root", "/run/user")  # what ProtectHome= hides
UNIT_NAME_CHARS = re.compile(r"[A-Za-z0-9:_.-]+")  # what a unit name may hold (escapes aside)

_TARGET = """[Unit]
Description=DeepInfer inference mesh
Wants={wants}

[Install]
WantedBy=multi-user.target
"""

_TEMPLATE = """[Unit]
Description={description}
After=network-online.target {after}
Wants=network-online.target
PartOf=deepinfer.target
{group}
[Service]
Type=exec
User={user}
ExecStart={exec_start}
Restart={restart}
RestartSec=2
TimeoutStopSec={stop_s}
KillSignal=SIGTERM
Environment=PYTHONUNBUFFERED=1
Environment=DEEPINFER_CACHE_DIR=%C/deepinfer
Environment={metrics_env}
{credentials}LimitNOFILE=65536
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


def credential_lines(topology: Topology, role: str, name: str = "%i") -> str:
    """The LoadCredential= lines of a unit of `role` for instance `name` (a specifier or a name): its secret
    key, every service's public key, and for the router the tenants' public keys. Empty without [security]."""
    if topology.security is None:
        return ""
    keys = Path(topology.security.keys_dir)
    own = keys / (CLIENTS_DIR if role == "gateway" else SERVICES_DIR) / f"{name}.key_secret"
    lines = [f"LoadCredential={SECRET_CREDENTIAL}:{own}"]
    lines += [f"LoadCredential={o}.key:{keys / SERVICES_DIR / f'{o}.key'}" for o in key_owners(topology)]
    if role == "router":
        allowed = topology.security.client_keys or str(keys / CLIENTS_DIR / CLIENTS_ALLOWED)
        lines.append(f"LoadCredential={CLIENTS_CREDENTIAL}:{allowed}")
    return "".join(line + "\n" for line in lines)


def _under_home(path: str) -> bool:
    return any(path == h or path.startswith(h + "/") for h in HOME_DIRS)


def unit_files(topology_path: Path, topology: Topology, launcher: str | None = None,
               user: str = DEFAULT_USER, host: str | None = None) -> dict[str, str]:
    """File name → contents: the target, the templates (the balancer's only when the topology has one),
    the rank units of expert-parallel workers, and nothing per template instance (instances are enabled
    through the target's Wants=). With `host` (an address of the topology), the target wants only the
    instances on that host (`Topology.instances_on`): what one machine of a cluster enables."""
    launcher = launcher or f"{shlex.quote(sys.executable)} -m deepinfer.launch.cli"
    topo = shlex.quote(str(topology_path.resolve()))
    writable = _writable_dirs(topology)
    # Home directories stay hidden unless the topology, the model or a directory it names lives there.
    read = [str(topology_path.resolve()), topology.model, shlex.split(launcher)[0], *writable]
    protect_home = "read-only" if any(_under_home(p) for p in read) else "yes"
    # "-": a directory that does not exist yet is skipped rather than failing the start.
    read_write = "".join(f"ReadWritePaths=-{d}\n" for d in writable)

    def unit(role: str, after: str = "deepinfer-router@router.service", name: str = "%i", rank: int | None = None,
             description: str | None = None, group: str = "", restart: str = "on-failure") -> str:
        # Workers may drive a GPU; the other roles need no device at all.
        private_devices = "" if role == "worker" else "PrivateDevices=yes\n"
        argv = f"{launcher} service {role} --topology {topo} --name {name}"
        return _TEMPLATE.format(description=description or f"DeepInfer {role} %i", after=after, group=group,
                                restart=restart,
                                user=user, stop_s=int(DRAIN_TIMEOUT_S) + STOP_MARGIN_S,
                                exec_start=argv if rank is None else f"{argv} --rank {rank}",
                                read_write=read_write, protect_home=protect_home, private_devices=private_devices,
                                metrics_env=f"{MULTIPROC_ENV}={METRICS_DIR}",
                                credentials=credential_lines(topology, role, name))

    # (rank_unit refuses a name a unit cannot hold; such a name is also one word of ExecStart=, no specifier.)
    # A follower away from its rank 0 comes back even after a clean exit: its leader's restart ends it with a
    # stop (exit 0), and no BindsTo= across machines would start it again.
    groups = {rank_unit(w, r): unit("worker", name=w.name, rank=r, group=_group_lines(w, r),
                                    description=f"DeepInfer worker {w.name} rank {r} of {w.ep}",
                                    restart="always" if r and not _with_rank0(w, r) else "on-failure")
              for w in topology.workers if w.ep > 1 for r in range(w.ep)}
    instances = ["deepinfer-router@router.service"]
    instances += [f"deepinfer-tokenizer@{t.name}.service" for t in topology.tokenizers]
    instances += [f"deepinfer-worker@{w.name}.service" for w in topology.workers if w.ep == 1]
    instances += list(groups)
    instances += [f"deepinfer-kvcache@{k.name}.service" for k in topology.kvcaches]
    # The balancer holds no requests: a worker group keeps its last placement while it is down.
    balancer = {"deepinfer-balancer@.service": unit("balancer")} if topology.balancer is not None else {}
    instances += [f"deepinfer-balancer@{BALANCER_NAME}.service"] if balancer else []
    # Gateways are clients of the router's front: after it, like the services.
    gateway = {"deepinfer-gateway@.service": unit("gateway")} if topology.gateways else {}
    instances += [f"deepinfer-gateway@{g.name}.service" for g in topology.gateways]
    if host is not None:
        here = set(topology.instances_on(host))
        if not here:
            raise TopologyError(f"no service of the topology binds on {host}: give one of its hosts' addresses")
        ranks_here = {rank_unit(w, r) for w in topology.workers if w.ep > 1 for r in w.ranks_on(host)}
        instances = [i for i in instances if _instance_name(i) in here and (i not in groups or i in ranks_here)]
        groups = {u: text for u, text in groups.items() if u in ranks_here}
    return {
        "deepinfer.target": _TARGET.format(wants=" ".join(instances)),
        "deepinfer-router@.service": unit("router", after=""),
        "deepinfer-tokenizer@.service": unit("tokenizer"),
        "deepinfer-worker@.service": unit("worker"),
        # Workers do not wait for the cache daemon: without it they compute every prompt in full.
        "deepinfer-kvcache@.service": unit("kvcache"),
        **balancer,
        **gateway,
        **groups,
    }


def _instance_name(unit: str) -> str:
    """The service a unit runs: `deepinfer-ROLE@NAME.service` or a rank unit `deepinfer-worker-NAME-rankR.service`."""
    if "@" in unit:
        return unit.split("@", 1)[1].removesuffix(".service")
    return unit.removeprefix("deepinfer-worker-").rsplit("-rank", 1)[0]


def rank_unit(w: WorkerSpec, rank: int) -> str:
    """The unit of one rank of an expert-parallel worker."""
    if not UNIT_NAME_CHARS.fullmatch(w.name):
        raise TopologyError(f"worker {w.name}: an expert-parallel worker's name is part of its units' names, so "
                            f"it may hold only letters, digits and ':_.-'")
    return f"deepinfer-worker-{w.name}-rank{rank}.service"


def _with_rank0(w: WorkerSpec, rank: int) -> bool:
    """Whether `rank` runs on rank 0's host (every rank does without `rank_hosts`)."""
    return not w.rank_hosts or w.rank_hosts[rank].lower() == w.rank_hosts[0].lower()


def _group_lines(w: WorkerSpec, rank: int) -> str:
    """A rank unit's [Unit] lines that tie its group together (see the module's docstring). systemd binds units
    of one machine only: a rank binds the group's ranks on its own host (`rank_hosts`); across hosts the group
    itself does it (rank 0 stops a group that lost a rank, and a rank whose group broke exits, so each unit's
    Restart= starts it again)."""
    host = w.rank_hosts[rank] if w.rank_hosts else None
    together = [r for r in range(w.ep) if host is None or w.rank_hosts[r].lower() == host.lower()]
    lines = [f"# Expert-parallel group {w.name}: its {w.ep} ranks stop and restart together."]
    if rank == 0:
        followers = " ".join(rank_unit(w, r) for r in together if r != 0)
        lines += [f"BindsTo={followers}", f"After={followers}"] if followers else []
    elif _with_rank0(w, rank):
        lines.append(f"BindsTo={rank_unit(w, 0)}")
    if len(together) < w.ep:
        elsewhere = ", ".join(f"rank {r} on {w.rank_hosts[r]}" for r in range(w.ep) if r not in together)
        lines.append(f"# On other hosts (bound by the group itself): {elsewhere}.")
    return "\n".join(lines) + "\n"


def write_units(topology_path: Path, out_dir: Path, launcher: str | None = None,
                user: str = DEFAULT_USER, host: str | None = None) -> list[Path]:
    topology = Topology.load(topology_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in unit_files(topology_path, topology, launcher, user, host).items():
        path = out_dir / name
        path.write_text(text)
        written.append(path)
    return written
