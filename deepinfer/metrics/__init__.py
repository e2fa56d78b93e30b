"""DeepInfer's metrics: one set of Prometheus metrics for every service, exported as text for GET /metrics.

    from deepinfer import metrics
    body, content_type = metrics.exposition()   # what GET /metrics answers
    exporter = metrics.serve("0.0.0.0", 9400)   # a host with services but no gateway
    exporter.close()
    metrics.record_http_request("/v1/completions", 200, seconds)   # the gateway, per answered request

Multiple processes (prometheus_client's multiprocess mode): every process of a mesh on one host is started
with `PROMETHEUS_MULTIPROC_DIR` (`MULTIPROC_ENV`) naming one directory, which the launcher empties first
(`prepare_dir`). Each process then writes its samples to its own files there, and `exposition()` in any
of them (the gateway's, the standalone exporter's) aggregates all the files: counters and histograms add
up over processes; a gauge follows its `multiprocess_mode` (see `definitions`). When a child exits, its
supervisor calls `process_exited(pid)`, which drops that process's live gauges (its counters stay).
Without the variable (an in-process mesh, tests) each process exports its own default registry.

The variable must be set in a process's environment before its first metric binds its labels — in
practice before the process starts. prometheus_client reads it once, at import, to choose how samples
are stored; `env.sync_value_class()` re-reads it before every bind, so an early import of
prometheus_client does no harm, but samples bound before the variable was set stay in-process.

The layout: `definitions` (every metric), `recorders` (what each service records, children bound once),
`env` (the variable, the directory, process exits), `export` (exposition and the exporter).
"""

from __future__ import annotations

from deepinfer.metrics.env import MULTIPROC_ENV, multiproc_dir, prepare_dir, process_exited
from deepinfer.metrics.export import MetricsServer, exposition, serve
from deepinfer.metrics.recorders.gateway import record_http_refusal, record_http_request

__all__ = ["MULTIPROC_ENV", "MetricsServer", "exposition", "multiproc_dir", "prepare_dir", "process_exited",
           "record_http_refusal", "record_http_request", "serve"]
