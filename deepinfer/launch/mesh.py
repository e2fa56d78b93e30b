"""Builds services from a topology and runs them: all in one process (`run_inproc`, every service an
asyncio task over inproc://), or one per process (`run_service`, what the supervisor and systemd run).
This is the only module that knows every service class. It imports a role's class only when it builds one:
a service process pays for its own imports alone (the router's start does not wait for torch, ~1.5 s here,
which is most of how long a restarted router takes to serve again)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import tempfile
import threading
from collections.abc import Callable, Collection
from typing import Any

import zmq.asyncio

from deepinfer.config.engine import DEFAULT_BLOCK_SIZE, DEFAULT_KV_CACHE_DTYPE, EngineConfig
from deepinfer.launch.keys import service_auth
from deepinfer.launch.supervisor import watch_lifeline
from deepinfer.launch.topology import Topology, WorkerSpec, default_kvcache_dir
from deepinfer.launch.tuning import tune_malloc
from deepinfer.services.balancer_config import BALANCER_NAME
from deepinfer.services.base import Service


def engine_config(w: WorkerSpec, block_size: int = DEFAULT_BLOCK_SIZE, rank: int = 0,
                  kv_cache_dtype: str = DEFAULT_KV_CACHE_DTYPE) -> EngineConfig:
    """A worker's engine settings: its sub-tree of the topology, and the topology's block size and KV
    dtype (what `build_service` passes; the defaults are the topology's own, so they cannot differ).

    A worker group (`ep` > 1) runs this engine on each of its ranks, one process each on the host: the
    worker's threads (all cores when unset) are shared out, each rank getting an equal share, at least one,
    and rank `rank` runs on its own device (`WorkerSpec.rank_device`)."""
    # The launcher's environment may override four settings (the supervisor passes a group its threads this
    # way; DEEPINFER_DECODE_LOOP=0 turns the native decode loop off, DEEPINFER_AMX=0 the AMX tile paths, for an
    # A/B run).
    threads = w.threads or (int(os.environ["DEEPINFER_THREADS"]) if "DEEPINFER_THREADS" in os.environ else None)
    ep_timeout_s = float(os.environ.get("DEEPINFER_EP_CONTROL_TIMEOUT_S", w.ep_timeout_s))
    if w.ep > 1:
        threads = max(1, (threads or os.cpu_count() or 1) // w.ep)
    return EngineConfig(block_size=block_size, kv_cache_bytes=w.kv_cache_mb * 1024 * 1024,
                        swap_space_bytes=w.swap_space_mb * 1024 * 1024,
                        max_num_seqs=w.max_num_seqs, max_num_batched_tokens=w.max_num_batched_tokens,
                        device=w.rank_device(rank), num_threads=threads, enable_prefix_caching=w.prefix_caching,
                        speculative=w.speculative, num_speculative_tokens=w.num_speculative_tokens,
                        adaptive_speculation=w.adaptive_speculation, redundant_experts=w.redundant_experts,
                        weights=w.weights, kv_cache_dtype=kv_cache_dtype, ep_timeout_s=ep_timeout_s,
                        decode_loop=os.environ.get("DEEPINFER_DECODE_LOOP", "1") != "0",
                        amx=os.environ.get("DEEPINFER_AMX", "1") != "0")


def build_service(topology: Topology, role: str, name: str, ctx: zmq.asyncio.Context) -> Service:
    """Service `name` of `role`, built from its sub-tree of the topology and the settings every service
    shares (model, backend, block size), passed explicitly: no constructor default stands in for them."""
    auth = service_auth(topology, role, name)  # CURVE keys for its tcp:// sockets; none without [security]
    if role == "router":
        from deepinfer.services.router import RouterService

        return RouterService("router", topology.frontend, topology.backend, ctx, topology.router, auth=auth)
    if role == "tokenizer":
        from deepinfer.services.tokenizer import TokenizerService

        spec = topology.tokenizer(name)
        return TokenizerService(spec.name, topology.backend, spec.detok, ctx, topology.model,
                                block_size=topology.block_size, kv_cache_dtype=topology.kv_cache_dtype, auth=auth)
    if role == "worker":
        from deepinfer.services.worker import WorkerService

        spec = topology.worker(name)
        daemon = topology.kvcache(spec.kvcache) if spec.kvcache is not None else None
        return WorkerService(
            spec.name, spec.role, topology.backend, ctx, topology.model,
            engine_config(spec, topology.block_size, kv_cache_dtype=topology.kv_cache_dtype),
            kv_bind=spec.kv if spec.role in ("decode", "worker") else None,
            decode_peers={w.name: w.kv for w in topology.workers if w.role in ("decode", "worker")},
            tokenizers={t.name: t.detok for t in topology.tokenizers},
            kvcache=(daemon.name, daemon.endpoint) if daemon is not None else None, auth=auth,
            ep=spec.ep, ep_master=spec.ep_master, stream_interval_s=spec.stream_interval_ms / 1000,
            lookup_ahead_steps=spec.lookup_ahead_steps, fetch_policy=spec.fetch_policy,
        )
    if role == "kvcache":
        from deepinfer.services.kvcache import KvCacheService

        k = topology.kvcache(name)
        return KvCacheService(k.name, topology.backend, ctx, topology.model, k.endpoint,
                              k.dir if k.dir is not None else default_kvcache_dir(), k.host_mb, k.disk_mb,
                              block_size=topology.block_size, kv_cache_dtype=topology.kv_cache_dtype,
                              pool_mb=k.pool_mb, auth=auth)
    if role == "balancer":
        if topology.balancer is None or name != BALANCER_NAME:
            raise ValueError(f"the topology has no balancer named {name!r} (a [balancer] table runs {BALANCER_NAME!r})")
        from deepinfer.services.balancer import BalancerService

        return BalancerService(BALANCER_NAME, topology.backend, ctx, config=topology.balancer, auth=auth)
    raise ValueError(f"unknown role {role!r}")


def all_services(topology: Topology, ctx: zmq.asyncio.Context, skip: Collection[str] = ()) -> list[Service]:
    """Every service of the topology but those named in `skip` (run elsewhere), router first."""
    named = [("router", "router"), *(("kvcache", k.name) for k in topology.kvcaches),
             *(("tokenizer", t.name) for t in topology.tokenizers), *(("worker", w.name) for w in topology.workers),
             *([("balancer", BALANCER_NAME)] if topology.balancer is not None else [])]
    return [build_service(topology, role, name, ctx) for role, name in named if name not in skip]


class InprocMesh:
    """Every service as a task in the running event loop; `await start()` returns once all are serving.
    `skip` names services run elsewhere (e.g. a second worker group: a process leads at most one)."""

    def __init__(self, topology: Topology, skip: Collection[str] = ()) -> None:
        self.topology = topology
        self.ctx = zmq.asyncio.Context()
        self.services = all_services(topology, self.ctx, skip)
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, timeout_s: float = 300.0) -> None:
        ready = [asyncio.Event() for _ in self.services]
        self._tasks = [asyncio.create_task(s.run(r)) for s, r in zip(self.services, ready)]
        waiting = asyncio.gather(*(r.wait() for r in ready))
        done, _ = await asyncio.wait([waiting, *self._tasks], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        for t in self._tasks:
            if t in done and t.exception() is not None:
                await self.stop()
                raise t.exception()  # type: ignore[misc]
        if waiting not in done:
            await self.stop()
            raise TimeoutError("the mesh did not become ready in time")

    def service(self, name: str) -> Any:
        return next(s for s in self.services if s.instance == name)

    async def stop(self) -> None:
        # Workers first so they stop producing, the router last so it can answer until the end.
        for s in reversed(self.services):
            s.stop()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(t, 30)
        self.ctx.term()


def run_service(topology: Topology, role: str, name: str, on_ready: Callable[[], None] | None = None) -> None:
    """Run one service in this process until SIGINT/SIGTERM, or until the supervisor that started it is gone:
    either drains it (see `Service.drain`; it ends by the drain timeout whether or not its peers are alive).
    A signal that arrives while the service is still being built (imports, model load) is kept and drains it
    as soon as it exists, so a stop during start-up ends the process as cleanly as a stop while serving."""
    stop_asked: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: stop_asked.append(signum))
    tune_malloc()
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency; plain asyncio still works
        pass

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        service = build_service(topology, role, name, ctx)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, service.drain)
        watch_lifeline(loop, service.drain)
        if stop_asked:
            service.drain()
        ready = asyncio.Event()
        task = asyncio.create_task(service.run(ready))
        waiter = asyncio.ensure_future(ready.wait())
        await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if ready.is_set() and on_ready:
            on_ready()
        try:
            await task
        finally:
            # The service has drained (or failed): a SIGTERM from here on, while the process winds down (its
            # threads joined, the loop closed), must not kill it with -15 instead of the drain's exit status.
            # Removing the loop's handlers first keeps the loop's close from restoring the default action.
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
                signal.signal(sig, signal.SIG_IGN)
            ctx.destroy(linger=0)  # never waits: a socket left open (or unsent messages) cannot hold the exit

    asyncio.run(main())


class EmbeddedMesh:
    """An in-process mesh on a background thread, for commands run without --endpoint: every service in
    one event loop over inproc://, the client front on an ipc:// socket in a private directory so plain
    (blocking) clients in this process can reach it.

        with EmbeddedMesh(model) as endpoint:
            Client(endpoint).generate("Hi")
    """

    def __init__(self, model: str, disaggregated: bool = False, **options: Any) -> None:
        """`options`: `Topology.local`'s worker and cache settings (threads, kv_cache_mb, block_size,
        speculative, ...), whose defaults are the topology's."""
        topo = Topology.local(model, "inproc", disaggregated=disaggregated, **options)
        self._tmp = tempfile.TemporaryDirectory(prefix="deepinfer-")
        self.topology = dataclasses.replace(topo, frontend=f"ipc://{self._tmp.name}/router-frontend.sock")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="embedded-mesh", daemon=True)
        self._mesh: InprocMesh | None = None

    def __enter__(self) -> str:
        tune_malloc()
        self._thread.start()

        async def start() -> InprocMesh:
            mesh = InprocMesh(self.topology)
            await mesh.start()
            return mesh

        try:
            self._mesh = asyncio.run_coroutine_threadsafe(start(), self._loop).result()
        except BaseException:
            self._shutdown()
            raise
        return self.topology.frontend

    def __exit__(self, *exc: object) -> None:
        if self._mesh is not None:
            asyncio.run_coroutine_threadsafe(self._mesh.stop(), self._loop).result(timeout=60)
        self._shutdown()

    def _shutdown(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._tmp.cleanup()


def serve_inproc(topology: Topology, on_ready: Callable[[], None] | None = None) -> None:
    """`deepinfer-launch up --inproc`: the whole mesh in this process until SIGINT/SIGTERM."""
    tune_malloc()
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):  # before the models load: a signal then still stops cleanly
            loop.add_signal_handler(sig, stop.set)
        mesh = InprocMesh(topology)
        await mesh.start()
        if on_ready and not stop.is_set():
            on_ready()
        await stop.wait()
        await mesh.stop()

    asyncio.run(main())
