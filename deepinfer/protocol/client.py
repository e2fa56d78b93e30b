"""The ZeroMQ client: `Client` (blocking, safe to share between threads) and `AsyncClient` (asyncio).

    with Client("ipc:///run/deepinfer/router-frontend.sock") as c:
        r = c.generate("Hello", max_tokens=16)
        print(r.text, r.finish_reason, r.usage.cached_tokens, r.timings.ttft_s)

    async with AsyncClient(endpoint) as c:
        async for delta in c.stream(messages=[{"role": "user", "content": "Hi"}], max_tokens=32):
            print(delta.text, end="")

Both talk to the router over one DEALER socket and route replies to their requests by request id. In
`Client` one I/O thread owns that socket; the threads calling `generate`, `generate_many` and `stream`
hand it their requests and each wait on a queue of their own, so any number of threads may share a client.

Cancelling a stream (breaking out of it, or cancelling its task) or closing the client aborts the
request in the mesh. Replies to requests the client gave up on (timed out, aborted) are dropped, so a
client stays usable after any failure. Failures raise a `MeshError` subclass that names what went wrong.

The router's liveness: ZMTP heartbeats on the socket and a socket monitor. When the connection to the router
drops (its process died, or it stopped answering heartbeats for HEARTBEAT_TIMEOUT_MS) every request the router
held ends with `RouterLostError`; a request sent while no router is connected waits `connect_timeout_s` for
one. The socket reconnects by itself, says Hello again, and the same client serves new requests.

A router whose tcp:// front is secured (CURVE, see `protocol.auth`) takes tenants with a listed key only:
pass `curve_keys=` (this tenant's KeyPair) and `server_key=` (the router's public key), e.g. both from
`load_client_keys(keys_dir)`. The client's routing id then starts with its key's prefix, which the router checks.

The client lives by job in the modules next to this one, and this module is their public face:
client_sync (`Client` and its I/O thread), client_async (`AsyncClient`), client_session (the socket and the
request bookkeeping both share), client_requests (`build_request`, `encode_request`, `logit_bias_pairs`) and
client_errors (`MeshError` and its subclasses).
"""

from deepinfer.protocol.client_async import AsyncClient
from deepinfer.protocol.client_errors import (
    InvalidRequestError,
    MeshError,
    OverloadedError,
    RequestTimeoutError,
    RequestTooLargeError,
    RouterLostError,
    UnauthorizedError,
    UnavailableError,
    WorkerLostError,
    error_from_reply,
)
from deepinfer.protocol.client_requests import build_request, encode_request, logit_bias_pairs
from deepinfer.protocol.client_session import (
    CONNECT_TIMEOUT_S,
    HEARTBEAT_IVL_MS,
    HEARTBEAT_TIMEOUT_MS,
    HEARTBEAT_TTL_MS,
)
from deepinfer.protocol.client_sync import Client

__all__ = [
    "CONNECT_TIMEOUT_S",
    "HEARTBEAT_IVL_MS",
    "HEARTBEAT_TIMEOUT_MS",
    "HEARTBEAT_TTL_MS",
    "AsyncClient",
    "Client",
    "InvalidRequestError",
    "MeshError",
    "OverloadedError",
    "RequestTimeoutError",
    "RequestTooLargeError",
    "RouterLostError",
    "UnauthorizedError",
    "UnavailableError",
    "WorkerLostError",
    "build_request",
    "encode_request",
    "error_from_reply",
    "logit_bias_pairs",
]
