"""The SSD tier's block metadata: per key, the packed META journal records of its SSD copy.

Kept packed (CRCs filled in) because a checkpoint copies them as they are, and reading one back
is a slice and a join. Bookkeeping only; the catalog calls it under the engine's lock.
"""

from __future__ import annotations

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

    def install(self, records: npt.NDArray[np.void], puts: npt.NDArray[np.void]) -> None:
        """Keep the META records of `puts`, the PUT records an open (or fsck) kept: a META
        record belongs to the PUT of its seq (a seq names one change) and must name its key.

        One numpy pass over all records, no per-block Python: a store of millions of blocks
        opens with it."""
        metas = np.flatnonzero(records["type"] == jr.META)
        if not len(metas) or not len(puts):
            return
        seq = records["seq"][metas]
        by_seq = np.argsort(puts["seq"], kind="stable")
        put_seqs = puts["seq"][by_seq]
        at = np.minimum(np.searchsorted(put_seqs, seq), len(put_seqs) - 1)
        owner = by_seq[at]
        mine = (put_seqs[at] == seq) & (puts["key"][owner] == records["key"][metas])
        metas, owner = metas[mine], owner[mine]
        if not len(metas):
            return
        part = records["tenant"][metas].astype(np.int64)  # a META record's slice number
        order = np.argsort((owner.astype(np.int64) << 16) | part, kind="stable")
        metas, owner, part = metas[order], owner[order], part[order]
        first = np.ones(len(metas), bool)
        first[1:] = owner[1:] != owner[:-1]
        starts = np.flatnonzero(first)
        counts = np.diff(np.append(starts, len(metas)))
        # Whole records as opaque 128-byte items (copies through the record's fields are
        # slower), and as bytes for the length field.
        items = np.ascontiguousarray(records).view(f"V{jr.RECORD_BYTES}")
        head = items[metas[starts]].view(np.uint8).reshape(-1, jr.RECORD_BYTES)
        declared = head[:, 32].astype(np.int64) | (head[:, 33].astype(np.int64) << 8)
        # Records each block's declared length needs, each slice once and in order: a block
        # missing some (a damaged file read by fsck) keeps no metadata rather than a cut one.
        need = -(-(declared + 2) // jr.META_SLICE)
        in_order = part == np.arange(len(metas)) - np.repeat(starts, counts)
        whole = (counts == need) & np.logical_and.reduceat(in_order, starts)
        keys = np.ascontiguousarray(records["key"][metas[starts]]).view("V16")
        for n in np.unique(counts[whole]).tolist():  # one pass per record count (usually one)
            sel = whole & (counts == n)
            pick = metas[(starts[sel][:, None] + np.arange(n)).ravel()]
            values = items[pick].view(f"V{n * jr.RECORD_BYTES}")
            self.packed.update(zip(keys[sel].tolist(), values.tolist(), strict=True))
