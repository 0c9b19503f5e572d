"""`Client` and `AsyncClient`: thin sync and async faces over one request layer.

The request layer (`_Requests`) owns everything that is not I/O: key checks, the block header,
integrity verification and counters. The two clients differ only in how they wait on the
transport.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from types import TracebackType

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
from kvoffload.client_sdk.wire.block import HEADER_BYTES, open_block, open_parts, seal
from kvoffload.errors import (
    CorruptBlockError,
    DeadlineExceededError,
    InvalidArgumentError,
    TransportError,
)
from kvoffload.kvstore.buffers import Bytes, as_readable, as_writable

__all__ = ["AsyncClient", "Client", "ClientStats"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClientStats:
    """What this client did, plus the store's own counters (`store`)."""

    puts: int
    hits: int
    misses: int
    corrupt_blocks: int  # blocks that failed verification and were served as misses
    bytes_put: int  # payload bytes handed to put
    bytes_stored: int  # bytes sent to the store (headers included)
    bytes_got: int  # payload bytes returned by get / get_into
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


class _Requests:
    """Validation, sealing, verification and counting around any transport; no I/O."""

    def __init__(self, namespace: Namespace | None, max_value_bytes: Callable[[], int]) -> None:
        self.namespace = namespace
        self._fingerprint = namespace.fingerprint if namespace is not None else None
        # Asked on first use: a remote store tells its limit when the connection opens.
        self._max_value_bytes = max_value_bytes
        self._max_payload: int | None = None
        self._lock = threading.Lock()
        self._puts = self._hits = self._misses = self._corrupt_count = self._unreachable = 0
        self._bytes_put = self._bytes_stored = self._bytes_got = 0

    @property
    def max_payload(self) -> int:
        if self._max_payload is None:
            self._max_payload = self._max_value_bytes() - HEADER_BYTES
        return self._max_payload

    def prepare_put(self, key: bytes, value: object, parent: bytes | None) -> _Put:
        block_key = to_key(key)
        parent_key = None if parent is None else to_key(parent, "parent")
        payload = as_readable(value)
        if payload.size > self.max_payload:
            raise InvalidArgumentError(
                f"value of {payload.size} bytes exceeds the store's limit of {self.max_payload} "
                "bytes per block"
            )
        header = seal(
            key_or_hash=bytes(key),
            payload=payload.data,
            stored_length=payload.size,
            raw_length=payload.size,
            namespace=self._fingerprint,
        )
        return _Put(block_key, parent_key, header, payload)

    def prepare_many(
        self, items: Iterable[tuple[bytes, object]], parents: Sequence[bytes | None] | None
    ) -> list[_Put]:
        return [self.prepare_put(k, v, p) for k, v, p in _pairs(items, parents)]

    def put_done(self, *puts: _Put) -> None:
        with self._lock:
            for put in puts:
                self._puts += 1
                self._bytes_put += put.payload.size
                self._bytes_stored += put.payload.size + HEADER_BYTES

    def _corrupt(self, key: bytes, exc: CorruptBlockError) -> None:
        log.warning("block %s failed verification (%s); served as a miss", key.hex(), exc)
        with self._lock:
            self._corrupt_count += 1
            self._misses += 1

    def _hit(self, length: int) -> None:
        with self._lock:
            self._hits += 1
            self._bytes_got += length

    def unreachable(self, what: str, exc: Exception) -> None:
        """A lookup-type call that could not reach the store: it answers as a miss."""
        log.warning("%s: store unreachable (%s); answering as a miss", what, exc)
        with self._lock:
            self._unreachable += 1

    def verify(self, key: bytes, held: HeldBlock | None) -> memoryview | None:
        """The payload of a verified block, or None (a miss, counted; corrupt ones logged)."""
        if held is None:
            with self._lock:
                self._misses += 1
            return None
        try:
            open_block(held.data, key_or_hash=bytes(key), namespace=self._fingerprint)
        except CorruptBlockError as exc:
            held.release()
            self._corrupt(key, exc)
            return None
        payload = held.data[HEADER_BYTES:]
        self._hit(len(payload))
        return payload

    def read_bytes(self, key: bytes, held: HeldBlock | None) -> bytes | None:
        payload = self.verify(key, held)
        if payload is None or held is None:
            return None
        try:
            return bytes(payload)
        finally:
            held.release()

    def read_into(self, key: bytes, held: HeldBlock | Received | None, buffer: Bytes) -> int | None:
        if isinstance(held, Received):
            return self._check_received(key, held, buffer)
        payload = self.verify(key, held)
        if payload is None or held is None:
            return None
        try:
            if len(payload) > buffer.size:
                raise InvalidArgumentError(
                    f"buffer of {buffer.size} bytes is too small for a {len(payload)}-byte block"
                )
            buffer[: len(payload)] = as_readable(payload)
            return len(payload)
        finally:
            held.release()

    def _check_received(self, key: bytes, got: Received, buffer: Bytes) -> int | None:
        """Verify a block already received into `buffer`; a corrupt one is zeroed there, so
        that no byte of it is left for a caller who ignores the miss."""
        payload = buffer[: got.length]
        try:
            open_parts(
                got.header, payload.data, key_or_hash=bytes(key), namespace=self._fingerprint
            )
        except CorruptBlockError as exc:
            payload[:] = 0
            self._corrupt(key, exc)
            return None
        self._hit(got.length)
        return got.length

    def stats(self, store: dict[str, object]) -> ClientStats:
        with self._lock:
            return ClientStats(
                puts=self._puts,
                hits=self._hits,
                misses=self._misses,
                corrupt_blocks=self._corrupt_count,
                unreachable=self._unreachable,
                bytes_put=self._bytes_put,
                bytes_stored=self._bytes_stored,
                bytes_got=self._bytes_got,
                store=store,
            )


