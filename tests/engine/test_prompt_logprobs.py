"""Prompt logprobs and logit_bias in the engine, against transformers on the same weights.

* Prompt logprobs: for every prompt token i >= 1, the log-softmax of the model's logits after tokens < i at
  token i, with the top-N alternatives — equal to transformers' within 1e-4 (tiny, fp32) / 1e-3 (SmolLM2),
  with chunked prefill forced small so several chunks contribute; the same again once the prefix cache
  holds the prompt (a request asking for them computes its whole prompt); carried by a prefill engine's
  handoff output; bounded like logprobs.
* logit_bias: greedy output with a bias equals transformers' greedy with the same bias added to its logits
  (a LogitsProcessor in generate), token for token, with speculation off and on.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import InvalidRequestError, Logprob, RequestOutput, SamplingParams
from tests import oracle_memo
from tests.engine.oracle import NEAR_TIE, hf_logits, hf_model_from_loaded, random_tokens
from tests.engine.test_pd_handoff import assert_whole, prefill_first

VOCAB = 320
TOP = 5
MODES = {
    "chunked": dict(num_kv_blocks=256, max_num_batched_tokens=16),
    "ample": dict(num_kv_blocks=256, max_num_batched_tokens=512),
    # 151 prompt tokens and 8 more each in 22 blocks of 4: preemption is certain.
    "preempt": dict(num_kv_blocks=22, max_num_batched_tokens=16),
}


def engine(loaded, tokenizer=None, **kw) -> LLMEngine:  # type: ignore[no-untyped-def]
    cfg: dict = dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=16)
    cfg.update(kw)
    return LLMEngine(loaded, tokenizer, EngineConfig(**cfg))


@pytest.fixture(scope="module")
def tiny_hf(tiny_llama):
    return hf_model_from_loaded(tiny_llama.config, tiny_llama.state_dict)


def hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """[len(prompt), vocab]: row p is the log-softmax after tokens <= p (it scores prompt token p + 1)."""
    return hf_logits(hf, prompt).float().log_softmax(dim=-1)


def assert_prompt_logprobs(ours: list[Logprob | None] | None, ref: torch.Tensor, prompt: list[int],
                           tol: float) -> None:
    assert ours is not None and len(ours) == len(prompt) and ours[0] is None
    for i in range(1, len(prompt)):
        lp, row = ours[i], ref[i - 1]
        assert lp is not None and lp.token_id == prompt[i], i
        assert lp.logprob == pytest.approx(row[prompt[i]].item(), abs=tol), i
        assert len(lp.top) == TOP
        assert [v for _, v in lp.top] == pytest.approx(row.topk(TOP).values.tolist(), abs=tol), i
        # Top ids match wherever the oracle's neighbouring values are not (near-)ties.
        values, ids = row.topk(TOP + 1)
        for j, (tid, _) in enumerate(lp.top):
            gaps = [values[j - 1] - values[j] if j else torch.tensor(1.0), values[j] - values[j + 1]]
            if min(float(g) for g in gaps) > 10 * tol:
                assert tid == ids[j].item(), (i, j)


def run(e: LLMEngine, batch: list[list[int]], params: SamplingParams) -> tuple[list[RequestOutput], list[list]]:
    """Final outputs in order, and every output of each request."""
    ids = [e.add_request(None, p, params) for p in batch]
    seen: dict[str, list[RequestOutput]] = {rid: [] for rid in ids}
    while e.has_unfinished():
        for out in e.step():
            seen[out.request_id].append(out)
    return [seen[rid][-1] for rid in ids], [seen[rid] for rid in ids]


LENGTHS = (1, 2, 5, 16, 17, 40, 70)


@pytest.mark.parametrize("mode", list(MODES))
def test_prompt_logprobs_match_transformers(tiny_llama, tiny_hf, mode):
    batch = [random_tokens(n, n, VOCAB) for n in LENGTHS]
    e = engine(tiny_llama, **MODES[mode])
    params = SamplingParams(max_tokens=8, ignore_eos=True, prompt_logprobs=TOP, logprobs=1)
    finals, every = run(e, batch, params)
    for prompt, final, outs in zip(batch, finals, every, strict=True):
        assert_prompt_logprobs(final.prompt_logprobs, hf_prompt_logprobs(tiny_hf, prompt), prompt, 1e-4)
        # Once on the first output with tokens, again on the final one, never in between.
        carrying = [i for i, o in enumerate(outs) if o.prompt_logprobs is not None]
        first = next(i for i, o in enumerate(outs) if o.new_token_ids)
        assert carrying == sorted({first, len(outs) - 1})
        assert final.usage.cached_tokens == 0
        # Per-step logprobs: one per new token, their concatenation is the final list.
        assert [lp for o in outs for lp in o.new_logprobs] == final.logprobs
        assert [lp.token_id for lp in final.logprobs] == final.token_ids
    if mode == "preempt":
        assert e.stats.num_preemptions > 0
    assert_whole(e)


def test_a_cached_prompt_gives_the_same_prompt_logprobs(tiny_llama, tiny_hf):
    prompt = random_tokens(37, 5, VOCAB)
    e = engine(tiny_llama)
    params = SamplingParams(max_tokens=2, prompt_logprobs=TOP)
    [first] = e.generate([prompt], params)
    [plain] = e.generate([prompt], SamplingParams(max_tokens=2))
    assert plain.usage.cached_tokens > 0  # the first request's blocks were stored in the prefix cache
    [second] = e.generate([prompt], params)
    assert second.usage.cached_tokens == 0  # ... but a request asking for prompt logprobs computes its prompt
    assert second.prompt_logprobs == first.prompt_logprobs
    assert_prompt_logprobs(second.prompt_logprobs, hf_prompt_logprobs(tiny_hf, prompt), prompt, 1e-4)
    assert first.token_ids == second.token_ids == plain.token_ids


def test_prefill_engine_handoff_carries_prompt_logprobs(tiny_llama, tiny_hf):
    prompt = random_tokens(30, 9, VOCAB)
    params = SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=TOP, logprobs=2)
    out = prefill_first(engine(tiny_llama), "r", prompt, params)
    assert out.handoff and out.new_token_ids == out.token_ids and len(out.new_logprobs) == 1
    assert_prompt_logprobs(out.prompt_logprobs, hf_prompt_logprobs(tiny_hf, prompt), prompt, 1e-4)


def test_prompt_logprobs_bounded(tiny_llama):
    e = engine(tiny_llama)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        e.add_request(None, [5, 6], SamplingParams(prompt_logprobs=SamplingParams.MAX_LOGPROBS + 1))
    with pytest.raises(InvalidRequestError, match="logit_bias token id 320"):
        e.add_request(None, [5, 6], SamplingParams(logit_bias={320: 1.0}))
    assert not e.has_unfinished()


# --- logit_bias against transformers ------------------------------------------------------------------------


def hf_biased_greedy(hf, prompt: list[int], n: int, bias: dict[int, float]) -> list[int]:  # type: ignore[no-untyped-def]
    """transformers' greedy `n` tokens with `bias` added to the logits; memoised as `hf_greedy` is."""
    question = [list(prompt), n, sorted(bias.items()), inspect.getsource(_hf_biased_greedy)]
    return oracle_memo.remember("biased-greedy", lambda: oracle_memo.model_key(hf), question,
                                lambda: _hf_biased_greedy(hf, prompt, n, bias))


