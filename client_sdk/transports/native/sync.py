"""The blocking `kv://` driver: a pool of sockets, each pipelining a plan's requests."""

from __future__ import annotations

import contextlib
import logging
import select
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TypeVar, cast

from kvoffload.client_sdk.transports.base import (
    HeldBlock,
    IntoBuffer,
    PutItem,
    Received,
    received_into,
    received_many_into,
)
from kvoffload.client_sdk.transports.core import (
    SyncRunner,
    connect,
    left,
    lost,
    receive,
    retrying,
    send_all,
)
from kvoffload.client_sdk.transports.native import plans
from kvoffload.client_sdk.transports.native.options import NativeOptions
from kvoffload.client_sdk.transports.native.session import Call, Plan, Req, Session
from kvoffload.client_sdk.url import StoreURL
from kvoffload.errors import (
    DeadlineExceededError,
    KVOffloadError,
    RemoteProtocolError,
    TransportError,
)
from kvoffload.wire import fast as _fast
from kvoffload.wire.block import HEADER_BYTES
from kvoffload.wire.hello_auth import tls_binding
from kvoffload.wire.native.connection import (
    META_VERSION,
    PROTOCOL_VERSION,
    REPAIR_VERSION,
    Event,
    Welcome,
)
from kvoffload.wire.native.fields import KEY_BYTES
from kvoffload.wire.native.frames import HEAD_READ
from kvoffload.wire.tiers import TierRun

__all__ = ["NativeTransport", "open_native"]

log = logging.getLogger(__name__)

T = TypeVar("T")
# Frames a plan may have in flight on one connection before it reads answers.
_WINDOW = 16
# A pooled connection idle for less than this is taken without asking the kernel whether the
# daemon closed it (a select per request); if it did, the request's failure says so and it
# goes again on a fresh connection, as it would after a check that came too early.
_TRUST_IDLE_S = 0.5


