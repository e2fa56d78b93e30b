"""The on-disk format of one cached KV block: a fixed header, then the payload bytes.

Layout (all integers little-endian, HEADER_BYTES = 88):

    offset  size  field
         0     8  magic            b"DIKVBLK1"
         8     2  format version   u16, FORMAT_VERSION
        10     2  header length    u16, HEADER_BYTES (lets a reader of this version refuse a different header)
        12    32  namespace        the CacheNamespace root, raw (its `id` is the hex of these bytes)
        44    32  block hash       the block's full BlockHash, raw
        76     8  payload length   u64, bytes that follow the header
        84     4  checksum         u32 zlib.crc32 over bytes [0, 84) of the header and then the whole payload
        88     …  payload

The file is self-describing: it names the namespace and block it holds, so a file copied or renamed under
another block's name, or left over from another model, is detected by `verify` even when its checksum is
intact. The checksum covers the identity fields as well as the payload, so no bit of the file can change
undetected (up to CRC-32's strength against random damage; this guards against torn writes and bit rot,
not against an adversary who can write the cache directory).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from deepinfer.cache.hashing import HASH_BYTES, BlockHash

MAGIC = b"DIKVBLK1"
FORMAT_VERSION = 1
_FIELDS = struct.Struct("<8sHH32s32sQ")  # everything the checksum follows
_CHECKSUM = struct.Struct("<I")
HEADER_BYTES = _FIELDS.size + _CHECKSUM.size
NAMESPACE_BYTES = 32

# CorruptBlock reasons; also the keys of the quarantine counters.
BAD_MAGIC = "bad_magic"
UNKNOWN_VERSION = "unknown_version"
BAD_HEADER = "bad_header"  # a header length this version does not write
TRUNCATED = "truncated"  # shorter than the header, or than the payload length it declares
LENGTH_MISMATCH = "length_mismatch"  # longer than declared, or not the payload size the caller expects
CHECKSUM_MISMATCH = "checksum_mismatch"
WRONG_NAMESPACE = "wrong_namespace"
WRONG_HASH = "wrong_hash"
CORRUPT_REASONS = (BAD_MAGIC, UNKNOWN_VERSION, BAD_HEADER, TRUNCATED, LENGTH_MISMATCH, CHECKSUM_MISMATCH,
                   WRONG_NAMESPACE, WRONG_HASH)


class CorruptBlock(Exception):
    """A block file that must not be served; `reason` is one of CORRUPT_REASONS."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class BlockHeader:
    namespace: bytes  # raw, NAMESPACE_BYTES
    block_hash: BlockHash
    payload_nbytes: int
    checksum: int


def namespace_bytes(namespace_id: str) -> bytes:
    """The raw form of a CacheNamespace id (64 hex characters)."""
    raw = bytes.fromhex(namespace_id)
    if len(raw) != NAMESPACE_BYTES:
        raise ValueError(f"a namespace id is {2 * NAMESPACE_BYTES} hex characters, got {len(namespace_id)}")
    return raw


def encode_header(namespace_id: str, block_hash: BlockHash, payload: bytes | memoryview) -> bytes:
    """The header for `payload`; write it and then the payload, so the payload is never copied."""
    if len(block_hash) != HASH_BYTES:
        raise ValueError(f"a block hash is {HASH_BYTES} bytes, got {len(block_hash)}")
    view = memoryview(payload).cast("B")
    fields = _FIELDS.pack(MAGIC, FORMAT_VERSION, HEADER_BYTES, namespace_bytes(namespace_id), block_hash,
                          view.nbytes)
    return fields + _CHECKSUM.pack(zlib.crc32(view, zlib.crc32(fields)))


def encode(namespace_id: str, block_hash: BlockHash, payload: bytes | memoryview) -> bytes:
    """The whole file's bytes (header + payload), as one copy."""
    return encode_header(namespace_id, block_hash, payload) + memoryview(payload).cast("B")


def parse_header(raw: bytes | bytearray | memoryview) -> BlockHeader:
    """Decode the header at the start of `raw` (at least HEADER_BYTES of it), checking only what the header
    alone can tell: magic, version, header length. Cheap enough for a directory scan."""
    view = memoryview(raw)
    if view.nbytes < HEADER_BYTES:
        raise CorruptBlock(TRUNCATED, f"{view.nbytes} bytes, shorter than the {HEADER_BYTES}-byte header")
    magic, version, header_len, namespace, block_hash, payload_nbytes = _FIELDS.unpack_from(view)
    if magic != MAGIC:
        raise CorruptBlock(BAD_MAGIC, repr(bytes(magic)))
    if version != FORMAT_VERSION:
        raise CorruptBlock(UNKNOWN_VERSION, f"version {version}, this build reads {FORMAT_VERSION}")
    if header_len != HEADER_BYTES:
        raise CorruptBlock(BAD_HEADER, f"header length {header_len}, expected {HEADER_BYTES}")
    (checksum,) = _CHECKSUM.unpack_from(view, _FIELDS.size)
    return BlockHeader(namespace, block_hash, payload_nbytes, checksum)


def verify(raw: bytes | bytearray | memoryview, expected_namespace: str, expected_hash: BlockHash,
           expected_payload_nbytes: int | None = None) -> memoryview:
    """The payload of a whole block file, after checking every field and the checksum against what the
    caller expects; raises CorruptBlock otherwise. The view shares `raw`'s memory and is read-only."""
    view = memoryview(raw).cast("B").toreadonly()
    header = parse_header(view)
    actual = view.nbytes - HEADER_BYTES
    if actual < header.payload_nbytes:
        raise CorruptBlock(TRUNCATED, f"payload {actual} bytes of {header.payload_nbytes} declared")
    if actual > header.payload_nbytes:
        raise CorruptBlock(LENGTH_MISMATCH, f"payload {actual} bytes, {header.payload_nbytes} declared")
    payload = view[HEADER_BYTES:]
    if zlib.crc32(payload, zlib.crc32(view[:_FIELDS.size])) != header.checksum:
        raise CorruptBlock(CHECKSUM_MISMATCH)
    # Identity after the checksum: a file whose checksum holds is intact, so a mismatch here means a
    # whole valid file sits under the wrong name or directory, not damage.
    if header.namespace != namespace_bytes(expected_namespace):
        raise CorruptBlock(WRONG_NAMESPACE, f"file holds namespace {header.namespace.hex()}")
    if header.block_hash != expected_hash:
        raise CorruptBlock(WRONG_HASH, f"file holds block {header.block_hash.hex()}")
    if expected_payload_nbytes is not None and header.payload_nbytes != expected_payload_nbytes:
        raise CorruptBlock(LENGTH_MISMATCH, f"payload {header.payload_nbytes} bytes, expected "
                                            f"{expected_payload_nbytes}")
    return payload