def _hf_biased_greedy(hf, prompt: list[int], n: int, bias: dict[int, float]) -> list[int]:  # type: ignore[no-untyped-def]
    from transformers import LogitsProcessor, LogitsProcessorList

    ids_t = torch.tensor(list(bias), dtype=torch.long)
    vals = torch.tensor(list(bias.values()), dtype=torch.float32)

    class Bias(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            scores = scores.clone()
            scores[:, ids_t] += vals.to(scores.dtype)
            return scores

    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, eos_token_id=None, pad_token_id=0,
                          logits_processor=LogitsProcessorList([Bias()]))
    return out[0, len(prompt):].tolist()


def assert_same_biased_greedy(hf, prompt: list[int], ours: list[int], ref: list[int],  # type: ignore[no-untyped-def]
                              bias: dict[int, float]) -> None:
    """Equal, or equal up to a position where the oracle's biased logits are at a near-tie."""
    assert len(ours) == len(ref)
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            with torch.inference_mode():
                logits = hf(torch.tensor([prompt + ref[:i]])).logits[0, -1].float()
            for t, v in bias.items():
                logits[t] += v
            top = logits.topk(2).values
            assert float(top[0] - top[1]) < NEAR_TIE, f"token {i} differs (ours {a}, oracle {b})"
            return


