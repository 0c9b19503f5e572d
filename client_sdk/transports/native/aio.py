"""The asyncio `kv://` driver: one connection multiplexes every concurrent request."""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections.abc import Callable, Sequence
from typing import TypeVar, cast

from kvoffload.client_sdk.transports.base import (
    HeldBlock,
    IntoBuffer,
    PutItem,
    Received,
    received_into_async,
    received_many_into_async,
)
from kvoffload.client_sdk.transports.core import AsyncRunner, left, retrying_async
from kvoffload.client_sdk.transports.native import plans
from kvoffload.client_sdk.transports.native.options import NativeOptions
from kvoffload.client_sdk.transports.native.session import Call, Plan, Req, Session
from kvoffload.client_sdk.url import StoreURL
from kvoffload.errors import DeadlineExceededError, KVOffloadError, TransportError
from kvoffload.wire.hello_auth import tls_binding
from kvoffload.wire.native.connection import META_VERSION, PROTOCOL_VERSION, Welcome
from kvoffload.wire.tiers import TierRun

__all__ = ["AsyncNativeTransport", "open_native_async"]

T = TypeVar("T")


class _Protocol(asyncio.BufferedProtocol):
    """Feeds received bytes straight into the session's codec buffer (or a caller's sink)."""

    def __init__(self, session: Session, on_progress: Callable[[], None]) -> None:
        self.session = session
        self._on_progress = on_progress
        self.transport: asyncio.Transport | None = None
        self._can_write = asyncio.Event()
        self._can_write.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.session.conn.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.session.conn.buffer_updated(nbytes)
        self.session.feed()
        self._on_progress()

    def eof_received(self) -> bool:
        self.session.conn.receive_eof()
        self.session.feed()
        self._on_progress()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.session.fail(TransportError(f"connection lost: {exc or 'closed by the daemon'}"))
        self._can_write.set()
        self._on_progress()

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    async def writable(self) -> None:
        await self._can_write.wait()


