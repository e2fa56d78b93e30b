"""Structured output on SmolLM2-135M-Instruct against transformers on the same weights with the same grammar
mask: greedy output equal token for token, also with speculation, across a P/D handoff and resumed mid-output;
seeded sampling stays valid; every output parses and validates; a constraint that cannot compile is refused
with its reason and leaves the engine untouched."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import FinishReason, InvalidRequestError, SamplingParams
from deepinfer.grammar import Constraint, ConstraintSpec, GrammarCache, apply_bitmask_, grammar_vocab, new_bitmask

pytestmark = pytest.mark.smollm2

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "colour": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "colour"],
    "additionalProperties": False,
}
JSON_SPEC = ConstraintSpec.json_schema(SCHEMA)
QUESTION = "Describe a person as JSON with their name, age and favourite colour."
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def case(smollm2_oracle):  # type: ignore[no-untyped-def]
    o = smollm2_oracle
    [prompt] = o.chat([QUESTION])
    return o, list(prompt)  # chat() gives the token ids of the templated conversation


def engine(o, **kw) -> LLMEngine:  # type: ignore[no-untyped-def]
    return LLMEngine(o.loaded, o.tok, EngineConfig(kv_cache_bytes=64 * 1024 * 1024, **kw))


def run(e: LLMEngine, prompt: list[int], params: SamplingParams, **kw):  # type: ignore[no-untyped-def]
    rid = e.add_request(None, prompt, params, **kw)
    final = None
    while e.has_unfinished():
        for out in e.step():
            if out.request_id == rid and out.finished:
                final = out
    assert final is not None
    return final


def masked_greedy(o, prompt: list[int], spec: ConstraintSpec, max_tokens: int) -> list[int]:  # type: ignore[no-untyped-def]
    """The oracle: transformers' logits, the same constraint's mask, argmax — until the constraint is done."""
    vocab = o.hf.config.vocab_size
    constraint = Constraint(GrammarCache(grammar_vocab(o.tok, n_vocab=vocab)).compile(spec))
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = o.hf(torch.tensor([ids])).logits[:, -1, :].float()
            mask = new_bitmask(1, vocab)
            constraint.allowed_mask(mask[0])
            apply_bitmask_(logits, mask, [0])
            token = int(logits.argmax(dim=-1))
            out.append(token)
            assert constraint.accept(token)
            if constraint.is_finished:
                break
            ids.append(token)
    return out


def valid_json(text: str) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    return value


def test_greedy_json_equals_transformers_under_the_same_mask_and_validates(case) -> None:  # type: ignore[no-untyped-def]
    o, prompt = case
    out = run(engine(o), prompt, SamplingParams(max_tokens=MAX_TOKENS, constraint=JSON_SPEC))
    assert out.token_ids == masked_greedy(o, prompt, JSON_SPEC, MAX_TOKENS)
    assert out.finish_reason == FinishReason.STOP
    valid_json(out.text)


def test_speculation_a_handoff_and_a_resume_keep_the_constrained_tokens(case) -> None:  # type: ignore[no-untyped-def]
    o, prompt = case
    params = SamplingParams(max_tokens=MAX_TOKENS, constraint=JSON_SPEC)
    plain = run(engine(o), prompt, params).token_ids
    spec_engine = engine(o, speculative="ngram", adaptive_speculation=False)
    assert run(spec_engine, prompt, params).token_ids == plain
    assert spec_engine.stats.spec_proposed_tokens > 0
    # P/D: the prefill engine samples the first token under the mask, the decode engine replays it and goes on.
    pre, dec = engine(o), engine(o)
    handed = run(pre, prompt, params, prefill_only=True)
    assert handed.handoff and handed.token_ids == plain[:1]
    rid = dec.add_prefilled_request("r", prompt, handed.token_ids[0], params, pre.export_kv(handed.request_id))
    pre.release(handed.request_id)
    final = None
    while dec.has_unfinished():
        final = next((x for x in dec.step() if x.request_id == rid and x.finished), final)
    assert final is not None and final.token_ids == plain
    # A request moved after 5 tokens continues from them with the constraint replayed over them.
    resumed = run(engine(o), prompt, params, resume_output_ids=plain[:5])
    assert resumed.token_ids == plain


def test_drafts_the_constraint_allows_are_accepted_and_one_it_forbids_is_not(smollm2_oracle) -> None:  # type: ignore[no-untyped-def]
    # The n-gram guesser proposes the sentence again from the prompt, "dog" included; the constraint wants "cat"
    # the second time. Accepted drafts speed the copy; the forbidden one is rejected by its row's mask.
    o = smollm2_oracle
    [prompt] = o.chat(["Copy this sentence twice: The quick brown fox jumps over the lazy dog."])
    spec = ConstraintSpec.regex(r"The quick brown fox jumps over the lazy (dog|cat)\. "
                                r"The quick brown fox jumps over the lazy cat\.")
    params = SamplingParams(max_tokens=40, constraint=spec)
    plain = run(engine(o), list(prompt), params)
    e = engine(o, speculative="ngram", adaptive_speculation=False)
    fast = run(e, list(prompt), params)
    assert fast.token_ids == plain.token_ids and fast.text.endswith("over the lazy cat.")
    assert fast.token_ids == masked_greedy(o, list(prompt), spec, 40)
    assert 0 < e.stats.spec_accepted_tokens < e.stats.spec_proposed_tokens


def test_a_tree_guesser_is_cut_to_its_main_chains_under_a_constraint(smollm2_oracle) -> None:  # type: ignore[no-untyped-def]
    # The prompt branches ("The quick brown fox ..." / "The quick brown cat ..."), so lookup proposes trees; the
    # constraint's masks follow a chain, so a constrained request is offered each tree's main chain only.
    o = smollm2_oracle
    [prompt] = o.chat(["Copy these two sentences: The quick brown fox jumps over the lazy dog. "
                       "The quick brown cat sleeps on the warm mat."])
    spec = ConstraintSpec.regex(r"The quick brown (fox|cat)[a-z .]*")
    params = SamplingParams(max_tokens=24, constraint=spec)
    e = engine(o, speculative="ngram:tree", adaptive_speculation=False, num_speculative_tokens=8)
    assert e.speculator is not None
    proposer, trees = e.speculator.proposer, [0]
    propose = proposer.propose

    def counting(batch, ks):  # type: ignore[no-untyped-def]
        out = propose(batch, ks)
        trees[0] += sum(p.parents is not None for p in out)
        return out

    proposer.propose = counting  # type: ignore[method-assign]
    fast = run(e, list(prompt), params)
    assert fast.token_ids == masked_greedy(o, list(prompt), spec, 24)
    assert trees[0] > 0 and e.stats.spec_accepted_tokens > 0


def test_seeded_sampling_gives_valid_json_and_regex_a_full_match(case) -> None:  # type: ignore[no-untyped-def]
    o, prompt = case
    e = engine(o)
    for seed in range(4):
        out = run(e, prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, constraint=JSON_SPEC))
        if out.finish_reason == FinishReason.STOP:
            valid_json(out.text)
        else:  # cut off by max_tokens: a prefix of a valid document, never anything else
            assert out.finish_reason == FinishReason.LENGTH
    pattern = r"(yes|no), because [a-z ]{5,40}\."
    out = run(e, prompt, SamplingParams(max_tokens=40, constraint=ConstraintSpec.regex(pattern)))
    assert out.finish_reason == FinishReason.STOP and re.fullmatch(pattern, out.text), out.text


def test_a_constraint_that_cannot_compile_is_refused_with_its_reason(case) -> None:  # type: ignore[no-untyped-def]
    o, prompt = case
    e = engine(o)
    with pytest.raises(InvalidRequestError, match="regex"):
        e.add_request("bad", prompt, SamplingParams(constraint=ConstraintSpec.regex("(unclosed")))
    with pytest.raises(InvalidRequestError, match="json_schema"):
        e.add_request("bad", prompt, SamplingParams(constraint=ConstraintSpec("json_schema", '{"type": 5}')))
    assert not e.has_unfinished() and e.num_free_blocks == e.pool.num_blocks
    no_tokenizer = LLMEngine(o.loaded, None, EngineConfig(kv_cache_bytes=16 * 1024 * 1024))
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        no_tokenizer.add_request("x", prompt, SamplingParams(constraint=JSON_SPEC))
