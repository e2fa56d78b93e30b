"""Block hash chain: deterministic across processes, sensitive to every input that changes the KV, only full
blocks, incremental hashing equal to one-shot hashing, bad inputs refused."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.cache.hashing import (
    HASH_BYTES,
    CacheNamespace,
    ChainHasher,
    HashKeys,
    hash_block,
    hash_blocks,
)

NS = CacheNamespace(model_fingerprint="model-abc", tokenizer_fingerprint="tok-123", kv_dtype="float32",
                    kv_layout="layers,kv,block_size,kv_heads,head_dim", block_size=4)
TOKENS = list(range(100, 114))  # 3 full blocks of 4 and a partial one of 2


def test_same_input_same_hash_in_another_process() -> None:
    here = [h.hex() for h in hash_blocks(NS, TOKENS, HashKeys(cache_salt="tenant", extra={"adapter": "a1"}))]
    code = (
        "from deepinfer.cache.hashing import CacheNamespace, HashKeys, hash_blocks\n"
        "ns = CacheNamespace(model_fingerprint='model-abc', tokenizer_fingerprint='tok-123', kv_dtype='float32',"
        " kv_layout='layers,kv,block_size,kv_heads,head_dim', block_size=4)\n"
        "keys = HashKeys(cache_salt='tenant', extra={'adapter': 'a1'})\n"
        "print(' '.join(h.hex() for h in hash_blocks(ns, list(range(100, 114)), keys)))\n"
    )
    # A fresh interpreter with a different string-hash seed: nothing may depend on Python's hash().
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.split() == here
    assert len(here) == 3 and all(len(bytes.fromhex(h)) == HASH_BYTES for h in here)


def test_only_full_blocks_are_hashed() -> None:
    assert len(hash_blocks(NS, TOKENS)) == len(TOKENS) // NS.block_size == 3
    assert hash_blocks(NS, TOKENS[:3]) == []
    assert hash_blocks(NS, TOKENS[:12]) == hash_blocks(NS, TOKENS)  # the partial tail adds nothing


def test_changing_any_token_changes_its_block_and_every_later_one() -> None:
    base = hash_blocks(NS, TOKENS)
    for i in range(12):
        changed = list(TOKENS)
        changed[i] += 1
        other = hash_blocks(NS, changed)
        block = i // NS.block_size
        assert other[:block] == base[:block], "blocks before the change keep their hashes"
        assert all(o != b for o, b in zip(other[block:], base[block:])), "the block and all later ones change"


def test_parent_is_part_of_the_hash() -> None:
    tokens = [1, 2, 3, 4]
    assert hash_block(b"\0" * 32, tokens) != hash_block(b"\1" + b"\0" * 31, tokens)


def test_salt_and_extra_keys_change_the_hash() -> None:
    variants = [
        HashKeys(),
        HashKeys(cache_salt=""),  # an empty salt is still a salt
        HashKeys(cache_salt="tenant-a"),
        HashKeys(cache_salt="tenant-b"),
        HashKeys(extra={"adapter": "x"}),
        HashKeys(extra={"adapter": "y"}),
        HashKeys(extra={"adaptor": "x"}),  # key name
        HashKeys(extra={"adapter": "x", "more": 1}),  # one more key
        HashKeys(extra={"n": 1}),
        HashKeys(extra={"n": "1"}),  # same text, other type
        HashKeys(extra={"n": b"1"}),
        HashKeys(cache_salt="x", extra={"adapter": "x"}),
    ]
    firsts = [hash_blocks(NS, TOKENS, keys)[0] for keys in variants]
    assert len(set(firsts)) == len(variants)


def test_extra_encoding_keeps_key_value_boundaries_apart() -> None:
    # Length prefixes: moving bytes between a key and its value must not collide.
    a = HashKeys(extra={"ab": "c"}).encoded
    b = HashKeys(extra={"a": "bc"}).encoded
    assert a != b


@pytest.mark.parametrize("field_name, value", [
    ("model_fingerprint", "model-abd"),
    ("tokenizer_fingerprint", "tok-124"),
    ("kv_dtype", "bfloat16"),
    ("kv_layout", "layers,kv,kv_heads,block_size,head_dim"),
    ("block_size", 2),
])
def test_every_namespace_field_changes_the_hash(field_name: str, value: object) -> None:
    other = dataclasses.replace(NS, **{field_name: value})
    assert other.root != NS.root and other.id != NS.id
    tokens = TOKENS[:4] * 2  # full blocks under both block sizes
    assert set(hash_blocks(other, tokens)).isdisjoint(hash_blocks(NS, tokens))


def test_unknown_scheme_is_refused() -> None:
    with pytest.raises(ValueError, match="scheme"):
        dataclasses.replace(NS, scheme="sha256-chain-v0")
    with pytest.raises(ValueError):
        dataclasses.replace(NS, block_size=0)


def test_namespace_id_is_hex_of_root() -> None:
    assert bytes.fromhex(NS.id) == NS.root and len(NS.id) == 2 * HASH_BYTES
    assert NS.handshake_scheme.endswith(NS.id)


def test_chain_hasher_extend_equals_hash_blocks() -> None:
    keys = HashKeys(cache_salt="s")
    chain = ChainHasher(NS, keys)
    tokens: list[int] = []
    for t in range(37):  # grow one token at a time, across several block boundaries
        tokens.append(1000 + t)
        assert chain.extend(tokens) == hash_blocks(NS, tokens, keys)
    assert len(chain.hashes) == 37 // NS.block_size


def test_extending_from_a_known_prefix_equals_hashing_from_scratch() -> None:
    full = hash_blocks(NS, TOKENS)
    assert hash_blocks(NS, TOKENS, start=1, parent=full[0]) == full[1:]
    resumed = ChainHasher(NS, known=full[:2])
    assert resumed.extend(TOKENS) == full
    with pytest.raises(ValueError, match="parent"):
        hash_blocks(NS, TOKENS, start=1)


@pytest.mark.parametrize("bad", [-1, 2**32, True, 1.0, "7", None])
def test_bad_token_ids_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="token id"):
        hash_blocks(NS, [1, 2, bad, 4])  # type: ignore[list-item]


def test_token_id_bounds_are_inclusive() -> None:
    assert len(hash_block(NS.root, [0, 2**32 - 1])) == HASH_BYTES


def test_bad_extra_and_parent_are_refused() -> None:
    with pytest.raises(TypeError):
        HashKeys(extra={"flag": True}).encoded  # noqa: B018  (bool is not a KV key type)
    with pytest.raises(TypeError):
        HashKeys(extra={"f": 1.5}).encoded  # type: ignore[dict-item]  # noqa: B018
    with pytest.raises(ValueError, match="reserved"):
        HashKeys(extra={"cache_salt": "x"}).encoded  # noqa: B018
    with pytest.raises(ValueError, match="parent"):
        hash_block(b"short", [1, 2])
