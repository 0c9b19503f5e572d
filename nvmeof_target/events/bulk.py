"""Announcing a restarted store's blocks in bulk (events.py's `KVEvents.announce`).

A restart may announce millions of blocks. Decoding each block's metadata into a `BlockMeta`,
keeping a `_Block` for it and packing one event dict each cost ~30 µs of Python per block
(43 CPU-s for 1M blocks). Here the metadata of all blocks is decoded at once with numpy over one
joined buffer, the blocks are kept as rows of arrays (`Announced`; a row becomes a `_Block` only
when a put, a tier move or a delete touches it), and the `BlockStored` events are written as
msgpack bytes straight from those arrays, 4096 to a message.

The msgpack written here is what `msgpack.packb` makes of the same event dict except that
integers always take their fixed-width form (hashes uint64, token ids and block size uint32):
every msgpack reader decodes both alike.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvoffload.errors import LocalProtocolError
from kvoffload.kvstore.described import DRAM, SSD  # bits of a row's tiers, as the engine lists them
from kvoffload.wire.blockmeta import MAX_META_TOKENS, MAX_NAME_BYTES, BlockMeta

__all__ = ["DRAM", "SSD", "Announced", "decode", "decode_joined", "encode_events", "event_order",
           "payload"]  # fmt: skip

_HEAD = 24  # BlockMeta's fixed head: version, flags, count, block size, two hashes
_HASH, _PARENT = 1, 2
MEDIA = (b"STORAGE", b"CPU")  # medium codes 0 (ssd) and 1 (dram), as events.MEDIA names them


def _str(s: bytes) -> bytes:
    return (bytes((0xA0 | len(s),)) if len(s) < 32 else b"\xd9" + bytes((len(s),))) + s


# The constant pieces of a BlockStored map, in the field order events.py writes.
_P_HASH = (b"\x89" + _str(b"type") + _str(b"BlockStored") + _str(b"block_hashes")
           + b"\x91\xcf")  # fmt: skip
_P_PARENT = _str(b"parent_block_hash")
_P_TOKENS = _str(b"token_ids")
_P_SIZE = _str(b"block_size") + b"\xce"
_P_MEDIUM = _str(b"lora_id") + b"\xc0" + _str(b"medium")
_P_LORA = _str(b"lora_name")
_P_TAIL = _str(b"locality") + _str(b"LOCAL")
_MEDIA_PACKED = [_str(m) for m in MEDIA]


@dataclass
class Decoded:
    """The metadata of n blocks, decoded; `ok` marks the rows a daemon can announce."""

    buf: npt.NDArray[np.uint8]  # every block's metadata, joined (padded)
    starts: npt.NDArray[np.int64]
    lengths: npt.NDArray[np.int64]
    ok: npt.NDArray[np.bool_]  # well formed, with a block hash
    digest: npt.NDArray[np.uint64]
    parent: npt.NDArray[np.uint64]
    has_parent: npt.NDArray[np.bool_]
    count: npt.NDArray[np.int64]  # token ids
    size: npt.NDArray[np.int64]  # tokens per block as published
    token_at: npt.NDArray[np.int64]  # where the token ids start in `buf`
    lora: dict[int, str] = field(default_factory=dict)  # rows with a LoRA name

    def meta(self, row: int) -> BlockMeta:
        start = int(self.starts[row])
        return BlockMeta.decode(self.buf[start : start + int(self.lengths[row])].tobytes())


def _u(buf: npt.NDArray[np.uint8], at: npt.NDArray[np.int64], width: int) -> npt.NDArray[np.uint64]:
    """Little-endian unsigned integers of `width` bytes at each offset `at`."""
    raw = buf[at[:, None] + np.arange(width)]
    return np.ascontiguousarray(raw).view(f"<u{width}")[:, 0].astype(np.uint64)


def decode(metas: list[bytes]) -> Decoded:
    """Decode `BlockMeta` byte forms in bulk (rows that are not well formed are not `ok`)."""
    n = len(metas)
    lengths = np.fromiter(map(len, metas), np.int64, n)
    starts = np.zeros(n, np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return decode_joined(np.frombuffer(b"".join(metas), np.uint8), starts, lengths)


def decode_joined(
    joined: npt.NDArray[np.uint8], starts: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]
) -> Decoded:
    """`decode` of the metadata at `joined[starts[i] : starts[i] + lengths[i]]` (what
    `Engine.described_table` lists: no bytes object per block)."""
    # Padding: the fixed-width reads below may run past a short (malformed) last record.
    buf = np.concatenate([joined, np.zeros(_HEAD + 2 + 8, np.uint8)])
    version, flags = buf[starts], buf[starts + 1]
    count = _u(buf, starts + 2, 2).astype(np.int64)
    size = _u(buf, starts + 4, 4).astype(np.int64)
    digest, parent = _u(buf, starts + 8, 8), _u(buf, starts + 16, 8)
    lora_len = buf[np.minimum(starts + _HEAD, len(buf) - 1)].astype(np.int64)
    salt_at = np.minimum(starts + _HEAD + 1 + lora_len, len(buf) - 1)
    salt_len = buf[salt_at].astype(np.int64)
    token_at = salt_at + 1 + salt_len
    ok = ((lengths >= _HEAD + 2) & (version == 1) & ((flags & 0xF0) == 0)
          & ((flags & _HASH) != 0) & (count <= MAX_META_TOKENS) & (lora_len <= MAX_NAME_BYTES)
          & (salt_len <= MAX_NAME_BYTES) & (token_at + 4 * count == starts + lengths))  # fmt: skip
    decoded = Decoded(buf, starts, lengths, ok, digest, parent, (flags & _PARENT) != 0, count,
                      np.where(size > 0, size, count), token_at)  # fmt: skip
    # Names must be UTF-8: the few rows that carry one are decoded one by one.
    named = ((flags & 0xC) != 0) | (lora_len > 0) | (salt_len > 0)
    for row in np.flatnonzero(ok & named).tolist():
        try:
            meta = decoded.meta(row)
        except LocalProtocolError:
            ok[row] = False
            continue
        if meta.lora_name is not None:
            decoded.lora[row] = meta.lora_name
    return decoded


def event_order(
    digest: npt.NDArray[np.uint64],
    parent: npt.NDArray[np.uint64],
    has_parent: npt.NDArray[np.bool_],
    topic: npt.NDArray[np.int64],
) -> npt.NDArray[np.int64]:
    """Block order for publishing: by topic, and within one a block after its parent when that
    is among them (a router drops a block whose parent it does not know)."""
    n = len(digest)
    if not n:
        return np.zeros(0, np.int64)
    by_digest = np.argsort(digest, kind="stable")
    sorted_digests = digest[by_digest]
    at = np.minimum(np.searchsorted(sorted_digests, parent), n - 1)
    up = np.where(has_parent & (sorted_digests[at] == parent), by_digest[at], -1)
    up[up == np.arange(n)] = -1  # a block that names itself
    # Depth by pointer jumping: log2(longest chain) passes. A cycle (colliding hashes) never
    # ends; the passes are bounded and its depths merely large.
    depth = (up >= 0).astype(np.int64)
    for _ in range(64):
        live = np.flatnonzero(up >= 0)
        if not len(live):
            break
        depth[live] = np.minimum(depth[live] + depth[up[live]], 1 << 40)
        up[live] = up[up[live]]
    return np.lexsort((depth, topic)).astype(np.int64)


def _scatter(
    out: npt.NDArray[np.uint8], at: npt.NDArray[np.int64], data: npt.NDArray[np.uint8]
) -> None:
    out[at[:, None] + np.arange(data.shape[1])] = data


def _be(values: npt.NDArray[np.uint64], width: int) -> npt.NDArray[np.uint8]:
    return values.astype(f">u{width}").view(np.uint8).reshape(-1, width)


def encode_events(
    dec: Decoded,
    rows: npt.NDArray[np.int64],
    media: npt.NDArray[np.int64],
    extras: list[bytes] | None = None,
) -> bytes:
    """The msgpack of one `BlockStored` per (row, medium code) in order, concatenated; a row
    of -1 takes the next of `extras` (an event packed elsewhere) instead."""
    table = rows >= 0
    r = rows[table]
    count = dec.count[r]
    parents = dec.has_parent[r]
    names = dec.lora
    lora = [_str(names[x].encode()) if x in names else b"\xc0" for x in r.tolist()] if names else []
    lora_len = np.fromiter(map(len, lora), np.int64, len(r)) if lora else np.ones(len(r), np.int64)
    medium_len = np.asarray([len(m) for m in _MEDIA_PACKED], np.int64)[media[table]]
    head = np.where(count < 16, 1, 3)
    lengths = np.zeros(len(rows), np.int64)
    lengths[table] = (len(_P_HASH) + 8 + len(_P_PARENT) + np.where(parents, 9, 1)
                      + len(_P_TOKENS) + head + 5 * count + len(_P_SIZE) + 4 + len(_P_MEDIUM)
                      + medium_len + len(_P_LORA) + lora_len + len(_P_TAIL))  # fmt: skip
    extra = extras or []
    if extra:
        lengths[~table] = np.fromiter(map(len, extra), np.int64, len(extra))
    offsets = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    out = np.zeros(int(offsets[-1]), np.uint8)
    at = offsets[:-1][table]

    def put(piece: bytes) -> None:
        nonlocal at
        _scatter(out, at, np.broadcast_to(np.frombuffer(piece, np.uint8), (len(at), len(piece))))
        at = at + len(piece)

    put(_P_HASH)
    _scatter(out, at, _be(dec.digest[r], 8))
    at = at + 8
    put(_P_PARENT)
    out[at] = np.where(parents, 0xCF, 0xC0)
    with_parent = at[parents] + 1
    _scatter(out, with_parent, _be(dec.parent[r][parents], 8))
    at = at + np.where(parents, 9, 1)
    put(_P_TOKENS)
    out[at] = np.where(count < 16, 0x90 | np.minimum(count, 15), 0xDC)
    wide = count >= 16
    _scatter(out, at[wide] + 1, _be(count[wide].astype(np.uint64), 2))
    at = at + head
    for n in np.unique(count).tolist():  # one pass per token count (usually one)
        if not n:
            continue
        same = np.flatnonzero(count == n)
        src = dec.token_at[r[same]][:, None] + np.arange(4 * n)
        tokens = np.ascontiguousarray(dec.buf[src]).view("<u4")
        cell = np.empty((len(same), n, 5), np.uint8)
        cell[:, :, 0] = 0xCE
        cell[:, :, 1:] = tokens.astype(">u4").view(np.uint8).reshape(len(same), n, 4)
        _scatter(out, at[same], cell.reshape(len(same), 5 * n))
    at = at + 5 * count
    put(_P_SIZE)
    _scatter(out, at, _be(dec.size[r].astype(np.uint64), 4))
    at = at + 4
    put(_P_MEDIUM)
    for code, packed in enumerate(_MEDIA_PACKED):
        mine = media[table] == code
        _scatter(out, at[mine], np.broadcast_to(np.frombuffer(packed, np.uint8),
                                                (int(mine.sum()), len(packed))))  # fmt: skip
    at = at + medium_len
    put(_P_LORA)
    if lora:
        for i, value in enumerate(lora):
            out[at[i] : at[i] + len(value)] = np.frombuffer(value, np.uint8)
    else:
        out[at] = 0xC0
    at = at + lora_len
    put(_P_TAIL)
    for i, start in zip(np.flatnonzero(~table).tolist(), range(len(extra)), strict=True):
        out[offsets[i] : offsets[i + 1]] = np.frombuffer(extra[start], np.uint8)
    return out.tobytes()


def payload(ts: float, count: int, events: bytes) -> bytes:
    """An EventBatch ``[ts, [event, ...], None]`` around `count` packed events."""
    header = bytes((0x90 | count,)) if count < 16 else b"\xdc" + count.to_bytes(2, "big")
    return b"\x93\xcb" + struct.pack(">d", ts) + header + events + b"\xc0"


@dataclass
class Announced:
    """Blocks announced at start and not touched since: rows of arrays, not `_Block`s."""

    keys: list[bytes]  # engine keys
    dec: Decoded
    topic: npt.NDArray[np.int64]  # index into `topics`
    topics: list[bytes]
    tiers: npt.NDArray[np.uint8]  # SSD | DRAM bits; 0 once the row is gone or adopted
    row_of: dict[bytes, int] = field(default_factory=dict)
