"""Keys over the shards of a store: a transport per shard, each key sent straight to its own.

`ShardRouter` is a blocking transport over the shards' transports, placing keys with
`wire.shards.shard_of` (the daemon's placement). A batch (`put_many`, `get_many*`, `lookup`,
`prefetch`) is split by shard and the parts run side by side, one thread each, so a batch
costs one round trip per shard, in parallel, never one per key; a batch that fails on one
shard fails whole (blocks the others returned are released, bytes they landed zeroed). Errors
are the shards' own. Used by `kv://` (shards from the daemon's Welcome) and `nvme+tcp://`
(shards named in the URL).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeAlias, TypeVar

from kvoffload.client_sdk.transports.base import HeldBlock, PutItem, Received, Transport
from kvoffload.errors import TransportError, WrongShardError
from kvoffload.wire.shards import merge_stats, shard_of
from kvoffload.wire.tiers import Tier, TierRun

__all__ = [
    "Got",
    "ShardRouter",
    "gather",
    "groups_of",
    "leading_run",
    "merge_tier_runs",
    "pick",
    "release",
    "scrub",
    "settle",
]

T = TypeVar("T")
G = TypeVar("G")
Got: TypeAlias = HeldBlock | Received | None


def pick(items: Sequence[T], at: list[int]) -> Sequence[T]:
    """`items` at the positions `at` (increasing, as `groups_of` gives them): all of them, the
    one-shard case, without a per-item copy."""
    return items if len(at) == len(items) else [items[i] for i in at]


def groups_of(keys: Sequence[bytes], count: int) -> dict[int, list[int]]:
    """Shard -> positions in `keys`, in order."""
    if count == 1:
        return {0: list(range(len(keys)))} if len(keys) else {}
    groups: dict[int, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(shard_of(key, count), []).append(i)
    return groups


def leading_run(total: int, groups: dict[int, list[int]], runs: Sequence[int]) -> int:
    """The whole chain's leading run from each shard's leading run over its own keys (in
    order): the first key missing anywhere is the first missing key of some shard."""
    first_missing = total
    for positions, run in zip(groups.values(), runs, strict=True):
        if run < len(positions):
            first_missing = min(first_missing, positions[run])
    return first_missing


def merge_tier_runs(total: int, groups: dict[int, list[int]], runs: Sequence[TierRun]) -> TierRun:
    """The whole chain's `TierRun` from each shard's over its own keys: the leading run as
    `leading_run` says, each block with the tier its shard reported, in key order."""
    run = leading_run(total, groups, [r.total for r in runs])
    tiers = [Tier.UNKNOWN] * run
    for positions, part in zip(groups.values(), runs, strict=True):
        for i, tier in zip(positions, part.tiers(), strict=False):
            if i < run:
                tiers[i] = tier
    return TierRun.from_tiers(tiers)


def gather(
    total: int, groups: dict[int, list[int]], parts: Sequence[Sequence[G]]
) -> list[G | None]:
    """Each shard's answers back in the order of the keys asked."""
    out: list[G | None] = [None] * total
    for positions, got in zip(groups.values(), parts, strict=True):
        for i, one in zip(positions, got, strict=True):
            out[i] = one
    return out


