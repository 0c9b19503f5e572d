"""SGLang 0.5.23 HiCache storage backend over a kvoffload store (the L3 tier behind SGLang's
host-memory KV pool).

Load it with ``--hicache-storage-backend dynamic`` and an extra config that names this class::

    --hicache-storage-backend-extra-config '{"backend_name":"kvoffload",
      "module_path":"kvoffload.connectors.sglang","class_name":"KVOffloadHiCacheStorage",
      "interface_v1":1,"url":"kv://127.0.0.1:7480"}'

SGLang names pages by chained SHA-256 page hashes; each is mixed with a namespace that covers
the model, dtype, page size, host pool layout and the rank's shard, so pages of different
deployments never collide. With ``interface_v1`` (zero copy) a page is stored as the parts the
host pool reports for it (K and V for an MHA pool in the default ``page_first`` layout, one
latent part for MLA), each put straight from host memory and read straight back into it; the
generic interface stores one flat page tensor. All SGLang-version-specific code is here.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvoffload.client_sdk import BlockHash, Client, Namespace, engine_hashes
from kvoffload.client_sdk.keys import DTYPE_BYTES
from kvoffload.errors import ConfigError, KVOffloadError

__all__ = ["KVOffloadHiCacheStorage", "Settings"]

log = logging.getLogger(__name__)

# Keys of the extra config that SGLang itself reads.
_SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})


@dataclass(frozen=True)
class Settings:
    """Our keys of ``--hicache-storage-backend-extra-config``."""

    # The store, e.g. kv://127.0.0.1:7480.
    url: str = ""
    # Deployment salt mixed into every key.
    salt: str = ""
    # Concurrent page reads per batch.
    io_threads: int = 8

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> Settings:
        """Raises: ConfigError for an unknown key, a missing url or a bad value."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known - _SGLANG_KEYS)
        if unknown:
            raise ConfigError(
                f"unknown HiCache extra config key(s) {unknown}; kvoffload reads "
                f"{sorted(known)}, SGLang reads {sorted(_SGLANG_KEYS)}"
            )
        url, salt, threads = extra.get("url", ""), extra.get("salt", ""), extra.get("io_threads", 8)
        if not isinstance(url, str) or not url:
            raise ConfigError('the HiCache extra config needs "url" (e.g. "kv://host:7480")')
        if not isinstance(salt, str):
            raise ConfigError("salt must be a string")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads <= 0:
            raise ConfigError("io_threads must be a positive integer")
        return cls(url=url, salt=salt, io_threads=threads)


def _host_memory(ptr: int, size: int) -> memoryview:
    """Writable bytes of host memory SGLang's pool reported (pinned CPU memory it owns)."""
    return memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")


def page_namespace(config: HiCacheStorageConfig, pool: Any, parts: int, salt: str) -> Namespace:
    """The namespace of this rank's pages: everything that changes a page's bytes."""
    dtype = str(pool.dtype).removeprefix("torch.")
    mla = bool(config.is_mla_model)
    layout = (
        f"sglang:{type(pool).__name__}:{pool.layout}:parts={parts}:dtype={dtype}"
        f":pp={config.pp_rank}/{config.pp_size}:cp={config.attn_cp_rank}/{config.attn_cp_size}"
        f":dcp={config.dcp_rank}/{config.dcp_size}"
    )
    return Namespace(
        model=config.model_name or "unknown",
        dtype=dtype if dtype in DTYPE_BYTES else "uint8",
        block_tokens=int(pool.page_size),
        num_layers=int(pool.layer_num),
        num_kv_heads=int(getattr(pool, "head_num", 1)),
        head_size=int(getattr(pool, "head_dim", 0) or getattr(pool, "kv_cache_dim", 1)),
        layout=layout,
        # MLA pages are the same on every TP rank: all ranks share one copy.
        tp_rank=0 if mla else int(config.tp_rank),
        tp_size=1 if mla else int(config.tp_size),
        hash_algo="sglang:sha256",
        salt=salt,
    )


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
        self._client: Client | None = None
        self._parts = 1
        self._readers = ThreadPoolExecutor(self.settings.io_threads, "kvoffload-hicache")
        self._lock = threading.Lock()
        self._counts = {"pages_written": 0, "objects_read": 0, "failed_reads": 0}

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Adopt SGLang's host pool: the page geometry decides the namespace."""
        super().register_mem_pool_host(mem_pool_host)
        page = torch.arange(mem_pool_host.page_size, dtype=torch.int64)
        ptrs, _ = mem_pool_host.get_page_buffer_meta(page)
        self._parts = len(ptrs)
        self.namespace = page_namespace(
            self.storage_config, mem_pool_host, self._parts, self.settings.salt
        )
        if self._client is not None:
            self._client.close()
        self._client = Client.connect(self.settings.url, namespace=self.namespace)

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
        return [_host_memory(int(p), int(s)) for p, s in zip(ptrs, sizes, strict=True)]

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
        """One verified part or page into `buffer` (host memory or a CPU tensor)."""
        client, _ = self._store()
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
        if self._client is not None:
            self._client.close()
            self._client = None
