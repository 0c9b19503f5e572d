"""The stored-value format: a fixed 96-byte little-endian header, then the payload (DESIGN §3).

Two header versions share the first 76 bytes. Version 1 protects a block against damage with
CRC32C; version 2 ("keyed seal") with a 16-byte keyed BLAKE3 MAC over the header's first 80
bytes and the payload, under a key only the tenant's clients hold, so that whoever stores or
carries the block (a node, a target, a process on the NVMe front) cannot forge one a reader
accepts. Version 1, in order:

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

Version 2 (sealed) has the same bytes 0..75 (version 2), then:

====== ====== =================================================================
76     4      key id: which of the tenant's keys sealed the block
80     16     keyed BLAKE3 (16-byte output) of bytes 0..79 then the payload
====== ====== =================================================================

Every read checks the header and the payload checksum before a byte reaches the caller; the
checksum covers the encoded payload, so damage is caught before any decoder runs. Everything a
codec needs to decode beyond its id and the raw length is inside its payload (see
kvoffload.compression). Sans-I/O: bytes in, results out.
"""

from __future__ import annotations

import functools
import hmac
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

import crc32c
from blake3 import blake3

from kvoffload.errors import CorruptBlockError
from kvoffload.wire import fast as _fast

__all__ = [
    "FLAG_FULL_CHAIN",
    "HEADER_BYTES",
    "MAC_KEY_BYTES",
    "MAGIC",
    "SEALED_VERSION",
    "BlockHeader",
    "check_payload",
    "crc32c_suffix",
    "open_block",
    "open_header",
    "open_parts",
    "peek_codec",
    "seal",
]

MAGIC = b"KVOB"
VERSION = 1
SEALED_VERSION = 2
MAC_KEY_BYTES = 32  # keyed BLAKE3's key
FLAG_FULL_CHAIN = 1
_KNOWN_FLAGS = FLAG_FULL_CHAIN
_BODY = struct.Struct("<4sHHIQQ16s32sI12s")
_CRC = struct.Struct("<I")
_CODEC = struct.Struct("<H")
_VERSION = struct.Struct("<H")
_CODEC_OFFSET = 6
HEADER_BYTES = _BODY.size + _CRC.size  # 96
_NO_NAMESPACE = bytes(16)
# Version 2: the common fields, the key id, then the MAC (over the first _SIGNED bytes).
_SEALED = struct.Struct("<4sHHIQQ16s32sI")
_SIGNED = _SEALED.size  # 80
_MAC_BYTES = HEADER_BYTES - _SIGNED  # 16: a 128-bit tag, as GMAC's or Poly1305's


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """A header `open_header` parsed. A sealed one (`key_id` set) is authentic only once
    `check_payload` has passed; a CRC-only one carries `payload_crc` (0 when sealed)."""

    codec_id: int
    flags: int
    raw_length: int
    stored_length: int
    namespace: bytes
    chain: bytes
    payload_crc: int
    key_id: int | None = None
    mac: bytes = b""
    # Keyed BLAKE3 fed with the signed header bytes; the payload is added to a copy of it.
    _hasher: blake3 | None = field(default=None, repr=False, compare=False)


def seal(
    *,
    key_or_hash: bytes,
    payload: bytes | memoryview,
    stored_length: int,
    raw_length: int,
    namespace: bytes | None = None,
    codec_id: int = 0,
    mac_key: tuple[int, bytes] | None = None,
) -> bytes:
    """The header for `payload` (any contiguous buffer of `stored_length` bytes).

    `key_or_hash` is the block's 16-byte key or its full 32-byte chain hash. With `mac_key`
    (key id, 32-byte key) the header is a version-2 one: a keyed seal instead of the CRCs.
    """
    if len(key_or_hash) == 32:
        chain, flags = key_or_hash, FLAG_FULL_CHAIN
    else:
        chain, flags = key_or_hash + bytes(16), 0
    if mac_key is not None:
        key_id, key = mac_key
        signed = _SEALED.pack(
            MAGIC,
            SEALED_VERSION,
            codec_id,
            flags,
            raw_length,
            stored_length,
            namespace or _NO_NAMESPACE,
            chain,
            key_id,
        )
        hasher = blake3(signed, key=key)
        hasher.update(payload)
        return signed + hasher.digest(_MAC_BYTES)
    body = _BODY.pack(
        MAGIC,
        VERSION,
        codec_id,
        flags,
        raw_length,
        stored_length,
        namespace or _NO_NAMESPACE,
        chain,
        _fast.crc32c(payload),  # the C loops where built: a put's one pass over its value
        bytes(12),
    )
    return body + _CRC.pack(crc32c.crc32c(body))


