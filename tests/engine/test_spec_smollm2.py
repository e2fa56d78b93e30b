"""Speculative decoding on SmolLM2-135M-Instruct against transformers on the same weights: every
guesser (and the lookup guessers' draft trees) keeps greedy output token for token, on prompts whose
answers repeat their input (so the lookup guessers are accepted) and on one that does not; with forced
chunked prefill and preemption; and a stop string that falls inside an accepted run cuts it exactly
where plain decoding stops."""

from __future__ import annotations

import pytest

from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import SamplingParams
from tests.engine.oracle import assert_same_greedy, smollm2_case

pytestmark = pytest.mark.smollm2

NEW_TOKENS = 40
QUESTIONS = [
    "Repeat this list exactly, one item per line: apples, bananas, cherries, dates, elderberries, figs, grapes.",
    "Copy this sentence twice: The quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
]
MODES = {
    "ample": dict(kv_cache_bytes=128 * 1024 * 1024),
    "chunked": dict(kv_cache_bytes=128 * 1024 * 1024, max_num_batched_tokens=24),
    "preempt": dict(num_kv_blocks=12),  # 3 sequences of 50-90 tokens in 12 blocks of 16
}


@pytest.fixture(scope="module")
def smollm2(smollm2_oracle):
    return smollm2_case(smollm2_oracle, QUESTIONS, NEW_TOKENS)


def run(loaded, tok, prompts, speculative, params, **kw):  # type: ignore[no-untyped-def]
    e = LLMEngine(loaded, tok, EngineConfig(speculative=speculative, adaptive_speculation=False, **kw))
    return e.generate(prompts, params), e


@pytest.mark.parametrize("method", ["ngram", "suffix", "self:8", "ngram:tree", "suffix:tree=8"])
def test_every_guesser_matches_transformers(smollm2, method):
    loaded, tok, hf, prompts, refs = smollm2
    k = 8 if "tree" in method else 4  # room for branches beside the main chain
    outs, e = run(loaded, tok, prompts, method, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True),
                  num_speculative_tokens=k, **MODES["ample"])
    for p, out, ref in zip(prompts, outs, refs):
        assert_same_greedy(hf, p, out.token_ids, ref)
    assert e.stats.spec_accepted_tokens > 0
    assert e.num_free_blocks == e.pool.num_blocks


@pytest.mark.parametrize("method", ["ngram", "ngram:tree"])
@pytest.mark.parametrize("mode", ["chunked", "preempt"])
def test_ngram_under_chunking_and_preemption(smollm2, mode, method):
    loaded, tok, hf, prompts, refs = smollm2
    outs, e = run(loaded, tok, prompts, method, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True),
                  **MODES[mode])
    for p, out, ref in zip(prompts, outs, refs):
        assert_same_greedy(hf, p, out.token_ids, ref)
    assert e.stats.spec_accepted_tokens > 0
    if mode == "preempt":
        assert e.stats.num_preemptions > 0


def test_a_stop_string_inside_an_accepted_run(smollm2):
    loaded, tok, hf, prompts, refs = smollm2
    # A stop string from the middle of the repeated list: lookup drafts run straight across it.
    params = SamplingParams(max_tokens=NEW_TOKENS, stop=["dates"])
    plain, _ = run(loaded, tok, prompts[:1], None, params, **MODES["ample"])
    spec, e = run(loaded, tok, prompts[:1], "ngram", params, **MODES["ample"])
    assert plain[0].finish_reason.value == "stop" and "dates" not in plain[0].text
    assert (spec[0].text, spec[0].token_ids, spec[0].finish_reason) == (
        plain[0].text, plain[0].token_ids, plain[0].finish_reason)
    assert spec[0].block_hashes == plain[0].block_hashes