def biases(prompt: list[int]) -> dict[int, float]:
    """A bias that matters: favour two tokens of the prompt moderately, ban a third, nudge a fourth."""
    return {prompt[0]: 4.0, prompt[-1]: 2.5, prompt[1]: -100.0, 7: 1.5}


@pytest.mark.parametrize("speculative", [None, "ngram", "suffix"])
def test_greedy_logit_bias_matches_transformers(tiny_llama, tiny_hf, speculative):
    batch = [random_tokens(n, 100 + n, VOCAB) for n in (3, 9, 24, 41)]
    n = 24
    e = engine(tiny_llama, speculative=speculative, num_speculative_tokens=4, adaptive_speculation=False,
               max_num_batched_tokens=32)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, logit_bias=biases(p), logprobs=1) for p in batch]
    outs = e.generate(batch, params)
    for p, out in zip(batch, outs, strict=True):
        ref = hf_biased_greedy(tiny_hf, p, n, biases(p))
        assert_same_biased_greedy(tiny_hf, p, out.token_ids, ref, biases(p))
        assert p[1] not in out.token_ids  # banned
    if speculative is not None:
        plain = engine(tiny_llama, max_num_batched_tokens=32).generate(batch, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
        for o, ref_out in zip(outs, plain, strict=True):
            assert [lp.logprob for lp in o.logprobs] == pytest.approx([lp.logprob for lp in ref_out.logprobs], abs=1e-4)
        assert e.stats.spec_accepted_tokens > 0  # the biased runs repeat: guesses were accepted
    assert_whole(e)


# --- SmolLM2 ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_case(smollm2_oracle):
    return smollm2_oracle.loaded, smollm2_oracle.tok, smollm2_oracle.hf


@pytest.mark.smollm2
def test_smollm2_prompt_logprobs_match_transformers(smollm2_case):
    loaded, tok, hf = smollm2_case
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in
               ("What is the capital of France?", "Write one sentence about rivers and the sea, please.")]
    e = LLMEngine(loaded, tok, EngineConfig(max_num_batched_tokens=16, num_kv_blocks=128))
    params = SamplingParams(max_tokens=4, prompt_logprobs=TOP)
    finals, _ = run(e, prompts, params)
    for p, out in zip(prompts, finals, strict=True):
        assert_prompt_logprobs(out.prompt_logprobs, hf_prompt_logprobs(hf, p), p, 1e-3)
    again, _ = run(e, prompts[:1], params)  # the prefix cache holds it now
    assert again[0].prompt_logprobs is not None
    assert [lp.logprob for lp in again[0].prompt_logprobs[1:]] == pytest.approx(
        [lp.logprob for lp in finals[0].prompt_logprobs[1:]], abs=1e-5)


@pytest.mark.smollm2
@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_smollm2_greedy_logit_bias_matches_transformers(smollm2_case, speculative):
    loaded, tok, hf = smollm2_case
    prompt = tok.encode_chat([{"role": "user", "content": "Name three colours."}])
    favourite = int(hf_logits(hf, prompt)[-1].topk(3).indices[2])  # the third choice
    bias = {favourite: 8.0, tok.encode(" the", add_special_tokens=False)[0]: -100.0}
    n = 16
    e = LLMEngine(loaded, tok, EngineConfig(num_kv_blocks=128, speculative=speculative))
    [out] = e.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True, logit_bias=bias))
    ref = hf_biased_greedy(hf, prompt, n, bias)
    assert ref[0] == favourite
    assert_same_biased_greedy(hf, prompt, out.token_ids, ref, bias)


def test_prompt_logprobs_of_a_long_chunk_are_taken_a_slice_at_a_time(tiny_llama, tiny_hf, monkeypatch):
    import deepinfer.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "_PROMPT_LOGPROB_ROWS", 3)  # 70 positions in one chunk: many slices
    prompt = random_tokens(70, 70, VOCAB)
    [out] = engine(tiny_llama, max_num_batched_tokens=512).generate([prompt], SamplingParams(max_tokens=1,
                                                                                            prompt_logprobs=TOP))
    assert_prompt_logprobs(out.prompt_logprobs, hf_prompt_logprobs(tiny_hf, prompt), prompt, 1e-4)
