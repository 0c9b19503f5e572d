"""`kv://host:7480`: the native protocol to a `kvoffload serve` daemon, sync and asyncio.

Every operation is written once, as a *plan*: a generator that yields the requests it needs
(several at a time when they can be pipelined) and receives their answers. The blocking driver
(`KVTransport`, a pool of sockets) and the asyncio driver (`AsyncKVTransport`, one multiplexed
connection) only move bytes; matching answers to requests is `_Session`'s job, which sits on the
sans-I/O codec in `client_sdk/wire/native.py`.

URL parameters: `token` (the tenant's token), `timeout` (seconds per operation, default 30),
`connect_timeout` (default 5), `retries` (default 3, with exponential backoff from `backoff`
seconds, default 0.05), `pool` (sync connections, default 4), `tls` (1 to use TLS), `ca` (CA
file to verify the daemon's certificate; default the system store), `server_name` (name to
verify instead of the URL's host).

A daemon that cannot be reached raises `TransportError` once the retries are spent (never
hangs: every socket operation has the operation's deadline); `DeadlineExceededError` when the
deadline passes first. The request layer turns both into misses for `lookup`/`exists`. A
connection the daemon has closed meanwhile (a goodbye after `idle_timeout_s`, a restart) is
replaced by a fresh one without spending a retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar, cast

from kvoffload import __version__
from kvoffload.client_sdk.transports.base import (
    HeldBlock,
    IntoBuffer,
    PutItem,
    Received,
    received_into,
    received_into_async,
    received_many_into,
    received_many_into_async,
)
from kvoffload.client_sdk.url import StoreURL
from kvoffload.client_sdk.wire.block import HEADER_BYTES
from kvoffload.client_sdk.wire.native import (
    NEED_DATA,
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
    PutMany,
    Role,
    Stats,
    StatsResult,
    Welcome,
)
from kvoffload.client_sdk.wire.status import error_for
from kvoffload.errors import (
    ConfigError,
    DeadlineExceededError,
    InvalidArgumentError,
    KVOffloadError,
    RemoteProtocolError,
    TransportError,
)

__all__ = ["AsyncKVTransport", "KVOptions", "KVTransport", "open_kv", "open_kv_async"]

log = logging.getLogger(__name__)

T = TypeVar("T")
DEFAULT_PORT = 7480
_PARAMS = {
    "token": "the tenant's token",
    "timeout": "seconds per operation (default 30)",
    "connect_timeout": "seconds to connect (default 5)",
    "retries": "attempts after a failed one (default 3)",
    "backoff": "first retry delay in seconds (default 0.05)",
    "pool": "connections of a sync client (default 4)",
    "tls": "1 to connect with TLS",
    "ca": "CA file that signed the daemon's certificate",
    "server_name": "certificate name to expect (default: the URL's host)",
}
# Keys per batch frame; keeps a frame's header well under the daemon's limit.
_BATCH_KEYS = 4096
# Frames a plan may have in flight on one connection before it reads answers.
_WINDOW = 16
# The client accepts answers up to this size (the daemon's own limit is lower).
_LIMITS = Limits(max_header_bytes=64 << 20, max_payload_bytes=4 << 30, max_pending=1 << 16)


@dataclass(frozen=True)
class KVOptions:
    """Where and how to reach a daemon (from a `kv://` URL)."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    token: str = ""
    timeout: float = 30.0
    connect_timeout: float = 5.0
    retries: int = 3
    backoff: float = 0.05
    pool: int = 4
    tls: bool = False
    ca: str = ""
    server_name: str = ""

    @classmethod
    def from_url(cls, url: StoreURL) -> KVOptions:
        """Raises: ConfigError: unknown parameter or bad value."""
        params = url.take(_PARAMS)
        kwargs: dict[str, Any] = {"host": url.host or "127.0.0.1", "port": url.port or DEFAULT_PORT}
        try:
            for name in ("timeout", "connect_timeout", "backoff"):
                if name in params:
                    kwargs[name] = float(params[name])
            for name in ("retries", "pool"):
                if name in params:
                    kwargs[name] = int(params[name])
        except ValueError as exc:
            raise ConfigError(f"bad kv:// parameter: {exc}") from None
        if "tls" in params:
            if params["tls"] not in ("0", "1"):
                raise ConfigError(f"tls must be 0 or 1, got {params['tls']!r}")
            kwargs["tls"] = params["tls"] == "1"
        for name in ("token", "ca", "server_name"):
            if name in params:
                kwargs[name] = params[name]
        options = cls(**kwargs)
        if options.timeout <= 0 or options.connect_timeout <= 0 or options.backoff < 0:
            raise ConfigError("kv:// timeouts must be positive and backoff non-negative")
        if options.retries < 0 or options.pool < 1:
            raise ConfigError("kv:// retries must be >= 0 and pool >= 1")
        return options

    @property
    def url(self) -> str:
        return f"kv://{self.host}:{self.port}"

    def ssl_context(self) -> ssl.SSLContext | None:
        if not self.tls:
            return None
        try:
            return ssl.create_default_context(cafile=self.ca or None)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot load CA file {self.ca!r}: {exc}") from None


