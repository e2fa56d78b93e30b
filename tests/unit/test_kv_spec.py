"""KvSpec: the one description of the KV cache — sizes and shapes for a Llama config and an MLA-like one, the
checks' messages, and the layout/namespace strings that on-disk caches are keyed by (which must never change)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.cache.hashing import CacheNamespace
from deepinfer.config.kv import KvSpec, kv_dtype_name
from deepinfer.config.model import ModelConfig

LLAMA = ModelConfig(architecture="llama", vocab_size=100, hidden_size=576, intermediate_size=1536, num_layers=30,
                    num_heads=9, num_kv_heads=3, head_dim=64)
# DeepSeek-V3's MLA caches per token and layer one vector: kv_lora_rank (512) latent + qk_rope_head_dim (64) key.
MLA = KvSpec(61, 64, ("latent",), (("latent_rope", 512 + 64),), component_axis="c")


def test_llama_sizes_and_shapes() -> None:
    s = KvSpec.for_model(LLAMA, 16)
    assert s.dtype is torch.float32 and s.dtype_name == "float32"
    assert s.components == ("k", "v") and s.token_shape == (3, 64)
    assert s.block_shape == (30, 2, 16, 3, 64)
    assert s.pool_shape(7) == (7, 30, 2, 16, 3, 64)
    assert s.bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46080  # what ModelConfig.kv_bytes_per_token was
    assert s.block_nbytes == 16 * 46080
    assert s.blocks_for(0) == 0 and s.blocks_for(16) == 1 and s.blocks_for(17) == 2
    assert s.blocks_for_budget(3 * s.block_nbytes + 1) == 3
    with pytest.raises(ValueError, match=r"smaller than one KV block \(737280 bytes\)"):
        s.blocks_for_budget(s.block_nbytes - 1)
    pool = s.allocate(5)
    assert pool.shape == s.pool_shape(5) and pool.dtype == torch.float32 and not pool.any()
    k, v = s.layer_views(pool, 2)
    assert k.shape == v.shape == (5, 16, 3, 64)
    k[1, 3] = 1.0
    assert pool[1, 2, 0, 3].eq(1.0).all() and not pool[1, 2, 1].any()  # views alias the pool


def test_mla_like_spec_needs_no_special_case() -> None:
    assert MLA.block_shape == (61, 1, 64, 576)
    assert MLA.bytes_per_token == 61 * 576 * 4
    assert MLA.block_nbytes == 64 * 61 * 576 * 4
    assert MLA.layout == "layers=61,c=1,block_size=64,latent_rope=576"
    (latent,) = MLA.layer_views(MLA.allocate(2), 60)
    assert latent.shape == (2, 64, 576)
    half = KvSpec(61, 64, ("latent",), (("latent_rope", 576),), "bfloat16", component_axis="c")
    assert half.bytes_per_token * 2 == MLA.bytes_per_token and half.layout == MLA.layout


def test_layout_and_namespace_strings_are_stable() -> None:
    """On-disk caches are keyed by the namespace: these exact strings (and so this id) were written before
    KvSpec existed. Changing them orphans every cache on disk."""
    s = KvSpec.for_model(LLAMA, 16)
    assert s.layout == "layers=30,kv=2,block_size=16,kv_heads=3,head_dim=64"
    ns = CacheNamespace("m" * 64, "t" * 64, s.dtype_name, s.layout, s.block_size)
    assert ns.id == "598372e894de5d9f77ee2cee8ae019ed85a13b13a3b40858a9c77f2f4885556a"
    assert KvSpec.for_model(LLAMA, 16, "float16").layout == s.layout  # the dtype is the namespace's own field


def test_checks_name_what_was_expected() -> None:
    s = KvSpec(2, 4, ("k", "v"), (("kv_heads", 2), ("head_dim", 8)))
    good = s.allocate(3)
    assert s.problem(good) is None and s.problem(good, 3) is None and s.check(good, 3) is good
    assert s.problem(good, 2) == ("kv is float32 (3, 2, 2, 4, 2, 8); expected float32 (2, 2, 2, 4, 2, 8) "
                                  "[blocks, layers, kv, block_size, kv_heads, head_dim]")
    assert s.problem(good.half()) == ("kv is float16 (3, 2, 2, 4, 2, 8); expected float32 (3, 2, 2, 4, 2, 8) "
                                      "[blocks, layers, kv, block_size, kv_heads, head_dim]")
    assert s.problem(good.numpy()) == "kv must be a torch.Tensor, got ndarray"
    with pytest.raises(ValueError, match=r"kv is float32 \(3, 2, 2, 4, 2, 8\); expected float32 \(1, "):
        s.check(good, 1)
    assert s.block_problem(good[0]) is None
    assert s.block_problem(good[0, :1]) == ("a block is float32 (1, 2, 4, 2, 8); expected float32 (2, 2, 4, 2, 8) "
                                            "[layers, kv, block_size, kv_heads, head_dim]")
    assert s.block_problem(b"x") == "a block is bytes; expected float32 (2, 2, 4, 2, 8) " \
                                    "[layers, kv, block_size, kv_heads, head_dim]"


def test_wire_round_trip() -> None:
    s = KvSpec(2, 4, ("k", "v"), (("kv_heads", 2), ("head_dim", 8)))
    blocks = torch.randn(s.pool_shape(3), generator=torch.Generator().manual_seed(0))
    payloads = s.block_payloads(blocks)
    assert [len(p) for p in payloads] == [s.block_nbytes] * 3
    assert all(torch.equal(s.view_block(p), blocks[i]) for i, p in enumerate(payloads))
    with pytest.raises(ValueError, match=f"has {s.block_nbytes - 4} bytes; expected {s.block_nbytes}"):
        s.view_block(payloads[0][4:])
    b16 = KvSpec(2, 4, ("k", "v"), (("kv_heads", 2), ("head_dim", 8)), "bfloat16")
    half = blocks.bfloat16()
    assert all(torch.equal(b16.view_block(p), half[i]) for i, p in enumerate(b16.block_payloads(half)))


def test_bad_specs_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown KV dtype 'float64'"):
        KvSpec(2, 4, ("k", "v"), (("head_dim", 8),), "float64")
    with pytest.raises(ValueError, match="positive sizes"):
        KvSpec(2, 0, ("k", "v"), (("head_dim", 8),))
    with pytest.raises(ValueError, match="positive sizes"):
        KvSpec(2, 4, (), (("head_dim", 8),))
    with pytest.raises(ValueError, match="free of"):
        KvSpec(2, 4, ("k", "v"), (("head=dim", 8),))
    assert kv_dtype_name(torch.float16) == "float16"
    with pytest.raises(ValueError, match="not a KV dtype"):
        kv_dtype_name(torch.int8)
