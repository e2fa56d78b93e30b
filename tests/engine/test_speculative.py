"""Speculative decoding in the engine, on tiny random-weight models.

The reference is the same engine without speculation, itself checked against transformers by the
oracle tests: with speculation on, greedy outputs and seeded point-mass sampling must be the same
tokens (and logprobs) on every path — chunked prefill, preemption, prefix hits from each tier, a P/D
handoff, stops inside an accepted run, 32 concurrent requests. A scripted guesser that proposes the
right continuation with deliberate errors exercises every acceptance length; the real guessers run
too. Nothing unverified may be published: every block named in the pool (KV events) or offered for
write-behind must hold committed tokens only, and every path returns every block.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch

from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import FinishReason, RequestOutput, SamplingParams
from deepinfer.engine.speculative.base import Proposal, Proposer, SpecContext
from tests.engine.test_pd_handoff import LetterTokenizer, assert_whole, run_disaggregated

BLOCK = 4
VOCAB = 320
GREEDY = SamplingParams(max_tokens=30, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.9, top_k=40, top_p=0.95,
                        repetition_penalty=1.2, seed=11, logprobs=2)
MODES = {
    "ample": dict(num_kv_blocks=256, max_num_batched_tokens=512),
    "chunked": dict(num_kv_blocks=256, max_num_batched_tokens=24),
    # 10 sequences growing to 35-100 tokens in 60 blocks of 4: preemption is certain.
    "preempt": dict(num_kv_blocks=60, max_num_batched_tokens=512),
}


def prompts(n: int = 10, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 70))] for _ in range(n)]


def engine(loaded, speculative: str | None = None, tokenizer=None, **kw) -> LLMEngine:  # type: ignore[no-untyped-def]
    cfg: dict = dict(block_size=BLOCK, num_kv_blocks=256, max_num_batched_tokens=512, speculative=speculative,
                     num_speculative_tokens=5, adaptive_speculation=False)
    cfg.update(kw)
    return LLMEngine(loaded, tokenizer, EngineConfig(**cfg))


class ScriptedProposer(Proposer):
    """Proposes the known continuation of each prompt, of a random length, with each token wrong
    with probability `wrong`: every acceptance length from 0 to k occurs."""

    def __init__(self, refs: dict[tuple[int, ...], list[int]], wrong: float = 0.3, seed: int = 1) -> None:
        self.refs = refs
        self.wrong = wrong
        self.rng = random.Random(seed)
        self.finished_ids: list[str] = []

    def propose(self, batch: Sequence[SpecContext], ks: Sequence[int]) -> list[Proposal]:
        out = []
        for ctx, k in zip(batch, ks):
            ref = self.refs[tuple(ctx.token_ids[: ctx.num_prompt_tokens])]
            done = len(ctx.token_ids) - ctx.num_prompt_tokens
            guess = ref[done : done + self.rng.randint(0, k)]
            out.append(Proposal([t if self.rng.random() >= self.wrong else (t + 1) % VOCAB for t in guess]))
        return out

    def finished(self, ctx: SpecContext) -> None:
        self.finished_ids.append(ctx.request_id)


def run(e: LLMEngine, batch: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
    return e.generate(batch, params)


def scripted(e: LLMEngine, batch: list[list[int]], outs: list[RequestOutput], wrong: float = 0.3) -> ScriptedProposer:
    assert e.speculator is not None
    proposer = ScriptedProposer({tuple(p): o.token_ids for p, o in zip(batch, outs)}, wrong)
    e.speculator.proposer = proposer
    return proposer


def same(a: list[RequestOutput], b: list[RequestOutput]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
        if x.logprobs is not None:
            assert [lp.token_id for lp in x.logprobs] == [lp.token_id for lp in y.logprobs]
            assert [lp.logprob for lp in x.logprobs] == pytest.approx([lp.logprob for lp in y.logprobs], abs=1e-4)
            assert [[t for t, _ in lp.top] for lp in x.logprobs] == [[t for t, _ in lp.top] for lp in y.logprobs]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("mode", MODES)
def test_scripted_drafts_change_nothing(tiny_llama, mode, params):
    batch = prompts()
    ref = run(engine(tiny_llama, **MODES[mode]), batch, params)
    e = engine(tiny_llama, "ngram", **MODES[mode])
    proposer = scripted(e, batch, ref)
    got = run(e, batch, params)
    same(got, ref)
    assert e.stats.spec_accepted_tokens > 0 and e.stats.spec_proposed_tokens > e.stats.spec_accepted_tokens
    assert sum(o.usage.spec_accepted_tokens for o in got) == e.stats.spec_accepted_tokens
    assert e.stats.num_steps < engine_steps(tiny_llama, batch, params, MODES[mode])
    if mode == "preempt":
        assert e.stats.num_preemptions > 0
    assert sorted(proposer.finished_ids) == sorted(o.request_id for o in got)
    assert_whole(e)


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=30, ignore_eos=True, logprobs=2), SEEDED],
                         ids=["greedy", "seeded"])
def test_one_request_speculates_to_the_bit(tiny_llama, params):
    """fp32 weights, one request (decode steps of at most 64 rows): the linear kernel and decode attention are
    both batch-invariant, so a verification row's logits are the plain decode step's bits and every reported
    logprob is equal, not just close. (The tiny model's 256-token limit keeps contexts too short for the old,
    batch-dependent split to differ here; tests/unit/test_paged_attention_groups.py shows that one failing.)"""
    rng = random.Random(3)
    batch = [[rng.randrange(3, VOCAB) for _ in range(200)]]  # long enough that decode attention splits it
    ref = run(engine(tiny_llama), batch, params)
    e = engine(tiny_llama, "ngram")
    scripted(e, batch, ref)
    got = run(e, batch, params)
    assert got[0].token_ids == ref[0].token_ids and e.stats.spec_accepted_tokens > 0
    assert [lp.logprob for lp in got[0].logprobs] == [lp.logprob for lp in ref[0].logprobs]
    assert [lp.top for lp in got[0].logprobs] == [lp.top for lp in ref[0].logprobs]


def engine_steps(loaded, batch, params, mode) -> int:  # type: ignore[no-untyped-def]
    e = engine(loaded, **mode)
    run(e, batch, params)
    return e.stats.num_steps


@pytest.mark.parametrize("method", ["ngram", "suffix", "self:1", "draft"])
def test_every_guesser_keeps_greedy_output(tiny_llama, tiny_draft_dir, method):
    # Prompts that repeat themselves, so the lookup guessers find matches.
    rng = random.Random(3)
    batch = []
    for _ in range(6):
        unit = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 9))]
        batch.append(unit * 5)
    spec = f"draft:{tiny_draft_dir}" if method == "draft" else method
    ref = run(engine(tiny_llama), batch, GREEDY)
    e = engine(tiny_llama, spec)
    # Twice: the second round has the first round's answers in the suffix index and the prefix cache.
    for _ in range(2):
        same(run(e, batch, GREEDY), ref)
    assert e.stats.spec_proposed_tokens > 0
    assert_whole(e)


def test_seeded_sampling_with_lookup_drafts_is_the_plain_output(tiny_llama):
    """A point-mass guesser never changes a seeded request's tokens: verification samples each row
    with the stream plain decoding uses at that position."""
    batch = [[5, 6, 7, 8] * 6, [9, 10] * 10]
    params = SamplingParams(max_tokens=40, temperature=1.5, seed=3, ignore_eos=True)
    ref = run(engine(tiny_llama), batch, params)
    e = engine(tiny_llama, "ngram")
    scripted(e, batch, ref, wrong=0.5)
    same(run(e, batch, params), ref)


def test_stops_inside_an_accepted_run_cut_it(tiny_llama):
    tok = LetterTokenizer()
    batch = prompts(6, seed=4)
    long = run(engine(tiny_llama, tokenizer=tok), batch, GREEDY)
    cases = [
        SamplingParams(max_tokens=13, ignore_eos=True),  # max_tokens inside a run
        SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[long[0].token_ids[9]]),
        SamplingParams(max_tokens=30, ignore_eos=True, stop=[tok.decode(long[1].token_ids[6:8])]),
    ]
    for params in cases:
        ref_engine = engine(tiny_llama, tokenizer=tok)
        ref = run(ref_engine, batch, params)
        e = engine(tiny_llama, "ngram", tokenizer=tok)
        scripted(e, batch, long, wrong=0.0)  # every draft right: runs of 6 tokens cross every stop
        got = run(e, batch, params)
        same(got, ref)
        assert [o.text for o in got] == [o.text for o in ref]
        # Write-behind offers exactly the plain run's blocks: none holds a token past the stop.
        assert [o.block_hashes for o in got] == [o.block_hashes for o in ref]
        assert any(o.finish_reason == FinishReason.STOP for o in got) or params.stop_token_ids == []
        assert_whole(e)


def committed_hashes(e: LLMEngine, batch: list[list[int]], outs: list[RequestOutput]) -> set:
    names = set()
    for p, o in zip(batch, outs):
        names.update(e.block_hashes(p + o.token_ids))
    return names


def test_kv_events_name_committed_blocks_only(tiny_llama):
    batch = prompts(8, seed=5)
    ref = run(engine(tiny_llama), batch, GREEDY)
    e = engine(tiny_llama, "ngram")
    scripted(e, batch, ref, wrong=0.5)
    for i, p in enumerate(batch):
        e.add_request(f"r{i}", p, GREEDY)
    stored: set = set()
    finals: dict[str, RequestOutput] = {}
    while e.has_unfinished():
        for out in e.step():
            if out.finished:
                finals[out.request_id] = out
        stored.update(e.pool.drain_events()[0])
    outs = [finals[f"r{i}"] for i in range(len(batch))]
    same(outs, ref)
    legit = committed_hashes(e, batch, outs)
    assert stored and stored <= legit
    assert all(set(o.block_hashes) <= legit for o in outs)


def test_prefix_hits_from_each_tier_with_speculation(tiny_llama):
    batch = prompts(6, seed=6)
    ref = run(engine(tiny_llama), batch, GREEDY)
    donor = engine(tiny_llama)
    run(donor, batch, GREEDY)
    for tier in ("device", "host", "disk"):
        e = engine(tiny_llama, "ngram")
        scripted(e, batch, ref)
        if tier == "device":
            run(e, batch, GREEDY)  # warms its own pool
        else:
            for p in batch:
                hashes = e.block_hashes(p)
                names, kv = donor.export_cached_blocks(hashes)
                if kv is not None:
                    e.import_cached_blocks(names, kv, tier)
        got = run(e, batch, GREEDY)
        same(got, ref)
        assert sum(o.usage.cached_by_tier.get(tier, 0) for o in got) > 0
        assert_whole(e)


def test_decode_side_of_a_handoff_speculates(tiny_llama):
    batch = prompts(8, seed=7)
    params = [GREEDY, SEEDED] * 4
    refs = {i: run(engine(tiny_llama), [p], params[i])[0] for i, p in enumerate(batch)}
    prefill = engine(tiny_llama)
    decode = engine(tiny_llama, "ngram", num_kv_blocks=200)
    proposer = ScriptedProposer({tuple(p): refs[i].token_ids for i, p in enumerate(batch)})
    assert decode.speculator is not None
    decode.speculator.proposer = proposer
    finals, _ = run_disaggregated(prefill, decode, batch, params)
    same([finals[i] for i in range(len(batch))], [refs[i] for i in range(len(batch))])
    assert decode.stats.spec_accepted_tokens > 0 and prefill.stats.spec_proposed_tokens == 0
    decode.cancel_reservation("ballast")
    assert_whole(prefill, decode)


def test_thirty_two_concurrent(tiny_llama):
    batch = prompts(32, seed=8)
    ref = run(engine(tiny_llama), batch, GREEDY)
    e = engine(tiny_llama, "ngram", num_kv_blocks=400)
    scripted(e, batch, ref)
    same(run(e, batch, GREEDY), ref)
    assert_whole(e)


@pytest.mark.parametrize("abort_after", range(6))
def test_aborts_at_every_step_return_every_block(tiny_llama, abort_after):
    batch = prompts(6, seed=9)
    ref = run(engine(tiny_llama), batch, GREEDY)
    e = engine(tiny_llama, "ngram", num_kv_blocks=80)
    proposer = scripted(e, batch, ref)
    for i, p in enumerate(batch):
        e.add_request(f"r{i}", p, GREEDY)
    for _ in range(abort_after):
        e.step()
    for i in range(0, len(batch), 2):
        e.abort(f"r{i}")
    ends: dict[str, int] = {}
    while e.has_unfinished():
        for out in e.step():
            if out.finished:
                ends[out.request_id] = ends.get(out.request_id, 0) + 1
    assert all(n == 1 for n in ends.values())
    assert sorted(proposer.finished_ids) == sorted(f"r{i}" for i in range(len(batch)))
    assert_whole(e)


class FailingProposer(ScriptedProposer):
    def propose(self, batch: Sequence[SpecContext], ks: Sequence[int]) -> list[Proposal]:
        raise RuntimeError("draft model fell over")


def test_a_guesser_that_fails_fails_the_step_not_the_engine(tiny_llama, tiny_draft_dir):
    e = engine(tiny_llama, f"draft:{tiny_draft_dir}")
    assert e.speculator is not None
    e.speculator.proposer = FailingProposer({})
    e.speculator.proposer.cheap = False
    e.add_request("a", [5, 6, 7], GREEDY)
    outs: list[RequestOutput] = []
    while e.has_unfinished():
        outs += e.step()
    final = [o for o in outs if o.finished]
    assert len(final) == 1 and final[0].finish_reason == FinishReason.ERROR and "fell over" in final[0].error
    assert_whole(e)


def test_the_controller_stops_proposing_what_is_never_accepted(tiny_llama):
    batch = prompts(4, seed=10)
    ref = run(engine(tiny_llama), batch, SamplingParams(max_tokens=120, ignore_eos=True))
    e = engine(tiny_llama, "ngram", adaptive_speculation=True)
    scripted(e, batch, ref, wrong=1.0)  # every draft wrong
    # A fixed cost curve (each row 5% of a step) instead of this machine's noisy timings: on a tiny model
    # rows are nearly free, and a controller is right to keep guessing when they are.
    spec = e.speculator
    assert spec is not None
    spec.record_step = lambda rows, seconds: spec.controller.record_step(rows, 0.02 + 0.001 * rows)
    for i, p in enumerate(batch):
        e.add_request(f"r{i}", p, SamplingParams(max_tokens=120, ignore_eos=True))
    proposed_per_step: list[int] = []
    while e.has_unfinished():
        before = e.stats.spec_proposed_tokens
        e.step()
        proposed_per_step.append(e.stats.spec_proposed_tokens - before)
    assert e.stats.spec_accepted_tokens == 0
    # A few tries, then (almost) nothing: occasional re-probes only.
    late = proposed_per_step[len(proposed_per_step) // 2 :]
    assert sum(late) <= len(late) // 2, proposed_per_step


def test_unknown_or_bad_speculative_settings_are_refused(tiny_llama):
    from deepinfer.config.model import ConfigError

    for bad in ["nope", "self:0", "self:x", "draft:", "ngram:3"]:
        with pytest.raises(ConfigError):
            EngineConfig(speculative=bad)
    with pytest.raises(ConfigError, match="layers"):
        engine(tiny_llama, "self:2")  # the tiny model has 2 layers: a self-draft takes fewer


@pytest.fixture(scope="module")
def tiny_draft_dir(tmp_path_factory):
    import transformers

    torch.manual_seed(99)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    path = tmp_path_factory.mktemp("tiny-draft")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_a_registered_toy_guesser_runs_in_the_engine(tiny_llama, monkeypatch):
    """A new guesser is one class and one registration (plus its grammar entry): the engine builds it
    by its kind, proposes with it, and the output stays the plain output."""
    from deepinfer.config.engine import NO_ARGUMENT
    from tests.unit.test_spec_registry import RepeatProposer, add_kind

    add_kind(monkeypatch, "toy", NO_ARGUMENT, RepeatProposer, lambda a: RepeatProposer(a.config.num_speculative_tokens))
    batch = [[5, 6, 7, 7, 7, 7], [9, 10] * 10]
    ref = run(engine(tiny_llama), batch, GREEDY)
    e = engine(tiny_llama, "toy")
    assert e.speculator is not None and isinstance(e.speculator.proposer, RepeatProposer)
    same(run(e, batch, GREEDY), ref)
    assert e.speculator.proposer.calls > 0 and e.stats.spec_proposed_tokens > 0
    assert_whole(e)
