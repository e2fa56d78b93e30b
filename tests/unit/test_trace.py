"""bench/trace.py: loading and validating a Mooncake-format trace, scaling it to tokens, its reusable fraction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.trace import (
    TRACE_BLOCK_TOKENS,
    BlockTokens,
    ScaleConfig,
    TraceError,
    TraceRequest,
    load_trace,
    parse_line,
    reusable_fraction,
    reusable_tokens,
    sample_groups,
    scale_trace,
    scaled_input_length,
    scaled_items,
    scaled_output_length,
    trace_items,
)


def req(ts: float, n_in: int, n_out: int, ids: list[int]) -> TraceRequest:
    return TraceRequest(ts, n_in, n_out, tuple(ids))


def write(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def line(ts: float = 0, n_in: int = 1000, n_out: int = 10, ids: list[int] | None = None) -> str:
    return json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out,
                       "hash_ids": [0, 1] if ids is None else ids})


# -- loading -------------------------------------------------------------------------------------------------


def test_load_reads_every_request_in_order(tmp_path: Path) -> None:
    p = write(tmp_path, [line(0, 1000, 5, [0, 1]), "", line(40, 512, 3, [0]), line(40, 1025, 0, [0, 1, 2])])
    t = load_trace(p)
    assert t == [req(0, 1000, 5, [0, 1]), req(40, 512, 3, [0]), req(40, 1025, 0, [0, 1, 2])]
    assert load_trace(p, limit=2) == t[:2]


@pytest.mark.parametrize("text, why", [
    ("not json", "not JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"timestamp": 0, "input_length": 5, "hash_ids": [0]}', "missing output_length"),
    (line(-1), "'timestamp'"),
    ('{"timestamp": "0", "input_length": 5, "output_length": 1, "hash_ids": [0]}', "'timestamp'"),
    (line(0, 0, 1, []), "'input_length' must be >= 1"),
    (line(0, 5.5, 1, [0]), "'input_length' must be an integer"),
    (line(0, 5, -1, [0]), "'output_length' must be >= 0"),
    ('{"timestamp": 0, "input_length": true, "output_length": 1, "hash_ids": [0]}', "must be an integer"),
    (line(0, 5, 1, [0, -1]), "non-negative integers"),
    (line(0, 5, 1, ["a"]), "non-negative integers"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": 3}', "non-negative integers"),
    (line(0, 1000, 1, [0]), "needs 2 hash_ids"),
    (line(0, 512, 1, [0, 1]), "needs 1 hash_ids"),
])
def test_malformed_lines_are_refused_with_a_reason(tmp_path: Path, text: str, why: str) -> None:
    with pytest.raises(TraceError, match=why):
        parse_line(text)
    p = write(tmp_path, [line(), text])
    with pytest.raises(TraceError, match=rf"trace.jsonl:2: .*{why}"):
        load_trace(p)


def test_timestamps_must_not_go_back(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="trace.jsonl:2: .*arrival order"):
        load_trace(write(tmp_path, [line(50), line(49)]))


def test_the_shipped_trace_loads() -> None:
    path = Path(__file__).parents[2] / "bench" / "data" / "mooncake-fast25" / "synthetic_trace.jsonl"
    t = load_trace(path, limit=50)
    assert len(t) == 50 and t[0].timestamp_ms == 0


# -- scaling -------------------------------------------------------------------------------------------------


def test_lengths_scale_by_b_over_512() -> None:
    assert scaled_input_length(512, 16) == 16
    assert scaled_input_length(513, 16) == 17  # rounded up: the partial block keeps one token
    assert scaled_input_length(1000, 16) == 32  # 31.25 → 32
    assert scaled_input_length(1, 32) == 1
    assert scaled_output_length(149, 16) == 5  # 4.66
    assert scaled_output_length(48, 16) == 2  # 1.5, halves go up
    assert scaled_output_length(0, 16) == 1 and scaled_output_length(3, 16) == 1  # at least one token
    assert scaled_output_length(893, 16, cap=8) == 8


def test_scaling_is_deterministic_and_seeded() -> None:
    trace = [req(0, 1500, 20, [7, 8, 9]), req(100, 700, 3, [7, 4])]
    cfg = ScaleConfig(block_tokens=16, low=100, vocab=200, seed=3)
    a, b = scale_trace(trace, cfg), scale_trace(list(trace), ScaleConfig(block_tokens=16, low=100, vocab=200, seed=3))
    assert a == b
    other = scale_trace(trace, ScaleConfig(block_tokens=16, low=100, vocab=200, seed=4))
    assert other.requests[0].prompt != a.requests[0].prompt
    assert all(100 <= t < 200 for r in a.requests for t in r.prompt)


def test_shared_leading_ids_share_exactly_k_times_b_tokens() -> None:
    b = 8
    trace = [req(0, 5 * 512, 1, [1, 2, 3, 4, 5]), req(0, 4 * 512, 1, [1, 2, 3, 9]), req(0, 3 * 512, 1, [6, 2, 3])]
    s = scale_trace(trace, ScaleConfig(block_tokens=b, low=10, vocab=50_000))
    p0, p1, p2 = (r.prompt for r in s.requests)
    common = next(i for i, (x, y) in enumerate(zip(p0, p1)) if x != y)
    assert common == 3 * b  # ids 1, 2, 3 shared; 4 vs 9 differ from their first token (with this vocab)
    assert p0[b:3 * b] == p2[b:3 * b]  # same ids at the same positions give the same tokens anyway
    assert p0[:b] != p2[:b]


def test_last_block_is_cut_to_the_scaled_remainder() -> None:
    b = 16
    s = scale_trace([req(0, 2 * 512 + 100, 1, [1, 2, 3]), req(0, 3 * 512, 1, [1, 2, 3])],
                    ScaleConfig(block_tokens=b))
    short, full = s.requests
    assert len(short.prompt) == 2 * b + 4  # ceil(100 * 16 / 512) = 4
    assert len(full.prompt) == 3 * b
    assert short.prompt == full.prompt[: len(short.prompt)]  # the partial block is the start of the full run


def test_block_runs_are_prefixes_of_longer_runs() -> None:
    assert BlockTokens(32, 0, 1000).run(5)[:16] == BlockTokens(16, 0, 1000).run(5)


def test_time_compression_and_output_cap() -> None:
    trace = [req(1000, 512, 512, [1]), req(3000, 512, 16, [2])]
    s = scale_trace(trace, ScaleConfig(block_tokens=16, time_scale=4, max_output_tokens=10))
    assert [r.arrival_s for r in s.requests] == [0.0, 0.5]  # from the first request; 2 s / 4
    assert [r.max_tokens for r in s.requests] == [10, 1]


def test_long_prompts_are_skipped_or_truncated() -> None:
    trace = [req(0, 512, 1, [1]), req(1, 4 * 512, 1, [1, 2, 3, 4]), req(2, 1024, 1, [1, 2])]
    skip = scale_trace(trace, ScaleConfig(block_tokens=16, max_input_tokens=40))
    assert [r.index for r in skip.requests] == [0, 2] and skip.skipped == [1] and skip.truncated == []
    cut = scale_trace(trace, ScaleConfig(block_tokens=16, max_input_tokens=40, long_prompts="truncate"))
    assert cut.truncated == [1] and cut.skipped == []
    r = cut.requests[1]
    assert len(r.prompt) == 40 and r.hash_ids == (1, 2, 3) and r.truncated
    assert r.prompt[:32] == cut.requests[2].prompt


@pytest.mark.parametrize("cfg, why", [
    (ScaleConfig(block_tokens=0), "block_tokens"),
    (ScaleConfig(low=10, vocab=10), "low < vocab"),
    (ScaleConfig(time_scale=0), "time_scale"),
    (ScaleConfig(long_prompts="drop"), "long_prompts"),
])
def test_bad_scale_settings_are_refused(cfg: ScaleConfig, why: str) -> None:
    with pytest.raises(TraceError, match=why):
        scale_trace([req(0, 512, 1, [1])], cfg)


# -- sampling and reuse ---------------------------------------------------------------------------------------


def test_reusable_fraction_on_a_hand_made_trace() -> None:
    trace = [
        req(0, 2 * 512, 1, [1, 2]),  # new: 0 of 1024
        req(1, 3 * 512, 1, [1, 2, 3]),  # 1, 2 seen: 1024 of 1536
        req(2, 300, 1, [4]),  # new: 0 of 300
        req(3, 2 * 512 + 100, 1, [1, 2, 3]),  # 1, 2, 3 seen, the last only partly in this one: 1124 of 1124
        req(4, 2 * 512, 1, [5, 2]),  # 2 seen, but not after 5: 0 of 1024
        req(5, 512 + 200, 1, [4, 6]),  # 4 seen with only 300 tokens: 300 of 712
    ]
    reusable, total = reusable_tokens(trace_items(trace), TRACE_BLOCK_TOKENS)
    assert (reusable, total) == (1024 + 1124 + 300, 1024 + 1536 + 300 + 1124 + 1024 + 712)
    assert reusable_fraction(trace_items(trace), TRACE_BLOCK_TOKENS) == pytest.approx(2448 / 5720)


def test_reusable_fraction_in_scaled_tokens_and_kv_blocks() -> None:
    trace = [req(0, 2 * 512, 1, [1, 2]), req(1, 3 * 512, 1, [1, 2, 3]), req(2, 2 * 512, 1, [1, 2])]
    s = scale_trace(trace, ScaleConfig(block_tokens=16))
    assert reusable_tokens(scaled_items(s.requests), 16) == (32 + 32, 32 + 48 + 32)
    # In KV blocks the whole-prompt repeat loses its last block: the last token is always computed.
    assert reusable_tokens(scaled_items(s.requests), 16, kv_block_size=16) == (32 + 16, 112)
    assert reusable_fraction([], 16) == 0.0


def test_group_sampling_keeps_whole_groups() -> None:
    trace = [req(i, 512 * 2, 1, [i % 7, 100 + i]) for i in range(200)]
    picked = sample_groups(trace, 0.5, seed=1)
    roots = {r.hash_ids[0] for r in picked}
    assert 0 < len(roots) < 7
    assert picked == [r for r in trace if r.hash_ids[0] in roots]  # every request of a kept group, in order
    assert picked == sample_groups(trace, 0.5, seed=1)
    assert sample_groups(trace, 1.0) == trace
    with pytest.raises(TraceError):
        sample_groups(trace, 0.0)
