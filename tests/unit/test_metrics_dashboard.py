"""The Grafana dashboard is valid JSON with a Prometheus datasource variable, and every metric its queries
name is one deepinfer.metrics defines (a renamed metric must not leave an empty panel behind)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from deepinfer.metrics import definitions as d

ROOT = Path(__file__).parents[2]
SUFFIXES = ("_bucket", "_count", "_sum", "_total")


def defined() -> set[str]:
    return {m._name for m in vars(d).values() if isinstance(m, (d.Counter, d.Gauge, d.Histogram))}


def base_name(series: str, names: set[str]) -> str:
    if series in names:
        return series
    for suffix in SUFFIXES:
        if series.endswith(suffix) and series[: -len(suffix)] in names:
            return series[: -len(suffix)]
    return series


def test_the_dashboard_queries_only_defined_metrics():
    dash = json.loads((ROOT / "deploy/grafana/deepinfer.json").read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    names = defined()
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) > 20
    used = {base_name(s, names) for e in exprs for s in re.findall(r"deepinfer_[a-z0-9_]+", e)}
    assert used - names == set()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}"


def test_the_example_scrape_config_names_metrics_endpoints():
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    jobs = config["scrape_configs"]
    assert jobs and all(j["metrics_path"] == "/metrics" and j["static_configs"][0]["targets"] for j in jobs)
