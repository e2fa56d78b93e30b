"""Topology: which services run, where, and on which endpoints.

Built from flags (`Topology.local`) or read from TOML (`Topology.load`)::

    model = "smollm2"
    [router]
    frontend = "tcp://10.0.0.1:5550"      # clients connect here
    backend = "tcp://10.0.0.1:5551"       # every service connects here
    [[tokenizer]]
    name = "tokenizer-0"
    detok = "tcp://10.0.0.1:5560"         # decode workers push token batches here
    [[worker]]
    name = "prefill-0"
    role = "prefill"                      # "prefill", "decode" or "worker" (both, co-located)
    device = "cpu"
    threads = 1
    kv = "tcp://10.0.0.2:5570"            # decode/worker roles: where prefill workers send KV
    kvcache = "kvcache-0"                 # the cache daemon on this worker's host (omit: none)
    speculative = "ngram"                 # speculative decoding: "ngram", "suffix", "self:L", "draft:PATH"
    num_speculative_tokens = 4            # the most draft tokens per request per step (1..32)
    adaptive_speculation = true           # let the controller choose each step's k (false: always the cap)
    [[kvcache]]
    name = "kvcache-0"
    endpoint = "tcp://10.0.0.2:5580"      # workers on its host connect here
    dir = "/mnt/nvme/deepinfer-kv"        # the disk tier (default: the user's cache directory)
    host_mb = 4096                        # DRAM tier capacity
    disk_mb = 200000                      # disk tier capacity (watermarks keep usage below it)
    [security]                            # optional: CURVE on every tcp:// endpoint
    keys_dir = "/etc/deepinfer/keys"      # from `deepinfer-launch keys DIR --topology F` (relative: to this file)
    client_keys = "/etc/deepinfer/clients.allowed"  # the tenants' public keys (default: DIR/clients/allowed)

The long-lived side binds (router frontend/backend, tokenizer detok, decode kv, kvcache endpoint);
everyone else connects. `block_size` (top level, default 16) must be the same for every service: it is
part of the KV-cache namespace, and the handshake refuses a service that hashes blocks differently.
Speculation runs where decoding does: on decode and co-located workers. A prefill worker stops after the
first token and has nothing to speculate on; `Topology.local` sets the speculation keys on decoding workers only.
"""

from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROLES = ("prefill", "decode", "worker")
KVCACHE_DIR_ENV = "DEEPINFER_KVCACHE_DIR"


def default_kvcache_dir() -> Path:
    """`$DEEPINFER_KVCACHE_DIR`, else `kvcache/` in the user's cache directory."""
    from deepinfer.engine.fetch import default_cache_dir

    env = os.environ.get(KVCACHE_DIR_ENV)
    return Path(env) if env else default_cache_dir() / "kvcache"


class TopologyError(ValueError):
    """A topology that cannot run; the message names the entry."""


# EngineConfig's bounds on num_speculative_tokens, checked here so a bad topology fails when it is read.
MIN_SPECULATIVE_TOKENS, MAX_SPECULATIVE_TOKENS = 1, 32


def speculative_problem(method: str) -> str | None:
    """Why `method` is not a speculative decoding method the engine knows, or None."""
    from deepinfer.engine.config import ConfigError
    from deepinfer.engine.spec.base import parse_speculative  # imports torch: only when a method is named

    try:
        parse_speculative(method)
    except ConfigError as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class WorkerSpec:
    name: str
    role: str
    kv: str  # the decode side's bound ROUTER endpoint (unused for pure prefill workers)
    device: str = "cpu"
    threads: int | None = None
    kv_cache_mb: int = 512
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    kvcache: str | None = None  # name of the cache daemon this worker reads from and writes to
    prefix_caching: bool = True  # keep freed full blocks addressable in the device pool
    speculative: str | None = None  # speculative decoding method (EngineConfig.speculative); None: off
    num_speculative_tokens: int = 4
    adaptive_speculation: bool = True

    def speculation_problem(self) -> str | None:
        """What is wrong with this worker's speculation keys, naming the key, or None."""
        k = self.num_speculative_tokens
        if type(k) is not int or not MIN_SPECULATIVE_TOKENS <= k <= MAX_SPECULATIVE_TOKENS:  # TOML may give anything
            bounds = f"[{MIN_SPECULATIVE_TOKENS}, {MAX_SPECULATIVE_TOKENS}]"
            return f"num_speculative_tokens = {k!r}: must be an integer in {bounds}"
        if not isinstance(self.adaptive_speculation, bool):
            return f"adaptive_speculation = {self.adaptive_speculation!r}: must be true or false"
        if self.speculative is None:
            return None
        if not isinstance(self.speculative, str):
            return f"speculative = {self.speculative!r}: must be a string such as \"ngram\""
        problem = speculative_problem(self.speculative)
        return None if problem is None else f"speculative = {self.speculative!r}: {problem}"


