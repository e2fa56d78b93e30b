"""The proposer registry and the `--speculative` grammar: the kinds the grammar accepts are exactly the
registered ones, the grammar's messages stay as they were, a kind with no guesser is refused when the
proposer is built, and a new guesser is one class plus one registration (and its grammar entry)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from deepinfer.config import engine as config_engine
from deepinfer.config.engine import KINDS, LAYERS, NO_ARGUMENT, EngineConfig, parse_speculative, speculative_methods
from deepinfer.config.model import ConfigError
from deepinfer.engine.speculative import registry
from deepinfer.engine.speculative.base import Proposal, Proposer, SpecContext
from deepinfer.engine.speculative.registry import (
    Build,
    ProposerArgs,
    register_proposer,
    registered_kinds,
    registration,
)
from deepinfer.engine.speculative.speculator import build_proposer


def add_kind(monkeypatch: pytest.MonkeyPatch, kind: str, argument: str, cls: type[Proposer] | None = None,
             build: Build | None = None) -> None:
    """Add `kind` to the grammar (taking `argument`) and, given `cls` and `build`, register its guesser;
    both are undone when the test ends."""
    registered_kinds()  # discover the real registrations first, so the copy below holds them
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setitem(config_engine.KINDS, kind, argument)
    if cls is not None and build is not None:
        register_proposer(kind, cls, build)


class RepeatProposer(Proposer):
    """A toy guesser: proposes the request's last token `times` times (at most k)."""

    def __init__(self, times: int) -> None:
        self.times = times
        self.calls = 0

    def propose(self, batch: Sequence[SpecContext], ks: Sequence[int]) -> list[Proposal]:
        self.calls += 1
        return [Proposal([ctx.token_ids[-1]] * min(k, self.times)) for ctx, k in zip(batch, ks)]


def test_the_grammar_accepts_exactly_the_registered_kinds():
    assert set(KINDS) == registered_kinds()


def test_each_kind_builds_its_guesser_and_says_whether_it_runs_a_model():
    from deepinfer.engine.speculative.draft import DraftProposer
    from deepinfer.engine.speculative.ngram import NgramProposer
    from deepinfer.engine.speculative.suffix import SuffixProposer

    assert {k: registration(k).cls for k in KINDS} == {
        "ngram": NgramProposer, "suffix": SuffixProposer, "self": DraftProposer, "draft": DraftProposer}
    assert {k for k in KINDS if registration(k).cls.cheap} == {"ngram", "suffix"}
    assert type(build_proposer(EngineConfig(speculative="ngram", ngram_min=2, ngram_max=3))) is NgramProposer
    assert type(build_proposer(EngineConfig(speculative="suffix"))) is SuffixProposer


@pytest.mark.parametrize(("text", "message"), [
    ("nope", "unknown speculative method 'nope'; expected ngram[:tree[=N]], suffix[:tree[=N]], self:L or "
             "draft:PATH"),
    ("ngram:3", "ngram takes no argument or tree[=N], N in [2, 16] leaves (got 'ngram:3')"),
    ("suffix:x", "suffix takes no argument or tree[=N], N in [2, 16] leaves (got 'suffix:x')"),
    ("ngram:tree=1", "ngram takes no argument or tree[=N], N in [2, 16] leaves (got 'ngram:tree=1')"),
    ("ngram:tree=17", "ngram takes no argument or tree[=N], N in [2, 16] leaves (got 'ngram:tree=17')"),
    ("ngram:trees", "ngram takes no argument or tree[=N], N in [2, 16] leaves (got 'ngram:trees')"),
    ("self:0", "self-draft needs a positive layer count, as in self:8 (got 'self:0')"),
    ("self:x", "self-draft needs a positive layer count, as in self:8 (got 'self:x')"),
    ("self", "self-draft needs a positive layer count, as in self:8 (got 'self')"),
    ("draft:", "a draft model needs a path, as in draft:/models/small (got 'draft:')"),
])
def test_the_grammar_refuses_with_the_same_messages(text, message):
    with pytest.raises(ConfigError) as info:
        parse_speculative(text)
    assert str(info.value) == message


def test_the_grammar_parses_each_argument_and_prints_it_back():
    assert speculative_methods() == "ngram[:tree[=N]], suffix[:tree[=N]], self:L or draft:PATH"
    for text, kind, layers, path in [("ngram", "ngram", None, None), ("suffix", "suffix", None, None),
                                     ("self:8", "self", 8, None), ("draft:/m/a:b", "draft", None, "/m/a:b")]:
        spec = parse_speculative(text)
        assert (spec.kind, spec.num_layers, spec.path, spec.tree_leaves) == (kind, layers, path, 1)
        assert str(spec) == text
    for text, leaves, printed in [("ngram:tree", 4, "ngram:tree=4"), ("suffix:tree=16", 16, "suffix:tree=16"),
                                  ("ngram:tree=2", 2, "ngram:tree=2")]:
        spec = parse_speculative(text)
        assert spec.tree_leaves == leaves and str(spec) == printed
        assert parse_speculative(printed) == spec


def test_a_kind_registers_once(monkeypatch):
    add_kind(monkeypatch, "toy", NO_ARGUMENT, RepeatProposer, lambda a: RepeatProposer(1))
    with pytest.raises(ValueError, match="already registered to RepeatProposer"):
        register_proposer("toy", RepeatProposer, lambda a: RepeatProposer(2))
    with pytest.raises(ValueError, match="already registered to NgramProposer"):
        register_proposer("ngram", RepeatProposer, lambda a: RepeatProposer(2))


def test_a_kind_the_grammar_accepts_but_nothing_builds_is_refused(monkeypatch):
    add_kind(monkeypatch, "orphan", NO_ARGUMENT)
    config = EngineConfig(speculative="orphan")  # the grammar alone accepts it
    with pytest.raises(ConfigError, match="speculative method 'orphan' has no registered proposer"):
        build_proposer(config)


def test_a_new_guesser_is_one_class_and_one_registration(monkeypatch):
    """A toy kind taking a layer count: the grammar parses the argument, the registration builds the
    class from it, and the speculator proposes with it."""
    from deepinfer.engine.request import Request, SamplingParams
    from deepinfer.engine.scheduler import ScheduledChunk, SchedulerOutput
    from deepinfer.engine.speculative.speculator import Speculator

    seen: list[ProposerArgs] = []

    def build(args: ProposerArgs) -> RepeatProposer:
        seen.append(args)
        return RepeatProposer(args.spec.num_layers or 0)

    add_kind(monkeypatch, "repeat", LAYERS, RepeatProposer, build)
    assert "repeat:L" in speculative_methods()
    config = EngineConfig(speculative="repeat:3", num_speculative_tokens=5, adaptive_speculation=False)
    proposer = build_proposer(config, target="model", kv=None)
    assert isinstance(proposer, RepeatProposer) and proposer.times == 3
    assert seen == [ProposerArgs(parse_speculative("repeat:3"), config, "model", None)]

    speculator = Speculator(config, proposer, max_model_len=64)
    req = Request("r", [5, 6, 7], SamplingParams(max_tokens=10, ignore_eos=True))
    req.num_computed_tokens = 2  # in its decode phase: one token to compute
    speculator.plan([req], budget=64)
    assert req.num_spec_tokens == 3 and proposer.calls == 1
    chunk = ScheduledChunk(req, num_new_tokens=1 + req.num_spec_tokens, num_spec=req.num_spec_tokens)
    speculator.draft(SchedulerOutput(chunks=[chunk]))
    assert chunk.draft_token_ids == [7, 7, 7]
