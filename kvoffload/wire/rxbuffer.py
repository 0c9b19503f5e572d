"""The receive side both wire codecs share: a buffer parsed in place, and payload sinks.

A codec parses headers out of `ReceiveBuffer`'s own buffer. When a header announces a payload
(a put's value, a PDU's data), the codec calls `_expect(n)`; the consumer then points those
bytes at its own memory (`_claim` with sinks: an engine reservation, a caller's `get_into`
buffer), drops them (`_claim` with discard), or lets the buffer allocate. While a sink is being
filled and nothing else is buffered, `get_buffer()` *is* the sink, so `recv_into` lands the
bytes at their destination; what arrived together with the header is copied once.

Sinks may cover less than the payload: once they are full the payload is unclaimed again and
the codec asks for more (NVMe/TCP does, to peek at a block header before choosing where the
rest goes). `_landed` sees every payload byte once, in order, wherever it went (for digests).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import ClassVar

__all__ = ["ReceiveBuffer"]

# Bytes read per system call when no sink is being filled: a pipelined burst of small messages
# is one call; small next to the arena.
_READ_CHUNK = 64 << 10
# Compact or grow rather than hand out less free space than this (avoids tiny reads).
_MIN_READ = 4 << 10


class _Payload(enum.Enum):
    NONE = "no payload pending"
    UNCLAIMED = "payload, no sink chosen yet"
    CLAIMED = "payload going into a sink (or dropped)"


class ReceiveBuffer:
    """Received bytes, parsed in place; payloads delivered into sinks."""

    # A payload with no sink is allocated up to this many bytes at once (None: all of it);
    # beyond that the memory grows, doubling, as bytes arrive, so that a length the peer
    # declares but never sends costs no memory. A codec whose declared lengths are not
    # already bounded by its own limits sets it.
    _alloc_ahead: ClassVar[int | None] = None

    def __init__(self) -> None:
        self._buf = bytearray(_READ_CHUNK)
        self._view = memoryview(self._buf)
        self._start = 0  # first unparsed byte in _buf
        self._end = 0  # one past the last received byte in _buf
        self._payload = _Payload.NONE
        self._left = 0  # payload bytes still to come
        self._sink: list[memoryview] = []
        self._sink_i = 0  # which sink buffer is being filled
        self._sink_fill = 0  # bytes written into it
        self._discarding = False
        self._allocated: memoryview | None = None
        self._direct = False  # the last get_buffer() handed out sink memory

    # ------------------------------------------------------------------ what codecs override

    def _header_room(self) -> int:
        """Bytes (from `_start`) the header being parsed needs in one contiguous piece."""
        return 0

    def _landed(self, data: memoryview) -> None:
        """Payload bytes arrived, in order, wherever they went (a digest hook)."""

    # ------------------------------------------------------------------ the receive side

    @property
    def buffered(self) -> int:
        """Bytes received but not yet parsed."""
        return self._end - self._start

    def get_buffer(self) -> memoryview:
        """Writable memory for the next received bytes (never empty)."""
        if self._payload is _Payload.UNCLAIMED:
            self._allocate()
        if (
            self._payload is _Payload.CLAIMED
            and not self._discarding
            and self._left
            and self._start == self._end
        ):
            self._direct = True
            piece = self._sink[self._sink_i]
            return piece[self._sink_fill : self._sink_fill + self._left]
        self._direct = False
        self._make_room()
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        """`nbytes` were written at the start of the memory `get_buffer` returned."""
        if nbytes <= 0:
            return
        if self._direct:
            self._direct = False
            self._landed(self._sink[self._sink_i][self._sink_fill : self._sink_fill + nbytes])
            self._advance_sink(nbytes)
        else:
            self._end += nbytes

    def _feed(self, data: bytes | bytearray | memoryview) -> None:
        """Copy received bytes in through `get_buffer` (for callers that read elsewhere)."""
        src = memoryview(data).cast("B")
        while len(src):
            dst = self.get_buffer()
            n = min(len(dst), len(src))
            dst[:n] = src[:n]
            self.buffer_updated(n)
            src = src[n:]

    # ------------------------------------------------------------------ payloads

    def _expect(self, nbytes: int) -> None:
        """A header announced `nbytes` of payload, next in the stream."""
        self._left = nbytes
        self._payload = _Payload.UNCLAIMED if nbytes else _Payload.NONE

    @property
    def _unclaimed(self) -> bool:
        return self._payload is _Payload.UNCLAIMED

    def _claim(self, views: Sequence[memoryview], *, discard: bool) -> None:
        self._sink = list(views)
        self._sink_i = 0
        self._sink_fill = 0
        self._discarding = discard
        self._allocated = None
        self._payload = _Payload.CLAIMED

    def _allocate(self) -> None:
        ahead = self._left if self._alloc_ahead is None else self._alloc_ahead
        memory = memoryview(bytearray(min(self._left, ahead)))
        self._claim([memory], discard=False)
        self._allocated = memory

    def _grow(self) -> None:
        """The allocated payload memory is full and more is coming: double it (at most to the
        payload's size), keeping what arrived."""
        assert self._allocated is not None
        filled = len(self._allocated)
        grown = bytearray(min(filled + self._left, 2 * filled))
        grown[:filled] = self._allocated
        memory = memoryview(grown)
        self._sink, self._sink_i, self._sink_fill = [memory], 0, filled
        self._allocated = memory

    def _advance_sink(self, n: int) -> None:
        self._left -= n
        if n < len(self._sink[self._sink_i]) - self._sink_fill:  # the piece is not full yet
            self._sink_fill += n
            return
        while n:
            room = len(self._sink[self._sink_i]) - self._sink_fill
            step = min(room, n)
            self._sink_fill += step
            n -= step
            if self._sink_fill == len(self._sink[self._sink_i]):
                self._sink_i += 1
                self._sink_fill = 0
        if self._left and self._sink_i == len(self._sink):
            if self._allocated is not None:
                self._grow()
            else:
                self._payload = _Payload.UNCLAIMED  # a partial sink is full: ask for the next

    def _drain(self) -> None:
        """Move buffered payload bytes into the sink (or drop them) until it is full."""
        while self._payload is _Payload.CLAIMED and self._left and self._end > self._start:
            take = min(self._end - self._start, self._left)
            src = self._view[self._start : self._start + take]
            if self._discarding:
                self._landed(src)
                self._left -= take
                self._start += take
                continue
            piece = self._sink[self._sink_i]
            step = min(len(piece) - self._sink_fill, take)
            piece[self._sink_fill : self._sink_fill + step] = src[:step]
            self._landed(src[:step])
            self._start += step
            self._advance_sink(step)

    def _payload_done(self) -> memoryview | None:
        """The payload is complete: what the buffer allocated for it, if it did."""
        allocated = self._allocated
        self._sink = []
        self._allocated = None
        self._discarding = False
        self._payload = _Payload.NONE
        return allocated

    # ------------------------------------------------------------------ the buffer

    def _make_room(self) -> None:
        """Ensure free space after `_end`, and that the header being parsed fits contiguously."""
        # The header's room grows with the bytes that arrived (at most doubling): a peer that
        # declares a large header and sends little must not make us allocate all of it.
        if self._start == self._end:
            # All parsed: start over at the front (no compaction), at the usual size again if
            # a large header made the buffer grow. Any header fits: `want` is at most a chunk.
            self._start = self._end = 0
            if len(self._buf) > _READ_CHUNK:
                self._buf = bytearray(_READ_CHUNK)
                self._view = memoryview(self._buf)
            return
        want = min(self._header_room(), max(_READ_CHUNK, 2 * self.buffered))
        if len(self._buf) - self._end >= _MIN_READ and len(self._buf) - self._start >= want:
            return
        if self._start:
            n = self.buffered
            # bytes(): the ranges may overlap, and bytearray slice assignment uses memcpy.
            self._buf[:n] = bytes(self._view[self._start : self._end])
            self._start, self._end = 0, n
        # The header was checked against the codec's limits; `buffered` is bounded by the caller,
        # who drains events between reads (only feeding a huge chunk at once can push it up).
        size = max(_READ_CHUNK, want + _MIN_READ, self.buffered + _MIN_READ)
        if len(self._buf) < size or (len(self._buf) > size and self.buffered < _READ_CHUNK // 2):
            # Grow for a large header; shrink back once it has been parsed.
            resized = bytearray(size)
            resized[: self.buffered] = self._view[: self.buffered]
            self._buf = resized
            self._view = memoryview(resized)
