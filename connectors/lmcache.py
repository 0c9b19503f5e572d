"""LMCache 0.5.6 remote connector over a kvoffload store, loaded through
``remote_storage_plugins`` (no LMCache fork, no ``remote_url``)::

    remote_storage_plugins: ["kvoffload"]
    extra_config:
      remote_storage_plugin.kvoffload.module_path: kvoffload.connectors.lmcache
      remote_storage_plugin.kvoffload.class_name: KVOffloadRemoteConnector
      remote_storage_plugin.kvoffload.url: kv://127.0.0.1:7480

LMCache names a chunk by its `CacheEngineKey` (model, world size, worker, chained chunk hash,
dtype); that name is mixed with a namespace covering the chunk's shapes, dtypes and memory
format, so engines with other chunk layouts never read each other's bytes. A chunk is stored as
its raw bytes: a read goes straight into a full-chunk buffer from LMCache's allocator and a
short chunk is then trimmed with LMCache's own `reshape_partial_chunk`. Reads are verified
(a damaged chunk is a miss). All LMCache-version-specific code is in this module.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvoffload.client_sdk import BlockHash, Client, Namespace, engine_hashes
from kvoffload.client_sdk.keys import DTYPE_BYTES
from kvoffload.connectors.store_url import block_store_url
from kvoffload.errors import ConfigError, KVOffloadError

__all__ = ["KVOffloadRemoteConnector"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_PREFIX = "remote_storage_plugin."
_OURS = "kvoffload.connectors.lmcache"
_SETTINGS = ("module_path", "class_name", "url", "salt", "io_threads")


def _settings(config: Any) -> dict[str, Any]:
    """This plugin's ``remote_storage_plugin.<name>.*`` keys.

    LMCache does not tell a plugin its name, so the name is the one plugin entry whose
    module_path is this module.

    Raises:
        ConfigError: no entry or several point here, an unknown key, or no url.
    """
    extra = dict(config.extra_config or {})
    names = [
        name
        for name in (config.remote_storage_plugins or [])
        if extra.get(f"{_PREFIX}{name}.module_path") == _OURS
    ]
    if len(names) != 1:
        raise ConfigError(
            f"expected one remote_storage_plugins entry with module_path {_OURS}, found {names}"
        )
    prefix = f"{_PREFIX}{names[0]}."
    ours = {k.removeprefix(prefix): v for k, v in extra.items() if k.startswith(prefix)}
    unknown = sorted(set(ours) - set(_SETTINGS))
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} under {prefix}; valid: {list(_SETTINGS)}")
    if not isinstance(ours.get("url"), str) or not ours["url"]:
        raise ConfigError(f'{prefix}url must name the store, e.g. "kv://127.0.0.1:7480"')
    return ours


def chunk_namespace(config: Any, metadata: Any, shapes: Any, dtypes: Any, fmt: Any,
                    salt: str) -> Namespace:  # fmt: skip
    """The namespace of this worker's chunks."""
    dtype = str(metadata.kv_dtype).removeprefix("torch.")
    layers, _, chunk, heads, head_size = metadata.kv_shape
    layout = (
        f"lmcache:{getattr(fmt, 'name', fmt)}:shapes={[tuple(s) for s in shapes]}"
        f":dtypes={[str(d) for d in dtypes]}:mla={int(bool(metadata.use_mla))}"
    )
    return Namespace(
        model=str(metadata.model_name),
        dtype=dtype if dtype in DTYPE_BYTES else "uint8",
        block_tokens=int(metadata.chunk_size),
        num_layers=int(layers),
        num_kv_heads=int(heads),
        head_size=int(head_size),
        layout=layout,
        tp_rank=int(metadata.worker_id),
        tp_size=int(metadata.world_size),
        hash_algo=f"lmcache:{config.pre_caching_hash_algorithm}",
        salt=salt,
    )


