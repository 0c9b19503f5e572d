"""The client side of a native-protocol connection, sans I/O: request ids, answers and
payload sinks over the codec in `kvoffload/wire/native/connection.py`. The drivers (`sync`, `aio`)
only move bytes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvoffload.client_sdk.transports import core
from kvoffload.errors import (
    InvalidArgumentError,
    KVOffloadError,
    RemoteProtocolError,
    TransportError,
)
from kvoffload.wire.native.connection import (
    NEED_DATA,
    ConnectionClosed,
    ErrorReply,
    Event,
    Limits,
    NativeConnection,
    PayloadEnd,
    Role,
)
from kvoffload.wire.native.frames import encode_frame
from kvoffload.wire.status import error_for

__all__ = ["Call", "Plan", "Req", "Session", "Sink"]

T = TypeVar("T")
# The client accepts answers up to this size (the daemon's own limit is lower).
_LIMITS = Limits(max_header_bytes=64 << 20, max_payload_bytes=4 << 30, max_pending=1 << 16)

Sink = Callable[[Event], "list[memoryview] | None"]


@dataclass
class Req:
    """One request a plan wants sent."""

    make: Callable[[int], Event]  # request id -> event
    payload: Sequence[object] = ()
    # Where the answer's payload goes (None: let the codec allocate; the callable may return
    # None to drop it, or raise InvalidArgumentError to fail the request after dropping it).
    sink: Sink | None = None
    # The one key of a Get, which the C exchange frames itself (no event built unless needed).
    key: bytes | None = None
    # The keys of a Lookup, which the C exchange frames itself (no event unless needed).
    lookup: tuple[bytes, ...] | None = None
    # A key-only request with an answer of a few bytes (an Exists): a plan's step of them goes
    # out in one write, its answers read after (`sync._SyncConnection.exchange`).
    small: bool = False


@dataclass
class Call:
    request: Event
    sink: Sink | None = None
    answer: Event | None = None
    payload: memoryview | None = None
    error: KVOffloadError | None = None
    done: bool = False
    receiving: bool = False  # its payload is arriving into a caller's sink right now

    def result(self) -> Event:
        if self.error is not None:
            raise self.error
        assert self.answer is not None
        return self.answer


Plan = core.Plan[Req, Call, T]


class Session:
    """The client side of one connection: request ids, answers, payload sinks; no I/O."""

    def __init__(self) -> None:
        self.conn = NativeConnection(Role.CLIENT, _LIMITS)
        self._next_id = 0
        self.calls: dict[int, Call] = {}
        self.broken: KVOffloadError | None = None
        # The daemon ended the connection (a goodbye or EOF), e.g. closing it as idle: it took
        # no request after that, so the driver retries on a fresh connection.
        self.peer_closed = False

    def start(self, req: Req, event: Event | None = None) -> tuple[Call, list[bytes | memoryview]]:
        """`req` registered and encoded (`event`: its event, numbered by `frame` already)."""
        if self.broken is not None:  # e.g. the daemon said goodbye: the driver reconnects
            raise self.broken
        if event is None:
            self._next_id = self._next_id % 0xFFFF_FFFF + 1
            event = req.make(self._next_id)
        parts = self.conn.send_parts(event, req.payload)
        call = Call(event, req.sink)
        self.calls[event.request_id] = call
        return call, parts

    @property
    def ready(self) -> bool:
        """Nothing outstanding, buffered or ended: a driver may exchange one request on the
        socket itself (`frame`, then `adopt` if the codec must see the answer)."""
        conn = self.conn
        return self.broken is None and not self.calls and conn.idle and not conn.peer_closed

    def number(self) -> int:
        """The next request id, for a request a driver frames and sends itself (`frame`, or
        the C exchange from `Req.key`); `adopt` hands it to the codec if need be."""
        self._next_id = self._next_id % 0xFFFF_FFFF + 1
        return self._next_id

    @staticmethod
    def frame(event: Event, payload: Sequence[object]) -> list[bytes | memoryview]:
        """The buffers that carry `event`, without the codec knowing (what `start` sends)."""
        return encode_frame(event.OP, 0, event.request_id, event.meta(), payload)  # type: ignore[arg-type]

    def adopt(self, req: Req, event: Event, received: bytes, eof: bool) -> Call:
        """Take over a request a driver sent itself (`frame`) whose answer it left to the
        codec: registered as if `start` had sent it, then fed what the driver read."""
        self.conn.send_parts(event, req.payload)  # the bytes went out already
        call = Call(event, req.sink)
        self.calls[event.request_id] = call
        if received:
            self.conn.receive_data(received)
        if eof:
            self.conn.receive_eof()
        self.feed()
        return call

    def took(self, received: bytes) -> None:
        """A driver took an answer whole: what it read past that frame goes to the codec."""
        if received:
            self.conn.receive_data(received)
            self.feed()

    def feed(self) -> None:
        """Match buffered answers to their calls (marking them done)."""
        while self.broken is None:
            try:
                item = self.conn.next_event()
            except RemoteProtocolError as exc:
                # Cut off mid-answer (a killed daemon, a reset): the connection failed, not the
                # protocol, so the request may be retried.
                cut = TransportError(f"the daemon closed the connection: {exc}")
                self.fail(cut if self.conn.peer_closed else exc)
                return
            if item is NEED_DATA:
                return
            if isinstance(item, ConnectionClosed):
                self.peer_closed = True
                self.fail(TransportError("the daemon closed the connection"))
                return
            if isinstance(item, PayloadEnd):
                self._payload_end(item)
            else:
                assert isinstance(item, Event)
                self._answer(item)
            if not self.calls and self.conn.idle_between_frames:
                return  # nothing to match and nothing buffered: skip the poll that says so

    def _answer(self, event: Event) -> None:
        if isinstance(event, ErrorReply) and event.request_id == 0:
            # A goodbye: whatever its status (an idle timeout says DEADLINE), the connection is
            # gone, not the request, which a fresh connection can carry.
            self.peer_closed = True
            self.fail(TransportError(f"daemon closed the connection: {event.message}"))
            return
        call = self.calls[event.request_id]  # the codec checked the id is outstanding
        call.answer = event
        if isinstance(event, ErrorReply):
            call.error = error_for(event.status, event.message)
        if not event.payload_length:
            self._finish(call)
            return
        if call.sink is None:
            return  # the codec allocates; PayloadEnd brings it
        try:
            buffers = call.sink(event)
        except InvalidArgumentError as exc:
            call.error, buffers = exc, None
        if buffers is None:
            self.conn.discard_payload()
        else:
            self.conn.set_payload_sink(buffers)
            call.receiving = True

    def _payload_end(self, end: PayloadEnd) -> None:
        call = self.calls[end.request_id]
        call.payload = end.data
        call.receiving = False
        self._finish(call)

    def _finish(self, call: Call) -> None:
        call.done = True
        self.calls.pop(call.request.request_id, None)

    def fail(self, error: KVOffloadError) -> None:
        """The connection is unusable: every outstanding call fails with `error`."""
        if self.broken is None:
            self.broken = error
        for call in self.calls.values():
            call.error = call.error or error
            call.done = True
        self.calls.clear()
