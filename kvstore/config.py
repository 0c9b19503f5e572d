"""Engine configuration: frozen dataclasses, validated on construction, plus size parsing."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvoffload.errors import ConfigError
from kvoffload.kvstore.eviction import POLICIES

# Policies the SSD tier implements over its own row arrays (kvstore/ssd/index.py); the others
# (e.g. "reuse") order DRAM only.
SSD_POLICIES = ("lru", "s3fifo", "prefix")

__all__ = ["PAGE", "DramConfig", "EngineConfig", "SsdConfig", "format_size", "parse_size"]

PAGE = 4096

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1 << 10,
    "kib": 1 << 10,
    "mi": 1 << 20,
    "mib": 1 << 20,
    "gi": 1 << 30,
    "gib": 1 << 30,
    "ti": 1 << 40,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse ``"1GiB"``, ``"512MiB"``, ``"4096"`` or an int into a byte count.

    Raises:
        ConfigError: the text is not a non-negative size with a known unit.
    """
    if isinstance(text, bool):
        raise ConfigError(f"size must be a number of bytes or a string like '1GiB', not {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"size must not be negative, got {text}")
        return text
    match = _SIZE_RE.match(text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ConfigError(
            f"cannot parse size {text!r}: use a number with an optional unit "
            "(B, KiB, MiB, GiB, TiB, or KB, MB, GB, TB), e.g. '1GiB'"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_size(n: int) -> str:
    """Render a byte count the way `parse_size` reads it back (``"1.5 GiB"``)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


# Whether NIXL is installed is checked when the store opens (kvstore.ssd.nixl_io).
_IO_BACKENDS = ("auto", "posix", "kvikio", "nixl-posix", "nixl-gds")
# Whether io_uring runs here is probed when the store opens (kvoffload.core).
_IO_ENGINES = ("auto", "io_uring", "threads")


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class DramConfig:
    """The DRAM tier: one preallocated arena of page-aligned slots as large as their values."""

    # Arena size in bytes; a hard bound on what the tier holds (slot sizes included).
    capacity_bytes: int = 1 << 30
    # Largest value the tier accepts (what the engine sees, i.e. header plus payload);
    # 0 derives it from the capacity: a sixteenth of it, clamped to [1 MiB, 64 MiB].
    max_value_bytes: int = 0
    # Ignored: the tier has had no slabs since its extent allocator (kept so older config
    # files still load; the engine logs a warning when it is set).
    slab_bytes: int = 0
    # Eviction policy name: "lru", "s3fifo", "prefix" or "reuse" (see kvstore.eviction.POLICIES).
    policy: str = "lru"
    # Touch every page at start so that the first puts do not pay for page faults.
    prefault: bool = True
    # Ignored, as slab_bytes: there are no size classes.
    class_growth: float = 1.05
    # With an SSD tier, a background writer keeps free DRAM ahead of demand: once less than
    # `demote_low` of the capacity is free it evicts in policy order (writing blocks down)
    # until `demote_high` is free, so requests seldom evict and never write. False demotes on
    # the request's own thread, as before issue 30 (kept for comparison; docs/design/ssd-tier.md).
    demote_background: bool = True
    demote_low: float = 0.05
    demote_high: float = 0.10

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ConfigError(f"dram.capacity_bytes must be positive, got {self.capacity_bytes}")
        if self.max_value_bytes < 0:
            raise ConfigError(
                f"dram.max_value_bytes must not be negative, got {self.max_value_bytes}"
            )
        if self.capacity_bytes < _round_up(self.effective_max_value_bytes, PAGE):
            raise ConfigError(
                f"dram capacity {format_size(self.capacity_bytes)} cannot hold one largest value "
                f"({format_size(self.effective_max_value_bytes)}); raise the capacity or lower "
                "max_value_bytes"
            )
        if self.policy not in POLICIES:
            raise ConfigError(
                f"unknown eviction policy {self.policy!r}; choose one of {sorted(POLICIES)}"
            )
        if not isinstance(self.demote_background, bool):
            raise ConfigError(
                f"dram.demote_background must be true or false, got {self.demote_background!r}"
            )
        for name in ("demote_low", "demote_high"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"dram.{name} must be a fraction of the capacity, got {value!r}")
            if not 0 <= value <= 0.5:
                raise ConfigError(
                    f"dram.{name} must be in [0, 0.5] (a fraction of dram.capacity_bytes kept "
                    f"free), got {value}"
                )
        if self.demote_low > self.demote_high:
            raise ConfigError(
                f"dram.demote_low ({self.demote_low}) must not exceed dram.demote_high "
                f"({self.demote_high}): the writer starts below low and stops at high"
            )

    @property
    def effective_max_value_bytes(self) -> int:
        if self.max_value_bytes:
            return self.max_value_bytes
        return min(64 << 20, max(1 << 20, _round_up(self.capacity_bytes // 16, PAGE)))


@dataclass(frozen=True)
class SsdConfig:
    """The SSD tier: one preallocated file (or block device) of 4 KiB-aligned slots."""

    # Bytes of SSD space; 0 disables the tier.
    capacity_bytes: int = 0
    # File or raw block device holding the slots; "" puts `ssd.slots` in the data directory.
    path: str = ""
    # Eviction policy of the SSD tier, one of SSD_POLICIES; "" uses the DRAM tier's where the
    # SSD tier has it, else "lru" (see EngineConfig.ssd_policy).
    policy: str = ""
    # Largest value the tier holds; fixed when the store is created (recorded on disk).
    # 0 takes the DRAM tier's limit.
    max_value_bytes: int = 0
    # A block evicted from DRAM is written to the SSD once it was used this many times (puts,
    # lookups and reads count); 1 admits every block. Durable puts always go to the SSD. 1 by
    # default: KV blocks are mostly put once and wanted later, and a block dropped at its first
    # eviction misses when its prefix comes back; 2 spares SSD wear (docs/design/ssd-tier.md).
    admission_min_uses: int = 1
    # Threads for background promotions (prefetch) from the SSD.
    io_threads: int = 4
    # Slot reads of one batched get (`get_many`, `get_many_into`) in flight at once: each on a
    # thread of its own (io_engine "threads": preadv releases the GIL), or in one io_uring
    # submission; 1 reads a batch's blocks one by one on threads. On io_uring it is also the
    # most demotions the background writer puts in one submission (a ring's depth).
    read_depth: int = 8
    # Longest time close() waits for SSD reads in flight; a read still hung then leaves its
    # memory mapped (leaked) and close raises StorageIOError (docs/design/ssd-tier.md).
    close_wait_s: float = 10.0
    # Longest time a journal record of a non-durable change waits for its fsync.
    sync_interval_s: float = 0.05
    # On a clean close, write every DRAM block that is not on the SSD yet (so a restart keeps it).
    flush_on_close: bool = True
    # Slot I/O: "posix" (O_DIRECT preadv/pwritev on the calling threads), "kvikio" (GPUDirect
    # Storage), "auto" (kvikio when it is installed and a CUDA device is present), or through
    # NIXL (an optional install): "nixl-posix" (its POSIX backend) or "nixl-gds" (its GDS one).
    io_backend: str = "auto"
    # The kernel queue of "nixl-posix": "aio" (Linux AIO, NIXL's default) or "uring" (io_uring).
    nixl_queue: str = "aio"
    # How the "posix" backend moves slots: "io_uring" (the C core's ring: a batched get's reads
    # in one submission, a batch of demotions one, each other slot write one), "threads"
    # (preadv/pwritev on the calling and read-pool threads), or "auto" (io_uring where the
    # kernel allows it, else threads; docs/design/ssd-tier.md).
    io_engine: str = "auto"
    # On io_uring: register the slot file with each ring (fixed file) and the DRAM arena's memory
    # (its pages pinned once, shared by the tier's rings on Linux 6.12+); what the kernel refuses
    # runs unregistered. false: plain descriptors and addresses (docs/design/ssd-tier.md).
    ring_register: bool = True

    def __post_init__(self) -> None:
        if self.capacity_bytes < 0:
            raise ConfigError(f"ssd.capacity_bytes must not be negative, got {self.capacity_bytes}")
        if self.policy and self.policy not in SSD_POLICIES:
            raise ConfigError(
                f"unknown ssd.policy {self.policy!r}; the SSD tier has {list(SSD_POLICIES)}"
            )
        if self.max_value_bytes < 0:
            raise ConfigError("ssd.max_value_bytes must not be negative")
        if self.admission_min_uses < 1:
            raise ConfigError("ssd.admission_min_uses must be at least 1")
        if self.io_threads < 1:
            raise ConfigError("ssd.io_threads must be at least 1")
        if not 1 <= self.read_depth <= 256:
            raise ConfigError(f"ssd.read_depth must be in [1, 256], got {self.read_depth}")
        if self.io_backend not in _IO_BACKENDS:
            raise ConfigError(
                f"ssd.io_backend must be one of {', '.join(map(repr, _IO_BACKENDS))}, got "
                f"{self.io_backend!r}"
            )
        if self.io_engine not in _IO_ENGINES:
            raise ConfigError(
                f"ssd.io_engine must be one of {', '.join(map(repr, _IO_ENGINES))}, got "
                f"{self.io_engine!r}"
            )
        if not isinstance(self.ring_register, bool):
            raise ConfigError(
                f"ssd.ring_register must be true or false, got {self.ring_register!r}"
            )
        if self.nixl_queue not in ("aio", "uring"):
            raise ConfigError(f"ssd.nixl_queue must be 'aio' or 'uring', got {self.nixl_queue!r}")
        if not 0 < self.close_wait_s <= 3600:
            raise ConfigError(f"ssd.close_wait_s must be in (0, 3600], got {self.close_wait_s}")
        if not 0 < self.sync_interval_s <= 10:
            raise ConfigError("ssd.sync_interval_s must be in (0, 10]")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs; the daemon's config tree embeds it."""

    dram: DramConfig = DramConfig()
    ssd: SsdConfig = SsdConfig()
    # Directory for the SSD tier, its journal and checkpoints; "" for a DRAM-only store.
    data_dir: str = ""

    @property
    def ssd_policy(self) -> str:
        """The SSD tier's policy: its own, else the DRAM tier's where the SSD tier has that one,
        else LRU (a DRAM-only policy such as "reuse" must not fail a store with an SSD)."""
        if self.ssd.policy:
            return self.ssd.policy
        return self.dram.policy if self.dram.policy in SSD_POLICIES else "lru"

    def __post_init__(self) -> None:
        if self.ssd.capacity_bytes and not self.data_dir:
            raise ConfigError("the SSD tier needs a data directory (data_dir)")
        if (
            self.ssd.max_value_bytes
            and self.dram.effective_max_value_bytes > self.ssd.max_value_bytes
        ):
            raise ConfigError(
                f"dram.max_value_bytes ({self.dram.effective_max_value_bytes}) exceeds "
                f"ssd.max_value_bytes ({self.ssd.max_value_bytes}): DRAM blocks must fit on SSD"
            )
