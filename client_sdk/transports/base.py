"""What every transport offers the SDK's request layer (raw stored blocks, no integrity logic)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable

from kvoffload.wire.tiers import TierRun

T = TypeVar("T")

__all__ = [
    "AsyncTransport",
    "Repairing",
    "HeldBlock",
    "IntoBuffer",
    "PutItem",
    "Received",
    "ThreadedAsyncTransport",
    "Transport",
]

# (key, parts of the stored value, parent key, block metadata in its byte form) — one block of
# a batch put. Transports that cannot carry metadata drop it (see docs/reference/events.md).
PutItem = tuple[bytes, Sequence[object], "bytes | None", "bytes | None"]


class HeldBlock(Protocol):
    """A stored block (header + payload) held for reading until released."""

    @property
    def data(self) -> memoryview: ...

    def release(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Received:
    """A block whose payload a transport received straight into the caller's buffer.

    `header` holds the stored value's header (normally `HEADER_BYTES`), `length` the payload
    bytes now at the start of the caller's buffer. Nothing is verified yet; `crc`, when not
    None, is the payload's CRC32C as the transport summed it while it landed (the reader then
    compares it with the header's instead of reading the payload again).
    """

    header: memoryview
    length: int
    crc: int | None = None


class IntoBuffer:
    """The caller's buffer of a `get_into`, and how far into it payload bytes may have landed:
    a get that fails part-way (a lost connection, a deadline, a cancel, a retry that finds a
    miss or a shorter block) must not leave a partial block there."""

    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer
        self._touched = 0

    def __len__(self) -> int:
        return len(self.buffer)

    def region(self, start: int, stop: int) -> memoryview:
        """`buffer[start:stop]`, to receive into."""
        self._touched = max(self._touched, min(stop, len(self.buffer)))
        return self.buffer[start:stop]

    def scrub(self, keep: int = 0) -> None:
        """Zero what was received past the first `keep` bytes (the block the get returns)."""
        if self._touched > keep:
            self.buffer[keep : self._touched] = bytes(self._touched - keep)
        self._touched = keep


def received_into(
    into: IntoBuffer, get: Callable[[], HeldBlock | Received | None]
) -> HeldBlock | Received | None:
    """Run a transport's `get`, which receives into `into`; on failure, and past the block it
    returns, no received byte stays in the caller's buffer."""
    try:
        got = get()
    except BaseException:
        into.scrub()
        raise
    into.scrub(got.length if isinstance(got, Received) else 0)
    return got


async def received_into_async(
    into: IntoBuffer, get: Callable[[], Awaitable[HeldBlock | Received | None]]
) -> HeldBlock | Received | None:
    """`received_into` for an asyncio transport (a cancelled get is scrubbed too)."""
    try:
        got = await get()
    except BaseException:
        into.scrub()
        raise
    into.scrub(got.length if isinstance(got, Received) else 0)
    return got


def _scrub_past(into: Sequence[IntoBuffer], got: Sequence[Received | None]) -> None:
    for buffer, block in zip(into, got, strict=False):
        buffer.scrub(block.length if block is not None else 0)
    for buffer in into[len(got) :]:
        buffer.scrub()


def received_many_into(
    into: Sequence[IntoBuffer], get: Callable[[], Sequence[Received | None]]
) -> Sequence[Received | None]:
    """`received_into` for a batch: one buffer per key, scrubbed the same way."""
    try:
        got = get()
    except BaseException:
        for buffer in into:
            buffer.scrub()
        raise
    _scrub_past(into, got)
    return got


async def received_many_into_async(
    into: Sequence[IntoBuffer], get: Callable[[], Awaitable[Sequence[Received | None]]]
) -> Sequence[Received | None]:
    """`received_many_into` for an asyncio transport."""
    try:
        got = await get()
    except BaseException:
        for buffer in into:
            buffer.scrub()
        raise
    _scrub_past(into, got)
    return got


