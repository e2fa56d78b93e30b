"""An in-process mesh on a background event loop (its router front on ipc:// so other loops can connect) and
the HTTP gateway served by uvicorn in a thread, with the gateway process's own protocol and bounds: what the
HTTP tests drive with real sockets."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx
import uvicorn

from deepinfer.gateway.app import Gateway, build_app
from deepinfer.launch.gateway_process import uvicorn_config
from deepinfer.launch.mesh import InprocMesh
from deepinfer.launch.topology import Topology, free_local_ports


class BackgroundMesh:
    """An InprocMesh on its own event loop thread; its router front on ipc:// so other loops can connect."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.mesh: InprocMesh | None = None

    def call(self, coro: Any, timeout: float = 300) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> None:
        self.thread.start()

        async def start() -> InprocMesh:
            mesh = InprocMesh(self.topology)
            await mesh.start()
            return mesh

        self.mesh = self.call(start())

    def router_inflight(self) -> int:
        async def count() -> int:
            return self.mesh.service("router").core.num_inflight  # type: ignore[union-attr]

        return self.call(count())

    def stop(self) -> None:
        if self.mesh is not None:
            self.call(self.mesh.stop(), timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


class BackgroundGateway:
    """uvicorn serving a Gateway on 127.0.0.1:<free port> in a thread."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.port = free_local_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(gw, build_app(gw), "127.0.0.1", self.port, loop="asyncio"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the gateway did not start"
            time.sleep(0.05)

    def wait_ready(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while httpx.get(self.url + "/ready").status_code != 200:
            assert time.monotonic() < deadline, "the gateway never became ready"
            time.sleep(0.1)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def settle(mesh: BackgroundMesh, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while mesh.router_inflight():
        assert time.monotonic() < deadline, f"{mesh.router_inflight()} requests still in flight at the router"
        time.sleep(0.05)


def sse_text(url: str, body: dict[str, Any], headers: dict[str, str] | None = None, timeout_s: float = 120.0,
             flowing: threading.Event | None = None) -> str:
    """One streamed completion's text (choice 0) from the gateway at `url`, checked: 200, no error event, ends with
    [DONE]. `flowing` is set once text arrived."""
    text, done = "", False
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=timeout_s) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: ") and not done, line
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            text += event["choices"][0]["text"]
            if flowing is not None and text:
                flowing.set()
    assert done
    return text
