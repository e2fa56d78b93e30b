"""CURVE keys for a topology: `deepinfer-launch keys DIR --topology F` makes them, `service_auth` reads what one
service instance needs from them.

Layout of DIR (0700; see `protocol.auth` for the file format)::

    services/NAME.key, NAME.key_secret     one pair per service instance (router, tokenizers, workers, cache
                                           daemons) and one for the supervisor (its exit notes to the router)
    clients/client.key, client.key_secret  a first tenant key pair
    clients/NAME.key, NAME.key_secret      one pair per HTTP gateway (a client of the router's front)
    clients/allowed                        the tenants' (and gateways') public keys the router's front accepts

Under systemd a unit does not read DIR (root's, 0700): each gets its own secret and the public keys as
credentials (`LoadCredential=`, read by systemd before it drops privileges; `systemd.credential_lines`), and
`service_auth` reads them from `$CREDENTIALS_DIRECTORY` — so one compromised service holds no other's secret.

Service keys and tenant keys never mix: the router's front accepts only `clients/allowed`, every other socket
only service keys. Who may connect where (each bound socket its own allow-list):

    router frontend       tenants and gateways
    router backend        tokenizers, workers, cache daemons (each bound to its instance name) + the supervisor
    decode/worker kv      prefill workers
    tokenizer detok       workers
    cache daemon          the workers that name it
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from deepinfer.launch.topology import Topology
from deepinfer.protocol.auth import (
    CLIENT_KEY_NAME,
    CLIENTS_ALLOWED,
    CLIENTS_DIR,
    NO_AUTH,
    ROUTER_KEY_NAME,
    SERVICES_DIR,
    AllowList,
    ClientAuth,
    KeyPair,
    ServiceAuth,
    client_allow_list,
    load_client_keys,
    load_public_key,
    read_client_keys,
    secured,
)
from deepinfer.services.balancer_config import BALANCER_NAME

ROUTER = ROUTER_KEY_NAME
SUPERVISOR = "supervisor"  # its routing ids are `supervisor-<pid>` (see exit_notes)
# Credential ids under systemd (file names in $CREDENTIALS_DIRECTORY): the unit's own secret key, the tenants'
# public keys (the router's front), and every service's public key under its file name, NAME.key.
SECRET_CREDENTIAL = "key_secret"
CLIENTS_CREDENTIAL = "clients.allowed"


def credentials_dir() -> Path | None:
    """systemd's credentials directory for this unit, if it passed this service its keys."""
    found = os.environ.get("CREDENTIALS_DIRECTORY")
    return Path(found) if found and (Path(found) / SECRET_CREDENTIAL).is_file() else None


def key_owners(topology: Topology) -> list[str]:
    """Every name that gets a service key pair."""
    return [ROUTER, *(t.name for t in topology.tokenizers), *(w.name for w in topology.workers),
            *(k.name for k in topology.kvcaches), *_balancer(topology), SUPERVISOR]


def _balancer(topology: Topology) -> list[str]:
    """The expert balancer's name, if the topology runs one."""
    return [BALANCER_NAME] if topology.balancer is not None else []


def _private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)  # an existing directory too: it holds secret keys
    return path


def make_keys(directory: str | os.PathLike[str], topology: Topology) -> list[Path]:
    """Make the key pairs `topology` needs in `directory` that are not there yet (existing keys are kept, so a
    grown topology only adds keys); returns the files written."""
    root = _private_dir(Path(directory))
    services, clients = _private_dir(root / SERVICES_DIR), _private_dir(root / CLIENTS_DIR)
    written: list[Path] = []
    for name in key_owners(topology):
        if not (services / f"{name}.key_secret").exists():
            written += KeyPair.generate().save(services, name)
    for name in (CLIENT_KEY_NAME, *(g.name for g in topology.gateways)):
        if not (clients / f"{name}.key_secret").exists():
            client = KeyPair.generate()
            written += client.save(clients, name)
            allowed = clients / CLIENTS_ALLOWED
            with open(allowed, "a") as f:
                f.write(f"{client.public.decode()} {name}\n")
            if allowed not in written:
                written.append(allowed)
    return written


