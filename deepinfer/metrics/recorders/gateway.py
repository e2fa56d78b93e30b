"""The HTTP gateway's metrics: one call per answered request."""

from __future__ import annotations

from typing import Any

from deepinfer.metrics import definitions as d
from deepinfer.metrics.bind import bind

_children: dict[tuple[str, str], Any] = {}
_durations: dict[str, Any] = {}
_refusals: dict[str, Any] = {}


def record_http_request(endpoint: str, status: int | str, seconds: float | None = None) -> None:
    """Count one answered HTTP request (and its duration when given).

    `endpoint` must come from a fixed set (the route's path template, e.g. "/v1/completions"; "other" for
    anything unrouted), never the raw URL: each distinct value is a series.
    """
    key = (endpoint, str(status))
    child = _children.get(key)
    if child is None:
        child = _children[key] = bind(d.HTTP_REQUESTS, *key)
    child.inc()
    if seconds is not None:
        hist = _durations.get(endpoint)
        if hist is None:
            hist = _durations[endpoint] = bind(d.HTTP_REQUEST_DURATION, endpoint)
        hist.observe(seconds)


def record_http_refusal(cause: str) -> None:
    """Count one request refused, or connection or stream ended, by the gateway; `cause` is from a fixed set
    (deepinfer.gateway.limits.REFUSAL_CAUSES)."""
    child = _refusals.get(cause)
    if child is None:
        child = _refusals[cause] = bind(d.HTTP_REFUSALS, cause)
    child.inc()
