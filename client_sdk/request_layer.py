"""The request layer `Client` and `AsyncClient` share: key checks, encoding and the block
header on the way in; integrity verification and decoding on the way out; the counters. No
I/O: the clients hand what it prepares to a transport and what the transport got back to it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import cast

import numpy as np

from kvoffload.buffers import Bytes, as_readable, as_writable
from kvoffload.client_sdk.keys import KEY_BYTES, BlockKey, Namespace, to_key
from kvoffload.client_sdk.seal import SealKeys
from kvoffload.client_sdk.transports.base import HeldBlock, PutItem, Received
from kvoffload.compression import (
    CODEC_NONE,
    DTYPE_BYTES,
    BlockSpec,
    Codec,
    codec_for_id,
    get_codec,
)
from kvoffload.errors import (
    CodecError,
    CodecMismatchError,
    CorruptBlockError,
    InvalidArgumentError,
    UnsupportedCodecConfigError,
)
from kvoffload.wire import fast as _fast
from kvoffload.wire.block import (
    HEADER_BYTES,
    BlockHeader,
    check_payload,
    crc32c_suffix,
    open_header,
    open_parts,
    peek_codec,
    seal,
)
from kvoffload.wire.blockmeta import BlockMeta

__all__ = [
    "ClientStats",
    "PreparedPut",
    "RequestLayer",
    "to_keys",
    "encoded",
    "many_into",
    "put_items",
    "resolve_codec",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClientStats:
    """What this client did, plus the store's own counters (`store`).

    Byte counters follow a block through the client: `bytes_put` raw bytes go in, the codec
    turns them into `bytes_stored` bytes on their way to the store (header included); a hit
    moves `bytes_fetched` stored bytes back and hands `bytes_got` decoded bytes to the caller.
    ``bytes_put / bytes_stored`` is the compression ratio this client achieved, headers
    included.
    """

    puts: int
    hits: int
    misses: int
    corrupt_blocks: int  # blocks that failed verification and were served as misses
    bytes_put: int  # raw value bytes handed to put / put_many (before encoding)
    bytes_stored: int  # bytes sent to the store: header + encoded payload
    bytes_got: int  # decoded value bytes returned by get / get_into
    bytes_fetched: int = 0  # bytes read from the store for hits: header + encoded payload
    # Blocks that passed verification but could not be decoded (unknown codec id, malformed
    # payload); served as misses and logged.
    codec_errors: int = 0
    unreachable: int = 0  # lookups and exists answered as misses because the store was down
    store: dict[str, object] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class PreparedPut:
    key: BlockKey
    parent: BlockKey | None
    header: bytes
    payload: Bytes
    raw_size: int
    meta: bytes | None = None  # `BlockMeta` in its byte form


def resolve_codec(namespace: Namespace | None, codec: str | Codec | None) -> Codec:
    """The codec a client writes with: its own choice, else the namespace's, else ``none``.

    A lossy codec must be the namespace's own (it is part of block identity), and a namespace
    that names a lossy codec is written with that codec only.

    Raises:
        UnsupportedCodecConfigError: unknown codec, or a lossy choice that contradicts the
            namespace.
    """
    declared = namespace.codec if namespace is not None else ""
    if codec is None:
        chosen = get_codec(declared or "none")
    else:
        chosen = get_codec(codec) if isinstance(codec, str) else codec
    lossy = namespace.lossy_codec if namespace is not None else ""
    if lossy and chosen.name != lossy:
        raise UnsupportedCodecConfigError(
            f"the namespace declares the lossy codec {lossy!r}; its blocks cannot be written "
            f"with {chosen.name!r}"
        )
    if not chosen.lossless and chosen.name != lossy:
        raise UnsupportedCodecConfigError(
            f"lossy codec {chosen.name!r} changes the KV readers get, so it must be part of "
            f"block identity: declare it as Namespace(..., codec={chosen.name!r})"
        )
    return chosen


def _value_dtype(value: object) -> str | None:
    """The element dtype a numpy array or torch tensor declares (None for plain buffers)."""
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    return name if name in DTYPE_BYTES else None


class RequestLayer:
    """Validation, encoding, sealing, verification, decoding and counting around any
    transport; no I/O."""

    def __init__(
        self,
        namespace: Namespace | None,
        max_value_bytes: Callable[[], int],
        codec: str | Codec | None,
        seal: SealKeys | None = None,
    ) -> None:
        self.namespace = namespace
        self.seal = seal
        self._mac_keys = seal.keys if seal is not None else None
        self._require_seal = seal is not None and seal.required
        self.codec = resolve_codec(namespace, codec)
        self._fingerprint = namespace.fingerprint if namespace is not None else None
        # Asked on first use: a remote store tells its limit when the connection opens.
        self._max_value_bytes = max_value_bytes
        self._max_payload: int | None = None
        self._lock = threading.Lock()
        self._puts = self._hits = self._misses = self._corrupt = self._codec_errors = 0
        self._unreachable = 0
        self._bytes_put = self._bytes_stored = self._bytes_got = self._bytes_fetched = 0

    @property
    def max_payload(self) -> int:
        if self._max_payload is None:
            self._max_payload = self._max_value_bytes() - HEADER_BYTES
        return self._max_payload

    def _spec(self, value: object, size: int) -> BlockSpec | None:
        """What the codec may assume about `value`: the namespace's dtype and, for a whole
        block, its shape; without a namespace, the dtype the value itself declares."""
        declared = _value_dtype(value)
        ns = self.namespace
        if ns is None:
            return BlockSpec(declared) if declared is not None else None
        if declared not in (None, "uint8", ns.dtype):
            raise CodecMismatchError(
                f"value of dtype {declared} does not match the namespace's dtype {ns.dtype}"
            )
        spec = ns.block_spec
        # Byte planes work on any length; a quantiser reports a value that is not one block.
        return spec if size == spec.nbytes or not self.codec.lossless else spec.flat()

    def prepare_put(
        self, key: bytes, value: object, parent: bytes | None, meta: BlockMeta | None = None
    ) -> PreparedPut:
        block_key = to_key(key)
        parent_key = None if parent is None else to_key(parent, "parent")
        if meta is not None and not isinstance(meta, BlockMeta):
            raise InvalidArgumentError(f"meta must be a BlockMeta, got {type(meta).__name__}")
        raw = as_readable(value)
        if raw.size > self.max_payload:
            raise InvalidArgumentError(
                f"value of {raw.size} bytes exceeds the store's limit of {self.max_payload} "
                "bytes per block"
            )
        codec = self.codec
        payload = raw
        if codec.codec_id != CODEC_NONE:
            spec = self._spec(value, raw.size) if codec.typed else None
            payload = as_readable(codec.encode(raw, spec))
            if codec.lossless and payload.size >= raw.size:
                codec, payload = self._none, raw  # incompressible: store it as it is
        header = seal(
            key_or_hash=bytes(key),
            payload=payload.data,
            stored_length=payload.size,
            raw_length=raw.size,
            namespace=self._fingerprint,
            codec_id=codec.codec_id,
            mac_key=self.seal.current if self.seal is not None else None,
        )
        encoded_meta = meta.encode() if meta is not None else None
        return PreparedPut(block_key, parent_key, header, payload, raw.size, encoded_meta)

    @property
    def _none(self) -> Codec:
        return codec_for_id(CODEC_NONE)

    def prepare_many(
        self,
        items: Iterable[tuple[bytes, object]],
        parents: Sequence[bytes | None] | None,
        metas: Sequence[BlockMeta | None] | None = None,
    ) -> list[PreparedPut]:
        pairs = _pairs(items, parents)
        if metas is not None and len(metas) != len(pairs):
            raise InvalidArgumentError(f"{len(pairs)} items but {len(metas)} metadata entries")
        return [self.prepare_put(k, v, p, metas[i] if metas is not None else None)
                for i, (k, v, p) in enumerate(pairs)]  # fmt: skip

    def put_done(self, *puts: PreparedPut) -> None:
        with self._lock:
            for put in puts:
                self._puts += 1
                self._bytes_put += put.raw_size
                self._bytes_stored += put.payload.size + HEADER_BYTES

    def unreachable(self, what: str, exc: Exception) -> None:
        """A lookup-type call that could not reach the store: it answers as a miss."""
        log.warning("%s: store unreachable (%s); answering as a miss", what, exc)
        with self._lock:
            self._unreachable += 1

    def verify(self, key: bytes, held: HeldBlock | None) -> tuple[BlockHeader, Bytes] | None:
        """The header and payload of a verified block, or None (a counted miss; corrupt blocks
        are logged). On None the block has been released."""
        if held is None:
            self._count_miss()
            return None
        data = held.data
        store_crc = _store_crc(held, data)
        header = self._open(key, data[:HEADER_BYTES], data[HEADER_BYTES:],
                            summed=store_crc is None)  # fmt: skip
        payload = as_readable(data[HEADER_BYTES:])
        if header is None or not (store_crc is None or self._intact(key, header, payload,
                                                                     store_crc)):  # fmt: skip
            held.release()
            return None
        return header, payload

    def _open(
        self, key: bytes, header: memoryview, payload: memoryview, *, summed: bool = True
    ) -> BlockHeader | None:
        """Verify a block's header and payload (`summed` False: all but the payload checksum,
        which the caller then checks); None is a counted, logged corrupt miss."""
        try:
            if summed:
                opened = open_parts(
                    header,
                    payload,
                    key_or_hash=bytes(key),
                    namespace=self._fingerprint,
                    mac_keys=self._mac_keys,
                    require_seal=self._require_seal,
                )
            else:
                opened = open_header(
                    header,
                    len(payload),
                    key_or_hash=bytes(key),
                    namespace=self._fingerprint,
                    mac_keys=self._mac_keys,
                    require_seal=self._require_seal,
                )
            if opened.raw_length > self.max_payload:
                raise CorruptBlockError(
                    f"header declares {opened.raw_length} raw bytes, more than any put accepts"
                )
        except CorruptBlockError as exc:
            self._corrupt_miss(key, exc)
            return None
        return opened

    def _intact(
        self, key: bytes, header: BlockHeader, payload: Bytes, crc: int | None = None
    ) -> bool:
        """Check a payload against a header `_open` passed unsummed (`crc`: its CRC32C, if a
        transport summed it already); False is a counted, logged corrupt miss."""
        if header.key_id is None:
            if (_fast.crc32c(payload) if crc is None else crc) == header.payload_crc:
                return True
            self._corrupt_miss(key, "payload checksum mismatch")
            return False
        try:
            check_payload(header, payload.data)
        except CorruptBlockError as exc:
            self._corrupt_miss(key, exc)
            return False
        return True

    def _corrupt_miss(self, key: bytes, why: object) -> None:
        log.warning("block %s failed verification (%s); served as a miss", key.hex(), why)
        self._count_miss(corrupt=True)

    def _count_miss(self, *, corrupt: bool = False, codec_error: bool = False) -> None:
        with self._lock:
            self._misses += 1
            self._corrupt += corrupt
            self._codec_errors += codec_error

    def _decode(self, key: bytes, header: BlockHeader, payload: Bytes, out: Bytes) -> bool:
        """Decode a verified payload into `out` (exactly its raw length). False is a counted,
        logged miss: an unknown codec leaves `out` untouched, a failed decode zeroes it rather
        than leave it half-decoded."""
        try:
            codec = codec_for_id(header.codec_id)
            lossy = self.namespace.lossy_codec if self.namespace is not None else ""
            if not codec.lossless and codec.name != lossy:
                # Lossy KV only reaches readers whose namespace declares that codec.
                raise UnsupportedCodecConfigError(
                    f"a {codec.name} (lossy) block, and this reader did not declare it"
                )
        except CodecError as exc:
            self._undecodable(key, header, exc)
            return False
        try:
            codec.decode_into(payload, out)
        except CodecError as exc:
            out[:] = 0
            self._undecodable(key, header, exc)
            return False
        self._count_hit(header, payload)
        return True

    def _undecodable(self, key: bytes, header: BlockHeader, exc: CodecError) -> None:
        log.warning(
            "block %s (codec id %d) could not be decoded (%s); served as a miss",
            key.hex(),
            header.codec_id,
            exc,
        )
        self._count_miss(codec_error=True)

    def _count_hit(self, header: BlockHeader, payload: Bytes) -> None:
        with self._lock:
            self._hits += 1
            self._bytes_got += header.raw_length
            self._bytes_fetched += HEADER_BYTES + payload.size

    def read_bytes(self, key: bytes, held: HeldBlock | None) -> bytes | None:
        verified = self.verify(key, held)
        if verified is None or held is None:
            return None
        header, payload = verified
        try:
            if header.codec_id == CODEC_NONE and header.raw_length == payload.size:
                self._count_hit(header, payload)
                return payload.tobytes()  # the one copy; decoding would add a second
            out = np.empty(header.raw_length, dtype=np.uint8)
            return out.tobytes() if self._decode(key, header, payload, out) else None
        finally:
            held.release()

    def read_into(self, key: bytes, held: HeldBlock | Received | None, buffer: Bytes) -> int | None:
        if isinstance(held, Received):
            return self._received(key, held, buffer)
        if held is None:
            self._count_miss()
            return None
        return self._copy_into(key, held, buffer)

    def _copy_into(self, key: bytes, held: HeldBlock, buffer: Bytes) -> int | None:
        """`read_into` of a block held in the store's memory (local://): a raw CRC-only payload
        is summed while it is copied (one pass); a mismatch zeroes what was copied."""
        try:
            data = held.data
            payload = as_readable(data[HEADER_BYTES:])
            header = self._open(key, data[:HEADER_BYTES], data[HEADER_BYTES:], summed=False)
            if header is None:
                return None
            store_crc = _store_crc(held, data)
            raw = header.raw_length
            # A sealed block is checked in place first: the MAC cannot be summed while copying.
            if (
                raw > buffer.size
                or header.codec_id != CODEC_NONE
                or raw != payload.size
                or header.key_id is not None
            ):
                if not self._intact(key, header, payload, store_crc):
                    return None
                if raw > buffer.size:
                    raise InvalidArgumentError(
                        f"buffer of {buffer.size} bytes is too small for a {raw}-byte block"
                    )
                return raw if self._decode(key, header, payload, buffer[:raw]) else None
            out = buffer[:raw]
            if store_crc is not None:  # the store summed these bytes: a plain copy
                if not self._intact(key, header, payload, store_crc):
                    return None
                out[:] = payload
                self._count_hit(header, payload)
                return raw
            if _fast.crc32c_copy(out, payload) != header.payload_crc:
                out[:] = 0  # no byte of a corrupt block stays in the caller's buffer
                self._corrupt_miss(key, "payload checksum mismatch")
                return None
            self._count_hit(header, payload)
            return raw
        finally:
            held.release()

    def read_many_into(
        self,
        keys: Sequence[bytes],
        got: Sequence[HeldBlock | Received | None],
        buffers: Sequence[Bytes],
    ) -> list[int | None]:
        """`read_into` for each block; if one raises, the blocks after it are released too
        (a held block pins its store slot until then)."""
        out: list[int | None] = []
        try:
            for key, held, buffer in zip(keys, got, buffers, strict=True):
                out.append(self.read_into(key, held, buffer))
        except BaseException:
            for held in got[len(out) + 1 :]:
                if held is not None and not isinstance(held, Received):
                    held.release()
            raise
        return out

    def _received(self, key: bytes, got: Received, buffer: Bytes) -> int | None:
        """Verify (and decode in place) a payload a transport already put into `buffer`; a
        corrupt one is zeroed there, so that no byte of it is left for a caller who ignores the
        miss."""
        payload = buffer[: got.length]
        summed = got.crc is None
        header = self._open(key, got.header, payload.data, summed=summed)
        if header is None or not (summed or self._intact(key, header, payload, got.crc)):
            payload[:] = 0
            return None
        if header.codec_id == CODEC_NONE and header.raw_length == got.length:
            self._count_hit(header, payload)
            return got.length
        if header.raw_length > buffer.size:
            payload[:] = 0
            raise InvalidArgumentError(
                f"buffer of {buffer.size} bytes is too small for a {header.raw_length}-byte block"
            )
        encoded = payload.copy()  # decoding writes over where the encoded bytes landed
        if self._decode(key, header, encoded, buffer[: header.raw_length]):
            return header.raw_length
        payload[:] = 0  # no byte of an undecodable block stays in the caller's buffer
        return None

    def stats(self, store: dict[str, object]) -> ClientStats:
        with self._lock:
            return ClientStats(
                puts=self._puts,
                hits=self._hits,
                misses=self._misses,
                corrupt_blocks=self._corrupt,
                bytes_put=self._bytes_put,
                bytes_stored=self._bytes_stored,
                bytes_got=self._bytes_got,
                bytes_fetched=self._bytes_fetched,
                codec_errors=self._codec_errors,
                unreachable=self._unreachable,
                store=store,
            )


_ONLY_BYTES = frozenset({bytes})
_ONLY_KEY_LENGTH = frozenset({KEY_BYTES})


def to_keys(keys: Sequence[bytes]) -> list[BlockKey]:
    try:
        # The common case, every key a 16-byte `bytes` in a list or tuple, checked in one C
        # pass; another sequence in two passes that run in C.
        if _fast.all_keys(keys, KEY_BYTES) or (
            set(map(type, keys)) <= _ONLY_BYTES and set(map(len, keys)) <= _ONLY_KEY_LENGTH
        ):
            return cast(list[BlockKey], list(keys))
        return [to_key(k) for k in keys]
    except TypeError:
        raise InvalidArgumentError(
            f"expected a sequence of keys, got {type(keys).__name__}"
        ) from None


def many_into(
    keys: Sequence[bytes], buffers: Sequence[object]
) -> tuple[list[Bytes], list[BlockKey]]:
    block_keys = to_keys(keys)
    if len(buffers) != len(block_keys):
        raise InvalidArgumentError(f"{len(block_keys)} keys but {len(buffers)} buffers")
    return [as_writable(b) for b in buffers], block_keys


def _store_crc(held: HeldBlock, data: memoryview) -> int | None:
    """The payload's CRC32C without a pass over it, where the store vouches for the whole
    value's (`local://`: the engine checked a block read back from the SSD against its slot's
    CRC in the memory `data` views): by CRC combination with the header's; else None."""
    whole = getattr(held, "value_crc", None)
    if not isinstance(whole, int) or len(data) < HEADER_BYTES:
        return None
    return crc32c_suffix(whole, _fast.crc32c(data[:HEADER_BYTES]), len(data) - HEADER_BYTES)


def encoded(held: HeldBlock | Received | None) -> bool:
    """Whether a received block needs decoding (CPU work to keep off an event loop)."""
    if held is None:
        return False
    return peek_codec(held.header if isinstance(held, Received) else held.data) != CODEC_NONE


def put_items(puts: Sequence[PreparedPut]) -> list[PutItem]:
    return [(p.key, (p.header, p.payload), p.parent, p.meta) for p in puts]


def _pairs(
    items: Iterable[tuple[bytes, object]], parents: Sequence[bytes | None] | None
) -> list[tuple[bytes, object, bytes | None]]:
    try:
        pairs = [(k, v) for k, v in items]
    except (TypeError, ValueError):
        raise InvalidArgumentError("items must be (key, value) pairs") from None
    if parents is not None and len(parents) != len(pairs):
        raise InvalidArgumentError(f"{len(pairs)} items but {len(parents)} parents")
    return [(k, v, parents[i] if parents else None) for i, (k, v) in enumerate(pairs)]
