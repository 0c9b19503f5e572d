"""The SSD tier's block metadata: per key, the packed META journal records of its SSD copy.

Kept packed (CRCs filled in) because a checkpoint copies them as they are, and reading one back
is a slice and a join. Bookkeeping only; the catalog calls it under the engine's lock.

What an open installs stays in numpy arrays (`_Base`: the records, and the keys sorted by their
hash for lookups), and only later changes go into a dict: a restart of millions of blocks then
makes no Python object per block, and a listing copies one mask instead of the whole book.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

import kvoffload.kvstore.ssd.journal as jr
from kvoffload.kvstore.ssd.keyhash import hash_key, hash_keys

__all__ = ["MetaBook", "MetaSnapshot"]

_ITEM = f"V{jr.RECORD_BYTES}"  # a record as an opaque item


@dataclass(frozen=True)
class _Base:
    """Blocks installed by an open, read-only but for `alive` (cleared when a key changes).
    Entries are in the order of their records in the files read (a sequential copy)."""

    keys: npt.NDArray[np.void]  # V16, entry i's key
    items: npt.NDArray[np.void]  # every entry's records, entry after entry
    first: npt.NDArray[np.int64]  # entry i's records are items[first[i] : first[i] + count[i]]
    count: npt.NDArray[np.int64]
    alive: npt.NDArray[np.bool_]
    hashes: npt.NDArray[np.uint64]  # the keys' hashes, sorted (for lookups)
    by_hash: npt.NDArray[np.int64]  # the entry of each of `hashes`


def _empty_base() -> _Base:
    none = np.zeros(0, np.int64)
    return _Base(np.zeros(0, "V16"), np.zeros(0, _ITEM), none, none, np.zeros(0, bool),
                 np.zeros(0, np.uint64), none)  # fmt: skip


@dataclass(frozen=True)
class MetaSnapshot:
    """The book at one moment (`MetaBook.snapshot`): read it without the lock."""

    base: _Base
    alive: npt.NDArray[np.bool_]
    keys: list[bytes]  # changed since the open
    packed: list[bytes]

    def records(self) -> tuple[list[bytes], npt.NDArray[np.uint8], npt.NDArray[np.int64]]:
        """Every block's key, all their META records as (n, 128) bytes, block by block in
        part order, and where each block's records start."""
        base, alive = self.base, self.alive
        keys = base.keys[alive].tolist() + self.keys
        rows = np.repeat(alive, base.count)
        extra = np.frombuffer(b"".join(self.packed), _ITEM)
        items = np.concatenate([base.items[rows], extra])
        counts = np.concatenate([base.count[alive],
                                 np.fromiter(map(len, self.packed), np.int64, len(self.packed))
                                 // jr.RECORD_BYTES])  # fmt: skip
        first = np.zeros(len(counts), np.int64)
        np.cumsum(counts[:-1], out=first[1:])
        return keys, items.view(np.uint8).reshape(-1, jr.RECORD_BYTES), first


class MetaBook:
    """Key -> packed META records, for SSD blocks stored with metadata."""

    def __init__(self) -> None:
        self._base = _empty_base()
        self._base_live = 0
        self._changed: dict[bytes, bytes] = {}  # since the open; never a key alive in the base

    def __len__(self) -> int:
        return self._base_live + len(self._changed)

    def records(self, key: bytes, seq: int, meta: bytes | None) -> bytes:
        """The META records to journal before the PUT of `key` at `seq` (b"" without)."""
        return jr.meta_records(key, seq, meta) if meta else b""

    def _find(self, key: bytes) -> int:
        """The base entry of `key` while it is alive, else -1."""
        base = self._base
        h = hash_key(key)
        i = int(np.searchsorted(base.hashes, np.uint64(h)))
        while i < len(base.hashes) and int(base.hashes[i]) == h:
            entry = int(base.by_hash[i])
            if base.alive[entry] and base.keys[entry].tobytes() == key:
                return entry
            i += 1
        return -1

    def _forget_base(self, key: bytes) -> None:
        if self._base_live:
            i = self._find(key)
            if i >= 0:
                self._base.alive[i] = False
                self._base_live -= 1

    def set(self, key: bytes, packed: bytes | None) -> None:
        """The key's SSD copy is now the one `packed` describes (None: no metadata)."""
        self._forget_base(key)
        if packed:
            self._changed[key] = packed
        else:
            self._changed.pop(key, None)

    def drop(self, key: bytes) -> None:
        self._forget_base(key)
        self._changed.pop(key, None)

    def packed(self, key: bytes) -> bytes | None:
        """The key's META records, if its SSD copy has metadata."""
        found = self._changed.get(key)
        if found is None and self._base_live:
            i = self._find(key)
            if i >= 0:
                base = self._base
                found = base.items[base.first[i] : base.first[i] + base.count[i]].tobytes()
        return found

    def get(self, key: bytes) -> bytes | None:
        """The metadata of the key's SSD copy, if it was stored with some."""
        packed = self.packed(key)
        return None if packed is None else jr.meta_of_records(packed)

    def snapshot(self) -> MetaSnapshot:
        """The book as it is now, to read after the lock is released: a copy of the base's
        mask and of the changed entries (C-level list copies), nothing per base block."""
        changed = self._changed
        return MetaSnapshot(self._base, self._base.alive.copy(), list(changed),
                            list(changed.values()))  # fmt: skip

    def export(self) -> npt.NDArray[np.void]:
        """Every block's META records (for a checkpoint)."""
        _, rows, _ = self.snapshot().records()
        return rows.reshape(-1).view(jr.RECORD)

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
        new_owner = np.ones(len(metas), bool)
        new_owner[1:] = owner[1:] != owner[:-1]
        starts = np.flatnonzero(new_owner)
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
        # The whole blocks become the base, in the order of their records in the files (so
        # that copying the records is sequential), with their hashes sorted for lookups.
        starts, counts = starts[whole], counts[whole]
        in_file = np.argsort(metas[starts], kind="stable")
        starts, counts = starts[in_file], counts[in_file]
        first = np.zeros(len(counts), np.int64)
        np.cumsum(counts[:-1], out=first[1:])
        pick = np.repeat(starts - first, counts) + np.arange(int(counts.sum()))
        keys = np.ascontiguousarray(records["key"][metas[starts]])
        hashes = hash_keys(keys)
        by_hash = np.argsort(hashes, kind="stable")
        self._base = _Base(keys.view("V16"), items[metas[pick]], first, counts,
                           np.ones(len(counts), bool), hashes[by_hash], by_hash)  # fmt: skip
        self._base_live = len(counts)
        self._changed = {}
