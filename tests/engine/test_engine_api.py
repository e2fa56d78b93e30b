"""The in-process engine API: lifecycle, aborts, limits, bad input and failure handling."""

from __future__ import annotations

import pytest

from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import FinishReason, InvalidRequestError, SamplingParams


def make_engine(tiny_llama, **kw) -> LLMEngine:
    cfg = dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=32)
    cfg.update(kw)
    return LLMEngine(tiny_llama, None, EngineConfig(**cfg))


def drain(engine: LLMEngine) -> dict[str, list]:
    """Run to completion; every output per request, in order."""
    seen: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen


def assert_ended_once(seen: dict[str, list]) -> None:
    for rid, outs in seen.items():
        assert [o.finished for o in outs].count(True) == 1, rid
        assert outs[-1].finished, rid


def test_finish_reasons_length_and_stop_token(tiny_llama):
    engine = make_engine(tiny_llama)
    [free] = [engine.num_free_blocks]
    greedy = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert greedy.finish_reason == FinishReason.LENGTH and len(greedy.token_ids) == 6
    stop_at = greedy.token_ids[3]
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=6, stop_token_ids=[stop_at], ignore_eos=True))[0]
    first = greedy.token_ids.index(stop_at)
    assert out.finish_reason == FinishReason.STOP and out.token_ids == greedy.token_ids[: first + 1]
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == first + 1
    assert engine.num_free_blocks == free


def test_context_limit_ends_with_length(tiny_llama):
    engine = make_engine(tiny_llama, max_model_len=20)
    out = engine.generate([list(range(3, 18))], SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert out.finish_reason == FinishReason.LENGTH
    assert out.usage.prompt_tokens + out.usage.completion_tokens == 20


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        (list(range(3, 40)), SamplingParams(), "context limit"),
        ([5, 320], SamplingParams(), "outside the vocabulary"),
        ([5, -1], SamplingParams(), "outside the vocabulary"),
        ([], SamplingParams(), "empty"),
        ([5], SamplingParams(max_tokens=0), "max_tokens"),
        ([5], SamplingParams(temperature=-1), "temperature"),
        ([5], SamplingParams(top_p=0.0), "top_p"),
        ([5], SamplingParams(top_k=-5), "top_k"),
        ([5], SamplingParams(min_p=1.5), "min_p"),
        ([5], SamplingParams(temperature=float("nan")), "temperature"),
        ([5], SamplingParams(stop_token_ids=[999]), "outside the vocabulary"),
        ([5], SamplingParams(logprobs=1000), "logprobs"),
        ([5], SamplingParams(stop=["x"]), "tokenizer"),
    ],
)
def test_bad_input_is_refused_and_engine_keeps_serving(tiny_llama, prompt, params, match):
    engine = make_engine(tiny_llama, max_model_len=32)
    with pytest.raises(InvalidRequestError, match=match):
        engine.add_request("bad", prompt, params)
    assert not engine.has_unfinished() and engine.num_free_blocks == 64
    out = engine.generate([[5, 6]], SamplingParams(max_tokens=3))[0]
    assert len(out.token_ids) == 3


def test_text_prompt_without_tokenizer_is_refused(tiny_llama):
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        make_engine(tiny_llama).add_request(None, "hello", SamplingParams())


def test_duplicate_request_id_is_refused(tiny_llama):
    engine = make_engine(tiny_llama)
    engine.add_request("a", [5], SamplingParams())
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("a", [6], SamplingParams())


def test_generate_is_all_or_nothing(tiny_llama):
    engine = make_engine(tiny_llama, max_model_len=16)
    with pytest.raises(InvalidRequestError):
        engine.generate([[5, 6], list(range(3, 30))], SamplingParams())
    assert not engine.has_unfinished() and engine.num_free_blocks == 64