class _AsyncConnection(AsyncRunner[Req, Call]):
    """One multiplexed connection: any number of coroutines' requests in flight at once."""

    def __init__(self, options: NativeOptions) -> None:
        self.options = options
        self.session = Session()
        self.protocol: _Protocol | None = None
        self.welcome: Welcome | None = None
        self.version = PROTOCOL_VERSION  # the Hello's (the transport lowers it for old daemons)
        # Who waits for the next answer: every one is woken (an Event cleared by one waiter
        # could swallow the wake-up another had not started waiting for yet).
        self._waiters: list[asyncio.Future[None]] = []

    def _notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def _progress(self, deadline: float) -> None:
        """Until the connection moves (an answer, its end): registered before it yields, so
        no wake-up is lost."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        await asyncio.wait_for(waiter, left(deadline))

    async def open(self, context: ssl.SSLContext | None, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, protocol = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Protocol(self.session, self._notify),
                    self.options.host,
                    self.options.port,
                    ssl=context,
                    server_hostname=(self.options.server_name or self.options.host)
                    if context
                    else None,
                ),
                timeout=min(self.options.connect_timeout, left(deadline)),
            )
        except asyncio.TimeoutError:
            raise DeadlineExceededError(f"connecting to {self.options.url} timed out") from None
        except (OSError, ssl.SSLError) as exc:
            raise TransportError(f"cannot reach {self.options.url}: {exc}") from None
        self.protocol = protocol
        sock = protocol.transport.get_extra_info("socket") if protocol.transport else None
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tls = protocol.transport.get_extra_info("ssl_object") if protocol.transport else None
        # The proof holds for this TLS endpoint only.
        binding = tls_binding(tls.getpeercert(binary_form=True) or b"") if tls else b""
        self.welcome = await self.run(plans.hello(self.options, self.version, binding), deadline)

    @property
    def healthy(self) -> bool:
        return self.protocol is not None and self.session.broken is None

    async def exchange(self, reqs: list[Req], deadline: float) -> list[Call]:
        protocol = self.protocol
        assert protocol is not None and protocol.transport is not None
        calls: list[Call] = []
        try:
            if len(reqs) > 1 and all(r.small for r in reqs):
                # A step of small key-only requests (`Req.small`): one write of them all, or
                # of as many as the connection's pending limit leaves room for.
                await asyncio.wait_for(protocol.writable(), left(deadline))
                frames: list[bytes | memoryview] = []
                try:
                    for req in reqs:
                        if not self._room():
                            protocol.transport.writelines(frames)
                            frames = []
                            await self._wait_room(deadline)
                        call, parts = self.session.start(req)
                        calls.append(call)
                        frames += parts
                finally:
                    # Every call started is sent, even when a later one failed: a call
                    # registered but never sent would stay outstanding forever.
                    if frames and not protocol.transport.is_closing():
                        protocol.transport.writelines(frames)
            else:
                for req in reqs:
                    await asyncio.wait_for(protocol.writable(), left(deadline))
                    await self._wait_room(deadline)
                    call, parts = self.session.start(req)
                    calls.append(call)
                    protocol.transport.writelines(parts)
            while not all(c.done for c in calls):
                await self._progress(deadline)
        except (asyncio.TimeoutError, DeadlineExceededError):
            self._abandon(calls)
            raise DeadlineExceededError(f"{self.options.url} did not answer in time") from None
        except asyncio.CancelledError:
            self._abandon(calls)
            raise
        return calls

    def _room(self) -> bool:
        """Whether one more request may be outstanding (the codec refuses it past the limit)."""
        conn = self.session.conn
        return conn.pending < conn.limits.max_pending or self.session.broken is not None

    async def _wait_room(self, deadline: float) -> None:
        """Until an answer makes room for one more request: many coroutines' calls in flight
        on one connection wait their turn instead of failing (a broken session lets `start`
        raise its error)."""
        while not self._room():
            await self._progress(deadline)

    def _abandon(self, calls: list[Call]) -> None:
        """Forget calls nobody waits for; a payload still flowing into a caller's buffer must
        stop, and only closing the connection stops it."""
        for call in calls:
            call.sink = None
            if call.receiving:
                self.close()
                return

    def close(self) -> None:
        if self.protocol is not None and self.protocol.transport is not None:
            self.protocol.transport.close()
        self.session.fail(TransportError("connection closed"))


class AsyncNativeTransport:
    """asyncio `kv://` transport: one connection multiplexes every concurrent request."""

    def __init__(self, options: NativeOptions) -> None:
        self.options = options
        self._context = options.ssl_context()
        self._conn: _AsyncConnection | None = None
        self._connecting: asyncio.Lock | None = None
        self._welcome: Welcome | None = None
        self._version = PROTOCOL_VERSION

    async def _connection(self, deadline: float) -> _AsyncConnection:
        if self._conn is not None and self._conn.healthy:
            return self._conn
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            while self._conn is None or not self._conn.healthy:
                conn = _AsyncConnection(self.options)
                conn.version = self._version
                try:
                    await conn.open(self._context, deadline)
                except KVOffloadError as exc:
                    conn.close()
                    older = plans.older_version(exc, self._version)
                    if older is None:
                        raise
                    self._version = older  # an older daemon: speak its version
                    continue
                except BaseException:
                    conn.close()
                    raise
                self._conn = conn
                self._welcome = conn.welcome
        return self._conn

    async def _run(self, plan: Callable[[], Plan[T]]) -> T:
        return await retrying_async(self.options, self._attempt, (plan, self._conn))

    async def _attempt(
        self, run: tuple[Callable[[], Plan[T]], _AsyncConnection | None], deadline: float
    ) -> T:
        """`run`: the plan and the connection there was when the operation began."""
        plan, earlier = run
        while True:
            conn = None
            try:
                conn = await self._connection(deadline)
                return await conn.run(plan(), deadline)
            except TransportError:
                if conn is not None and conn is earlier and conn.session.peer_closed:
                    # The daemon closed the connection (idle) as this request went out: not a
                    # failure of the request; once per run, so it needs no retry budget.
                    earlier = None
                    continue
                raise

    async def welcomed(self) -> Welcome:
        """The daemon's Welcome (connects if needed)."""
        if self._welcome is None:
            await self._connection(time.monotonic() + self.options.timeout)
        assert self._welcome is not None
        return self._welcome

    @property
    def max_value_bytes(self) -> int:
        if self._welcome is None:
            raise TransportError("not connected yet; use `await AsyncClient.open(url)`")
        return self._welcome.max_value_bytes

    async def open(self) -> None:
        """Connect (and authenticate) now.

        Raises:
            AuthError: the token was refused.
            TransportError, DeadlineExceededError: the daemon could not be reached.
        """
        await self.welcomed()

    async def put(
        self,
        key: bytes,
        parts: Sequence[object],
        parent: bytes | None,
        durable: bool = False,
        meta: bytes | None = None,
    ) -> None:
        if meta is not None and (await self.welcomed()).version < META_VERSION:
            meta = None  # an older daemon refuses it; the put still counts
        await self._run(lambda: plans.put(key, parts, parent, durable, meta))

    async def put_many(self, items: Sequence[PutItem], durable: bool = False) -> None:
        welcome = await self.welcomed()
        items = plans.metadata_for(welcome.version, items)
        await self._run(lambda: plans.put_many(items, durable, welcome.max_payload_bytes))

    async def get(self, key: bytes) -> HeldBlock | None:
        return await self._run(lambda: plans.get(key))

    async def get_into(self, key: bytes, buffer: memoryview) -> HeldBlock | Received | None:
        into = IntoBuffer(buffer)
        return await received_into_async(into, lambda: self._run(lambda: plans.get_into(key, into)))

    async def get_many(self, keys: Sequence[bytes]) -> list[HeldBlock | None]:
        return await self._run(lambda: plans.get_many(keys))

    async def get_many_into(
        self, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> list[HeldBlock | Received | None]:
        into = [IntoBuffer(b) for b in buffers]
        got = await received_many_into_async(
            into, lambda: self._run(lambda: plans.get_many_into(keys, into))
        )
        return list(got)

    async def exists(self, key: bytes) -> bool:
        return await self._run(lambda: plans.exists(key))

    async def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        return await self._run(lambda: plans.exists_many(keys))

    async def lookup(self, keys: Sequence[bytes]) -> int:
        return await self._run(lambda: plans.lookup(keys))

    async def lookup_tiers(self, keys: Sequence[bytes]) -> TierRun:
        version = (await self.welcomed()).version
        return await self._run(lambda: plans.lookup_tiers(keys, version))

    async def prefetch(self, keys: Sequence[bytes]) -> int:
        return await self._run(lambda: plans.prefetch(keys))

    async def delete(self, key: bytes) -> bool:
        return await self._run(lambda: plans.delete(key))

    async def stats(self) -> dict[str, object]:
        return await self._run(plans.stats)

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def open_native_async(url: StoreURL) -> AsyncNativeTransport:
    """Open `kv://host:port?token=...` for asyncio (connects on first use or `open()`)."""
    return AsyncNativeTransport(NativeOptions.from_url(url))
