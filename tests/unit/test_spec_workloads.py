"""bench/spec_workloads.py: the speculative-decoding benchmark's workloads are deterministic, well-formed and sized
as the bench expects. No model, no tokenizer, no torch."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.spec_workloads import (
    AGENT_TEMPLATES,
    CODE_FILES,
    COUNTS,
    DATA,
    DOCUMENTS,
    QUESTIONS,
    QUICK_COUNTS,
    WORKLOADS,
    WorkItem,
    build,
    code_source,
    document,
    max_tokens_for,
    requests_for,
)

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOT_SHA256 = {
    "services__tokenizer.py.txt": "65c7ff1ec362e3e6b40c5be0fd91fc2751c7462af41bf20990a218dd6c7af0d2",
    "protocol__framing.py.txt": "145a39f91b3dddef9794351d6b602683a4e12b55d55fb655f21868d96c45b5b0",
    "launch__systemd.py.txt": "58fdd098bdac74f11956ea5c2d3c1421659bf7aeecb953a505c4e0ab8c03f68e",
    "engine__identity.py.txt": "5251a81b3166ce5423d7dda85c7e5318362a3827fa4e57fefeee13bc671cd578",
}
# Every (workload, concurrency) the bench runs by default or in --quick, plus one it derives.
SIZES = [(w, c, quick) for w in WORKLOADS for c, quick in [(1, False), (8, False), (32, False), (1, True), (4, True),
                                                           (16, False)]]


@pytest.mark.parametrize("workload", WORKLOADS)
def test_built_twice_is_identical(workload: str) -> None:
    a, b = build(workload, 40), build(workload, 40)
    assert a == b
    assert [x.chat() for x in a] == [x.chat() for x in b]
    # a shorter build is a prefix of a longer one: runs at different concurrencies issue the same leading prompts
    assert build(workload, 7) == a[:7]


@pytest.mark.parametrize(("workload", "concurrency", "quick"), SIZES)
def test_counts_per_concurrency(workload: str, concurrency: int, quick: bool) -> None:
    n = requests_for(workload, concurrency, quick)
    table = (QUICK_COUNTS if quick else COUNTS)[workload]
    if concurrency in table:
        assert n == table[concurrency]
    assert n >= concurrency  # a closed loop at c needs at least c requests to ever have c in flight
    items = build(workload, n)
    assert len(items) == n
    assert [x.index for x in items] == list(range(n))


def test_default_counts_keep_every_concurrency_busy() -> None:
    for w in WORKLOADS:
        assert 3 <= COUNTS[w][1] <= 16
        assert 8 <= COUNTS[w][8] <= 32
        assert 32 <= COUNTS[w][32] <= 64
        assert 96 <= max_tokens_for(w) <= 160
        assert max_tokens_for(w, quick=True) < max_tokens_for(w)
    # An agent loop repeats its templates: most agentic requests have an earlier one of the same template.
    assert COUNTS["agentic"][1] >= 4 * len(AGENT_TEMPLATES) and COUNTS["agentic"][32] >= 64


@pytest.mark.parametrize("workload", WORKLOADS)
def test_items_are_well_formed(workload: str) -> None:
    items = build(workload, 32)
    for it in items:
        assert isinstance(it, WorkItem) and it.workload == workload and it.key
        assert it.messages and it.messages[-1][0] == "user"
        assert all(role in ("system", "user") and content.strip() for role, content in it.messages)
        slots = ("{src}", "{kind}", "{old}", "{new}", "{audience}", "{title}", "{body}", "{first}", "{cid}", "{order}")
        assert not [x for _, c in it.messages for x in slots if x in c]  # no unfilled slot of a builder
    # 32 different prompts: no run at concurrency 32 repeats one exactly
    assert len({it.messages for it in items}) == 32
    assert len({it.key for it in items}) == 32


def test_code_prompts_hold_the_source_file() -> None:
    items = build("code", 32)
    assert {it.meta["snapshot"] for it in items[:4]} == {f"bench/data/spec/code/{s}" for s in CODE_FILES}
    for it in items:
        src = (ROOT / it.meta["snapshot"]).read_text(encoding="utf-8")
        user = it.messages[-1][1]
        assert src in user
        assert it.meta["file"] in user
        old, new = it.meta["old"], it.meta["new"]
        assert re.search(rf"\bdef {re.escape(old)}\(", src), (it.key, "the renamed function must exist")
        assert not re.search(rf"\b{re.escape(new)}\b", src), (it.key, "the new name must be new")
        assert f"`{old}` renamed to `{new}`" in user
        assert len(user) < 4200  # ~1,200 SmolLM2 tokens at most, chat template included (measured: 1,212)


def test_code_snapshots_are_unchanged() -> None:
    assert set(SNAPSHOT_SHA256) == set(CODE_FILES)
    for name, digest in SNAPSHOT_SHA256.items():
        assert hashlib.sha256((DATA / "code" / name).read_bytes()).hexdigest() == digest, name
        assert code_source(name).count("\n") <= 200


def test_summary_prompts_hold_a_whole_document() -> None:
    items = build("summary", 32)
    assert {it.meta["document"].rsplit("/", 1)[1] for it in items[:len(DOCUMENTS)]} == set(DOCUMENTS)
    for it in items:
        title, body = document(it.meta["document"].rsplit("/", 1)[1])
        user = it.messages[-1][1]
        assert title in user and body in user
        assert "word for word" in user and f"Quote its {it.meta['quotes']} " in user
        assert 150 <= len(body.split()) <= 400


def test_chat_questions_are_all_different() -> None:
    items = build("chat", len(QUESTIONS))
    assert len({it.messages[-1][1] for it in items}) == len(QUESTIONS) >= 32


def test_agentic_cycles_templates_with_small_variations() -> None:
    items = build("agentic", 32)
    k = len(AGENT_TEMPLATES)
    assert [it.meta["template"] for it in items] == [AGENT_TEMPLATES[i % k] for i in range(32)]
    assert [it.meta["variation"] for it in items] == [i // k for i in range(32)]
    for t in AGENT_TEMPLATES:
        same = [it for it in items if it.meta["template"] == t]
        assert len({it.messages[0] for it in same}) == 1, "a template keeps its system prompt"
        users = [it.messages[-1][1] for it in same]
        assert len(set(users)) == len(users), "each repeat differs (ids, names)"
    # the concurrency-1 run repeats every template, so a later request can learn from an earlier one
    assert requests_for("agentic", 1) >= 2 * k


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        build("nope", 1)
    with pytest.raises(ValueError):
        requests_for("code", 0)


def test_no_model_or_torch_needed() -> None:
    code = ("import sys; import bench.spec_workloads as w; [w.build(x, 32) for x in w.WORKLOADS]; "
            "bad = [m for m in ('torch', 'deepinfer.engine') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
