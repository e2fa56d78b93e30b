"""A cluster on one machine: each host a Linux network namespace with its own address on a private bridge, each
service started in its host's namespace with exactly the command its systemd unit runs
(`deepinfer-launch service ROLE --name NAME --topology FILE`). Needs root (CI runs as root); `available()` says
why not otherwise, and the tests skip with that reason.

    with Cluster(["front", "p1", "d1"]) as cluster:
        topo = ...  # endpoints on cluster.address("front"), cluster.address("p1"), ...
        cluster.start("front", "router", "router", topology_file)
        ...
        cluster.cut("d1")      # its link down: nothing reaches it, it reaches nothing
        cluster.restore("d1")
        cluster.kill_host("d1")  # every process in its namespace, SIGKILL

Layout: one bridge in the root namespace holding the test's own address (`client_address`: the clients run there,
as on a machine outside the cluster), and per host a veth pair, one end on the bridge, the other in the host's
namespace. Names carry this process's id, so concurrent runs (and a run's leftovers) never collide; the subnet is
10.(200 + pid % 50).(pid // 50 % 250).0/24 for the same reason. Teardown — on leaving the `with`, on a failure,
and again at interpreter exit — stops every process it started (SIGTERM, then SIGKILL after a grace), kills
anything else left in the namespaces, and deletes the veth pairs, the namespaces and the bridge. `leftovers()` lists
what of this run still exists (for tests to assert nothing is left).

The hosts share the filesystem: a directory both hosts' cache daemons name stands in for a shared mount.

A host's clock can be set off (`clock_shifts`, seconds by host): its processes start with `clock_shift.c` preloaded,
which moves their wall clock (CLOCK_REALTIME: time.time(), log timestamps) by that much; their monotonic clocks and
the file times the kernel sets stay true, as a shared mount's server sets them for a host whose clock is wrong.

By hand, a topology whose tcp:// endpoints use the addresses A.B.C.1, A.B.C.2, ... (host k = A.B.C.k, in the
order of first appearance) runs as a cluster until Ctrl-C:

    sudo python -m bench.cluster_harness cluster.toml        # prints each host's services, then the frontend
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

STOP_GRACE_S = 20.0  # a service's drain after SIGTERM before SIGKILL


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"dip{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, namespace: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = ["ip", "netns", "exec", namespace, "ip", *args] if namespace else ["ip", *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")
    return done


@dataclass
class Service:
    host: str
    role: str
    name: str
    process: subprocess.Popen[bytes]
    log: Path


@dataclass
class Cluster:
    """`hosts`: their names; `net`: the /24 they share, as "A.B.C" (default: one derived from this process's id),
    each host taking .1, .2, ... in order (`address`), the root namespace .254."""

    hosts: Sequence[str]
    log_dir: Path | None = None
    net: str | None = None
    services: list[Service] = field(default_factory=list)
    clock_shifts: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        pid = os.getpid()
        self.tag = f"{pid:x}"[-6:]
        self._net = self.net or f"10.{200 + pid % 50}.{pid // 50 % 250}"
        self.bridge = f"dib{self.tag}"
        self._index = {h: i for i, h in enumerate(self.hosts)}
        self._made: list[str] = []
        self._logs: list[IO[bytes]] = []
        self.forced: list[str] = []  # services still running STOP_GRACE_S after SIGTERM at destroy(), killed
        if self.log_dir is None:
            import tempfile

            self.log_dir = Path(tempfile.mkdtemp(prefix="deepinfer-cluster-"))

    # -- names ---------------------------------------------------------------------------------------------

    def namespace(self, host: str) -> str:
        return f"di{self.tag}-{host}"

    def address(self, host: str) -> str:
        return f"{self._net}.{self._index[host] + 1}"

    @property
    def client_address(self) -> str:
        return f"{self._net}.254"

    def _veth(self, host: str) -> str:
        return f"div{self.tag}{self._index[host]}"  # the root namespace's end (15 characters at most)

    # -- making and unmaking -------------------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        atexit.register(self.destroy)
        try:
            self.create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append("bridge")
        _ip("addr", "add", f"{self.client_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for host in self.hosts:
            ns, veth = self.namespace(host), self._veth(host)
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("link", "set", "lo", "up", namespace=ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            _ip("addr", "add", f"{self.address(host)}/24", "dev", "eth0", namespace=ns)
            _ip("link", "set", "eth0", "up", namespace=ns)

    def destroy(self) -> None:
        """Stop everything and remove every namespace and link this cluster made; safe to call again."""
        for service in self.services:
            if service.process.poll() is None:
                service.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for service in self.services:
            try:
                service.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.forced.append(f"{service.host}/{service.name}")
                print(f"cluster: {service.host}/{service.name} still running {STOP_GRACE_S:.0f} s after SIGTERM: "
                      "killed", file=sys.stderr)
                service.process.kill()
                service.process.wait()
        for host in self.hosts:
            if self.namespace(host) in self._made:
                self._kill_namespace(host)
                # Deleting the pair here, not through its namespace: a namespace's devices go away in the
                # kernel's own time after `ip netns del` returns.
                _ip("link", "del", self._veth(host), check=False)
                _ip("netns", "del", self.namespace(host), check=False)
        if "bridge" in self._made:
            _ip("link", "del", self.bridge, check=False)
        self._made.clear()
        for log in self._logs:
            log.close()
        self._logs.clear()
        atexit.unregister(self.destroy)

    def leftovers(self) -> list[str]:
        """What of this cluster still exists: namespaces, links, running processes."""
        found = [ns for ns in _ip("netns", "list").stdout.split() if ns.startswith(f"di{self.tag}-")]
        found += [line.split(":")[1].strip().split("@")[0] for line in _ip("-o", "link").stdout.splitlines()
                  if self.tag in line.split(":")[1]]
        found += [f"pid {s.process.pid} ({s.name})" for s in self.services if s.process.poll() is None]
        return found

    # -- running services ----------------------------------------------------------------------------------

    def start(self, host: str, role: str, name: str, topology: Path, *extra: str,
              env: dict[str, str] | None = None) -> Service:
        """`deepinfer-launch service ROLE --name NAME --topology FILE` in `host`'s namespace; its output to a log
        file named after the service."""
        assert self.log_dir is not None
        log_path = self.log_dir / f"{host}-{name}.log"
        log = open(log_path, "ab")  # noqa: SIM115 - kept open for the process's life, closed at destroy()
        self._logs.append(log)
        cmd = ["ip", "netns", "exec", self.namespace(host), sys.executable, "-m", "deepinfer.launch.cli",
               "service", role, "--name", name, "--topology", str(topology), *extra]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}  # as the unit's Environment= has it
        if host in self.clock_shifts:
            env.update(LD_PRELOAD=str(self._clock_shift_library()), CLOCK_SHIFT_S=str(self.clock_shifts[host]))
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        service = Service(host, role, name, process, log_path)
        self.services.append(service)
        return service

    def _clock_shift_library(self) -> Path:
        assert self.log_dir is not None
        library = self.log_dir / "clock_shift.so"
        if not library.exists():
            source = Path(__file__).with_name("clock_shift.c")
            subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(library), str(source), "-ldl"], check=True)
        return library

    def cut(self, host: str) -> None:
        """Take the host's link down: its processes keep running, unreachable and reaching nothing."""
        _ip("link", "set", self._veth(host), "down")

    def restore(self, host: str) -> None:
        _ip("link", "set", self._veth(host), "up")

    def in_mounts(self, name: str, *command: str) -> None:
        """Run `command` in the mount namespace of service `name`. `ip netns exec` gives each service a mount
        namespace of its own (receiving the root's later mounts only where those are shared, and here they are
        private): this is how a test changes what one host's process sees of the filesystem, e.g. of the pool."""
        service = next(s for s in self.services if s.name == name and s.process.poll() is None)
        subprocess.run(["nsenter", "--target", str(service.process.pid), "--mount", *command], check=True)

    def kill(self, name: str) -> Service:
        """SIGKILL one service (a crash, or `kill -9`); it leaves `services`, so `dead()` names only deaths nobody
        caused. Start it again with `start` (as systemd's Restart= would)."""
        service = next(s for s in self.services if s.name == name and s.process.poll() is None)
        service.process.kill()
        service.process.wait()
        self.services.remove(service)
        return service

    def kill_host(self, host: str) -> None:
        """Lose the host: SIGKILL every process in its namespace (its link stays, as a dead machine's port). Its
        services leave `services`, as with `kill`: `dead()` names only deaths nobody caused."""
        self._kill_namespace(host)
        for service in [s for s in self.services if s.host == host]:
            service.process.wait()
            self.services.remove(service)

    def _kill_namespace(self, host: str) -> None:
        pids = _ip("netns", "pids", self.namespace(host), check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def dead(self) -> list[str]:
        """The services that exited, with the tail of each one's log."""
        return [f"{s.host}/{s.name} exited {s.process.returncode}:\n{s.log.read_text()[-3000:]}"
                for s in self.services if s.process.poll() is not None]


def run_topology(path: Path) -> None:
    """Every service of the topology at `path` in the namespace of the host its address names (see the module
    docstring), until SIGINT/SIGTERM; then everything is removed."""
    from deepinfer.launch.topology import Topology

    topo = Topology.load(path)
    addresses = sorted({h for _, e in topo.endpoints() if e.startswith("tcp://")
                        for h in [e.removeprefix("tcp://").rpartition(":")[0]]}, key=lambda a: int(a.split(".")[-1]))
    nets = {a.rpartition(".")[0] for a in addresses}
    if len(nets) != 1 or any(int(a.split(".")[-1]) != i + 1 for i, a in enumerate(addresses)):
        raise SystemExit(f"the topology's addresses must be A.B.C.1, A.B.C.2, ... in one /24; they are {addresses}")
    hosts = [f"h{i + 1}" for i in range(len(addresses))]
    roles = {"router": "router", "balancer": "balancer", **{t.name: "tokenizer" for t in topo.tokenizers},
             **{w.name: "worker" for w in topo.workers}, **{k.name: "kvcache" for k in topo.kvcaches},
             **{g.name: "gateway" for g in topo.gateways}}
    stop: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, _: stop.append(signum))
    signal.signal(signal.SIGTERM, lambda signum, _: stop.append(signum))
    with Cluster(hosts, net=nets.pop()) as cluster:
        for host, address in zip(hosts, addresses):
            names = topo.instances_on(address)
            print(f"{host} ({cluster.namespace(host)}, {address}): {', '.join(names)}", flush=True)
            for name in names:
                cluster.start(host, roles[name], name, path.resolve())
        print(f"frontend {topo.frontend}; logs in {cluster.log_dir}; Ctrl-C stops it", flush=True)
        while not stop:
            if cluster.dead():
                print("\n".join(cluster.dead()), file=sys.stderr, flush=True)
                break
            time.sleep(0.5)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m bench.cluster_harness TOPOLOGY.toml")
    problem = available()
    if problem is not None:
        raise SystemExit(problem)
    run_topology(Path(sys.argv[1]))
