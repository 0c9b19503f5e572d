"""`Client` and `AsyncClient`: thin sync and async faces over one request layer.

The request layer (`_Requests`) owns everything that is not I/O: key checks, the block header,
integrity verification and counters. The two clients differ only in how they wait on the
transport.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from types import TracebackType

import numpy as np

from kvoffload.buffers import Bytes, as_readable, as_writable
from kvoffload.client_sdk.keys import BlockKey, Namespace, to_key
from kvoffload.client_sdk.transports import open_async_transport, open_transport
from kvoffload.client_sdk.transports.base import (
    AsyncTransport,
    HeldBlock,
    PutItem,
    Received,
    Transport,
)
from kvoffload.client_sdk.url import DEFAULT_URL, parse_url
from kvoffload.client_sdk.wire.block import (
    HEADER_BYTES,
    BlockHeader,
    open_parts,
    peek_codec,
    seal,
)
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
    DeadlineExceededError,
    InvalidArgumentError,
    TransportError,
    UnsupportedCodecConfigError,
)

__all__ = ["AsyncClient", "Client", "ClientStats", "resolve_codec"]

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
class _Put:
    key: BlockKey
    parent: BlockKey | None
    header: bytes
    payload: Bytes
    raw_size: int


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


class _Requests:
    """Validation, encoding, sealing, verification, decoding and counting around any
    transport; no I/O."""

    def __init__(
        self,
        namespace: Namespace | None,
        max_value_bytes: Callable[[], int],
        codec: str | Codec | None,
    ) -> None:
        self.namespace = namespace
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

    def prepare_put(self, key: bytes, value: object, parent: bytes | None) -> _Put:
        block_key = to_key(key)
        parent_key = None if parent is None else to_key(parent, "parent")
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
        )
        return _Put(block_key, parent_key, header, payload, raw.size)

    @property
    def _none(self) -> Codec:
        return codec_for_id(CODEC_NONE)

    def prepare_many(
        self, items: Iterable[tuple[bytes, object]], parents: Sequence[bytes | None] | None
    ) -> list[_Put]:
        return [self.prepare_put(k, v, p) for k, v, p in _pairs(items, parents)]

    def put_done(self, *puts: _Put) -> None:
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
        header = self._open(key, data[:HEADER_BYTES], data[HEADER_BYTES:])
        if header is None:
            held.release()
            return None
        return header, as_readable(data[HEADER_BYTES:])

    def _open(self, key: bytes, header: memoryview, payload: memoryview) -> BlockHeader | None:
        """Verify a block's header and payload; None is a counted, logged corrupt miss."""
        try:
            opened = open_parts(
                header, payload, key_or_hash=bytes(key), namespace=self._fingerprint
            )
            if opened.raw_length > self.max_payload:
                raise CorruptBlockError(
                    f"header declares {opened.raw_length} raw bytes, more than any put accepts"
                )
        except CorruptBlockError as exc:
            log.warning("block %s failed verification (%s); served as a miss", key.hex(), exc)
            self._count_miss(corrupt=True)
            return None
        return opened

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
        verified = self.verify(key, held)
        if verified is None or held is None:
            return None
        header, payload = verified
        try:
            if header.raw_length > buffer.size:
                raise InvalidArgumentError(
                    f"buffer of {buffer.size} bytes is too small for a "
                    f"{header.raw_length}-byte block"
                )
            ok = self._decode(key, header, payload, buffer[: header.raw_length])
            return header.raw_length if ok else None
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
        header = self._open(key, got.header, payload.data)
        if header is None:
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


def _keys(keys: Sequence[bytes]) -> list[BlockKey]:
    try:
        return [to_key(k) for k in keys]
    except TypeError:
        raise InvalidArgumentError(
            f"expected a sequence of keys, got {type(keys).__name__}"
        ) from None


def _many_into(
    keys: Sequence[bytes], buffers: Sequence[object]
) -> tuple[list[Bytes], list[BlockKey]]:
    block_keys = _keys(keys)
    if len(buffers) != len(block_keys):
        raise InvalidArgumentError(f"{len(block_keys)} keys but {len(buffers)} buffers")
    return [as_writable(b) for b in buffers], block_keys


