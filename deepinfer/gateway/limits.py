"""The gateway's bounds: what one HTTP connection or request may cost before it is refused, at the usual
norms of HTTP servers (nginx, Node): a body limit enforced while reading, header and body read deadlines,
a cap on open connections, on JSON nesting and integer size, on the sequences one POST may ask for, and on
what a stream may hold for a client that stopped reading.

Each refusal is counted under a cause from `REFUSAL_CAUSES` (deepinfer_http_refusals_total{cause}).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

MIB = 1 << 20

# Why the gateway refused a request or ended a connection (a metric label: a fixed set).
REFUSAL_CAUSES = (
    "body_too_large",  # 413: Content-Length, or the bytes read, past max_body_bytes
    "headers_too_large",  # 431: request line and headers past max_header_bytes
    "header_timeout",  # 408 and closed: the headers did not arrive within header_timeout_s
    "body_timeout",  # closed: the body did not arrive within body_timeout_s of the headers
    "write_stall",  # closed: the client read nothing of a response for write_stall_timeout_s
    "connection_limit",  # 503 and closed: max_connections were open
    "invalid_json",  # 400: not JSON, nested past max_json_depth, or an integer outside 64 bits
    "too_many_sequences",  # 400: n × prompts past max_sequences
    "prompt_too_long",  # 400: longer than any prompt the context can hold
    "unencodable",  # 400/413: the request could not be encoded for the mesh
    "unauthorized",  # 401: a key the mesh requires is missing or unknown
    "busy",  # 503: the gateway's parsing/tokenising threads had too much waiting
    "draining",  # 503: the gateway is shutting down
    "slow_client",  # a stream's mesh requests aborted: its client stopped reading
)


@dataclass(frozen=True)
class HttpLimits:
    """The bounds of one gateway (a topology's [[gateway]] may set any of them)."""

    max_body_bytes: int = 4 * MIB  # a request body; larger → 413 (read no further)
    max_header_bytes: int = 64 * 1024  # request line and headers; larger → 431
    max_json_depth: int = 32  # arrays/objects nested deeper → 400 (OpenAI's bodies nest 4 deep)
    max_sequences: int = 256  # choices per request: n × prompts; more → 400
    max_connections: int = 1024  # open HTTP connections; one more is answered 503 and closed
    header_timeout_s: float = 10.0  # from a request's first byte (or the connection) to its last header
    body_timeout_s: float = 60.0  # from the last header to the body's last byte
    keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after this
    write_stall_timeout_s: float = 60.0  # a response the client reads none of for this long: closed
    max_stream_backlog: int = 4096  # mesh records a stream holds unsent; more → its requests are aborted
    offload_threads: int = 2  # threads for parsing, templating, tokenising and building big responses
    max_offload_waiting: int = 64  # jobs waiting for those threads; more → 503
    router_connections: int = 4  # AsyncClients to the router (requests spread over them)
    # What a connection buffers for its client before a stall reaches the stream's backlog bound: the
    # kernel's SO_SNDBUF and the transport's high-water mark (0: the kernel's autotuning, up to
    # net.ipv4.tcp_wmem's maximum, 4 MiB by default, and the event loop's 64 KiB).
    send_buffer_bytes: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            least = 0 if f.name == "send_buffer_bytes" else 1e-9
            if isinstance(value, bool) or not isinstance(value, int | float) or value < least:
                raise ValueError(f"{f.name} must be a positive number, got {value!r}")

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> HttpLimits:
        """From a mapping of field names to values (a topology's `[gateway.limits]`); ValueError naming an
        unknown key, or a fractional value for a count."""
        known = {f.name: f for f in fields(cls)}
        values = {}
        for key, value in options.items():
            if key not in known:
                raise ValueError(f"limits: unknown key {key!r} (known: {', '.join(known)})")
            if known[key].type == "int":
                if isinstance(value, float) and not value.is_integer():
                    raise ValueError(f"limits: {key} = {value!r} must be a whole number")
                value = int(value) if isinstance(value, float) else value
            values[key] = value
        return cls(**values)