class Transport(Protocol):
    """Moves stored blocks to and from one store. Keys are 16 bytes, already validated."""

    @property
    def max_value_bytes(self) -> int: ...

    def put(
        self,
        key: bytes,
        parts: Sequence[object],
        parent: bytes | None,
        durable: bool = False,
        meta: bytes | None = None,
    ) -> None: ...

    def put_many(self, items: Sequence[PutItem], durable: bool = False) -> None:
        """Store several blocks, in order (a failure leaves the earlier ones stored)."""
        ...

    def get(self, key: bytes) -> HeldBlock | None: ...

    def get_into(self, key: bytes, buffer: memoryview) -> HeldBlock | Received | None:
        """Either hold the block for the caller to verify and copy (no copy made yet), or
        receive its payload straight into `buffer` (`Received`); None on a miss.

        Raises:
            InvalidArgumentError: the payload does not fit `buffer` (nothing was written).
            TransportError, DeadlineExceededError: no byte received before the failure is
                left in `buffer` (it is zeroed); neither is any past the returned block.
        """
        ...

    def get_many(self, keys: Sequence[bytes]) -> list[HeldBlock | None]: ...

    def get_many_into(
        self, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> list[HeldBlock | Received | None]:
        """`get_into` for each key with its buffer, in as few round trips as the transport
        allows (the same guarantees per buffer)."""
        ...

    def exists(self, key: bytes) -> bool: ...

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        """`exists` for each key, in as few round trips as the transport allows."""
        ...

    def lookup(self, keys: Sequence[bytes]) -> int: ...

    def lookup_tiers(self, keys: Sequence[bytes]) -> TierRun:
        """`lookup`'s run split by where its blocks are (`wire.tiers`)."""
        ...

    def prefetch(self, keys: Sequence[bytes]) -> int: ...

    def delete(self, key: bytes) -> bool: ...

    def stats(self) -> dict[str, object]: ...

    def close(self) -> None: ...


@runtime_checkable
class Repairing(Protocol):
    """A transport that can copy a block onto a cluster node that missed it without undoing
    a newer write or a delete (the native front from protocol 5). Each method answers None
    when the node cannot (an older daemon): the cluster then repairs nothing there."""

    def repair(
        self, key: bytes, parts: Sequence[object], parent: bytes | None, meta: bytes | None
    ) -> bool | None:
        """Store the copy only where `key` is absent and was not deleted lately; whether it
        was stored."""
        ...

    def describe(self, key: bytes) -> tuple[bool, bytes | None, bytes | None] | None:
        """Whether `key` is stored, with the parent and block metadata it was stored with."""
        ...

    def delete_many(self, keys: Sequence[bytes]) -> list[bool] | None:
        """Drop `keys`' copies (no tombstones: a cluster put clearing a key's next node);
        which were stored."""
        ...


class AsyncTransport(Protocol):
    """The coroutine form of `Transport`. `max_value_bytes` is known once `open()` returned."""

    async def open(self) -> None:
        """Connect now if the transport connects at all (the client calls it before use)."""
        ...

    @property
    def max_value_bytes(self) -> int: ...

    async def put(
        self,
        key: bytes,
        parts: Sequence[object],
        parent: bytes | None,
        durable: bool = False,
        meta: bytes | None = None,
    ) -> None: ...

    async def put_many(self, items: Sequence[PutItem], durable: bool = False) -> None: ...

    async def get(self, key: bytes) -> HeldBlock | None: ...

    async def get_into(self, key: bytes, buffer: memoryview) -> HeldBlock | Received | None: ...

    async def get_many(self, keys: Sequence[bytes]) -> list[HeldBlock | None]: ...

    async def get_many_into(
        self, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> list[HeldBlock | Received | None]: ...

    async def exists(self, key: bytes) -> bool: ...

    async def exists_many(self, keys: Sequence[bytes]) -> list[bool]: ...

    async def lookup(self, keys: Sequence[bytes]) -> int: ...

    async def lookup_tiers(self, keys: Sequence[bytes]) -> TierRun: ...

    async def prefetch(self, keys: Sequence[bytes]) -> int: ...

    async def delete(self, key: bytes) -> bool: ...

    async def stats(self) -> dict[str, object]: ...

    async def close(self) -> None: ...


def hold_window(transport: object) -> int:
    """How many blocks of a batched get a client should hold at once (0: all). A transport
    whose held blocks pin the store's memory (local://) sets `hold_window`."""
    window = getattr(transport, "hold_window", 0)
    return window if isinstance(window, int) else 0


def windows(n: int, window: int) -> list[slice]:
    """`n` items in slices of `window` (one slice when `window` is 0)."""
    if window <= 0 or n <= window:
        return [slice(0, n)]
    return [slice(lo, lo + window) for lo in range(0, n, window)]


class ThreadedAsyncTransport:
    """Serves the async API from a sync transport: calls that move value bytes run in a worker
    thread (copies release the GIL); index-only calls run inline only where the inner transport
    answers them in memory (`index_inline`, local://), else they wait on the network (nvme+tcp,
    kv:// with data=nixl) and run in a worker thread too, never on the event loop.
    """

    def __init__(self, inner: Transport) -> None:
        self._inner = inner
        self._inline = getattr(inner, "index_inline", False) is True

    async def _index(self, call: Callable[..., T], *args: object) -> T:
        """An index call: inline where it takes microseconds, else in a worker thread."""
        if self._inline:
            return call(*args)
        return await asyncio.to_thread(call, *args)

    async def open(self) -> None:
        pass

    @property
    def hold_window(self) -> int:
        """The inner transport's (`hold_window`), 0 if it sets none."""
        return hold_window(self._inner)

    @property
    def max_value_bytes(self) -> int:
        return self._inner.max_value_bytes

    async def put(
        self,
        key: bytes,
        parts: Sequence[object],
        parent: bytes | None,
        durable: bool = False,
        meta: bytes | None = None,
    ) -> None:
        await asyncio.to_thread(self._inner.put, key, parts, parent, durable, meta)

    async def put_many(self, items: Sequence[PutItem], durable: bool = False) -> None:
        await asyncio.to_thread(self._inner.put_many, items, durable)

    async def get(self, key: bytes) -> HeldBlock | None:
        return await asyncio.to_thread(self._inner.get, key)

    async def get_into(self, key: bytes, buffer: memoryview) -> HeldBlock | Received | None:
        return await asyncio.to_thread(self._inner.get_into, key, buffer)

    async def get_many_into(
        self, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> list[HeldBlock | Received | None]:
        return await asyncio.to_thread(self._inner.get_many_into, keys, buffers)

    async def get_many(self, keys: Sequence[bytes]) -> list[HeldBlock | None]:
        return await asyncio.to_thread(self._inner.get_many, keys)

    async def exists(self, key: bytes) -> bool:
        return await self._index(self._inner.exists, key)

    async def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        return await self._index(self._inner.exists_many, keys)

    async def lookup(self, keys: Sequence[bytes]) -> int:
        return await self._index(self._inner.lookup, keys)

    async def lookup_tiers(self, keys: Sequence[bytes]) -> TierRun:
        return await self._index(self._inner.lookup_tiers, keys)

    async def prefetch(self, keys: Sequence[bytes]) -> int:
        return await asyncio.to_thread(self._inner.prefetch, keys)

    async def delete(self, key: bytes) -> bool:
        return await self._index(self._inner.delete, key)

    async def stats(self) -> dict[str, object]:
        return await self._index(self._inner.stats)

    async def close(self) -> None:
        self._inner.close()
