"""The topology's sections, one frozen dataclass per table of the file (see deepinfer.launch.topology):
tokenizers, workers, cache daemons, security. A key left out takes the default declared here, itself taken
from deepinfer.config.engine's DEFAULT_* where the engine has the same setting, so a worker's settings and
its engine's cannot drift apart."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from deepinfer.cache.fetch_plan import FETCH_POLICIES
from deepinfer.config.engine import (
    DEFAULT_DEVICE,
    DEFAULT_EP_TIMEOUT_S,
    DEFAULT_KV_CACHE_MB,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    DEFAULT_SWAP_SPACE_MB,
    DEFAULT_WEIGHTS,
    MAX_SPECULATIVE_TOKENS,
    MIN_SPECULATIVE_TOKENS,
    WEIGHTS_MODES,
)
from deepinfer.gateway.limits import HttpLimits
from deepinfer.services.stream_coalescer import STREAM_INTERVAL_S

ROLES = ("prefill", "decode", "worker")
KVCACHE_DIR_ENV = "DEEPINFER_KVCACHE_DIR"
DEFAULT_MODEL = "smollm2"  # fetched on first use
DEFAULT_HOST_CACHE_MB, DEFAULT_DISK_CACHE_MB = 1024, 8192  # a cache daemon's DRAM and disk tiers
# The devices an expert-parallel group may name: its ranks take one device each, rank R on `rank_device(R)`.
EP_DEVICES = ("cpu", "cuda")


def default_kvcache_dir() -> Path:
    """`$DEEPINFER_KVCACHE_DIR`, else `kvcache/` in the user's cache directory."""
    from deepinfer.config.paths import default_cache_dir

    env = os.environ.get(KVCACHE_DIR_ENV)
    return Path(env) if env else default_cache_dir() / "kvcache"


def speculative_problem(method: str) -> str | None:
    """Why `method` is not a speculative decoding method the engine knows, or None."""
    from deepinfer.config.engine import parse_speculative
    from deepinfer.config.model import ConfigError

    try:
        parse_speculative(method)
    except ConfigError as exc:
        return str(exc)
    return None


def split_host_port(address: str) -> tuple[str, int]:
    """"host:port" (an IPv6 host in brackets) → (host, port); ValueError says what is wrong."""
    host, sep, port = address.rpartition(":")
    if "://" in address:
        raise ValueError("must be host:port, without a scheme")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("must be host:port, with a port in 1..65535")
    return host.removeprefix("[").removesuffix("]"), int(port)