# ---------------------------------------------------------------------------- sans-I/O session

Sink = Callable[[Event], "list[memoryview] | None"]


@dataclass
class _Req:
    """One request a plan wants sent."""

    make: Callable[[int], Event]  # request id -> event
    payload: Sequence[object] = ()
    # Where the answer's payload goes (None: let the codec allocate; the callable may return
    # None to drop it, or raise InvalidArgumentError to fail the request after dropping it).
    sink: Sink | None = None


@dataclass
class _Call:
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


class _Session:
    """The client side of one connection: request ids, answers, payload sinks; no I/O."""

    def __init__(self) -> None:
        self.conn = NativeConnection(Role.CLIENT, _LIMITS)
        self._next_id = 0
        self.calls: dict[int, _Call] = {}
        self.broken: KVOffloadError | None = None
        # The daemon ended the connection (a goodbye or EOF), e.g. closing it as idle: it took
        # no request after that, so the driver retries on a fresh connection.
        self.peer_closed = False

    def start(self, req: _Req) -> tuple[_Call, list[bytes | memoryview]]:
        if self.broken is not None:  # e.g. the daemon said goodbye: the driver reconnects
            raise self.broken
        self._next_id = self._next_id % 0xFFFF_FFFF + 1
        event = req.make(self._next_id)
        parts = self.conn.send_parts(event, req.payload)
        call = _Call(event, req.sink)
        self.calls[event.request_id] = call
        return call, parts

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

    def _finish(self, call: _Call) -> None:
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


# ---------------------------------------------------------------------------- plans

Plan = Generator[list[_Req], list[_Call], T]


@dataclass(frozen=True, slots=True)
class _Held:
    """A block received into memory the codec allocated; nothing to release."""

    data: memoryview

    def release(self) -> None:
        pass


def _one(req: _Req) -> Generator[list[_Req], list[_Call], Event]:
    (call,) = yield [req]
    return call.result()


def _plan_hello(token: str) -> Plan[Welcome]:
    answer = yield from _one(_Req(lambda rid: Hello(rid, token=token, client=_CLIENT)))
    return cast(Welcome, answer)


def _nbytes(parts: Sequence[object]) -> int:
    total = 0
    for part in parts:
        total += memoryview(part).nbytes  # type: ignore[arg-type]
    return total


def _plan_put(
    key: bytes, parts: Sequence[object], parent: bytes | None, durable: bool
) -> Plan[None]:
    length = _nbytes(parts)
    yield from _one(_Req(partial(_put_event, key, length, parent, durable), parts))


def _put_event(key: bytes, length: int, parent: bytes | None, durable: bool, rid: int) -> Event:
    return Put(rid, key, length, parent, durable)


def _put_many_event(
    keys: tuple[bytes, ...],
    lengths: tuple[int, ...],
    parents: tuple[bytes | None, ...],
    durable: bool,
    rid: int,
) -> Event:
    used = parents if any(p is not None for p in parents) else ()
    return PutMany(rid, keys, lengths, used, durable)


def _keys_event(
    cls: Callable[[int, tuple[bytes, ...]], Event], keys: tuple[bytes, ...], rid: int
) -> Event:
    return cls(rid, keys)


def _key_event(cls: Callable[[int, bytes], Event], key: bytes, rid: int) -> Event:
    return cls(rid, key)


