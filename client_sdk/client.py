"""`Client` and `AsyncClient`: thin sync and async faces over one request layer.

The request layer (`request_layer.RequestLayer`) owns everything that is not I/O: key checks,
the block header, integrity verification and counters. The two clients differ only in how
they wait on the transport.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Literal, overload

from kvoffload.buffers import Bytes, as_writable
from kvoffload.client_sdk.keys import Namespace, to_key
from kvoffload.client_sdk.request_layer import (
    ClientStats,
    RequestLayer,
    encoded,
    many_into,
    put_items,
    resolve_codec,
    to_keys,
)
from kvoffload.client_sdk.seal import SealKeys
from kvoffload.client_sdk.transports import open_async_transport, open_transport
from kvoffload.client_sdk.transports.base import (
    AsyncTransport,
    HeldBlock,
    Received,
    Transport,
    hold_window,
    windows,
)
from kvoffload.client_sdk.url import DEFAULT_URL, parse_url
from kvoffload.compression import CODEC_NONE, Codec
from kvoffload.errors import DeadlineExceededError, TransportError
from kvoffload.wire.block import peek_codec
from kvoffload.wire.blockmeta import BlockMeta
from kvoffload.wire.tiers import TierRun

__all__ = ["AsyncClient", "Client", "ClientStats", "resolve_codec"]


class Client:
    """Put and get KV blocks in a store named by a URL.

    Keys are 16-byte block keys (or 32-byte chain hashes, which add a full-hash check on
    reads). Values are any contiguous buffer. Every read is verified (header, key, namespace,
    CRC32C, or with seal keys the keyed seal) before a byte reaches the caller; a block that
    fails is a counted miss.

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
        seal: SealKeys | None = None,
    ) -> None:
        """
        Args:
            transport: the store connection.
            namespace: the model/layout of the blocks; readers only accept blocks of theirs.
            codec: a codec name or instance (`kvoffload.compression.get_codec`) for puts.
            seal: keys to seal puts and open reads with (docs/guides/sdk.md); default: the
                keys `KVOFFLOAD_SEAL_KEYS` / `KVOFFLOAD_SEAL_KEY_FILE` name, else none.

        Raises:
            UnsupportedCodecConfigError: unknown codec, or a lossy codec the namespace does
                not declare.
            ConfigError: malformed seal keys in the environment.
        """
        self._transport = transport
        self._requests = RequestLayer(
            namespace, lambda: transport.max_value_bytes, codec, _seal_keys(seal)
        )

    @classmethod
    def connect(
        cls,
        url: str | None = None,
        *,
        namespace: Namespace | None = None,
        codec: str | Codec | None = None,
        seal: SealKeys | None = None,
    ) -> Client:
        """Open a client for `url` (default: an embedded DRAM store, ``local://``).

        Raises:
            ConfigError: unknown scheme, bad URL parameters or seal keys.
            UnsupportedCodecConfigError: see `Client`.
        """
        chosen = resolve_codec(namespace, codec)  # fail before connecting
        keys = _seal_keys(seal)
        transport = open_transport(parse_url(url or DEFAULT_URL))
        return cls(transport, namespace=namespace, codec=chosen, seal=keys)

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
        self,
        key: bytes,
        value: object,
        *,
        parent: bytes | None = None,
        durable: bool = False,
        meta: BlockMeta | None = None,
    ) -> None:
        """Store `value` under `key`; `parent` is the previous block of the same chain.

        Args:
            durable: return only once the block is on stable storage (needs an SSD tier);
                the default returns once the block is in the store's memory.
            meta: what a KV-aware router needs to know of the block (its token ids, the
                serving engine's block hash, LoRA); kept with the block and published in the
                daemon's KV events. `nvme+tcp://` and daemons older than protocol 3 drop it.

        Raises:
            InvalidArgumentError: bad key, parent or value (nothing was stored).
            CodecMismatchError: the value does not fit the codec (not one block of the
                namespace, another dtype); an `InvalidArgumentError` too.
            CapacityError: the store cannot make room.
        """
        put = self._requests.prepare_put(key, value, parent, meta)
        self._transport.put(put.key, (put.header, put.payload), put.parent, durable, put.meta)
        self._requests.put_done(put)

    def put_many(
        self,
        items: Iterable[tuple[bytes, object]],
        *,
        parents: Sequence[bytes | None] | None = None,
        metas: Sequence[BlockMeta | None] | None = None,
    ) -> None:
        """`put` each (key, value) pair in order, with optional parents and metadata (one per
        item), in as few round trips as the transport allows. Nothing is sent unless every item
        is valid.

        Raises:
            InvalidArgumentError, CapacityError: as for `put`; on CapacityError the items before
                the failing one are stored.
        """
        puts = self._requests.prepare_many(items, parents, metas)
        self._transport.put_many(put_items(puts))
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
        block_keys = to_keys(keys)
        out: list[bytes | None] = []
        # In windows where held blocks pin the store's memory (local://).
        for part in windows(len(block_keys), hold_window(self._transport)):
            held = self._transport.get_many(block_keys[part])
            out += [self._requests.read_bytes(k, h) for k, h in zip(keys[part], held, strict=True)]
        return out

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
        dsts, block_keys = many_into(keys, buffers)
        out: list[int | None] = []
        for part in windows(len(block_keys), hold_window(self._transport)):
            got = self._transport.get_many_into(block_keys[part], [d.data for d in dsts[part]])
            out += self._requests.read_many_into(keys[part], got, dsts[part])
        return out

    def exists(self, key: bytes) -> bool:
        """Whether the store holds `key`; False also when the store cannot be reached."""
        block_key = to_key(key)
        try:
            return self._transport.exists(block_key)
        except (TransportError, DeadlineExceededError) as exc:
            self._requests.unreachable("exists", exc)
            return False

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether the store holds each of `keys`, in as few round trips as the transport
        allows (``kv://``: runs of pipelined Exists requests, one write each, on each worker
        side by side; ``cluster://``: one batch per node and replica rank). Unlike `lookup`,
        every key answers for itself, so a missing key does not hide the ones after it. All
        False when the store cannot be reached (as `exists`).

        Raises:
            InvalidArgumentError: a malformed key (nothing was asked).
        """
        block_keys = to_keys(keys)
        try:
            return self._transport.exists_many(block_keys)
        except (TransportError, DeadlineExceededError) as exc:
            self._requests.unreachable("exists_many", exc)
            return [False] * len(block_keys)

    @overload
    def lookup(self, keys: Sequence[bytes], *, tiers: Literal[False] = False) -> int: ...

    @overload
    def lookup(self, keys: Sequence[bytes], *, tiers: Literal[True]) -> TierRun: ...

    def lookup(self, keys: Sequence[bytes], *, tiers: bool = False) -> int | TierRun:
        """How many leading blocks of the chain `keys` the store holds (0 when the store cannot
        be reached: a serving engine then recomputes instead of failing).

        With `tiers=True`, that run as a `TierRun`: its blocks in key order, segment by
        segment, each `Tier.DRAM` (in the store's DRAM), `Tier.SSD` (only on its SSD),
        `Tier.REMOTE` (every hit of ``cluster://``) or `Tier.UNKNOWN` (``nvme+tcp://``, a
        daemon older than protocol 4); `.total` is the plain answer. The store answers from
        its indexes in the same round trip, reading no block.
        """
        block_keys = to_keys(keys)
        try:
            if tiers:
                return self._transport.lookup_tiers(block_keys)
            return self._transport.lookup(block_keys)
        except (TransportError, DeadlineExceededError) as exc:
            self._requests.unreachable("lookup", exc)
            return TierRun() if tiers else 0

    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Ask the store to stage `keys` in its fastest tier; returns how many are there."""
        return self._transport.prefetch(to_keys(keys))

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
        seal: SealKeys | None = None,
    ) -> None:
        self._transport = transport
        self._requests = RequestLayer(
            namespace, lambda: transport.max_value_bytes, codec, _seal_keys(seal)
        )
        self._opened = False

    @classmethod
    def connect(
        cls,
        url: str | None = None,
        *,
        namespace: Namespace | None = None,
        codec: str | Codec | None = None,
        seal: SealKeys | None = None,
    ) -> AsyncClient:
        """An async client for `url` (default ``local://``); a remote store is connected to on
        first use. `seal` as for `Client`."""
        chosen = resolve_codec(namespace, codec)  # fail before connecting
        keys = _seal_keys(seal)
        transport = open_async_transport(parse_url(url or DEFAULT_URL))
        return cls(transport, namespace=namespace, codec=chosen, seal=keys)

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
        self,
        key: bytes,
        value: object,
        *,
        parent: bytes | None = None,
        durable: bool = False,
        meta: BlockMeta | None = None,
    ) -> None:
        await self._open()
        requests = self._requests
        if requests.codec.codec_id == CODEC_NONE:
            put = requests.prepare_put(key, value, parent, meta)
        else:  # encoding takes CPU time: keep it off the event loop
            put = await asyncio.to_thread(requests.prepare_put, key, value, parent, meta)
        await self._transport.put(put.key, (put.header, put.payload), put.parent, durable, put.meta)
        requests.put_done(put)

    async def put_many(
        self,
        items: Iterable[tuple[bytes, object]],
        *,
        parents: Sequence[bytes | None] | None = None,
        metas: Sequence[BlockMeta | None] | None = None,
    ) -> None:
        await self._open()
        requests = self._requests
        if requests.codec.codec_id == CODEC_NONE:
            puts = requests.prepare_many(items, parents, metas)
        else:  # encoding takes CPU time: keep it off the event loop
            puts = await asyncio.to_thread(requests.prepare_many, items, parents, metas)
        await self._transport.put_many(put_items(puts))
        requests.put_done(*puts)

    async def get(self, key: bytes) -> bytes | None:
        held = await self._transport.get(to_key(key))
        if held is not None and peek_codec(held.data) != CODEC_NONE:
            return await asyncio.to_thread(self._requests.read_bytes, key, held)
        return self._requests.read_bytes(key, held)

    async def get_into(self, key: bytes, buffer: object) -> int | None:
        dst = as_writable(buffer)
        held = await self._transport.get_into(to_key(key), dst.data)
        if encoded(held):
            # Decoding takes CPU time: keep it off the event loop.
            return await asyncio.to_thread(self._requests.read_into, key, held, dst)
        return self._requests.read_into(key, held, dst)

    async def get_many_into(
        self, keys: Sequence[bytes], buffers: Sequence[object]
    ) -> list[int | None]:
        dsts, block_keys = many_into(keys, buffers)
        out: list[int | None] = []
        for part in windows(len(block_keys), hold_window(self._transport)):
            at = block_keys[part]
            got = await self._transport.get_many_into(at, [d.data for d in dsts[part]])
            if any(encoded(h) for h in got):
                out += await asyncio.to_thread(self._read_many_into, keys[part], got, dsts[part])
            else:
                out += self._read_many_into(keys[part], got, dsts[part])
        return out

    def _read_many_into(
        self,
        keys: Sequence[bytes],
        got: Sequence[HeldBlock | Received | None],
        dsts: Sequence[Bytes],
    ) -> list[int | None]:
        return self._requests.read_many_into(keys, got, dsts)

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        block_keys = to_keys(keys)
        out: list[bytes | None] = []
        for part in windows(len(block_keys), hold_window(self._transport)):
            held = await self._transport.get_many(block_keys[part])
            if any(h is not None and peek_codec(h.data) != CODEC_NONE for h in held):
                out += await asyncio.to_thread(self._read_all, keys[part], held)
            else:
                out += self._read_all(keys[part], held)
        return out

    def _read_all(self, keys: Sequence[bytes], held: list[HeldBlock | None]) -> list[bytes | None]:
        return [self._requests.read_bytes(k, h) for k, h in zip(keys, held, strict=True)]

    async def exists(self, key: bytes) -> bool:
        block_key = to_key(key)
        try:
            return await self._transport.exists(block_key)
        except (TransportError, DeadlineExceededError) as exc:
            self._requests.unreachable("exists", exc)
            return False

    async def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        block_keys = to_keys(keys)
        try:
            return await self._transport.exists_many(block_keys)
        except (TransportError, DeadlineExceededError) as exc:
            self._requests.unreachable("exists_many", exc)
            return [False] * len(block_keys)

    @overload
    async def lookup(self, keys: Sequence[bytes], *, tiers: Literal[False] = False) -> int: ...

    @overload
    async def lookup(self, keys: Sequence[bytes], *, tiers: Literal[True]) -> TierRun: ...

    async def lookup(self, keys: Sequence[bytes], *, tiers: bool = False) -> int | TierRun:
        block_keys = to_keys(keys)
        try:
            if tiers:
                return await self._transport.lookup_tiers(block_keys)
            return await self._transport.lookup(block_keys)
        except (TransportError, DeadlineExceededError) as exc:
            self._requests.unreachable("lookup", exc)
            return TierRun() if tiers else 0

    async def prefetch(self, keys: Sequence[bytes]) -> int:
        return await self._transport.prefetch(to_keys(keys))

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


def _seal_keys(seal: SealKeys | None) -> SealKeys | None:
    """The caller's keys, else the environment's (so connectors seal without a code change)."""
    return seal if seal is not None else SealKeys.from_env()
