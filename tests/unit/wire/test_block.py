from __future__ import annotations

import os

import pytest
from blake3 import blake3
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.errors import CorruptBlockError
from kvoffload.wire.block import (
    HEADER_BYTES,
    SEALED_VERSION,
    check_payload,
    open_block,
    open_header,
    peek_codec,
    seal,
)

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


# ------------------------------------------------------------------ the keyed seal (version 2)
MAC_KEY = bytes(range(100, 132))
OTHER_KEY = bytes(range(200, 232))
KEYS = {7: MAC_KEY}


def sealed_v2(payload: bytes, mac_key: tuple[int, bytes] = (7, MAC_KEY)) -> bytearray:
    header = seal(
        key_or_hash=KEY,
        payload=payload,
        stored_length=len(payload),
        raw_length=len(payload),
        namespace=NS,
        mac_key=mac_key,
    )
    return bytearray(header + payload)


def test_a_sealed_block_carries_its_version_and_key_id_and_opens_with_its_key() -> None:
    payload = os.urandom(300)
    block = sealed_v2(payload)
    assert len(block) == HEADER_BYTES + len(payload)
    assert int.from_bytes(block[4:6], "little") == SEALED_VERSION
    assert int.from_bytes(block[76:80], "little") == 7
    opened = open_block(block, key_or_hash=KEY, namespace=NS, mac_keys=KEYS, require_seal=True)
    assert (opened.key_id, opened.raw_length, opened.payload_crc) == (7, 300, 0)
    assert MAC_KEY.hex() not in repr(opened)


def test_the_mac_is_keyed_blake3_over_the_signed_header_then_the_payload() -> None:
    # An independent statement of the format: one keyed hash of bytes 0..79 and the payload.
    payload = b"kv" * 1000
    block = sealed_v2(payload)
    expected = blake3(bytes(block[:80]) + payload, key=MAC_KEY).digest(16)
    assert bytes(block[80:96]) == expected


@given(st.binary(min_size=1, max_size=512), st.data())
def test_any_single_bit_flip_of_a_sealed_block_is_detected(
    payload: bytes, data: st.DataObject
) -> None:
    block = sealed_v2(payload)
    bit = data.draw(st.integers(0, len(block) * 8 - 1))
    block[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(CorruptBlockError):
        open_block(block, key_or_hash=KEY, namespace=NS, mac_keys={7: MAC_KEY, 6: OTHER_KEY})


@pytest.mark.parametrize(
    ("offset", "value"),
    [
        (6, b"\x04\x00"),
        (12, (5000).to_bytes(8, "little")),
        (28, bytes(16)),
        (8, b"\x01\x00\x00\x00"),
    ],
    ids=["codec", "raw_length", "namespace", "flags"],
)
def test_a_tampered_header_field_breaks_the_seal(offset: int, value: bytes) -> None:
    payload = os.urandom(64)
    block = sealed_v2(payload)
    block[offset : offset + len(value)] = value
    with pytest.raises(CorruptBlockError, match="seal mismatch"):
        open_block(block, key_or_hash=KEY, mac_keys=KEYS)


def test_a_block_sealed_with_another_key_is_a_forgery() -> None:
    block = sealed_v2(b"forged", mac_key=(7, OTHER_KEY))  # right key id, wrong key
    with pytest.raises(CorruptBlockError, match="seal mismatch"):
        open_block(block, key_or_hash=KEY, mac_keys=KEYS)


def test_a_key_id_the_reader_does_not_hold_is_refused() -> None:
    block = sealed_v2(b"payload", mac_key=(9, MAC_KEY))
    with pytest.raises(CorruptBlockError, match="key id 9, which this client does not hold"):
        open_block(block, key_or_hash=KEY, mac_keys=KEYS)
    with pytest.raises(CorruptBlockError, match="holds no key"):
        open_block(block, key_or_hash=KEY)  # a reader without keys cannot check it


def test_crc_only_blocks_are_read_unless_the_seal_is_required() -> None:
    block = sealed(b"written before the seal")
    assert open_block(block, key_or_hash=KEY, mac_keys=KEYS).key_id is None
    with pytest.raises(CorruptBlockError, match="not sealed"):
        open_block(block, key_or_hash=KEY, mac_keys=KEYS, require_seal=True)


def test_open_header_then_check_payload_is_open_block_in_two_steps() -> None:
    payload = os.urandom(200)
    block = sealed_v2(payload)
    opened = open_header(block[:HEADER_BYTES], len(payload), key_or_hash=KEY, mac_keys=KEYS)
    check_payload(opened, payload)
    check_payload(opened, payload)  # the header's keyed state is reused, not consumed
    with pytest.raises(CorruptBlockError, match="seal mismatch"):
        check_payload(opened, payload[:-1] + bytes([payload[-1] ^ 1]))
    crc_block = sealed(payload)
    opened = open_header(crc_block[:HEADER_BYTES], len(payload), key_or_hash=KEY)
    check_payload(opened, payload)
    with pytest.raises(CorruptBlockError, match="payload checksum"):
        check_payload(opened, bytes(200))
