"""Framing shared by the native protocol's two ends: a fixed header, a msgpack map, raw payload.

Every frame is::

    offset bytes field (little-endian)
    0      4     magic b"KVNP"
    4      1     protocol version (1)
    5      1     frame type (the operation; see native.py)
    6      2     flags (bit 0: response)
    8      4     request id (0 = the connection itself, for connection-level errors)
    12     4     header length: bytes of the msgpack map that follows
    16     8     payload length: raw bytes after the map
    24     ...   msgpack map, then payload

`FrameReader` parses a byte stream into frames without owning a socket. It exposes the receive
side the way `asyncio.BufferedProtocol` wants it (`get_buffer` / `buffer_updated`), so that once
a frame's header is parsed, the caller can point the rest of the frame — its payload — at its own
memory (`set_sink`: an engine reservation, a caller's `get_into` buffer) and the socket fills it
directly. Declared lengths are checked against `Limits` before anything is allocated.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Protocol

import msgpack

from kvoffload.errors import LocalProtocolError
from kvoffload.wire.rxbuffer import ReceiveBuffer

__all__ = [
    "FLAG_RESPONSE",
    "FRAME",
    "HEAD_READ",
    "LARGE_PAYLOAD",
    "MAGIC",
    "VERSION",
    "Frame",
    "FrameReader",
    "Limits",
    "Need",
    "PayloadEnd",
    "SinkFull",
    "encode_frame",
]

MAGIC = b"KVNP"
VERSION = 1
FLAG_RESPONSE = 0x1
_KNOWN_FLAGS = FLAG_RESPONSE
FRAME = struct.Struct("<4sBBHIIQ")  # 24 bytes
MAX_REQUEST_ID = (1 << 32) - 1
# A payload this large is worth a read of its own (see `FrameReader.after_large_payload`).
LARGE_PAYLOAD = 32 << 10
# What to read when only a frame's header (and a little more) is wanted.
HEAD_READ = 512


# fast.parse_frame: (buffer, start, end, max header, max payload) -> (event, next start, head).
ParseFrame = Callable[
    [bytearray, int, int, int, int], "tuple[object, int, tuple[int, int, int, int, int]] | None"
]


class Buffer(Protocol):
    """Anything `memoryview()` accepts; what payload parts may be."""

    def __buffer__(self, flags: int, /) -> memoryview: ...


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on what a peer may declare; checked before allocating."""

    # Largest msgpack map; bounds key lists of batch requests (~19 bytes per key).
    max_header_bytes: int = 4 << 20
    # Largest payload of one frame.
    max_payload_bytes: int = 1 << 30
    # Requests one connection may have outstanding (pipelined) at once.
    max_pending: int = 4096

    def __post_init__(self) -> None:
        if self.max_header_bytes < 64 or self.max_payload_bytes < 0 or self.max_pending < 1:
            raise ValueError(f"unusable frame limits: {self}")


class Need(enum.Enum):
    """`next_event` results that are not events."""

    DATA = "need data"


@dataclass(frozen=True, slots=True)
class Frame:
    """A frame whose header and msgpack map are in; `payload_length` bytes follow."""

    type: int
    flags: int
    request_id: int
    meta: dict[str, object]
    payload_length: int


@dataclass(frozen=True, slots=True)
class PayloadEnd:
    """The payload of the frame `request_id` is complete.

    `data` holds it when the reader allocated the memory itself; it is None when the payload
    went into a caller's sink (the caller knows where) or was discarded.
    """

    request_id: int
    data: memoryview | None = None


@dataclass(frozen=True, slots=True)
class SinkFull:
    """The partial sink set for the payload of `request_id` is full; `remaining` bytes follow.
    Set another sink, discard them, or (doing neither) let the reader allocate them."""

    request_id: int
    remaining: int


class _State(enum.Enum):
    HEAD = "head"
    META = "meta"
    PAYLOAD = "payload"  # whether a sink is chosen is the ReceiveBuffer's business


