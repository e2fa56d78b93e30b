"""Errors as OpenAI reports them: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

Every failure the gateway can meet becomes an `ApiError`: a request body it refuses (400), an unknown model or
route (404), and each of the mesh's error codes (`from_mesh_error`). Statuses follow OpenAI's (and so the SDKs'
exception types): 400 BadRequestError, 401 AuthenticationError, 404 NotFoundError, 429 RateLimitError (with
`Retry-After`), 500 InternalServerError, 503 (service unavailable: retry later), 504 (timed out).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# The mesh's error codes (protocol.messages.ErrorCode, plus the client's own "router_lost") → (HTTP status,
# OpenAI error type). A code not listed is an internal error.
MESH_STATUS: dict[str, tuple[int, str]] = {
    "invalid_request": (400, "invalid_request_error"),
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

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None) -> ApiError:
    """A 400 for a request the gateway refuses before the mesh sees it."""
    return ApiError(400, message, "invalid_request_error", param, None)


def model_not_found(model: Any) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model",
                    "model_not_found")


def from_mesh_error(exc: Exception) -> ApiError:
    """A `protocol.client.MeshError` (or anything else: 500) as an ApiError. Its message keeps the mesh's
    words (they name the field or the reason); an overloaded refusal carries `Retry-After` in whole seconds."""
    code = getattr(exc, "code", "internal")
    status, kind = MESH_STATUS.get(code, (500, "internal_error"))
    message = str(exc).removeprefix(f"{code}: ") or code
    headers = {}
    if status == 429:
        retry = getattr(exc, "retry_after_s", None)
        headers["Retry-After"] = str(max(1, math.ceil(retry)) if retry else DEFAULT_RETRY_AFTER_S)
    return ApiError(status, message, kind, None, code, headers)
