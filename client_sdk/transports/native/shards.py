"""`kv://host:port` to a daemon with several workers: each key goes straight to its shard.

The first operation connects to the URL's port; the daemon's Welcome names every shard's own
port (`Welcome.shard_ports`; empty for a one-process daemon, which is then used as is). The
transports then keep one `NativeTransport` per shard (sync: `ShardRouter` in `sharding.py`;
asyncio: here, with the same helpers), placing keys as the daemon does. A shard that is down
raises `TransportError`, as a one-process daemon would.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import TypeVar

from kvoffload.client_sdk.transports.base import (
    HeldBlock,
    PutItem,
    Repairing,
    ThreadedAsyncTransport,
    Transport,
)
from kvoffload.client_sdk.transports.native.aio import AsyncNativeTransport
from kvoffload.client_sdk.transports.native.nixl import NixlTransport
from kvoffload.client_sdk.transports.native.options import NativeOptions
from kvoffload.client_sdk.transports.native.sync import NativeTransport
from kvoffload.client_sdk.transports.sharding import (
    Got,
    ShardRouter,
    gather,
    groups_of,
    leading_run,
    merge_tier_runs,
    pick,
    release,
    scrub,
    settle,
)
from kvoffload.client_sdk.url import StoreURL
from kvoffload.errors import (
    DeadlineExceededError,
    KVOffloadError,
    TransportError,
    WrongShardError,
)
from kvoffload.wire.shards import merge_stats, shard_of
from kvoffload.wire.tiers import TierRun

__all__ = ["AsyncShardedTransport", "ShardedTransport", "open_sharded", "open_sharded_async"]

T = TypeVar("T")
log = logging.getLogger("kvoffload.client")


class ShardedTransport(ShardRouter):
    """The blocking `kv://` transport: the daemon's Welcome says whether it has workers and
    every worker's port; then each key goes straight to its shard. A shard that cannot be
    reached makes the transport ask the node's port again: a restarted node may have its
    shards elsewhere (with `--port 0`); a node whose map is unchanged is simply down."""

    def __init__(self, options: NativeOptions) -> None:
        self._options = options
        self._ports: tuple[int, ...] = ()
        super().__init__(self._shard_transports, self._moved)
        try:  # connect now for an early AuthError; a daemon that is down is only a warning
            self._map()
        except (TransportError, DeadlineExceededError) as exc:
            log.warning("%s is not reachable yet (%s); will retry on use", options.url, exc)

    def _shard_transports(self) -> list[Transport]:
        main = _sync_transport(self._options)
        try:
            ports = main.welcome.shard_ports  # connects
        except BaseException:
            main.close()
            raise
        self._ports = ports
        if not ports:
            return [main]
        main.close()
        shards = [_sync_transport(replace(self._options, port=p)) for p in ports]
        try:
            for i, shard in enumerate(shards):
                welcome = shard.welcome  # connects: each port must be the shard it claims
                if welcome.shard != i or welcome.shard_ports != ports:
                    raise TransportError(
                        f"{self._options.url}: port {ports[i]} answered as shard "
                        f"{welcome.shard} of {len(welcome.shard_ports)}, not {i} of "
                        f"{len(ports)} (the node changed while connecting; try again)"
                    )
        except BaseException:
            for shard in shards:
                shard.close()
            raise
        return list(shards)

    def repair(
        self, key: bytes, parts: Sequence[object], parent: bytes | None, meta: bytes | None
    ) -> bool | None:
        def run() -> bool | None:
            shard = self._of(key)
            return shard.repair(key, parts, parent, meta) if isinstance(shard, Repairing) else None

        return self._again(run)

    def describe(self, key: bytes) -> tuple[bool, bytes | None, bytes | None] | None:
        def run() -> tuple[bool, bytes | None, bytes | None] | None:
            shard = self._of(key)
            return shard.describe(key) if isinstance(shard, Repairing) else None

        return self._again(run)

    def delete_many(self, keys: Sequence[bytes]) -> list[bool] | None:
        def call(shard: Transport, at: list[int]) -> list[bool] | None:
            if not isinstance(shard, Repairing):
                return None
            return shard.delete_many(pick(keys, at))

        groups, answers = self._split(keys, call)
        out = [False] * len(keys)
        for at, deleted in zip(groups.values(), answers, strict=True):
            if deleted is None:
                return None
            for i, gone in zip(at, deleted, strict=True):
                out[i] = gone
        return out

    def _moved(self) -> list[Transport] | None:
        old = self._ports
        try:
            found = self._shard_transports()
        except KVOffloadError:
            return None
        if self._ports == old:
            for shard in found:
                shard.close()
            return None
        return found


class AsyncShardedTransport:
    """The asyncio `kv://` transport, routing keys to shards when the daemon has workers (as
    `ShardedTransport` does, asking the node's port again when a shard cannot be reached)."""

    def __init__(self, options: NativeOptions) -> None:
        self._options = options
        self._shards: list[AsyncNativeTransport] | None = None
        self._ports: tuple[int, ...] = ()
        self._opening = asyncio.Lock()
        self._closed = False

    async def _probe(self) -> tuple[tuple[int, ...], list[AsyncNativeTransport]]:
        main = AsyncNativeTransport(self._options)
        try:
            ports = (await main.welcomed()).shard_ports
        except BaseException:
            await main.close()
            raise
        if not ports:
            return ports, [main]
        await main.close()
        shards = [AsyncNativeTransport(replace(self._options, port=p)) for p in ports]
        try:
            for i, shard in enumerate(shards):
                welcome = await shard.welcomed()
                if welcome.shard != i or welcome.shard_ports != ports:
                    raise TransportError(
                        f"{self._options.url}: port {ports[i]} answered as shard "
                        f"{welcome.shard}, not {i} (the node changed while connecting)"
                    )
        except BaseException:
            for shard in shards:
                await shard.close()
            raise
        return ports, shards

    async def _map(self) -> list[AsyncNativeTransport]:
        shards = self._shards
        if shards is None:
            async with self._opening:
                if self._closed:
                    raise TransportError("the client is closed")
                if self._shards is None:
                    self._ports, self._shards = await self._probe()
                shards = self._shards
        return shards

    async def _again(self, op: Callable[[], Awaitable[T]]) -> T:
        """`op`, once more on a new shard map if it could not reach a shard of the old one."""
        try:
            return await op()
        except (TransportError, WrongShardError):
            if self._closed:
                raise
            async with self._opening:
                try:
                    ports, found = await self._probe()
                except KVOffloadError:
                    ports, found = self._ports, []
                if ports == self._ports or self._closed:
                    for shard in found:
                        await shard.close()
                    raise
                old, self._ports, self._shards = self._shards or [], ports, found
            for shard in old:
                await shard.close()
        return await op()

    async def _of(self, key: bytes) -> AsyncNativeTransport:
        shards = await self._map()
        return shards[shard_of(key, len(shards))] if len(shards) > 1 else shards[0]

    async def _split(
        self,
        keys: Sequence[bytes],
        call: Callable[[AsyncNativeTransport, list[int]], Awaitable[T]],
        undo: Callable[[list[int], T], None] | None = None,
    ) -> tuple[dict[int, list[int]], list[T]]:
        async def run() -> tuple[dict[int, list[int]], list[T]]:
            shards = await self._map()
            groups = groups_of(keys, len(shards))
            got = await asyncio.gather(
                *(call(shards[s], at) for s, at in groups.items()), return_exceptions=True
            )
            errors = [g if isinstance(g, BaseException) else None for g in got]
            results = [None if isinstance(g, BaseException) else g for g in got]
            return groups, settle(list(groups.values()), errors, results, undo)

        return await self._again(run)

    async def _keyed(self, key: bytes, call: Callable[[AsyncNativeTransport], Awaitable[T]]) -> T:
        async def op() -> T:
            return await call(await self._of(key))

        return await self._again(op)

    async def open(self) -> None:
        for shard in await self._map():
            await shard.open()

    @property
    def max_value_bytes(self) -> int:
        if not self._shards:
            raise TransportError(f"{self._options.url}: not open yet (await open() first)")
        return self._shards[0].max_value_bytes

    async def put(
        self,
        key: bytes,
        parts: Sequence[object],
        parent: bytes | None,
        durable: bool = False,
        meta: bytes | None = None,
    ) -> None:
        await self._keyed(key, lambda t: t.put(key, parts, parent, durable, meta))

    async def put_many(self, items: Sequence[PutItem], durable: bool = False) -> None:
        await self._split(
            [item[0] for item in items],
            lambda s, at: s.put_many(pick(items, at), durable),
        )

    async def get(self, key: bytes) -> HeldBlock | None:
        return await self._keyed(key, lambda t: t.get(key))

    async def get_into(self, key: bytes, buffer: memoryview) -> Got:
        return await self._keyed(key, lambda t: t.get_into(key, buffer))

    async def get_many(self, keys: Sequence[bytes]) -> list[HeldBlock | None]:
        groups, parts = await self._split(keys, lambda s, at: s.get_many(pick(keys, at)), release)
        return gather(len(keys), groups, parts)

    async def get_many_into(
        self, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> list[Got]:
        groups, parts = await self._split(
            keys,
            lambda s, at: s.get_many_into(pick(keys, at), pick(buffers, at)),
            scrub(buffers),
        )
        return gather(len(keys), groups, parts)

    async def exists(self, key: bytes) -> bool:
        return await self._keyed(key, lambda t: t.exists(key))

    async def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        groups, found = await self._split(keys, lambda s, at: s.exists_many(pick(keys, at)))
        return [bool(one) for one in gather(len(keys), groups, found)]

    async def lookup(self, keys: Sequence[bytes]) -> int:
        groups, runs = await self._split(keys, lambda s, at: s.lookup(pick(keys, at)))
        return leading_run(len(keys), groups, runs)

    async def lookup_tiers(self, keys: Sequence[bytes]) -> TierRun:
        groups, runs = await self._split(keys, lambda s, at: s.lookup_tiers(pick(keys, at)))
        return merge_tier_runs(len(keys), groups, runs)

    async def prefetch(self, keys: Sequence[bytes]) -> int:
        _, counts = await self._split(keys, lambda s, at: s.prefetch(pick(keys, at)))
        return sum(counts)

    async def delete(self, key: bytes) -> bool:
        return await self._keyed(key, lambda t: t.delete(key))

    async def stats(self) -> dict[str, object]:
        async def run() -> dict[str, object]:
            shards = await self._map()
            if len(shards) == 1:
                return await shards[0].stats()
            merged = merge_stats(await asyncio.gather(*(s.stats() for s in shards)))
            merged["shards"] = len(shards)
            return merged

        return await self._again(run)

    async def close(self) -> None:
        """Close every shard's connection; later calls raise `TransportError`."""
        self._closed = True
        shards, self._shards = self._shards or [], None
        for shard in shards:
            await shard.close()


def _sync_transport(options: NativeOptions) -> NativeTransport:
    """One daemon process's transport: payloads over NIXL with `data=nixl`."""
    if options.data == "nixl":
        return NixlTransport(options)
    return NativeTransport(options)


def open_sharded(url: StoreURL) -> ShardedTransport:
    """Open `kv://host:port?...` (blocking; connects on first use)."""
    return ShardedTransport(NativeOptions.from_url(url))


def open_sharded_async(url: StoreURL) -> AsyncShardedTransport | ThreadedAsyncTransport:
    """Open `kv://host:port?...` for asyncio (connects on `open` or first use). With
    `data=nixl` the blocking transport serves it from worker threads (a NIXL wait drives
    progress in its thread, never on the event loop)."""
    options = NativeOptions.from_url(url)
    if options.data == "nixl":
        return ThreadedAsyncTransport(ShardedTransport(options))
    return AsyncShardedTransport(options)
