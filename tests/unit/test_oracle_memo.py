"""The oracle memo (tests/oracle_memo.py): off, it always asks; on, it answers a repeated question from disk and
treats any change in the question, the model's weights or the environment as a new question."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests import oracle_memo


@pytest.fixture
def memo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    before = oracle_memo.enabled()
    oracle_memo.enable(True)
    try:
        yield tmp_path / "oracle-memo"
    finally:
        oracle_memo.enable(before)


class Counting:
    def __init__(self, answer: object) -> None:
        self.answer, self.calls = answer, 0

    def __call__(self) -> object:
        self.calls += 1
        return self.answer


def test_off_it_always_asks_and_never_hashes_or_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    before = oracle_memo.enabled()
    oracle_memo.enable(False)
    try:
        ask = Counting([1, 2])

        def key() -> str:
            raise AssertionError("the key is computed only when the memo is on")

        assert oracle_memo.remember("greedy", key, [[5], 2], ask) == [1, 2]
        assert oracle_memo.remember("greedy", key, [[5], 2], ask) == [1, 2]
    finally:
        oracle_memo.enable(before)
    assert ask.calls == 2 and not (tmp_path / "oracle-memo").exists()


def test_on_a_repeated_question_is_answered_from_disk(memo: Path) -> None:
    ask = Counting({"ids": [3, 4]})
    assert oracle_memo.remember("k", "model-a", ["q", 1], ask) == {"ids": [3, 4]}
    assert oracle_memo.remember("k", "model-a", ["q", 1], ask) == {"ids": [3, 4]}
    assert ask.calls == 1 and len(list(memo.rglob("*.json"))) == 1
    assert not list(memo.rglob(".*.tmp"))  # written through a temporary, renamed into place


@pytest.mark.parametrize("change", ["question", "key", "kind", "environment"])
def test_any_change_is_a_new_question(memo: Path, monkeypatch: pytest.MonkeyPatch, change: str) -> None:
    ask = Counting([7])
    oracle_memo.remember("k", "model-a", ["q", 1], ask)
    if change == "environment":  # e.g. another torch thread count: reductions split differently
        threads = torch.get_num_threads()
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 1)
    oracle_memo.remember("k2" if change == "kind" else "k", "model-b" if change == "key" else "model-a",
                         ["q", 2] if change == "question" else ["q", 1], ask)
    assert ask.calls == 2


def test_a_damaged_entry_is_asked_again(memo: Path) -> None:
    ask = Counting([1])
    oracle_memo.remember("k", "m", [], ask)
    (entry,) = memo.rglob("*.json")
    entry.write_text('{"torn')
    assert oracle_memo.remember("k", "m", [], ask) == [1] and ask.calls == 2


def test_a_model_key_follows_every_weight_and_the_config() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    a = LlamaForCausalLM(config)
    b = LlamaForCausalLM(config)
    b.load_state_dict(a.state_dict())
    assert oracle_memo.model_key(a) == oracle_memo.model_key(b)
    c = LlamaForCausalLM(config)
    c.load_state_dict(a.state_dict())
    with torch.no_grad():
        c.model.layers[0].mlp.down_proj.weight[0, 0] += 1e-6
    assert oracle_memo.model_key(c) != oracle_memo.model_key(a)
    config.rms_norm_eps *= 2
    d = LlamaForCausalLM(config)
    d.load_state_dict(a.state_dict())
    assert oracle_memo.model_key(d) != oracle_memo.model_key(a)


def test_a_lazy_model_is_built_only_when_used() -> None:
    built: list[int] = []

    def build() -> torch.nn.Module:
        built.append(1)
        return torch.nn.Linear(2, 3)

    lazy = oracle_memo.LazyModel("known-key", build)
    assert oracle_memo.model_key(lazy) == "known-key" and not built
    assert lazy(torch.ones(1, 2)).shape == (1, 3) and lazy.out_features == 3 and built == [1]
