"""The SSD tier's block metadata: per key, the packed META journal records of its SSD copy.

Kept packed (CRCs filled in) because a checkpoint copies them as they are, and reading one back
is a slice and a join. Bookkeeping only; the catalog calls it under the engine's lock.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from kvoffload.kvstore.ssd import journal as jr

__all__ = ["MetaBook"]


class MetaBook:
    """Key -> packed META records, for SSD blocks stored with metadata."""

    def __init__(self) -> None:
        self.packed: dict[bytes, bytes] = {}

    def __len__(self) -> int:
        return len(self.packed)

    def records(self, key: bytes, seq: int, meta: bytes | None) -> bytes:
        """The META records to journal before the PUT of `key` at `seq` (b"" without)."""
        return jr.meta_records(key, seq, meta) if meta else b""

    def set(self, key: bytes, packed: bytes | None) -> None:
        """The key's SSD copy is now the one `packed` describes (None: no metadata)."""
        if packed:
            self.packed[key] = packed
        else:
            self.packed.pop(key, None)

    def drop(self, key: bytes) -> None:
        self.packed.pop(key, None)

    def get(self, key: bytes) -> bytes | None:
        """The metadata of the key's SSD copy, if it was stored with some."""
        packed = self.packed.get(key)
        return None if packed is None else jr.meta_of_records(packed)

    def export(self) -> npt.NDArray[np.void]:
        """Every block's META records (for a checkpoint)."""
        return np.frombuffer(b"".join(self.packed.values()), dtype=jr.RECORD)

    def install(self, records: npt.NDArray[np.void], seqs: npt.NDArray[np.uint64],
                stored: Callable[[bytes], bool]) -> None:  # fmt: skip
        """Keep the META records of the PUTs that won a replay (a seq names one change) whose
        key is `stored` (rows refused at open keep no metadata)."""
        metas = np.flatnonzero(records["type"] == jr.META)
        metas = metas[np.isin(records["seq"][metas], seqs)]
        if not len(metas):
            return
        part = records["tenant"][metas]  # a META record's slice number
        order = np.lexsort((part, records["seq"][metas]))
        metas, part = metas[order], part[order]
        raw = records[metas].tobytes()
        starts = np.flatnonzero(part == 0)
        ends = np.append(starts[1:], len(metas))
        keys = records["key"][metas[starts]]
        # Records each block's declared length needs: a block missing some (a damaged file
        # read by fsck) keeps no metadata rather than a cut one.
        heads = np.frombuffer(raw, np.uint8).reshape(-1, jr.RECORD_BYTES)[starts, 32:34]
        declared = heads.copy().view("<u2")[:, 0].astype(np.int64)
        need = -(-(declared + 2) // jr.META_SLICE)
        for key, start, end, wanted in zip(keys.tolist(), starts.tolist(), ends.tolist(),
                                           need.tolist(), strict=True):  # fmt: skip
            key = key.ljust(16, b"\0")  # numpy drops trailing NULs of an S16 value
            if end - start == wanted and stored(key):
                self.packed[key] = raw[start * jr.RECORD_BYTES : end * jr.RECORD_BYTES]