@dataclass(frozen=True)
class WorkerSpec:
    """One worker: its engine's settings default to EngineConfig's (the same DEFAULT_* constants)."""

    name: str
    role: str
    kv: str  # the decode side's bound ROUTER endpoint (unused for pure prefill workers)
    device: str = DEFAULT_DEVICE
    threads: int | None = None
    kv_cache_mb: int = DEFAULT_KV_CACHE_MB
    # Host memory for preempted requests' KV, swapped out where that is cheaper than recomputing it; 0: recompute.
    swap_space_mb: int = DEFAULT_SWAP_SPACE_MB
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    kvcache: str | None = None  # name of the cache daemon this worker reads from and writes to
    prefix_caching: bool = True  # keep freed full blocks addressable in the device pool
    speculative: str | None = None  # speculative decoding method (EngineConfig.speculative); None: off
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    adaptive_speculation: bool = True
    # Expert parallelism: the worker is a group of `ep` ranks, one process each (rank 0 speaks for the group
    # to the mesh); `ep_master` is the group's torch.distributed rendezvous, "host:port" (required when ep > 1,
    # unused when ep = 1), on rank 0's host. A rank runs wherever its unit is started: `rank_hosts` names each
    # rank's host by its address (rank 0's is the host of `kv`), which `systemd --host` follows; empty, every
    # rank is on the worker's host (as `up` runs them). `threads` is the worker's, shared equally by its ranks
    # (at least one each; mesh.engine_config divides it).
    ep: int = 1
    ep_master: str = ""
    rank_hosts: tuple[str, ...] = ()
    # How long a rank waits for its group (rendezvous, every control round) before the group counts as broken.
    ep_timeout_s: float = DEFAULT_EP_TIMEOUT_S
    # An MoE group's redundant expert replicas per layer in its starting (static) placement, the slots the
    # expert balancer moves hot experts into: None = automatic (EngineConfig: max(1, E // 8)), 0 = none.
    redundant_experts: int | None = None
    # How the engine holds projection weights (EngineConfig.weights): "auto", "native", "fp32" or "q8_0".
    weights: str = DEFAULT_WEIGHTS
    # New tokens go to the tokenizers at most this often (a request's first tokens and its finish at once;
    # services/stream_coalescer.py); 0: after every engine step.
    stream_interval_ms: float = STREAM_INTERVAL_S * 1000
    # With a cache daemon: a job's cached prefix is looked up as it enters the engine's queue, which is kept
    # this many steps' token budgets deep (services/worker_stage.py); 0: looked up as the job arrives.
    lookup_ahead_steps: int = 2
    # With a cache daemon: "plan" loads a cached prefix only where fetching is predicted faster than computing
    # it (cache/fetch_plan.py); "always" loads every hit, as a cache without that plan would.
    fetch_policy: str = "plan"

    def rank_device(self, rank: int) -> str:
        """The device rank `rank` runs on: "cuda" gives rank R cuda:R (a group takes devices 0..ep-1 of its
        host), "cpu" every rank the CPU; a single-rank worker runs on `device` as given (e.g. "cuda:1")."""
        if not 0 <= rank < self.ep:
            raise ValueError(f"worker {self.name}: rank {rank} is not in [0, {self.ep})")
        return f"cuda:{rank}" if self.ep > 1 and self.device == "cuda" else self.device

    def parallel_problem(self) -> str | None:
        """What is wrong with this worker's expert-parallel keys, naming the key, or None (types already
        checked; collisions with other endpoints are the topology's to find)."""
        if self.ep < 1:
            return f"ep = {self.ep}: must be an integer >= 1"
        if self.redundant_experts is not None and self.redundant_experts < 0:
            return f"redundant_experts = {self.redundant_experts}: must not be negative"
        if self.ep == 1:
            return self._rank_hosts_problem()
        if self.device not in EP_DEVICES:
            return (f"device = {self.device!r}: the ranks of an expert-parallel group take one device each "
                    f"(rank R on cuda:R), so give device = \"cuda\" or \"cpu\"")
        if not self.ep_master:
            return f"ep = {self.ep}: needs ep_master = \"host:port\" (the group's torch.distributed rendezvous)"
        try:
            split_host_port(self.ep_master)
        except ValueError as exc:
            return f"ep_master = {self.ep_master!r}: {exc}"
        return self._rank_hosts_problem()

    def _rank_hosts_problem(self) -> str | None:
        if not self.rank_hosts:
            return None
        if len(self.rank_hosts) != self.ep or not all(self.rank_hosts):
            return f"rank_hosts = {list(self.rank_hosts)!r}: must name the host of each of the {self.ep} ranks"
        kv_host = self.host()
        if kv_host is None or kv_host.lower() != self.rank_hosts[0].lower():
            return (f"rank_hosts = {list(self.rank_hosts)!r}: rank 0 binds kv = {self.kv!r}, so its host must be "
                    f"that endpoint's address")
        return None

    def host(self) -> str | None:
        """The address this worker binds `kv` on (its rank 0's host); None for ipc:// and inproc://."""
        if not self.kv.startswith("tcp://"):
            return None
        try:
            return split_host_port(self.kv.removeprefix("tcp://"))[0]
        except ValueError:  # a malformed kv is refused where endpoints are checked
            return None

    def ranks_on(self, address: str) -> list[int]:
        """The ranks that run on the host with this address (`rank_hosts`, else all of them on the worker's)."""
        if self.rank_hosts:
            return [r for r, h in enumerate(self.rank_hosts) if h.lower() == address.lower()]
        host = self.host()
        return list(range(self.ep)) if host is not None and host.lower() == address.lower() else []

    def weights_problem(self) -> str | None:
        """What is wrong with this worker's `weights` key, or None."""
        if self.weights not in WEIGHTS_MODES:
            return f"weights = {self.weights!r}: must be one of {', '.join(map(repr, WEIGHTS_MODES))}"
        return None

    def stream_problem(self) -> str | None:
        """What is wrong with this worker's `stream_interval_ms`, `lookup_ahead_steps`, `fetch_policy` or
        `swap_space_mb`, or None."""
        if not 0 <= self.stream_interval_ms <= 10_000:
            return f"stream_interval_ms = {self.stream_interval_ms!r}: must be a number of milliseconds in [0, 10000]"
        if not 0 <= self.lookup_ahead_steps <= 64:
            return f"lookup_ahead_steps = {self.lookup_ahead_steps!r}: must be an integer in [0, 64]"
        if self.fetch_policy not in FETCH_POLICIES:
            return f"fetch_policy = {self.fetch_policy!r}: must be one of {', '.join(map(repr, FETCH_POLICIES))}"
        if self.swap_space_mb < 0:
            return f"swap_space_mb = {self.swap_space_mb!r}: must not be negative (0: preempted requests recompute)"
        return None

    def speculation_problem(self) -> str | None:
        """What is wrong with this worker's speculation keys, naming the key, or None (types already checked)."""
        k = self.num_speculative_tokens
        if not MIN_SPECULATIVE_TOKENS <= k <= MAX_SPECULATIVE_TOKENS:
            return f"num_speculative_tokens = {k!r}: must be an integer in [{MIN_SPECULATIVE_TOKENS}, " \
                   f"{MAX_SPECULATIVE_TOKENS}]"
        problem = None if self.speculative is None else speculative_problem(self.speculative)
        return None if problem is None else f"speculative = {self.speculative!r}: {problem}"


