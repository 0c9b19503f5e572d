"""The storage engine: keys to slots, DRAM arena, eviction policies, stats.

No sockets and no asyncio here; the daemon and the SDK drive the engine.
"""

from kvoffload.kvstore.config import (
    PAGE,
    DramConfig,
    EngineConfig,
    SsdConfig,
    format_size,
    parse_size,
)
from kvoffload.kvstore.engine import (
    KEY_BYTES,
    MAX_META_BYTES,
    BlockView,
    DescribedBlock,
    DescribedTable,
    Engine,
    EngineStats,
    HotHandles,
    PutReservation,
    Recovery,
    TierStats,
)
from kvoffload.kvstore.eviction import POLICIES, EvictionPolicy, Rank, make_policy, register_policy
from kvoffload.kvstore.policies import ReusePolicy

__all__ = [
    "KEY_BYTES",
    "MAX_META_BYTES",
    "PAGE",
    "POLICIES",
    "PutReservation",
    "Recovery",
    "SsdConfig",
    "BlockView",
    "DescribedBlock",
    "DescribedTable",
    "DramConfig",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "EvictionPolicy",
    "HotHandles",
    "Rank",
    "ReusePolicy",
    "TierStats",
    "format_size",
    "make_policy",
    "parse_size",
    "register_policy",
]
