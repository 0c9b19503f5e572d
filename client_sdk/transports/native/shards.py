"""`kv://host:port` to a daemon with several workers: each key goes straight to its shard.

The first operation connects to the URL's port; the daemon's Welcome names every shard's own
port (`Welcome.shard_ports`; empty for a one-process daemon, which is then used as is). The
router then keeps one `NativeTransport` per shard and places keys with `wire.shards.shard_of`, as
the daemon does. A batch (`put_many`, `get_many*`, `lookup`, `prefetch`) is split by shard and
the parts run side by side, one thread each, so a batch costs one round trip per shard, in
parallel, never one per key. Errors are the shards' own (a shard that is down raises
`TransportError`, as a one-process daemon would).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import replace
from typing import TypeAlias, TypeVar

from kvoffload.client_sdk.transports.base import HeldBlock, PutItem, Received
from kvoffload.client_sdk.transports.native.aio import AsyncNativeTransport
from kvoffload.client_sdk.transports.native.options import NativeOptions
from kvoffload.client_sdk.transports.native.sync import NativeTransport
from kvoffload.client_sdk.url import StoreURL
from kvoffload.client_sdk.wire.shards import merge_stats, shard_of

__all__ = ["AsyncShardedTransport", "ShardedTransport", "open_sharded", "open_sharded_async"]

T = TypeVar("T")
G = TypeVar("G")
Got: TypeAlias = HeldBlock | Received | None


def _groups(keys: Sequence[bytes], count: int) -> dict[int, list[int]]:
    """Shard -> positions in `keys`, in order."""
    groups: dict[int, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(shard_of(key, count), []).append(i)
    return groups


def _leading_run(total: int, groups: dict[int, list[int]], runs: Sequence[int]) -> int:
    """The whole chain's leading run from each shard's leading run over its own keys (in
    order): the first key missing anywhere is the first missing key of some shard."""
    first_missing = total
    for positions, run in zip(groups.values(), runs, strict=True):
        if run < len(positions):
            first_missing = min(first_missing, positions[run])
    return first_missing


def _gather(
    total: int, groups: dict[int, list[int]], parts: Sequence[Sequence[G]]
) -> list[G | None]:
    """Each shard's answers back in the order of the keys asked."""
    out: list[G | None] = [None] * total
    for positions, got in zip(groups.values(), parts, strict=True):
        for i, one in zip(positions, got, strict=True):
            out[i] = one
    return out


def _settle(
    groups: list[list[int]],
    errors: Sequence[BaseException | None],
    results: Sequence[T | None],
    undo: Callable[[list[int], T], None] | None,
) -> list[T]:
    """The shards' results, or — when one failed — its error, once the others' results are
    taken back: a batch that fails fails whole, holding nothing and leaving no bytes behind."""
    failed = next((e for e in errors if e is not None), None)
    if failed is None:
        return [r for r in results]  # type: ignore[misc]
    if undo is not None:
        for at, error, result in zip(groups, errors, results, strict=True):
            if error is None:
                undo(at, result)  # type: ignore[arg-type]
    raise failed


def _release(at: list[int], got: Sequence[HeldBlock | Received | None]) -> None:
    for block in got:
        if block is not None and not isinstance(block, Received):
            block.release()


def _scrub(buffers: Sequence[memoryview]) -> Callable[[list[int], Sequence[Got]], None]:
    def undo(at: list[int], got: Sequence[Got]) -> None:
        for i, block in zip(at, got, strict=True):
            if isinstance(block, Received):
                buffers[i][: block.length] = bytes(block.length)
            elif block is not None:
                block.release()

    return undo


