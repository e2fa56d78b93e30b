"""The gateway as a process: `deepinfer-launch service gateway --topology F --name NAME` (what the supervisor and
systemd run) serves the topology's [[gateway]] NAME with uvicorn (uvloop, httptools) until SIGINT/SIGTERM,
or until the supervisor that started it is gone; either way uvicorn stops accepting and finishes the
requests in flight (at most the services' drain timeout)."""

from __future__ import annotations

import asyncio
from typing import Any

from deepinfer.gateway.app import build_app
from deepinfer.gateway.server import load_gateway
from deepinfer.launch.sections import split_host_port


def run_gateway(topology: Any, name: str) -> None:
    """Serve gateway `name` of `topology` (a launch.topology.Topology) in this process."""
    import uvicorn

    from deepinfer.launch.keys import gateway_client_keys
    from deepinfer.launch.supervisor import watch_lifeline
    from deepinfer.launch.tuning import tune_malloc
    from deepinfer.services.base import DRAIN_TIMEOUT_S

    tune_malloc()
    spec = topology.gateway(name)
    host, port = split_host_port(spec.listen)
    gw = load_gateway(topology.model, topology.frontend, spec.served_model_name,
                      gateway_client_keys(topology, name))
    server: uvicorn.Server | None = None

    def on_startup(loop: asyncio.AbstractEventLoop) -> None:
        def stop() -> None:
            if server is not None:
                server.should_exit = True

        watch_lifeline(loop, stop)

    config = uvicorn.Config(build_app(gw, on_startup), host=host, port=port, loop="uvloop", http="httptools",
                            lifespan="on", log_level="warning", access_log=False,
                            timeout_graceful_shutdown=int(DRAIN_TIMEOUT_S))
    server = uvicorn.Server(config)
    server.run()
