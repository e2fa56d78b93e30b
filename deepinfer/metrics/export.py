"""The text of GET /metrics, and a standalone exporter for a host that runs services but no gateway."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from deepinfer.metrics.env import multiproc_dir


def exposition() -> tuple[bytes, str]:
    """The Prometheus text exposition (format 0.0.4, which every scraper reads) and its content type.

    With a multiprocess directory: the aggregate over every process's files there (counters and histograms
    summed, gauges by their mode); without: this process's own default registry.
    """
    from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, REGISTRY, CollectorRegistry, generate_latest

    directory = multiproc_dir()
    if directory is None:
        return generate_latest(REGISTRY), CONTENT_TYPE_PLAIN_0_0_4
    from prometheus_client.multiprocess import MultiProcessCollector

    directory.mkdir(parents=True, exist_ok=True)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    return generate_latest(registry), CONTENT_TYPE_PLAIN_0_0_4


class _MetricsHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (the name http.server calls)
        if self.path.split("?", 1)[0] not in ("/metrics", "/"):
            self.send_error(404)
            return
        body, content_type = exposition()
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the signature http.server calls)
        return  # a scrape every few seconds is not worth a log line


class MetricsServer:
    """A thread serving GET /metrics (the same text as `exposition()`) until `close()`."""

    def __init__(self, host: str, port: int) -> None:
        self._server = ThreadingHTTPServer((host, port), _MetricsHandler)
        self._server.daemon_threads = True
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-exporter", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and release the port (idempotent)."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()

    shutdown = close

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(host: str, port: int) -> MetricsServer:
    """Start the standalone exporter on host:port (port 0: any free one, see `.port`)."""
    return MetricsServer(host, port)
