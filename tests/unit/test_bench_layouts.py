"""bench_layouts' pure parts: medians over repeats, the ratio table and the issue's check of the default layout."""

from __future__ import annotations

from bench.bench_layouts import LLAMA, medians, parse_args, report


def run(tok_s: float, p50_ms: float, p99_ms: float, failed: int = 0) -> dict:
    return {"output_throughput": tok_s, "ttft_ms": {"p50": p50_ms, "p99": p99_ms}, "failed": failed,
            "errors": ["HTTP 503"] if failed else []}


def test_each_figure_is_its_own_median_over_the_repeats():
    m = medians([run(300, 400, 900), run(100, 300, 500, failed=1), run(200, 200, 700)])
    assert (m["output_tok_s"], m["ttft_p50_s"], m["ttft_p99_s"]) == (200, 0.3, 0.7)
    assert m["failed"] == 1 and m["errors"] == ["HTTP 503"] and len(m["runs"]) == 3


def test_the_report_gives_ratios_and_checks_the_default():
    def layout(tok_s: float, p50_s: float) -> dict:
        return {"streams": {8: {"output_tok_s": tok_s, "ttft_p50_s": p50_s, "ttft_p99_s": 2 * p50_s, "failed": 0}}}

    results = {"default": layout(300, 0.35), "colocated": layout(310, 0.33), "split": layout(200, 0.6),
               LLAMA: "absent: llama-server is not on PATH"}
    lines = report(results, [8])
    assert lines[0] == "8 streams (ratios: tok/s over colocated's, TTFT over the lowest)"
    assert "split:   200.0 out tok/s (0.65x)  TTFT p50   0.60 s (1.82x)" in lines[3]
    assert lines[4] == "  check: default/colocated = 0.97x tok/s (>= 0.95), TTFT p50 1.06x (<= 1.1): ok"
    assert lines[-1] == "llama-server: absent: llama-server is not on PATH"
    results["default"] = layout(250, 0.35)
    assert report(results, [8])[4].endswith("NOT MET")


def test_the_defaults_are_the_issue_s_load():
    args = parse_args([])
    assert args.streams == [8, 32, 64] and args.repeats == 3 and args.max_tokens == 128
    assert args.layouts == ["default", "colocated", "split"]
    quick = parse_args(["--streams", "8", "--repeats", "1", "--layouts", "default,split"])
    assert (quick.streams, quick.repeats, quick.layouts) == ([8], 1, ["default", "split"])