@dataclass(frozen=True)
class KvCacheSpec:
    """One cache daemon (one per host): a DRAM tier and a disk tier in `dir`."""

    name: str
    endpoint: str
    dir: str | None = None  # None: default_kvcache_dir()
    host_mb: int = 256
    disk_mb: int = 2048


@dataclass(frozen=True)
class TokenizerSpec:
    name: str
    detok: str


@dataclass(frozen=True)
class SecuritySpec:
    """Where the CURVE keys are (`deepinfer-launch keys`): `keys_dir/services/NAME.key` names each service's
    public key, a host holds the `.key_secret` of its own services only; `client_keys` lists the tenants' public
    keys (kept apart from the service keys: a tenant key never authenticates a service)."""

    keys_dir: str
    client_keys: str | None = None  # None: keys_dir/clients/allowed


@dataclass(frozen=True)
class Topology:
    model: str
    frontend: str
    backend: str
    tokenizers: tuple[TokenizerSpec, ...]
    workers: tuple[WorkerSpec, ...]
    router_options: dict[str, Any] = field(default_factory=dict)
    kvcaches: tuple[KvCacheSpec, ...] = ()
    block_size: int = 16
    security: SecuritySpec | None = None  # None: no CURVE (loopback or ipc:// only, as DESIGN §3 advises)

    def __post_init__(self) -> None:
        names = [t.name for t in self.tokenizers] + [w.name for w in self.workers] + [k.name for k in self.kvcaches]
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
            problem = w.speculation_problem()
            if problem is not None:
                raise TopologyError(f"worker {w.name}: {problem}")
        if self.block_size <= 0:
            raise TopologyError(f"block_size must be positive, got {self.block_size}")

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

    def kvcache(self, name: str) -> KvCacheSpec:
        for k in self.kvcaches:
            if k.name == name:
                return k
        raise TopologyError(f"no kvcache named {name!r}")

    @classmethod
    def local(cls, model: str, transport: str, run_dir: Path | None = None, disaggregated: bool = True,
              num_prefill: int = 1, num_decode: int = 1, num_tokenizers: int = 1, threads: int | None = None,
              kv_cache_mb: int = 512, kvcache: bool = True, cache_dir: str | os.PathLike[str] | None = None,
              host_cache_mb: int = 256, disk_cache_mb: int = 2048, prefix_caching: bool = True,
              speculative: str | None = None, num_speculative_tokens: int = 4,
              adaptive_speculation: bool = True) -> Topology:
        """One host: `inproc` (one process) or `ipc` (a process per service, sockets in `run_dir`).
        With `kvcache`, one cache daemon (disk tier in `cache_dir`, default `default_kvcache_dir()`)
        serves every worker; `prefix_caching=False` also turns off reuse inside each worker. The
        speculation options go to the workers that decode (decode and co-located ones)."""
        if transport == "inproc":
            ep = lambda name: f"inproc://deepinfer-{os.getpid()}-{name}"  # noqa: E731
        elif transport == "ipc":
            if run_dir is None:
                raise TopologyError("ipc transport needs a runtime directory")
            ep = lambda name: f"ipc://{run_dir}/{name}.sock"  # noqa: E731
        else:
            raise TopologyError(f"unknown local transport {transport!r}")
        daemons = (KvCacheSpec("kvcache-0", ep("kvcache-0"), None if cache_dir is None else str(cache_dir),
                               host_cache_mb, disk_cache_mb),) if kvcache else ()
        common: dict[str, Any] = dict(threads=threads, kv_cache_mb=kv_cache_mb, prefix_caching=prefix_caching,
                                      kvcache="kvcache-0" if kvcache else None)
        decoding: dict[str, Any] = dict(common, speculative=speculative, num_speculative_tokens=num_speculative_tokens,
                                        adaptive_speculation=adaptive_speculation)
        workers: list[WorkerSpec] = []
        if disaggregated:
            workers += [WorkerSpec(f"prefill-{i}", "prefill", ep(f"prefill-{i}-kv"), **common)
                        for i in range(num_prefill)]
            workers += [WorkerSpec(f"decode-{i}", "decode", ep(f"decode-{i}-kv"), **decoding)
                        for i in range(num_decode)]
        else:
            workers.append(WorkerSpec("worker-0", "worker", ep("worker-0-kv"), **decoding))
        tokenizers = tuple(TokenizerSpec(f"tokenizer-{i}", ep(f"tokenizer-{i}-detok")) for i in range(num_tokenizers))
        return cls(model, ep("router-frontend"), ep("router-backend"), tokenizers, tuple(workers), kvcaches=daemons)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Topology:
        with open(path, "rb") as f:
            data = tomllib.load(f)
        try:
            router = data["router"]
            return cls(
                model=str(data.get("model", "smollm2")),
                frontend=router["frontend"],
                backend=router["backend"],
                tokenizers=tuple(TokenizerSpec(t["name"], t["detok"]) for t in data.get("tokenizer", [])),
                workers=tuple(WorkerSpec(**w) for w in data.get("worker", [])),
                router_options={k: v for k, v in router.items() if k not in ("frontend", "backend")},
                kvcaches=tuple(KvCacheSpec(**k) for k in data.get("kvcache", [])),
                block_size=int(data.get("block_size", 16)),
                security=_security(data.get("security"), Path(path).parent),
            )
        except (KeyError, TypeError) as exc:
            raise TopologyError(f"{path}: malformed topology ({exc})") from exc

    def to_toml(self) -> str:
        lines = [f'model = "{self.model}"', f"block_size = {self.block_size}", "", "[router]",
                 f'frontend = "{self.frontend}"', f'backend = "{self.backend}"']
        lines += [f"{k} = {v!r}" if isinstance(v, str) else f"{k} = {v}" for k, v in self.router_options.items()]
        for t in self.tokenizers:
            lines += ["", "[[tokenizer]]", f'name = "{t.name}"', f'detok = "{t.detok}"']
        for w in self.workers:
            lines += ["", "[[worker]]", f'name = "{w.name}"', f'role = "{w.role}"', f'kv = "{w.kv}"',
                      f'device = "{w.device}"', f"kv_cache_mb = {w.kv_cache_mb}",
                      f"max_num_seqs = {w.max_num_seqs}", f"max_num_batched_tokens = {w.max_num_batched_tokens}"]
            if w.threads is not None:
                lines.append(f"threads = {w.threads}")
            if w.kvcache is not None:
                lines.append(f'kvcache = "{w.kvcache}"')
            if not w.prefix_caching:
                lines.append("prefix_caching = false")
            lines += _speculation_toml(w)
        for k in self.kvcaches:
            lines += ["", "[[kvcache]]", f'name = "{k.name}"', f'endpoint = "{k.endpoint}"',
                      f"host_mb = {k.host_mb}", f"disk_mb = {k.disk_mb}"]
            if k.dir is not None:
                lines.append(f"dir = {json.dumps(k.dir)}")
        if self.security is not None:
            lines += ["", "[security]", f"keys_dir = {json.dumps(self.security.keys_dir)}"]
            if self.security.client_keys is not None:
                lines.append(f"client_keys = {json.dumps(self.security.client_keys)}")
        return "\n".join(lines) + "\n"


def _security(table: dict[str, Any] | None, base: Path) -> SecuritySpec | None:
    """The [security] table, its paths made absolute against the topology file's directory."""
    if table is None:
        return None
    spec = SecuritySpec(**table)
    client_keys = None if spec.client_keys is None else str(base / spec.client_keys)
    return SecuritySpec(str(base / spec.keys_dir), client_keys)


def _speculation_toml(w: WorkerSpec) -> list[str]:
    """A worker's speculation keys that differ from the defaults."""
    lines = [] if w.speculative is None else [f"speculative = {json.dumps(w.speculative)}"]
    if w.num_speculative_tokens != WorkerSpec.num_speculative_tokens:
        lines.append(f"num_speculative_tokens = {w.num_speculative_tokens}")
    if not w.adaptive_speculation:
        lines.append("adaptive_speculation = false")
    return lines
