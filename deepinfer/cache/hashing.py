"""Block identity: the hash chain that names a KV block by everything that decides its contents.

    h_0 = root(namespace)
    h_i = SHA-256("deepinfer-kv-block\\0" ‖ h_{i-1} ‖ n ‖ tokens_i as n little-endian u32 ‖ extra)

A block's hash therefore covers its own tokens, every token before it (through the parent), the
namespace — model and tokenizer fingerprints, KV dtype and layout, block size, scheme version — and
`extra`, the typed keys that change the KV without changing the tokens: the tenant's cache salt
(set by the router from the API key, never taken from a client) and anything else of that kind.

The encoding is fixed-width or length-prefixed everywhere, so no two different inputs serialize to
the same bytes; SHA-256 then makes a collision between different blocks infeasible. Only full blocks
are hashed: a partial tail block is never cached. Pure functions of their inputs: every process, on
every host and across restarts, computes the same hashes.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property

HASH_SCHEME = "sha256-chain-v1"
HASH_BYTES = 32

BlockHash = bytes  # HASH_BYTES raw digest bytes
ExtraValue = str | int | bytes

_BLOCK_TAG = b"deepinfer-kv-block\0"
_NAMESPACE_TAG = b"deepinfer-kv-namespace\0"
_U32 = struct.Struct("<I")
_MAX_TOKEN = 2**32 - 1


@dataclass(frozen=True)
class CacheNamespace:
    """Everything that must match for two KV blocks with the same tokens to be interchangeable."""

    model_fingerprint: str
    tokenizer_fingerprint: str
    kv_dtype: str  # KvSpec.dtype_name, e.g. "float32"
    kv_layout: str  # KvSpec.layout, e.g. "layers=30,kv=2,block_size=16,kv_heads=3,head_dim=64"
    block_size: int
    scheme: str = HASH_SCHEME

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.scheme != HASH_SCHEME:
            raise ValueError(f"unknown block-hash scheme {self.scheme!r} (this build has {HASH_SCHEME!r})")

    @cached_property
    def root(self) -> BlockHash:
        """The chain's seed: a digest of every field, in a canonical encoding."""
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(_NAMESPACE_TAG + canonical).digest()

    @property
    def id(self) -> str:
        """Short printable name of the namespace (hex of the root), for logs, handshakes and file headers."""
        return self.root.hex()

    @property
    def handshake_scheme(self) -> str:
        """What a service puts in Hello.block_hash_scheme: peers that disagree cannot share blocks."""
        return f"{self.scheme}:{self.id}"


@dataclass(frozen=True)
class HashKeys:
    """The `extra` of one request's chain: the cache salt and any other KV-changing keys."""

    cache_salt: str | None = None
    extra: Mapping[str, ExtraValue] = field(default_factory=dict)

    @cached_property
    def encoded(self) -> bytes:
        items: dict[str, ExtraValue] = dict(self.extra)
        if "cache_salt" in items:
            raise ValueError("'cache_salt' is a reserved extra key; pass it as cache_salt")
        if self.cache_salt is not None:
            items["cache_salt"] = self.cache_salt
        return encode_extra(items)


def encode_extra(items: Mapping[str, ExtraValue]) -> bytes:
    """Canonical bytes of typed keys: count, then per key (sorted) its name, a type tag and its value,
    each length-prefixed. The type tag keeps 1, "1" and b"1" apart."""
    out = [_U32.pack(len(items))]
    for key in sorted(items):
        value = items[key]
        if isinstance(value, bool) or not isinstance(value, str | int | bytes):
            raise TypeError(f"extra key {key!r} has a value of type {type(value).__name__}; use str, int or bytes")
        if isinstance(value, str):
            tag, raw = b"s", value.encode()
        elif isinstance(value, int):
            tag, raw = b"i", str(value).encode()
        else:
            tag, raw = b"b", value
        name = key.encode()
        out += [_U32.pack(len(name)), name, tag, _U32.pack(len(raw)), raw]
    return b"".join(out)


def hash_block(parent: BlockHash, tokens: Sequence[int], extra: bytes = b"") -> BlockHash:
    """One link of the chain. `extra` is `HashKeys.encoded` (empty bytes only for raw tests)."""
    if len(parent) != HASH_BYTES:
        raise ValueError(f"parent hash must be {HASH_BYTES} bytes, got {len(parent)}")
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= _MAX_TOKEN:
            raise ValueError(f"token id {t!r} cannot be hashed (an int in [0, 2**32) is needed)")
    h = hashlib.sha256(_BLOCK_TAG)
    h.update(parent)
    h.update(_U32.pack(len(tokens)))
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    h.update(extra)
    return h.digest()


def hash_blocks(namespace: CacheNamespace, token_ids: Sequence[int], keys: HashKeys | None = None,
                start: int = 0, parent: BlockHash | None = None) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` from block index `start` on.

    `parent` is the hash of block `start - 1` (required when start > 0), so a caller that already holds
    a prefix's hashes extends the chain without rehashing it."""
    bs = namespace.block_size
    if start > 0 and parent is None:
        raise ValueError("extending a chain past block 0 needs the parent hash")
    prev = namespace.root if start == 0 else parent
    assert prev is not None
    extra = (keys or HashKeys()).encoded
    out: list[BlockHash] = []
    for i in range(start, len(token_ids) // bs):
        prev = hash_block(prev, token_ids[i * bs:(i + 1) * bs], extra)
        out.append(prev)
    return out


class ChainHasher:
    """A request's chain, extended as its tokens grow: `extend(all_token_ids)` hashes the blocks that
    became full since the last call and returns every hash so far."""

    def __init__(self, namespace: CacheNamespace, keys: HashKeys | None = None,
                 known: Iterable[BlockHash] = ()) -> None:
        self.namespace = namespace
        self.keys = keys or HashKeys()
        self.hashes: list[BlockHash] = list(known)

    def extend(self, token_ids: Sequence[int]) -> list[BlockHash]:
        n = len(self.hashes)
        if len(token_ids) // self.namespace.block_size > n:
            self.hashes += hash_blocks(self.namespace, token_ids, self.keys, start=n,
                                       parent=self.hashes[-1] if n else None)
        return self.hashes
