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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import msgpack

from kvoffload.errors import LocalProtocolError

__all__ = [
    "FLAG_RESPONSE",
    "FRAME",
    "MAGIC",
    "VERSION",
    "Frame",
    "FrameReader",
    "Limits",
    "Need",
    "PayloadEnd",
    "encode_frame",
]

MAGIC = b"KVNP"
VERSION = 1
FLAG_RESPONSE = 0x1
_KNOWN_FLAGS = FLAG_RESPONSE
FRAME = struct.Struct("<4sBBHIIQ")  # 24 bytes
MAX_REQUEST_ID = (1 << 32) - 1
# Bytes the reader buffers per read when it is not filling a payload sink: large enough that a
# pipelined burst of small requests is one system call, small enough to cost nothing per connection
# that matters next to the arena.
_READ_CHUNK = 64 << 10
# Compact or grow rather than hand out less free space than this (avoids tiny reads).
_MIN_READ = 4 << 10


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


class _State(enum.Enum):
    HEAD = "head"
    META = "meta"
    PAYLOAD_UNCLAIMED = "payload, no sink chosen yet"
    PAYLOAD = "payload"


class FrameReader:
    """Incremental frame parser: bytes in (any chunking), `Frame` / `PayloadEnd` out."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self._buf = bytearray(_READ_CHUNK)
        self._view = memoryview(self._buf)
        self._start = 0  # first unparsed byte in _buf
        self._end = 0  # one past the last received byte in _buf
        self._state = _State.HEAD
        self._head: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)  # type, flags, id, hlen, plen
        self._sink: list[memoryview] = []
        self._sink_index = 0  # which sink buffer is being filled
        self._sink_fill = 0  # bytes written into it
        self._remaining = 0  # payload bytes still to come
        self._discarding = False
        self._allocated: memoryview | None = None
        self._direct = False  # the last get_buffer() handed out sink memory

    # ------------------------------------------------------------------ receive side

    @property
    def buffered(self) -> int:
        """Bytes received but not yet consumed by `next_frame`."""
        return self._end - self._start

    @property
    def at_boundary(self) -> bool:
        """True between frames (nothing partial buffered)."""
        return self._state is _State.HEAD and self._start == self._end

    def get_buffer(self) -> memoryview:
        """Writable memory for the next received bytes (never empty).

        While a claimed payload is being received and nothing else is buffered, this is the
        sink itself, so a `recv_into` lands the bytes at their destination.
        """
        if self._state is _State.PAYLOAD_UNCLAIMED:
            self._allocate()
        direct = self._state is _State.PAYLOAD and not self._discarding and self._remaining
        if direct and self._start == self._end:
            self._direct = True
            sink = self._sink[self._sink_index]
            return sink[self._sink_fill : self._sink_fill + self._remaining]
        self._direct = False
        self._make_room()
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        """`nbytes` were written at the start of the memory `get_buffer` returned."""
        if nbytes <= 0:
            return
        if self._direct:
            self._direct = False
            self._advance_sink(nbytes)
        else:
            self._end += nbytes

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Feed received bytes (copying them through `get_buffer`)."""
        src = memoryview(data).cast("B")
        while len(src):
            dst = self.get_buffer()
            n = min(len(dst), len(src))
            dst[:n] = src[:n]
            self.buffer_updated(n)
            src = src[n:]

    def set_sink(self, buffers: Sequence[memoryview]) -> None:
        """Deliver the pending payload into `buffers` (in order; their sizes must add up to it).

        Raises:
            LocalProtocolError: no payload is pending, or the sizes do not match.
        """
        if self._state is not _State.PAYLOAD_UNCLAIMED:
            raise LocalProtocolError("no payload is waiting for a sink")
        views = [memoryview(b).cast("B") for b in buffers if len(b)]
        if sum(len(v) for v in views) != self._remaining:
            raise LocalProtocolError(
                f"sink of {sum(len(v) for v in views)} bytes for a {self._remaining}-byte payload"
            )
        self._claim(views, discard=False)

    def discard(self) -> None:
        """Read and drop the pending payload without allocating memory for it."""
        if self._state is not _State.PAYLOAD_UNCLAIMED:
            raise LocalProtocolError("no payload is waiting to be discarded")
        self._claim([], discard=True)

    def next_frame(self) -> Frame | PayloadEnd | Need:
        """The next complete frame head or payload end, or `Need.DATA`.

        Raises:
            LocalProtocolError: the bytes break the framing rules (callers re-raise it as the
                peer's fault).
        """
        if self._state is _State.PAYLOAD_UNCLAIMED:
            self._allocate()
        if self._state is _State.PAYLOAD:
            return self._drain_payload()
        if self._state is _State.HEAD:
            if self.buffered < FRAME.size:
                return Need.DATA
            self._parse_head()
        rid = self._head[2]
        hlen, plen = self._head[3], self._head[4]
        if self.buffered < hlen:
            return Need.DATA
        raw = self._view[self._start : self._start + hlen]
        self._start += hlen
        frame = Frame(self._head[0], self._head[1], rid, _unpack_map(raw), plen)
        if plen:
            self._state = _State.PAYLOAD_UNCLAIMED
            self._remaining = plen
        else:
            self._state = _State.HEAD
        return frame

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

    def _make_room(self) -> None:
        """Ensure free space after `_end`, and that a declared map fits contiguously."""
        want = self._head[3] if self._state is _State.META else 0
        if len(self._buf) - self._end >= _MIN_READ and len(self._buf) - self._start >= want:
            return
        self._compact()
        # `want` was checked against the limit; `buffered` is bounded by the caller, who drains
        # events between reads (only `receive_data` of a huge chunk can push it up).
        size = max(_READ_CHUNK, want + _MIN_READ, self.buffered + _MIN_READ)
        if len(self._buf) < size or (len(self._buf) > size and self.buffered < _READ_CHUNK // 2):
            # Grow for a large map; shrink back once it has been consumed.
            resized = bytearray(size)
            resized[: self.buffered] = self._view[: self.buffered]
            self._buf = resized
            self._view = memoryview(resized)

    def _compact(self) -> None:
        if self._start:
            n = self.buffered
            # bytes(): the ranges may overlap, and bytearray slice assignment uses memcpy.
            self._buf[:n] = bytes(self._view[self._start : self._end])
            self._start, self._end = 0, n

    def _allocate(self) -> None:
        memory = memoryview(bytearray(self._remaining))
        self._claim([memory], discard=False)
        self._allocated = memory

    def _claim(self, views: list[memoryview], *, discard: bool) -> None:
        self._sink = views
        self._sink_index = 0
        self._sink_fill = 0
        self._discarding = discard
        self._allocated = None
        self._state = _State.PAYLOAD

    def _advance_sink(self, n: int) -> None:
        self._remaining -= n
        while n:
            room = len(self._sink[self._sink_index]) - self._sink_fill
            step = min(room, n)
            self._sink_fill += step
            n -= step
            if self._sink_fill == len(self._sink[self._sink_index]):
                self._sink_index += 1
                self._sink_fill = 0

    def _drain_payload(self) -> PayloadEnd | Need:
        take = min(self.buffered, self._remaining)
        if take and self._discarding:
            self._remaining -= take
            self._start += take
        elif take:
            pos = 0
            while pos < take:
                sink = self._sink[self._sink_index]
                step = min(len(sink) - self._sink_fill, take - pos)
                sink[self._sink_fill : self._sink_fill + step] = self._view[
                    self._start + pos : self._start + pos + step
                ]
                self._advance_sink(step)
                pos += step
            self._start += take
        if self._remaining:
            return Need.DATA
        end = PayloadEnd(self._head[2], self._allocated)
        self._sink = []
        self._allocated = None
        self._discarding = False
        self._state = _State.HEAD
        return end


def _unpack_map(raw: memoryview) -> dict[str, object]:
    try:
        meta = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as exc:
        # msgpack's own errors (ExtraData, FormatError, StackError) derive from ValueError.
        raise LocalProtocolError(f"undecodable frame header: {exc}") from None
    if not isinstance(meta, dict) or not all(isinstance(k, str) for k in meta):
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
