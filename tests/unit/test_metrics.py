"""deepinfer.metrics: the exposition parses, names and label sets are as documented, recorders move their
series; with PROMETHEUS_MULTIPROC_DIR, real processes' samples add up and an exited one's live gauges go."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepinfer import metrics
from deepinfer.metrics import definitions as d
from deepinfer.metrics.bind import TotalsFeed, bind
from deepinfer.metrics.recorders.cache import CacheExport
from deepinfer.metrics.recorders.router import RouterExport
from deepinfer.metrics.recorders.service import ServiceMetrics
from deepinfer.metrics.recorders.worker import WorkerExport
from deepinfer.protocol import messages as m
from deepinfer.services.router_state import Phase

WHO = {"service", "instance"}

ROUTER_PHASES = [p.value for p in Phase]


def samples(body: bytes) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of an exposition: (name, labels) → value."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def value(body: bytes, name: str, **labels: str) -> float:
    return samples(body).get((name, frozenset(labels.items())), 0.0)


def families(body: bytes) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(body.decode())}


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    monkeypatch.delenv(metrics.MULTIPROC_ENV, raising=False)


def finished(prompt: int = 7, completion: int = 5, reason: str = "stop", **cached: int) -> m.RequestFinished:
    return m.RequestFinished("r", "text", [1] * completion, reason,  # type: ignore[arg-type]
                             m.UsageWire(prompt, completion, sum(cached.values()), dict(cached)),
                             m.Timings(e2e_s=0.5, ttft_s=0.05, tpot_s=0.01, queue_s=0.001, prefill_s=0.02))


def test_the_exposition_parses_with_names_types_and_labels_as_documented():
    body, content_type = metrics.exposition()
    assert content_type.startswith("text/plain")
    RouterExport("r-doc", ROUTER_PHASES).finished(finished(device=3))
    ServiceMetrics("decode", "w-doc").on_heartbeat(m.Heartbeat("decode", "w-doc", "i", 1, 1, free_blocks=6,
                                                               total_blocks=8), 0)
    body, _ = metrics.exposition()
    types = families(body)
    expected = {
        "deepinfer_time_to_first_token_seconds": "histogram", "deepinfer_inter_token_latency_seconds": "histogram",
        "deepinfer_e2e_request_latency_seconds": "histogram", "deepinfer_prompt_tokens": "counter",
        "deepinfer_generation_tokens": "counter", "deepinfer_request_success": "counter",
        "deepinfer_request_errors": "counter", "deepinfer_prefix_cache_queries": "counter",
        "deepinfer_prefix_cache_hits": "counter", "deepinfer_num_requests_running": "gauge",
        "deepinfer_num_requests_waiting": "gauge", "deepinfer_kv_blocks_used": "gauge",
        "deepinfer_kv_blocks_free": "gauge", "deepinfer_kv_cache_usage_perc": "gauge",
    }
    for name, kind in expected.items():
        assert types.get(name) == kind, name
    labels = {name: set(labels) for name, labels in samples(body)}
    for (name, label_set) in samples(body):
        if name.startswith("deepinfer_") and not name.startswith("deepinfer_http"):
            assert WHO <= {k for k, _ in label_set}, name
    assert "deepinfer_time_to_first_token_seconds_bucket" in labels
    assert value(body, "deepinfer_prefix_cache_hits_total", service="router", instance="r-doc", tier="device") == 3
    assert value(body, "deepinfer_request_success_total", service="router", instance="r-doc",
                 finished_reason="stop") == 1
    assert value(body, "deepinfer_kv_blocks_used", service="decode", instance="w-doc") == 2
    assert value(body, "deepinfer_kv_cache_usage_perc", service="decode", instance="w-doc") == 0.25
    assert not any(name.endswith("_created") for name, _ in samples(body))


def test_every_metric_is_named_deepinfer_and_only_http_lacks_the_process_labels():
    for metric in vars(d).values():
        if isinstance(metric, (d.Counter, d.Gauge, d.Histogram)):
            assert metric._name.startswith("deepinfer_")
            assert "request_id" not in metric._labelnames
            if not metric._name.startswith("deepinfer_http"):
                assert metric._labelnames[:2] == ("service", "instance"), metric._name


def test_a_finished_request_moves_the_histograms_and_counters():
    export = RouterExport("r-move", ROUTER_PHASES)
    before, _ = metrics.exposition()
    export.to_client(finished(prompt=10, completion=4, device=2, host=3))
    export.to_client(finished(prompt=6, completion=2, reason="length"))
    export.to_client(m.ErrorReply("r", "timeout", "late"))
    export.to_client(m.StreamDelta("r", "x", [1]))  # ignored
    after, _ = metrics.exposition()
    who = {"service": "router", "instance": "r-move"}

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **who, **labels) - value(before, name, **who, **labels)

    assert grew("deepinfer_time_to_first_token_seconds_count") == 2
    assert grew("deepinfer_time_to_first_token_seconds_bucket", le="0.06") == 2
    assert grew("deepinfer_time_to_first_token_seconds_bucket", le="0.04") == 0
    assert grew("deepinfer_e2e_request_latency_seconds_sum") == pytest.approx(1.0)
    assert grew("deepinfer_inter_token_latency_seconds_count") == 2
    assert grew("deepinfer_prompt_tokens_total") == 16 and grew("deepinfer_generation_tokens_total") == 6
    assert grew("deepinfer_prefix_cache_queries_total") == 16
    assert grew("deepinfer_prefix_cache_hits_total", tier="device") == 2
    assert grew("deepinfer_prefix_cache_hits_total", tier="host") == 3
    assert grew("deepinfer_request_success_total", finished_reason="length") == 1
    assert grew("deepinfer_request_errors_total", code="timeout") == 1


def test_router_state_and_expert_load():
    export = RouterExport("r-state", ROUTER_PHASES)

    class Member:
        def __init__(self, role: str, alive: bool) -> None:
            self.role, self.alive = role, alive

    members = [Member("worker", True), Member("worker", False), Member("tokenizer", True), Member("mystery", True)]
    export.state({"parked": 1, "decoding": 2}, 1, {"admitted": 5, "moves": 1}, members)
    export.state({"decoding": 1, "prefilling": 1}, 0, {"admitted": 9, "moves": 1}, [Member("worker", True)])
    load = m.ExpertLoad("g0", placement_version=4, period_s=5.0, rank_tokens=[10, 30],
                        rank_expert_tokens=[[1, 3], [2, 2]])
    export.expert_load("g0", load, 1.25)
    export.expert_load("g0", load, 1.5)
    body, _ = metrics.exposition()
    who = {"service": "router", "instance": "r-state"}
    assert value(body, "deepinfer_router_requests_inflight", **who, phase="decoding") == 1
    assert value(body, "deepinfer_router_requests_inflight", **who, phase="prefilling") == 1
    assert value(body, "deepinfer_router_requests_inflight", **who, phase="parked") == 0
    assert value(body, "deepinfer_router_events_total", **who, event="admitted") == 9
    assert value(body, "deepinfer_router_events_total", **who, event="moves") == 1
    assert value(body, "deepinfer_router_live_instances", **who, role="worker") == 1
    assert value(body, "deepinfer_router_live_instances", **who, role="tokenizer") == 0
    assert value(body, "deepinfer_expert_placement_version", **who, group="g0") == 4
    assert value(body, "deepinfer_expert_load_max_over_mean", **who, group="g0") == 1.5
    assert value(body, "deepinfer_expert_rank_tokens_total", **who, group="g0", rank="1") == 60
    assert value(body, "deepinfer_expert_rank_assignments_total", **who, group="g0", rank="0") == 6


def test_worker_steps_transfers_and_cache_tiers():
    w = WorkerExport("prefill", "w-steps")
    w.steps.step(0.02, 3, 40)
    w.steps.flush()
    w.handoff_sent("a", 4096)
    w.handoff_acked("a")
    w.handoff_acked("never-sent")  # no observation
    w.handoff_received(100)
    w.totals(preemptions=2, fetched_bytes=0, stored_bytes=512)
    w.totals(preemptions=3, fetched_bytes=0, stored_bytes=512, swapped_preemptions=2, swap_out_bytes=64,
             swap_in_bytes=32)
    c = CacheExport("kvcache", "c-tiers")
    c.stats({"host_blocks": 4, "host_bytes": 400, "host_capacity_bytes": 1000, "host_evictions": 2, "host_hits": 5,
             "host_misses": 1, "disk_blocks": 9, "disk_evictions": 1, "pending_writes": 3})
    c.stats({"host_blocks": 2, "host_bytes": 200, "host_capacity_bytes": 1000, "host_evictions": 7, "host_hits": 5,
             "host_misses": 1, "disk_blocks": 9, "disk_evictions": 1, "pending_writes": 0,
             "disk_write_errors_no_space": 2, "disk_write_errors_io": 1})
    body, _ = metrics.exposition()
    w_who = {"service": "prefill", "instance": "w-steps"}
    c_who = {"service": "kvcache", "instance": "c-tiers"}
    assert value(body, "deepinfer_worker_step_duration_seconds_count", **w_who) == 1
    assert value(body, "deepinfer_worker_step_batch_size_sum", **w_who) == 3
    assert value(body, "deepinfer_worker_step_tokens_sum", **w_who) == 40
    assert value(body, "deepinfer_kv_transfer_bytes_total", **w_who, path="handoff_send") == 4096
    assert value(body, "deepinfer_kv_transfer_bytes_total", **w_who, path="handoff_recv") == 100
    assert value(body, "deepinfer_kv_transfer_bytes_total", **w_who, path="cache_store") == 512
    assert value(body, "deepinfer_kv_transfer_seconds_count", **w_who, path="handoff_send") == 1
    assert value(body, "deepinfer_num_preemptions_total", **w_who) == 3
    assert value(body, "deepinfer_num_swapped_preemptions_total", **w_who) == 2
    assert value(body, "deepinfer_kv_transfer_bytes_total", **w_who, path="swap_out") == 64
    assert value(body, "deepinfer_kv_transfer_bytes_total", **w_who, path="swap_in") == 32
    assert value(body, "deepinfer_cache_tier_blocks", **c_who, tier="host") == 2
    assert value(body, "deepinfer_cache_tier_blocks", **c_who, tier="disk") == 9
    assert value(body, "deepinfer_cache_evictions_total", **c_who, tier="host") == 7
    assert value(body, "deepinfer_cache_lookups_total", **c_who, tier="host", result="hit") == 5
    assert value(body, "deepinfer_cache_pending_writes", **c_who) == 0
    assert value(body, "deepinfer_cache_disk_write_errors_total", **c_who, cause="no_space") == 2
    assert value(body, "deepinfer_cache_disk_write_errors_total", **c_who, cause="io") == 1


def test_totals_feed_counts_growth_and_restarts_from_zero():
    child = bind(d.SERVICE_PROGRESS, "tokenizer", "t-feed")
    feed = TotalsFeed(lambda key: child if key == "progress" else None)
    feed.update({"progress": 5, "ignored": 100})
    feed.update({"progress": 8})
    feed.update({"progress": 2})  # the owner restarted: 2 more
    body, _ = metrics.exposition()
    assert value(body, "deepinfer_service_progress_total", service="tokenizer", instance="t-feed") == 10


def test_http_requests_and_the_standalone_exporter():
    metrics.record_http_request("/v1/completions", 200, 0.25)
    metrics.record_http_request("/v1/completions", 200)
    exporter = metrics.serve("127.0.0.1", 0)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=10).read()
    finally:
        exporter.close()
    assert value(body, "deepinfer_http_requests_total", endpoint="/v1/completions", status="200") >= 2
    assert value(body, "deepinfer_http_request_duration_seconds_count", endpoint="/v1/completions") >= 1


def test_prepare_dir_creates_or_empties(tmp_path):
    target = tmp_path / "prom"
    metrics.prepare_dir(target)
    assert target.is_dir()
    (target / "counter_1.db").write_bytes(b"old")
    (target / "keep.txt").write_text("not ours")
    metrics.prepare_dir(target)
    assert sorted(p.name for p in target.iterdir()) == ["keep.txt"]


CHILD = textwrap.dedent("""
    import json, os, sys
    from deepinfer.metrics import definitions as d
    from deepinfer.metrics.bind import bind
    n = int(sys.argv[1])
    bind(d.GENERATION_TOKENS, "router", "r0").inc(n)
    bind(d.TIME_TO_FIRST_TOKEN, "router", "r0").observe(0.05 * n)
    bind(d.NUM_REQUESTS_RUNNING, "decode", "w").set(n)
    bind(d.EXPERT_PLACEMENT_VERSION, "router", "r0", "g").set(n)
    bind(d.SERVICE_UP, "decode", f"w{n}").set(1)
    print(os.getpid(), flush=True)