def _plan_put_many(items: Sequence[PutItem], durable: bool, budget: int) -> Plan[None]:
    reqs: list[_Req] = []
    for chunk in _chunks(items, budget):
        keys = tuple(k for k, _, _ in chunk)
        lengths = tuple(_nbytes(parts) for _, parts, _ in chunk)
        parents = tuple(p for _, _, p in chunk)
        payload = [p for _, parts, _ in chunk for p in parts]
        reqs.append(_Req(partial(_put_many_event, keys, lengths, parents, durable), payload))
    calls = yield reqs
    for call in calls:  # the first failure in order is the one to report
        call.result()


def _chunks(items: Sequence[PutItem], budget: int) -> list[list[PutItem]]:
    """Split a batch so that each frame stays within `budget` payload bytes and _BATCH_KEYS."""
    chunks: list[list[PutItem]] = [[]]
    size = 0
    for item in items:
        n = _nbytes(item[1])
        if chunks[-1] and (size + n > budget or len(chunks[-1]) >= _BATCH_KEYS):
            chunks.append([])
            size = 0
        chunks[-1].append(item)
        size += n
    return [c for c in chunks if c]


def _plan_get(key: bytes) -> Plan[HeldBlock | None]:
    (call,) = yield [_Req(partial(_key_event, Get, key))]
    answer = cast(GetResult, call.result())
    if answer.length is None:
        return None
    return _Held(call.payload if call.payload is not None else memoryview(b""))


def _plan_get_into(key: bytes, buffer: IntoBuffer) -> Plan[Received | None]:
    header = memoryview(bytearray(HEADER_BYTES))
    received = 0

    def sink(event: Event) -> list[memoryview]:
        nonlocal header, received
        length = cast(GetResult, event).length or 0
        if length < HEADER_BYTES:  # not one of ours: verification will say so
            header = memoryview(bytearray(length))
            return [header]
        if length - HEADER_BYTES > len(buffer):
            raise InvalidArgumentError(
                f"buffer of {len(buffer)} bytes is too small for a "
                f"{length - HEADER_BYTES}-byte block"
            )
        received = length - HEADER_BYTES
        return [header, buffer.region(0, received)]

    (call,) = yield [_Req(partial(_key_event, Get, key), sink=sink)]
    answer = cast(GetResult, call.result())
    if answer.length is None:
        return None
    return Received(header, received)


def _plan_get_batches(
    keys: Sequence[bytes],
    sink: Callable[[int], Sink] | None,
    take: Callable[[int, GetManyResult, _Call], list[T]],
) -> Plan[list[T]]:
    """GetMany in frames of up to _BATCH_KEYS keys, asking again from where the daemon
    answered only a prefix; `sink(first)` places the payload of the frame starting at key
    `first`, `take` turns its answer into one result per answered key."""
    out: list[T] = []
    done = 0
    while done < len(keys):
        starts = range(done, len(keys), _BATCH_KEYS)
        calls = yield [
            _Req(
                partial(_keys_event, GetMany, tuple(keys[i : i + _BATCH_KEYS])),
                sink=None if sink is None else sink(i),
            )
            for i in starts
        ]
        for first, call in zip(starts, calls, strict=True):
            answer = cast(GetManyResult, call.result())
            asked = min(_BATCH_KEYS, len(keys) - first)
            # A prefix of at least one key, or the loop would ask again forever (or the
            # results would not line up with the keys).
            if not 1 <= len(answer.lengths) <= asked:
                raise RemoteProtocolError(
                    f"the daemon answered {len(answer.lengths)} keys of {asked} asked for"
                )
            out += take(first, answer, call)
            done = first + len(answer.lengths)
            if len(answer.lengths) < asked:
                break  # the daemon answered a prefix; ask again from there
    return out


def _plan_get_many(keys: Sequence[bytes]) -> Plan[list[HeldBlock | None]]:
    return (yield from _plan_get_batches(keys, None, lambda _, a, c: _split(a.lengths, c.payload)))


def _plan_get_many_into(
    keys: Sequence[bytes], buffers: Sequence[IntoBuffer]
) -> Plan[list[Received | None]]:
    """GetMany whose answers are received straight into the caller's buffers (one per key):
    each block's header into a small buffer of its own, its payload into the key's buffer."""
    answered: dict[int, list[Received | None]] = {}

    def take(first: int, answer: GetManyResult, _: _Call) -> list[Received | None]:
        # No sink call: nothing had a payload (every key a miss).
        return answered.pop(first, [None] * len(answer.lengths))

    def sink(first: int) -> Sink:
        return partial(_many_sink, buffers, answered, first)

    return (yield from _plan_get_batches(keys, sink, take))


