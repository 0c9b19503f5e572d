"""One connection of the native front (`NativeSession`).

A thin shell in the shape of h11's example servers: read into the codec's buffer, drain its
events, hand each request to its handler, write what they answer. The session owns the flow
control, the timeouts and how answers and errors go out; the handlers (`requests`, `puts`,
`nixl`) decide. They reach the session through its methods; it reaches them only through the
table its front hands it (`Host.handlers`), so neither side imports the other back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, TypeVar

from kvoffload.core import hot_gets_type
from kvoffload.errors import KVOffloadError, LocalProtocolError, RemoteProtocolError
from kvoffload.kvstore import BlockView, PutReservation
from kvoffload.nvmeof_target.channel import Channel, TlsChannel
from kvoffload.nvmeof_target.config import NativeConfig
from kvoffload.nvmeof_target.metrics import LATENCY_BUCKETS
from kvoffload.nvmeof_target.native.agent import NixlPeer
from kvoffload.nvmeof_target.services import Services
from kvoffload.nvmeof_target.session import OPS, TURN_STEPS, Instruments, Session
from kvoffload.nvmeof_target.tenants import HelloChallenge, Tenant
from kvoffload.wire import fast
from kvoffload.wire.native.connection import (
    NEED_DATA,
    ConnectionClosed,
    Delete,
    DeleteMany,
    Describe,
    ErrorReply,
    Event,
    Exists,
    Get,
    GetMany,
    Limits,
    Lookup,
    NativeConnection,
    NixlGet,
    PayloadEnd,
    Prefetch,
    Put,
    PutMany,
    Repair,
    Role,
    SinkFull,
)
from kvoffload.wire.native.frames import _State
from kvoffload.wire.status import Status, status_of

__all__ = ["FRONT", "CPut", "Handler", "Host", "NativeSession", "PendingPut"]

log = logging.getLogger("kvoffload.native")
FRONT = "native"
T = TypeVar("T")
# Request class -> its operation's name in the metrics, built once per class.
_OP_NAMES: dict[type[Event], str] = {}
# Requests naming keys a worker of a multi-worker daemon must hold (puts check as they reserve).
_KEYED: frozenset[type[Event]] = frozenset(
    {Get, Exists, Delete, GetMany, Lookup, Prefetch, NixlGet, Describe, DeleteMany}
)
# How the C reader callback hands back (`HotGets.arm`, hot.c): bytes left for the Python
# codec (or none, after answers the kernel did not take whole), EOF, a receive error, a raise.
_BACK_DATA, _BACK_EOF, _BACK_OSERROR, _BACK_RAISED = 0, 1, 2, 3


@dataclass
class PendingPut:
    """A put whose payload is arriving, value by value, into reservations.

    A value's slot is reserved only when its bytes are next in the stream (empty values at
    the end): a batch header that declares much and sends little must not pin, and evict for,
    more of the arena than one value.
    """

    request: Put | PutMany | Repair
    # (client key, length, client parent, block metadata: the client's, then what is stored)
    items: list[tuple[bytes, int, bytes | None, bytes | None]]
    reserved: dict[int, PutReservation] = dataclasses.field(default_factory=dict)  # index -> slot
    at: int = -1  # the item whose bytes are arriving
    error: KVOffloadError | None = None
    stored: bool = True  # a Repair's answer: False when the key was held or deleted lately

    def next_item(self) -> int:
        """The next item that carries bytes, after the one arriving."""
        return next(i for i in range(self.at + 1, len(self.items)) if self.items[i][1])

    @property
    def empty_items(self) -> list[int]:
        return [i for i, item in enumerate(self.items) if not item[1]]

    def abort(self) -> None:
        for reservation in self.reserved.values():
            reservation.abort()
        self.reserved.clear()


Handler = Callable[..., Awaitable[object] | None]
# A put the C reader callback took (`puts.c_put_begin`): request id, client key, length, client
# parent, stored block metadata, its reservation, its start (time.perf_counter).
CPut = tuple[int, bytes, int, bytes | None, bytes | None, PutReservation, float]


class Host(Protocol):
    """What a session needs of the front that accepted it (`front.NativeFront`)."""

    config: NativeConfig
    services: Services
    instruments: Instruments
    limits: Limits
    hello_limits: Limits
    tls_binding: bytes  # `hello_auth.tls_binding` of the front's certificate (b"": no TLS)
    # request type (and PayloadEnd, SinkFull) -> its handler
    handlers: Mapping[type[object], Handler]
    # The C reader callback's put (`HotGets.take_puts`): begin and commit (`puts.c_put_*`),
    # called with the session first; None: puts stay on the Python path.
    c_puts: tuple[Callable[..., object], Callable[..., object]] | None

    @property
    def connection_count(self) -> int: ...

    def forget(self, session: NativeSession) -> None: ...


class NativeSession(Session):
    """One client connection."""

    def __init__(self, front: Host, channel: Channel, peer: str) -> None:
        super().__init__(
            FRONT, front.services, channel, peer, front.instruments, front.config.frame_timeout_s
        )
        self.front = front
        self._handlers = front.handlers
        self.engine = front.services.engine
        self.config = front.config
        self.conn = NativeConnection(Role.SERVER, front.hello_limits)
        self.tenant: Tenant | None = None
        self.challenge: HelloChallenge | None = None  # sent, its Auth not yet received
        self.puts: dict[int, PendingPut] = {}  # request id -> its payload on the way
        self.shard = front.services.shard
        self.version = 0  # the protocol version of the accepted Hello
        self.nixl: NixlPeer | None = None  # the client's NIXL agent (protocol 3)
        self._created = self._last_rx = time.monotonic()
        self._frame_since: float | None = None
        self._hot: Any = None  # the C Get path (`start_hot`), once it may serve
        # Whether the last request was answered in C: only then does the next read go to the C
        # reader (`_read_in_c`). A connection that puts would hand back at every request, and
        # arming and handing back cost a put more than the Python read does.
        self._hot_last = False

    # ------------------------------------------------------------------ the loop

    async def _read_loop(self) -> None:
        if isinstance(self.channel, TlsChannel):
            await self.channel.handshake()
        while self._reading:
            if not await self._drain_events():
                return
            self._frame_since = (
                None if self.conn.at_frame_boundary else self._frame_since or time.monotonic()
            )
            if self._hot is not None and await self._read_in_c():
                continue
            buffer = self.conn.get_buffer()
            most = self.conn.read_size()
            n = await self.channel.recv_into(buffer[:most] if most else buffer)
            self._last_rx = time.monotonic()
            if n:
                self.conn.buffer_updated(n)
            else:
                self.conn.receive_eof()
            await self._next_step()  # a payload streaming in counts too

    async def _drain_events(self) -> bool:
        """Handle buffered events; False once the connection is done with reading."""
        conn, config = self.conn, self.config
        limit = config.max_inflight_bytes
        while self._reading:
            if not (  # room for another request (flow control), checked before each event
                conn.pending < config.max_pending
                and self._inflight_bytes < config.max_inflight_bytes
            ):
                self._room.clear()
                await self._room.wait()
                continue
            # Whole Get frames at the front answered in C (only with nothing outstanding, so
            # answers keep request order); then the flow control again before the next frame.
            # An empty buffer (a put just answered) has nothing for C: not asked.
            if (
                self._hot is not None
                and not conn.pending
                and conn._reader._end > conn._reader._start
            ):
                served = self._serve_hot(max(1, self._turn_left()))
                if served:
                    self._hot_last = True
                    await self._next_step(served)  # each counts: a pipeliner still yields
                    reader = conn._reader
                    if (
                        reader._start == reader._end
                        and self._inflight_bytes < limit
                        and not conn._eof
                    ):
                        return self._reading  # all served, room left: straight to the read
                    continue
            event = conn.next_event()
            if event is NEED_DATA:
                return True
            if isinstance(event, ConnectionClosed):
                return False
            if isinstance(event, PayloadEnd):
                waiting = self._handlers[PayloadEnd](self, event)
            elif isinstance(event, SinkFull):
                waiting = self._handlers[SinkFull](self, event)
            else:
                assert isinstance(event, Event)
                self._hot_last = False
                waiting = self._dispatch(event)
            if waiting is not None:
                await waiting  # engine work on the I/O threads that later requests must follow
            await self._next_step()
        return False

    def _dispatch(self, event: Event) -> Awaitable[object] | None:
        cls = type(event)
        op = _OP_NAMES.get(cls) or _OP_NAMES.setdefault(cls, cls.__name__.lower())
        self._started_now(event.request_id, op)
        try:
            if self.shard is not None and cls in _KEYED:  # puts are checked as they reserve
                keys = getattr(event, "keys", None)
                self.shard.check_all(keys if keys is not None else (getattr(event, "key", b""),))
            return self._handlers[cls](self, event)
        except KVOffloadError as exc:  # e.g. the engine closing under a stopping daemon
            self.fail(event.request_id, exc)
            return None

    def start_hot(self) -> None:
        """Hello accepted: serve this connection's reads of DRAM blocks in C from now on when
        that does exactly what the Python path does: the C core loaded, plain TCP (TLS
        decrypts in Python), a DRAM-only engine (a miss reads nothing back). On a worker of a
        multi-worker daemon C serves only frames whose keys are all this shard's (the same
        `shard_of`); a frame with another shard's key goes to `_dispatch`, which refuses it."""
        hot_type = hot_gets_type()
        if hot_type is None or isinstance(self.channel, TlsChannel):
            return
        if self.services.blocking_engine:
            return
        handles = self.engine.hot_handles()
        if handles is None:
            return
        self._hot = hot_type(handles.lock, handles.index, handles.counters, handles.manager,
                             handles.apply_touches, handles.free, handles.arena,
                             self.me.hasher, fast.frame_head, _State.HEAD,
                             handles.touch_ring, buckets=LATENCY_BUCKETS,
                             pins=self.services.answer_pins,
                             max_payload=self.config.max_payload_bytes,
                             step=self.engine.config.ssd.read_depth)  # fmt: skip
        if self.shard is not None:
            self._hot.set_shard(self.shard.index, self.shard.count)
        self._instruments.hot.add(self._hot)
        c_puts = self.front.c_puts
        if c_puts is not None:  # the reader callback takes canonical Puts too
            self._hot.take_puts(partial(c_puts[0], self), partial(c_puts[1], self))

    def _forget(self) -> None:
        if self._hot is not None:  # its last counts, then no more scrapes of it
            held = self._hot.take_put()
            if held is not None:  # a bug: every stop and hand-back takes it (`_stop_c_reader`)
                log.error("session %s forgotten with a put C held (request %d)",
                          self.peer, held[0][0])  # fmt: skip
                held[0][5].abort()
            self._hot.take_puts(None, None)  # (they hold the session: no cycle left)
            self._instruments.fold(self._hot)
            self._instruments.hot.discard(self._hot)
        self.front.forget(self)

    async def _read_in_c(self) -> bool:
        """Wait for the next requests with `HotGets` as the loop's reader of the socket (the C
        reader callback, hot.c) when the connection is idle at a frame boundary with nothing
        outstanding and its last request was answered in C; False (nothing done) otherwise.
        C receives into the codec's buffer and answers the hot frames itself, request after
        request, and hands back once with what it must not answer: the buffer is then as
        `recv_into` would have left it, and the step is counted as after a read. The same as
        the Python read loop in everything but cost."""
        conn, channel, hot = self.conn, self.channel, self._hot
        if (
            not self._hot_last
            or conn.pending
            or self._tasks
            or self._inflight_bytes
            or self.puts
            # after a large payload only a header is read, so that the payload lands in its
            # slot: C does the same (`small_read`) only when it takes puts itself
            or (conn.read_size() and self.front.c_puts is None)
            or not conn.idle_between_frames
        ):
            return False
        fd = channel.direct_fd()
        if fd < 0:
            return False
        hot.small_read = bool(conn.read_size())
        conn.get_buffer()  # all parsed: the buffer starts over at its usual size, as for a read
        back: asyncio.Future[tuple[int, Any]] = asyncio.get_running_loop().create_future()

        def handed_back(code: int, extra: object, got: Any) -> None:
            try:
                channel.unwatch()
                self._take_c_put()
            except Exception as exc:  # a bug: raised in the session, which logs and closes
                if code != _BACK_RAISED:  # (C's own error, if any, is the first cause)
                    code, extra = _BACK_RAISED, exc
            finally:
                self.services.hot_reader_handbacks += 1
                # The unsent rest of C's answers is queued now, not when the task resumes: a
                # cancellation between the two must not drop pinned bytes the client is
                # reading. (After an abort the channel is closed: the write unpins them.)
                if got is not None:
                    self._queue_rest(got)
                if not back.done():  # always: the session must not await it forever
                    back.set_result((code, extra))

        try:
            hot.arm(conn._reader, fd, max(1, TURN_STEPS - 1), self.config.max_inflight_bytes,
                    handed_back, self.services)  # fmt: skip
            channel.watch(hot)
            code, extra = await back
        finally:
            self._stop_c_reader()  # stopped or cut off while waiting (or arming failed)
        self._last_rx = max(self._last_rx, hot.last_rx)
        if code == _BACK_EOF:
            conn.receive_eof()
        elif code == _BACK_OSERROR:
            raise channel.broken(int(extra))
        elif code == _BACK_RAISED:
            raise extra
        self._steps = 0  # the loop went round while C read; what it served counts this turn
        await self._next_step(1 + ((extra or 0) if code == _BACK_DATA else 0))
        return True

    def _stop_c_reader(self) -> None:
        """No C reader callback runs after this (none runs the handback)."""
        hot = self._hot
        if hot is not None and hot.armed:
            hot.disarm()
            self.channel.unwatch()
        self._take_c_put()

    def _take_c_put(self) -> None:
        """A put whose payload C was receiving becomes the Python codec's (then finished,
        or abandoned on a stop or a closed connection, as the Python path's own)."""
        held = self._hot.take_put() if self._hot is not None else None
        if held is None:
            return
        put, got = held
        rid, key, length, parent, meta, reservation, _ = put
        if got < 0:  # C failed before it consumed the header: the frame is still the codec's
            reservation.abort()
            return
        event = Put(rid, key, length, parent)
        pending = PendingPut(event, [(key, length, parent, meta)], at=0)
        pending.reserved[0] = reservation
        self.puts[rid] = pending  # filed first: if what follows raises, `_abandon` aborts it
        self.admit_c_put(put, event)
        self.conn.resume_payload(Put.OP, rid, length, got)
        self.conn.set_payload_sink([reservation.buffer[got:]])

    def admit_c_put(self, put: CPut, event: Put | None = None) -> Put:
        """The codec learns of a put C took (as if it had parsed it), and its start counts."""
        rid, key, length, parent, _, _, t0 = put
        if event is None:
            event = Put(rid, key, length, parent)
        self.conn.admit(event)
        self.started_put(rid, t0)
        return event

    def answered_in_python(self) -> None:
        """A frame C took is answered in Python after all (a refused reservation): the next
        read is Python's, as after any request `_dispatch` handled (`_hot_last`)."""
        self._hot_last = False

    def started_put(self, request_id: int, t0: float) -> None:
        """`_started_now` for a put that started at `t0` (time.perf_counter)."""
        self._started[request_id] = ("put", t0)

    def stop_reading(self) -> None:
        # At once, not when the cancelled task next runs: the loop may already have the socket
        # readable in this iteration, and the Python read loop reads nothing after a stop.
        self._stop_c_reader()
        super().stop_reading()

    def abort(self) -> None:
        self._stop_c_reader()
        super().abort()

    def _queue_rest(self, got: Any) -> None:
        """What `HotGets.serve(..., fd)` could not send: queued, pinned and counted in flight
        until the kernel has it."""
        hot, parts, views, entries, size, taken = self._hot, got[0], got[1], got[2], got[5], got[6]
        self._inflight_bytes += size

        def sent() -> None:
            self._inflight_bytes -= size
            hot.release(views, entries, taken)
            self._wake()

        self.channel.write(parts, sent)

    def _serve_hot(self, most: int) -> int:
        """Answer up to `most` whole Get, GetMany, Exists and Lookup frames at the front of the
        buffer in C; how many it answered. With nothing queued on the socket C also sends the
        answers and counts them (folded into the metrics at scrape time), and unpins at once:
        only what the kernel does not take goes through the Channel."""
        hot, t0 = self._hot, time.perf_counter()
        reader, limit = self.conn._reader, self.config.max_inflight_bytes
        fd = self.channel.direct_fd()
        got = hot.serve(reader, self._inflight_bytes, limit, most, fd)
        if got is None:
            return 0
        parts, views, entries, (gets, exists, lookups, many), out_bytes, size, taken = got
        self.services.hot_gets += gets
        self.services.hot_exists += exists
        self.services.hot_lookups += lookups
        self.services.hot_get_manys += many
        if fd >= 0:
            if parts:  # a full socket: the rest waits in the Channel, pinned until sent
                self._queue_rest(got)
            return int(gets + exists + lookups + many)
        self._inflight_bytes += size
        self.bytes_out.inc(out_bytes)

        def done() -> None:
            self._inflight_bytes -= size
            hot.release(views, entries, taken)
            self._wake()

        # Counted before the write, as `_answer` does: a client that scrapes the metrics once
        # it has its answer must find its request there.
        histograms = []
        for op, count in zip(OPS[:4], (gets, exists, lookups, many), strict=True):
            if count:
                counter, histogram = self._instruments(op, "ok")
                counter.inc(count)
                histograms.append((histogram, count))
        self.channel.write(parts, done)
        elapsed = time.perf_counter() - t0  # the batch's time, as each request's latency
        for histogram, count in histograms:
            for _ in range(count):
                histogram.observe(elapsed)
        return int(gets + exists + lookups + many)

    def _wake(self) -> None:
        if (  # room again (as `_drain_events` checks it); inline: this runs twice per answer
            self.conn.pending < self.config.max_pending
            and self._inflight_bytes < self.config.max_inflight_bytes
        ):
            self._room.set()

    def overdue(self, now: float) -> str:
        """Why the watchdog should close this connection ("" if it should not)."""
        since = self._frame_since
        if since is None and self._hot is not None and self._hot.put_arriving:
            since = self._hot.put_started  # inside a put's payload, in C
        if since is not None and now - since > self.config.frame_timeout_s:
            return "frame timeout"
        if self.send_stalled(now):
            return "send timeout"
        if self.tenant is None and now - self._created > self.config.hello_timeout_s:
            return "hello timeout"
        # A put whose payload C receives is not in the codec yet: busy, as the Python path's
        busy = (
            self.conn.pending
            or self._tasks
            or self._inflight_bytes
            or (self._hot is not None and self._hot.put_arriving)
        )
        last_rx = self._last_rx if self._hot is None else max(self._last_rx, self._hot.last_rx)
        if not busy and now - last_rx > self.config.idle_timeout_s:
            return "idle timeout"
        return ""

    def _protocol_error(self, exc: RemoteProtocolError) -> None:
        self.peer_log.info("protocol error from %s: %s", self.peer, exc)
        self.say_goodbye(Status.PROTOCOL, str(exc))

    def _internal_error(self) -> None:
        self.say_goodbye(Status.INTERNAL, "internal error")

    def _abandon(self) -> None:
        for pending in self.puts.values():  # partially received puts never become visible
            pending.abort()
        self.puts.clear()
        if self.nixl is not None and self.services.nixl is not None:
            self.services.nixl.forget(self.nixl.name)  # its client's memory is out of reach
        self.nixl = None

    def drop_for_room(self) -> None:
        self.say_goodbye(Status.UNAVAILABLE, "too many connections without Hello")
        super().drop_for_room()

    def say_goodbye(self, status: Status, message: str) -> None:
        self._reading = False
        with contextlib.suppress(LocalProtocolError):
            self.channel.write(self.conn.send_parts(ErrorReply(0, status, message[:500])))

    # ------------------------------------------------------------------ answering

    def reply(
        self,
        event: Event,
        payload: Sequence[memoryview] = (),
        on_done: Callable[[], None] | None = None,
    ) -> None:
        try:
            parts = self.conn.send_parts(event, payload)
        except LocalProtocolError:
            if on_done is not None:
                on_done()
            raise
        status = "ok" if not isinstance(event, ErrorReply) else Status(event.status).name.lower()
        self._answer(event.request_id, parts, status, on_done)
        self._wake()

    def reply_get(self, request_id: int, view: BlockView | None) -> None:
        """Answer a Get with `view` (None: a miss): `reply` without building the answer
        event; the view is released once the kernel has its bytes."""
        if view is None:
            parts = self.conn.send_get_result(request_id, None)
            self._answer(request_id, parts, "ok")
        else:
            self.bytes_out.inc(len(view))
            try:
                parts = self.conn.send_get_result(request_id, len(view), (view.data,))
            except LocalProtocolError:
                view.release()
                raise
            self._answer(request_id, parts, "ok", view.release)
        self._wake()

    def reply_put_done(self, request_id: int) -> None:
        """Answer a Put: `reply(PutDone(request_id))` without building the event."""
        self._answer(request_id, self.conn.send_put_done(request_id), "ok")
        self._wake()

    def reply_put_done_hot(self, request_id: int, length: int) -> bool:
        """`bytes_in.inc(length)` and `reply_put_done(request_id)`, with the answer sent and
        counted in C (`HotGets.put_done`) while nothing is queued on the socket; False (nothing
        done) where C may not: the caller answers in Python."""
        hot = self._hot
        if hot is None:
            return False
        fd = self.channel.direct_fd()
        if fd < 0:
            return False
        parts = self.conn.send_put_done(request_id)
        _, t0 = self._started.pop(request_id, ("put", time.perf_counter()))
        rest = hot.put_done(parts, fd, t0, length)
        self.services.hot_put_answers += 1
        if self.front.c_puts is not None:
            self._hot_last = True  # the next put may come in C (`_read_in_c`)
        if rest:  # a full socket: the rest waits in the Channel, counted in flight until sent
            size = sum(map(len, rest))
            self._inflight_bytes += size

            def sent() -> None:
                self._inflight_bytes -= size
                self._wake()

            self.channel.write(rest, sent)
        self._wake()
        return True

    def reply_exists(self, request_id: int, found: bool) -> None:
        """Answer an Exists: `reply(ExistsResult(request_id, found))` without the event."""
        self._answer(request_id, self.conn.send_exists_result(request_id, found), "ok")
        self._wake()

    def fail(self, request_id: int, exc: KVOffloadError) -> None:
        self.reply(ErrorReply(request_id, status_of(exc), str(exc)[:1000]))

    def offload_request(
        self, request_id: int, work: Callable[[], T], then: Callable[[T], None]
    ) -> None:
        """Run `work` on the I/O threads (it may block), then `then(result)` on the loop."""
        self.offload(work, then, partial(self.fail, request_id))

    def read_request(
        self, request_id: int, work: Callable[[], T], then: Callable[[T], None]
    ) -> None:
        """Run an engine read inline, or on the I/O threads when it may wait on a device."""
        self.read(work, then, partial(self.fail, request_id))

    @property
    def tls_binding(self) -> bytes:
        """What a Hello proof on this connection is bound to (b"" without TLS)."""
        return self.front.tls_binding if isinstance(self.channel, TlsChannel) else b""

    @property
    def me(self) -> Tenant:
        assert self.tenant is not None  # the codec admits nothing before Hello
        return self.tenant
