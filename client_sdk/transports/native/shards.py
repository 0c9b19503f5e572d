"""`kv://host:port` to a daemon with several workers: each key goes straight to its shard.

The first operation connects to the URL's port; the daemon's Welcome names every shard's own
port (`Welcome.shard_ports`; empty for a one-process daemon, which is then used as is). The
transports then keep one `NativeTransport` per shard (sync: `ShardRouter` in `sharding.py`;
asyncio: here, with the same helpers), placing keys as the daemon does. A shard that is down
raises `TransportError`, as a one-process daemon would.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import TypeVar

from kvoffload.client_sdk.transports.base import HeldBlock, PutItem, Transport
from kvoffload.client_sdk.transports.native.aio import AsyncNativeTransport
from kvoffload.client_sdk.transports.native.options import NativeOptions
from kvoffload.client_sdk.transports.native.sync import NativeTransport
from kvoffload.client_sdk.transports.sharding import (
    Got,
    ShardRouter,
    gather,
    groups_of,
    leading_run,
    release,
    scrub,
    settle,
)
from kvoffload.client_sdk.url import StoreURL
from kvoffload.client_sdk.wire.shards import merge_stats, shard_of

__all__ = ["AsyncShardedTransport", "ShardedTransport", "open_sharded", "open_sharded_async"]

T = TypeVar("T")


class ShardedTransport(ShardRouter):
    """The blocking `kv://` transport: the daemon's Welcome says whether it has workers and
    every worker's port; then each key goes straight to its shard."""

    def __init__(self, options: NativeOptions) -> None:
        self._options = options
        self._main = NativeTransport(options)
        super().__init__(self._shard_transports)

    def _shard_transports(self) -> list[Transport]:
        ports = self._main.welcome.shard_ports  # connects
        if not ports:
            return [self._main]
        self._main.close()
        return [NativeTransport(replace(self._options, port=p)) for p in ports]

    def close(self) -> None:
        super().close()
        self._main.close()


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
        groups = groups_of(keys, len(shards))
        got = await asyncio.gather(
            *(call(shards[s], at) for s, at in groups.items()), return_exceptions=True
        )
        errors = [g if isinstance(g, BaseException) else None for g in got]
        results = [None if isinstance(g, BaseException) else g for g in got]
        return groups, settle(list(groups.values()), errors, results, undo)

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
            keys, lambda s, at: s.get_many([keys[i] for i in at]), release
        )
        return gather(len(keys), groups, parts)

    async def get_many_into(
        self, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> list[Got]:
        groups, parts = await self._split(
            keys,
            lambda s, at: s.get_many_into([keys[i] for i in at], [buffers[i] for i in at]),
            scrub(buffers),
        )
        return gather(len(keys), groups, parts)

    async def exists(self, key: bytes) -> bool:
        return await (await self._of(key)).exists(key)

    async def lookup(self, keys: Sequence[bytes]) -> int:
        groups, runs = await self._split(keys, lambda s, at: s.lookup([keys[i] for i in at]))
        return leading_run(len(keys), groups, runs)

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
