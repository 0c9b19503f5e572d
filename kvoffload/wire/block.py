"""The stored-value format: a fixed 96-byte little-endian header, then the payload (DESIGN §3).

Header fields, in order:

====== ====== =================================================================
offset bytes  field
====== ====== =================================================================
0      4      magic ``KVOB``
4      2      format version (1)
6      2      codec id (0 = raw; see kvoffload.compression)
8      4      flags (bit 0: `chain` holds a full 32-byte hash, not key + zeros)
12     8      raw length (the value's length before encoding = after decoding)
20     8      stored length (encoded payload bytes that follow the header)
28     16     namespace fingerprint (zeros when the writer had no namespace)
44     32     chain hash of the block (or its 16-byte key followed by zeros)
76     4      CRC32C of the payload
80     12     reserved, zero
92     4      CRC32C of bytes 0..91
====== ====== =================================================================

Every read checks the header and the payload checksum before a byte reaches the caller; the
checksum covers the encoded payload, so damage is caught before any decoder runs. Everything a
codec needs to decode beyond its id and the raw length is inside its payload (see
kvoffload.compression). Sans-I/O: bytes in, results out.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import crc32c

from kvoffload.errors import CorruptBlockError

__all__ = [
    "FLAG_FULL_CHAIN",
    "HEADER_BYTES",
    "MAGIC",
    "BlockHeader",
    "open_block",
    "open_header",
    "open_parts",
    "peek_codec",
    "seal",
]

MAGIC = b"KVOB"
VERSION = 1
FLAG_FULL_CHAIN = 1
_KNOWN_FLAGS = FLAG_FULL_CHAIN
_BODY = struct.Struct("<4sHHIQQ16s32sI12s")
_CRC = struct.Struct("<I")
_CODEC = struct.Struct("<H")
_CODEC_OFFSET = 6
HEADER_BYTES = _BODY.size + _CRC.size  # 96
_NO_NAMESPACE = bytes(16)


@dataclass(frozen=True, slots=True)
class BlockHeader:
    codec_id: int
    flags: int
    raw_length: int
    stored_length: int
    namespace: bytes
    chain: bytes
    payload_crc: int


def seal(
    *,
    key_or_hash: bytes,
    payload: bytes | memoryview,
    stored_length: int,
    raw_length: int,
    namespace: bytes | None = None,
    codec_id: int = 0,
) -> bytes:
    """The header for `payload` (any contiguous buffer of `stored_length` bytes).

    `key_or_hash` is the block's 16-byte key or its full 32-byte chain hash.
    """
    if len(key_or_hash) == 32:
        chain, flags = key_or_hash, FLAG_FULL_CHAIN
    else:
        chain, flags = key_or_hash + bytes(16), 0
    body = _BODY.pack(
        MAGIC,
        VERSION,
        codec_id,
        flags,
        raw_length,
        stored_length,
        namespace or _NO_NAMESPACE,
        chain,
        crc32c.crc32c(payload),
        bytes(12),
    )
    return body + _CRC.pack(crc32c.crc32c(body))


def open_block(
    block: memoryview | bytes,
    *,
    key_or_hash: bytes,
    namespace: bytes | None = None,
) -> BlockHeader:
    """Verify a stored block (header + payload) and return its header.

    Args:
        block: the whole stored value.
        key_or_hash: what the reader asked for: a 16-byte key (the header's chain must start
            with it) or a 32-byte chain hash (all of it must match when the writer stored one).
        namespace: the reader's namespace fingerprint; when given, the writer's must be equal.

    Raises:
        CorruptBlockError: anything does not match; the message says what.
    """
    view = memoryview(block)
    return open_parts(
        view[:HEADER_BYTES], view[HEADER_BYTES:], key_or_hash=key_or_hash, namespace=namespace
    )


def open_parts(
    header: memoryview | bytes,
    payload: memoryview | bytes,
    *,
    key_or_hash: bytes,
    namespace: bytes | None = None,
) -> BlockHeader:
    """`open_block` for a block received in two places (header apart from its payload).

    Raises:
        CorruptBlockError: as for `open_block`.
    """
    opened = open_header(
        header, len(memoryview(payload)), key_or_hash=key_or_hash, namespace=namespace
    )
    if crc32c.crc32c(payload) != opened.payload_crc:
        raise CorruptBlockError("payload checksum mismatch")
    return opened


def open_header(
    header: memoryview | bytes,
    payload_length: int,
    *,
    key_or_hash: bytes,
    namespace: bytes | None = None,
) -> BlockHeader:
    """`open_parts` without the payload's checksum: the caller sums the payload itself (while
    copying it) and compares the sum with `payload_crc` before any byte is used.

    Raises:
        CorruptBlockError: as for `open_block` (the payload checksum aside).
    """
    view = memoryview(header)
    if len(view) < HEADER_BYTES:
        raise CorruptBlockError(f"block of {len(view)} bytes is shorter than its header")
    body = view[: _BODY.size]
    (header_crc,) = _CRC.unpack_from(view, _BODY.size)
    if crc32c.crc32c(body) != header_crc:
        raise CorruptBlockError("header checksum mismatch")
    magic, version, codec, flags, raw_len, stored_len, ns, chain, payload_crc, _ = _BODY.unpack(
        body
    )
    if magic != MAGIC or version != VERSION or flags & ~_KNOWN_FLAGS:
        raise CorruptBlockError(f"unknown block format (magic {magic!r}, version {version})")
    if stored_len != payload_length:
        raise CorruptBlockError(
            f"header declares {stored_len} payload bytes, block holds {payload_length}"
        )
    if chain[:16] != key_or_hash[:16]:
        raise CorruptBlockError("block belongs to another key")
    if len(key_or_hash) == 32 and flags & FLAG_FULL_CHAIN and chain != key_or_hash:
        raise CorruptBlockError("block belongs to another chain (16-byte key collision)")
    if namespace is not None and ns != namespace:
        raise CorruptBlockError("block belongs to another namespace")
    return BlockHeader(codec, flags, raw_len, stored_len, bytes(ns), bytes(chain), payload_crc)


def peek_codec(block: memoryview | bytes) -> int:
    """The codec id a stored block claims, unverified (0 for anything too short to say).

    For scheduling only (whether decoding is worth a worker thread); `open_block` decides
    whether the block is used.
    """
    if len(block) < HEADER_BYTES:
        return 0
    (codec_id,) = _CODEC.unpack_from(block, _CODEC_OFFSET)
    return int(codec_id)