def test_abort_at_every_point_frees_blocks_and_ends_once(tiny_llama):
    engine = make_engine(tiny_llama, max_num_batched_tokens=8, max_num_seqs=2)
    p = SamplingParams(max_tokens=20, ignore_eos=True)
    engine.add_request("decoding", [5, 6, 7], p)
    engine.add_request("prefilling", list(range(3, 40)), p)
    engine.add_request("waiting", [9, 9], p)
    seen: dict[str, list] = {}

    def step():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)

    step()
    step()  # "decoding" has tokens, "prefilling" is mid-prefill, "waiting" queued (max_num_seqs=2)
    req = engine.scheduler.requests
    assert req["prefilling"].num_computed_tokens < len(req["prefilling"].prompt_token_ids)
    assert len(req["decoding"].output_token_ids) >= 1 and req["waiting"].block_ids == []
    for rid in ("waiting", "prefilling", "decoding"):
        assert engine.abort(rid)
        assert not engine.abort(rid)  # twice: no second terminal event
    assert engine.num_free_blocks == 64  # freed at once, before the next step
    engine.pool.check_integrity()
    step()
    assert not engine.has_unfinished()
    assert_ended_once(seen)
    assert {rid: outs[-1].finish_reason for rid, outs in seen.items()} == {
        rid: FinishReason.ABORT for rid in ("waiting", "prefilling", "decoding")
    }
    assert not engine.abort("never-existed")


def test_failed_step_fails_its_requests_and_engine_recovers(tiny_llama, monkeypatch):
    engine = make_engine(tiny_llama)
    engine.add_request("a", [5, 6], SamplingParams(max_tokens=4))
    engine.add_request("b", [7], SamplingParams(max_tokens=4))

    def boom(_):
        raise RuntimeError("device fell over")

    with monkeypatch.context() as m:
        m.setattr(engine.runner, "execute", boom)
        outs = engine.step()
    assert {o.request_id: (o.finished, o.finish_reason) for o in outs} == {
        "a": (True, FinishReason.ERROR), "b": (True, FinishReason.ERROR)
    }
    assert all("device fell over" in o.error for o in outs)
    assert engine.num_free_blocks == 64 and not engine.has_unfinished()
    assert len(engine.generate([[5]], SamplingParams(max_tokens=2))[0].token_ids) == 2


def test_seeded_sampling_is_independent_of_batch(tiny_llama):
    p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    alone = make_engine(tiny_llama).generate([[5, 6, 7]], p)[0].token_ids
    noisy = SamplingParams(max_tokens=12, temperature=1.5, ignore_eos=True)
    batch = make_engine(tiny_llama).generate([[8, 9], [5, 6, 7], [10] * 9], [noisy, p, noisy])
    assert batch[1].token_ids == alone
    other = make_engine(tiny_llama).generate([[5, 6, 7]], SamplingParams(**{**p.__dict__, "seed": 43}))[0]
    assert other.token_ids != alone


def test_seeded_sampling_survives_preemption(tiny_llama):
    p = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in (10, 12, 14, 16)]
    roomy = make_engine(tiny_llama).generate(prompts, p)
    tight_engine = make_engine(tiny_llama, num_kv_blocks=16)
    tight = tight_engine.generate(prompts, p)
    assert tight_engine.stats.num_preemptions > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]


def test_logprobs_are_returned(tiny_llama):
    out = make_engine(tiny_llama).generate([[5, 6]], SamplingParams(max_tokens=3, logprobs=2))[0]
    assert len(out.logprobs) == 3
    for token, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == token and lp.logprob <= 0 and len(lp.top) == 2
        assert lp.top[0][0] == token  # greedy: the chosen token is the best


def test_priority_is_served_first(tiny_llama):
    engine = make_engine(tiny_llama, max_num_seqs=1)
    engine.add_request("low", [5], SamplingParams(max_tokens=2), priority=1)
    engine.add_request("high", [6], SamplingParams(max_tokens=2), priority=0)
    first = engine.step()
    assert [o.request_id for o in first] == ["high"]


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        LLMEngine.load(tmp_path / "nope")