def _many_sink(
    buffers: Sequence[IntoBuffer],
    answered: dict[int, list[Received | None]],
    first: int,
    event: Event,
) -> list[memoryview]:
    """Where a GetManyResult for keys from `first` on goes; records what each key got."""
    parts: list[memoryview] = []
    got = answered[first] = []
    for i, length in enumerate(cast(GetManyResult, event).lengths):
        if length is None:
            got.append(None)
            continue
        into = buffers[first + i]
        if length < HEADER_BYTES:  # not one of ours: verification makes it a miss
            header = memoryview(bytearray(length))
            parts.append(header)
            got.append(Received(header, 0))
            continue
        if length - HEADER_BYTES > len(into):
            raise InvalidArgumentError(
                f"buffer {first + i} of {len(into)} bytes is too small for a "
                f"{length - HEADER_BYTES}-byte block"
            )
        header = memoryview(bytearray(HEADER_BYTES))
        parts += [header, into.region(0, length - HEADER_BYTES)]
        got.append(Received(header, length - HEADER_BYTES))
    return parts


def _split(lengths: Sequence[int | None], payload: memoryview | None) -> list[HeldBlock | None]:
    out: list[HeldBlock | None] = []
    pos = 0
    data = payload if payload is not None else memoryview(b"")
    for n in lengths:
        if n is None:
            out.append(None)
        else:
            out.append(_Held(data[pos : pos + n]))
            pos += n
    return out


def _plan_simple(make: Callable[[int], Event]) -> Plan[Event]:
    return (yield from _one(_Req(make)))


def _plan_lookup(keys: Sequence[bytes]) -> Plan[int]:
    total = 0
    for i in range(0, len(keys), _BATCH_KEYS):
        chunk = tuple(keys[i : i + _BATCH_KEYS])
        answer = cast(LookupResult, (yield from _one(_Req(partial(_keys_event, Lookup, chunk)))))
        if not 0 <= answer.count <= len(chunk):
            raise RemoteProtocolError(f"lookup of {len(chunk)} keys answered {answer.count}")
        total += answer.count
        if answer.count < len(chunk):
            break
    return total


def _plan_prefetch(keys: Sequence[bytes]) -> Plan[int]:
    chunks = [tuple(keys[i : i + _BATCH_KEYS]) for i in range(0, len(keys), _BATCH_KEYS)]
    calls = yield [_Req(partial(_keys_event, Prefetch, c)) for c in chunks]
    counts = [cast(PrefetchResult, call.result()).count for call in calls]
    if any(not 0 <= n <= len(c) for n, c in zip(counts, chunks, strict=True)):
        raise RemoteProtocolError(f"prefetch answered {counts} for chunks of {len(chunks[0])}")
    return sum(counts)


_CLIENT = f"kvoffload-sdk/{__version__} python"


# ---------------------------------------------------------------------------- sync driver


