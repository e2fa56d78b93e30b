"""DeepInfer: an LLM inference server with paged KV cache, continuous batching and a ZeroMQ service mesh.

    import deepinfer
    with deepinfer.Client("ipc:///run/deepinfer/router-frontend.sock") as c:
        print(c.generate("Hello", max_tokens=16).text)

The client names are loaded on first use, so `import deepinfer` (and any subpackage) stays light: no zmq
until a client is asked for, never torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
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
    "__version__",
]
_CLIENT_NAMES = frozenset(__all__) - {"__version__"}  # from deepinfer.protocol.client

if TYPE_CHECKING:
    from deepinfer.protocol.client import (
        AsyncClient,
        Client,
        InvalidRequestError,
        MeshError,
        OverloadedError,
        RequestTimeoutError,
        RequestTooLargeError,
        RouterLostError,
        UnauthorizedError,
        UnavailableError,
        WorkerLostError,
    )


def __getattr__(name: str) -> Any:
    if name in _CLIENT_NAMES:
        from deepinfer.protocol import client

        return getattr(client, name)
    raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_CLIENT_NAMES])