def service_auth(topology: Topology, role: str, name: str) -> ServiceAuth:
    """What service `name` (role router, tokenizer, worker, kvcache or balancer) needs: its key pair, the public keys of
    the servers it connects to, and the allow-list of each socket it binds. NO_AUTH without [security]."""
    if topology.security is None:
        return NO_AUTH
    credentials = credentials_dir()
    services = credentials or Path(topology.security.keys_dir) / SERVICES_DIR

    def public(owner: str) -> bytes:
        return load_public_key(services / f"{owner}.key")

    def allow(socket_name: str, owners: list[str]) -> AllowList:
        return AllowList(f"{name}/{socket_name}", {public(o): o for o in owners})

    workers = [w.name for w in topology.workers]
    servers = [ROUTER, *(t.name for t in topology.tokenizers), *(k.name for k in topology.kvcaches),
               *(w.name for w in topology.workers if w.role in ("decode", "worker"))]
    lists: dict[str, AllowList] = {}
    if role == "router":
        daemons = [k.name for k in topology.kvcaches]
        backend = allow("backend", [t.name for t in topology.tokenizers] + workers + daemons + _balancer(topology))
        backend.allow(public(SUPERVISOR), f"{SUPERVISOR}-*")
        client_keys = (credentials / CLIENTS_CREDENTIAL if credentials else topology.security.client_keys
                       or Path(topology.security.keys_dir) / CLIENTS_DIR / CLIENTS_ALLOWED)
        lists = {"backend": backend, "frontend": client_allow_list(f"{name}/frontend", read_client_keys(client_keys))}
    elif role == "tokenizer":
        lists = {"detok": allow("detok", workers)}
    elif role == "worker":
        lists = {"kv": allow("kv", [w.name for w in topology.workers if w.role == "prefill"])}
    elif role == "kvcache":
        lists = {"cache": allow("cache", [w.name for w in topology.workers if w.kvcache == name])}
    elif role == "balancer":
        lists = {}  # it binds nothing: it only connects to the router
    else:
        raise ValueError(f"unknown role {role!r}")
    secret = credentials / SECRET_CREDENTIAL if credentials else services / f"{name}.key_secret"
    return ServiceAuth(KeyPair.load(secret), {s: public(s) for s in servers}, lists)


def supervisor_auth(topology: Topology) -> ClientAuth | None:
    """The supervisor's key for its exit notes to the router's backend, if the backend is secured."""
    if topology.security is None or not secured(topology.backend):
        return None
    services = Path(topology.security.keys_dir) / SERVICES_DIR
    return ClientAuth(KeyPair.load(services / f"{SUPERVISOR}.key_secret"), load_public_key(services / f"{ROUTER}.key"))


def gateway_client_keys(topology: Topology, name: str) -> dict[str, Any]:
    """`AsyncClient` keyword arguments for gateway `name`: on a secured client front, its own key pair
    (clients/NAME.key_secret, which `keys` writes for every gateway) and the router's public key; else none."""
    topology.gateway(name)  # TopologyError for a name the topology does not have
    if topology.security is None or not secured(topology.frontend):
        return {}
    credentials = credentials_dir()
    if credentials is not None:
        return {"curve_keys": KeyPair.load(credentials / SECRET_CREDENTIAL),
                "server_key": load_public_key(credentials / f"{ROUTER}.key")}
    pair, router_key = load_client_keys(topology.security.keys_dir, name)
    return {"curve_keys": pair, "server_key": router_key}


def probe_client_keys(topology: Topology) -> dict[str, Any]:
    """`Client` keyword arguments for the launcher's readiness probe: on a secured client front, the tenant key
    pair `keys` wrote (clients/client.key_secret) and the router's public key; otherwise none."""
    if topology.security is None or not secured(topology.frontend):
        return {}
    try:
        pair, router_key = load_client_keys(topology.security.keys_dir)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"the client front is secured: checking that the mesh serves needs a tenant key "
                                f"({exc.filename}; `deepinfer-launch keys` writes one)") from exc
    return {"curve_keys": pair, "server_key": router_key}
