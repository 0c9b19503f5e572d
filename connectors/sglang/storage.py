"""SGLang 0.5.23 HiCache storage backend over a kvoffload store (the L3 tier behind SGLang's
host-memory pools).

SGLang names pages by chained SHA-256 page hashes; each is mixed with a namespace that covers
the model, dtype, page size, host pool layout and the rank's shard, so pages of different
deployments never collide. KV pages go through the v1 (zero copy, ``interface_v1``) or the
generic interface; a hybrid model's other pools (MAMBA state, SWA, indexers, ...) through the
v2 per-pool interface, each pool's pages under keys that name the pool and its layout.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kvoffload.client_sdk import BlockHash, Client, Namespace, engine_hashes
from kvoffload.client_sdk.transports import open_transport
from kvoffload.client_sdk.transports.base import Transport
from kvoffload.client_sdk.url import parse_url
from kvoffload.connectors.sglang.pools import PoolPages, host_memory, probe_parts, restorable
from kvoffload.connectors.sglang.settings import (
    STATE_POOLS,
    Settings,
    page_namespace,
    pool_namespace,
)
from kvoffload.connectors.store_url import block_store_url
from kvoffload.errors import ConfigError, KVOffloadError

__all__ = ["KVOffloadHiCacheStorage"]

log = logging.getLogger(__name__)

_KV = PoolName.KV.value


class KVOffloadHiCacheStorage(HiCacheStorage):
    """A `HiCacheStorage` backed by a kvoffload store.

    Args:
        storage_config: SGLang's storage config; its ``extra_config`` holds `Settings`.
        kwargs: what SGLang's factory passes to dynamic backends (unused).

    Raises:
        ConfigError: bad extra config.
    """

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None
    ) -> None:
        self.settings = Settings.from_extra_config(storage_config.extra_config or {})
        self.storage_config = storage_config
        self.namespace: Namespace | None = None
        self._conn: Transport | None = None
        self._client: Client | None = None
        self._parts = 1
        self._pools: dict[str, PoolPages] = {}
        self._readers = ThreadPoolExecutor(self.settings.io_threads, "kvoffload-hicache")
        self._lock = threading.Lock()
        self._counts = {"pages_written": 0, "objects_read": 0, "failed_reads": 0}

    def _transport(self) -> Transport:
        """One connection to the store, shared by the clients of every pool."""
        if self._conn is None:
            self._conn = open_transport(parse_url(block_store_url(self.settings.url)))
        return self._conn

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Adopt SGLang's host pool (the KV pool): the page geometry decides the namespace."""
        super().register_mem_pool_host(mem_pool_host)
        page = torch.arange(mem_pool_host.page_size, dtype=torch.int64)
        ptrs, _ = mem_pool_host.get_page_buffer_meta(page)
        self._parts = len(ptrs)
        self.namespace = page_namespace(
            self.storage_config, mem_pool_host, self._parts, self.settings.salt,
            self.settings.codec,
        )  # fmt: skip
        self._client = Client(self._transport(), namespace=self.namespace)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Adopt one of a hybrid model's host pools (SGLang calls this for each pool of its
        pool group after `register_mem_pool_host`, and for sidecars added later): its pages
        are stored under a namespace of their own that names the pool and its layout.

        Raises:
            ConfigError: the pool reports pages this backend cannot store.
        """
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(getattr(host_pool_name, "value", host_pool_name))
        if name == _KV:
            return  # the KV pool's pages go through the v1 or generic interface
        zero_copy, sizes = probe_parts(host_pool)
        if not sizes or min(sizes) <= 0:
            raise ConfigError(f"pool {name}: the host pool reports empty pages ({sizes})")
        ns = pool_namespace(self.storage_config, name, host_pool, sizes, zero_copy, self.settings)
        client = Client(self._transport(), namespace=ns)
        self._pools[name] = PoolPages(name, host_pool, client, zero_copy, sizes)
        log.info(
            "kvoffload: HiCache pool %s stored as %s of %s bytes a page",
            name, "parts" if zero_copy else "one flat page", sizes,
        )  # fmt: skip

    # -- keys -----------------------------------------------------------------------------

    def _store(self) -> tuple[Client, Namespace]:
        if self._client is None or self.namespace is None:
            raise ConfigError("register_mem_pool_host was not called")
        return self._client, self.namespace

    def _zero_copy_hashes(self, keys: Sequence[str]) -> list[BlockHash]:
        """One hash per part per page, page after page (a chain the store can count)."""
        _, ns = self._store()
        names = [f"{key}\0v1/{j}".encode() for key in keys for j in range(self._parts)]
        return engine_hashes(ns, names)

    def _flat_hashes(self, keys: Sequence[str]) -> list[BlockHash]:
        _, ns = self._store()
        return engine_hashes(ns, [f"{key}\0flat".encode() for key in keys])

    def _uses_zero_copy(self) -> bool:
        return bool((self.storage_config.extra_config or {}).get("interface_v1", 0))

    def _chain_parent(self, extra_info: Any, zero_copy: bool) -> BlockHash | None:
        """The hash of the last stored part before this batch, from SGLang's prefix keys."""
        prefix = getattr(extra_info, "prefix_keys", None)
        if not prefix:
            return None
        hashes = (
            self._zero_copy_hashes(prefix[-1:]) if zero_copy else self._flat_hashes(prefix[-1:])
        )
        return hashes[-1]

    # -- lookups --------------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading pages of `keys` the store holds (one round trip)."""
        client, _ = self._store()
        if self._uses_zero_copy():
            return client.lookup(self._zero_copy_hashes(keys)) // self._parts
        return client.lookup(self._flat_hashes(keys))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- zero-copy interface ----------------------------------------------------------------

    def _page_memory(self, host_indices: torch.Tensor, pages: int) -> list[memoryview]:
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if len(ptrs) != pages * self._parts:
            raise ConfigError(
                f"the host pool reported {len(ptrs)} buffers for {pages} pages, "
                f"expected {self._parts} per page"
            )
        return [host_memory(int(p), int(s)) for p, s in zip(ptrs, sizes, strict=True)]

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Put each page's parts straight from host memory; pages already stored are kept."""
        client, _ = self._store()
        if not keys:
            return []
        if not self.storage_config.is_storage_writer:
            return [True] * len(keys)  # another rank writes the shared (MLA) pages
        hashes = self._zero_copy_hashes(keys)
        memory = self._page_memory(host_indices, len(keys))
        present = client.lookup(hashes) // self._parts
        first = present * self._parts
        parent = hashes[first - 1] if first else self._chain_parent(extra_info, True)
        todo = list(zip(hashes[first:], memory[first:], strict=True))
        try:
            client.put_many(todo, parents=[parent, *hashes[first:-1]][: len(todo)])
        except KVOffloadError as exc:
            log.warning("kvoffload: storing %d pages failed: %s", len(keys) - present, exc)
            return [True] * present + [False] * (len(keys) - present)
        with self._lock:
            self._counts["pages_written"] += len(keys) - present
        return [True] * len(keys)

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Read each page's parts straight into host memory, verified; a page counts only if
        all its parts arrived."""
        self._store()
        if not keys:
            return []
        hashes = self._zero_copy_hashes(keys)
        memory = self._page_memory(host_indices, len(keys))
        got = list(self._readers.map(self._read_into, hashes, memory))
        parts = self._parts
        return [all(got[i * parts : (i + 1) * parts]) for i in range(len(keys))]

    def _read_into(self, key: BlockHash, buffer: Any) -> bool:
        """One verified KV part or page into `buffer` (host memory or a CPU tensor)."""
        client, _ = self._store()
        return self._read_part(client, key, buffer)

    def _read_part(self, client: Client, key: BlockHash, buffer: Any) -> bool:
        """One verified block of `client`'s namespace into `buffer`; it must fill it exactly."""
        size = (
            len(buffer)
            if isinstance(buffer, memoryview)
            else buffer.numel() * buffer.element_size()
        )
        try:
            ok = client.get_into(key, buffer) == size
        except KVOffloadError as exc:
            log.warning("kvoffload: reading page %s failed: %s", key[:16].hex(), exc)
            ok = False
        with self._lock:
            self._counts["objects_read" if ok else "failed_reads"] += 1
        return ok

    # -- v2: per-pool transfers of hybrid models --------------------------------------------

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: Any = None,
    ) -> PoolTransferResult:
        """The longest prefix of `keys` (KV page hashes) that the KV pages and every pool of
        `pool_transfers` can restore, each pool under the hit policy SGLang gives it.

        A pool's pages are keyed by the KV page hash they sit at. ALL_PAGES pools must hold
        every page of the prefix, TRAILING_PAGES pools (Mamba and SWA states) the last
        ``len(transfer.keys)`` pages; the result lists every restorable length (SGLang
        intersects them across ranks) and each pool's own boundary. A pool that is not
        registered, or a policy that cannot be folded, ends the hit at 0; BLOCK_GROUPS pools
        give no verdict (by SGLang's definition they never gate the KV hit).
        """
        kv_pages = self.batch_exists(keys, extra_info)
        hits: dict[str, int] = {_KV: kv_pages} if kv_pages else {}
        lengths = set(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not lengths:
                break
            name = str(getattr(transfer.name, "value", transfer.name))
            pages = self._pools.get(name)
            if pages is None:
                log.warning("kvoffload: pool %s was never registered: no hit", name)
                lengths = set()
                break
            if transfer.hit_policy == PoolHitPolicy.BLOCK_GROUPS:
                continue
            window = len(transfer.keys or []) or 1
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                present = [True] * pages.leading(keys[:kv_pages])
                present += [False] * (kv_pages - len(present))
            else:
                present = pages.present(keys[:kv_pages], self._readers)
            try:
                ok = restorable(transfer.hit_policy, window, present)
            except ValueError as exc:
                log.warning("kvoffload: pool %s: %s: no hit", name, exc)
                lengths = set()
                break
            if ok:
                hits[name] = max(ok)
            lengths &= ok
        final = max(lengths, default=0)
        return PoolTransferResult(final, hits, sorted(lengths))

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: Any = None
    ) -> dict[str, list[bool]]:
        """Store each transfer's pages from its host pool; per pool, one flag per key."""
        results: dict[str, list[bool]] = {}
        for transfer in transfers:
            name = str(getattr(transfer.name, "value", transfer.name))
            keys = list(transfer.keys or [])
            if name == _KV:
                results[name] = self._set_kv(keys, transfer.host_indices, extra_info)
                continue
            results[name] = self._set_pool(name, keys, transfer.host_indices)
        return results

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: Any = None
    ) -> dict[str, list[bool]]:
        """Read each transfer's pages into its host pool, verified; per pool, one flag per
        key, a page true only if every part of it arrived whole."""
        results: dict[str, list[bool]] = {}
        for transfer in transfers:
            name = str(getattr(transfer.name, "value", transfer.name))
            keys = list(transfer.keys or [])
            if name == _KV:
                results[name] = self._get_kv(keys, transfer.host_indices, extra_info)
                continue
            pages = self._pools.get(name)
            if pages is None or not keys:
                results[name] = [False] * len(keys)
                continue
            try:
                results[name] = pages.read(keys, transfer.host_indices, self._readers,
                                           self._read_part)  # fmt: skip
            except (ConfigError, KVOffloadError) as exc:
                log.warning("kvoffload: reading %d %s pages failed: %s", len(keys), name, exc)
                results[name] = [False] * len(keys)
        return results

    def _set_pool(self, name: str, keys: list[str], host_indices: Any) -> list[bool]:
        pages = self._pools.get(name)
        if pages is None:
            log.warning("kvoffload: pool %s was never registered: not stored", name)
            return [False] * len(keys)
        if not keys:
            return []
        if not self.storage_config.is_storage_writer and name not in STATE_POOLS:
            return [True] * len(keys)  # another rank writes the shared (MLA) pages
        try:
            values = pages.values(host_indices, len(keys))
            pages.client.put_many(zip(pages.hashes(keys), values, strict=True))
        except (ConfigError, KVOffloadError) as exc:
            log.warning("kvoffload: storing %d %s pages failed: %s", len(keys), name, exc)
            return [False] * len(keys)
        with self._lock:
            self._counts["pages_written"] += len(keys)
        return [True] * len(keys)

    def _set_kv(self, keys: list[str], host_indices: Any, extra_info: Any) -> list[bool]:
        """KV pages handed to v2 (SGLang's linkers do): the same keys as v1 or generic."""
        if self._uses_zero_copy():
            return self.batch_set_v1(keys, host_indices, extra_info)
        pages = [self.mem_pool_host.get_data_page(int(i)) for i in self._kv_offsets(host_indices)]
        return [self.batch_set(keys, pages)] * len(keys)

    def _get_kv(self, keys: list[str], host_indices: Any, extra_info: Any) -> list[bool]:
        if self._uses_zero_copy():
            return self.batch_get_v1(keys, host_indices, extra_info)
        offsets = self._kv_offsets(host_indices)
        got = self.batch_get(keys, [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys])
        for offset, page in zip(offsets, got, strict=True):
            if page is not None:
                self.mem_pool_host.set_from_flat_data_page(offset, page)
        return [page is not None for page in got]

    def _kv_offsets(self, host_indices: Any) -> list[int]:
        return [int(i) for i in host_indices.tolist()[:: int(self.mem_pool_host.page_size)]]

    # -- generic interface (one flat tensor per page) -------------------------------------

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        client, _ = self._store()
        if not keys:
            return True
        if not self.storage_config.is_storage_writer:
            return True
        hashes = self._flat_hashes(keys)
        pages = [v.contiguous() for v in values]
        try:
            client.put_many(zip(hashes, pages, strict=True), parents=[None, *hashes[:-1]])
        except KVOffloadError as exc:
            log.warning("kvoffload: storing %d pages failed: %s", len(keys), exc)
            return False
        with self._lock:
            self._counts["pages_written"] += len(keys)
        return True

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        self._store()
        if target_locations is None:
            raise ConfigError("batch_get needs target_locations (SGLang passes flat pages)")
        targets = list(target_locations)
        got = list(self._readers.map(self._read_into, self._flat_hashes(keys), targets))
        return [t if ok else None for t, ok in zip(targets, got, strict=True)]

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    # -- housekeeping ---------------------------------------------------------------------

    def get_stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def clear(self) -> None:
        # A shared store is not wiped from one engine: other engines' pages live there too.
        log.info("kvoffload: clear() keeps the shared store's pages; delete them on the store")

    def close(self) -> None:
        self._readers.shutdown(wait=True)
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._client = None
        self._pools.clear()
