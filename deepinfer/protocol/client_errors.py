"""The client's errors: `MeshError` and a subclass per wire ErrorCode, and the one for a reply that carries one.

A request that fails raises (or, from `Client.generate_many`, returns in its place) one of these; `code` names
what went wrong, `request_id` which request, `retry_after_s` when the router suggests retrying.
"""

from __future__ import annotations

from deepinfer.protocol import messages as m


class MeshError(RuntimeError):
    """A request ended with an error. `code` is the wire ErrorCode (or "router_lost")."""

    code = "internal"

    def __init__(self, message: str, request_id: str = "", retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.retry_after_s = retry_after_s


class OverloadedError(MeshError):
    code = "overloaded"


class InvalidRequestError(MeshError):
    """The request itself is wrong (refused by the router, or by the client before sending: a value that does
    not fit the wire, such as an integer of 2**64 or more); retrying it unchanged fails again."""

    code = "invalid_request"


class RequestTooLargeError(InvalidRequestError):
    """The request's message is over the router's client limits (protocol.limits.CLIENT_LIMITS): a prompt
    past 2 MiB, too many token ids. Raised by the client before sending, or by the router's reply."""

    code = "request_too_large"


class WorkerLostError(MeshError):
    code = "worker_lost"


class UnauthorizedError(MeshError):
    """The router requires an api_key and the request's is unknown or missing."""

    code = "unauthorized"


class UnavailableError(MeshError):
    """No live worker or tokenizer could take the request (the mesh is starting or lost them); retry later."""

    code = "unavailable"


class RequestTimeoutError(MeshError):
    code = "timeout"


class RouterLostError(MeshError):
    """The connection to the router dropped while it held the request, or no router was reachable."""

    code = "router_lost"


_ERRORS = {cls.code: cls for cls in (OverloadedError, InvalidRequestError, RequestTooLargeError, WorkerLostError,
                                      RequestTimeoutError, UnauthorizedError, UnavailableError)}


def error_from_reply(reply: m.ErrorReply) -> MeshError:
    cls = _ERRORS.get(reply.code, MeshError)
    return cls(f"{reply.code}: {reply.message}", reply.request_id, reply.retry_after_s)
