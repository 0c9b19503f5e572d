"""The native protocol (DESIGN §5), sans-I/O: events in, bytes out, and back.

One `NativeConnection` per TCP connection and side, shaped like h11's `Connection`:
`receive_data` (or `get_buffer` / `buffer_updated`), `next_event`, `send` / `send_parts`,
`send_failed`. Requests are pipelined and multiplexed: each carries a request id, answers may come
back in any order, and the connection tracks which ids are outstanding and which answer each
request admits. The messages themselves are in `native_events` (re-exported here).

A frame that carries a payload (a put, a get's answer) yields its event as soon as its header is
in, with `payload_length`; the receiver then chooses where the payload goes (`set_payload_sink`),
drops it (`discard_payload`) or lets the connection allocate, and a `PayloadEnd` event follows
once the last byte is in (or takes it piece by piece: `set_payload_part`, and a `SinkFull`
event asks for the next piece's memory). Byte-at-a-time feeding yields exactly the same events.

Operations (request -> answer): Hello -> Welcome, Put -> PutDone, Get -> GetResult,
Exists -> ExistsResult, Delete -> DeleteResult, PutMany -> PutManyDone, GetMany -> GetManyResult,
Lookup -> LookupResult, Prefetch -> PrefetchResult, Stats -> StatsResult, from version 3
NixlMemory -> NixlMemoryDone, NixlGet -> NixlGetResult, NixlPut -> NixlPutDone, and from version 5
Repair -> RepairDone, Describe -> Described, DeleteMany -> DeleteManyResult, and a Hello with a
nonce -> Challenge, then Auth -> Welcome (`wire.hello_auth`); any request may be
answered with ErrorReply instead. ErrorReply with request id 0 concerns the whole connection
(the sender closes it next).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from kvoffload.errors import LocalProtocolError, RemoteProtocolError
from kvoffload.wire import fast as _fast
from kvoffload.wire.native.events import (
    _ALSO,
    _ANSWER,
    AUTH_VERSION,
    KEY_BYTES,
    META_VERSION,
    NEED_DATA,
    NIXL_DEADLINE_VERSION,
    NIXL_PROOF_PREFIX,
    NIXL_VERSION,
    PROTOCOL_VERSION,
    PROTOCOL_VERSIONS,
    REPAIR_HOLD_S,
    REPAIR_MAX_AGE_S,
    REPAIR_VERSION,
    TIER_LOOKUP_VERSION,
    TOMBSTONE_RETENTION_S,
    Auth,
    Challenge,
    ConnectionClosed,
    Delete,
    DeleteMany,
    DeleteManyResult,
    DeleteResult,
    Describe,
    Described,
    ErrorReply,
    Event,
    Exists,
    ExistsResult,
    Get,
    GetMany,
    GetManyResult,
    GetResult,
    Hello,
    Lookup,
    LookupResult,
    NixlGet,
    NixlGetResult,
    NixlMemory,
    NixlMemoryDone,
    NixlPut,
    NixlPutDone,
    Prefetch,
    PrefetchResult,
    Put,
    PutDone,
    PutMany,
    PutManyDone,
    Repair,
    RepairDone,
    Stats,
    StatsResult,
    Welcome,
    _decode,
)
from kvoffload.wire.native.frames import (
    FLAG_RESPONSE,
    HEAD_READ,
    Frame,
    FrameReader,
    Limits,
    Need,
    PayloadEnd,
    SinkFull,
    encode_frame,
)

__all__ = [
    "AUTH_VERSION",
    "KEY_BYTES",
    "META_VERSION",
    "NEED_DATA",
    "NIXL_DEADLINE_VERSION",
    "NIXL_PROOF_PREFIX",
    "NIXL_VERSION",
    "PROTOCOL_VERSION",
    "PROTOCOL_VERSIONS",
    "REPAIR_HOLD_S",
    "REPAIR_MAX_AGE_S",
    "REPAIR_VERSION",
    "TOMBSTONE_RETENTION_S",
    "TIER_LOOKUP_VERSION",
    "Auth",
    "Challenge",
    "ConnectionClosed",
    "Delete",
    "DeleteMany",
    "DeleteManyResult",
    "DeleteResult",
    "Describe",
    "Described",
    "ErrorReply",
    "Event",
    "Exists",
    "ExistsResult",
    "Get",
    "GetMany",
    "GetManyResult",
    "GetResult",
    "Hello",
    "Limits",
    "Lookup",
    "LookupResult",
    "NativeConnection",
    "NixlGet",
    "NixlGetResult",
    "NixlMemory",
    "NixlMemoryDone",
    "NixlPut",
    "NixlPutDone",
    "PayloadEnd",
    "Prefetch",
    "PrefetchResult",
    "Put",
    "PutDone",
    "PutMany",
    "PutManyDone",
    "Repair",
    "RepairDone",
    "Role",
    "SinkFull",
    "Stats",
    "StatsResult",
    "Welcome",
]

# The events the C fast path builds (fast.KINDS).
_fast.register({c.__name__: c for c in (Get, Exists, Put, GetResult, PutDone, ExistsResult)})

# ---------------------------------------------------------------------------- the connection


class Role(enum.Enum):
    CLIENT = "client"
    SERVER = "server"


class _Phase(enum.Enum):
    AWAIT_HELLO = "await hello"
    AWAIT_AUTH = "await auth"  # a Hello asked for a Challenge: only Auth may follow
    READY = "ready"
    BROKEN = "broken"


class NativeConnection:
    """One side of one native-protocol connection; no I/O.

    Rules it enforces, on what it sends (LocalProtocolError) and on what it receives
    (RemoteProtocolError): the client's first request is Hello; request ids are unique among
    outstanding requests and non-zero; every answer matches an outstanding request and its kind;
    at most `limits.max_pending` requests are outstanding; declared lengths are within limits.
    After a received violation the connection is broken and keeps raising.
    """

    def __init__(self, role: Role, limits: Limits | None = None) -> None:
        self.role = role
        self.limits = limits or Limits()
        self._reader = FrameReader(self.limits)
        self._phase_in = _Phase.AWAIT_HELLO  # what a client may send next (server side)
        self._phase_out = _Phase.AWAIT_HELLO  # what we may send next (client side)
        self._pending: dict[int, type[Event]] = {}  # request id -> request class
        self._eof = False
        self._error: RemoteProtocolError | None = None

    def set_limits(self, limits: Limits) -> None:
        """Bound what the peer may declare from the next frame on (a server accepts only a
        small Hello from a peer it does not know yet)."""
        self.limits = limits
        self._reader.limits = limits

    # ------------------------------------------------------------------ receiving

    def get_buffer(self) -> memoryview:
        """Memory to receive the next bytes into (see FrameReader.get_buffer)."""
        return self._reader.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self._reader.buffer_updated(nbytes)

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Feed received bytes; `b""` means the peer closed its side."""
        if not data:
            self._eof = True
            return
        self._reader.receive_data(data)

    def receive_eof(self) -> None:
        self._eof = True

    @property
    def peer_closed(self) -> bool:
        """The peer closed its side (whether or not at a frame boundary)."""
        return self._eof

    def set_payload_sink(self, buffers: Sequence[memoryview]) -> None:
        """Put the payload of the event just returned into `buffers` (sizes must add up)."""
        self._reader.set_sink(buffers)

    def set_payload_part(self, buffers: Sequence[memoryview]) -> None:
        """Put the next bytes of the payload into `buffers`, which may hold less than what
        remains; a `SinkFull` event follows when they are full."""
        self._reader.set_sink(buffers, part=True)

    def discard_payload(self) -> None:
        """Drop the payload of the event just returned without storing it."""
        self._reader.discard()

    def next_event(self) -> Event | PayloadEnd | SinkFull | ConnectionClosed | Need:
        """The next event, `NEED_DATA`, or `ConnectionClosed` after a clean EOF.

        Raises:
            RemoteProtocolError: the peer broke the protocol; the connection is unusable.
        """
        if self._error is not None:
            raise self._error
        try:
            parse = _fast.parse_frame
            if parse is not None:
                fast = self._reader.take_parsed(parse)
                if fast is not None:
                    self._admit(fast)  # type: ignore[arg-type]
                    return fast  # type: ignore[return-value]
            item = self._reader.next_frame()
            if isinstance(item, Frame):
                event = _decode(item)
                self._admit(event)
                return event
            if isinstance(item, (PayloadEnd, SinkFull)):
                return item
            if self._eof:
                if not self._reader.at_boundary:
                    raise LocalProtocolError("connection closed in the middle of a frame")
                return ConnectionClosed()
            return item
        except LocalProtocolError as exc:
            self._phase_in = _Phase.BROKEN
            self._error = RemoteProtocolError(str(exc))
            raise self._error from None

    def admit(self, event: Event) -> None:
        """Record a request whose frame someone else parsed (the daemon's C reader takes
        canonical Puts), as `next_event` records what it parses.

        Raises:
            LocalProtocolError: as `next_event` would (the request is not allowed now).
        """
        self._admit(event)

    def resume_payload(self, op: int, request_id: int, length: int, got: int) -> None:
        """The frame of request `request_id` (`op`, `length` payload bytes) was parsed by
        someone else, who took `got` of its payload bytes: the rest comes next, and a sink or
        a discard is chosen for it as after `next_event` returned it."""
        if not 0 <= got < length:
            raise LocalProtocolError(f"{got} of a {length}-byte payload taken: none left")
        self._reader.resume_payload(op, request_id, length, got)

    def _admit(self, event: Event) -> None:
        """Check a received event against the connection state and record it."""
        if (self.role is Role.SERVER) == event.RESPONSE:
            raise LocalProtocolError(f"{type(event).__name__} sent the wrong way")
        if event.RESPONSE:
            self._settle(event)
            return
        self._phase_in = self._next_phase(self._phase_in, event)
        self._open(event)

    @staticmethod
    def _next_phase(phase: _Phase, request: Event) -> _Phase:
        """The phase after `request` (sent or received) in `phase`.

        Raises:
            LocalProtocolError: `request` is not allowed in `phase`.
        """
        name = type(request).__name__
        if phase is _Phase.AWAIT_HELLO and not isinstance(request, Hello):
            raise LocalProtocolError(f"{name} before Hello (the first request must be Hello)")
        if phase is _Phase.AWAIT_AUTH and not isinstance(request, Auth):
            raise LocalProtocolError(f"{name} before Auth (the Hello asked for a Challenge)")
        if phase is _Phase.READY and isinstance(request, Hello):
            raise LocalProtocolError("second Hello on one connection")
        if phase is not _Phase.AWAIT_AUTH and isinstance(request, Auth):
            raise LocalProtocolError("Auth without a Challenge to answer")
        if isinstance(request, Hello) and request.challenges:
            return _Phase.AWAIT_AUTH
        return _Phase.READY

    def _open(self, request: Event) -> None:
        if request.request_id in self._pending:
            raise LocalProtocolError(f"request id {request.request_id} is already outstanding")
        if len(self._pending) >= self.limits.max_pending:
            raise LocalProtocolError(
                f"more than {self.limits.max_pending} requests outstanding on one connection"
            )
        self._pending[request.request_id] = type(request)

    def _settle(self, answer: Event) -> None:
        if answer.request_id == 0 and isinstance(answer, ErrorReply):
            return  # connection-level error: the sender closes next
        request = self._pending.get(answer.request_id)
        if request is None:
            raise LocalProtocolError(f"answer to unknown request id {answer.request_id}")
        if not isinstance(answer, (ErrorReply, _ANSWER[request], _ALSO.get(request, ErrorReply))):
            raise LocalProtocolError(
                f"{type(answer).__name__} answers a {request.__name__} request"
            )
        del self._pending[answer.request_id]

    # ------------------------------------------------------------------ sending

    def send_parts(self, event: Event, payload: Sequence[object] = ()) -> list[bytes | memoryview]:
        """The buffers that carry `event` (payload parts are referenced, not copied).

        Raises:
            LocalProtocolError: the event is not allowed now, or the payload's size does not
                match what the event declares.
        """
        if self._phase_out is _Phase.BROKEN:
            raise LocalProtocolError("the connection failed; open a new one")
        parts = encode_frame(
            event.OP,
            FLAG_RESPONSE if event.RESPONSE else 0,
            event.request_id,
            event.meta(),
            payload,  # type: ignore[arg-type]
        )
        sent = 0
        for part in parts[1:]:
            sent += len(part)
        if sent != event.payload_length:
            raise LocalProtocolError(
                f"{type(event).__name__} declares {event.payload_length} payload bytes, got {sent}"
            )
        if (self.role is Role.SERVER) != event.RESPONSE:
            raise LocalProtocolError(f"a {self.role.value} cannot send {type(event).__name__}")
        if event.RESPONSE:
            self._settle(event)
        else:
            phase = self._next_phase(self._phase_out, event)
            self._open(event)
            self._phase_out = phase
        return parts

    def send_get_result(
        self, request_id: int, length: int | None, payload: Sequence[memoryview] = ()
    ) -> list[bytes | memoryview]:
        """`send_parts(GetResult(request_id, length), payload)`, byte for byte, without
        building the event and its map (the daemon's most common answer). Anything unusual
        (not an outstanding Get, a payload of another size) takes `send_parts`, which says
        what is wrong.

        Raises:
            LocalProtocolError: as `send_parts`.
        """
        parts: list[bytes | memoryview] = [b""]
        size = 0
        for part in payload:
            if len(part):
                parts.append(part)
                size += part.nbytes
        if size != (length or 0) or not self._may_answer(request_id, Get):
            return self.send_parts(GetResult(request_id, length), payload)
        del self._pending[request_id]
        parts[0] = _fast.frame_head(GetResult.OP, request_id, "length", length, size)
        return parts

    def send_put_done(self, request_id: int) -> list[bytes | memoryview]:
        """`send_parts(PutDone(request_id))`, byte for byte, without building the event.

        Raises:
            LocalProtocolError: as `send_parts`.
        """
        if not self._may_answer(request_id, Put):
            return self.send_parts(PutDone(request_id))
        del self._pending[request_id]
        return [_fast.frame_head(PutDone.OP, request_id, None, None, 0)]

    def send_exists_result(self, request_id: int, found: bool) -> list[bytes | memoryview]:
        """`send_parts(ExistsResult(request_id, found))`, byte for byte, without the event.

        Raises:
            LocalProtocolError: as `send_parts`.
        """
        if type(found) is not bool or not self._may_answer(request_id, Exists):
            return self.send_parts(ExistsResult(request_id, found))
        del self._pending[request_id]
        return [_fast.frame_head(ExistsResult.OP, request_id, "found", found, 0)]

    def _may_answer(self, request_id: int, asked: type[Event]) -> bool:
        """A server may answer `request_id`, an outstanding `asked` request, now."""
        return (
            self._pending.get(request_id) is asked
            and self.role is Role.SERVER
            and self._phase_out is not _Phase.BROKEN
        )

    def send(self, event: Event, payload: Sequence[object] = ()) -> bytes:
        """`send_parts` joined into one bytes object (copies the payload)."""
        return b"".join(self.send_parts(event, payload))

    def send_failed(self) -> None:
        """The transport failed while sending; nothing more may be sent."""
        self._phase_out = _Phase.BROKEN

    # ------------------------------------------------------------------ introspection

    @property
    def pending(self) -> int:
        """Requests sent (client) or received (server) and not yet answered."""
        return len(self._pending)

    @property
    def at_frame_boundary(self) -> bool:
        """No partial frame is buffered (payloads included)."""
        return self._reader.at_boundary

    def read_size(self) -> int:
        """How much the next read should take: 0 for all `get_buffer` offers, or `HEAD_READ`
        between frames after a large payload (its successor's payload then goes straight
        into its sink, uncopied; a small frame still comes whole)."""
        return HEAD_READ if self._reader.after_large_payload else 0

    @property
    def idle_between_frames(self) -> bool:
        """Nothing partial buffered and no EOF to report: `next_event` would say NEED_DATA."""
        return self._reader.at_boundary and not self._eof

    @property
    def idle(self) -> bool:
        """Nothing outstanding and no partial frame buffered."""
        return not self._pending and self._reader.at_boundary