class _SyncConnection:
    """One blocking socket and its session."""

    def __init__(self, options: KVOptions, context: ssl.SSLContext | None, deadline: float) -> None:
        self.options = options
        self.session = _Session()
        try:
            sock = socket.create_connection(
                (options.host, options.port), timeout=min(options.connect_timeout, _left(deadline))
            )
        except TimeoutError:
            raise DeadlineExceededError(f"connecting to {options.url} timed out") from None
        except OSError as exc:
            raise TransportError(f"cannot reach {options.url}: {exc.strerror or exc}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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
        self.welcome: Welcome = self.run(_plan_hello(options.token), deadline)

    def run(self, plan: Plan[T], deadline: float) -> T:
        try:
            reqs = next(plan)
            while True:
                reqs = plan.send(self._exchange(reqs, deadline))
        except StopIteration as stop:
            return cast(T, stop.value)

    def _exchange(self, reqs: list[_Req], deadline: float) -> list[_Call]:
        """Send `reqs` (at most _WINDOW unanswered at a time) and collect their answers."""
        calls: list[_Call] = []
        for req in reqs:
            while sum(1 for c in calls if not c.done) >= _WINDOW:
                self._receive(deadline)
            call, parts = self.session.start(req)
            calls.append(call)
            self._send(parts, deadline)
        while not all(c.done for c in calls):
            self._receive(deadline)
        return calls

    def _send(self, parts: list[bytes | memoryview], deadline: float) -> None:
        try:
            self.sock.settimeout(_left(deadline))
            if self.tls:
                for part in parts:
                    self.sock.sendall(part)
                return
            _send_all(self.sock, parts)
        except OSError as exc:
            raise self._lost(exc) from None

    def _receive(self, deadline: float) -> None:
        session = self.session
        try:
            self.sock.settimeout(_left(deadline))
            n = self.sock.recv_into(session.conn.get_buffer())
        except OSError as exc:
            raise self._lost(exc) from None
        if n:
            session.conn.buffer_updated(n)
        else:
            session.conn.receive_eof()
        session.feed()

    def _lost(self, exc: OSError) -> KVOffloadError:
        error: KVOffloadError
        if isinstance(exc, TimeoutError):
            error = DeadlineExceededError(f"{self.options.url} did not answer in time")
        else:
            error = TransportError(f"connection to {self.options.url} lost: {exc}")
        self.session.fail(error)
        self.session.conn.send_failed()
        self.close()
        return error

    @property
    def healthy(self) -> bool:
        return self.session.broken is None and not self.session.calls

    def stale(self) -> bool:
        """Whether the daemon closed this idle connection (a goodbye or EOF is waiting)."""
        session = self.session
        try:
            if not select.select([self.sock], [], [], 0)[0]:
                return False
            self.sock.settimeout(0)
            n = self.sock.recv_into(session.conn.get_buffer())
        except (ssl.SSLWantReadError, BlockingIOError):
            return False  # TLS bytes that are not a whole record yet
        except (OSError, ValueError):
            return True
        if n:
            session.conn.buffer_updated(n)
        else:
            session.conn.receive_eof()
        session.feed()
        return session.broken is not None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def _send_all(sock: socket.socket, parts: Sequence[bytes | memoryview]) -> None:
    """`sendmsg` every byte of `parts` (a blocking socket; its timeout applies per call)."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        sent = sock.sendmsg(views[:512])  # Linux takes at most IOV_MAX (1024) buffers
        while sent:
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0] = views[0][sent:]
                sent = 0


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceededError("operation timed out")
    return left


class _Retrying:
    """Deadline, retry and backoff policy shared by both drivers."""

    def __init__(self, options: KVOptions) -> None:
        self.options = options

    def delays(self, deadline: float) -> Generator[float, None, None]:
        delay = self.options.backoff
        for _ in range(self.options.retries):
            # Full jitter: many clients of one restarting daemon do not retry in lockstep.
            wait = random.uniform(0, delay)
            if time.monotonic() + wait >= deadline:
                return
            yield wait
            delay = min(delay * 2, 2.0)


class KVTransport:
    """Blocking `kv://` transport: a pool of connections, each pipelining a plan's requests."""

    def __init__(self, options: KVOptions) -> None:
        self.options = options
        self._context = options.ssl_context()
        self._retry = _Retrying(options)
        self._idle: list[_SyncConnection] = []
        self._open = 0
        self._cond = threading.Condition()
        self._welcome: Welcome | None = None
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
                    if not conn.stale():
                        conn.reused = True
                        return conn
                    conn.close()
                    self._open -= 1
                if self._open < self.options.pool:
                    self._open += 1
                    break
                if not self._cond.wait(timeout=_left(deadline)):
                    raise DeadlineExceededError(f"no free connection to {self.options.url}")
        try:
            conn = _SyncConnection(self.options, self._context, deadline)
        except BaseException:
            with self._cond:
                self._open -= 1
                self._cond.notify()
            raise
        self._welcome = conn.welcome
        return conn

    def _release(self, conn: _SyncConnection, healthy: bool) -> None:
        with self._cond:
            if healthy and conn.healthy and not self._closed:
                self._idle.append(conn)
            else:
                conn.close()
                self._open -= 1
            self._cond.notify()

    def _run(self, plan: Callable[[], Plan[T]]) -> T:
        """Run a fresh plan, retrying on a lost connection (every operation is idempotent)."""
        deadline = time.monotonic() + self.options.timeout
        delays = self._retry.delays(deadline)
        while True:
            conn = None
            try:
                conn = self._acquire(deadline)
                result = conn.run(plan(), deadline)
            except TransportError as exc:
                if conn is not None:
                    self._release(conn, False)
                    if conn.reused and conn.session.peer_closed:
                        # The daemon closed a pooled connection (idle) just as this request
                        # went out: not a failure of the request. Each pooled connection can
                        # cause this once, so it needs no retry budget.
                        log.debug("pooled connection was closed (%s); reconnecting", exc)
                        continue
                wait = next(delays, None)
                if wait is None:
                    raise
                log.debug("retrying after %s", exc)
                time.sleep(wait)
                continue
            except KVOffloadError:
                if conn is not None:  # an error answer leaves the connection usable
                    self._release(conn, True)
                raise
            except BaseException:
                if conn is not None:
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
    def tenant(self) -> str:
        self.max_value_bytes  # noqa: B018 - connects if needed
        assert self._welcome is not None
        return self._welcome.tenant

    def _budget(self) -> int:
        self.max_value_bytes  # noqa: B018 - connects if needed
        assert self._welcome is not None
        return self._welcome.max_payload_bytes

    def put(
        self, key: bytes, parts: Sequence[object], parent: bytes | None, durable: bool = False
    ) -> None:
        self._run(lambda: _plan_put(key, parts, parent, durable))

    def put_many(self, items: Sequence[PutItem], durable: bool = False) -> None:
        budget = self._budget()
        self._run(lambda: _plan_put_many(items, durable, budget))

    def get(self, key: bytes) -> HeldBlock | None:
        return self._run(lambda: _plan_get(key))

    def get_into(self, key: bytes, buffer: memoryview) -> HeldBlock | Received | None:
        into = IntoBuffer(buffer)
        return received_into(into, lambda: self._run(lambda: _plan_get_into(key, into)))

    def get_many(self, keys: Sequence[bytes]) -> list[HeldBlock | None]:
        return self._run(lambda: _plan_get_many(keys))

    def get_many_into(
        self, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> list[HeldBlock | Received | None]:
        into = [IntoBuffer(b) for b in buffers]
        got = received_many_into(into, lambda: self._run(lambda: _plan_get_many_into(keys, into)))
        return list(got)

    def exists(self, key: bytes) -> bool:
        answer = self._run(lambda: _plan_simple(partial(_key_event, Exists, key)))
        return cast(ExistsResult, answer).found

    def lookup(self, keys: Sequence[bytes]) -> int:
        return self._run(lambda: _plan_lookup(keys))

    def prefetch(self, keys: Sequence[bytes]) -> int:
        return self._run(lambda: _plan_prefetch(keys))

    def delete(self, key: bytes) -> bool:
        answer = self._run(lambda: _plan_simple(partial(_key_event, Delete, key)))
        return cast(DeleteResult, answer).deleted

    def stats(self) -> dict[str, object]:
        answer = self._run(lambda: _plan_simple(Stats))
        return cast(StatsResult, answer).stats

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        for conn in idle:
            conn.close()


# ---------------------------------------------------------------------------- asyncio driver


class _Protocol(asyncio.BufferedProtocol):
    """Feeds received bytes straight into the session's codec buffer (or a caller's sink)."""

    def __init__(self, session: _Session, on_progress: Callable[[], None]) -> None:
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


class _AsyncConnection:
    """One multiplexed connection: any number of coroutines' requests in flight at once."""

    def __init__(self, options: KVOptions) -> None:
        self.options = options
        self.session = _Session()
        self.protocol: _Protocol | None = None
        self.welcome: Welcome | None = None
        self._progress = asyncio.Event()

    def _notify(self) -> None:
        self._progress.set()

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
                timeout=min(self.options.connect_timeout, _left(deadline)),
            )
        except asyncio.TimeoutError:
            raise DeadlineExceededError(f"connecting to {self.options.url} timed out") from None
        except (OSError, ssl.SSLError) as exc:
            raise TransportError(f"cannot reach {self.options.url}: {exc}") from None
        self.protocol = protocol
        sock = protocol.transport.get_extra_info("socket") if protocol.transport else None
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.welcome = await self.run(_plan_hello(self.options.token), deadline)

    @property
    def healthy(self) -> bool:
        return self.protocol is not None and self.session.broken is None

    async def run(self, plan: Plan[T], deadline: float) -> T:
        try:
            reqs = next(plan)
            while True:
                reqs = plan.send(await self._exchange(reqs, deadline))
        except StopIteration as stop:
            return cast(T, stop.value)

    async def _exchange(self, reqs: list[_Req], deadline: float) -> list[_Call]:
        protocol = self.protocol
        assert protocol is not None and protocol.transport is not None
        calls: list[_Call] = []
        try:
            for req in reqs:
                await asyncio.wait_for(protocol.writable(), _left(deadline))
                call, parts = self.session.start(req)
                calls.append(call)
                protocol.transport.writelines(parts)
            while not all(c.done for c in calls):
                self._progress.clear()
                await asyncio.wait_for(self._progress.wait(), _left(deadline))
        except (asyncio.TimeoutError, DeadlineExceededError):
            self._abandon(calls)
            raise DeadlineExceededError(f"{self.options.url} did not answer in time") from None
        except asyncio.CancelledError:
            self._abandon(calls)
            raise
        return calls

    def _abandon(self, calls: list[_Call]) -> None:
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


class AsyncKVTransport:
    """asyncio `kv://` transport: one connection multiplexes every concurrent request."""

    def __init__(self, options: KVOptions) -> None:
        self.options = options
        self._context = options.ssl_context()
        self._retry = _Retrying(options)
        self._conn: _AsyncConnection | None = None
        self._connecting: asyncio.Lock | None = None
        self._welcome: Welcome | None = None

    async def _connection(self, deadline: float) -> _AsyncConnection:
        if self._conn is not None and self._conn.healthy:
            return self._conn
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._conn is None or not self._conn.healthy:
                conn = _AsyncConnection(self.options)
                try:
                    await conn.open(self._context, deadline)
                except BaseException:
                    conn.close()
                    raise
                self._conn = conn
                self._welcome = conn.welcome
        return self._conn

    async def _run(self, plan: Callable[[], Plan[T]]) -> T:
        deadline = time.monotonic() + self.options.timeout
        delays = self._retry.delays(deadline)
        earlier = self._conn
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
                wait = next(delays, None)
                if wait is None:
                    raise
                await asyncio.sleep(wait)

    async def _welcomed(self) -> Welcome:
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
        await self._welcomed()

    async def put(
        self, key: bytes, parts: Sequence[object], parent: bytes | None, durable: bool = False
    ) -> None:
        await self._run(lambda: _plan_put(key, parts, parent, durable))

    async def put_many(self, items: Sequence[PutItem], durable: bool = False) -> None:
        budget = (await self._welcomed()).max_payload_bytes
        await self._run(lambda: _plan_put_many(items, durable, budget))

    async def get(self, key: bytes) -> HeldBlock | None:
        return await self._run(lambda: _plan_get(key))

    async def get_into(self, key: bytes, buffer: memoryview) -> HeldBlock | Received | None:
        into = IntoBuffer(buffer)
        return await received_into_async(into, lambda: self._run(lambda: _plan_get_into(key, into)))

    async def get_many(self, keys: Sequence[bytes]) -> list[HeldBlock | None]:
        return await self._run(lambda: _plan_get_many(keys))

    async def get_many_into(
        self, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> list[HeldBlock | Received | None]:
        into = [IntoBuffer(b) for b in buffers]
        got = await received_many_into_async(
            into, lambda: self._run(lambda: _plan_get_many_into(keys, into))
        )
        return list(got)

    async def exists(self, key: bytes) -> bool:
        answer = await self._run(lambda: _plan_simple(partial(_key_event, Exists, key)))
        return cast(ExistsResult, answer).found

    async def lookup(self, keys: Sequence[bytes]) -> int:
        return await self._run(lambda: _plan_lookup(keys))

    async def prefetch(self, keys: Sequence[bytes]) -> int:
        return await self._run(lambda: _plan_prefetch(keys))

    async def delete(self, key: bytes) -> bool:
        answer = await self._run(lambda: _plan_simple(partial(_key_event, Delete, key)))
        return cast(DeleteResult, answer).deleted

    async def stats(self) -> dict[str, object]:
        answer = await self._run(lambda: _plan_simple(Stats))
        return cast(StatsResult, answer).stats

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def open_kv(url: StoreURL) -> KVTransport:
    """Open `kv://host:port?token=...` (blocking)."""
    return KVTransport(KVOptions.from_url(url))


def open_kv_async(url: StoreURL) -> AsyncKVTransport:
    """Open `kv://host:port?token=...` for asyncio (connects on first use or `open()`)."""
    return AsyncKVTransport(KVOptions.from_url(url))
