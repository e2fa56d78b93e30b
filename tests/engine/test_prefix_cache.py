"""The device tier of the prefix cache, in the engine, against transformers.

A request whose prompt starts with blocks another request computed (or this one, before a
preemption, or another engine, through export and import) takes them instead of computing them. The
greedy tokens must stay transformers' token for token — cold, on a device hit, with chunked prefill,
with preemption, after an import from another tier — and the usage must say exactly how many prompt
tokens came from which tier. Every test leaves the pool whole: nothing held, every block free, the
hash map consistent.
"""

from __future__ import annotations

import random

import pytest

from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.handoff import HandoffError
from deepinfer.engine.request import FinishReason, RequestOutput, SamplingParams
from tests.engine.oracle import assert_same_greedy, hf_greedy

BLOCK = 4
NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
MODES = {
    "ample": dict(num_kv_blocks=128, max_num_batched_tokens=512),
    "chunked": dict(num_kv_blocks=128, max_num_batched_tokens=6),
    # 6 sequences of 20-28 prompt tokens sharing 5 blocks, 13 blocks in all, growing by 4 blocks each
    # in a pool of 30: preemption is certain.
    "preempt": dict(num_kv_blocks=30, max_num_batched_tokens=512),
}


def engine(loaded, **kw) -> LLMEngine:  # type: ignore[no-untyped-def]
    cfg = dict(block_size=BLOCK, num_kv_blocks=64, max_num_batched_tokens=64)
    cfg.update(kw)
    return LLMEngine(loaded, None, EngineConfig(**cfg))


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(n)]


def run(e: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY, **add_kw) -> list[RequestOutput]:
    """Submit every prompt at once and step to the end; final outputs in prompt order."""
    ids = [e.add_request(None, p, params, **add_kw) for p in prompts]
    final: dict[str, RequestOutput] = {}
    while e.has_unfinished():
        for out in e.step():
            if out.finished:
                assert out.request_id not in final
                final[out.request_id] = out
    return [final[i] for i in ids]


def cap(n_prompt: int) -> int:
    """The most prompt tokens a hit can cover: whole blocks, never the last token."""
    return (n_prompt - 1) // BLOCK * BLOCK


def assert_whole(*engines: LLMEngine) -> None:
    for e in engines:
        assert not e.has_unfinished() and e.num_held == 0 and len(e.reservations) == 0
        assert e.num_free_blocks == e.pool.num_blocks
        e.pool.check_integrity()


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):  # type: ignore[no-untyped-def]
    import transformers

    return transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir).eval()