class ShardedTransport:
    """The blocking `kv://` transport, routing keys to shards when the daemon has workers."""

    def __init__(self, options: NativeOptions) -> None:
        self._options = options
        self._main = NativeTransport(options)
        self._shards: list[NativeTransport] | None = None
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def _map(self) -> list[NativeTransport]:
        shards = self._shards
        if shards is None:
            with self._lock:
                if self._shards is None:
                    ports = self._main.welcome.shard_ports  # connects
                    if ports:
                        self._shards = [
                            NativeTransport(replace(self._options, port=p)) for p in ports
                        ]
                        self._main.close()
                        self._pool = ThreadPoolExecutor(len(ports), "kvoffload-shard")
                    else:
                        self._shards = [self._main]
                shards = self._shards
        return shards

    def _of(self, key: bytes) -> NativeTransport:
        shards = self._map()
        return shards[shard_of(key, len(shards))] if len(shards) > 1 else shards[0]

    def _split(
        self,
        keys: Sequence[bytes],
        call: Callable[[NativeTransport, list[int]], T],
        undo: Callable[[list[int], T], None] | None = None,
    ) -> tuple[dict[int, list[int]], list[T]]:
        """Run `call(shard, positions)` for each shard that holds some of `keys`, side by
        side. If one fails, the first failure raises once all have finished, after `undo`
        took back what the others returned (blocks they hold, bytes they landed)."""
        shards = self._map()
        groups = _groups(keys, len(shards))
        if len(groups) <= 1 or self._pool is None:
            return groups, [call(shards[s], at) for s, at in groups.items()]
        futures = [self._pool.submit(call, shards[s], at) for s, at in groups.items()]
        wait(futures)
        return groups, _settle(
            list(groups.values()),
            [f.exception() for f in futures],
            [f.result() if f.exception() is None else None for f in futures],
            undo,
        )

    @property
    def shard_count(self) -> int:
        return len(self._map())

    @property
    def max_value_bytes(self) -> int:
        return self._map()[0].max_value_bytes

    @property
    def tenant(self) -> str:
        return self._map()[0].tenant

    def put(
        self, key: bytes, parts: Sequence[object], parent: bytes | None, durable: bool = False
    ) -> None:
        self._of(key).put(key, parts, parent, durable)

    def put_many(self, items: Sequence[PutItem], durable: bool = False) -> None:
        self._split(
            [item[0] for item in items],
            lambda s, at: s.put_many([items[i] for i in at], durable),
        )

    def get(self, key: bytes) -> HeldBlock | None:
        return self._of(key).get(key)

    def get_into(self, key: bytes, buffer: memoryview) -> Got:
        return self._of(key).get_into(key, buffer)

    def get_many(self, keys: Sequence[bytes]) -> list[HeldBlock | None]:
        groups, parts = self._split(keys, lambda s, at: s.get_many([keys[i] for i in at]), _release)
        return _gather(len(keys), groups, parts)

    def get_many_into(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[Got]:
        groups, parts = self._split(
            keys,
            lambda s, at: s.get_many_into([keys[i] for i in at], [buffers[i] for i in at]),
            _scrub(buffers),
        )
        return _gather(len(keys), groups, parts)

    def exists(self, key: bytes) -> bool:
        return self._of(key).exists(key)

    def lookup(self, keys: Sequence[bytes]) -> int:
        groups, runs = self._split(keys, lambda s, at: s.lookup([keys[i] for i in at]))
        return _leading_run(len(keys), groups, runs)

    def prefetch(self, keys: Sequence[bytes]) -> int:
        _, counts = self._split(keys, lambda s, at: s.prefetch([keys[i] for i in at]))
        return sum(counts)

    def delete(self, key: bytes) -> bool:
        return self._of(key).delete(key)

    def stats(self) -> dict[str, object]:
        shards = self._map()
        if len(shards) == 1:
            return shards[0].stats()
        pool = self._pool
        parts = list(pool.map(lambda s: s.stats(), shards)) if pool else [s.stats() for s in shards]
        merged = merge_stats(parts)
        merged["shards"] = len(shards)
        return merged

    def close(self) -> None:
        with self._lock:
            shards, self._shards = self._shards or [], None
            pool, self._pool = self._pool, None
        self._main.close()
        for shard in shards:
            shard.close()
        if pool is not None:
            pool.shutdown(wait=False)


class AsyncShardedTransport:
    """The asyncio `kv://` transport, routing keys to shards when the daemon has workers."""

    def __init__(self, options: NativeOptions) -> None:
        self._options = options
        self._main = AsyncNativeTransport(options)
        self._shards: list[AsyncNativeTransport] | None = None
        self._opening = asyncio.Lock()

    async def _map(self) -> list[AsyncNativeTransport]:
        shards = self._shards
        if shards is None:
            async with self._opening:
                if self._shards is None:
                    ports = (await self._main.welcomed()).shard_ports
                    if ports:
                        opened = [
                            AsyncNativeTransport(replace(self._options, port=p)) for p in ports
                        ]
                        await self._main.close()
                        self._shards = opened
                    else:
                        self._shards = [self._main]
                shards = self._shards
        return shards

    async def _of(self, key: bytes) -> AsyncNativeTransport:
        shards = await self._map()
        return shards[shard_of(key, len(shards))] if len(shards) > 1 else shards[0]

    async def _split(
        self,
        keys: Sequence[bytes],
        call: Callable[[AsyncNativeTransport, list[int]], Awaitable[T]],
        undo: Callable[[list[int], T], None] | None = None,
    ) -> tuple[dict[int, list[int]], list[T]]:
        shards = await self._map()
        groups = _groups(keys, len(shards))
        got = await asyncio.gather(
            *(call(shards[s], at) for s, at in groups.items()), return_exceptions=True
        )
        errors = [g if isinstance(g, BaseException) else None for g in got]
        results = [None if isinstance(g, BaseException) else g for g in got]
        return groups, _settle(list(groups.values()), errors, results, undo)

    async def open(self) -> None:
        for shard in await self._map():
            await shard.open()

    @property
    def max_value_bytes(self) -> int:
        return (self._shards or [self._main])[0].max_value_bytes

    async def put(
        self, key: bytes, parts: Sequence[object], parent: bytes | None, durable: bool = False
    ) -> None:
        await (await self._of(key)).put(key, parts, parent, durable)

    async def put_many(self, items: Sequence[PutItem], durable: bool = False) -> None:
        await self._split(
            [item[0] for item in items],
            lambda s, at: s.put_many([items[i] for i in at], durable),
        )

    async def get(self, key: bytes) -> HeldBlock | None:
        return await (await self._of(key)).get(key)

    async def get_into(self, key: bytes, buffer: memoryview) -> Got:
        return await (await self._of(key)).get_into(key, buffer)

    async def get_many(self, keys: Sequence[bytes]) -> list[HeldBlock | None]:
        groups, parts = await self._split(
            keys, lambda s, at: s.get_many([keys[i] for i in at]), _release
        )
        return _gather(len(keys), groups, parts)

    async def get_many_into(
        self, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> list[Got]:
        groups, parts = await self._split(
            keys,
            lambda s, at: s.get_many_into([keys[i] for i in at], [buffers[i] for i in at]),
            _scrub(buffers),
        )
        return _gather(len(keys), groups, parts)

    async def exists(self, key: bytes) -> bool:
        return await (await self._of(key)).exists(key)

    async def lookup(self, keys: Sequence[bytes]) -> int:
        groups, runs = await self._split(keys, lambda s, at: s.lookup([keys[i] for i in at]))
        return _leading_run(len(keys), groups, runs)

    async def prefetch(self, keys: Sequence[bytes]) -> int:
        _, counts = await self._split(keys, lambda s, at: s.prefetch([keys[i] for i in at]))
        return sum(counts)

    async def delete(self, key: bytes) -> bool:
        return await (await self._of(key)).delete(key)

    async def stats(self) -> dict[str, object]:
        shards = await self._map()
        if len(shards) == 1:
            return await shards[0].stats()
        merged = merge_stats(await asyncio.gather(*(s.stats() for s in shards)))
        merged["shards"] = len(shards)
        return merged

    async def close(self) -> None:
        shards, self._shards = self._shards or [], None
        await self._main.close()
        for shard in shards:
            if shard is not self._main:
                await shard.close()


def open_sharded(url: StoreURL) -> ShardedTransport:
    """Open `kv://host:port?...` (blocking; connects on first use)."""
    return ShardedTransport(NativeOptions.from_url(url))


def open_sharded_async(url: StoreURL) -> AsyncShardedTransport:
    """Open `kv://host:port?...` for asyncio (connects on `open` or first use)."""
    return AsyncShardedTransport(NativeOptions.from_url(url))