@dataclass(frozen=True)
class KvCacheSpec:
    """One cache daemon (one per host): a DRAM tier and a disk tier in `dir`."""

    name: str
    endpoint: str
    dir: str | None = None  # None: default_kvcache_dir()
    host_mb: int = DEFAULT_HOST_CACHE_MB
    disk_mb: int = DEFAULT_DISK_CACHE_MB
    # One budget shared by every daemon whose `dir` is this pool (give each the same value): the daemons agree
    # their shares of it (cache.pool_share). None: each daemon's disk_mb is its only bound.
    pool_mb: int | None = None


@dataclass(frozen=True)
class TokenizerSpec:
    name: str
    detok: str


@dataclass(frozen=True)
class GatewaySpec:
    """One OpenAI-compatible HTTP gateway (deepinfer.gateway): a client of the router's frontend that listens
    for HTTP on `listen`, "HOST:PORT". It serves the topology's model under `served_model_name` (the `model`
    clients must give; default: the topology's `model` as written). Stateless: several may run, on any hosts."""

    name: str
    listen: str
    served_model_name: str | None = None
    # deepinfer.gateway.limits.HttpLimits fields to change ([gateway.limits] max_body_bytes = 8388608, ...)
    limits: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        try:
            split_host_port(self.listen)
        except ValueError as exc:
            raise ValueError(f"listen = {self.listen!r}: {exc}") from None
        HttpLimits.from_options(self.limits)  # ValueError naming a key it does not know or cannot take
        object.__setattr__(self, "limits", MappingProxyType(dict(self.limits)))  # frozen all the way down


@dataclass(frozen=True)
class SecuritySpec:
    """Where the CURVE keys are (`deepinfer-launch keys`): `keys_dir/services/NAME.key` names each service's
    public key, a host holds the `.key_secret` of its own services only; `client_keys` lists the tenants' public
    keys (kept apart from the service keys: a tenant key never authenticates a service)."""

    keys_dir: str
    client_keys: str | None = None  # None: keys_dir/clients/allowed