""")

PARENT = textwrap.dedent("""
    import json, os, subprocess, sys
    import prometheus_client  # before the variable: deepinfer.metrics must still write to the directory
    from pathlib import Path
    directory = Path(sys.argv[1])
    from deepinfer import metrics
    metrics.prepare_dir(directory)
    os.environ[metrics.MULTIPROC_ENV] = str(directory)
    pids = [int(subprocess.run([sys.executable, "-c", sys.argv[2], str(n)], check=True, capture_output=True,
                               text=True).stdout) for n in (1, 2)]
    from deepinfer.metrics import definitions as d
    from deepinfer.metrics.bind import bind
    bind(d.GENERATION_TOKENS, "router", "r0").inc(100)  # this process too
    out = {"both": metrics.exposition()[0].decode()}
    metrics.process_exited(pids[0])
    out["after_exit"] = metrics.exposition()[0].decode()
    print(json.dumps(out))
""")


def test_processes_sharing_a_directory_add_up_and_an_exited_ones_gauges_go(tmp_path):
    """Run in a subprocess: the test process's own prometheus_client mode must not matter."""
    env = {k: v for k, v in os.environ.items() if k != metrics.MULTIPROC_ENV}
    done = subprocess.run([sys.executable, "-c", PARENT, str(tmp_path / "prom"), CHILD], check=True,
                          capture_output=True, text=True, env=env, cwd=Path(__file__).parents[2], timeout=120)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    both, after = out["both"].encode(), out["after_exit"].encode()
    assert value(both, "deepinfer_generation_tokens_total", service="router", instance="r0") == 103
    assert value(both, "deepinfer_time_to_first_token_seconds_count", service="router", instance="r0") == 2
    assert value(both, "deepinfer_time_to_first_token_seconds_sum", service="router",
                 instance="r0") == pytest.approx(0.15)
    assert value(both, "deepinfer_time_to_first_token_seconds_bucket", service="router", instance="r0",
                 le="0.06") == 1
    assert value(both, "deepinfer_num_requests_running", service="decode", instance="w") == 3  # livesum
    assert value(both, "deepinfer_expert_placement_version", service="router", instance="r0", group="g") == 2
    assert value(both, "deepinfer_service_up", service="decode", instance="w1") == 1
    # The first child exited: its live gauges are gone, its counters and histograms stay.
    assert value(after, "deepinfer_num_requests_running", service="decode", instance="w") == 2
    assert ("deepinfer_service_up", frozenset({("service", "decode"), ("instance", "w1")})) not in samples(after)
    assert value(after, "deepinfer_service_up", service="decode", instance="w2") == 1
    assert value(after, "deepinfer_generation_tokens_total", service="router", instance="r0") == 103
