"""Listing the stored blocks that have metadata (`Engine.described_table`), for a daemon that
announces what a restarted store holds.

A store may hold millions of such blocks, and every request waits for the engine's lock while
they are listed. So the lock is held only to take the books as they are (the SSD metadata book's
snapshot: a copy of one mask and of the entries changed since the open; the index's tenant
column when there are tenants; the few DRAM entries with metadata); joining the metadata and
finding tenants and tiers runs after the lock is released, in numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

import kvoffload.kvstore.ssd.journal as jr
from kvoffload.kvstore.manager import Manager
from kvoffload.kvstore.ssd.metabook import MetaSnapshot
from kvoffload.kvstore.ssd.tier import SsdTier

__all__ = ["DRAM", "SSD", "DescribedBlock", "DescribedTable", "Listing", "take_listing"]

SSD, DRAM = 1, 2  # bits of `DescribedTable.tiers`
_TIERS = {SSD: ("ssd",), DRAM: ("dram",), SSD | DRAM: ("ssd", "dram")}


@dataclass(frozen=True, slots=True)
class DescribedBlock:
    """A stored block that has metadata (`Engine.described_blocks`)."""

    key: bytes
    tenant: str
    meta: bytes
    tiers: tuple[str, ...]  # "ssd" and/or "dram", SSD first (a durable put's order)


@dataclass(frozen=True)
class DescribedTable:
    """Stored blocks with metadata, as arrays: block i is `keys[i]`, of tenant
    `tenants[tenant[i]]`, its metadata `meta[starts[i] : starts[i] + lengths[i]]`, held in the
    tiers whose bits (`SSD`, `DRAM`) `tiers[i]` sets."""

    keys: list[bytes]
    tenants: list[str]
    tenant: npt.NDArray[np.int64]
    meta: npt.NDArray[np.uint8]  # every block's metadata, joined (with gaps)
    starts: npt.NDArray[np.int64]
    lengths: npt.NDArray[np.int64]
    tiers: npt.NDArray[np.uint8]

    def __len__(self) -> int:
        return len(self.keys)

    def blocks(self) -> list[DescribedBlock]:
        """One `DescribedBlock` per block (per-block objects: for small listings)."""
        return [
            DescribedBlock(key, self.tenants[t], self.meta[s : s + n].tobytes(), _TIERS[b])
            for key, t, s, n, b in zip(self.keys, self.tenant.tolist(), self.starts.tolist(),
                                       self.lengths.tolist(), self.tiers.tolist(), strict=True)
        ]  # fmt: skip

    @classmethod
    def of(cls, blocks: list[DescribedBlock]) -> DescribedTable:
        """The table of `DescribedBlock`s."""
        names: dict[str, int] = {}
        n = len(blocks)
        lengths = np.fromiter((len(b.meta) for b in blocks), np.int64, n)
        starts = np.zeros(n, np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        bits = {tiers: bit for bit, tiers in _TIERS.items()}
        tenant = np.fromiter((names.setdefault(b.tenant, len(names)) for b in blocks), np.int64, n)
        return cls(
            [b.key for b in blocks],
            list(names),
            tenant,
            np.frombuffer(b"".join(b.meta for b in blocks), np.uint8),
            starts,
            lengths,
            np.fromiter((bits.get(b.tiers, 0) for b in blocks), np.uint8, n),
        )


@dataclass(frozen=True)
class Listing:
    """The books as they were under the lock (`take_listing`); `table` does the rest."""

    ssd: MetaSnapshot | None  # the SSD metadata book
    tenants: list[str]
    index_keys: npt.NDArray[np.void] | None  # the SSD index's keys and tenants (with tenants)
    index_tenants: npt.NDArray[np.uint16] | None
    dram: list[tuple[bytes, str, bytes]]  # DRAM entries with metadata: key, tenant, meta

    def table(self) -> DescribedTable:
        """The blocks as arrays, SSD blocks first (no lock needed)."""
        keys: list[bytes] = []
        body = np.zeros(0, np.uint8)
        starts = lengths = np.zeros(0, np.int64)
        if self.ssd is not None:
            keys, records, first = self.ssd.records()
            body, starts, lengths = _bodies(records, first)
        n = len(keys)
        tenant = np.zeros(n, np.int64)
        if self.index_keys is not None and self.index_tenants is not None and n:
            of = dict(zip(self.index_keys.tolist(), self.index_tenants.tolist(), strict=True))
            tenant = np.fromiter((of.get(k, 0) for k in keys), np.int64, n)
        tiers = np.full(n, SSD, np.uint8)
        names = {name: i for i, name in enumerate(self.tenants)}
        rest: list[tuple[bytes, str, bytes]] = []
        if self.dram:
            at = dict(zip(keys, range(n), strict=True))
            for item in self.dram:
                row = at.get(item[0])
                if row is None:
                    rest.append(item)
                else:  # the SSD copy's metadata speaks for both (a durable put's order)
                    tiers[row] |= DRAM
        for _, name, _ in rest:
            names.setdefault(name, len(names))
        extra = np.fromiter((len(m) for _, _, m in rest), np.int64, len(rest))
        extra_starts = np.zeros(len(rest), np.int64)
        np.cumsum(extra[:-1], out=extra_starts[1:])
        joined = b"".join(m for _, _, m in rest)
        return DescribedTable(
            keys + [k for k, _, _ in rest],
            list(names),
            np.concatenate(
                [tenant, np.fromiter((names[t] for _, t, _ in rest), np.int64, len(rest))]
            ),  # fmt: skip
            np.concatenate([body, np.frombuffer(joined, np.uint8)]),
            np.concatenate([starts, extra_starts + len(body)]),
            np.concatenate([lengths, extra]),
            np.concatenate([tiers, np.full(len(rest), DRAM, np.uint8)]),
        )


def _bodies(
    records: npt.NDArray[np.uint8], first: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The metadata in META records, (n, 128) bytes: each record's 96-byte slice, joined (a
    block's slices are consecutive and in order, ``u16 length ‖ metadata``), and where each
    block's metadata starts in it and how long it is."""
    at = jr.RECORD_BYTES - jr.META_SLICE
    length = records[first, at].astype(np.int64) | (records[first, at + 1].astype(np.int64) << 8)
    body = np.ascontiguousarray(records[:, at:]).ravel()
    return body, first * jr.META_SLICE + 2, length


def take_listing(m: Manager) -> Listing:
    """The books' contents (lock held): copies of arrays and lists, no per-block Python for
    SSD blocks (`MetaBook.snapshot`)."""
    dram = [(e.key, e.tenant, e.meta) for e in m.index.values() if e.live and e.meta is not None]
    for ssd in m.lower[:1]:  # the SSD's books list the blocks below DRAM
        return _listing(ssd, dram)
    return Listing(None, [""], None, None, dram)


def _listing(ssd: SsdTier, dram: list[tuple[bytes, str, bytes]]) -> Listing:
    index = ssd.cat.index
    keys, tids = None, None
    if len(ssd.tenants) > 1:
        live = index.live_rows()
        keys = np.ascontiguousarray(index.rows["key"][live]).view("V16")
        tids = index.rows["tenant"][live]
    return Listing(ssd.cat.meta.snapshot(), list(ssd.tenants), keys, tids, dram)