def open_block(
    block: memoryview | bytes,
    *,
    key_or_hash: bytes,
    namespace: bytes | None = None,
    mac_keys: Mapping[int, bytes] | None = None,
    require_seal: bool = False,
) -> BlockHeader:
    """Verify a stored block (header + payload) and return its header.

    Args:
        block: the whole stored value.
        key_or_hash: what the reader asked for: a 16-byte key (the header's chain must start
            with it) or a 32-byte chain hash (all of it must match when the writer stored one).
        namespace: the reader's namespace fingerprint; when given, the writer's must be equal.
        mac_keys: the keys (by key id) the reader opens sealed blocks with; without them a
            sealed block cannot be checked, so it is refused.
        require_seal: refuse CRC-only (version 1) blocks.

    Raises:
        CorruptBlockError: anything does not match; the message says what.
    """
    view = memoryview(block)
    return open_parts(
        view[:HEADER_BYTES],
        view[HEADER_BYTES:],
        key_or_hash=key_or_hash,
        namespace=namespace,
        mac_keys=mac_keys,
        require_seal=require_seal,
    )


def open_parts(
    header: memoryview | bytes,
    payload: memoryview | bytes,
    *,
    key_or_hash: bytes,
    namespace: bytes | None = None,
    mac_keys: Mapping[int, bytes] | None = None,
    require_seal: bool = False,
) -> BlockHeader:
    """`open_block` for a block received in two places (header apart from its payload).

    Raises:
        CorruptBlockError: as for `open_block`.
    """
    opened = open_header(
        header,
        len(memoryview(payload)),
        key_or_hash=key_or_hash,
        namespace=namespace,
        mac_keys=mac_keys,
        require_seal=require_seal,
    )
    check_payload(opened, payload)
    return opened


def check_payload(opened: BlockHeader, payload: memoryview | bytes) -> None:
    """Check `payload` against a header `open_header` returned: its CRC32C, or for a sealed
    block the MAC over header and payload (compared in constant time).

    Raises:
        CorruptBlockError: the payload (or, sealed, anything the MAC covers) does not match.
    """
    if opened._hasher is None:
        if _fast.crc32c(payload) != opened.payload_crc:
            raise CorruptBlockError("payload checksum mismatch")
        return
    hasher = opened._hasher.copy()
    hasher.update(payload)
    if not hmac.compare_digest(hasher.digest(_MAC_BYTES), opened.mac):
        raise CorruptBlockError(f"seal mismatch (key id {opened.key_id}): forged or damaged")


def open_header(
    header: memoryview | bytes,
    payload_length: int,
    *,
    key_or_hash: bytes,
    namespace: bytes | None = None,
    mac_keys: Mapping[int, bytes] | None = None,
    require_seal: bool = False,
) -> BlockHeader:
    """`open_parts` without the payload's check: the caller then runs `check_payload` (or,
    for a CRC-only block, sums the payload itself while copying it and compares the sum with
    `payload_crc`) before any byte is used. A sealed header is not authentic until then.

    Raises:
        CorruptBlockError: as for `open_block` (the payload check aside).
    """
    view = memoryview(header)
    if len(view) < HEADER_BYTES:
        raise CorruptBlockError(f"block of {len(view)} bytes is shorter than its header")
    (version,) = _VERSION.unpack_from(view, 4)
    if version == SEALED_VERSION:
        opened = _open_sealed(view, mac_keys)
    else:
        opened = _open_crc(view)
        if require_seal:
            raise CorruptBlockError("block is not sealed, and this client requires the seal")
    if opened.stored_length != payload_length:
        raise CorruptBlockError(
            f"header declares {opened.stored_length} payload bytes, block holds {payload_length}"
        )
    chain = opened.chain
    if chain[:16] != key_or_hash[:16]:
        raise CorruptBlockError("block belongs to another key")
    if len(key_or_hash) == 32 and opened.flags & FLAG_FULL_CHAIN and chain != key_or_hash:
        raise CorruptBlockError("block belongs to another chain (16-byte key collision)")
    if namespace is not None and opened.namespace != namespace:
        raise CorruptBlockError("block belongs to another namespace")
    return opened


