"""The gateway as a process: `deepinfer-launch service gateway --topology F --name NAME` (what the supervisor and
systemd run) serves the topology's [[gateway]] NAME with uvicorn (uvloop, httptools with the gateway's
connection bounds: `gateway.http_protocol`).

Stopping: SIGTERM drains — new generation requests are answered 503 with Retry-After and `/ready` says 503
(a load balancer stops sending), the requests in flight finish (at most the services' drain timeout), then
uvicorn stops accepting, closes idle connections and exits. A second SIGTERM, or SIGINT, stops at once as
uvicorn does (it still finishes the requests in flight); so does the end of the supervisor that started it.
"""

from __future__ import annotations

import asyncio
import signal
from types import FrameType
from typing import Any

from deepinfer.gateway.app import Gateway, build_app, count_refusal
from deepinfer.gateway.http_protocol import guarded_httptools
from deepinfer.gateway.limits import HttpLimits
from deepinfer.gateway.server import load_gateway
from deepinfer.launch.sections import split_host_port


def uvicorn_config(gw: Gateway, app: Any, host: str, port: int, loop: str = "uvloop", **options: Any) -> Any:
    """uvicorn.Config serving `app` with `gw.limits`' connection bounds (the tests serve theirs with it too)."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, loop=loop, http=guarded_httptools(gw.limits, count_refusal),
                          lifespan="on", log_level="warning", access_log=False,
                          timeout_keep_alive=max(1, round(gw.limits.keep_alive_s)), backlog=2048, **options)


def draining_server(gw: Gateway, config: Any, drain_timeout_s: float) -> Any:
    """A uvicorn.Server whose first SIGTERM drains `gw` (see the module's doc) before it shuts down."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        loop: asyncio.AbstractEventLoop | None = None

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if sig == signal.SIGTERM and not gw.draining and self.loop is not None and not self.should_exit:
                self._captured_signals.append(sig)  # re-raised after the shutdown, as uvicorn does
                self.loop.call_soon_threadsafe(gw.begin_drain, self._drained, drain_timeout_s)
                return
            super().handle_exit(sig, frame)

        def _drained(self) -> None:
            self.should_exit = True

    return DrainingServer(config)


def run_gateway(topology: Any, name: str) -> None:
    """Serve gateway `name` of `topology` (a launch.topology.Topology) in this process."""
    from deepinfer.launch.keys import gateway_client_keys
    from deepinfer.launch.supervisor import watch_lifeline
    from deepinfer.launch.tuning import tune_malloc
    from deepinfer.services.base import DRAIN_TIMEOUT_S

    tune_malloc()
    spec = topology.gateway(name)
    host, port = split_host_port(spec.listen)
    router = topology.router
    gw = load_gateway(topology.model, topology.frontend, spec.served_model_name,
                      gateway_client_keys(topology, name), limits=HttpLimits.from_options(spec.limits),
                      tenant_keys=frozenset(router.tenants) if router.require_api_key else None,
                      require_api_key=router.require_api_key)
    server: Any = None

    def on_startup(loop: asyncio.AbstractEventLoop) -> None:
        server.loop = loop

        def stop() -> None:
            server.should_exit = True

        watch_lifeline(loop, stop)

    config = uvicorn_config(gw, build_app(gw, on_startup), host, port,
                            timeout_graceful_shutdown=int(DRAIN_TIMEOUT_S))
    server = draining_server(gw, config, DRAIN_TIMEOUT_S)
    server.run()
