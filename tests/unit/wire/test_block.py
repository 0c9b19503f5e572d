from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.errors import CorruptBlockError
from kvoffload.wire.block import HEADER_BYTES, open_block, peek_codec, seal

KEY = bytes(range(16))
HASH = bytes(range(32))
NS = bytes([7]) * 16


def sealed(payload: bytes, key: bytes = KEY, ns: bytes | None = NS) -> bytearray:
    header = seal(
        key_or_hash=key,
        payload=payload,
        stored_length=len(payload),
        raw_length=len(payload),
        namespace=ns,
    )
    return bytearray(header + payload)


@given(st.binary(max_size=4096))
def test_round_trip(payload: bytes) -> None:
    block = sealed(payload)
    header = open_block(block, key_or_hash=KEY, namespace=NS)
    assert len(block) == HEADER_BYTES + len(payload)
    assert header.stored_length == header.raw_length == len(payload)
    assert header.namespace == NS and header.codec_id == 0


@given(st.binary(min_size=1, max_size=512), st.data())
def test_any_single_bit_flip_is_detected(payload: bytes, data: st.DataObject) -> None:
    block = sealed(payload)
    bit = data.draw(st.integers(0, len(block) * 8 - 1))
    block[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(CorruptBlockError):
        open_block(block, key_or_hash=KEY, namespace=NS)


def test_every_mismatch_has_its_reason() -> None:
    block = sealed(os.urandom(100))
    with pytest.raises(CorruptBlockError, match="another key"):
        open_block(block, key_or_hash=bytes(16))
    with pytest.raises(CorruptBlockError, match="another namespace"):
        open_block(block, key_or_hash=KEY, namespace=bytes(16))
    with pytest.raises(CorruptBlockError, match="shorter than its header"):
        open_block(block[:50], key_or_hash=KEY)
    with pytest.raises(CorruptBlockError, match="declares"):
        open_block(block[:-1], key_or_hash=KEY)
    with pytest.raises(CorruptBlockError, match="payload checksum"):
        block[-1] ^= 0xFF
        open_block(block, key_or_hash=KEY)


def test_full_chain_hash_is_checked_when_both_sides_have_it() -> None:
    block = sealed(b"payload", key=HASH)
    open_block(block, key_or_hash=HASH)
    open_block(block, key_or_hash=HASH[:16])  # a 16-byte reader checks the key part
    other = HASH[:16] + bytes(16)
    with pytest.raises(CorruptBlockError, match="another chain"):
        open_block(block, key_or_hash=other)


def test_codec_id_and_raw_length_round_trip_and_can_be_peeked() -> None:
    payload = b"encoded bytes"
    header = seal(
        key_or_hash=KEY, payload=payload, stored_length=len(payload), raw_length=4096, codec_id=4
    )
    block = header + payload
    assert peek_codec(block) == 4 and peek_codec(block[:50]) == 0
    opened = open_block(block, key_or_hash=KEY)
    assert (opened.codec_id, opened.raw_length, opened.stored_length) == (4, 4096, len(payload))