@pytest.fixture(scope="module")
def oracle(hf):  # type: ignore[no-untyped-def]
    """transformers' greedy continuation of a prompt, computed once per prompt."""
    memo: dict[tuple[int, ...], list[int]] = {}

    def greedy(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in memo:
            memo[key] = hf_greedy(hf, prompt, NEW_TOKENS)
        return memo[key]

    return greedy


# -- cold and device hits ---------------------------------------------------------------------


@pytest.mark.parametrize("n_prompt", [3, 16, 23, 37])  # shorter than a block, exact multiple, others
def test_same_prompt_twice_cold_then_device_hit(tiny_llama, hf, oracle, n_prompt):
    e = engine(tiny_llama)
    prompt = tokens(n_prompt, seed=n_prompt)
    [cold] = run(e, [prompt])
    assert (cold.usage.cached_tokens, cold.usage.cached_by_tier) == (0, {})
    [hit] = run(e, [prompt])
    want = cap(n_prompt)
    assert (hit.usage.cached_tokens, hit.usage.cached_by_tier) == (want, {"device": want} if want else {})
    assert hit.token_ids == cold.token_ids
    assert_same_greedy(hf, prompt, hit.token_ids, oracle(prompt))
    assert (e.stats.prefix_lookups, e.stats.prefix_hit_tokens, e.stats.prefix_query_tokens) == (
        2, want, 2 * n_prompt)
    assert e.stats.tokens_computed == 2 * (n_prompt + NEW_TOKENS - 1) - want
    assert_whole(e)


@pytest.mark.parametrize("mode", list(MODES))
def test_shared_prefix_prompts_match_transformers(tiny_llama, hf, oracle, mode):
    stem = tokens(20, seed=1)  # 5 blocks
    # In "chunked" mode the 8-token tail does not fit one step's budget after the hit.
    tails = [tokens(n, seed=10 + n) for n in (0, 1, 3, 4, 5, 8)]
    prompts = [stem + t for t in tails]
    e = engine(tiny_llama, **MODES[mode])
    [first] = run(e, [stem + tokens(2, seed=99)])
    assert first.usage.cached_tokens == 0
    outs = run(e, prompts)
    for p, out in zip(prompts, outs):
        assert out.finish_reason == FinishReason.LENGTH
        # The stem alone is an exact multiple of the block size: its last block is recomputed.
        want = min(20, cap(len(p)))
        assert (out.usage.cached_tokens, out.usage.cached_by_tier) == (want, {"device": want})
        assert_same_greedy(hf, p, out.token_ids, oracle(p))
    if mode == "preempt":
        assert e.stats.num_preemptions > 0
    assert_whole(e)


def test_cold_and_cached_runs_agree_under_preemption(tiny_llama, hf, oracle):
    """The same batch with the cache off and on, in a pool that forces preemption: every
    preempted request refinds what is left of its blocks, and the tokens do not change."""
    stem = tokens(12, seed=2)
    prompts = [stem + tokens(n, seed=20 + n) for n in (1, 6, 9, 13, 17)] + [tokens(15, seed=3)]
    outs = {}
    for caching in (False, True):
        e = engine(tiny_llama, num_kv_blocks=24, enable_prefix_caching=caching)
        outs[caching] = run(e, prompts)
        assert e.stats.num_preemptions > 0
        assert (e.stats.prefix_hit_tokens > 0) == caching
        assert_whole(e)
    for p, off, on in zip(prompts, outs[False], outs[True]):
        assert on.token_ids == off.token_ids
        assert_same_greedy(hf, p, on.token_ids, oracle(p))


def test_a_second_turn_reuses_the_first_turns_answer(tiny_llama, hf, oracle):
    e = engine(tiny_llama)
    turn1 = tokens(13, seed=4)
    [answer] = run(e, [turn1])
    turn2 = turn1 + answer.token_ids + tokens(6, seed=5)
    [out] = run(e, [turn2])
    # Turn 1 computed KV for its prompt and all but its last token: 28 tokens, 7 whole blocks.
    computed = len(turn1) + NEW_TOKENS - 1
    assert out.usage.cached_tokens == computed // BLOCK * BLOCK == 28 > len(turn1)
    assert out.usage.cached_by_tier == {"device": 28}
    assert_same_greedy(hf, turn2, out.token_ids, oracle(turn2))
    assert_whole(e)


def test_final_outputs_name_the_blocks_whose_kv_was_computed(tiny_llama):
    e = engine(tiny_llama)
    prompt = tokens(10, seed=6)
    e.add_request("r", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    outs = []
    while e.has_unfinished():
        outs += e.step()
    assert [o.block_hashes for o in outs[:-1]] == [[]] * (len(outs) - 1)  # only the final output has them
    final = outs[-1]
    # 10 + 4 tokens, the last one without KV: 13 computed, 3 whole blocks.
    assert final.block_hashes == e.block_hashes(prompt + final.token_ids)[:3]
    assert e.cached_prefix_blocks(final.block_hashes) == 3
    assert set(e.pool.cached_hashes()) == set(final.block_hashes)
    assert e.pool.drain_events() == (final.block_hashes, [])
    assert final.usage.to_dict() == {"prompt_tokens": 10, "completion_tokens": 4, "cached_tokens": 0,
                                     "cached_by_tier": {}, "spec_proposed_tokens": 0, "spec_accepted_tokens": 0}
    assert_whole(e)


# -- salts and switching it off ---------------------------------------------------------------


def test_different_salts_share_nothing(tiny_llama):
    e = engine(tiny_llama)
    prompt = tokens(18, seed=7)
    assert e.block_hashes(prompt, "tenant-a") != e.block_hashes(prompt, "tenant-b") != e.block_hashes(prompt)
    [a] = run(e, [prompt], cache_salt="tenant-a")
    [b] = run(e, [prompt], cache_salt="tenant-b")
    [none] = run(e, [prompt])
    [a2] = run(e, [prompt], cache_salt="tenant-a")
    assert [o.usage.cached_tokens for o in (a, b, none, a2)] == [0, 0, 0, 16]
    assert a.token_ids == b.token_ids == none.token_ids == a2.token_ids
    assert a2.block_hashes == e.block_hashes(prompt + a2.token_ids, "tenant-a")[:(18 + NEW_TOKENS - 1) // BLOCK]
    assert_whole(e)


def test_disabled_prefix_caching_never_hits_nor_names(tiny_llama):
    e = engine(tiny_llama, enable_prefix_caching=False)
    prompt = tokens(18, seed=7)
    [cold] = run(e, [prompt])
    [again] = run(e, [prompt])
    assert again.usage.cached_tokens == 0 and again.token_ids == cold.token_ids
    assert e.pool.num_cached == 0 and e.pool.drain_events() == ([], []) and again.block_hashes == []
    hashes = e.block_hashes(prompt)
    assert e.cached_prefix_blocks(hashes) == 0 and e.export_cached_blocks(hashes) == ([], None)
    donor = engine(tiny_llama)
    run(donor, [prompt])
    _, kv = donor.export_cached_blocks(hashes)
    assert e.import_cached_blocks(hashes, kv, "host") == 0 and e.stats.prefix_lookups == 0
    assert_whole(e, donor)


# -- other tiers: export and import -----------------------------------------------------------


def test_export_import_round_trip_counts_host_hits(tiny_llama, hf, oracle):
    prompt = tokens(22, seed=8)  # 5 whole blocks
    a = engine(tiny_llama)
    [cold] = run(a, [prompt])
    hashes = a.block_hashes(prompt)
    assert len(hashes) == 5 and a.cached_prefix_blocks(hashes) == 5
    stranger = a.block_hashes(tokens(8, seed=9))[0]
    present, kv = a.export_cached_blocks([hashes[0], stranger, *hashes[1:]])
    assert present == hashes and kv.shape == (5, *a.runner.kv.shape[1:]) and kv.is_contiguous()
    assert (kv[0] == a.runner.kv[a.pool.block_of(hashes[0])]).all()

    b = engine(tiny_llama, num_kv_blocks=48)
    assert b.reserve("ballast", 3, lease_s=3600.0)  # shifts b's block ids away from a's
    assert b.cached_prefix_blocks(hashes) == 0
    assert b.import_cached_blocks(hashes, kv, "host") == 5
    assert b.stats.blocks_imported == 5 and b.cached_prefix_blocks(hashes) == 5 and b.num_free_blocks == 45
    assert b.import_cached_blocks(hashes, kv, "disk") == 0  # already resident: skipped
    assert b.pool.drain_events() == (hashes, [])
    [hit] = run(b, [prompt])
    assert hit.token_ids == cold.token_ids
    assert_same_greedy(hf, prompt, hit.token_ids, oracle(prompt))
    assert (hit.usage.cached_tokens, hit.usage.cached_by_tier) == (20, {"host": 20})
    [again] = run(b, [prompt])  # the blocks are device-resident now
    assert again.usage.cached_by_tier == {"device": 20} and again.token_ids == cold.token_ids
    assert b.cancel_reservation("ballast")
    assert_whole(a, b)


def test_import_takes_blocks_one_tensor_each_as_they_come_off_the_wire(tiny_llama):
    prompt = tokens(22, seed=8)
    a = engine(tiny_llama)
    [cold] = run(a, [prompt])
    hashes = a.block_hashes(prompt)
    _, kv = a.export_cached_blocks(hashes)
    b = engine(tiny_llama)
    with pytest.raises(HandoffError):
        b.import_cached_blocks(hashes, [kv[0]] * 4, "host")  # 4 tensors for 5 hashes
    with pytest.raises(HandoffError):
        b.import_cached_blocks(hashes[:1], [kv[0, :1]], "host")  # not one block's shape
    assert b.import_cached_blocks(hashes, [kv[i].clone() for i in range(5)], "disk") == 5
    [hit] = run(b, [prompt])
    assert hit.token_ids == cold.token_ids and hit.usage.cached_by_tier == {"disk": 20}
    assert_whole(a, b)


def test_import_fills_free_blocks_only_and_keeps_the_prefix_it_completes(tiny_llama, hf, oracle):
    prompt = tokens(22, seed=8)
    a = engine(tiny_llama)
    [cold] = run(a, [prompt])
    hashes = a.block_hashes(prompt)
    _, kv = a.export_cached_blocks(hashes)

    c = engine(tiny_llama, num_kv_blocks=12)
    assert c.reserve("busy", 9, lease_s=3600.0)  # referenced blocks: never touched
    assert c.import_cached_blocks(hashes, kv, "disk") == 3  # as many as are free
    assert c.cached_prefix_blocks(hashes) == 3 and c.num_free_blocks == 3
    assert c.cancel_reservation("busy")
    # The rest, with the head already resident: the import pins it while it evicts older blocks.
    assert c.import_cached_blocks(hashes, kv, "host") == 2
    assert c.cached_prefix_blocks(hashes) == 5 and c.pool.num_cached == 5
    [out] = run(c, [prompt])
    assert out.token_ids == cold.token_ids
    assert out.usage.cached_by_tier == {"disk": 12, "host": 8}
    assert_same_greedy(hf, prompt, out.token_ids, oracle(prompt))

    # Importing only the rest of a chain: its resident head is named in keep_resident and held.
    d = engine(tiny_llama, num_kv_blocks=12)
    assert d.reserve("busy", 9, lease_s=3600.0)
    assert d.import_cached_blocks(hashes[:3], kv[:3], "disk") == 3
    assert d.cancel_reservation("busy")  # the free queue: the 3 imported blocks first, then the 9
    stranger = d.block_hashes(tokens(4, seed=9))
    assert d.import_cached_blocks(hashes[3:], kv[3:], "host", keep_resident=stranger) == 0  # a gap: useless
    assert d.import_cached_blocks(hashes[3:], kv[3:], "host", keep_resident=hashes[:3]) == 2
    assert d.cached_prefix_blocks(hashes) == 5
    [out] = run(d, [prompt])
    assert out.token_ids == cold.token_ids and out.usage.cached_by_tier == {"disk": 12, "host": 8}
    assert_whole(a, c, d)


def test_import_refuses_malformed_input_and_changes_nothing(tiny_llama):
    a = engine(tiny_llama)
    prompt = tokens(22, seed=8)
    run(a, [prompt])
    hashes = a.block_hashes(prompt)
    _, kv = a.export_cached_blocks(hashes)
    b = engine(tiny_llama, num_kv_blocks=16)
    with pytest.raises(HandoffError, match="; expected float32"):
        b.import_cached_blocks(hashes[:4], kv, "host")
    with pytest.raises(HandoffError, match="kv is float64"):
        b.import_cached_blocks(hashes, kv.double(), "host")
    with pytest.raises(ValueError, match="tier"):
        b.import_cached_blocks(hashes, kv, "device")
    with pytest.raises(ValueError, match="32 bytes"):
        b.import_cached_blocks([h[:8] for h in hashes], kv, "host")
    assert b.pool.num_cached == 0 and b.stats.blocks_imported == 0
    assert_whole(a, b)


# -- handoff, holds, aborts -------------------------------------------------------------------


def test_handoff_names_the_prompt_blocks_on_both_sides(tiny_llama):
    prefill, decode = engine(tiny_llama), engine(tiny_llama, num_kv_blocks=32)
    prompt = tokens(14, seed=11)
    prefill.add_request("r", prompt, GREEDY, prefill_only=True, cache_salt="t")
    [out] = prefill.step()
    assert out.handoff and out.block_hashes == prefill.block_hashes(prompt, "t")  # 3 whole prompt blocks
    assert decode.reserve("r", 4, lease_s=60.0)
    decode.add_prefilled_request("r", prompt, out.token_ids[0], GREEDY, prefill.export_kv("r"),
                                 reservation_id="r", cache_salt="t")
    assert decode.cached_prefix_blocks(decode.block_hashes(prompt, "t")) == 3
    assert decode.cached_prefix_blocks(decode.block_hashes(prompt)) == 0  # the salt is part of the name
    assert prefill.release("r")
    # Released, the prompt's blocks stay cached on the prefill side: the same prompt hits them.
    [again] = run(prefill, [prompt], cache_salt="t")
    assert again.usage.cached_by_tier == {"device": 12}
    [decoded] = [o for o in run_decode(decode) if o.finished]
    assert decoded.token_ids == again.token_ids
    [local] = run(decode, [prompt], cache_salt="t")  # the imported prompt is the decode side's cache too
    assert local.usage.cached_tokens == 12 and local.token_ids == again.token_ids
    assert_whole(prefill, decode)


def run_decode(e: LLMEngine) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    while e.has_unfinished():
        outs += e.step()
    return outs


def test_aborts_at_every_point_leak_nothing_and_keep_what_was_cached(tiny_llama):
    e = engine(tiny_llama, max_num_batched_tokens=8, max_num_seqs=3)
    stem = tokens(12, seed=12)
    run(e, [stem + [5]])
    p = SamplingParams(max_tokens=30, ignore_eos=True)
    e.add_request("decoding", stem + [6], p)
    e.step()
    e.step()  # "decoding": 12 cached tokens, its last prompt token computed, decoding
    e.add_request("prefilling", stem + tokens(20, seed=13), p)
    e.add_request("held", stem + [7, 8], p, prefill_only=True)
    e.add_request("waiting", stem + [9], p)
    e.step()  # "prefilling" took the stem and is mid-prefill; the step's budget is spent
    reqs = e.scheduler.requests
    prefilling, decoding = reqs["prefilling"], reqs["decoding"]
    assert prefilling.num_cached_tokens == 12 and prefilling.num_computed_tokens < prefilling.num_tokens
    assert decoding.block_ids[:3] == prefilling.block_ids[:3]
    assert [e.pool.ref_cnt(b) for b in decoding.block_ids[:3]] == [2, 2, 2]
    assert reqs["waiting"].block_ids == []
    assert e.abort("waiting") and e.abort("prefilling")
    assert [e.pool.ref_cnt(b) for b in decoding.block_ids[:3]] == [1, 1, 1]
    e.pool.check_integrity()
    while "held" not in e.scheduler.held:
        e.step()
    assert e.reserve("reserved", 2, lease_s=60.0)
    for rid in ("held", "decoding", "reserved"):
        assert e.abort(rid) and not e.abort(rid)
    while e.has_unfinished():
        e.step()
    assert_whole(e)
    assert e.cached_prefix_blocks(e.block_hashes(stem)) == 3  # every holder gone, still cached
    [after] = run(e, [stem + [9]])
    assert after.usage.cached_by_tier == {"device": 12}
    assert_whole(e)


# -- the real model ---------------------------------------------------------------------------


@pytest.mark.smollm2
def test_smollm2_shared_prefix_pair_same_tokens_with_and_without_hits(smollm2_oracle):
    loaded, tok = smollm2_oracle.loaded, smollm2_oracle.tok
    system = {"role": "system", "content": "You are a concise assistant who answers in one short sentence, "
                                           "using plain words and no lists, and never asks questions back."}
    pair = [tok.encode_chat([system, {"role": "user", "content": q}])
            for q in ("What is the capital of France?", "What colour is the sky on a clear day?")]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    results = {}
    for caching in (False, True):
        e = LLMEngine(loaded, tok, EngineConfig(num_kv_blocks=64, enable_prefix_caching=caching))
        results[caching] = [run(e, [p], params)[0] for p in pair]
        assert_whole(e)
    shared = next(i for i, (x, y) in enumerate(zip(*pair)) if x != y)
    hit = results[True][1].usage
    assert hit.cached_tokens == shared // 16 * 16 > 0 and hit.cached_by_tier == {"device": hit.cached_tokens}
    assert [o.token_ids for o in results[True]] == [o.token_ids for o in results[False]]
