"""uvicorn's httptools protocol with the connection-level bounds HTTP servers keep and uvicorn lacks: a cap on
open connections, a deadline for a request's headers and one for its body, a cap on header bytes, and a
limit on how long a response may wait for a client that reads none of it.

Without these a slowloris client (connections that trickle headers, or bodies, a byte at a time) holds
sockets forever, and a client that stops reading holds its response's buffers forever. Each refusal is
answered the way HTTP norms say (503 / 408 / 431, then closed; a stalled body or reader: closed) and
reported to `on_refusal(cause)` with a cause from `limits.REFUSAL_CAUSES`.

Timers, per connection: the header deadline runs from the connection's start (a request's first byte on a
kept-alive one) to its last header; the body deadline from there to the body's last byte; the write stall
timer while the transport's write buffer is over its high-water mark. uvicorn's own keep-alive timeout
closes connections idle between requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from deepinfer.gateway.limits import HttpLimits


def _response(status: int, reason: str, extra: str = "") -> bytes:
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-length: 0\r\nconnection: close\r\n{extra}\r\n").encode()


CONNECTION_LIMIT = _response(503, "Service Unavailable", "retry-after: 1\r\n")
HEADER_TIMEOUT = _response(408, "Request Timeout")
HEADERS_TOO_LARGE = _response(431, "Request Header Fields Too Large")


def guarded_httptools(limits: HttpLimits, on_refusal: Callable[[str], None]) -> type[asyncio.Protocol]:
    """The protocol class to give uvicorn.Config(http=...): httptools with `limits`' connection bounds."""

    class GuardedHttpTools(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._refused = False  # answered and closing: parser callbacks do nothing more
            self._header_bytes = 0
            self._header_timer: asyncio.TimerHandle | None = None
            self._body_timer: asyncio.TimerHandle | None = None
            self._write_timer: asyncio.TimerHandle | None = None

        # --- the connection ---

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                self._refuse("connection_limit", CONNECTION_LIMIT)
                return
            if limits.send_buffer_bytes:  # the kernel's buffer and the transport's, each this size
                with contextlib.suppress(OSError, AttributeError):
                    transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF,
                                                                  limits.send_buffer_bytes)
                transport.set_write_buffer_limits(high=limits.send_buffer_bytes)
            self._header_timer = self.loop.call_later(limits.header_timeout_s, self._on_header_timeout)

        def connection_lost(self, exc: Exception | None) -> None:
            for timer in (self._header_timer, self._body_timer, self._write_timer):
                if timer is not None:
                    timer.cancel()
            super().connection_lost(exc)

        def _refuse(self, cause: str, response: bytes | None) -> None:
            """Answer `response` (None: nothing, the request is under way) and close the connection."""
            if self._refused:
                return
            self._refused = True
            on_refusal(cause)
            if self.transport.is_closing():
                return
            if response is not None:
                self.transport.write(response)
                self.transport.close()
                return
            # Reset, not close: what the kernel still holds for this client is dropped too (a stalled reader
            # would otherwise be fed megabytes of it at its pace). The app's receive/send see a disconnect.
            sock = self.transport.get_extra_info("socket")
            with contextlib.suppress(OSError, AttributeError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.transport.abort()

        def send_400_response(self, msg: str) -> None:
            if not self._refused:  # a parse error after our own answer is not answered again
                super().send_400_response(msg)

        # --- deadlines ---

        def _on_header_timeout(self) -> None:
            self._header_timer = None
            self._refuse("header_timeout", HEADER_TIMEOUT)

        def _on_body_timeout(self) -> None:
            self._body_timer = None
            self._refuse("body_timeout", None)

        def _on_write_stall(self) -> None:
            self._write_timer = None
            self._refuse("write_stall", None)

        # --- parser callbacks ---

        def on_message_begin(self) -> None:
            if self._refused:
                return
            super().on_message_begin()
            self._header_bytes = 0
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(limits.header_timeout_s, self._on_header_timeout)

        def _count_header_bytes(self, n: int) -> bool:
            self._header_bytes += n
            if self._header_bytes > limits.max_header_bytes:
                self._refuse("headers_too_large", HEADERS_TOO_LARGE)
            return not self._refused

        def on_url(self, url: bytes) -> None:
            if not self._refused and self._count_header_bytes(len(url)):
                super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            if not self._refused and self._count_header_bytes(len(name) + len(value) + 4):
                super().on_header(name, value)

        def on_headers_complete(self) -> None:
            if self._refused:
                return
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            self._body_timer = self.loop.call_later(limits.body_timeout_s, self._on_body_timeout)
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if not self._refused:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if self._refused:
                return
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None
            super().on_message_complete()

        # --- a client that does not read ---

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._write_timer is None:
                self._write_timer = self.loop.call_later(limits.write_stall_timeout_s, self._on_write_stall)

        def resume_writing(self) -> None:
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None
            super().resume_writing()

    return GuardedHttpTools
