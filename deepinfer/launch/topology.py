"""Topology: which services run, where, on which endpoints, and with which settings: one frozen tree.

Built from flags (`Topology.local`) or read from TOML (`Topology.load`); `to_toml` writes it back::

    model = "smollm2"
    block_size = 16                       # tokens per KV block, for every service (default 16)
    kv_cache_dtype = "float16"            # KV element type, every service's: "float32" (default) or "float16"
    [router]
    frontend = "tcp://10.0.0.1:5550"      # clients connect here
    backend = "tcp://10.0.0.1:5551"       # every service connects here
    heartbeat_timeout_s = 5.0             # any other key: a field of RouterConfig (services.router_state)
    require_api_key = true
    [router.tenants]                      # api_key → cache salt (an inline table works too)
    "key-a" = "salt-a"
    [router.max_inflight_per_tenant]      # likewise priority_floor, max_queued_prompt_tokens_per_tenant
    "key-a" = 64
    [[tokenizer]]
    name = "tokenizer-0"
    detok = "tcp://10.0.0.1:5560"         # decode workers push token batches here
    [[worker]]
    name = "prefill-0"
    role = "prefill"                      # "prefill", "decode" or "worker" (both, co-located)
    device = "cpu"
    threads = 1
    kv = "tcp://10.0.0.2:5570"            # decode/worker roles: where prefill workers send KV
    kv_cache_mb = 512                     # also max_num_seqs, max_num_batched_tokens, prefix_caching
    kvcache = "kvcache-0"                 # the cache daemon on this worker's host (omit: none)
    speculative = "ngram"                 # speculative decoding: "ngram", "suffix", "self:L", "draft:PATH"
    num_speculative_tokens = 4            # the most draft tokens per request per step (1..32)
    adaptive_speculation = true           # let the controller choose each step's k (false: always the cap)
    weights = "auto"                      # "native" (GGUF blocks kept packed), "fp32", "q8_0" (quantise on load);
                                          #   "auto": native for a GGUF file on a CPU device
    ep = 1                                # expert parallelism: a group of N ranks, a process each (default 1;
    ep_master = "10.0.0.2:29500"          #   N > 1 needs this rendezvous, host:port)
    rank_hosts = []                       # with ep = N: N hosts, rank 0 on kv's (default: all on kv's host)
    redundant_experts = 2                 # MoE: extra expert replicas per layer (default: max(1, E // 8); 0: none)
    stream_interval_ms = 50               # send new tokens at most this often (first tokens, finishes: at once)
    lookup_ahead_steps = 2                # with a kvcache: look a job's prefix up as it enters the engine's queue,
                                          #   kept this many steps deep (0: as the job arrives)
    fetch_policy = "plan"                 # with a kvcache: load a hit only where faster than computing it
                                          #   ("always": load every hit)
    swap_space_mb = 256                   # host memory for preempted requests' KV where a copy beats recomputing
                                          #   it (0: always recompute)
    [[kvcache]]
    name = "kvcache-0"
    endpoint = "tcp://10.0.0.2:5580"      # workers on its host connect here
    dir = "/mnt/nvme/deepinfer-kv"        # the disk tier (default: the user's cache directory)
    host_mb = 4096                        # DRAM tier capacity
    disk_mb = 200000                      # disk tier capacity (watermarks keep usage below it)
    pool_mb = 800000                      # optional: one budget for every daemon sharing this dir (a shared mount)
    [balancer]                            # optional: the expert balancer for the MoE worker groups (one per mesh,
    interval_s = 30.0                     #   named "balancer"): how often it reconsiders each group's placement
    window_s = 120.0                      # the load reports it weighs: the last window_s seconds
    threshold = 0.05                      # the relative max/mean gain a layer must promise before experts move
    max_moves = 8                         # at most this many slots per layer load new weights at once (default 8)
    max_moves_total = 64                  # and at most this many over all layers, largest gains first (default 64)
    move_timeout_s = 60.0                 # a placement unanswered by then is given up
    [[gateway]]                           # optional: an OpenAI-compatible HTTP gateway (a client of the frontend)
    name = "gateway-0"
    listen = "0.0.0.0:8000"               # HOST:PORT it serves HTTP on
    served_model_name = "smollm2"         # the `model` clients give (default: `model` above, as written)
    [gateway.limits]                      # optional: its HTTP bounds (deepinfer.gateway.limits.HttpLimits)
    max_body_bytes = 4194304              # 413 past it; also header_timeout_s, max_connections, max_sequences, ...
    [security]                            # CURVE on every tcp:// endpoint: required when there is one (below)
    keys_dir = "/etc/deepinfer/keys"      # from `deepinfer-launch keys DIR --topology F` (relative: to this file)
    client_keys = "/etc/deepinfer/clients.allowed"  # the tenants' public keys (default: DIR/clients/allowed)

Fail closed: services refuse to start from a topology with a tcp:// endpoint and no [security] table (anyone who
can reach an open endpoint can submit work, join the mesh as a service, read prompts and outputs, and store or
fetch cache blocks; a loopback address is open to every local user). The operator who means it says so: a
top-level `insecure = true` in the file (what systemd units and every host read), or `--insecure` to `up` and
`service` for one run. `check_secured` is the rule; loading a file never refuses (`keys` reads a topology
before its [security] table exists).

Every table is one frozen dataclass (TokenizerSpec, WorkerSpec, KvCacheSpec, GatewaySpec, SecuritySpec,
RouterConfig, BalancerConfig),
read by `tables.from_table`: an unknown key or a value of the wrong type is refused when the file is read,
naming the file, the entry and the key. A key left out takes its default, and every default is defined once
(deepinfer.config.engine's DEFAULT_*, the KvCacheSpec defaults here, RouterConfig's), so the file, the
command line and the services cannot disagree.

The long-lived side binds (router frontend/backend, tokenizer detok, decode kv, kvcache endpoint);
everyone else connects. `block_size` must be the same for every service: it is part of the KV-cache
namespace, and the handshake refuses a service that hashes blocks differently (so is `kv_cache_dtype`, set
at the top level the same way). So it is set once, at the
top level; the router's copy is derived from it (`[router] block_size` is refused). Speculation runs where
decoding does: on decode and co-located workers. A prefill worker stops after the first token and has
nothing to speculate on; `Topology.local` sets the speculation keys on decoding workers only.

A worker with `ep = N > 1` is an expert-parallel group: N processes, on the worker's host unless `rank_hosts`
spreads them (docs/cluster.md), rank 0 speaking for the group to the mesh and ranks 1..N-1 following it
(`service worker --rank R`). Its `device` is "cpu"
or "cuda" (rank R on cuda:R; `WorkerSpec.rank_device`), its `threads` are shared equally by the ranks, and
`ep_master` is where the ranks rendezvous (torch.distributed's store, on rank 0): an address no other
endpoint of the topology uses. `Topology.local` gives each group a free 127.0.0.1 port.

A gateway (`[[gateway]]`) is a client of the router's frontend like any other (with [security], it gets a
tenant key pair of its own: `clients/NAME.key_secret`); the tenant of each HTTP request is its
`Authorization: Bearer KEY`, passed on as the request's api_key. Its `listen` port must be free on its host.

The expert balancer (`[balancer]`, an empty table for every default) reads the MoE groups' expert loads
through the router and sends them better placements (deepinfer.services.balancer); it binds nothing.
Without it every group keeps its static placement, whose `redundant_experts` replicas then stay where
the static layout put them.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from deepinfer.config.engine import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_KV_CACHE_DTYPE,
    DEFAULT_KV_CACHE_MB,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    DEFAULT_WEIGHTS,
    kv_cache_dtype_name,
)
from deepinfer.config.model import ConfigError
from deepinfer.launch.sections import (
    DEFAULT_DISK_CACHE_MB,
    DEFAULT_HOST_CACHE_MB,
    DEFAULT_MODEL,
    ROLES,
    GatewaySpec,
    KvCacheSpec,
    SecuritySpec,
    TokenizerSpec,
    WorkerSpec,
    default_kvcache_dir,
    speculative_problem,
    split_host_port,
)
from deepinfer.launch.tables import TopologyError, check_fields, from_table, toml_string, toml_table
from deepinfer.services.balancer_config import BALANCER_NAME, BalancerConfig
from deepinfer.services.router_state import RouterConfig

# The sections are re-exported: the tree is read and built from this module.
__all__ = ["DEFAULT_DISK_CACHE_MB", "DEFAULT_HOST_CACHE_MB", "DEFAULT_MODEL", "BalancerConfig", "GatewaySpec",
           "KvCacheSpec",
           "RouterConfig",
           "SecuritySpec", "TokenizerSpec", "Topology", "TopologyError", "WorkerSpec", "default_kvcache_dir",
           "speculative_problem"]

T = TypeVar("T")
TOP_LEVEL_KEYS = ("model", "block_size", "kv_cache_dtype", "insecure", "router", "tokenizer", "worker", "kvcache",
                  "gateway", "balancer", "security")
# RouterConfig fields a [router] table may not set: they are derived, so they cannot disagree with their source.
ROUTER_DERIVED = {"block_size": "set block_size at the top level: it is every service's, the router's included",
                  "id_prefix": "the router chooses it, anew at every start"}


@dataclass(frozen=True)
class Topology:
    """The whole mesh. Invariants, established at construction however it was made (file, flags, Python):
    every field has its declared type, names are unique, references resolve, and `router.block_size ==
    block_size` (the router's copy is derived here, never set on its own)."""

    model: str
    frontend: str
    backend: str
    tokenizers: tuple[TokenizerSpec, ...]
    workers: tuple[WorkerSpec, ...]
    router: RouterConfig = field(default_factory=RouterConfig)
    kvcaches: tuple[KvCacheSpec, ...] = ()
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_dtype: str = DEFAULT_KV_CACHE_DTYPE  # every service's KV element type ("float32" or "float16")
    security: SecuritySpec | None = None  # None: no CURVE (loopback or ipc:// only, as DESIGN §3 advises)
    balancer: BalancerConfig | None = None  # None: no expert balancer (groups keep their static placement)
    gateways: tuple[GatewaySpec, ...] = ()  # OpenAI-compatible HTTP gateways (none: ZeroMQ clients only)
    insecure: bool = False  # tcp:// endpoints without [security] run anyway: the operator said so (check_secured)

    def __post_init__(self) -> None:
        check_fields(self)
        for where, spec in self._sections():
            _within(where, lambda spec=spec: check_fields(spec))
        if self.block_size <= 0:
            raise TopologyError(f"block_size must be positive, got {self.block_size}")
        try:
            object.__setattr__(self, "kv_cache_dtype", kv_cache_dtype_name(self.kv_cache_dtype))
        except ConfigError as exc:
            raise TopologyError(str(exc)) from None
        if self.router.id_prefix:
            raise TopologyError(f"router: id_prefix: {ROUTER_DERIVED['id_prefix']}")
        if self.router.block_size != self.block_size:
            object.__setattr__(self, "router", dataclasses.replace(self.router, block_size=self.block_size))
        names = [t.name for t in self.tokenizers] + [w.name for w in self.workers] + [k.name for k in self.kvcaches]
        names += [g.name for g in self.gateways]
        names += [BALANCER_NAME] if self.balancer is not None else []
        if len(set(names)) != len(names):
            raise TopologyError(f"service names must be unique: {names}")
        if not self.tokenizers:
            raise TopologyError("a topology needs at least one tokenizer")
        roles = {w.role for w in self.workers}
        for w in self.workers:
            if w.role not in ROLES:
                raise TopologyError(f"worker {w.name}: unknown role {w.role!r} (one of {ROLES})")
        if not ({"worker"} & roles or {"prefill", "decode"} <= roles):
            raise TopologyError("a topology needs a 'worker', or at least one 'prefill' and one 'decode' worker")
        daemons = {k.name for k in self.kvcaches}
        for w in self.workers:
            if w.kvcache is not None and w.kvcache not in daemons:
                raise TopologyError(f"worker {w.name}: no kvcache named {w.kvcache!r}")
            problem = w.speculation_problem() or w.parallel_problem() or w.weights_problem() or w.stream_problem()
            if problem is not None:
                raise TopologyError(f"worker {w.name}: {problem}")
        if self.insecure and self.security is not None:
            raise TopologyError("insecure = true and a [security] table contradict each other: drop one")
        self._check_ep_masters()

    def endpoints(self) -> list[tuple[str, str]]:
        """(what, endpoint) for every ZeroMQ endpoint a service binds (clients and connecting services reach
        the mesh only through these)."""
        return [("router frontend", self.frontend), ("router backend", self.backend),
                *((f"tokenizer {t.name} detok", t.detok) for t in self.tokenizers),
                *((f"worker {w.name} kv", w.kv) for w in self.workers),
                *((f"kvcache {k.name} endpoint", k.endpoint) for k in self.kvcaches)]

    def unsecured_endpoints(self) -> list[tuple[str, str]]:
        """The tcp:// endpoints nothing authenticates: every one of them when there is no [security] table
        (ipc:// is guarded by its private run directory, inproc:// never leaves the process)."""
        return [] if self.security is not None else [(w, e) for w, e in self.endpoints() if e.startswith("tcp://")]

    def check_secured(self, insecure: bool = False, flag: str | None = "--insecure") -> None:
        """Fail closed (see the module docstring): raise TopologyError when a tcp:// endpoint has no [security],
        unless the operator accepted it (`insecure = true` in the file, or `insecure` here from a command-line
        flag; `flag` names that flag in the error, None where the command has none)."""
        open_endpoints = self.unsecured_endpoints()
        if not open_endpoints or insecure or self.insecure:
            return
        shown = ", ".join(f"{what} {endpoint}" for what, endpoint in open_endpoints[:3])
        more = f" and {len(open_endpoints) - 3} more" if len(open_endpoints) > 3 else ""
        opt_in = (f"pass {flag} (or set `insecure = true` at the top of the topology)" if flag is not None
                  else "set `insecure = true` at the top of the topology")
        raise TopologyError(
            f"refusing to run tcp:// endpoints without [security]: {shown}{more}. Anyone who can reach them could "
            f"submit work, join the mesh as a service, and read prompts and outputs. Secure them: `deepinfer-launch "
            f"keys DIR --topology FILE`, then a [security] table with keys_dir = \"DIR\"; or, on a network where every "
            f"host and user that can reach them is trusted, {opt_in}.")

    def _check_ep_masters(self) -> None:
        """Every group's ep_master and every gateway's listen address is an address nothing else in the topology
        binds: a port taken twice on one host would make one of the two fail to start (a wildcard host takes
        the port on every address)."""
        taken: list[tuple[str, int, str]] = []  # (host, port, what)
        for what, endpoint in self.endpoints():
            if endpoint.startswith("tcp://"):
                try:
                    taken.append((*split_host_port(endpoint.removeprefix("tcp://")), what))
                except ValueError:
                    pass  # not host:port (ZeroMQ also takes interface names); nothing to compare
        for w in self.workers:
            if w.ep == 1:
                continue
            host, port = split_host_port(w.ep_master)  # checked by parallel_problem
            for other_host, other_port, what in taken:
                if port == other_port and _same_host(host, other_host):
                    raise TopologyError(f"worker {w.name}: ep_master = {w.ep_master!r} is also the {what}")
            taken.append((host, port, f"worker {w.name} ep_master"))
        for g in self.gateways:  # (listen checked by GatewaySpec)
            host, port = split_host_port(g.listen)
            for other_host, other_port, what in taken:
                if port == other_port and _same_host(host, other_host):
                    raise TopologyError(f"gateway {g.name}: listen = {g.listen!r} is also the {what}")
            taken.append((host, port, f"gateway {g.name} listen"))

    def _sections(self) -> list[tuple[str, Any]]:
        """Every sub-tree with the name its errors carry."""
        return [("router", self.router), *((f"tokenizer {t.name}", t) for t in self.tokenizers),
                *((f"worker {w.name}", w) for w in self.workers), *((f"kvcache {k.name}", k) for k in self.kvcaches),
                *((f"gateway {g.name}", g) for g in self.gateways),
                *([("security", self.security)] if self.security is not None else []),
                *([("balancer", self.balancer)] if self.balancer is not None else [])]

    def worker(self, name: str) -> WorkerSpec:
        for w in self.workers:
            if w.name == name:
                return w
        raise TopologyError(f"no worker named {name!r}")

    def tokenizer(self, name: str) -> TokenizerSpec:
        for t in self.tokenizers:
            if t.name == name:
                return t
        raise TopologyError(f"no tokenizer named {name!r}")

    def gateway(self, name: str) -> GatewaySpec:
        for g in self.gateways:
            if g.name == name:
                return g
        raise TopologyError(f"no gateway named {name!r}")

    def instances_on(self, address: str) -> list[str]:
        """The services that run on the host with this address, by where each binds: the router by its frontend,
        a tokenizer by its detok, a worker by its kv (a prefill worker's is required for this), a cache daemon
        by its endpoint, a gateway by its listen address; the balancer goes with the router; an expert-parallel
        worker also on each host its `rank_hosts` puts a rank on. A service bound to a wildcard address, or to
        ipc://, is on no named host."""
        def on(endpoint: str) -> bool:
            host = endpoint.removeprefix("tcp://") if endpoint.startswith("tcp://") else None
            return host is not None and split_host_port(host)[0].lower() == address.lower()

        names = ["router"] if on(self.frontend) else []
        names += [t.name for t in self.tokenizers if on(t.detok)]
        names += [w.name for w in self.workers if on(w.kv) or w.ranks_on(address)]  # its rank 0, or another rank
        names += [k.name for k in self.kvcaches if on(k.endpoint)]
        names += [BALANCER_NAME] if self.balancer is not None and on(self.frontend) else []
        names += [g.name for g in self.gateways if on(f"tcp://{g.listen}")]
        return names

    def kvcache(self, name: str) -> KvCacheSpec:
        for k in self.kvcaches:
            if k.name == name:
                return k
        raise TopologyError(f"no kvcache named {name!r}")

    @classmethod
    def local(cls, model: str, transport: str, run_dir: Path | None = None, disaggregated: bool = True,
              num_prefill: int = 1, num_decode: int = 1, num_tokenizers: int = 1, threads: int | None = None,
              kv_cache_mb: int = DEFAULT_KV_CACHE_MB, kvcache: bool = True,
              cache_dir: str | os.PathLike[str] | None = None, host_cache_mb: int = DEFAULT_HOST_CACHE_MB,
              disk_cache_mb: int = DEFAULT_DISK_CACHE_MB, prefix_caching: bool = True,
              speculative: str | None = None, num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS,
              adaptive_speculation: bool = True, block_size: int = DEFAULT_BLOCK_SIZE,
              max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
              max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, ep: int = 1,
              redundant_experts: int | None = None, balancer: BalancerConfig | None = None,
              http: str | None = None, weights: str = DEFAULT_WEIGHTS,
              kv_cache_dtype: str = DEFAULT_KV_CACHE_DTYPE) -> Topology:
        """One host: `inproc` (one process) or `ipc` (a process per service, sockets in `run_dir`).
        With `kvcache`, one cache daemon (disk tier in `cache_dir`, default `default_kvcache_dir()`)
        serves every worker; `prefix_caching=False` also turns off reuse inside each worker. The
        speculation options go to the workers that decode (decode and co-located ones). With `ep > 1`
        every worker is an expert-parallel group of `ep` ranks, each group rendezvousing on a free
        127.0.0.1 port (free when chosen: another program may take it before the group starts); a group's
        rank 0 talks to the cache daemon for every rank. `redundant_experts` goes to every worker; with
        `balancer` the mesh runs an expert balancer with those settings. With `http` ("HOST:PORT") one HTTP
        gateway, "gateway-0", listens there."""
        if transport == "inproc":
            if ep != 1:
                raise TopologyError("an in-process mesh runs every service in one process; an expert-parallel "
                                    "group needs a process per rank (use the ipc transport)")
            endpoint = lambda name: f"inproc://deepinfer-{os.getpid()}-{name}"  # noqa: E731
        elif transport == "ipc":
            if run_dir is None:
                raise TopologyError("ipc transport needs a runtime directory")
            endpoint = lambda name: f"ipc://{run_dir}/{name}.sock"  # noqa: E731
        else:
            raise TopologyError(f"unknown local transport {transport!r}")
        daemons = (KvCacheSpec("kvcache-0", endpoint("kvcache-0"), None if cache_dir is None else str(cache_dir),
                               host_cache_mb, disk_cache_mb),) if kvcache else ()
        common: dict[str, Any] = dict(threads=threads, kv_cache_mb=kv_cache_mb, max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens, prefix_caching=prefix_caching,
                                      kvcache="kvcache-0" if kvcache else None, redundant_experts=redundant_experts,
                                      weights=weights)
        decoding: dict[str, Any] = dict(common, speculative=speculative, num_speculative_tokens=num_speculative_tokens,
                                        adaptive_speculation=adaptive_speculation)
        workers: list[WorkerSpec] = []
        if disaggregated:
            workers += [WorkerSpec(f"prefill-{i}", "prefill", endpoint(f"prefill-{i}-kv"), **common)
                        for i in range(num_prefill)]
            workers += [WorkerSpec(f"decode-{i}", "decode", endpoint(f"decode-{i}-kv"), **decoding)
                        for i in range(num_decode)]
        else:
            workers.append(WorkerSpec("worker-0", "worker", endpoint("worker-0-kv"), **decoding))
        if ep != 1:
            masters = [f"127.0.0.1:{port}" for port in free_local_ports(len(workers))]
            workers = [dataclasses.replace(w, ep=ep, ep_master=m) for w, m in zip(workers, masters)]
        tokenizers = tuple(TokenizerSpec(f"tokenizer-{i}", endpoint(f"tokenizer-{i}-detok"))
                           for i in range(num_tokenizers))
        gateways = (GatewaySpec("gateway-0", http),) if http is not None else ()
        return cls(model, endpoint("router-frontend"), endpoint("router-backend"), tokenizers, tuple(workers),
                   kvcaches=daemons, block_size=block_size, kv_cache_dtype=kv_cache_dtype, balancer=balancer,
                   gateways=gateways)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Topology:
        """Read a topology file; TopologyError names the file, the entry and the key of anything wrong."""
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
            return _within(str(path), lambda: _from_document(data, Path(path).parent))
        except tomllib.TOMLDecodeError as exc:
            raise TopologyError(f"{path}: not valid TOML ({exc})") from exc

    def to_toml(self) -> str:
        """The topology as a file `load` reads back to an equal Topology (security paths as given: `load`
        makes relative ones absolute against the file's directory)."""
        lines = [f"model = {toml_string(self.model)}", f"block_size = {self.block_size}",
                 f"kv_cache_dtype = {toml_string(self.kv_cache_dtype)}"]
        lines += ["insecure = true"] if self.insecure else []
        lines += toml_table("router", self.router, skip=tuple(ROUTER_DERIVED),
                            first={"frontend": self.frontend, "backend": self.backend})
        for t in self.tokenizers:
            lines += toml_table("tokenizer", t, array=True)
        for w in self.workers:
            lines += toml_table("worker", w, array=True)
        for k in self.kvcaches:
            lines += toml_table("kvcache", k, array=True)
        for g in self.gateways:
            lines += toml_table("gateway", g, array=True)
        if self.balancer is not None:
            lines += toml_table("balancer", self.balancer)
        if self.security is not None:
            lines += toml_table("security", self.security)
        return "\n".join(lines) + "\n"


WILDCARD_HOSTS = ("*", "0.0.0.0", "::")
LOOPBACK_NAMES = {"localhost": "127.0.0.1"}


def _same_host(a: str, b: str) -> bool:
    """Whether two hosts of one topology may be one address (a wildcard is every address)."""
    a, b = (LOOPBACK_NAMES.get(h.lower(), h.lower()) for h in (a, b))
    return a == b or a in WILDCARD_HOSTS or b in WILDCARD_HOSTS


def free_local_ports(n: int) -> list[int]:
    """`n` distinct TCP ports free on 127.0.0.1 now (all held open until every one is chosen)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _within(where: str, build: Callable[[], T]) -> T:
    """build(), its TopologyError prefixed with `where` (the file, the entry)."""
    try:
        return build()
    except TopologyError as exc:
        raise TopologyError(f"{where}: {exc}") from exc


def _from_document(data: dict[str, Any], base: Path) -> Topology:
    """The tree from a parsed file; relative security paths are made absolute against `base`."""
    unknown = [k for k in data if k not in TOP_LEVEL_KEYS]
    if unknown:
        raise TopologyError(f"unknown top-level key {unknown[0]!r} (known: {', '.join(TOP_LEVEL_KEYS)})")
    router = data.get("router")
    if not isinstance(router, Mapping) or not {"frontend", "backend"} <= router.keys():
        raise TopologyError("malformed topology: it needs a [router] table with frontend and backend")
    options = {k: v for k, v in router.items() if k not in ("frontend", "backend")}
    return Topology(
        model=data.get("model", DEFAULT_MODEL),
        frontend=router["frontend"],
        backend=router["backend"],
        tokenizers=_entries(TokenizerSpec, data, "tokenizer"),
        workers=_entries(WorkerSpec, data, "worker"),
        router=_within("router", lambda: from_table(RouterConfig, options, refused=ROUTER_DERIVED)),
        kvcaches=_entries(KvCacheSpec, data, "kvcache"),
        gateways=_entries(GatewaySpec, data, "gateway"),
        block_size=data.get("block_size", DEFAULT_BLOCK_SIZE),
        kv_cache_dtype=data.get("kv_cache_dtype", DEFAULT_KV_CACHE_DTYPE),
        insecure=data.get("insecure", False),
        security=None if "security" not in data else _within("security", lambda: _security(data["security"], base)),
        balancer=None if "balancer" not in data else _within("balancer", lambda: from_table(BalancerConfig,
                                                                                            data["balancer"])),
    )


def _entries(cls: type[T], data: dict[str, Any], key: str) -> tuple[T, ...]:
    """An array of tables ([[key]]), each entry's errors prefixed with its name."""
    tables = data.get(key, [])
    if not isinstance(tables, list):
        raise TopologyError(f"{key}: must be an array of tables ([[{key}]])")
    entries = []
    for i, table in enumerate(tables):
        name = table.get("name") if isinstance(table, Mapping) else None
        where = f"{key} {name}" if isinstance(name, str) else f"{key} #{i + 1}"
        entries.append(_within(where, lambda table=table: from_table(cls, table)))
    return tuple(entries)


def _security(table: Any, base: Path) -> SecuritySpec:
    """The [security] table, its paths made absolute against the topology file's directory."""
    spec = from_table(SecuritySpec, table)
    client_keys = None if spec.client_keys is None else str(base / spec.client_keys)
    return SecuritySpec(str(base / spec.keys_dir), client_keys)
