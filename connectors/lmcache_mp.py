"""LMCache 0.5.6 multiprocess (MP) mode: an L2 adapter over a kvoffload store.

LMCache's MP server loads it as a plugin L2 adapter::

    --l2-adapter '{"type": "plugin", "module_path": "kvoffload.connectors.lmcache_mp",
                   "class_name": "KVOffloadL2Adapter",
                   "adapter_params": {"url": "kv://127.0.0.1:7480"}}'

Only ``module_path``, ``class_name``, ``adapter_params`` and ``config_class_name`` reach a
plugin, so every setting of ours lives inside ``adapter_params``: `url` (``local:///dir?...``,
``kv://...`` or ``cluster://...``; required), `salt` (mixed into every key, default "") and
`prefetch` (have the store read SSD-only blocks into DRAM, all at once on its I/O threads,
after a lookup; default true; a load is one batched get, whose SSD reads are in flight
together anyway).

LMCache calls ``submit_*`` and ``query_*`` from its store and prefetch controller threads, which
must never block: each submit only hands a coroutine to this adapter's own event loop thread,
which runs the store's `AsyncClient` (one pipelined batch per task; a load lands straight in
the L1 buffers LMCache hands over) and signals one of three event fds when the task is done.

An `ObjectKey` has five fields and several keys can share a chunk hash (other ranks, object
groups, salts), so the store key is derived from all five. Every load is verified; a block that
is missing, damaged or of the wrong length fails, and so does every later key of its chain
(same model, rank, object group and salt) in that task, so a hit never has a hole. A store
that cannot be reached turns into failed stores and misses within the URL's own timeout.
All LMCache-version-specific code is in this module.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.platform import create_event_notifier

from kvoffload.client_sdk import AsyncClient, BlockHash, Client, Namespace, engine_hashes
from kvoffload.client_sdk.transports import open_transport
from kvoffload.client_sdk.transports.base import ThreadedAsyncTransport
from kvoffload.client_sdk.url import parse_url
from kvoffload.connectors.store_url import block_store_url
from kvoffload.errors import ConfigError, InvalidArgumentError, KVOffloadError

__all__ = ["KVOffloadL2Adapter", "object_name"]

log = logging.getLogger(__name__)

_SETTINGS = {
    "url": "the store: local:///dir?ssd=..., kv://host:7480 or cluster://a:7480,b:7480",
    "salt": "mixed into every key (default empty)",
    "prefetch": "read SSD blocks into the store's DRAM after a lookup (true)",
}
# Stored sizes remembered for LMCache's byte accounting on delete; bounded, oldest dropped.
_MAX_SIZES = 1 << 18
# How long `delete` (called synchronously by LMCache's eviction) and `close` wait.
_WAIT_S = 30.0


@dataclass(frozen=True)
class Settings:
    url: str
    salt: str = ""
    prefetch: bool = True


def parse_settings(params: object) -> Settings:
    """Check ``adapter_params``.

    Raises:
        ConfigError: not a dict, an unknown key, a missing or malformed url, a bad value.
    """
    if not isinstance(params, dict):
        raise ConfigError(f"adapter_params must be a JSON object, got {type(params).__name__}")
    unknown = sorted(set(params) - set(_SETTINGS))
    if unknown:
        valid = "; ".join(f"{k}: {v}" for k, v in _SETTINGS.items())
        raise ConfigError(f"unknown adapter_params key(s) {unknown}; valid: {valid}")
    url = params.get("url")
    if not isinstance(url, str) or not url:
        raise ConfigError('adapter_params.url must name the store, e.g. "kv://127.0.0.1:7480"')
    parse_url(url)  # a malformed URL fails here, before LMCache starts
    salt = params.get("salt", "")
    if not isinstance(salt, str):
        raise ConfigError("adapter_params.salt must be a string")
    prefetch = params.get("prefetch", True)
    if not isinstance(prefetch, bool):
        raise ConfigError("adapter_params.prefetch must be true or false")
    return Settings(url, salt, prefetch)


def object_name(key: Any) -> bytes:
    """All five fields of an LMCache `ObjectKey`, each length-prefixed so that no two keys
    serialise alike."""
    fields = (
        bytes(key.chunk_hash),
        key.model_name.encode(),
        str(int(key.kv_rank)).encode(),
        str(int(key.object_group_id)).encode(),
        key.cache_salt.encode(),
    )
    return b"".join(len(f).to_bytes(4, "little") + f for f in fields)


def chains(keys: Sequence[Any]) -> list[list[int]]:
    """Indices of `keys` grouped by chain (every field but the chunk hash), in task order."""
    groups: dict[tuple[str, int, int, str], list[int]] = {}
    for i, key in enumerate(keys):
        chain = (key.model_name, key.kv_rank, key.object_group_id, key.cache_salt)
        groups.setdefault(chain, []).append(i)
    return list(groups.values())


def _buffer(obj: Any) -> memoryview:
    return memoryview(obj.byte_array).cast("B")


class KVOffloadL2Adapter(L2AdapterInterface):
    """An LMCache MP-mode `L2AdapterInterface` backed by a kvoffload store.

    Constructed by LMCache's plugin factory as ``cls(adapter_params, l1_memory_desc=...)``.

    Raises:
        ConfigError: bad ``adapter_params`` or store URL.
    """

    def __init__(self, adapter_params: dict[str, Any], l1_memory_desc: Any = None) -> None:
        super().__init__()  # kvoffload bounds its own capacity: no LMCache-driven eviction
        self.settings = parse_settings(adapter_params)
        self.namespace = Namespace(
            model="lmcache-mp",
            dtype="uint8",
            layout="lmcache-mp:object",
            hash_algo="lmcache-mp:objectkey-v1",
            salt=self.settings.salt,
        )
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._lock = threading.Lock()  # task ids and the three result tables
        self._next_id = 0
        self._stored: dict[int, L2StoreResult] = {}
        self._found: dict[int, Bitmap] = {}
        self._loaded: dict[int, Bitmap] = {}
        self._sizes: dict[bytes, int] = {}  # guarded by _lock
        # Counters owned by the loop thread (read elsewhere only for report_status).
        self._counts = {"stored": 0, "store_failed": 0, "loaded": 0, "load_failed": 0}
        self._closed = False
        self._sync: Client | None = None  # local:// only: see `_connect`
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvoffload-l2", daemon=True
        )
        self._thread.start()
        try:
            self.client: AsyncClient = self._wait(self._connect())
        except BaseException:
            self._stop_loop()
            raise

    async def _connect(self) -> AsyncClient:
        # Built on the loop that will use it: asyncio transports bind to their loop.
        url = parse_url(self.settings.url)
        if url.scheme != "local":
            return AsyncClient.connect(block_store_url(self.settings.url), namespace=self.namespace)
        # The engine runs in this process, and a task's CPU work (checksums, copies) would
        # run on this one loop thread: stores and loads go through a sync client on worker
        # threads instead, several tasks at once (the rest shares its transport).
        transport = open_transport(url)
        self._sync = Client(transport, namespace=self.namespace)
        return AsyncClient(ThreadedAsyncTransport(transport), namespace=self.namespace)

    async def _put_many(self, hashes: list[BlockHash], values: list[memoryview]) -> None:
        if self._sync is not None:
            await asyncio.to_thread(self._sync.put_many, zip(hashes, values, strict=True))
        else:
            await self.client.put_many(zip(hashes, values, strict=True))

    async def _get_many_into(
        self, hashes: list[BlockHash], buffers: list[memoryview]
    ) -> list[int | None]:
        if self._sync is not None:
            return await asyncio.to_thread(self._sync.get_many_into, hashes, buffers)
        return await self.client.get_many_into(hashes, buffers)

    def _wait(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=_WAIT_S)

    # -- event fds --------------------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return int(self._store_efd.fileno())

    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._lookup_efd.fileno())

    def get_load_event_fd(self) -> int:
        return int(self._load_efd.fileno())

    # -- submit / query (LMCache's controller threads: never block) -------------------------

    def _submit(self, coro: Coroutine[Any, Any, None]) -> None:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        future.add_done_callback(_log_crash)

    def _task_id(self) -> int:
        with self._lock:
            self._next_id += 1
            return self._next_id

    def submit_store_task(self, keys: list[Any], objects: list[Any]) -> int:
        task_id = self._task_id()
        self._submit(self._store(task_id, keys, objects))
        return task_id

    def pop_completed_store_tasks(self) -> dict[int, L2StoreResult]:
        with self._lock:
            done, self._stored = self._stored, {}
        return done

    def submit_lookup_and_lock_task(self, keys: list[Any], group_layout_descs: Any) -> int:
        task_id = self._task_id()
        self._submit(self._lookup(task_id, keys))
        return task_id

    def query_lookup_and_lock_result(self, task_id: int) -> Bitmap | None:
        with self._lock:
            return self._found.pop(task_id, None)

    def submit_unlock(self, keys: list[Any]) -> None:
        # kvoffload has no per-reader locks: a block evicted between lookup and load is a
        # failed load of that key, which LMCache handles.
        return None

    def submit_load_task(self, keys: list[Any], objects: list[Any]) -> int:
        task_id = self._task_id()
        self._submit(self._load(task_id, keys, objects))
        return task_id

    def query_load_result(self, task_id: int) -> Bitmap | None:
        with self._lock:
            return self._loaded.pop(task_id, None)

    # -- the tasks (this adapter's loop thread) ---------------------------------------------

    def _hashes(self, keys: Sequence[Any]) -> list[BlockHash]:
        return engine_hashes(self.namespace, [object_name(k) for k in keys])

    async def _store(self, task_id: int, keys: list[Any], objects: list[Any]) -> None:
        result = L2StoreResult(False, 0)
        try:
            hashes = self._hashes(keys)
            values = [_buffer(obj) for obj in objects]
            await self._put_many(hashes, values)
            sizes = [len(v) for v in values]
            self._remember(hashes, sizes)
            self._counts["stored"] += len(keys)
            self._notify_keys_stored(keys, sizes)
            result = L2StoreResult(True, sum(sizes))
        except KVOffloadError as exc:
            self._counts["store_failed"] += len(keys)
            log.warning("kvoffload: storing %d LMCache objects failed: %s", len(keys), exc)
        finally:  # a task always completes, or LMCache's controller waits for it forever
            with self._lock:
                self._stored[task_id] = result
            self._store_efd.notify()

    async def _lookup(self, task_id: int, keys: list[Any]) -> None:
        found = Bitmap(len(keys))
        hashes: list[BlockHash] = []
        try:
            hashes = self._hashes(keys)
            for chain in chains(keys):
                # One request for the stored prefix, then one batch for the keys after its
                # first gap (each answers for itself); both answer misses when the store is
                # unreachable.
                n = await self.client.lookup([hashes[i] for i in chain])
                rest = chain[n + 1 :]
                there = await self.client.exists_many([hashes[i] for i in rest]) if rest else []
                for i in chain[:n] + [i for i, ok in zip(rest, there, strict=True) if ok]:
                    found.set(i)
        except KVOffloadError as exc:
            log.warning("kvoffload: looking up %d LMCache objects failed: %s", len(keys), exc)
        finally:
            with self._lock:
                self._found[task_id] = found
            self._lookup_efd.notify()
        hits = [hashes[i] for i in found.get_indices_list()]
        if self.settings.prefetch and hits:
            # The nearest thing to LMCache's "lock": SSD-only blocks move to DRAM before the
            # load asks for them (in the store's background, reads never done twice).
            try:
                await self.client.prefetch(hits)
            except KVOffloadError as exc:
                log.info("kvoffload: prefetch after a lookup failed: %s", exc)

    async def _load(self, task_id: int, keys: list[Any], objects: list[Any]) -> None:
        loaded = Bitmap(len(keys))
        try:
            hashes = self._hashes(keys)
            buffers = [_buffer(obj) for obj in objects]
            # One batched get: the store reads the task's SSD-only blocks with several reads
            # in flight (a prefetch first would only stage them in its DRAM, where a task
            # larger than that DRAM evicts its own blocks before they are copied out).
            try:
                got = await self._get_many_into(hashes, buffers)
            except InvalidArgumentError:
                # A stored block larger than its L1 buffer: read each on its own, so only
                # that one fails.
                got = [await self._load_one(h, b) for h, b in zip(hashes, buffers, strict=True)]
            for chain in chains(keys):
                for i in chain:
                    if got[i] != len(buffers[i]):
                        break  # missing, damaged or the wrong length: the chain's hit ends
                    loaded.set(i)
        except KVOffloadError as exc:
            log.warning("kvoffload: loading %d LMCache objects failed: %s", len(keys), exc)
        finally:
            with self._lock:
                self._loaded[task_id] = loaded
            self._load_efd.notify()
        hit = loaded.popcount()
        self._counts["loaded"] += hit
        self._counts["load_failed"] += len(keys) - hit
        if hit:
            self._notify_keys_accessed([keys[i] for i in loaded.get_indices_list()])

    async def _load_one(self, key: BlockHash, buffer: memoryview) -> int | None:
        try:
            return await self.client.get_into(key, buffer)
        except InvalidArgumentError as exc:
            log.warning("kvoffload: object %s does not fit its buffer: %s", key[:16].hex(), exc)
            return None

    # -- delete, status, close --------------------------------------------------------------

    def _remember(self, hashes: Sequence[BlockHash], sizes: Sequence[int]) -> None:
        with self._lock:
            for h, size in zip(hashes, sizes, strict=True):
                self._sizes.pop(h, None)
                self._sizes[h] = size
            while len(self._sizes) > _MAX_SIZES:
                del self._sizes[next(iter(self._sizes))]

    def delete(self, keys: list[Any]) -> None:
        """Delete `keys` from the store; absent keys are skipped. Called synchronously by
        LMCache's eviction; waits at most 30 s, then gives up (logged)."""
        if not keys or self._closed:
            return
        hashes = self._hashes(keys)
        try:
            held = self._wait(self._delete(hashes))
        except (KVOffloadError, TimeoutError) as exc:
            log.warning("kvoffload: deleting %d LMCache objects failed: %s", len(keys), exc)
            return
        gone = [i for i, was in enumerate(held) if was]
        with self._lock:
            sizes = [self._sizes.pop(hashes[i], 0) for i in gone]
        if gone:
            self._notify_keys_deleted([keys[i] for i in gone], sizes)

    async def _delete(self, hashes: list[BlockHash]) -> list[bool]:
        return list(await asyncio.gather(*(self.client.delete(h) for h in hashes)))

    def report_status(self) -> dict[str, Any]:
        url = parse_url(self.settings.url)
        return {
            "is_healthy": self._thread.is_alive() and not self._closed,
            "type": type(self).__name__,
            "store": f"{url.scheme}://{url.host}{url.path}",  # no token or parameters
            **self._counts,
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._wait(self._shutdown())
        except (KVOffloadError, TimeoutError) as exc:
            log.warning("kvoffload: closing the store client failed: %s", exc)
        self._stop_loop()

    async def _shutdown(self) -> None:
        current = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.client.close()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=_WAIT_S)
        if not self._thread.is_alive():
            self._loop.close()
        for efd in (self._store_efd, self._lookup_efd, self._load_efd):
            efd.close()


def _log_crash(future: Future[None]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("kvoffload: an L2 task failed", exc_info=future.exception())
