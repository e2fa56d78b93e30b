"""Prefill/decode handoff between two engines on the same weights.

A prefill engine runs prompts with `prefill_only=True`, samples the first token and holds the prompt's
blocks; the test moves them with `export_kv` into a decode engine (its own pool, of another size,
so the copy lands in other block ids) through `reserve` + `add_prefilled_request`, then `release`s
them. Outputs must equal a single engine's and transformers', through chunked prefill, decode-side
preemption and seeded sampling; every path (first token ends the request, lease expiry, short pool,
aborts, malformed KV) must leave both pools whole.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import pytest
import torch

from deepinfer.cache.block_pool import BlockPool, NoFreeBlocksError
from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.handoff import HandoffError, Reservations, blocks_for
from deepinfer.engine.request import FinishReason, InvalidRequestError, RequestOutput, SamplingParams
from tests.engine.oracle import assert_same_greedy, hf_greedy

NEW_TOKENS = 32
BLOCK = 4  # the tiny engines' block size
LENGTHS = [1, 4, 5, 9, 16, 17, 31, 48, 70]  # multiples of BLOCK too: the first token's KV opens a block
PREFILL_MODES = {
    "ample": dict(num_kv_blocks=128, max_num_batched_tokens=512),
    "chunked": dict(num_kv_blocks=128, max_num_batched_tokens=24),  # the longer prompts take 2-3 steps
}
DECODE_MODES = {
    "ample": dict(num_kv_blocks=200, max_num_batched_tokens=512),
    # 9 sequences growing to 33-102 tokens in 40 blocks of 4: preemption is certain.
    "preempt": dict(num_kv_blocks=40, max_num_batched_tokens=512),
}


def batch_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(n)] for n in LENGTHS]


def engine(loaded, tokenizer=None, clock=time.monotonic, **kw) -> LLMEngine:  # type: ignore[no-untyped-def]
    cfg = dict(block_size=BLOCK, num_kv_blocks=64, max_num_batched_tokens=64)
    cfg.update(kw)
    return LLMEngine(loaded, tokenizer, EngineConfig(**cfg), clock=clock)


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class LetterTokenizer:
    """Decodes id i as one letter, 'a' + i % 26: enough for the detokenizer and stop strings."""

    eos_token_ids = (2,)
    fingerprint = "letters"  # names the tokenizer in the engine's cache namespace

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def assert_whole(*engines: LLMEngine) -> None:
    """Nothing held, reserved, queued or leaked."""
    for e in engines:
        assert not e.has_unfinished() and e.num_held == 0 and len(e.reservations) == 0
        assert e.num_free_blocks == e.pool.num_blocks
        assert e.swap_policy is None or e.swap_policy.used_blocks == 0
        e.pool.check_integrity()


def prefill_first(prefill: LLMEngine, rid: str, prompt: list[int], params: SamplingParams) -> RequestOutput:
    """Run one prefill-only request to its (only) output."""
    prefill.add_request(rid, prompt, params, prefill_only=True)
    while True:
        outs = prefill.step()
        if outs:
            [out] = outs
            assert out.finished
            return out


def drain(e: LLMEngine) -> dict[str, list[RequestOutput]]:
    seen: dict[str, list[RequestOutput]] = {}
    while e.has_unfinished():
        for out in e.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen


def run_disaggregated(
    prefill: LLMEngine, decode: LLMEngine, batch: list[list[int]], params: Sequence[SamplingParams],
) -> tuple[dict[int, RequestOutput], list[tuple[list[int], list[int]]]]:
    """Every prompt prefill-only on `prefill`; each handoff reserved on `decode` (retried after a
    decode step while its pool is short), exported, added and released. Both engines step in turn
    until every request has ended. Returns final outputs by prompt index and, per handoff, the
    prefill-side and decode-side block ids of the prompt's KV.

    Both pools would hand out the same ids in the same order; a 3-block reservation held on the
    decode side throughout shifts its ids, so the copy has to relocate every block."""
    assert decode.reserve("ballast", 3, lease_s=3600.0)
    for i, p in enumerate(batch):
        prefill.add_request(f"p{i}", p, params[i], prefill_only=True)
    finals: dict[int, RequestOutput] = {}
    ready: list[RequestOutput] = []
    moves: list[tuple[list[int], list[int]]] = []
    for _ in range(10_000):
        if not (prefill.has_unfinished() or decode.has_unfinished() or ready):
            break
        for out in prefill.step():
            assert out.finished
            if out.handoff:
                assert out.finish_reason is None and out.new_token_ids == out.token_ids
                ready.append(out)
            else:
                finals[int(out.request_id[1:])] = out
        waiting = []
        for out in ready:
            rid, i = out.request_id, int(out.request_id[1:])
            if not decode.reserve(rid, blocks_for(len(batch[i]), decode.config.block_size), lease_s=60.0):
                waiting.append(out)
                continue
            src = list(prefill.scheduler.held[rid].block_ids)
            dst = list(decode.reservations.get(rid).block_ids)
            first_logprob = out.logprobs[0] if out.logprobs else None
            decode.add_prefilled_request(rid, batch[i], out.new_token_ids[0], params[i], prefill.export_kv(rid),
                                         reservation_id=rid, first_logprob=first_logprob)
            assert prefill.release(rid)
            moves.append((src, dst))
        ready = waiting
        for out in decode.step():
            if out.finished:
                finals[int(out.request_id[1:])] = out
    else:
        pytest.fail("the handoff loop did not finish")
    assert decode.cancel_reservation("ballast")
    return finals, moves


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):  # type: ignore[no-untyped-def]
    import transformers

    return transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir).eval()


@pytest.fixture(scope="module")
def greedy_refs(tiny_llama, hf):  # type: ignore[no-untyped-def]
    batch = batch_prompts()
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    single = engine(tiny_llama, num_kv_blocks=256, max_num_batched_tokens=512).generate(batch, params)
    return batch, [o.token_ids for o in single], [hf_greedy(hf, p, NEW_TOKENS) for p in batch]


# -- the handoff itself -----------------------------------------------------------------------


def test_handoff_output_and_export(tiny_llama):
    prefill = engine(tiny_llama)
    prompt = list(range(3, 12))  # 9 tokens: 3 blocks, the last with one token
    out = prefill_first(prefill, "r", prompt, SamplingParams(max_tokens=8, logprobs=2))
    assert out.handoff and out.finished and out.finish_reason is None and out.text is None
    assert out.new_token_ids == out.token_ids and len(out.token_ids) == 1
    assert out.usage.prompt_tokens == 9 and out.usage.completion_tokens == 1
    assert len(out.logprobs) == 1 and out.logprobs[0].token_id == out.token_ids[0]
    assert prefill.num_held == 1 and prefill.held_request_ids == ["r"] and not prefill.has_unfinished()
    assert prefill.stats.handoffs_out == 1
    held = prefill.scheduler.held["r"].block_ids
    assert held == [0, 1, 2] and prefill.num_free_blocks == 61
    assert prefill.step() == []  # held: never scheduled again
    kv = prefill.export_kv("r")
    assert kv.shape == (3, *prefill.runner.kv.shape[1:]) and kv.is_contiguous()
    torch.testing.assert_close(kv[:2], prefill.runner.kv[held[:2]], rtol=0, atol=0)
    torch.testing.assert_close(kv[2, :, :, :1], prefill.runner.kv[held[2], :, :, :1], rtol=0, atol=0)
    assert kv[2, :, :, 1:].abs().sum() == 0  # slots past the prompt do not travel
    assert kv[:, :, :, 0].abs().sum() > 0
    kv.fill_(7.0)  # a copy: the engine's KV is untouched
    assert prefill.export_kv("r")[0].ne(7.0).all()
    with pytest.raises(InvalidRequestError, match="already in use"):
        prefill.add_request("r", [5], SamplingParams())  # the id stays taken while held
    assert prefill.release("r") and not prefill.release("r")
    with pytest.raises(HandoffError, match="not held"):
        prefill.export_kv("r")
    assert not prefill.release("never-existed")
    assert_whole(prefill)


@pytest.mark.parametrize("prefill_mode, decode_mode", [("ample", "ample"), ("chunked", "preempt"),
                                                       ("ample", "preempt")])
def test_greedy_through_handoff_matches_single_engine_and_transformers(
    tiny_llama, hf, greedy_refs, prefill_mode, decode_mode
):
    batch, single, refs = greedy_refs
    prefill = engine(tiny_llama, **PREFILL_MODES[prefill_mode])
    decode = engine(tiny_llama, **DECODE_MODES[decode_mode])
    params = [SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)] * len(batch)
    finals, moves = run_disaggregated(prefill, decode, batch, params)
    for i, p in enumerate(batch):
        assert finals[i].finish_reason == FinishReason.LENGTH and not finals[i].handoff
        assert finals[i].token_ids == single[i], i
        assert finals[i].usage.prompt_tokens == len(p) and finals[i].usage.completion_tokens == NEW_TOKENS
        assert_same_greedy(hf, p, finals[i].token_ids, refs[i])
    assert len(moves) == len(batch)
    assert all(src != dst for src, dst in moves)  # the KV really moved to other blocks
    assert prefill.stats.handoffs_out == decode.stats.handoffs_in == len(batch)
    if prefill_mode == "chunked":
        assert prefill.stats.num_steps > len(batch) // 3  # the long prompts took several steps
    if decode_mode == "preempt":
        assert decode.stats.num_preemptions > 0
    assert_whole(prefill, decode)


@pytest.mark.parametrize("decode_mode", list(DECODE_MODES))
def test_seeded_sampling_through_handoff_matches_single_engine(tiny_llama, decode_mode):
    batch = batch_prompts(seed=3)
    kinds = [
        dict(temperature=1.0),
        dict(temperature=0.8, top_p=0.9),
        dict(temperature=1.2, top_k=20, logprobs=3),
        dict(temperature=1.0, min_p=0.05, repetition_penalty=1.3),
        dict(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.5, logprobs=0),
        dict(temperature=0.0, repetition_penalty=1.5),  # greedy with a penalty over the first token too
    ]
    params = [SamplingParams(max_tokens=20, ignore_eos=True, seed=100 + i, **kinds[i % len(kinds)])
              for i in range(len(batch))]
    single = engine(tiny_llama, num_kv_blocks=256, max_num_batched_tokens=512).generate(batch, params)
    prefill = engine(tiny_llama, **PREFILL_MODES["chunked"])
    decode = engine(tiny_llama, **DECODE_MODES[decode_mode])
    finals, _ = run_disaggregated(prefill, decode, batch, params)
    for i, ref in enumerate(single):
        assert finals[i].token_ids == ref.token_ids, i
        if params[i].logprobs is not None:
            assert [lp.token_id for lp in finals[i].logprobs] == ref.token_ids
            assert [lp.logprob for lp in finals[i].logprobs] == pytest.approx([lp.logprob for lp in ref.logprobs],
                                                                              abs=1e-5)
    if decode_mode == "preempt":
        assert decode.stats.num_preemptions > 0
    assert_whole(prefill, decode)


def test_detokenizer_on_the_decode_side_includes_the_first_token(tiny_llama):
    tok = LetterTokenizer()
    prompt = list(range(3, 14))
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    single = engine(tiny_llama, tok).generate([prompt], greedy)[0]
    prefill, decode = engine(tiny_llama, tok), engine(tiny_llama, tok, num_kv_blocks=30)
    first = prefill_first(prefill, "r", prompt, greedy).token_ids[0]
    assert first == single.token_ids[0]
    kv = prefill.export_kv("r")
    decode.add_prefilled_request("r", prompt, first, greedy, kv)
    assert prefill.release("r")
    outs = drain(decode)["r"]
    # new_token_ids never repeat the first token; the final output covers the whole answer.
    assert [t for o in outs for t in o.new_token_ids] == single.token_ids[1:]
    assert outs[-1].token_ids == single.token_ids and outs[-1].text == single.text == tok.decode(single.token_ids)
    # A stop string spanning the first and second tokens is found: the first token is in the text.
    stop = SamplingParams(max_tokens=6, ignore_eos=True, stop=[tok.decode(single.token_ids[:2])])
    decode.add_prefilled_request("s", prompt, first, stop, kv)
    [out] = [o for o in drain(decode)["s"] if o.finished]
    assert out.finish_reason == FinishReason.STOP and out.token_ids == single.token_ids[:2] and out.text == ""
    assert_whole(prefill, decode)


# -- the first token ends the request ---------------------------------------------------------


@pytest.mark.parametrize("case", ["max_tokens", "stop_token", "eos", "stop_string"])
def test_first_token_ending_the_request_finishes_on_the_prefill_side(tiny_llama, case):
    tok = LetterTokenizer()
    prompt = [5, 6, 7, 8, 9]
    first = engine(tiny_llama).generate([prompt], SamplingParams(max_tokens=1))[0].token_ids[0]
    prefill = engine(tiny_llama, tok)
    params = {
        "max_tokens": SamplingParams(max_tokens=1),
        "stop_token": SamplingParams(max_tokens=8, stop_token_ids=[first]),
        "eos": SamplingParams(max_tokens=8),
        "stop_string": SamplingParams(max_tokens=8, stop=[tok.decode([first])]),
    }[case]
    if case == "eos":
        prefill.eos_token_ids = (first,)
    out = prefill_first(prefill, "r", prompt, params)
    assert not out.handoff and out.token_ids == [first]
    assert out.finish_reason == (FinishReason.LENGTH if case == "max_tokens" else FinishReason.STOP)
    assert prefill.num_held == 0 and not prefill.release("r") and prefill.stats.handoffs_out == 0
    with pytest.raises(HandoffError):
        prefill.export_kv("r")
    assert_whole(prefill)


@pytest.mark.parametrize("case", ["max_tokens", "stop_token", "eos", "stop_string", "context_limit"])
def test_first_token_ending_the_request_finishes_on_the_decode_side(tiny_llama, case):
    tok = LetterTokenizer()
    prompt = list(range(3, 12))
    prefill = engine(tiny_llama, tok)
    out = prefill_first(prefill, "r", prompt, SamplingParams(max_tokens=8))
    first, kv = out.token_ids[0], prefill.export_kv("r")
    assert prefill.release("r")
    decode = engine(tiny_llama, tok, num_kv_blocks=20, max_model_len=10 if case == "context_limit" else None)
    params = {
        "max_tokens": SamplingParams(max_tokens=1),
        "stop_token": SamplingParams(max_tokens=8, stop_token_ids=[first]),
        "eos": SamplingParams(max_tokens=8),
        "stop_string": SamplingParams(max_tokens=8, stop=[tok.decode([first])]),
        "context_limit": SamplingParams(max_tokens=8),
    }[case]
    if case == "eos":
        decode.eos_token_ids = (first,)
    assert decode.reserve("r", 5, lease_s=10.0)
    decode.add_prefilled_request("r", prompt, first, params, kv, reservation_id="r")
    assert decode.num_free_blocks == 20 and "r" not in decode.reservations  # freed at once
    [end] = decode.step()
    assert end.finished and not end.handoff and end.new_token_ids == [] and end.token_ids == [first]
    assert end.finish_reason == (FinishReason.STOP if case in ("stop_token", "eos", "stop_string")
                                 else FinishReason.LENGTH)
    assert end.usage.completion_tokens == 1
    if case == "stop_string":
        assert end.text == ""
    assert decode.step() == []
    assert_whole(prefill, decode)


# -- reservations -----------------------------------------------------------------------------


def test_reservations_pure_exact_blocks_and_leases():
    pool = BlockPool(8)
    res = Reservations(pool)
    assert res.reserve("a", 3, lease_s=5.0, now=100.0)
    assert res.reserve("b", 2, lease_s=1.0, now=101.0)
    assert res.get("a").block_ids == [0, 1, 2] and res.get("b").block_ids == [3, 4]
    assert not res.reserve("c", 4, lease_s=5.0, now=101.0)  # 3 free: refused, nothing changed
    assert pool.num_free == 3 and res.ids == ["a", "b"] and res.num_blocks == 5
    with pytest.raises(HandoffError, match="already in use"):
        res.reserve("a", 1, lease_s=5.0, now=101.0)
    for n, lease in ((0, 5.0), (1, 0.0), (1, float("inf")), (1, float("nan"))):
        with pytest.raises(HandoffError):
            res.reserve("d", n, lease_s=lease, now=101.0)
    assert res.expire(101.999) == []
    assert res.expire(105.0) == ["b", "a"]  # a lease ends at its deadline; earliest deadline first
    assert pool.num_free == 8 and len(res) == 0
    assert pool.allocate(8) == [5, 6, 7, 4, 3, 2, 1, 0]  # b then a went back, each in reverse
    pool.free(range(8))
    assert res.reserve("e", 2, lease_s=1.0, now=0.0)
    assert res.take("e") == [0, 1] and "e" not in res
    assert pool.num_free == 6  # taken blocks now belong to the caller
    assert not res.cancel("e") and res.expire(1e9) == []
    with pytest.raises(HandoffError, match="unknown or expired"):
        res.take("e")
    pool.check_integrity()


def test_reservation_lease_expires_on_the_engine_clock(tiny_llama):
    clock = Clock(100.0)
    decode = engine(tiny_llama, num_kv_blocks=16, clock=clock)
    assert decode.reserve("a", 3, lease_s=5.0)  # until 105 on the engine clock
    assert decode.reserve("b", 2, lease_s=10.0, now=101.0)  # until 111
    assert decode.num_free_blocks == 11 and decode.num_reserved_blocks == 5
    assert decode.expire_reservations(104.999) == []
    clock.t = 105.0
    assert decode.step() == []  # the step loop expires leases itself
    assert decode.num_free_blocks == 14 and decode.reservations.ids == ["b"]
    assert decode.stats.reservations_expired == 1
    assert decode.expire_reservations(111.0) == ["b"]
    # The KV of an expired reservation arrives late: refused, nothing changes.
    prefill = engine(tiny_llama)
    prompt = list(range(3, 12))
    out = prefill_first(prefill, "a", prompt, SamplingParams(max_tokens=4))
    with pytest.raises(HandoffError, match="unknown or expired reservation 'a'"):
        decode.add_prefilled_request("a", prompt, out.token_ids[0], SamplingParams(max_tokens=4),
                                     prefill.export_kv("a"), reservation_id="a")
    assert prefill.release("a")
    assert_whole(prefill, decode)


def test_reservation_refused_when_the_pool_is_short(tiny_llama):
    decode = engine(tiny_llama, num_kv_blocks=10)
    assert not decode.reserve("big", 11, lease_s=5.0)
    assert decode.num_free_blocks == 10 and len(decode.reservations) == 0
    decode.add_request("busy", list(range(3, 30)), SamplingParams(max_tokens=4))
    decode.step()  # 27 prompt tokens: 7 blocks
    assert decode.num_free_blocks == 3
    assert not decode.reserve("r", 4, lease_s=5.0)  # never preempts the running request
    assert decode.num_free_blocks == 3 and decode.scheduler.requests["busy"].num_preemptions == 0
    assert decode.reserve("r", 3, lease_s=5.0) and decode.num_free_blocks == 0
    assert decode.cancel_reservation("r") and not decode.cancel_reservation("r")
    drain(decode)
    assert_whole(decode)


def test_without_a_reservation_blocks_come_from_the_pool_or_the_add_is_refused(tiny_llama):
    prefill = engine(tiny_llama)
    prompt = list(range(3, 20))  # 17 tokens: 5 blocks
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    out = prefill_first(prefill, "r", prompt, params)
    kv = prefill.export_kv("r")
    decode = engine(tiny_llama, num_kv_blocks=6)
    assert decode.reserve("ballast", 2, lease_s=60.0)
    with pytest.raises(NoFreeBlocksError, match="needs 5 blocks, 4 free"):
        decode.add_prefilled_request("r", prompt, out.token_ids[0], params, kv)
    assert decode.num_free_blocks == 4 and not decode.has_unfinished()
    assert decode.cancel_reservation("ballast")
    decode.add_prefilled_request("r", prompt, out.token_ids[0], params, kv)
    assert decode.scheduler.requests["r"].block_ids == [2, 3, 4, 5, 1]  # exactly the prompt's, from the pool
    assert decode.num_free_blocks == 1
    assert drain(decode)["r"][-1].token_ids == engine(tiny_llama).generate([prompt], params)[0].token_ids
    assert prefill.release("r")
    assert_whole(prefill, decode)


def test_extra_reserved_blocks_stay_with_the_request_up_to_its_longest_output(tiny_llama):
    prefill = engine(tiny_llama)
    prompt = list(range(3, 12))  # 9 tokens: 3 blocks
    # At most 9 + 6 = 15 tokens, of which the first 14 get KV: 4 blocks are all it can ever use.
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    out = prefill_first(prefill, "r", prompt, params)
    decode = engine(tiny_llama, num_kv_blocks=16)
    assert decode.reserve("res", 6, lease_s=60.0)
    assert decode.reservations.get("res").block_ids == [0, 1, 2, 3, 4, 5]
    decode.add_prefilled_request("r", prompt, out.token_ids[0], params, prefill.export_kv("r"),
                                 reservation_id="res")
    assert prefill.release("r")
    req = decode.scheduler.requests["r"]
    assert req.block_ids == [0, 1, 2, 3] and req.num_computed_tokens == 9 and req.output_token_ids == out.token_ids
    assert decode.num_free_blocks == 12 and "res" not in decode.reservations
    assert decode.pool.allocate(12)[-2:] == [5, 4]  # the two surplus blocks went back, tail first
    decode.pool.free(range(6, 16))
    decode.pool.free([4, 5])
    while decode.has_unfinished():
        decode.step()
        assert req.is_finished or req.block_ids == [0, 1, 2, 3]  # grew into its own blocks only
    assert req.finish_reason == FinishReason.LENGTH and len(req.output_token_ids) == 6
    assert_whole(prefill, decode)


def test_too_small_reservation_is_refused_and_kept(tiny_llama):
    prefill = engine(tiny_llama)
    prompt = list(range(3, 12))
    out = prefill_first(prefill, "r", prompt, SamplingParams(max_tokens=4))
    decode = engine(tiny_llama, num_kv_blocks=16)
    assert decode.reserve("r", 2, lease_s=60.0)
    with pytest.raises(HandoffError, match="has 2 blocks; the prompt's KV needs 3"):
        decode.add_prefilled_request("r", prompt, out.token_ids[0], SamplingParams(max_tokens=4),
                                     prefill.export_kv("r"), reservation_id="r")
    assert decode.reservations.get("r").block_ids == [0, 1] and decode.num_free_blocks == 14
    assert decode.abort("r") and not decode.abort("r")  # a reservation named after its request
    assert prefill.release("r")
    assert_whole(prefill, decode)


# -- aborts -----------------------------------------------------------------------------------


def test_abort_of_held_reserved_and_running_handed_off_requests_frees_everything(tiny_llama):
    prefill = engine(tiny_llama)
    decode = engine(tiny_llama, num_kv_blocks=40)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    prompts = {rid: list(range(3, 3 + n)) for rid, n in (("held", 7), ("running", 13), ("fresh", 6))}
    outs = {rid: prefill_first(prefill, rid, p, params) for rid, p in prompts.items()}
    # Held on the prefill side: freed at once, no second terminal output.
    assert prefill.abort("held") and not prefill.abort("held") and not prefill.release("held")
    assert prefill.step() == [] and prefill.num_held == 2
    # Reserved on the decode side, KV never arrives.
    assert decode.reserve("lost", 4, lease_s=60.0)
    assert decode.abort("lost") and not decode.cancel_reservation("lost")
    # Running on the decode side after the handoff: mid-decode, and just added.
    for rid in ("running", "fresh"):
        assert decode.reserve(rid, 5, lease_s=60.0)
        decode.add_prefilled_request(rid, prompts[rid], outs[rid].token_ids[0], params, prefill.export_kv(rid),
                                     reservation_id=rid)
        assert prefill.release(rid)
        if rid == "running":
            decode.step()
            decode.step()
    assert len(decode.scheduler.requests["running"].output_token_ids) == 3
    assert decode.abort("running") and decode.abort("fresh") and not decode.abort("fresh")
    assert decode.num_free_blocks == 40  # freed before the next step
    [a, b] = decode.step()
    assert {(o.request_id, o.finish_reason, len(o.token_ids)) for o in (a, b)} == {
        ("running", FinishReason.ABORT, 3), ("fresh", FinishReason.ABORT, 1)
    }
    assert_whole(prefill, decode)


# -- refused handoffs -------------------------------------------------------------------------


def test_malformed_handoffs_are_refused_and_nothing_leaks(tiny_llama):
    prefill = engine(tiny_llama)
    prompt = list(range(3, 12))  # 9 tokens: 3 blocks
    params = SamplingParams(max_tokens=4, logprobs=1, ignore_eos=True)
    out = prefill_first(prefill, "r", prompt, params)
    first, kv = out.token_ids[0], prefill.export_kv("r")
    assert prefill.release("r")
    wide = engine(tiny_llama, block_size=8)
    out8 = prefill_first(wide, "w", prompt, params)
    kv8 = wide.export_kv("w")
    assert wide.release("w")
    decode = engine(tiny_llama, num_kv_blocks=16)
    decode.add_request("taken", [5, 6], SamplingParams(max_tokens=40, ignore_eos=True))
    decode.step()
    assert decode.reserve("res", 4, lease_s=60.0)
    free = decode.num_free_blocks
    lp = out.logprobs[0]
    cases = [
        (dict(kv=kv[:2]), HandoffError, r"kv is float32 \(2, 2, 2, 4, 2, 16\); expected float32 \(3, 2, 2, 4, 2, 16\) "
                                        r"\[blocks, layers, kv, block_size, kv_heads, head_dim\]"),
        (dict(kv=torch.cat([kv, kv[:1]])), HandoffError, r"kv is float32 \(4, "),
        (dict(kv=kv8), HandoffError, r"kv is float32 \(2, 2, 2, 8, 2, 16\)"),
        (dict(kv=kv.double()), HandoffError, r"kv is float64 \(3, 2, 2, 4, 2, 16\); expected float32 \(3, "),
        (dict(kv=kv.half()), HandoffError, "kv is float16"),
        (dict(kv=kv.numpy()), HandoffError, "must be a torch.Tensor"),
        (dict(prompt_token_ids=prompt[:-1]), HandoffError, r"kv is float32 \(3, .*expected float32 \(2, "),
        (dict(first_token=320), InvalidRequestError, "first token 320 is outside the vocabulary"),
        (dict(first_token=-1), InvalidRequestError, "outside the vocabulary"),
        (dict(first_logprob=None), HandoffError, "first_logprob"),
        (dict(first_token=(first + 1) % 320), HandoffError, "first_logprob"),
        (dict(prompt_token_ids=[]), InvalidRequestError, "empty"),
        (dict(prompt_token_ids=[5, 400] + prompt[2:]), InvalidRequestError, "outside the vocabulary"),
        (dict(params=SamplingParams(max_tokens=0)), InvalidRequestError, "max_tokens"),
        (dict(params=SamplingParams(stop=["x"])), InvalidRequestError, "tokenizer"),
        (dict(request_id="taken"), InvalidRequestError, "already in use"),
        (dict(reservation_id="nope"), HandoffError, "unknown or expired reservation 'nope'"),
    ]
    for change, error, match in cases:
        args = dict(request_id="r", prompt_token_ids=prompt, first_token=first, params=params, kv=kv,
                    reservation_id="res", first_logprob=lp)
        args.update(change)
        with pytest.raises(error, match=match):
            decode.add_prefilled_request(**args)
        assert decode.num_free_blocks == free and decode.reservations.get("res").block_ids == [1, 2, 3, 4]
        assert set(decode.scheduler.requests) == {"taken"}
    assert out8.token_ids == out.token_ids  # the block size changes the layout, not the model
    # The same call, well formed, goes through: the refusals left the reservation usable.
    decode.add_prefilled_request("r", prompt, first, params, kv, reservation_id="res", first_logprob=lp)
    seen = drain(decode)
    assert seen["r"][-1].token_ids[0] == first and len(seen["r"][-1].logprobs) == 4
    assert seen["r"][-1].logprobs[0] == lp
    assert_whole(prefill, decode)


# -- the real model ---------------------------------------------------------------------------


@pytest.mark.smollm2
def test_smollm2_greedy_through_handoff_matches_single_engine_and_transformers(smollm2_oracle):
    from tests.engine.test_oracle_smollm2 import QUESTIONS

    new_tokens = 16
    loaded, tok, hf = smollm2_oracle.loaded, smollm2_oracle.tok, smollm2_oracle.hf
    batch = smollm2_oracle.chat(QUESTIONS)
    greedy = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    single = LLMEngine(loaded, tok, EngineConfig(kv_cache_bytes=64 * 1024 * 1024)).generate(batch, greedy)
    # Chunked prefill on one side; on the other 24 blocks of 16 for 9 sequences of 48-82 tokens.
    prefill = LLMEngine(loaded, tok, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=40))
    decode = LLMEngine(loaded, tok, EngineConfig(num_kv_blocks=24))
    finals, moves = run_disaggregated(prefill, decode, batch, [greedy] * len(batch))
    for i, p in enumerate(batch):
        assert finals[i].token_ids == single[i].token_ids and finals[i].text == single[i].text, i
        assert_same_greedy(hf, p, finals[i].token_ids, smollm2_oracle.greedy(p, new_tokens))
    assert decode.stats.num_preemptions > 0 and all(src != dst for src, dst in moves)
    assert_whole(prefill, decode)

