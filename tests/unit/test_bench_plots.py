"""bench/plots.py: each kind of result draws its PNGs beside the JSON; the kind is recognised from the keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from bench import plots  # noqa: E402

ENGINE = {"env": {"threads": 2}, "caps": {"linear_tok_s": {"1": 60.0, "32": 900.0}},
          "concurrency": {"1": {"engine": {"aggregate_tok_s": 30.0, "decode_only_tok_s": 35.0},
                                "transformers": {"aggregate_tok_s": 20.0}},
                          "32": {"engine": {"aggregate_tok_s": 300.0, "decode_only_tok_s": 350.0},
                                 "transformers": {}}}}
MESH = {"workload": {"requests": 32, "new_tokens": 64}, "kv_transfer": {},
        "throughput": {"engine": {"aggregate_tok_s": 250.0, "threads": "2"},
                       "co-located mesh (processes)": {"aggregate_tok_s": 235.0, "threads": "2"}},
        "ttft": [{"rate_req_s": r, "client_ttft_p50_s": 0.2 * r, "client_ttft_p99_s": 0.5 * r,
                  "router_ttft_p50_s": 0.1 * r, "router_ttft_p99_s": 0.4 * r} for r in (0.5, 1.0)]}
REPLAY = {"workload": {"requests": 4, "reusable_kv_blocks": 0.5}, "arms": {},
          "rows": {"cache on": [{"ttft_s": 0.1, "cached_by_tier": {"device": 32}},
                                {"ttft_s": 0.2, "cached_by_tier": {"host": 16, "disk": 48}},
                                {"ttft_s": 2.0, "cached_by_tier": {}}, {"error": "x", "ttft_s": None}],
                   "cache off": [{"ttft_s": 1.5, "cached_by_tier": {}}, {"ttft_s": 2.5, "cached_by_tier": {}}]}}
PREFIX = {"prompt_tokens": 2048, "cached_tokens": 2032, "cached_blocks": 127,
          "rounds": [{"miss": {"ttft_s": 3.8}, "device": {"ttft_s": 0.09}, "dram": {"ttft_s": 0.1},
                      "nvme": {"ttft_s": 0.2}}] * 3}
SOAK = {"kills": [[15.0, "decode-1"]], "samples": [{"t": 10.0 * i, "tokens": 900 * i} for i in range(4)]}
EPLB = {"bin_s": 1.0, "tokens_per_bin": [14, 15, 13, 12, 15], "balancer_start_s": 2.0, "moves": [[2.5, 3.0, 1]],
        "steady_tok_s": 14.0}

ARM_POINT = {"goodput_req_s": 0.4, "hit_of_reusable": 0.97, "ttft_p50_s": 0.3, "ttft_p99_s": 4.0}
SWEEP = {"workload": {"requests": 40, "reusable_kv_blocks": 0.6}, "slo_s": 5.0, "capacity_req_s": 0.5,
         "rows": {}, "points": {"0.5": {"full": ARM_POINT, "cache off": {**ARM_POINT, "hit_of_reusable": None}},
                                "2": {"full": {**ARM_POINT, "ttft_p99_s": None}}}}

CASES = {"engine": (ENGINE, 1), "mesh": (MESH, 2), "replay": (REPLAY, 2), "prefix": (PREFIX, 1), "soak": (SOAK, 1),
         "eplb_mesh": (EPLB, 1), "sweep": (SWEEP, 1)}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_each_kind_draws_its_figures(tmp_path: Path, kind: str) -> None:
    report, n = CASES[kind]
    out = tmp_path / f"{kind}.json"
    out.write_text(json.dumps(report))
    assert plots.guess_kind(report) == kind
    paths = plots.write(kind, report, out)
    assert len(paths) == n
    assert all(p.parent == tmp_path and p.name.startswith(f"{kind}-") for p in paths)
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in paths)
    assert plots.main([str(out)]) == 0  # redrawn from the saved JSON


def test_tier_of_a_request_is_where_most_of_its_prefix_came_from() -> None:
    assert plots.main_tier({"cached_by_tier": {"host": 16, "disk": 48}}) == "disk"
    assert plots.main_tier({"cached_by_tier": {"device": 0}}) == "miss"
    assert plots.main_tier({}) == "miss"


def test_a_failing_figure_does_not_raise(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert plots.write("soak", {"samples": []}, tmp_path / "soak.json") == []
    assert plots.write("engine", {"nonsense": 1}, tmp_path / "engine.json") == []
    assert "engine figures failed" in capsys.readouterr().err