class KVOffloadRemoteConnector(RemoteConnector):
    """A LMCache `RemoteConnector` backed by a kvoffload store.

    Constructed by LMCache's `DynamicConnectorAdapter` as ``cls(loop=..., local_cpu_backend=...,
    config=...)``. The async methods run on LMCache's event loop thread; the store's blocking
    client runs on this connector's own threads so that loop never waits on the network.

    Raises:
        ConfigError: bad plugin settings.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any,
                 config: Any) -> None:  # fmt: skip
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        settings = _settings(config)
        threads = settings.get("io_threads", 8)
        if isinstance(threads, bool) or not isinstance(threads, int) or threads <= 0:
            raise ConfigError("io_threads must be a positive integer")
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.namespace = chunk_namespace(
            config,
            local_cpu_backend.metadata,
            self.meta_shapes,
            self.meta_dtypes,
            self.meta_fmt,
            str(settings.get("salt", "")),
        )
        self.client = Client.connect(block_store_url(settings["url"]), namespace=self.namespace)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvoffload-lmcache")

    def _hashes(self, keys: Sequence[Any]) -> list[BlockHash]:
        return engine_hashes(self.namespace, [key.to_string().encode() for key in keys])

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, partial(fn, *args))

    # -- lookups --------------------------------------------------------------------------

    async def exists(self, key: Any) -> bool:
        return bool(await self._run(self.exists_sync, key))

    def exists_sync(self, key: Any) -> bool:
        return self.client.exists(self._hashes([key])[0])

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[Any]) -> int:
        """How many leading chunks of `keys` the store holds, in one round trip."""
        return self.client.lookup(self._hashes(keys))

    async def batched_async_contains(self, lookup_id: str, keys: list[Any],
                                     pin: bool = False) -> int:  # fmt: skip
        return int(await self._run(self.batched_contains, keys))

    # -- reads ----------------------------------------------------------------------------

    def _read(self, key: BlockHash) -> Any:
        """One chunk into a buffer of LMCache's allocator, or None (miss, damaged, no
        memory). LMCache owns the returned object's reference."""
        obj = self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)
        if obj is None:
            log.warning("kvoffload: LMCache's allocator is full; chunk read as a miss")
            return None
        try:
            n = self.client.get_into(key, obj.byte_array.cast("B"))
        except KVOffloadError as exc:
            log.warning("kvoffload: reading chunk %s failed: %s", key[:16].hex(), exc)
            n = None
        if not n:
            obj.ref_count_down()
            return None
        try:
            return self.reshape_partial_chunk(obj, n)
        except ValueError as exc:  # a length no chunk of this layout can have
            log.warning("kvoffload: chunk %s has %d bytes: %s", key[:16].hex(), n, exc)
            obj.ref_count_down()
            return None

    async def get(self, key: Any) -> Any:
        return await self._run(self._read, self._hashes([key])[0])

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[Any]) -> list[Any]:
        return list(await asyncio.gather(*(self._run(self._read, h) for h in self._hashes(keys))))

    # -- writes ---------------------------------------------------------------------------

    def _write(self, hashes: list[BlockHash], objs: Sequence[Any]) -> None:
        # No ref_count_down here: LMCache's InstrumentedRemoteConnector releases the objects
        # once put returns (its base-class docstring says otherwise; it is wrong).
        items = [(h, obj.byte_array.cast("B")) for h, obj in zip(hashes, objs, strict=True)]
        self.client.put_many(items, parents=[None, *hashes[:-1]])

    async def put(self, key: Any, memory_obj: Any) -> None:
        await self._run(self._write, self._hashes([key]), [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[Any], memory_objs: list[Any]) -> None:
        await self._run(self._write, self._hashes(keys), memory_objs)

    # -- the rest -------------------------------------------------------------------------

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        try:
            await self._run(self.client.stats)
        except KVOffloadError as exc:
            log.warning("kvoffload: ping failed: %s", exc)
            return 1
        return 0

    def remove_sync(self, key: Any) -> bool:
        return self.client.delete(self._hashes([key])[0])

    async def list(self) -> list[str]:
        # The store keeps hashed keys, not LMCache's key strings: there is nothing to list.
        return []

    async def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.client.close()
