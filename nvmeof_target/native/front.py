"""The native front: the native protocol (`wire.native.connection`) over TCP, on the engine.

A thin shell in the shape of h11's example servers: read into the codec's buffer, drain its
events, call the engine, write the answers. Payloads never pass through Python objects: a put's
bytes are received straight into the slot that `Engine.reserve` hands out, and a get's bytes are
sent straight from the pinned `BlockView`, which is released once the kernel has them.

Bad input closes only the connection that sent it (after an ErrorReply with request id 0 when
the connection can still carry one). Memory per connection is bounded: the codec's buffer, a
limit on requests in progress and on answer bytes queued (reading stops while over either), and
timeouts for idle connections and for frames that trickle in.

This module is the front (listener, watchdog); `native_session.NativeSession` serves each
connection, with the requests in `native_requests` and `native_puts`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import replace

from kvoffload.nvmeof_target.channel import Channel, TlsChannel
from kvoffload.nvmeof_target.config import Config, NativeConfig
from kvoffload.nvmeof_target.native.puts import c_put_begin, c_put_commit, payload_end, payload_part
from kvoffload.nvmeof_target.native.requests import HANDLERS
from kvoffload.nvmeof_target.native.session import FRONT, Handler, NativeSession
from kvoffload.nvmeof_target.services import Services
from kvoffload.nvmeof_target.session import Instruments, RoomLimits, make_room, stop_sessions
from kvoffload.wire.hello_auth import tls_binding_of_pem
from kvoffload.wire.native.connection import (
    ErrorReply,
    Limits,
    NativeConnection,
    PayloadEnd,
    Role,
    SinkFull,
)
from kvoffload.wire.status import Status

__all__ = ["NativeFront", "make_front"]

log = logging.getLogger("kvoffload.native")
# Largest frame header accepted before Hello (a Hello with a long token fits easily).
HELLO_HEADER_BYTES = 16 << 10


def make_front(config: Config, services: Services) -> NativeFront | None:
    return NativeFront(config.native, services) if config.native.enabled else None


class NativeFront:
    """Listens for native-protocol connections and serves each in its own task."""

    name = FRONT

    def __init__(self, config: NativeConfig, services: Services) -> None:
        self.config = config
        self.services = services
        self.handlers: Mapping[type[object], Handler] = {
            **HANDLERS,
            PayloadEnd: payload_end,
            SinkFull: payload_part,
        }
        # Puts the C reader callback takes (`NativeSession.start_hot` decides where it runs)
        self.c_puts: tuple[Callable[..., object], Callable[..., object]] | None = (
            c_put_begin,
            c_put_commit,
        )
        self._listeners: list[socket.socket] = []
        self._accept_tasks: list[asyncio.Task[None]] = []
        self._watchdog: asyncio.Task[None] | None = None
        self._sessions: dict[NativeSession, asyncio.Task[None]] = {}
        self._tls: ssl.SSLContext | None = None
        self.tls_binding = b""
        self.instruments = Instruments(services.metrics, FRONT, log)
        self._budget = RoomLimits(
            config.max_connections,
            config.max_unauthenticated,
            config.max_unauthenticated_per_peer,
            "unauthenticated",
        )
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
            with open(self.config.tls.cert_file) as fh:  # loaded above: readable PEM
                self.tls_binding = tls_binding_of_pem(fh.read())
        shard = self.services.shard
        if shard is not None:  # the worker's supervisor bound them
            listeners = shard.listeners
        else:
            listeners = [
                socket.create_server(
                    (self.config.host, self.config.port),
                    backlog=self.config.backlog,
                    reuse_port=False,
                )
            ]
        loop = asyncio.get_running_loop()
        for listener in listeners:
            listener.setblocking(False)
            self._listeners.append(listener)
            self._accept_tasks.append(loop.create_task(self._accept(listener)))
        self._watchdog = loop.create_task(self._watch())
        what = FRONT + ("+tls" if self._tls else "")
        return [(what, *_bound(listener)) for listener in listeners]

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
            self.instruments.connections_total.inc()
            if not make_room(
                self._sessions,
                _admitted,
                str(peer[0]),
                self._budget,
                self.services.metrics,
                FRONT,
                self.instruments.peer_log,
            ):
                metrics.refused.labels(FRONT, "too many connections").inc()
                _refuse(sock, "too many connections")
                continue
            channel: Channel = (
                TlsChannel(sock, loop, self._tls) if self._tls else Channel(sock, loop)
            )
            session = NativeSession(self, channel, f"{peer[0]}:{peer[1]}")
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
                    session.peer_log.info("closing %s: %s", session.peer, reason)
                    session.say_goodbye(Status.DEADLINE, reason)
                    session.abort()

    @property
    def connection_count(self) -> int:
        return len(self._sessions)

    def drop_connections(self) -> None:
        for session in list(self._sessions):
            session.abort()

    def forget(self, session: NativeSession) -> None:
        self._sessions.pop(session, None)

    async def stop(self, timeout: float) -> None:
        for task in (*self._accept_tasks, self._watchdog):
            if task is not None:
                task.cancel()
        self._accept_tasks.clear()
        for listener in self._listeners:
            listener.close()
        self._listeners.clear()
        await stop_sessions(self._sessions, timeout)


def _bound(listener: socket.socket) -> tuple[str, int]:
    host, port = listener.getsockname()[:2]
    return str(host), int(port)


def _refuse(sock: socket.socket, why: str) -> None:
    """Tell a connection we will not serve it (best effort, never blocking) and close it."""
    conn = NativeConnection(Role.SERVER)
    try:
        sock.setblocking(False)
        sock.send(conn.send(ErrorReply(0, Status.UNAVAILABLE, why)))
    except OSError:
        pass
    sock.close()


def _admitted(session: NativeSession) -> bool:
    return session.tenant is not None