def settle(
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


def release(at: list[int], got: Sequence[HeldBlock | Received | None]) -> None:
    for block in got:
        if block is not None and not isinstance(block, Received):
            block.release()


def scrub(buffers: Sequence[memoryview]) -> Callable[[list[int], Sequence[Got]], None]:
    def undo(at: list[int], got: Sequence[Got]) -> None:
        for i, block in zip(at, got, strict=True):
            if isinstance(block, Received):
                buffers[i][: block.length] = bytes(block.length)
            elif block is not None:
                block.release()

    return undo


class ShardRouter:
    """A blocking transport over one transport per shard, placing keys with `shard_of`.

    `resolve` gives the shards' transports in shard order; it runs on first use (it may
    connect). One transport means one shard: every call goes straight to it. `remap`, when
    given, is asked after a call failed to reach its shard whether the store's shards have
    changed (a restarted daemon whose shards listen elsewhere): it returns the new shards'
    transports (the call is then made once more) or None.
    """

    def __init__(
        self,
        resolve: Callable[[], Sequence[Transport]],
        remap: Callable[[], Sequence[Transport] | None] | None = None,
    ) -> None:
        self._resolve = resolve
        self._remap = remap
        self._shards: list[Transport] | None = None
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    def _install(self, found: Sequence[Transport]) -> list[Transport]:
        shards = list(found)
        pool = ThreadPoolExecutor(len(shards), "kvoffload-shard") if len(shards) > 1 else None
        old, old_pool = self._shards, self._pool
        self._shards, self._pool = shards, pool
        for shard in old or ():
            if shard not in shards:
                shard.close()
        if old_pool is not None:
            old_pool.shutdown(wait=False)
        return shards

    def _map(self) -> list[Transport]:
        shards = self._shards
        if shards is None:
            with self._lock:
                if self._closed:
                    raise TransportError("the client is closed")
                shards = self._shards or self._install(self._resolve())
        return shards

    def _again(self, op: Callable[[], T]) -> T:
        """`op`, once more on a new shard map if it could not reach a shard of the old one."""
        try:
            return op()
        except (TransportError, WrongShardError):
            if self._remap is None or self._closed:
                raise
            with self._lock:
                found = self._remap()
                if found is None or self._closed:
                    raise
                self._install(found)
        return op()

    def _of(self, key: bytes) -> Transport:
        shards = self._map()
        return shards[shard_of(key, len(shards))] if len(shards) > 1 else shards[0]

    def _split(
        self,
        keys: Sequence[bytes],
        call: Callable[[Transport, list[int]], T],
        undo: Callable[[list[int], T], None] | None = None,
    ) -> tuple[dict[int, list[int]], list[T]]:
        """Run `call(shard, positions)` for each shard that holds some of `keys`, side by
        side. If one fails, the first failure raises once all have finished, after `undo`
        took back what the others returned (blocks they hold, bytes they landed)."""

        def run() -> tuple[dict[int, list[int]], list[T]]:
            shards, pool = self._map(), self._pool
            groups = groups_of(keys, len(shards))
            if len(groups) <= 1 or pool is None:
                return groups, [call(shards[s], at) for s, at in groups.items()]
            futures = [pool.submit(call, shards[s], at) for s, at in groups.items()]
            wait(futures)
            errors = [f.exception() for f in futures]
            results = [None if e else f.result() for f, e in zip(futures, errors, strict=True)]
            return groups, settle(list(groups.values()), errors, results, undo)

        return self._again(run)

    @property
    def shard_count(self) -> int:
        return len(self._map())

    @property
    def max_value_bytes(self) -> int:
        return self._again(lambda: self._map()[0].max_value_bytes)

    @property
    def tenant(self) -> str:
        return str(getattr(self._map()[0], "tenant", ""))

    def put(
        self,
        key: bytes,
        parts: Sequence[object],
        parent: bytes | None,
        durable: bool = False,
        meta: bytes | None = None,
    ) -> None:
        self._again(lambda: self._of(key).put(key, parts, parent, durable, meta))

    def put_many(self, items: Sequence[PutItem], durable: bool = False) -> None:
        self._split(
            [item[0] for item in items],
            lambda s, at: s.put_many(pick(items, at), durable),
        )

    def get(self, key: bytes) -> HeldBlock | None:
        return self._again(lambda: self._of(key).get(key))

    def get_into(self, key: bytes, buffer: memoryview) -> Got:
        return self._again(lambda: self._of(key).get_into(key, buffer))

    def get_many(self, keys: Sequence[bytes]) -> list[HeldBlock | None]:
        groups, parts = self._split(keys, lambda s, at: s.get_many(pick(keys, at)), release)
        return gather(len(keys), groups, parts)

    def get_many_into(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[Got]:
        groups, parts = self._split(
            keys,
            lambda s, at: s.get_many_into(pick(keys, at), pick(buffers, at)),
            scrub(buffers),
        )
        return gather(len(keys), groups, parts)

    def exists(self, key: bytes) -> bool:
        return self._again(lambda: self._of(key).exists(key))

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        groups, found = self._split(keys, lambda s, at: s.exists_many(pick(keys, at)))
        return [bool(one) for one in gather(len(keys), groups, found)]

    def lookup(self, keys: Sequence[bytes]) -> int:
        groups, runs = self._split(keys, lambda s, at: s.lookup(pick(keys, at)))
        return leading_run(len(keys), groups, runs)

    def lookup_tiers(self, keys: Sequence[bytes]) -> TierRun:
        groups, runs = self._split(keys, lambda s, at: s.lookup_tiers(pick(keys, at)))
        return merge_tier_runs(len(keys), groups, runs)

    def prefetch(self, keys: Sequence[bytes]) -> int:
        _, counts = self._split(keys, lambda s, at: s.prefetch(pick(keys, at)))
        return sum(counts)

    def delete(self, key: bytes) -> bool:
        return self._again(lambda: self._of(key).delete(key))

    def stats(self) -> dict[str, object]:
        def run() -> dict[str, object]:
            shards, pool = self._map(), self._pool
            if len(shards) == 1:
                return shards[0].stats()
            parts = (
                list(pool.map(lambda s: s.stats(), shards)) if pool else [s.stats() for s in shards]
            )
            merged = merge_stats(parts)
            merged["shards"] = len(shards)
            return merged

        return self._again(run)

    def close(self) -> None:
        """Close every shard's transport; later calls raise `TransportError`."""
        self._closed = True
        with self._lock:
            shards, self._shards = self._shards or [], None
            pool, self._pool = self._pool, None
        for shard in shards:
            shard.close()
        if pool is not None:
            pool.shutdown(wait=False)