def _encoded(held: HeldBlock | Received | None) -> bool:
    """Whether a received block needs decoding (CPU work to keep off an event loop)."""
    if held is None:
        return False
    return peek_codec(held.header if isinstance(held, Received) else held.data) != CODEC_NONE


def _put_items(puts: Sequence[_Put]) -> list[PutItem]:
    return [(p.key, (p.header, p.payload), p.parent) for p in puts]


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


class Client:
    """Put and get KV blocks in a store named by a URL.

    Keys are 16-byte block keys (or 32-byte chain hashes, which add a full-hash check on
    reads). Values are any contiguous buffer. Every read is verified (header, key, namespace,
    CRC32C) before a byte reaches the caller; a block that fails is a counted miss.

    Values are encoded with the client's codec on put (the namespace's, unless `codec` names
    one; default ``none``) and decoded on get with whatever codec the block's header names, so
    every transport carries and every store holds the encoded bytes.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        namespace: Namespace | None = None,
        codec: str | Codec | None = None,
    ) -> None:
        """
        Args:
            transport: the store connection.
            namespace: the model/layout of the blocks; readers only accept blocks of theirs.
            codec: a codec name or instance (`kvoffload.compression.get_codec`) for puts.

        Raises:
            UnsupportedCodecConfigError: unknown codec, or a lossy codec the namespace does
                not declare.
        """
        self._transport = transport
        self._requests = _Requests(namespace, lambda: transport.max_value_bytes, codec)

    @classmethod
    def connect(
        cls,
        url: str | None = None,
        *,
        namespace: Namespace | None = None,
        codec: str | Codec | None = None,
    ) -> Client:
        """Open a client for `url` (default: an embedded DRAM store, ``local://``).

        Raises:
            ConfigError: unknown scheme or bad URL parameters.
            UnsupportedCodecConfigError: see `Client`.
        """
        chosen = resolve_codec(namespace, codec)  # fail before connecting
        return cls(open_transport(parse_url(url or DEFAULT_URL)), namespace=namespace, codec=chosen)

    @property
    def namespace(self) -> Namespace | None:
        return self._requests.namespace

    @property
    def codec(self) -> Codec:
        """The codec this client writes with."""
        return self._requests.codec

    @property
    def transport(self) -> Transport:
        return self._transport

    def put(
        self, key: bytes, value: object, *, parent: bytes | None = None, durable: bool = False
    ) -> None:
        """Store `value` under `key`; `parent` is the previous block of the same chain.

        Args:
            durable: return only once the block is on stable storage (needs an SSD tier);
                the default returns once the block is in the store's memory.

        Raises:
            InvalidArgumentError: bad key, parent or value (nothing was stored).
            CodecMismatchError: the value does not fit the codec (not one block of the
                namespace, another dtype); an `InvalidArgumentError` too.
            CapacityError: the store cannot make room.
        """
        put = self._requests.prepare_put(key, value, parent)
        self._transport.put(put.key, (put.header, put.payload), put.parent, durable)
        self._requests.put_done(put)

    def put_many(
        self,
        items: Iterable[tuple[bytes, object]],
        *,
        parents: Sequence[bytes | None] | None = None,
    ) -> None:
        """`put` each (key, value) pair in order, with optional parents, in as few round trips
        as the transport allows. Nothing is sent unless every item is valid.

        Raises:
            InvalidArgumentError, CapacityError: as for `put`; on CapacityError the items before
                the failing one are stored.
        """
        puts = self._requests.prepare_many(items, parents)
        self._transport.put_many(_put_items(puts))
        self._requests.put_done(*puts)

    def get(self, key: bytes) -> bytes | None:
        """The verified, decoded value, or None on a miss, a corrupt or an undecodable block."""
        block_key = to_key(key)
        return self._requests.read_bytes(key, self._transport.get(block_key))

    def get_into(self, key: bytes, buffer: object) -> int | None:
        """Decode the verified value into `buffer`; returns its length, or None on a miss.

        The block is checked (header, CRC32C) before any byte is written; an encoded block is
        then decoded straight into `buffer` (byte-plane codecs use one scratch array per
        part). If decoding fails after verification, the bytes it would have filled are
        zeroed and the read is a miss. If the get fails part-way (a lost connection, the
        deadline), the bytes that had already arrived in `buffer` are zeroed before it raises.

        Raises:
            InvalidArgumentError: `buffer` is read-only, not contiguous, or too small.
            TransportError, DeadlineExceededError: the store could not be read.
        """
        dst = as_writable(buffer)
        block_key = to_key(key)
        return self._requests.read_into(key, self._transport.get_into(block_key, dst.data), dst)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """`get` for each key, in as few round trips as the transport allows."""
        held = self._transport.get_many(_keys(keys))
        return [self._requests.read_bytes(k, h) for k, h in zip(keys, held, strict=True)]

    def get_many_into(self, keys: Sequence[bytes], buffers: Sequence[object]) -> list[int | None]:
        """`get_into` for each key with its own buffer, in as few round trips as the transport
        allows: over `kv://` one pipelined batch whose blocks are received straight into the
        buffers. Returns each value's length, or None for a miss (its buffer untouched, or
        zeroed where a damaged block had landed).

        Raises:
            InvalidArgumentError: not one buffer per key, or a buffer read-only, not contiguous
                or too small.
            TransportError, DeadlineExceededError: the store could not be read (no partial
                block is left in any buffer).
        """
        dsts, block_keys = _many_into(keys, buffers)
        got = self._transport.get_many_into(block_keys, [d.data for d in dsts])
        return self._requests.read_many_into(keys, got, dsts)

    def exists(self, key: bytes) -> bool:
        """Whether the store holds `key`; False also when the store cannot be reached."""
        block_key = to_key(key)
        try:
            return self._transport.exists(block_key)
        except (TransportError, DeadlineExceededError) as exc:
            self._requests.unreachable("exists", exc)
            return False

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading blocks of the chain `keys` the store holds (0 when the store cannot
        be reached: a serving engine then recomputes instead of failing)."""
        block_keys = _keys(keys)
        try:
            return self._transport.lookup(block_keys)
        except (TransportError, DeadlineExceededError) as exc:
            self._requests.unreachable("lookup", exc)
            return 0

    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Ask the store to stage `keys` in its fastest tier; returns how many are there."""
        return self._transport.prefetch(_keys(keys))

    def delete(self, key: bytes) -> bool:
        """Delete `key`; True if the store held it.

        After a lost connection the transport retries (every operation is idempotent), so if
        the first attempt deleted the key before the connection broke, the retry finds nothing
        and this returns False although this call deleted it. The key is gone either way; do
        not use the result to count deletions.
        """
        return self._transport.delete(to_key(key))

    def stats(self) -> ClientStats:
        return self._requests.stats(self._transport.stats())

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class AsyncClient:
    """`Client` as coroutines, over the same request layer; see `Client` for each method."""

    def __init__(
        self,
        transport: AsyncTransport,
        *,
        namespace: Namespace | None = None,
        codec: str | Codec | None = None,
    ) -> None:
        self._transport = transport
        self._requests = _Requests(namespace, lambda: transport.max_value_bytes, codec)
        self._opened = False

    @classmethod
    def connect(
        cls,
        url: str | None = None,
        *,
        namespace: Namespace | None = None,
        codec: str | Codec | None = None,
    ) -> AsyncClient:
        """An async client for `url` (default ``local://``); a remote store is connected to on
        first use."""
        chosen = resolve_codec(namespace, codec)  # fail before connecting
        transport = open_async_transport(parse_url(url or DEFAULT_URL))
        return cls(transport, namespace=namespace, codec=chosen)

    async def _open(self) -> None:
        if not self._opened:
            await self._transport.open()
            self._opened = True

    @property
    def namespace(self) -> Namespace | None:
        return self._requests.namespace

    @property
    def codec(self) -> Codec:
        return self._requests.codec

    async def put(
        self, key: bytes, value: object, *, parent: bytes | None = None, durable: bool = False
    ) -> None:
        await self._open()
        requests = self._requests
        if requests.codec.codec_id == CODEC_NONE:
            put = requests.prepare_put(key, value, parent)
        else:  # encoding takes CPU time: keep it off the event loop
            put = await asyncio.to_thread(requests.prepare_put, key, value, parent)
        await self._transport.put(put.key, (put.header, put.payload), put.parent, durable)
        requests.put_done(put)

    async def put_many(
        self,
        items: Iterable[tuple[bytes, object]],
        *,
        parents: Sequence[bytes | None] | None = None,
    ) -> None:
        await self._open()
        requests = self._requests
        if requests.codec.codec_id == CODEC_NONE:
            puts = requests.prepare_many(items, parents)
        else:  # encoding takes CPU time: keep it off the event loop
            puts = await asyncio.to_thread(requests.prepare_many, items, parents)
        await self._transport.put_many(_put_items(puts))
        requests.put_done(*puts)

    async def get(self, key: bytes) -> bytes | None:
        held = await self._transport.get(to_key(key))
        if held is not None and peek_codec(held.data) != CODEC_NONE:
            return await asyncio.to_thread(self._requests.read_bytes, key, held)
        return self._requests.read_bytes(key, held)

    async def get_into(self, key: bytes, buffer: object) -> int | None:
        dst = as_writable(buffer)
        held = await self._transport.get_into(to_key(key), dst.data)
        if _encoded(held):
            # Decoding takes CPU time: keep it off the event loop.
            return await asyncio.to_thread(self._requests.read_into, key, held, dst)
        return self._requests.read_into(key, held, dst)

    async def get_many_into(
        self, keys: Sequence[bytes], buffers: Sequence[object]
    ) -> list[int | None]:
        dsts, block_keys = _many_into(keys, buffers)
        got = await self._transport.get_many_into(block_keys, [d.data for d in dsts])
        if any(_encoded(h) for h in got):
            return await asyncio.to_thread(self._read_many_into, keys, got, dsts)
        return self._read_many_into(keys, got, dsts)

    def _read_many_into(
        self,
        keys: Sequence[bytes],
        got: Sequence[HeldBlock | Received | None],
        dsts: Sequence[Bytes],
    ) -> list[int | None]:
        return self._requests.read_many_into(keys, got, dsts)

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        held = await self._transport.get_many(_keys(keys))
        if any(h is not None and peek_codec(h.data) != CODEC_NONE for h in held):
            return await asyncio.to_thread(self._read_all, keys, held)
        return self._read_all(keys, held)

    def _read_all(self, keys: Sequence[bytes], held: list[HeldBlock | None]) -> list[bytes | None]:
        return [self._requests.read_bytes(k, h) for k, h in zip(keys, held, strict=True)]

    async def exists(self, key: bytes) -> bool:
        block_key = to_key(key)
        try:
            return await self._transport.exists(block_key)
        except (TransportError, DeadlineExceededError) as exc:
            self._requests.unreachable("exists", exc)
            return False

    async def lookup(self, keys: Sequence[bytes]) -> int:
        block_keys = _keys(keys)
        try:
            return await self._transport.lookup(block_keys)
        except (TransportError, DeadlineExceededError) as exc:
            self._requests.unreachable("lookup", exc)
            return 0

    async def prefetch(self, keys: Sequence[bytes]) -> int:
        return await self._transport.prefetch(_keys(keys))

    async def delete(self, key: bytes) -> bool:
        """Delete `key`; True if the store held it (False after a retry: see `Client.delete`)."""
        return await self._transport.delete(to_key(key))

    async def stats(self) -> ClientStats:
        return self._requests.stats(await self._transport.stats())

    async def close(self) -> None:
        await self._transport.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
