"""The gateway's connection bounds (`gateway.http_protocol`) on a real uvicorn server with a small ASGI app,
driven by raw sockets: slowloris connections (headers, or a body, that never finish) are answered and
closed while an ordinary request on another connection is served; oversized headers get 431; past the
connection cap a connection gets 503 at once; a client that stops reading an endless response is cut off.
Each is reported with its cause."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from deepinfer.gateway.http_protocol import guarded_httptools
from deepinfer.gateway.limits import HttpLimits
from deepinfer.launch.topology import free_local_ports

WAIT_S = 60  # a bound on waiting for what must happen (never asserted as a duration)


async def app(scope, receive, send) -> None:
    """/echo reads the body and answers its length; /endless streams until the client is gone."""
    if scope["path"] == "/endless":
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.ensure_future(watch())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        while not gone.is_set():  # (a send to a gone client returns at once: yield to see it go)
            await send({"type": "http.response.body", "body": b"x" * 65536, "more_body": True})
            await asyncio.sleep(0)
        await watcher
        return
    size, more = 0, True
    while more:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return
        size, more = size + len(msg.get("body", b"")), msg.get("more_body", False)
    answer = str(size).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(answer))]})
    await send({"type": "http.response.body", "body": answer})


class Served:
    def __init__(self, limits: HttpLimits, loop: str = "uvloop") -> None:
        self.causes: list[str] = []
        self.refused = threading.Condition()
        self.port = free_local_ports(1)[0]
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, loop=loop,
                                http=guarded_httptools(limits, self._on_refusal), lifespan="off",
                                log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + WAIT_S
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive()
            time.sleep(0.01)

    def _on_refusal(self, cause: str) -> None:
        with self.refused:
            self.causes.append(cause)
            self.refused.notify_all()

    def wait_for(self, cause: str, count: int = 1) -> None:
        with self.refused:
            assert self.refused.wait_for(lambda: self.causes.count(cause) >= count, WAIT_S), self.causes

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=WAIT_S)

    def echo(self, body: bytes) -> bytes:
        with self.connect() as s:
            s.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
                      % (len(body), body))
            return read_all(s)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(WAIT_S)


def read_all(s: socket.socket) -> bytes:
    """Everything until the server closes (a reset counts as closed)."""
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


@pytest.fixture(scope="module", params=["uvloop", "asyncio"])
def quick(request) -> Iterator[Served]:
    """A server with short deadlines, on each event loop the gateway runs on (the process: uvloop)."""
    served = Served(HttpLimits(header_timeout_s=0.5, body_timeout_s=0.5, write_stall_timeout_s=0.5,
                               max_header_bytes=4096), request.param)
    yield served
    served.stop()


def test_slowloris_headers_are_answered_408_and_closed_while_others_are_served(quick):
    loris = [quick.connect() for _ in range(50)]
    for s in loris:
        s.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\n")  # and never the rest
    assert quick.echo(b"hello").endswith(b"\r\n\r\n5")  # served meanwhile
    for s in loris:
        assert read_all(s).startswith(b"HTTP/1.1 408 ")
        s.close()
    quick.wait_for("header_timeout", 50)
    idle = quick.connect()  # a connection that sends nothing at all is closed too
    assert read_all(idle).startswith(b"HTTP/1.1 408 ")
    idle.close()


def test_a_body_that_never_finishes_is_cut_off(quick):
    with quick.connect() as s:
        s.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\nonly ten b")
        assert read_all(s) == b""  # closed without an answer: the request is under way
    quick.wait_for("body_timeout")
    assert quick.echo(b"x" * 100).endswith(b"100")


def test_oversized_headers_get_431(quick):
    with quick.connect() as s:
        s.sendall(b"GET /echo HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 8192 + b"\r\n\r\n")
        assert read_all(s).startswith(b"HTTP/1.1 431 ")
    quick.wait_for("headers_too_large")
    with quick.connect() as s:
        s.sendall(b"GET /" + b"a" * 8192 + b" HTTP/1.1\r\nhost: x\r\n\r\n")
        assert read_all(s).startswith(b"HTTP/1.1 431 ")


def test_a_client_that_stops_reading_is_cut_off(quick):
    with quick.connect() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(b"GET /endless HTTP/1.1\r\nhost: x\r\n\r\n")
        quick.wait_for("write_stall")  # reads nothing until then
        read_all(s)  # ends: the server closed it (an endless response otherwise never would)


def test_past_the_connection_cap_a_connection_gets_503_at_once():
    served = Served(HttpLimits(max_connections=4, header_timeout_s=WAIT_S))
    try:
        held = [served.connect() for _ in range(4)]
        for s in held:
            s.sendall(b"GET /echo HTTP/1.1\r\nhost: x\r\n")  # unfinished: they stay open
        with served.connect() as extra:
            reply = read_all(extra)
        assert reply.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in reply
        served.wait_for("connection_limit")
        for s in held:
            s.close()
        deadline = time.monotonic() + WAIT_S
        while True:  # the closed ones free their places (once the server has seen them go)
            try:
                if served.echo(b"abc").endswith(b"3"):
                    break
            except OSError:  # refused while the server had not seen them go: it wrote 503 and closed
                pass
            assert time.monotonic() < deadline, "no place came free"
            time.sleep(0.05)
    finally:
        served.stop()

