"""bench/serving_core.py: arrivals, workloads, the SSE parser and the statistics of bench_serving."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.serving_core import (
    RequestRecord,
    Slo,
    SseParser,
    parse_rates,
    percentile,
    poisson_arrivals,
    run_duration,
    summarise,
    synthetic_workload,
    trace_workload,
    word_prompts,
)
from bench.trace import ScaleConfig


def test_poisson_arrivals_are_seeded_sorted_and_have_the_asked_rate() -> None:
    a = poisson_arrivals(4000, 8.0, seed=3)
    assert a == poisson_arrivals(4000, 8.0, seed=3)
    assert a != poisson_arrivals(4000, 8.0, seed=4)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    mean_gap = a[-1] / (len(a) - 1)
    assert mean_gap == pytest.approx(1 / 8.0, rel=0.1)


def test_infinite_rate_is_a_burst_and_bad_rates_are_refused() -> None:
    assert poisson_arrivals(5, math.inf) == [0.0] * 5
    with pytest.raises(ValueError):
        poisson_arrivals(5, 0.0)
    assert parse_rates("1, 2,inf") == [1.0, 2.0, math.inf]
    with pytest.raises(ValueError):
        parse_rates("1,-2")


def test_word_prompts_have_the_asked_lengths_and_a_seed_fixes_the_workload() -> None:
    words = [f"w{i}" for i in range(50)]
    prompts = word_prompts(words, 20, 3, 7, seed=1)
    assert all(3 <= len(p.split()) <= 7 for p in prompts)
    assert all(p.split()[0] in words for p in prompts)
    w1 = synthetic_workload(" ".join(words), 10, 2.0, 32, 3, 7, seed=5)
    assert w1 == synthetic_workload(" ".join(words), 10, 2.0, 32, 3, 7, seed=5)
    assert [r.index for r in w1] == list(range(10)) and all(r.max_tokens == 32 for r in w1)
    assert all(r.prompt and r.prompt_token_ids is None for r in w1)


def test_trace_workload_keeps_arrivals_and_shared_prefixes(tmp_path: Path) -> None:
    lines = [{"timestamp": 0, "input_length": 1024, "output_length": 512, "hash_ids": [1, 2]},
             {"timestamp": 500, "input_length": 1536, "output_length": 1024, "hash_ids": [1, 2, 3]},
             {"timestamp": 2000, "input_length": 512, "output_length": 512, "hash_ids": [9]}]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    w = trace_workload(path, ScaleConfig(block_tokens=8, time_scale=2.0))
    assert [r.arrival_s for r in w] == [0.0, 0.25, 1.0]
    assert [len(r.prompt_token_ids or ()) for r in w] == [16, 24, 8]
    assert w[1].prompt_token_ids[:16] == w[0].prompt_token_ids  # the two shared blocks
    assert [r.max_tokens for r in w] == [8, 16, 8]
    assert len(trace_workload(path, ScaleConfig(block_tokens=8), limit=2)) == 2


def test_sse_parser_is_independent_of_chunking() -> None:
    body = (b': comment\r\n\r\ndata: {"a": 1}\r\n\r\n'
            b'event: x\ndata: line1\ndata: line2\n\n'
            b'data:{"b":2}\r\rdata: [DONE]\n\n')
    want = ['{"a": 1}', "line1\nline2", '{"b":2}', "[DONE]"]
    whole = SseParser()
    assert [*whole.feed(body), *whole.close()] == want
    for size in (1, 2, 3, 7):
        p = SseParser()
        got = [e for i in range(0, len(body), size) for e in p.feed(body[i:i + size])]
        assert got + [*p.close()] == want, size


def test_sse_parser_keeps_an_unterminated_last_event() -> None:
    p = SseParser()
    assert list(p.feed(b"data: 1\n\ndata: 2")) == ["1"]
    assert list(p.close()) == ["2"]


def test_percentile_interpolates_like_numpy() -> None:
    xs = [1.0, 2.0, 3.0, 4.0]
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 90) == pytest.approx(3.7)
    assert math.isnan(percentile([], 50))


def rec(i: int, send: float, first: float, end: float, tokens: int, chunks: list[float] | None = None,
        error: str | None = None) -> RequestRecord:
    return RequestRecord(i, send, tokens, 10, first, end, chunks if chunks is not None else [first, end], error)


def test_record_latencies() -> None:
    r = rec(0, 1.0, 1.5, 3.5, 5, [1.5, 2.0, 3.5])
    assert r.ttft_s == 0.5 and r.e2e_s == 2.5
    assert r.tpot_s == pytest.approx(0.5)  # 2 s for the 4 tokens after the first
    assert r.itls() == [0.5, 1.5]
    assert rec(1, 0.0, 0.1, 0.1, 1).tpot_s is None


def test_summary_throughputs_and_goodput() -> None:
    records = [rec(0, 0.0, 0.1, 1.0, 10),  # ttft 100 ms, tpot 100 ms
               rec(1, 0.0, 0.5, 2.0, 16),  # ttft 500 ms, tpot 100 ms
               rec(2, 1.0, 1.2, 4.0, 8),  # ttft 200 ms, tpot 400 ms
               rec(3, 1.0, 1.0, 1.0, 0, [], error="HTTP 503")]
    duration = run_duration(records)
    assert duration == 4.0
    s = summarise(records, duration, Slo(ttft_ms=300, tpot_ms=200))
    assert s["completed"] == 3 and s["failed"] == 1 and s["errors"] == ["HTTP 503"]
    assert s["output_tokens"] == 34 and s["output_throughput"] == 34 / 4
    assert s["request_throughput"] == 3 / 4
    assert s["slo_met"] == 1 and s["goodput"] == 1 / 4  # only request 0 meets both bounds
    assert s["ttft_ms"]["p50"] == pytest.approx(200)
    assert s["ttft_ms"]["mean"] == pytest.approx(800 / 3)
    no_slo = summarise(records, duration)
    assert no_slo["slo_met"] == 3  # no bounds: every request that succeeded


def sse(events: list[object]) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


def test_http_path_measures_a_streamed_completion_and_counts_errors() -> None:
    """HttpPath against an in-memory transport (no sockets): the body it sends, TTFT/ITL/tokens it reads."""
    import asyncio

    import httpx

    from bench.bench_serving import HttpPath, drive
    from bench.serving_core import ServingRequest

    seen: list[dict[str, object]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        if body["prompt"] == "bad":
            return httpx.Response(400, json={"error": {"message": "no", "type": "invalid_request_error"}})
        chunks = [{"choices": [{"index": 0, "text": t}]} for t in ("a", "b", "")] + [
            {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}]
        return httpx.Response(200, content=sse([*chunks, b"[DONE]"]),
                              headers={"content-type": "text/event-stream"})

    async def run() -> list[RequestRecord]:
        path = HttpPath("http://gateway", "m", 4, transport=httpx.MockTransport(handler))
        path.extra = {"tpot_slo_s": 0.1}  # --admission's SLO fields go with every request
        work = [ServingRequest(0, 0.0, 5, prompt="hi"), ServingRequest(1, 0.0, 5, prompt="bad"),
                ServingRequest(2, 0.0, 5, prompt_token_ids=(7, 8))]
        try:
            return await drive(path.send, work, 2)
        finally:
            await path.close()

    records = asyncio.run(run())
    assert records[0].ok and records[0].output_tokens == 2 and records[0].prompt_tokens == 3
    assert len(records[0].chunk_times) == 2 and records[0].ttft_s >= 0
    assert not records[1].ok and records[1].error.startswith("HTTP 400")
    assert records[2].ok and seen[2]["prompt"] == [7, 8]
    assert all(b["stream"] and b["ignore_eos"] and b["stream_options"] == {"include_usage": True} for b in seen)
    assert {b["max_tokens"] for b in seen} == {5} and {b["tpot_slo_s"] for b in seen} == {0.1}


def test_serving_figures_are_written_beside_the_json(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from bench import plots

    def path_summary(tok_s: float, ttfts: list[float]) -> dict[str, object]:
        return {"output_throughput": tok_s, "ttft_ms_all": ttfts}

    scenarios = [{"label": label, "http": path_summary(100.0, [10.0, 20.0, 40.0]),
                  "zmq": path_summary(104.0, [9.0, 18.0, 35.0]), "ratio_http_zmq": {"output_throughput": 100 / 104}}
                 for label in ("32 streams", "rate 1")]
    out = tmp_path / "serving.json"
    paths = plots.write("serving", {"scenarios": scenarios}, out)
    assert [p.name for p in paths] == ["serving-ttft-cdf.png", "serving-throughput.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in paths)
    assert plots.guess_kind({"scenarios": scenarios}) == "serving"


def test_a_load_sweep_needs_the_burst_that_measures_capacity() -> None:
    from bench.bench_serving import parse_args

    assert parse_args(["--load", "0.5,1,2,4"]).load == "0.5,1,2,4"
    with pytest.raises(SystemExit):
        parse_args(["--load", "1", "--streams", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--load", "1", "--trace", "t.jsonl"])


def test_admission_sends_the_slos_with_each_request_and_needs_a_load_and_an_slo() -> None:
    from bench.bench_serving import parse_args, slo_fields
    from bench.serving_core import Slo

    assert slo_fields(Slo(2000, 150)) == {"ttft_slo_s": 2.0, "tpot_slo_s": 0.15}
    assert slo_fields(Slo(None, 150)) == {"tpot_slo_s": 0.15}
    assert parse_args(["--load", "1", "--slo-tpot-ms", "100", "--admission"]).admission
    with pytest.raises(SystemExit):
        parse_args(["--load", "1", "--admission"])  # no SLO to admit against
    with pytest.raises(SystemExit):
        parse_args(["--slo-ttft-ms", "100", "--admission"])  # no load sweep
