"""`local://`: the engine runs inside the caller's process; no daemon, no extra copies."""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.client_sdk.transports.base import HeldBlock, PutItem, Received
from kvoffload.client_sdk.url import StoreURL
from kvoffload.errors import ConfigError
from kvoffload.kvstore import DramConfig, Engine, EngineConfig, SsdConfig, parse_size
from kvoffload.wire.tiers import TierRun

__all__ = ["LocalTransport", "open_local"]

_PARAMS = {
    "dram": "DRAM arena size, e.g. 1GiB",
    "max_value": "largest stored value, e.g. 64MiB",
    "slab": "slab size",
    "policy": "eviction policy: lru, s3fifo, prefix or reuse (DRAM only)",
    "prefault": "populate the arena at start: 1 or 0",
    "ssd": "SSD tier size, e.g. 8GiB (needs a directory: local:///path?ssd=...)",
    "ssd_path": "file or block device for the SSD slots (default: <dir>/ssd.slots)",
    "ssd_policy": "SSD eviction policy: lru, s3fifo or prefix (default: the DRAM one, else lru)",
    "admit": "uses before a block evicted from DRAM is written to the SSD (1 = all)",
}
_BOOL = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def engine_config_from_url(url: StoreURL) -> EngineConfig:
    """Build the engine config from `local://` query parameters.

    Raises:
        ConfigError: unknown parameter or bad value.
    """
    params = url.take(_PARAMS)
    kwargs: dict[str, object] = {}
    if "dram" in params:
        kwargs["capacity_bytes"] = parse_size(params["dram"])
    if "max_value" in params:
        kwargs["max_value_bytes"] = parse_size(params["max_value"])
    if "slab" in params:
        kwargs["slab_bytes"] = parse_size(params["slab"])
    if "policy" in params:
        kwargs["policy"] = params["policy"]
    if "prefault" in params:
        if params["prefault"].lower() not in _BOOL:
            raise ConfigError(f"prefault must be 1 or 0, got {params['prefault']!r}")
        kwargs["prefault"] = _BOOL[params["prefault"].lower()]
    ssd: dict[str, object] = {}
    if "ssd" in params:
        ssd["capacity_bytes"] = parse_size(params["ssd"])
    if "ssd_path" in params:
        ssd["path"] = params["ssd_path"]
    if "ssd_policy" in params:
        ssd["policy"] = params["ssd_policy"]
    if "admit" in params:
        if not params["admit"].isdigit():
            raise ConfigError(f"admit must be a positive integer, got {params['admit']!r}")
        ssd["admission_min_uses"] = int(params["admit"])
    return EngineConfig(
        dram=DramConfig(**kwargs),  # type: ignore[arg-type]
        ssd=SsdConfig(**ssd),  # type: ignore[arg-type]
        data_dir=url.path if url.path not in ("", "/") else "",
    )


class LocalTransport:
    """Adapts an in-process `Engine` to the `Transport` protocol."""

    # Index calls answer from memory in microseconds: the async API runs them inline.
    index_inline = True

    def __init__(self, engine: Engine, *, owned: bool = True) -> None:
        self.engine = engine
        self._owned = owned

    @property
    def hold_window(self) -> int:
        """The most blocks of a batched get the client holds at once: held blocks pin the
        engine's memory (`Engine.hold_window`)."""
        return self.engine.hold_window

    @property
    def max_value_bytes(self) -> int:
        return self.engine.max_value_bytes

    def put(
        self,
        key: bytes,
        parts: Sequence[object],
        parent: bytes | None,
        durable: bool = False,
        meta: bytes | None = None,
    ) -> None:
        self.engine.put_parts(key, parts, parent=parent, durable=durable, meta=meta)

    def put_many(self, items: Sequence[PutItem], durable: bool = False) -> None:
        for key, parts, parent, meta in items:
            self.engine.put_parts(key, parts, parent=parent, durable=durable, meta=meta)

    def get(self, key: bytes) -> HeldBlock | None:
        return self.engine.get(key)

    def get_into(self, key: bytes, buffer: memoryview) -> HeldBlock | Received | None:
        # The block is verified in the arena before a byte is copied to the caller.
        return self.engine.get(key)

    def get_many(self, keys: Sequence[bytes]) -> list[HeldBlock | None]:
        return list(self.engine.get_many(keys))

    def get_many_into(
        self, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> list[HeldBlock | Received | None]:
        return list(self.engine.get_many(keys))  # verified in the arena, as for get_into

    def exists(self, key: bytes) -> bool:
        return self.engine.contains(key)

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        contains = self.engine.contains
        return [contains(key) for key in keys]

    def lookup(self, keys: Sequence[bytes]) -> int:
        return self.engine.lookup(keys)

    def lookup_tiers(self, keys: Sequence[bytes]) -> TierRun:
        where: list[str] = []
        self.engine.lookup(keys, where)
        return TierRun.from_names(where)

    def prefetch(self, keys: Sequence[bytes]) -> int:
        return self.engine.prefetch(keys)

    def delete(self, key: bytes) -> bool:
        return self.engine.delete(key)

    def stats(self) -> dict[str, object]:
        return self.engine.stats().as_dict()

    def close(self) -> None:
        if self._owned:
            self.engine.close()


def open_local(url: StoreURL) -> LocalTransport:
    """Open `local:///dir?dram=1GiB&ssd=8GiB`. The directory holds the SSD tier, its journal
    and checkpoints; a store already there is reopened (with its own SSD size when `ssd` is not
    given). Without `ssd` and without a store in the directory, the store is DRAM-only."""
    if url.host:
        raise ConfigError(
            f"local:// URLs take a path, not a host ({url.host!r}); write local:///{url.host}"
            f"{url.path}"
        )
    return LocalTransport(Engine(engine_config_from_url(url)))
