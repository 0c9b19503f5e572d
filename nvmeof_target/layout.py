"""A node's shard layout on disk and each worker's share of its config (`serve --workers N`).

The layout file pins the shard count of a data directory: a store written by N workers is
only ever opened by N (each shard holds the keys `wire.shards.shard_of` assigns it).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from kvoffload.errors import ConfigError
from kvoffload.nvmeof_target.config import Config

__all__ = ["LAYOUT_FILE", "shard_config", "shard_count", "write_layout"]

LAYOUT_FILE = "shards.json"
_STORE_FILES = ("kvoffload.meta", "ssd.slots", "checkpoint")


def shard_count(config: Config) -> int:
    """The number of workers: the configured count, or for 0 ("auto") the layout an existing
    store was made with, else one per core.

    Raises:
        ConfigError: the data directory holds a store made with another count.
    """
    made = _layout(config)
    wanted = config.server.workers
    if wanted == 0:
        if made > 1:
            _check_shards(config, made)
        return made or len(os.sched_getaffinity(0))
    if made > 1:
        _check_shards(config, made)
    if made and made != wanted:
        raise ConfigError(
            f"{config.data_dir} holds a store of {made} shard(s); run it with --workers {made} "
            f"(or 0 for the store's own count), or give a new --data-dir"
        )
    return wanted


def _has_store(config: Config) -> bool:
    return config.ssd.capacity_bytes > 0 and not config.ssd.path


def _layout(config: Config) -> int:
    """Shards of the store in the data directory: 0 when there is none yet, 1 for a
    single-process store."""
    if not _has_store(config):
        return 0
    root = Path(config.data_dir)
    layout = root / LAYOUT_FILE
    try:
        text = layout.read_text()
    except FileNotFoundError:
        return 1 if _holds_store(root) else 0
    except OSError as exc:
        raise ConfigError(f"cannot read {layout}: {exc.strerror}") from None
    try:
        count = json.loads(text)["shards"]
    except (ValueError, KeyError, TypeError):
        count = None
    if not isinstance(count, int) or not 1 < count <= 256:
        raise ConfigError(f'{layout} is damaged (expected {{"shards": N}}, got {text[:80]!r})')
    return count


def _holds_store(root: Path) -> bool:
    """A one-process store's own files (a fresh mount's lost+found is not a store)."""
    return any((root / name).exists() for name in _STORE_FILES) or any(root.glob("journal.*"))


def _check_shards(config: Config, count: int) -> None:
    """Every shard of an existing multi-worker store is there: a missing one would quietly
    come back empty."""
    root = Path(config.data_dir)
    present = [i for i in range(count) if (root / f"shard-{i}").exists()]
    if present and len(present) != count:
        missing = sorted(set(range(count)) - set(present))
        raise ConfigError(
            f"{root} holds a store of {count} shards but shard-{missing[0]} is missing "
            "(restore it, or start a new store in another --data-dir)"
        )


def write_layout(config: Config, count: int) -> None:
    if not _has_store(config) or _layout(config) == count:
        return
    root = Path(config.data_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / (LAYOUT_FILE + ".tmp")
    tmp.write_text(json.dumps({"shards": count}) + "\n")
    os.replace(tmp, root / LAYOUT_FILE)


def shard_config(config: Config, index: int, count: int) -> Config:
    """Worker `index`'s own config: its share of the capacities and quotas, its own data
    directory and NVMe subsystem, no metrics endpoint (the supervisor serves the node's).

    Raises:
        ConfigError: a share is too small to work (e.g. DRAM below one largest value).
    """
    if config.ssd.path and config.ssd.capacity_bytes:
        raise ConfigError("ssd.path (one file or device) cannot be split over several workers")

    def share(size: int) -> int:
        return 0 if size == 0 else max(1, size // count)

    def share_pages(size: int) -> int:
        return 0 if size == 0 else max(4096, size // count // 4096 * 4096)

    nvme = config.nvme
    nvme = replace(
        nvme,
        port=nvme.port + index if nvme.port else 0,
        subnqn=f"{nvme.subnqn}.shard{index}",
        subsystems=tuple(replace(s, nqn=f"{s.nqn}.shard{index}") for s in nvme.subsystems),
    )
    tenants = tuple(
        replace(t, quota_bytes=share(t.quota_bytes), ssd_quota_bytes=share(t.ssd_quota_bytes))
        for t in config.tenants
    )
    try:
        # The node's largest value stays what it would be with one worker: clients see the
        # same limit whatever the worker count.
        dram = replace(
            config.dram,
            capacity_bytes=share_pages(config.dram.capacity_bytes),
            max_value_bytes=config.dram.effective_max_value_bytes,
        )
    except ConfigError as exc:
        raise ConfigError(f"with {count} workers each gets 1/{count} of the DRAM: {exc}") from None
    return replace(
        config,
        server=replace(config.server, workers=1),
        # The supervisor registers the node; a worker keeps `etcd` to know it is a cluster
        # node's shard (it drops its blocks at start: server.py).
        nvme=nvme,
        metrics=replace(config.metrics, enabled=False),
        dram=dram,
        ssd=replace(config.ssd, capacity_bytes=share_pages(config.ssd.capacity_bytes)),
        data_dir=os.path.join(config.data_dir, f"shard-{index}"),
        tenants=tenants,
    )
