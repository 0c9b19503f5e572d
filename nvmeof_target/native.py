"""The native front: the native protocol (client_sdk/wire/native.py) over TCP, on the engine.

A thin shell in the shape of h11's example servers: read into the codec's buffer, drain its
events, call the engine, write the answers. Payloads never pass through Python objects: a put's
bytes are received straight into the slot that `Engine.reserve` hands out, and a get's bytes are
sent straight from the pinned `BlockView`, which is released once the kernel has them.

Bad input closes only the connection that sent it (after an ErrorReply with request id 0 when
the connection can still carry one). Memory per connection is bounded: the codec's buffer, a
limit on requests in progress and on answer bytes queued (reading stops while over either), and
timeouts for idle connections and for frames that trickle in.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, TypeVar

from kvoffload import __version__
from kvoffload.client_sdk.wire.native import (
    NEED_DATA,
    PROTOCOL_VERSION,
    ConnectionClosed,
    Delete,
    DeleteResult,
    ErrorReply,
    Event,
    Exists,
    ExistsResult,
    Get,
    GetMany,
    GetManyResult,
    GetResult,
    Hello,
    Limits,
    Lookup,
    LookupResult,
    NativeConnection,
    PayloadEnd,
    Prefetch,
    PrefetchResult,
    Put,
    PutDone,
    PutMany,
    PutManyDone,
    Role,
    SinkFull,
    Stats,
    StatsResult,
    Welcome,
)
from kvoffload.client_sdk.wire.status import Status, status_of
from kvoffload.errors import (
    AuthError,
    KVOffloadError,
    LocalProtocolError,
    RemoteProtocolError,
)
from kvoffload.kvstore import BlockView, PutReservation
from kvoffload.nvmeof_target.channel import Channel, TlsChannel
from kvoffload.nvmeof_target.config import Config, NativeConfig
from kvoffload.nvmeof_target.services import Services
from kvoffload.nvmeof_target.session import Instruments, Session, stop_sessions
from kvoffload.nvmeof_target.tenants import Tenant

__all__ = ["NativeFront", "make_front"]

log = logging.getLogger("kvoffload.native")
FRONT = "native"
# Largest frame header accepted before Hello (a Hello with a long token fits easily).
HELLO_HEADER_BYTES = 16 << 10
T = TypeVar("T")


def make_front(config: Config, services: Services) -> NativeFront | None:
    return NativeFront(config.native, services) if config.native.enabled else None


@dataclass
class _PendingPut:
    """A put whose payload is arriving, value by value, into reservations.

    A value's slot is reserved only when its bytes are next in the stream (empty values at
    the end): a batch header that declares much and sends little must not pin, and evict for,
    more of the arena than one value.
    """

    request: Put | PutMany
    items: list[tuple[bytes, int, bytes | None]]  # (client key, length, client parent)
    reserved: dict[int, PutReservation] = dataclasses.field(default_factory=dict)  # index -> slot
    at: int = -1  # the item whose bytes are arriving
    error: KVOffloadError | None = None

    def next_item(self) -> int:
        """The next item that carries bytes, after the one arriving."""
        return next(i for i in range(self.at + 1, len(self.items)) if self.items[i][1])

    @property
    def empty_items(self) -> list[int]:
        return [i for i, (_, length, _) in enumerate(self.items) if not length]

    def abort(self) -> None:
        for reservation in self.reserved.values():
            reservation.abort()
        self.reserved.clear()


class NativeFront:
    """Listens for native-protocol connections and serves each in its own task."""

    name = FRONT

    def __init__(self, config: NativeConfig, services: Services) -> None:
        self.config = config
        self.services = services
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._sessions: dict[_Session, asyncio.Task[None]] = {}
        self._tls: ssl.SSLContext | None = None
        self.instruments = Instruments(services.metrics, FRONT)
        self.limits = Limits(
            max_header_bytes=config.max_header_bytes,
            max_payload_bytes=config.max_payload_bytes,
            # The session stops pulling requests at max_pending; the codec's own bound is only
            # a backstop, never reached by the session's flow control.
            max_pending=config.max_pending + 1,
        )
        # Until its Hello is accepted a connection may only send a small header and no payload:
        # a stranger must not make the daemon wait for (and buffer) a 4 MiB header.
        self.hello_limits = replace(
            self.limits,
            max_header_bytes=min(HELLO_HEADER_BYTES, config.max_header_bytes),
            max_payload_bytes=0,
        )

    async def start(self) -> list[tuple[str, str, int]]:
        if self.config.tls.enabled:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(self.config.tls.cert_file, self.config.tls.key_file or None)
            self._tls = context
        listener = socket.create_server(
            (self.config.host, self.config.port), backlog=self.config.backlog, reuse_port=False
        )
        listener.setblocking(False)
        self._listener = listener
        loop = asyncio.get_running_loop()
        self._accept_task = loop.create_task(self._accept(listener))
        self._watchdog = loop.create_task(self._watch())
        host, port = listener.getsockname()[:2]
        return [(FRONT + ("+tls" if self._tls else ""), str(host), int(port))]

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        metrics = self.services.metrics
        while True:
            try:
                sock, peer = await loop.sock_accept(listener)
            except OSError as exc:  # EMFILE and friends: back off, keep the listener
                log.warning("accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            metrics.connections_total.labels(FRONT).inc()
            if len(self._sessions) >= self.config.max_connections:
                metrics.refused.labels(FRONT, "too many connections").inc()
                _refuse(sock, "too many connections")
                continue
            channel: Channel = (
                TlsChannel(sock, loop, self._tls) if self._tls else Channel(sock, loop)
            )
            session = _Session(self, channel, f"{peer[0]}:{peer[1]}")
            self._sessions[session] = loop.create_task(session.run())

    async def _watch(self) -> None:
        """Close connections that sit idle or trickle a frame in for too long."""
        interval = max(
            0.02, min(1.0, self.config.idle_timeout_s / 4, self.config.frame_timeout_s / 4)
        )
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for session in list(self._sessions):
                reason = session.overdue(now)
                if reason:
                    self.services.metrics.refused.labels(FRONT, reason).inc()
                    log.info("closing %s: %s", session.peer, reason)
                    session.say_goodbye(Status.DEADLINE, reason)
                    session.abort()

    def forget(self, session: _Session) -> None:
        self._sessions.pop(session, None)

    async def stop(self, timeout: float) -> None:
        for task in (self._accept_task, self._watchdog):
            if task is not None:
                task.cancel()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        await stop_sessions(self._sessions, timeout)


def _refuse(sock: socket.socket, why: str) -> None:
    """Tell a connection we will not serve it (best effort, never blocking) and close it."""
    conn = NativeConnection(Role.SERVER)
    try:
        sock.setblocking(False)
        sock.send(conn.send(ErrorReply(0, Status.UNAVAILABLE, why)))
    except OSError:
        pass
    sock.close()


class _Session(Session):
    """One client connection."""

    def __init__(self, front: NativeFront, channel: Channel, peer: str) -> None:
        super().__init__(
            FRONT, front.services, channel, peer, front.instruments, front.config.frame_timeout_s
        )
        self.front = front
        self.engine = front.services.engine
        self.config = front.config
        self.conn = NativeConnection(Role.SERVER, front.hello_limits)
        self.tenant: Tenant | None = None
        self._puts: dict[int, _PendingPut] = {}
        self._created = self._last_rx = time.monotonic()
        self._frame_since: float | None = None

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
            n = await self.channel.recv_into(self.conn.get_buffer())
            self._last_rx = time.monotonic()
            if n:
                self.conn.buffer_updated(n)
            else:
                self.conn.receive_eof()

    async def _drain_events(self) -> bool:
        """Handle buffered events; False once the connection is done with reading."""
        while self._reading:
            if not self._has_room():
                self._room.clear()
                await self._room.wait()
                continue
            event = self.conn.next_event()
            if event is NEED_DATA:
                return True
            if isinstance(event, ConnectionClosed):
                return False
            if isinstance(event, PayloadEnd):
                waiting = self._payload_end(event)
            elif isinstance(event, SinkFull):
                waiting = self._payload_part(event)
            else:
                assert isinstance(event, Event)
                waiting = self._dispatch(event)
            if waiting is not None:
                await waiting  # engine work on the I/O threads that later requests must follow
        return False

    def _dispatch(self, event: Event) -> Awaitable[object] | None:
        self._started_now(event.request_id, type(event).__name__.lower())
        try:
            return _HANDLERS[type(event)](self, event)
        except KVOffloadError as exc:  # e.g. the engine closing under a stopping daemon
            self._fail(event.request_id, exc)
            return None

    def _has_room(self) -> bool:
        return (
            self.conn.pending < self.config.max_pending
            and self._inflight_bytes < self.config.max_inflight_bytes
        )

    def _wake(self) -> None:
        if self._has_room():
            self._room.set()

    def overdue(self, now: float) -> str:
        """Why the watchdog should close this connection ("" if it should not)."""
        if self._frame_since is not None and now - self._frame_since > self.config.frame_timeout_s:
            return "frame timeout"
        if self.send_stalled(now):
            return "send timeout"
        if self.tenant is None and now - self._created > self.config.hello_timeout_s:
            return "hello timeout"
        busy = self.conn.pending or self._tasks or self._inflight_bytes
        if not busy and now - self._last_rx > self.config.idle_timeout_s:
            return "idle timeout"
        return ""

    def _protocol_error(self, exc: RemoteProtocolError) -> None:
        log.info("protocol error from %s: %s", self.peer, exc)
        self.say_goodbye(Status.PROTOCOL, str(exc))

    def _internal_error(self) -> None:
        self.say_goodbye(Status.INTERNAL, "internal error")

    def _abandon(self) -> None:
        for pending in self._puts.values():  # partially received puts never become visible
            pending.abort()
        self._puts.clear()

    def _forget(self) -> None:
        self.front.forget(self)

    def say_goodbye(self, status: Status, message: str) -> None:
        self._reading = False
        with contextlib.suppress(LocalProtocolError):
            self.channel.write(self.conn.send_parts(ErrorReply(0, status, message[:500])))

    # ------------------------------------------------------------------ answering

    def _reply(
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

    def _fail(self, request_id: int, exc: KVOffloadError) -> None:
        self._reply(ErrorReply(request_id, status_of(exc), str(exc)[:1000]))

    def _offload(self, request_id: int, work: Callable[[], T], then: Callable[[T], None]) -> None:
        """Run `work` on the I/O threads (it may block), then `then(result)` on the loop."""
        self.offload(work, then, partial(self._fail, request_id))

    def _read(self, request_id: int, work: Callable[[], T], then: Callable[[T], None]) -> None:
        """Run an engine read inline, or on the I/O threads when it may wait on a device."""
        self.read(work, then, partial(self._fail, request_id))

    @property
    def _me(self) -> Tenant:
        assert self.tenant is not None  # the codec admits nothing before Hello
        return self.tenant

    # ------------------------------------------------------------------ handlers

    def _on_hello(self, event: Hello) -> None:
        if event.version != PROTOCOL_VERSION:
            self._fail(
                event.request_id,
                RemoteProtocolError(
                    f"protocol version {event.version} is not supported (this daemon speaks "
                    f"{PROTOCOL_VERSION})"
                ),
            )
            self._reading = False
            return
        try:
            self.tenant = self.services.tenants.authenticate(event.token)
        except AuthError as exc:
            self.services.metrics.auth_failures.labels(FRONT).inc()
            log.info("refused %s: %s", self.peer, exc)
            self._fail(event.request_id, exc)
            self._reading = False  # nothing pipelined behind a refused Hello is served
            return
        self.conn.set_limits(self.front.limits)
        self._reply(
            Welcome(
                event.request_id,
                PROTOCOL_VERSION,
                self.tenant.name,
                self.engine.max_value_bytes,
                self.config.max_payload_bytes,
                server=f"kvoffload {__version__}",
            )
        )

    def _on_put(self, event: Put) -> Awaitable[object] | None:
        return self._begin_put(event, [(event.key, event.length, event.parent)])

    def _on_put_many(self, event: PutMany) -> Awaitable[object] | None:
        parents = event.parents or (None,) * len(event.keys)
        return self._begin_put(event, list(zip(event.keys, event.lengths, parents, strict=True)))

    def _begin_put(
        self, event: Put | PutMany, items: list[tuple[bytes, int, bytes | None]]
    ) -> Awaitable[object] | None:
        pending = _PendingPut(event, items)
        if not event.payload_length:
            return self._reserve_then(pending, pending.empty_items, self._end_put)
        self._puts[event.request_id] = pending
        pending.at = pending.next_item()
        return self._reserve_then(pending, [pending.at], self._sink)

    def _payload_part(self, full: SinkFull) -> Awaitable[object] | None:
        """One value's bytes are in: reserve the next one's slot and receive into it."""
        pending = self._puts[full.request_id]
        pending.at = pending.next_item()
        return self._reserve_then(pending, [pending.at], self._sink)

    def _payload_end(self, end: PayloadEnd) -> Awaitable[object] | None:
        pending = self._puts.pop(end.request_id, None)
        if pending is None:
            return None
        return self._reserve_then(pending, pending.empty_items, self._end_put)

    def _reserve_then(
        self,
        pending: _PendingPut,
        items: list[int],
        then: Callable[[_PendingPut], Awaitable[object] | None],
    ) -> Awaitable[object] | None:
        reserve = partial(self._reserve, pending, items)
        if not self.services.blocking_engine:
            return then(reserve())
        return self._reserve_off_loop(reserve, then)

    async def _reserve_off_loop(
        self,
        reserve: Callable[[], _PendingPut],
        then: Callable[[_PendingPut], Awaitable[object] | None],
    ) -> None:
        # Reserving may evict, which writes blocks to the SSD: not on the loop. The payload that
        # follows has nowhere to go until it is done, so this connection's reader waits.
        waiting = then(await self.off_loop(reserve, _PendingPut.abort))
        if waiting is not None:
            await waiting

    def _reserve(self, pending: _PendingPut, items: list[int]) -> _PendingPut:
        """Reserve the slots of `items` (on any thread); a failure gives back every slot of the
        put and is kept in `error`."""
        if pending.error is not None or not items:
            return pending
        me = self._me
        try:
            for i in items:
                key, length, parent = pending.items[i]
                pending.reserved[i] = self.engine.reserve(
                    me.key(key),
                    length,
                    parent=me.opt_key(parent),
                    durable=pending.request.durable,
                    tenant=me.name,
                )
        except KVOffloadError as exc:
            pending.abort()
            pending.error = exc
        return pending

    def _sink(self, pending: _PendingPut) -> None:
        """Receive the arriving value into its slot (or drop the rest after a failure)."""
        if pending.error is None:
            self.conn.set_payload_part([pending.reserved[pending.at].buffer])
        else:
            self.conn.discard_payload()

    def _end_put(self, pending: _PendingPut) -> Awaitable[object] | None:
        rid = pending.request.request_id
        if pending.error is not None:
            self._fail(rid, pending.error)
            return None
        answer: Event = PutDone(rid) if isinstance(pending.request, Put) else PutManyDone(rid)

        events = self.services.events
        me = self._me
        keys = [(me.key(key), key, parent) for key, _, parent in pending.items]
        reservations = [pending.reserved[i] for i in range(len(pending.items))]
        if events is not None:
            for engine_key, key, parent in keys:
                events.expect(engine_key, key, parent, me.name)

        def commit() -> None:
            try:
                for reservation in reservations:
                    reservation.commit()
            finally:
                for reservation in reservations:
                    reservation.abort()  # no-op for the committed ones
                if events is not None:
                    for engine_key, _, _ in keys:
                        events.settle(engine_key)

        def done(_: None) -> None:
            self.services.metrics.bytes_in.labels(FRONT).inc(pending.request.payload_length)
            self._reply(answer)

        if pending.request.durable:
            # A durable commit waits for the SSD and the journal: off the loop, and the reader
            # goes on meanwhile (a get pipelined behind it may miss it).
            self._offload(rid, commit, done)
            return None
        return self.in_order(commit, done, partial(self._fail, rid))

    def _on_get(self, event: Get) -> None:
        key = self._me.key(event.key)

        def send(view: BlockView | None) -> None:
            if view is None:
                self._reply(GetResult(event.request_id, None))
                return
            self.services.metrics.bytes_out.labels(FRONT).inc(len(view))
            self._reply(GetResult(event.request_id, len(view)), [view.data], view.release)

        self._read(event.request_id, lambda: self.engine.get(key), send)

    def _on_get_many(self, event: GetMany) -> None:
        keys = self._me.keys(event.keys)
        budget = self.config.max_payload_bytes

        def fetch() -> list[BlockView | None]:
            views: list[BlockView | None] = []
            total = 0
            try:
                for key in keys:
                    view = self.engine.get(key)
                    if view is not None and views and total + len(view) > budget:
                        view.release()  # answer a prefix; the client asks again for the rest
                        break
                    total += len(view) if view is not None else 0
                    views.append(view)
            except BaseException:
                # A get that fails part-way (a promotion finding every DRAM block pinned, some
                # by this very request) must not leave the views taken so far pinned for good.
                for view in views:
                    if view is not None:
                        view.release()
                raise
            return views

        def send(views: list[BlockView | None]) -> None:
            hits = [v for v in views if v is not None]
            lengths = tuple(None if v is None else len(v) for v in views)
            self.services.metrics.bytes_out.labels(FRONT).inc(sum(len(v) for v in hits))

            def release() -> None:
                for view in hits:
                    view.release()

            self._reply(GetManyResult(event.request_id, lengths), [v.data for v in hits], release)

        self._read(event.request_id, fetch, send)

    def _on_exists(self, event: Exists) -> None:
        found = self.engine.contains(self._me.key(event.key))
        self._reply(ExistsResult(event.request_id, found))

    def _on_lookup(self, event: Lookup) -> None:
        count = self.engine.lookup(self._me.keys(event.keys))
        self._reply(LookupResult(event.request_id, count))

    def _on_prefetch(self, event: Prefetch) -> None:
        keys = self._me.keys(event.keys)
        self._read(
            event.request_id,
            lambda: self.engine.prefetch(keys),
            lambda n: self._reply(PrefetchResult(event.request_id, n)),
        )

    def _on_delete(self, event: Delete) -> Awaitable[object] | None:
        engine_key = self._me.key(event.key)

        def done(deleted: bool) -> None:
            if deleted and self.services.events is not None:
                self.services.events.removed(engine_key)
            self._reply(DeleteResult(event.request_id, deleted))

        # With an SSD tier a delete wipes the block's slot header: in_order takes it off the loop.
        return self.in_order(
            partial(self.engine.delete, engine_key), done, partial(self._fail, event.request_id)
        )

    def _on_stats(self, event: Stats) -> None:
        stats = self.engine.stats().as_dict()
        me = self._me
        for field in ("tenant_bytes", "ssd_tenant_bytes"):
            held = stats.get(field)
            if isinstance(held, dict) and me.name:
                # A tenant sees its own usage, not who else uses the store.
                stats[field] = {me.name: held.get(me.name, 0)}
        stats["server"] = {
            **self.services.server_info(),
            "tenant": me.name,
            "connections": len(self.front._sessions),
        }
        self._reply(StatsResult(event.request_id, stats))


# A handler returns what the reader must await before it takes the next request (engine work
# on the I/O threads), or None.
_HANDLERS: dict[type[Event], Callable[[_Session, Any], Awaitable[object] | None]] = {
    Hello: _Session._on_hello,
    Put: _Session._on_put,
    PutMany: _Session._on_put_many,
    Get: _Session._on_get,
    GetMany: _Session._on_get_many,
    Exists: _Session._on_exists,
    Lookup: _Session._on_lookup,
    Prefetch: _Session._on_prefetch,
    Delete: _Session._on_delete,
    Stats: _Session._on_stats,
}
