"""Resuming a request from the output it already streamed: what a worker does for a request whose
first worker died (`add_request(..., resume_output_ids=...)`, and across a P/D handoff
`add_prefilled_request(..., resume_output_ids=...)`).

The continuation must be exactly what the undisturbed request produced after that point: greedy, seeded
sampling (draws are keyed by output position), penalties (they count the resumed tokens), `max_tokens`
(counts them too) and stop strings spanning the cut.
"""

from __future__ import annotations

import random

import pytest

from deepinfer.engine.handoff import blocks_for
from deepinfer.engine.request import InvalidRequestError, SamplingParams
from tests.engine.test_pd_handoff import LetterTokenizer, assert_whole, drain, engine, prefill_first

MAX_TOKENS = 24
CUTS = [1, 3, 4, 9, 23]  # 4: the cut falls on a block boundary of the tiny engine (block size 4)

PARAMS = {
    "greedy": SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
    "penalties": SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=3, repetition_penalty=1.3,
                                frequency_penalty=0.5, ignore_eos=True),
}


def prompt(n: int = 13, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(n)]


def full_output(tiny_llama, params: SamplingParams, ids: list[int]) -> list[int]:
    e = engine(tiny_llama)
    e.add_request("r", ids, params)
    [out] = drain(e)["r"][-1:]
    return out.token_ids


@pytest.mark.parametrize("kind", PARAMS)
def test_resumed_request_continues_exactly(tiny_llama, kind):
    params, ids = PARAMS[kind], prompt()
    want = full_output(tiny_llama, params, ids)
    assert len(want) == MAX_TOKENS
    for cut in CUTS:
        e = engine(tiny_llama)
        e.add_request("r", ids, params, resume_output_ids=want[:cut])
        outs = drain(e)["r"]
        assert [t for o in outs for t in o.new_token_ids] == want[cut:], cut
        final = outs[-1]
        assert final.token_ids == want and final.usage.completion_tokens == MAX_TOKENS
        assert final.usage.prompt_tokens == len(ids)
        assert_whole(e)


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_resumed_request_through_a_handoff(tiny_llama, kind):
    """Prefill engine resumes (prompt + output so far), samples the next token, hands the KV of both over."""
    params, ids = PARAMS[kind], prompt(seed=1)
    want = full_output(tiny_llama, params, ids)
    for cut in CUTS[:-1]:
        prefill, decode = engine(tiny_llama), engine(tiny_llama, num_kv_blocks=80)
        prefill.add_request("r", ids, params, prefill_only=True, resume_output_ids=want[:cut])
        out = None
        while out is None:
            out = next(iter(prefill.step()), None)
        assert out.handoff and out.new_token_ids == [want[cut]]
        kv = prefill.export_kv("r")
        assert kv.shape[0] == blocks_for(len(ids) + cut, 4)
        assert decode.reserve("r", blocks_for(len(ids) + cut, 4), lease_s=60.0)
        decode.add_prefilled_request("r", ids, out.new_token_ids[0], params, kv, reservation_id="r",
                                     resume_output_ids=want[:cut])
        assert prefill.release("r")
        outs = drain(decode)["r"]
        assert [t for o in outs for t in o.new_token_ids] == want[cut + 1:], cut
        assert outs[-1].token_ids == want
        assert_whole(prefill, decode)


def test_stop_string_spanning_the_cut_is_found(tiny_llama):
    """The engine's detokenizer is fed the resumed output: a stop string that began before the cut ends
    the request where the undisturbed one ended."""
    ids = prompt(seed=2)
    plain = engine(tiny_llama, tokenizer=LetterTokenizer())
    plain.add_request("r", ids, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    text = drain(plain)["r"][-1].text
    stop = text[5:8]  # letters 6..8 of the output: the first stop may come earlier, the test asks the same
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop])
    ref = engine(tiny_llama, tokenizer=LetterTokenizer())
    ref.add_request("r", ids, params)
    want = drain(ref)["r"][-1]
    n = len(want.token_ids)
    e = engine(tiny_llama, tokenizer=LetterTokenizer())
    e.add_request("r", ids, params, resume_output_ids=want.token_ids[: n - 2])  # cut inside the stop string
    got = drain(e)["r"][-1]
    assert got.token_ids == want.token_ids and got.text == want.text and got.finish_reason == want.finish_reason


def test_resume_is_validated(tiny_llama):
    e = engine(tiny_llama)
    params = SamplingParams(max_tokens=4)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        e.add_request("r", [5, 6], params, resume_output_ids=[7, 10_000])
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        e.add_request("r", [5, 6], params, resume_output_ids=[7, 8, 9, 10])
    with pytest.raises(InvalidRequestError, match="context"):
        e.add_request("r", [5] * 200, SamplingParams(max_tokens=100), resume_output_ids=[7] * 60)
    assert_whole(e)


def test_prefill_first_helper_still_hands_off_a_plain_prompt(tiny_llama):
    """A request without resumed output exports exactly its prompt's KV, as before."""
    e = engine(tiny_llama)
    out = prefill_first(e, "r", prompt(9), SamplingParams(max_tokens=8))
    assert out.handoff and e.export_kv("r").shape[0] == blocks_for(9, 4)
    assert e.release("r")
    assert_whole(e)
