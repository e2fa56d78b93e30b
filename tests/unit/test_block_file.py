"""The block file format: a round trip, and every kind of damage detected with its reason."""

from __future__ import annotations

import hashlib
import struct

import pytest

from deepinfer.cache import block_file as bf

NS_ID = hashlib.sha256(b"namespace").hexdigest()
OTHER_NS_ID = hashlib.sha256(b"another namespace").hexdigest()
HASH = hashlib.sha256(b"block 1").digest()
OTHER_HASH = hashlib.sha256(b"block 2").digest()
PAYLOAD = hashlib.shake_256(b"payload").digest(4096)


def reason_of(raw: bytes, namespace: str = NS_ID, block_hash: bytes = HASH, nbytes: int | None = None) -> str:
    with pytest.raises(bf.CorruptBlock) as info:
        bf.verify(raw, namespace, block_hash, nbytes)
    return info.value.reason


def test_round_trip() -> None:
    raw = bf.encode(NS_ID, HASH, PAYLOAD)
    assert len(raw) == bf.HEADER_BYTES + len(PAYLOAD)
    payload = bf.verify(raw, NS_ID, HASH, len(PAYLOAD))
    assert bytes(payload) == PAYLOAD and payload.readonly
    header = bf.parse_header(raw)
    assert (header.namespace.hex(), header.block_hash, header.payload_nbytes) == (NS_ID, HASH, len(PAYLOAD))


def test_header_then_payload_equals_one_buffer() -> None:
    # The disk tier writes the header and the payload separately, to avoid copying the payload.
    assert bf.encode_header(NS_ID, HASH, memoryview(PAYLOAD)) + PAYLOAD == bf.encode(NS_ID, HASH, PAYLOAD)


def test_empty_payload_and_non_byte_views_round_trip() -> None:
    assert bytes(bf.verify(bf.encode(NS_ID, HASH, b""), NS_ID, HASH)) == b""
    floats = memoryview(bytearray(PAYLOAD)).cast("f")  # a typed view, as a tensor's buffer would be
    assert bytes(bf.verify(bf.encode(NS_ID, HASH, floats), NS_ID, HASH)) == PAYLOAD


def test_magic_version_and_header_length() -> None:
    raw = bytearray(bf.encode(NS_ID, HASH, PAYLOAD))
    assert raw[:8] == b"DIKVBLK1"
    bad = bytearray(raw)
    bad[0] ^= 0xFF
    assert reason_of(bytes(bad)) == bf.BAD_MAGIC
    bad = bytearray(raw)
    struct.pack_into("<H", bad, 8, bf.FORMAT_VERSION + 1)
    assert reason_of(bytes(bad)) == bf.UNKNOWN_VERSION
    bad = bytearray(raw)
    struct.pack_into("<H", bad, 10, bf.HEADER_BYTES + 8)
    assert reason_of(bytes(bad)) == bf.BAD_HEADER


@pytest.mark.parametrize("keep", [0, 7, bf.HEADER_BYTES - 1, bf.HEADER_BYTES, bf.HEADER_BYTES + 100])
def test_truncated(keep: int) -> None:
    assert reason_of(bf.encode(NS_ID, HASH, PAYLOAD)[:keep]) == bf.TRUNCATED


def test_length_mismatch() -> None:
    raw = bf.encode(NS_ID, HASH, PAYLOAD)
    assert reason_of(raw + b"\0") == bf.LENGTH_MISMATCH  # trailing bytes
    assert reason_of(raw, nbytes=len(PAYLOAD) * 2) == bf.LENGTH_MISMATCH  # not the size the store uses


@pytest.mark.parametrize("offset", [12, 44, 76, 84, bf.HEADER_BYTES, bf.HEADER_BYTES + 2000, -1])
def test_any_flipped_byte_is_detected(offset: int) -> None:
    raw = bytearray(bf.encode(NS_ID, HASH, PAYLOAD))
    raw[offset] ^= 0x01
    # Flipping a bit of the payload-length field makes the declared length disagree first.
    assert reason_of(bytes(raw)) in ((bf.TRUNCATED, bf.LENGTH_MISMATCH) if offset == 76 else (bf.CHECKSUM_MISMATCH,))


def test_every_single_byte_flip_is_detected() -> None:
    raw = bf.encode(NS_ID, HASH, PAYLOAD[:64])
    for i in range(len(raw)):
        bad = bytearray(raw)
        bad[i] ^= 0x80
        with pytest.raises(bf.CorruptBlock):
            bf.verify(bytes(bad), NS_ID, HASH)


def test_valid_file_of_another_namespace_or_block() -> None:
    assert reason_of(bf.encode(OTHER_NS_ID, HASH, PAYLOAD)) == bf.WRONG_NAMESPACE
    assert reason_of(bf.encode(NS_ID, OTHER_HASH, PAYLOAD)) == bf.WRONG_HASH


def test_payloads_swapped_between_two_files_fail_the_checksum() -> None:
    a = bf.encode(NS_ID, HASH, PAYLOAD)
    b = bf.encode(NS_ID, OTHER_HASH, PAYLOAD[::-1])
    spliced = a[:bf.HEADER_BYTES] + b[bf.HEADER_BYTES:]
    assert reason_of(spliced) == bf.CHECKSUM_MISMATCH


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        bf.encode(NS_ID, b"short", PAYLOAD)
    with pytest.raises(ValueError):
        bf.encode("abc", HASH, PAYLOAD)
    assert set(bf.CORRUPT_REASONS) >= {bf.BAD_MAGIC, bf.CHECKSUM_MISMATCH, bf.WRONG_HASH}
