"""An fp16 KV cache's blocks everywhere KV travels: the P/D transfer between two engines, the export and
import of named blocks, and the cache daemon's DRAM and disk tiers. All of them size and check blocks by
the engine's `KvSpec`, so an fp16 block is half the bytes of an fp32 one and moves byte for byte; the
block-hash namespace carries the dtype, so fp16 and fp32 blocks of one model never mix.

Each path must give the outputs of one fp16 engine computing everything itself.
"""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from deepinfer.config.kv import KvSpec
from deepinfer.engine.handoff import HandoffError
from deepinfer.engine.request import SamplingParams
from deepinfer.loading.weights import load_model_weights
from deepinfer.text.tokenizer import Tokenizer
from tests.engine.oracle import random_tokens
from tests.engine.test_deepseek_kv_tiers import daemon_round_trip
from tests.engine.test_pd_handoff import (
    BLOCK,
    DECODE_MODES,
    PREFILL_MODES,
    assert_whole,
    batch_prompts,
    engine,
    prefill_first,
    run_disaggregated,
)

VOCAB = 320
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
FP16 = dict(kv_cache_dtype="float16")


@pytest.fixture(scope="module")
def llama(tmp_path_factory, tiny_llama_dir):  # type: ignore[no-untyped-def]
    """(model directory, loaded weights, tokenizer): the tiny Llama with a word-level tokenizer beside it, so
    the daemon derives the same namespace as the engine."""
    path = tmp_path_factory.mktemp("tiny-llama-fp16-kv")
    shutil.copytree(tiny_llama_dir, path, dirs_exist_ok=True)
    backend = Backend(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.save(str(path / "tokenizer.json"))
    return path, load_model_weights(path), Tokenizer.load(path)


def test_fp16_namespace_and_blocks_are_their_own(llama):  # type: ignore[no-untyped-def]
    _, loaded, tok = llama
    e16, e32 = engine(loaded, tok, **FP16), engine(loaded, tok)
    assert e16.cache_namespace.kv_dtype == "float16" and e32.cache_namespace.kv_dtype == "float32"
    assert e16.cache_namespace.id != e32.cache_namespace.id
    prompt = random_tokens(9, 1, VOCAB)
    assert e16.block_hashes(prompt) != e32.block_hashes(prompt)  # no fp32 block is ever named as an fp16 one
    spec = e16.kv_spec
    assert spec == KvSpec.for_model(loaded.config, BLOCK, "float16")
    assert 2 * spec.block_nbytes == e32.kv_spec.block_nbytes
    blocks = torch.randn(3, *spec.block_shape).half()
    payloads = spec.block_payloads(blocks)
    assert [len(p) for p in payloads] == [spec.block_nbytes] * 3
    assert torch.equal(torch.stack([spec.view_block(p) for p in payloads]), blocks)
    assert "kv is float16" in (e32.kv_spec.problem(blocks) or "")


@pytest.mark.parametrize("prefill_mode, decode_mode", [("ample", "ample"), ("chunked", "preempt")])
def test_pd_handoff_of_fp16_blocks_matches_one_engine(llama, prefill_mode, decode_mode):  # type: ignore[no-untyped-def]
    _, loaded, _ = llama
    batch = batch_prompts()
    single = engine(loaded, num_kv_blocks=256, max_num_batched_tokens=512, **FP16).generate(batch, GREEDY)
    prefill = engine(loaded, **PREFILL_MODES[prefill_mode], **FP16)
    decode = engine(loaded, **DECODE_MODES[decode_mode], **FP16)
    finals, moves = run_disaggregated(prefill, decode, batch, [GREEDY] * len(batch))
    assert len(moves) == len(batch) and all(src != dst for src, dst in moves)
    for i in range(len(batch)):
        assert finals[i].token_ids == single[i].token_ids, i
    if decode_mode == "preempt":
        assert decode.stats.num_preemptions > 0
    assert_whole(prefill, decode)


def test_fp16_export_is_half_the_bytes_and_an_fp32_engine_refuses_it(llama):  # type: ignore[no-untyped-def]
    _, loaded, _ = llama
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompt = list(range(3, 12))  # 9 tokens: 3 blocks
    prefill = engine(loaded, **FP16)
    first = prefill_first(prefill, "r", prompt, params).token_ids[0]
    kv = prefill.export_kv("r")
    assert kv.dtype == torch.float16 and kv.shape == (3, *prefill.kv_spec.block_shape)
    assert kv.numel() * kv.element_size() == 3 * prefill.kv_spec.block_nbytes
    fp32 = engine(loaded)
    with pytest.raises(HandoffError, match=r"kv is float16 .*; expected float32"):
        fp32.add_prefilled_request("r", prompt, first, params, kv)
    with pytest.raises(HandoffError, match=r"kv is float32 .*; expected float16"):
        engine(loaded, **FP16).add_prefilled_request("r", prompt, first, params, kv.float())
    assert prefill.release("r")
    assert_whole(prefill, fp32)


def test_fp16_blocks_through_the_cache_daemon_host_and_disk_tiers(llama, tmp_path):  # type: ignore[no-untyped-def]
    """Engine A's fp16 blocks are stored into an fp16 daemon; fresh engines fetch them back from DRAM and,
    after a warm restart, from disk, import them and must produce A's outputs from the hits."""
    path, loaded, tok = llama
    stem = random_tokens(12, 1, VOCAB)
    batch = [stem + random_tokens(n, n, VOCAB) for n in (5, 9, 14)]  # sharing 3 blocks
    a = engine(loaded, tok, num_kv_blocks=128, max_num_batched_tokens=512, **FP16)
    cold = a.generate(batch, GREEDY)
    prefixes = [a.block_hashes(p)[: (len(p) - 1) // BLOCK] for p in batch]
    wanted = list(dict.fromkeys(h for hashes in prefixes for h in hashes))
    names, kv = a.export_cached_blocks(wanted)
    assert names == wanted and kv is not None and kv.dtype == torch.float16

    for tier, replies in asyncio.run(daemon_round_trip(path, tmp_path / "kv", a, names, kv, prefixes, **FP16)).items():
        b = engine(loaded, tok, num_kv_blocks=128, max_num_batched_tokens=512, **FP16)
        for hashes, reply in zip(prefixes, replies):
            assert reply.block_hashes == hashes, tier
            assert torch.equal(torch.stack(reply.blocks), kv[[names.index(h) for h in hashes]]), tier
            have = b.cached_prefix_blocks(hashes)
            b.import_cached_blocks(hashes[have:], reply.blocks[have:], tier, keep_resident=hashes[:have])
        assert b.cached_prefix_blocks(wanted) == len(wanted)
        for hashes, out, ref in zip(prefixes, b.generate(batch, GREEDY), cold):
            assert out.token_ids == ref.token_ids, tier
            assert out.usage.cached_tokens == len(hashes) * BLOCK and tier in out.usage.cached_by_tier, tier
        assert_whole(b)