def _open_crc(view: memoryview) -> BlockHeader:
    body = view[: _BODY.size]
    (header_crc,) = _CRC.unpack_from(view, _BODY.size)
    if crc32c.crc32c(body) != header_crc:
        raise CorruptBlockError("header checksum mismatch")
    magic, version, codec, flags, raw_len, stored_len, ns, chain, payload_crc, _ = _BODY.unpack(
        body
    )
    if magic != MAGIC or version != VERSION or flags & ~_KNOWN_FLAGS:
        raise CorruptBlockError(f"unknown block format (magic {magic!r}, version {version})")
    return BlockHeader(codec, flags, raw_len, stored_len, bytes(ns), bytes(chain), payload_crc)


def _open_sealed(view: memoryview, mac_keys: Mapping[int, bytes] | None) -> BlockHeader:
    signed = view[:_SIGNED]
    magic, _, codec, flags, raw_len, stored_len, ns, chain, key_id = _SEALED.unpack(signed)
    if magic != MAGIC or flags & ~_KNOWN_FLAGS:
        raise CorruptBlockError(f"unknown block format (magic {magic!r}, version 2)")
    if not mac_keys:
        raise CorruptBlockError(f"block is sealed (key id {key_id}); this client holds no key")
    key = mac_keys.get(key_id)
    if key is None:
        raise CorruptBlockError(
            f"block is sealed with key id {key_id}, which this client does not hold"
        )
    return BlockHeader(
        codec,
        flags,
        raw_len,
        stored_len,
        bytes(ns),
        bytes(chain),
        0,
        key_id,
        bytes(view[_SIGNED:HEADER_BYTES]),
        blake3(signed, key=key),
    )


def peek_codec(block: memoryview | bytes) -> int:
    """The codec id a stored block claims, unverified (0 for anything too short to say).

    For scheduling only (whether decoding is worth a worker thread); `open_block` decides
    whether the block is used.
    """
    if len(block) < HEADER_BYTES:
        return 0
    (codec_id,) = _CODEC.unpack_from(block, _CODEC_OFFSET)
    return int(codec_id)


# CRC combination (as zlib's crc32_combine, for CRC32C's reflected polynomial): the CRC of
# A ‖ B from the CRCs of A and B and B's length, without reading either. On `local://` the
# engine verified a cold block's whole value (header ‖ payload) against its slot's CRC as it
# read it; the payload's own CRC then follows from that and the header's, with no second pass.
_POLY = 0x82F63B78


def _mulmod(a: int, b: int) -> int:
    """a·b modulo the polynomial (bit-reflected: bit 31 is x^0)."""
    m, p = 1 << 31, 0
    while m and a:
        if a & m:
            p ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


_X2N = [1 << 30]  # x^(2^k) modulo the polynomial: x^1, x^2, x^4, ...
for _ in range(31):
    _X2N.append(_mulmod(_X2N[-1], _X2N[-1]))


@functools.lru_cache(maxsize=64)  # a store's blocks come in a few sizes
def _shift(length: int) -> int:
    """x^(8·length) modulo the polynomial: what appending `length` bytes multiplies by."""
    p, k = 1 << 31, 3
    while length:
        if length & 1:
            p = _mulmod(_X2N[k & 31], p)
        length >>= 1
        k += 1
    return p


def crc32c_suffix(whole: int, prefix: int, suffix_length: int) -> int:
    """CRC32C of B, given CRC32C of A ‖ B (`whole`), of A (`prefix`) and B's length."""
    if suffix_length < 0:
        raise ValueError(f"suffix_length must not be negative, got {suffix_length}")
    return whole ^ _mulmod(_shift(suffix_length), prefix)
