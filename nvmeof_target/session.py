"""What the daemon's fronts share per connection: a reader task that can be stopped or cut off,
engine work that may block run on the I/O threads (with an SSD tier: reads, reservations,
commits and deletes), per-request metrics, and a graceful stop.

The native front (`native.py`) and the NVMe/TCP front (`nvme.py`) each subclass `Session` for
their protocol; everything here is protocol-agnostic.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvoffload.errors import KVOffloadError, RemoteProtocolError, TransportError
from kvoffload.nvmeof_target.channel import Channel
from kvoffload.nvmeof_target.metrics import Metrics
from kvoffload.nvmeof_target.services import Services

__all__ = [
    "TURN_STEPS",
    "Instruments",
    "PeerLog",
    "RoomLimits",
    "Session",
    "make_room",
    "stop_sessions",
]

log = logging.getLogger("kvoffload.serve")
T = TypeVar("T")
S = TypeVar("S", bound="Session")
# Requests (or socket reads) one connection handles in one turn of the event loop before its
# reader lets the loop serve the other connections: a peer that pipelines hundreds of frames
# (valid or garbage) must not make every other client's request wait behind all of them.
TURN_STEPS = 8


class PeerLog:
    """A front's per-connection log lines (a peer's protocol errors, connections closed for a
    timeout or a budget), at most `burst` per `window_s`: a peer that sends garbage on
    connection after connection must not make the daemon's one loop format and write a line
    for each. The lines held back are counted and said with the next line of a later window
    (the metrics count every one of them anyway)."""

    def __init__(
        self,
        logger: logging.Logger,
        burst: int = 20,
        window_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self._burst = burst
        self._window_s = window_s
        self._clock = clock
        self._since = clock()
        self._said = 0
        self.held = 0  # lines not logged in the current window

    def info(self, msg: str, *args: object) -> None:
        now = self._clock()
        if now - self._since >= self._window_s:
            if self.held:
                self._log.info(
                    "%d more connection log lines held back in %.0f s", self.held, now - self._since
                )
            self._since, self._said, self.held = now, 0, 0
        if self._said < self._burst:
            self._said += 1
            self._log.info(msg, *args)
        else:
            self.held += 1


# The ops `HotGets.take_metrics` counts, in its order (a GetMany is "getmany" here as in
# `NativeSession._dispatch`); `HotGets.serve` answers the first four, `put_done` puts.
OPS = ("get", "exists", "lookup", "getmany", "put")


class Instruments:
    """The request counter and latency histogram of each (op, status) of one front, and its
    payload byte counters, looked up once (label lookups cost more than the increments); and
    its rate-limited per-connection log (`peer_log`)."""

    def __init__(self, metrics: Metrics, front: str, logger: logging.Logger) -> None:
        self._metrics = metrics
        self._front = front
        self.peer_log = PeerLog(logger)
        self._found: dict[tuple[str, str], tuple[Any, Any]] = {}
        self.bytes_in = metrics.bytes_in.labels(front)
        self.bytes_out = metrics.bytes_out.labels(front)
        # Touched once or twice per connection: a crowd of short connections (a fuzzing peer)
        # must not cost a label lookup each time.
        self.connections = metrics.connections.labels(front)
        self.connections_total = metrics.connections_total.labels(front)
        self.protocol_errors = metrics.protocol_errors.labels(front)
        # Connections whose C hot path counts its requests itself (`HotGets.take_metrics`),
        # folded in before every scrape: no prometheus call per answered batch.
        self.hot: set[Any] = set()
        metrics.before_collect(self.fold_all)

    def fold_all(self) -> None:
        for hot in list(self.hot):  # a copy: the loop thread adds and drops connections
            self.fold(hot)

    def fold(self, hot: Any) -> None:
        """Add what `hot` counted since it was last taken to the request metrics."""
        counts, out_bytes, buckets, sums, in_bytes = hot.take_metrics()
        if out_bytes:
            self.bytes_out.inc(out_bytes)
        if in_bytes:
            self.bytes_in.inc(in_bytes)
        for op, count, row, total in zip(OPS, counts, buckets, sums, strict=True):
            if not count:
                continue
            counter, histogram = self(op, "ok")
            counter.inc(count)
            # The histogram's own values (prometheus_client has no bulk observe): its buckets
            # are stored as C counts them, not cumulative, +Inf last.
            for value, n in zip(histogram._buckets, row, strict=True):
                if n:
                    value.inc(n)
            histogram._sum.inc(total)

    def __call__(self, op: str, status: str) -> tuple[Any, Any]:
        found = self._found.get((op, status))
        if found is None:
            found = (
                self._metrics.requests.labels(self._front, op, status),
                self._metrics.latency.labels(self._front, op),
            )
            self._found[(op, status)] = found
        return found


class Session:
    """One client connection of a front (subclassed per protocol).

    `run()` reads in its own task (`_read_loop`, the protocol's) so that `stop_reading()` can
    cancel it without cancelling the orderly finish: in-flight work is awaited, partially
    received writes are dropped (`_abandon`), queued answers are flushed, the socket closed.

    A peer that stops reading its answers is given `send_timeout_s` without progress (the
    front's watchdog asks `send_stalled`, and the finish gives up flushing), then cut off: its
    queued answers pin arena blocks, which must not stay pinned for as long as it likes.
    """

    def __init__(
        self,
        front: str,
        services: Services,
        channel: Channel,
        peer: str,
        instruments: Instruments,
        send_timeout_s: float,
    ) -> None:
        self.front_name = front
        self.services = services
        self.channel = channel
        self.peer = peer
        self.address = peer.rpartition(":")[0]  # the peer's address, for its front's budgets
        self.dropped = False  # closed by its front to make room: no longer counted
        self.send_timeout_s = send_timeout_s
        self._instruments = instruments
        self.bytes_in = instruments.bytes_in
        self.bytes_out = instruments.bytes_out
        self._started: dict[int, tuple[str, float]] = {}  # request/command id -> (op, t0)
        self._inflight_bytes = 0  # answer bytes queued and not yet in the kernel
        self._tasks: set[asyncio.Task[None]] = set()
        self._room = asyncio.Event()  # set while the session may take more requests
        self._room.set()
        self._reading = True  # False once the connection should take no more requests
        self._reader: asyncio.Task[None] | None = None
        self._steps = 0  # requests and reads since the reader last let the loop go round
        self._waits = 0  # the channel's `waits` when `_steps` was last counted
        self.peer_log = instruments.peer_log

    async def run(self) -> None:
        self._instruments.connections.inc()
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())
        try:
            await self._reader
        except asyncio.CancelledError:
            pass  # stop_reading() or abort(): finish what was already received
        except RemoteProtocolError as exc:
            self._instruments.protocol_errors.inc()
            self._protocol_error(exc)
        except TransportError:
            pass  # the peer went away
        except Exception:  # a bug must cost one connection, never the daemon
            log.exception("%s connection %s failed", self.front_name, self.peer)
            self._internal_error()
        finally:
            self._reader = None
            await self._finish()
            self._instruments.connections.dec()
            self._forget()

    async def _read_loop(self) -> None:
        """Receive and handle requests until the peer is done or reading stops."""
        raise NotImplementedError

    def _protocol_error(self, exc: RemoteProtocolError) -> None:
        """The peer broke the protocol; tell it if the protocol can (reading has stopped)."""
        self.peer_log.info("protocol error from %s: %s", self.peer, exc)

    def _internal_error(self) -> None:
        """A bug ended the connection; tell the peer if the protocol can."""

    def _abandon(self) -> None:
        """Drop writes whose data had not fully arrived (they must never become visible)."""

    def _forget(self) -> None:
        """The connection is over: the front stops tracking it."""

    async def _finish(self) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks))
        self._abandon()
        await self._flush()
        self.channel.close()

    async def _flush(self) -> None:
        """Send what is queued, unless the peer takes nothing for `send_timeout_s`."""
        channel = self.channel
        while channel.buffered:
            left = channel.progress_at + self.send_timeout_s - time.monotonic()
            if left <= 0:
                self.services.metrics.refused.labels(self.front_name, "send timeout").inc()
                self.peer_log.info(
                    "closing %s: send timeout (%d B unsent)", self.peer, channel.buffered
                )
                return
            try:
                await asyncio.wait_for(channel.drain(), left)
                return
            except asyncio.TimeoutError:
                continue  # see whether the peer took anything meanwhile
            except TransportError:
                return

    def send_stalled(self, now: float) -> bool:
        """Answers are queued and the peer has taken none of them for `send_timeout_s`."""
        return bool(self.channel.buffered) and now - self.channel.progress_at > self.send_timeout_s

    def stop_reading(self) -> None:
        """Take no more requests; answer those already received, then close."""
        self._reading = False
        if self._reader is not None:
            self._reader.cancel()

    def end_after_answers(self) -> None:
        """Take no more requests; the connection closes once what is queued is out."""
        self._reading = False

    def drop_for_room(self) -> None:
        """Closed by the front to make room for a newer connection (it never authenticated)."""
        self.dropped = True
        self.abort()

    def abort(self) -> None:
        """Close now, dropping whatever is queued."""
        self._reading = False
        self.channel.close()
        self._room.set()
        if self._reader is not None:
            self._reader.cancel()

    def _wake(self) -> None:
        """Something finished: flow control may let the reader go on (subclasses decide)."""

    def _turn_left(self) -> int:
        """Requests this connection may still take in this turn of the loop (`_next_step`)."""
        if self.channel.waits != self._waits:  # the loop went round while it waited for data
            self._waits = self.channel.waits
            self._steps = 0
        return TURN_STEPS - self._steps

    async def _next_step(self, count: int = 1) -> None:
        """Count `count` requests or reads; after `TURN_STEPS` of them in one turn of the loop
        (no read found the socket empty meanwhile: the peer keeps sending) the reader lets the
        loop serve the other connections' ready requests before it goes on. A request/reply
        client drains its socket and waits each time, so it is never made to yield
        mid-request."""
        self._turn_left()
        self._steps += count
        if self._steps >= TURN_STEPS:
            self._steps = 0
            await asyncio.sleep(0)

    def _started_now(self, request: int, op: str) -> None:
        self._started[request] = (op, time.perf_counter())

    def _answer(
        self,
        request: int,
        parts: Sequence[bytes | memoryview],
        status: str,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        """Queue the buffers that answer `request`: they count against the in-flight budget
        until the kernel has them (then `on_done` runs: a pinned view may be released), and
        the request's counter and latency are recorded."""
        size = 0
        for part in parts:
            size += len(part)
        self._inflight_bytes += size

        def done() -> None:
            self._inflight_bytes -= size
            if on_done is not None:
                on_done()
            self._wake()

        # Counted before the write: the write may reach the client at once, and a client that
        # then scrapes the metrics must find its request there. The latency includes the write
        # (the send call, TLS encryption), as it always has.
        op, t0 = self._started.pop(request, ("?", time.perf_counter()))
        counter, histogram = self._instruments(op, status)
        counter.inc()
        self.channel.write(parts, done)
        histogram.observe(time.perf_counter() - t0)

    def offload(
        self,
        work: Callable[[], T],
        then: Callable[[T], None],
        fail: Callable[[KVOffloadError], None],
    ) -> asyncio.Task[None]:
        """Run `work` on the I/O threads (it may block), then `then(result)` on the loop, or
        `fail(error)` if it raised a KVOffloadError. The connection's finish waits for it."""
        loop = asyncio.get_running_loop()

        async def job() -> None:
            try:
                result = await loop.run_in_executor(self.services.executor, work)
            except KVOffloadError as exc:
                fail(exc)
                return
            then(result)

        task = loop.create_task(job())
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("request on %s failed", self.peer, exc_info=task.exception())
            self.abort()
        self._wake()

    def read(
        self,
        work: Callable[[], T],
        then: Callable[[T], None],
        fail: Callable[[KVOffloadError], None],
    ) -> None:
        """An engine read inline, or on the I/O threads when it may wait on a device."""
        if self.services.blocking_engine:
            self.offload(work, then, fail)
            return
        _inline(work, then, fail)

    def in_order(
        self,
        work: Callable[[], T],
        then: Callable[[T], None],
        fail: Callable[[KVOffloadError], None],
    ) -> Awaitable[object] | None:
        """An engine call that changes the store (commit, delete): inline while the engine is
        DRAM-only; with an SSD tier on the I/O threads (it may write to, or wipe on, the
        device, and holding the loop would stall every connection). Then the caller (the
        reader) awaits what this returns, so the next request still sees the change, as it
        does inline; if the reader is cut off meanwhile, the work is still answered."""
        if not self.services.blocking_engine:
            _inline(work, then, fail)
            return None
        return asyncio.wait({self.offload(work, then, fail)})

    async def off_loop(self, work: Callable[[], T], undo: Callable[[T], None]) -> T:
        """Run `work` on the I/O threads and return its result (the caller, the reader, waits;
        other connections do not).

        Raises:
            KVOffloadError: from `work`.
            asyncio.CancelledError: the reader was stopped; `undo(result)` then runs once
                `work` is done, so that what it claimed (a reservation) does not outlive the
                connection.
        """
        job = asyncio.get_running_loop().run_in_executor(self.services.executor, work)
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            # The shielded work goes on and what it claims belongs to no one now: give it back
            # once done. The connection's finish waits for that, as for offloaded requests.
            task = asyncio.get_running_loop().create_task(_undo_when_done(job, undo))
            self._tasks.add(task)
            task.add_done_callback(self._task_done)
            raise


def _inline(
    work: Callable[[], T], then: Callable[[T], None], fail: Callable[[KVOffloadError], None]
) -> None:
    try:
        result = work()
    except KVOffloadError as exc:
        fail(exc)
        return
    then(result)


async def _undo_when_done(job: asyncio.Future[T], undo: Callable[[T], None]) -> None:
    try:
        result = await job
    except Exception:  # the work failed: it claimed nothing
        return
    undo(result)


async def stop_sessions(sessions: Mapping[S, asyncio.Task[None]], timeout: float) -> None:
    """Stop reading on every session, give them `timeout` s to answer what they have, then
    cut off the rest."""
    running = dict(sessions)  # a copy: sessions remove themselves as they end
    for session in running:
        session.stop_reading()
    if running:
        _, late = await asyncio.wait(running.values(), timeout=timeout)
        for session, task in running.items():
            if task in late:
                session.abort()
        if late:
            await asyncio.wait(late, timeout=1.0)


@dataclass(frozen=True)
class RoomLimits:
    """A front's connection limits; `waiting` counts connections not yet authenticated (no
    accepted Hello, no NVMe Connect), in all and per peer address."""

    connections: int
    waiting: int
    waiting_per_peer: int
    label: str  # the refusal reason's word: "unauthenticated", "unconnected"


def make_room(
    sessions: Collection[S],
    admitted: Callable[[S], bool],
    address: str,
    limits: RoomLimits,
    metrics: Metrics,
    front: str,
    peer_log: PeerLog,
) -> bool:
    """Room for a new connection from `address`: beyond the budgets of connections not yet
    admitted (per peer, in all) or the connection limit, the oldest such connection (of this
    peer first) is closed; an admitted one never is. False when every connection is admitted
    and the limit is reached. `sessions` iterate oldest first."""
    waiting = [s for s in sessions if not admitted(s) and not s.dropped]
    mine = [s for s in waiting if s.address == address]
    if len(mine) >= limits.waiting_per_peer:
        victim, reason = mine[0], f"{limits.label} per peer"
    elif len(waiting) >= limits.waiting or (waiting and len(sessions) >= limits.connections):
        victim, reason = waiting[0], limits.label
    else:
        return len(sessions) < limits.connections
    metrics.refused.labels(front, reason).inc()
    peer_log.info("closing %s: %s connections over budget", victim.peer, reason)
    victim.drop_for_room()
    return True