def _keys(keys: Sequence[bytes]) -> list[BlockKey]:
    return [to_key(k) for k in keys]


def _put_items(puts: Sequence[_Put]) -> list[PutItem]:
    return [(p.key, (p.header, p.payload), p.parent) for p in puts]


def _pairs(
    items: Iterable[tuple[bytes, object]], parents: Sequence[bytes | None] | None
) -> list[tuple[bytes, object, bytes | None]]:
    pairs = list(items)
    if parents is not None and len(parents) != len(pairs):
        raise InvalidArgumentError(f"{len(pairs)} items but {len(parents)} parents")
    return [(k, v, parents[i] if parents else None) for i, (k, v) in enumerate(pairs)]


class Client:
    """Put and get KV blocks in a store named by a URL.

    Keys are 16-byte block keys (or 32-byte chain hashes, which add a full-hash check on
    reads). Values are any contiguous buffer. Every read is verified (header, key, namespace,
    CRC32C) before a byte reaches the caller; a block that fails is a counted miss.
    """

    def __init__(self, transport: Transport, *, namespace: Namespace | None = None) -> None:
        self._transport = transport
        self._requests = _Requests(namespace, lambda: transport.max_value_bytes)

    @classmethod
    def connect(cls, url: str | None = None, *, namespace: Namespace | None = None) -> Client:
        """Open a client for `url` (default: an embedded DRAM store, ``local://``).

        Raises:
            ConfigError: unknown scheme or bad URL parameters.
        """
        return cls(open_transport(parse_url(url or DEFAULT_URL)), namespace=namespace)

    @property
    def namespace(self) -> Namespace | None:
        return self._requests.namespace

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
        """The verified value, or None on a miss or a corrupt block."""
        block_key = to_key(key)
        return self._requests.read_bytes(key, self._transport.get(block_key))

    def get_into(self, key: bytes, buffer: object) -> int | None:
        """Copy the verified value into `buffer`; returns its length, or None on a miss.

        Raises:
            InvalidArgumentError: `buffer` is read-only, not contiguous, or too small.
        """
        dst = as_writable(buffer)
        block_key = to_key(key)
        return self._requests.read_into(key, self._transport.get_into(block_key, dst.data), dst)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """`get` for each key, in as few round trips as the transport allows."""
        held = self._transport.get_many(_keys(keys))
        return [self._requests.read_bytes(k, h) for k, h in zip(keys, held, strict=True)]

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

    def __init__(self, transport: AsyncTransport, *, namespace: Namespace | None = None) -> None:
        self._transport = transport
        self._requests = _Requests(namespace, lambda: transport.max_value_bytes)
        self._opened = False

    @classmethod
    def connect(cls, url: str | None = None, *, namespace: Namespace | None = None) -> AsyncClient:
        """An async client for `url` (default ``local://``); a remote store is connected to on
        first use."""
        return cls(open_async_transport(parse_url(url or DEFAULT_URL)), namespace=namespace)

    async def _open(self) -> None:
        if not self._opened:
            await self._transport.open()
            self._opened = True

    @property
    def namespace(self) -> Namespace | None:
        return self._requests.namespace

    async def put(
        self, key: bytes, value: object, *, parent: bytes | None = None, durable: bool = False
    ) -> None:
        await self._open()
        put = self._requests.prepare_put(key, value, parent)
        await self._transport.put(put.key, (put.header, put.payload), put.parent, durable)
        self._requests.put_done(put)

    async def put_many(
        self,
        items: Iterable[tuple[bytes, object]],
        *,
        parents: Sequence[bytes | None] | None = None,
    ) -> None:
        await self._open()
        puts = self._requests.prepare_many(items, parents)
        await self._transport.put_many(_put_items(puts))
        self._requests.put_done(*puts)

    async def get(self, key: bytes) -> bytes | None:
        return self._requests.read_bytes(key, await self._transport.get(to_key(key)))

    async def get_into(self, key: bytes, buffer: object) -> int | None:
        dst = as_writable(buffer)
        block_key = to_key(key)
        return self._requests.read_into(
            key, await self._transport.get_into(block_key, dst.data), dst
        )

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        held = await self._transport.get_many(_keys(keys))
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
