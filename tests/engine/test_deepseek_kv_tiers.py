"""MLA latents through every place KV travels: the P/D transfer between two engines, and the cache daemon's
DRAM and disk tiers. A tiny DeepSeek-V3 (transformers' random weights, saved with `save_pretrained`, plus a
word-level tokenizer so the daemon can derive the same namespace as the engine).

Each path must give the greedy outputs of one engine computing everything itself (and transformers'),
and report where its prefix came from. The blocks that travel are the engine's `KvSpec` blocks —
[layers, 1, block_size, kv_lora_rank + qk_rope_head_dim] — moved byte for byte.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from deepinfer.engine.request import SamplingParams
from deepinfer.loading.weights import load_model_weights
from deepinfer.protocol import messages as m
from deepinfer.text.tokenizer import Tokenizer
from tests.engine.deepseek_models import VOCAB, build_hf_deepseek, save
from tests.engine.oracle import assert_same_greedy, hf_greedy
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
from tests.service.test_kvcache_service import Mesh

NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
VARIANT = "v3-qlora-dense1-yarn"


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ds(tmp_path_factory):  # type: ignore[no-untyped-def]
    """(model directory, transformers model, our loaded weights, its tokenizer)."""
    hf = build_hf_deepseek(VARIANT, seed=7)
    path = save(hf, tmp_path_factory.mktemp("deepseek"))
    backend = Backend(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.save(str(path / "tokenizer.json"))
    return path, hf, load_model_weights(path), Tokenizer.load(path)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def test_export_is_latent_blocks(ds):  # type: ignore[no-untyped-def]
    _, hf, loaded, _ = ds
    prefill = engine(loaded)
    prefill_first(prefill, "r", list(range(3, 12)), SamplingParams(max_tokens=4))
    kv = prefill.export_kv("r")
    latent = hf.config.kv_lora_rank + hf.config.qk_rope_head_dim
    assert kv.shape == (3, loaded.config.num_layers, 1, BLOCK, latent) and kv.is_contiguous()
    assert prefill.kv_spec.layout == f"layers={loaded.config.num_layers},kv=1,block_size={BLOCK},latent_dim={latent}"
    assert prefill.release("r")
    assert_whole(prefill)


@pytest.mark.parametrize("prefill_mode, decode_mode", [("ample", "ample"), ("chunked", "preempt")])
def test_pd_handoff_of_latents_matches_one_engine_and_transformers(ds, prefill_mode, decode_mode):  # type: ignore[no-untyped-def]
    _, hf, loaded, _ = ds
    batch = batch_prompts()
    single = engine(loaded, num_kv_blocks=256, max_num_batched_tokens=512).generate(batch, GREEDY)
    prefill = engine(loaded, **PREFILL_MODES[prefill_mode])
    decode = engine(loaded, **DECODE_MODES[decode_mode])
    finals, moves = run_disaggregated(prefill, decode, batch, [GREEDY] * len(batch))
    assert len(moves) == len(batch) and all(src != dst for src, dst in moves)  # relocated into other blocks
    for i, p in enumerate(batch):
        assert finals[i].token_ids == single[i].token_ids, i
        assert_same_greedy(hf, p, finals[i].token_ids, hf_greedy(hf, p, NEW_TOKENS))
    if decode_mode == "preempt":
        assert decode.stats.num_preemptions > 0
    assert_whole(prefill, decode)


async def daemon_round_trip(path, kv_dir, a, names: list[bytes], kv: torch.Tensor, prefixes: list[list[bytes]],
                            **mesh_kw) -> dict[str, list[m.CacheBlocks]]:  # type: ignore[no-untyped-def]
    """Store engine `a`'s exported blocks in a cache daemon of the same KV spec and namespace, fetch every
    prefix from its DRAM tier, then again from disk after a warm restart: {"host": replies, "disk": replies}."""
    mesh = Mesh(path, kv_dir, block_size=BLOCK, **mesh_kw)
    try:
        d = await mesh.start_daemon()
        assert d.kv == a.kv_spec and d.namespace.id == a.cache_namespace.id
        assert d.store.block_nbytes == a.kv_spec.block_nbytes
        ack = await mesh.ask(m.CacheStore("store", d.namespace.id, names, kv.contiguous()))
        assert (ack.stored, ack.skipped, ack.reason) == (len(names), 0, "")
        host = [await mesh.ask(m.CacheFetch(f"host-{i}", h, namespace=d.namespace.id)) for i, h in enumerate(prefixes)]
        await mesh.flushed()
        await mesh.stop_daemon()
        d = await mesh.start_daemon()  # a warm restart: DRAM is empty, the disk index rebuilt from the files
        disk = [await mesh.ask(m.CacheFetch(f"disk-{i}", h, namespace=d.namespace.id)) for i, h in enumerate(prefixes)]
        return {"host": host, "disk": disk}
    finally:
        await mesh.close()


def test_latents_through_the_cache_daemon_host_and_disk_tiers(ds, tmp_path):  # type: ignore[no-untyped-def]
    """Engine A computes the prompts and its blocks are stored into the daemon (as a worker's write-behind
    does); fresh engines B fetch them back from DRAM, then, after a warm restart of the daemon, from disk
    (as a worker does before prefill), import them and must produce A's greedy outputs from the hits."""
    path, hf, loaded, tok = ds
    stem = tokens(12, seed=1)
    batch = [stem + tokens(n, seed=n) for n in (5, 9, 14)]  # 17, 21 and 26 tokens sharing 3 blocks
    a = engine(loaded, tok, num_kv_blocks=128, max_num_batched_tokens=512)
    cold = a.generate(batch, GREEDY)
    # A hit never covers a prompt's last token (its logits are needed): the blocks before it.
    prefixes = [a.block_hashes(p)[: (len(p) - 1) // BLOCK] for p in batch]
    wanted = list(dict.fromkeys(h for hashes in prefixes for h in hashes))
    names, kv = a.export_cached_blocks(wanted)
    assert names == wanted and kv is not None and kv.shape == (len(wanted), *a.kv_spec.block_shape)

    for tier, replies in asyncio.run(daemon_round_trip(path, tmp_path / "kv", a, names, kv, prefixes)).items():
        b = engine(loaded, tok, num_kv_blocks=128, max_num_batched_tokens=512)
        for hashes, reply in zip(prefixes, replies):
            assert reply.block_hashes == hashes, tier
            sent = kv[[names.index(h) for h in hashes]]
            assert torch.equal(torch.stack(reply.blocks), sent), tier  # the latents, byte for byte
            # As the worker's cache client imports: what is already resident is held, the rest filled in.
            # A block's first fetch comes from `tier`; a disk hit is promoted to DRAM, so a later prompt
            # sharing it finds it there — and here already resident, from the first import.
            have = b.cached_prefix_blocks(hashes)
            assert reply.tiers[have:] == [tier] * (len(hashes) - have), tier
            b.import_cached_blocks(hashes[have:], reply.blocks[have:], tier, keep_resident=hashes[:have])
        assert b.cached_prefix_blocks(wanted) == len(wanted)
        outs = b.generate(batch, GREEDY)
        for p, hashes, out, ref in zip(batch, prefixes, outs, cold):
            assert out.token_ids == ref.token_ids, tier
            assert out.usage.cached_tokens == len(hashes) * BLOCK and tier in out.usage.cached_by_tier, tier
            assert_same_greedy(hf, p, out.token_ids, hf_greedy(hf, p, NEW_TOKENS))
        assert b.stats.prefix_hit_tokens == sum(len(h) for h in prefixes) * BLOCK