class _SyncConnection(SyncRunner[Req, Call]):
    """One blocking socket and its session."""

    def __init__(
        self,
        options: NativeOptions,
        context: ssl.SSLContext | None,
        deadline: float,
        version: int = PROTOCOL_VERSION,
    ) -> None:
        self.options = options
        self.session = Session()
        sock = connect(options, deadline)
        if context is not None:
            try:
                sock = context.wrap_socket(
                    sock, server_hostname=options.server_name or options.host
                )
            except (ssl.SSLError, OSError) as exc:
                sock.close()
                raise TransportError(f"TLS handshake with {options.url} failed: {exc}") from None
        self.sock = sock
        self.tls = context is not None
        self.reused = False  # taken from the pool: the daemon may have closed it meanwhile
        self.idle_since = 0.0  # when it went back to the pool
        # The socket's timeout as last set: setting it costs a system call, so each call
        # sets it only when the deadline asks for another value (see `_arm`).
        self._timeout = -1.0
        self._slack = min(0.05 * options.timeout, 0.5)
        try:
            binding = b""
            if isinstance(sock, ssl.SSLSocket):  # the proof holds for this TLS endpoint only
                binding = tls_binding(sock.getpeercert(binary_form=True) or b"")
            self.welcome: Welcome = self.run(plans.hello(options, version, binding), deadline)
        except BaseException:
            sock.close()  # refused Hello (bad token, version): do not wait for the collector
            raise

    def room(self, calls: list[Call]) -> bool:
        return sum(1 for c in calls if not c.done) < _WINDOW

    def _arm(self, deadline: float) -> None:
        """Bound the next socket call by `deadline`, give or take `_slack`.

        The timeout is set to the time left plus the slack and kept while it stays within
        that slack of the time left, so that back-to-back requests set it once, not per call;
        a call may thus wait up to `_slack` past the deadline, never less than the deadline.
        """
        remaining = left(deadline)
        if not remaining <= self._timeout <= remaining + self._slack:
            self._timeout = remaining + self._slack
            self.sock.settimeout(self._timeout)

    def exchange(self, requests: Sequence[Req], deadline: float) -> list[Call]:
        """A step of small key-only requests (`Req.small`, a plan bounds how many) in one
        write, then their answers; any other step with the runner's window."""
        if len(requests) < 2 or not all(r.small for r in requests):
            return super().exchange(requests, deadline)
        calls: list[Call] = []
        parts: list[bytes | memoryview] = []
        for request in requests:
            call, frame = self.session.start(request)
            calls.append(call)
            parts += frame
        try:
            self._arm(deadline)
            if self.tls:  # an SSL socket has no sendmsg
                self.sock.sendall(b"".join(parts))
            else:
                send_all(self.sock, parts)
        except OSError as exc:
            raise self._lost(exc) from None
        while not all(c.done for c in calls):
            self.pump(deadline)
        return calls

    def start(self, request: Req, deadline: float, event: Event | None = None) -> Call:
        call, parts = self.session.start(request, event)
        try:
            self._arm(deadline)
            if self.tls:  # an SSL socket has no sendmsg
                for part in parts:
                    self.sock.sendall(part)
            else:
                send_all(self.sock, parts)
        except OSError as exc:
            raise self._lost(exc) from None
        return call

    def exchange_one(
        self, req: Req, deadline: float, into: IntoBuffer | list[IntoBuffer] | None
    ) -> tuple[Call | None, object]:
        """Send `req` (a get_into's when `into` is a buffer, a get_many_into's when a list, else
        a put's or a put_many's) and take its answer: (None, result) when the C exchange took
        it whole (`Received` blocks, summed, or None), else (call, None) with the call answered
        or receiving through the Python codec: the reference path, and the whole path over TLS
        or without the extension."""
        session = self.session
        if self.tls or not session.ready or len(req.payload) >= _fast.NET_MAX_PARTS:
            return self._through_codec(req, deadline), None
        rid = session.number()
        if req.lookup is not None and _fast.net_lookup is not None:
            return self._lookup_one(req, req.lookup, rid, deadline)
        # A get_into's frame is built by C from its key; the event only if Python takes over.
        event = None if isinstance(into, IntoBuffer) and req.key else req.make(rid)
        parts = [req.key] if event is None else session.frame(event, req.payload)
        fd = self.sock.fileno()
        timeout = left(deadline) + self._slack
        self._arm(deadline)  # a socket with a timeout is non-blocking: C then polls it
        headers: list[object] = (
            [bytearray(HEADER_BYTES) for _ in into] if isinstance(into, list) else []
        )
        header = bytearray(HEADER_BYTES)
        try:
            if into is None and _fast.net_put is not None and event is not None:
                status, _, _, eof, data = _fast.net_put(fd, parts, rid, event.OP, timeout)
                lengths: list[int] | None = None
                crcs: list[int] | None = None
            elif isinstance(into, IntoBuffer) and _fast.net_get_into is not None:
                status, length, crc, eof, data = _fast.net_get_into(
                    fd, parts[0], rid, header, into.buffer, timeout
                )
                headers, lengths, crcs = [header], [length], [crc]
            elif isinstance(into, list) and _fast.net_get_many_into is not None:
                buffers: list[object] = [b.buffer for b in into]
                status, lengths, crcs, eof, data = _fast.net_get_many_into(
                    fd,
                    parts[0],
                    rid,
                    headers,
                    buffers,
                    timeout,
                )
            else:
                return self._through_codec(req, deadline, event), None
        except (BufferError, TypeError, ValueError):  # a buffer C cannot take: nothing was sent
            return self._through_codec(req, deadline, event or req.make(rid)), None
        except OSError as exc:  # the C call zeroed whatever had landed
            raise self._lost(exc) from None
        if status == _fast.NET_FALLBACK:
            return session.adopt(req, event or req.make(rid), data, bool(eof)), None
        if status == _fast.NET_CUT:  # what had landed is zeroed
            error = TransportError("the daemon closed the connection in the middle of an answer")
            session.conn.receive_eof()
            session.fail(error)
            raise error
        session.took(data)
        if into is None:
            return None, None
        assert lengths is not None and crcs is not None
        got: list[Received | None] = []
        for buffer, head, n, crc in zip(
            into if isinstance(into, list) else [into], headers, lengths, crcs, strict=True
        ):
            if n < 0:
                got.append(None)
            else:
                buffer.region(0, n)
                got.append(Received(memoryview(head), n, crc))  # type: ignore[arg-type]
        return None, got if isinstance(into, list) else got[0]

    def _lookup_one(
        self, req: Req, keys: tuple[bytes, ...], rid: int, deadline: float
    ) -> tuple[Call | None, object]:
        """A Lookup framed, sent and answered in one C call (no per-key Python work); an
        answer other than a plain count goes to the codec, as in `exchange_one`."""
        session, net_lookup = self.session, _fast.net_lookup
        assert net_lookup is not None
        # Keys C cannot frame go the codec's way, checked here: a TypeError or ValueError out
        # of net_lookup may be a signal handler's, raised after the frame went out.
        if not _fast.all_keys(keys, KEY_BYTES):
            return self._through_codec(req, deadline, req.make(rid)), None
        self._arm(deadline)
        try:
            status, count, eof, data = net_lookup(
                self.sock.fileno(), keys, rid, left(deadline) + self._slack
            )
        except OSError as exc:
            raise self._lost(exc) from None
        if status == _fast.NET_FALLBACK:
            return session.adopt(req, req.make(rid), data, bool(eof)), None
        if count > len(keys):  # as plans.lookup checks the codec's answer
            raise RemoteProtocolError(f"lookup of {len(keys)} keys answered {count}")
        return None, count

    def _through_codec(self, req: Req, deadline: float, event: Event | None = None) -> Call:
        """`req` sent and its answer's first bytes read the Python way (`event`: its event,
        already numbered by `Session.frame`)."""
        call = self.start(req, deadline, event)
        # A get_into's first read takes the answer's header, the block's header and a little
        # of the value: the rest then lands in the caller's buffer uncopied, where a full-size
        # read would take most of it into the receive buffer and copy it out (both cost two
        # reads for a value of 64 KiB or more).
        self.pump(deadline, 0 if req.sink is None else HEAD_READ)
        return call

    def pump(self, deadline: float, most: int = 0) -> None:
        """Receive once (at most `most` bytes, if not 0) and match what came to the calls."""
        conn = self.session.conn
        try:
            self._arm(deadline)
            n = self.sock.recv_into(conn.get_buffer(), most)
            if n:
                conn.buffer_updated(n)
            else:
                conn.receive_eof()
        except OSError as exc:
            raise self._lost(exc) from None
        self.session.feed()

    def _lost(self, exc: OSError) -> KVOffloadError:
        error = lost(self.options.url, exc)
        self.session.fail(error)
        self.session.conn.send_failed()
        self.close()
        return error

    @property
    def healthy(self) -> bool:
        return self.session.broken is None and not self.session.calls

    def stale(self) -> bool:
        """Whether the daemon closed this idle connection (a goodbye or EOF is waiting)."""
        try:
            if not select.select([self.sock], [], [], 0)[0]:
                return False
            self._timeout = 0.0
            receive(self.sock, self.session.conn, 0)
        except (ssl.SSLWantReadError, BlockingIOError):
            return False  # TLS bytes that are not a whole record yet
        except (OSError, ValueError):
            return True
        self.session.feed()
        return self.session.broken is not None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class NativeTransport:
    """Blocking `kv://` transport: a pool of connections, each pipelining a plan's requests."""

    def __init__(self, options: NativeOptions) -> None:
        self.options = options
        self._context = options.ssl_context()
        self._idle: list[_SyncConnection] = []
        self._open = 0
        self._cond = threading.Condition()
        self._welcome: Welcome | None = None
        self._version = PROTOCOL_VERSION
        self._closed = False
        try:  # connect now for an early AuthError; a daemon that is down is only a warning
            self._release(self._acquire(time.monotonic() + options.connect_timeout), True)
        except (TransportError, DeadlineExceededError) as exc:
            log.warning("%s is not reachable yet (%s); will retry on use", options.url, exc)

    # ------------------------------------------------------------------ pool

    def _acquire(self, deadline: float) -> _SyncConnection:
        with self._cond:
            while True:
                if self._closed:
                    raise TransportError("the client is closed")
                while self._idle:
                    conn = self._idle.pop()
                    if time.monotonic() - conn.idle_since < _TRUST_IDLE_S or not conn.stale():
                        conn.reused = True
                        return conn
                    conn.close()
                    self._open -= 1
                if self._open < self.options.pool:
                    self._open += 1
                    break
                if not self._cond.wait(timeout=left(deadline)):
                    raise DeadlineExceededError(f"no free connection to {self.options.url}")
        try:
            conn = self._connect(deadline)
        except BaseException:
            with self._cond:
                self._open -= 1
                self._cond.notify()
            raise
        self._welcome = conn.welcome
        return conn

    def _connect(self, deadline: float) -> _SyncConnection:
        """A new connection, speaking the newest protocol version the daemon accepts (an
        older daemon refuses a newer Hello by its version; that is remembered)."""
        while True:
            try:
                return _SyncConnection(self.options, self._context, deadline, self._version)
            except KVOffloadError as exc:
                older = plans.older_version(exc, self._version)
                if older is None:
                    raise
                log.info("%s speaks an older protocol; using version %d", self.options.url, older)
                self._version = older

    def _release(self, conn: _SyncConnection, healthy: bool) -> None:
        with self._cond:
            if healthy and conn.healthy and not self._closed:
                conn.idle_since = time.monotonic()
                self._idle.append(conn)
            else:
                conn.close()
                self._open -= 1
            self._cond.notify()

    def _run(self, plan: Callable[[], Plan[T]]) -> T:
        """Run a fresh plan, retrying on a lost connection (every operation is idempotent)."""
        return retrying(self.options, self._attempt, plan)

    def _single(
        self,
        req: Req,
        finish: Callable[[Call], T],
        plan: Callable[[], Plan[T]],
        into: IntoBuffer | list[IntoBuffer] | None = None,
    ) -> T:
        """One request on a pooled connection without the plan and retry machinery (the
        common `get_into`, whose buffer is `into`, and `put`), one C call on a plain socket
        (`_SyncConnection.exchange_one`); only when that attempt fails does `plan` run the
        general way, the failed attempt counting as the first of the retries."""
        deadline = time.monotonic() + self.options.timeout
        with self._cond:
            conn = self._idle.pop() if self._idle and not self._closed else None
        if conn is None or (time.monotonic() - conn.idle_since >= _TRUST_IDLE_S and conn.stale()):
            if conn is not None:
                self._release(conn, False)
            return retrying(self.options, self._attempt, plan, deadline)
        conn.reused = True
        try:
            call, took = conn.exchange_one(req, deadline, into)
            if call is None:
                result = cast(T, took)
            else:
                while not call.done:
                    conn.pump(deadline)
                result = finish(call)
        except TransportError as exc:
            self._release(conn, False)
            # A pooled connection the daemon had closed costs no retry (as in `_attempt`).
            failed = None if conn.session.peer_closed else exc
            return retrying(self.options, self._attempt, plan, deadline, failed)
        except RemoteProtocolError:
            self._release(conn, False)
            raise
        except KVOffloadError:
            self._release(conn, True)
            raise
        except BaseException:
            self._release(conn, False)
            raise
        self._release(conn, True)
        return result

    def _attempt(self, plan: Callable[[], Plan[T]], deadline: float) -> T:
        while True:
            conn = self._acquire(deadline)
            try:
                result = conn.run(plan(), deadline)
            except TransportError as exc:
                self._release(conn, False)
                if conn.reused and conn.session.peer_closed:
                    # The daemon closed a pooled connection (idle) just as this request
                    # went out: not a failure of the request. Each pooled connection can
                    # cause this once, so it needs no retry budget.
                    log.debug("pooled connection was closed (%s); reconnecting", exc)
                    continue
                raise
            except RemoteProtocolError:
                self._release(conn, False)  # a daemon that answers nonsense: not reused
                raise
            except KVOffloadError:
                self._release(conn, True)  # an error answer leaves the connection usable
                raise
            except BaseException:
                self._release(conn, False)
                raise
            self._release(conn, True)
            return result

    # ------------------------------------------------------------------ Transport

    @property
    def max_value_bytes(self) -> int:
        if self._welcome is None:
            self._release(self._acquire(time.monotonic() + self.options.timeout), True)
        assert self._welcome is not None
        return self._welcome.max_value_bytes

    @property
    def welcome(self) -> Welcome:
        """The daemon's Welcome (connects if needed)."""
        self.max_value_bytes  # noqa: B018 - connects if needed
        assert self._welcome is not None
        return self._welcome

    @property
    def tenant(self) -> str:
        self.max_value_bytes  # noqa: B018 - connects if needed
        assert self._welcome is not None
        return self._welcome.tenant

    def _budget(self) -> int:
        self.max_value_bytes  # noqa: B018 - connects if needed
        assert self._welcome is not None
        return self._welcome.max_payload_bytes

    def put(
        self,
        key: bytes,
        parts: Sequence[object],
        parent: bytes | None,
        durable: bool = False,
        meta: bytes | None = None,
    ) -> None:
        if meta is not None and self._version_now() < META_VERSION:
            meta = None  # an older daemon refuses it; the put still counts
        req = plans.put_request(key, parts, parent, durable, meta)
        self._single(req, plans.put_done, lambda: plans.put(key, parts, parent, durable, meta))

    def put_many(self, items: Sequence[PutItem], durable: bool = False) -> None:
        budget = self._budget()
        items = plans.metadata_for(self._version_now(), items)
        reqs = plans.put_many_requests(items, durable, budget)
        plan = partial(plans.put_many, items, durable, budget)
        if len(reqs) == 1:  # one frame: one call, as a put
            self._single(reqs[0], plans.put_done, plan)
        else:
            self._run(plan)

    def _version_now(self) -> int:
        """The protocol version the daemon accepted (connecting if needed)."""
        self.max_value_bytes  # noqa: B018 - connects if needed
        assert self._welcome is not None
        return self._welcome.version

    def get(self, key: bytes) -> HeldBlock | None:
        return self._run(lambda: plans.get(key))

    def get_into(self, key: bytes, buffer: memoryview) -> HeldBlock | Received | None:
        into = IntoBuffer(buffer)
        req, finish = plans.get_into_request(key, into)
        plan = partial(plans.get_into, key, into)
        return received_into(into, partial(self._single, req, finish, plan, into))

    def get_many(self, keys: Sequence[bytes]) -> list[HeldBlock | None]:
        return self._run(lambda: plans.get_many(keys))

    def get_many_into(
        self, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> list[HeldBlock | Received | None]:
        into = [IntoBuffer(b) for b in buffers]
        return list(received_many_into(into, partial(self._many_into, keys, into)))

    def _many_into(self, keys: Sequence[bytes], into: list[IntoBuffer]) -> list[Received | None]:
        """A batch of up to `NET_MAX_KEYS` keys in one request (one C call on a plain socket);
        a larger one, and what the daemon left of a batch it answered in part, the general
        way."""
        if not keys or len(keys) > _fast.NET_MAX_KEYS:
            return self._run(lambda: plans.get_many_into(keys, into))
        req, finish = plans.get_many_into_request(keys, into)
        got = self._single(req, finish, lambda: plans.get_many_into(keys, into), into)
        if len(got) < len(keys):  # a prefix: ask again from there, as the plan does
            rest = keys[len(got) :], into[len(got) :]
            got += self._run(lambda: plans.get_many_into(*rest))
        return got

    def exists(self, key: bytes) -> bool:
        return self._run(lambda: plans.exists(key))

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        return self._run(lambda: plans.exists_many(keys)) if keys else []

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Up to `NET_LOOKUP_MAX_KEYS` keys in one C call on a plain socket (`_lookup_one`);
        more, or without the extension, the plan's way."""
        if not keys or len(keys) > _fast.NET_LOOKUP_MAX_KEYS or _fast.net_lookup is None:
            return self._run(lambda: plans.lookup(keys))
        req, finish = plans.lookup_request(keys)
        return self._single(req, finish, lambda: plans.lookup(keys))

    def lookup_tiers(self, keys: Sequence[bytes]) -> TierRun:
        version = self._version_now()
        return self._run(lambda: plans.lookup_tiers(keys, version))

    def prefetch(self, keys: Sequence[bytes]) -> int:
        return self._run(lambda: plans.prefetch(keys))

    def delete(self, key: bytes) -> bool:
        return self._run(lambda: plans.delete(key))

    def repair(
        self, key: bytes, parts: Sequence[object], parent: bytes | None, meta: bytes | None
    ) -> bool | None:
        if self._version_now() < REPAIR_VERSION:
            return None
        return self._run(lambda: plans.repair(key, parts, parent, meta))

    def describe(self, key: bytes) -> tuple[bool, bytes | None, bytes | None] | None:
        if self._version_now() < REPAIR_VERSION:
            return None
        return self._run(lambda: plans.describe(key))

    def delete_many(self, keys: Sequence[bytes]) -> list[bool] | None:
        if self._version_now() < REPAIR_VERSION:
            return None
        return self._run(lambda: plans.delete_many(keys))

    def stats(self) -> dict[str, object]:
        return self._run(plans.stats)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        for conn in idle:
            conn.close()


def open_native(url: StoreURL) -> NativeTransport:
    """Open `kv://host:port?token=...` (blocking)."""
    return NativeTransport(NativeOptions.from_url(url))