class FrameReader(ReceiveBuffer):
    """Incremental frame parser: bytes in (any chunking), `Frame` / `PayloadEnd` out."""

    def __init__(self, limits: Limits | None = None) -> None:
        super().__init__()
        self.limits = limits or Limits()
        self._state = _State.HEAD
        self._head: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)  # type, flags, id, hlen, plen
        self._part = False  # the sink set last holds only part of the payload

    # ------------------------------------------------------------------ receive side

    @property
    def at_boundary(self) -> bool:
        """True between frames (nothing partial buffered)."""
        return self._state is _State.HEAD and self._start == self._end

    @property
    def after_large_payload(self) -> bool:
        """Between frames, and the last one carried a payload of `LARGE_PAYLOAD` bytes or more.

        The next frame is then likely large too (a connection that puts 64 KiB values keeps
        doing so): reading only its header first lets its payload land in the sink the
        consumer chooses instead of in this buffer, from which it would be copied.
        """
        return self._head[4] >= LARGE_PAYLOAD and self.at_boundary

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Feed received bytes (copying them through `get_buffer`)."""
        self._feed(data)

    def _header_room(self) -> int:
        return self._head[3] if self._state is _State.META else 0

    def set_sink(self, buffers: Sequence[memoryview], *, part: bool = False) -> None:
        """Deliver the pending payload into `buffers` (in order; their sizes must add up to it).

        With `part`, they may hold less than what remains: once they are full, `next_frame`
        returns `SinkFull` and the consumer chooses where the rest goes (a server reserves
        memory for a batch's values one at a time, as their bytes come).

        Raises:
            LocalProtocolError: no payload is pending, or the sizes do not match.
        """
        if not self._unclaimed:
            raise LocalProtocolError("no payload is waiting for a sink")
        views = [memoryview(b).cast("B") for b in buffers if len(b)]
        size = sum(len(v) for v in views)
        if size > self._left or (size != self._left and not (part and size)):
            raise LocalProtocolError(f"sink of {size} bytes for a {self._left}-byte payload")
        self._claim(views, discard=False)
        self._part = size < self._left

    def discard(self) -> None:
        """Read and drop the pending payload without allocating memory for it."""
        if not self._unclaimed:
            raise LocalProtocolError("no payload is waiting to be discarded")
        self._claim([], discard=True)

    def next_frame(self) -> Frame | PayloadEnd | SinkFull | Need:
        """The next complete frame head or payload end, or `Need.DATA`.

        Raises:
            LocalProtocolError: the bytes break the framing rules (callers re-raise it as the
                peer's fault).
        """
        if self._state is _State.PAYLOAD:
            return self._drain_payload()
        if self._state is _State.HEAD:
            if self._end - self._start < FRAME.size:
                return Need.DATA
            self._parse_head()
        rid = self._head[2]
        hlen, plen = self._head[3], self._head[4]
        if self._end - self._start < hlen:
            return Need.DATA
        raw = self._view[self._start : self._start + hlen]
        self._start += hlen
        frame = Frame(self._head[0], self._head[1], rid, _unpack_map(raw), plen)
        if plen:
            self._state = _State.PAYLOAD
            self._expect(plen)
        else:
            self._state = _State.HEAD
        return frame

    def take_parsed(self, parse: ParseFrame) -> object | None:
        """The event `parse` (fast.parse_frame) makes of the whole frame buffered next, with
        the reader moved past its map as `next_frame` would; None (nothing consumed) when it
        does not take that frame, or when the reader is inside one."""
        if self._state is not _State.HEAD:
            return None
        got = parse(
            self._buf,
            self._start,
            self._end,
            self.limits.max_header_bytes,
            self.limits.max_payload_bytes,
        )
        if got is None:
            return None
        event, self._start, self._head = got
        if self._head[4]:
            self._state = _State.PAYLOAD
            self._expect(self._head[4])
        return event

    def resume_payload(self, op: int, request_id: int, length: int, got: int) -> None:
        """Between frames, a frame (`op`, `length` payload bytes) was parsed elsewhere and
        `got` of its payload taken: the remaining bytes are next (see `take_parsed`)."""
        if not self.at_boundary:
            raise LocalProtocolError("a payload resumed inside another frame")
        self._head = (op, 0, request_id, 0, length)
        self._state = _State.PAYLOAD
        self._expect(length - got)

    # ------------------------------------------------------------------ internals

    def _parse_head(self) -> None:
        magic, version, ftype, flags, rid, hlen, plen = FRAME.unpack_from(self._buf, self._start)
        if magic != MAGIC:
            raise LocalProtocolError(f"bad frame magic {bytes(magic)!r} (not a kvoffload peer?)")
        if version != VERSION:
            raise LocalProtocolError(f"unsupported frame version {version} (this side speaks 1)")
        if flags & ~_KNOWN_FLAGS:
            raise LocalProtocolError(f"unknown frame flags {flags:#x}")
        if hlen > self.limits.max_header_bytes:
            raise LocalProtocolError(
                f"frame header of {hlen} bytes exceeds the limit of {self.limits.max_header_bytes}"
            )
        if plen > self.limits.max_payload_bytes:
            raise LocalProtocolError(
                f"payload of {plen} bytes exceeds the limit of {self.limits.max_payload_bytes}"
            )
        self._start += FRAME.size
        self._head = (ftype, flags, rid, hlen, plen)
        self._state = _State.META

    def _drain_payload(self) -> PayloadEnd | SinkFull | Need:
        while True:
            if self._unclaimed:
                if self._part:  # a partial sink is full: the consumer chooses again
                    self._part = False
                    return SinkFull(self._head[2], self._left)
                self._allocate()  # nobody chose a sink (or not again): the reader allocates
            self._drain()
            if not self._left:
                break
            if not self._unclaimed:
                return Need.DATA
        end = PayloadEnd(self._head[2], self._payload_done())
        self._state = _State.HEAD
        return end


# Lists and maps one frame header may hold. A real one has a handful (a stats answer a few
# dozen); without a bound, a 4 MiB header of empty lists decodes to ~290 MiB of list objects.
MAX_CONTAINERS = 1024


class _TooNested(Exception):
    pass


def _no_ext(code: int, data: bytes) -> object:
    raise _TooNested(f"msgpack extension type {code} (the protocol uses none)")


def _unpack_counted(raw: memoryview) -> object:
    made = 0

    def count(container: object) -> object:
        nonlocal made
        made += 1
        if made > MAX_CONTAINERS:
            raise _TooNested(f"more than {MAX_CONTAINERS} lists and maps")
        return container

    return msgpack.unpackb(
        raw,
        raw=False,
        strict_map_key=True,
        use_list=True,
        list_hook=count,
        object_hook=count,
        ext_hook=_no_ext,
    )


def _unpack_map(raw: memoryview) -> dict[str, object]:
    try:
        if len(raw) <= MAX_CONTAINERS:
            # Every list or map takes a byte at least: a header this short cannot hold too
            # many, so the count (a Python call per container) is left out.
            meta = msgpack.unpackb(raw, raw=False, strict_map_key=True, ext_hook=_no_ext)
        else:
            meta = _unpack_counted(raw)
    except (_TooNested, ValueError, TypeError, OverflowError, msgpack.UnpackException) as exc:
        # msgpack's own errors (ExtraData, FormatError, StackError) derive from ValueError.
        raise LocalProtocolError(f"undecodable frame header: {exc}") from None
    # map/repeat: the keys are checked without a Python generator step per key
    if not isinstance(meta, dict) or not all(map(isinstance, meta, repeat(str))):
        raise LocalProtocolError("frame header is not a map with string keys")
    return meta


def encode_frame(
    ftype: int,
    flags: int,
    request_id: int,
    meta: dict[str, object],
    payload: Sequence[Buffer | bytes | memoryview] = (),
) -> list[bytes | memoryview]:
    """The buffers of one frame, ready for `sendmsg`/`writelines`; payload parts are not copied.

    Raises:
        LocalProtocolError: a field is out of range.
    """
    if not 0 <= request_id <= MAX_REQUEST_ID:
        raise LocalProtocolError(f"request id {request_id} out of range")
    packed = msgpack.packb(meta, use_bin_type=True)
    parts = [memoryview(p).cast("B") for p in payload]
    plen = sum(len(p) for p in parts)
    head = FRAME.pack(MAGIC, VERSION, ftype, flags, request_id, len(packed), plen)
    out: list[bytes | memoryview] = [head + packed]
    out.extend(p for p in parts if len(p))
    return out
