"""The SSD tier: a preallocated slot file, its compact index, the journal and checkpoints that
make the index survive crashes, and `fsck` (`kvoffload.kvstore.ssd.fsck`).

Nothing here knows about DRAM; the engine calls the tier's coarse operations under its lock.
"""

from kvoffload.kvstore.ssd.index import EMPTY, SsdIndex, ssd_slot_bytes, ssd_slot_sizes
from kvoffload.kvstore.ssd.tier import META_NAME, Recovery, SsdTier, WritePlan

__all__ = [
    "EMPTY",
    "META_NAME",
    "Recovery",
    "SsdIndex",
    "SsdTier",
    "WritePlan",
    "ssd_slot_bytes",
    "ssd_slot_sizes",
]
