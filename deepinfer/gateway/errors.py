"""Errors as OpenAI reports them: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

Every failure the gateway can meet becomes an `ApiError`: a request body it refuses (400), an unknown model or
route (404), a body over the size limit (413), each of the mesh's error codes (`from_mesh_error`), and
anything a request's producer raises (`from_exception`: a value the wire cannot carry is the request's fault,
400). Statuses follow OpenAI's (and so the SDKs' exception types): 400 BadRequestError, 401
AuthenticationError, 404 NotFoundError, 413, 429 RateLimitError (with `Retry-After`), 500
InternalServerError, 503 (service unavailable: retry later, with `Retry-After`), 504 (timed out).

An ApiError the gateway raised itself may name a `cause` (one of `limits.REFUSAL_CAUSES`): it is counted in
deepinfer_http_refusals_total.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from deepinfer.protocol.client_errors import MeshError
from deepinfer.protocol.errors import ProtocolError

# The mesh's error codes (protocol.messages.ErrorCode, plus the client's own "router_lost") → (HTTP status,
# OpenAI error type). A code not listed is an internal error.
MESH_STATUS: dict[str, tuple[int, str]] = {
    "invalid_request": (400, "invalid_request_error"),
    "request_too_large": (413, "invalid_request_error"),
    "unauthorized": (401, "authentication_error"),
    "overloaded": (429, "rate_limit_exceeded"),
    "unavailable": (503, "service_unavailable"),
    "worker_lost": (503, "service_unavailable"),
    "router_lost": (503, "service_unavailable"),
    "timeout": (504, "timeout"),
}
DEFAULT_RETRY_AFTER_S = 1  # an overloaded refusal that named no time


@dataclass
class ApiError(Exception):
    """One failed HTTP request: its status, the OpenAI error object's fields, and extra response headers."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    cause: str | None = None  # a refusal of the gateway's own (limits.REFUSAL_CAUSES), counted

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, cause: str | None = None) -> ApiError:
    """A 400 for a request the gateway refuses before the mesh sees it."""
    return ApiError(400, message, "invalid_request_error", param, None, cause=cause)


def too_large(message: str) -> ApiError:
    """413: the body (or the request it makes) is over a size limit; the connection is closed after it, as
    the rest of the body is not read."""
    return ApiError(413, message, "invalid_request_error", None, "request_too_large", {"Connection": "close"},
                    cause="body_too_large")


def unavailable(message: str, cause: str | None = None, retry_after_s: int = DEFAULT_RETRY_AFTER_S) -> ApiError:
    """503 with Retry-After: the gateway cannot take this request now (not connected, busy, draining)."""
    return ApiError(503, message, "service_unavailable", None, "unavailable", {"Retry-After": str(retry_after_s)},
                    cause=cause)


def model_not_found(model: Any) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model",
                    "model_not_found")


def from_mesh_error(exc: Exception) -> ApiError:
    """A `protocol.client.MeshError` (or anything else: 500) as an ApiError. Its message keeps the mesh's
    words (they name the field or the reason); an overloaded or unavailable refusal carries `Retry-After` in
    whole seconds. A request the client refused to send as too large is counted as `unencodable`."""
    code = getattr(exc, "code", "internal")
    status, kind = MESH_STATUS.get(code, (500, "internal_error"))
    message = str(exc).removeprefix(f"{code}: ") or code
    headers = {}
    if status in (429, 503):
        retry = getattr(exc, "retry_after_s", None)
        headers["Retry-After"] = str(max(1, math.ceil(retry)) if retry else DEFAULT_RETRY_AFTER_S)
    return ApiError(status, message, kind, None, code, headers,
                    cause="unencodable" if code == "request_too_large" else None)


def from_exception(exc: BaseException) -> ApiError:
    """Whatever a request's producer raised, as the ApiError its consumer gets (every error reaches it): the
    gateway's own, the mesh's, and a request the wire cannot carry (a ProtocolError or a ValueError /
    OverflowError while encoding, e.g. an integer of 2**64) as 400 (413 if too large) — the request's fault,
    never a 500. Anything else is an internal error."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, MeshError):
        return from_mesh_error(exc)
    if isinstance(exc, ProtocolError):
        status, code = (413, "request_too_large") if exc.code == "too_large" else (400, "invalid_request")
        return ApiError(status, f"the request cannot be sent to the mesh: {exc}", "invalid_request_error", None,
                        code, cause="unencodable")
    if isinstance(exc, ValueError | OverflowError):
        return ApiError(400, f"the request cannot be sent to the mesh: {exc}", "invalid_request_error", None,
                        "invalid_request", cause="unencodable")
    return ApiError(500, "internal error in the gateway", "internal_error", None, "internal")
