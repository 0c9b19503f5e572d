"""`kv://host:port?data=nixl`: the native protocol as control channel, payloads one-sided.

A get asks the daemon to WRITE the block's payload straight into the caller's buffer and
answers with the block's length and header; a put names where its payload lies and the daemon
READs it into a reserved slot (docs/guides/nixl.md). The client registers buffers once
(`nixl_memory`); verification is the request layer's, as for every `Received` block.

Each NIXL lane is one control connection (protocol 4, or 3 with an older daemon) with its own
agent: the daemon ties registered memory to the connection that registered it. A daemon that
speaks only protocol 2 (or refuses NIXL: TLS, no nixl installed there) leaves the lane closed
and every operation takes the plain `kv://` path, logged once.

A get or put whose deadline passes does not hand its buffer back while the daemon may still
move bytes into or out of it: the lane shuts its side of the connection (a daemon posts no
transfer after that, nor past the time left that protocol 4 requests carry) and waits, for at
most `_SETTLE_S`, for the daemon to finish the request. If it does not, the lane's agent,
registrations and half-closed connection are kept (`quarantined`) and the error says so, until
the daemon answers or closes that connection: then its handler is over (any transfer done or
cancelled, our agent removed there), and once our memory is deregistered and our agent gone,
no late transfer can land in it by any transport (docs/guides/nixl.md), so the lane is released.
"""

from __future__ import annotations

import logging
import select
import socket
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
from kvoffload.client_sdk.transports.core import left, too_small
from kvoffload.client_sdk.transports.native import plans
from kvoffload.client_sdk.transports.native.nixl_memory import NixlMemory, Region, address_of
from kvoffload.client_sdk.transports.native.options import NativeOptions
from kvoffload.client_sdk.transports.native.session import Req
from kvoffload.client_sdk.transports.native.sync import NativeTransport, _SyncConnection
from kvoffload.errors import (
    DeadlineExceededError,
    KVOffloadError,
    RemoteProtocolError,
    TransportError,
)
from kvoffload.wire.block import HEADER_BYTES
from kvoffload.wire.native.connection import (
    AUTH_VERSION,
    NIXL_DEADLINE_VERSION,
    NIXL_VERSION,
    PROTOCOL_VERSION,
    Event,
    NixlGet,
    NixlGetResult,
    NixlPut,
)
from kvoffload.wire.native.connection import (
    NixlMemory as NixlMemoryEvent,
)

__all__ = ["NixlTransport", "quarantined", "release_quarantined"]

log = logging.getLogger("kvoffload.client")
T = TypeVar("T")
# Polls of the socket and NIXL's progress before the wait starts sleeping in select between
# progress calls (bounds the CPU a slow answer costs; a fast one never sleeps).
_SPINS = 50
_NAP_S = 0.0001
# The first NixlMemory of a lane may wait this long for the daemon to make its agent.
_SETUP_S = 120.0
# Keys per NixlGet / NixlPut frame.
_BATCH = 1024
# After a transfer request's deadline: how long to wait for the daemon to finish it before
# its lane's memory is quarantined.
_SETTLE_S = 5.0
# Lanes (agent, registrations, the buffers they keep alive, the connection) whose daemon has
# not yet confirmed a request it may still be moving bytes for; released once it has.
quarantined: list[_Lane] = []
_quarantine_lock = threading.Lock()
# Past this many quarantined lanes a transport opens no more NIXL lanes (calls take kv://):
# bounds what a hung daemon can make this process hold (each lane: its registration cache).
_MAX_QUARANTINED = 8


class _Refused(Exception):
    """The daemon speaks protocol 2 or older: no NIXL data path there."""


class _Older(Exception):
    """The daemon refused this protocol version: try the one below."""


class _Lane:
    """One protocol 3 connection, its NIXL agent and the memory registered on it."""

    def __init__(
        self, options: NativeOptions, context: ssl.SSLContext | None, version: int
    ) -> None:
        deadline = time.monotonic() + options.connect_timeout
        try:
            self.conn = _SyncConnection(options, context, deadline, version)
        except RemoteProtocolError as exc:
            if plans.older_version(exc, version) is None:
                raise
            if version > NIXL_VERSION:
                raise _Older(str(exc)) from None
            raise _Refused(str(exc)) from None
        # Whether NixlGet / NixlPut carry the time left (protocol 4).
        self.budgets = self.conn.welcome.version >= NIXL_DEADLINE_VERSION
        self.unsafe = False  # the daemon may still move bytes for a request we gave up on
        self.to_revoke: list[memoryview] = []  # asked for while the lane was busy
        self.timeout = options.timeout
        try:
            self.memory = NixlMemory(max_bytes=options.nixl_cache_bytes)
            # The daemon refuses with a ConfigError if it cannot or may not (TLS) serve NIXL.
            # The daemon makes its agent on first use, loading NIXL's plugins: seconds on a
            # busy host, so the first exchange may take longer than a request.
            first = max(self.timeout, _SETUP_S)
            self.ask(lambda rid: NixlMemoryEvent(rid, agent=self.memory.metadata()), first)
            self.prove()
        except BaseException:
            self.conn.close()
            raise

    def ask(self, make: Callable[[int], Event], timeout: float = 0.0) -> Event:
        """Send one request and wait for its answer (at most `timeout` s, default the URL's),
        driving NIXL's progress meanwhile (the daemon's transfer into or out of our memory
        needs it on TCP)."""
        conn = self.conn
        deadline = time.monotonic() + (timeout or self.timeout)
        call = conn.start(Req(make), deadline)
        sock = conn.sock
        spins = 0
        while not call.done:
            pending = isinstance(sock, ssl.SSLSocket) and sock.pending()
            wait = 0.0 if spins < _SPINS else min(_NAP_S, left(deadline))
            if pending or select.select([sock], [], [], wait)[0]:
                conn.pump(deadline)
                continue
            self.memory.progress()
            spins += 1
            if spins % 256 == 0:
                left(deadline)  # raises past the deadline
        return call.result()

    def prove(self) -> None:
        """Echo the nonce the daemon sent our agent after our last metadata (a NIXL
        notification, which only our own worker receives): no transfer is served before.

        Raises:
            DeadlineExceededError: it did not arrive within the URL's timeout.
        """
        if self.conn.welcome.version < AUTH_VERSION:
            return  # an older daemon sends none (and asks for none)
        deadline = time.monotonic() + self.timeout
        while (nonce := self.memory.take_proof()) is None:
            self.memory.progress()
            if left(deadline) > _NAP_S:  # raises past the deadline
                time.sleep(_NAP_S)
        self.ask(lambda rid: NixlMemoryEvent(rid, echo=nonce))

    def transfer(self, make: Callable[..., Event]) -> Event:
        """`ask` for a request that makes the daemon move bytes (NixlGet, NixlPut), which
        carries the time left where the daemon takes it. Past the deadline the daemon must be
        seen to be done with our memory before the caller may reuse it (see `_settle`).

        Raises:
            DeadlineExceededError: the time ran out (the lane is then closed; its memory
                quarantined if the daemon never confirmed).
        """
        started = time.monotonic()

        def event(rid: int) -> Event:
            if not self.budgets:
                return make(rid)
            budget = self.timeout - (time.monotonic() - started)
            return make(rid, budget_ms=max(0, int(budget * 1000)))

        try:
            return self.ask(event)
        except DeadlineExceededError:
            if self._settle(started + self.timeout + _SETTLE_S):
                raise
            self.unsafe = True
            log.error(
                "%s: no answer after a NIXL request timed out; its buffers stay "
                "registered for good",
                self.conn.options.url,
            )
            raise DeadlineExceededError(
                "operation timed out, and the daemon did not confirm it was done with the "
                "buffer: a late NIXL transfer may still write it (it stays registered)"
            ) from None

    def _settle(self, until: float) -> bool:
        """Shut our side of the connection (the daemon then posts nothing more) and wait until
        `until` for the daemon to answer the request or close: either means its handler,
        and any transfer it posted, is over. True if it did."""
        sock = self.conn.sock
        try:
            socket.socket.shutdown(sock, socket.SHUT_WR)  # below TLS: only the FIN matters
        except OSError:
            return True  # the connection is already gone, and the daemon's handler with it
        while (wait := until - time.monotonic()) > 0:
            try:
                if select.select([sock], [], [], min(wait, _NAP_S * 10))[0]:
                    return True  # an answer (of the one request outstanding) or the close
            except (OSError, ValueError):
                return True
            self.memory.progress()  # lets a transfer in flight over TCP finish
        return False  # the connection stays open (half-closed): see `confirmed`

    def confirmed(self) -> bool:
        """Whether the daemon has, since, answered the request we gave up on or closed the
        connection (a quarantined lane's check; never blocks)."""
        try:
            return bool(select.select([self.conn.sock], [], [], 0)[0])
        except (OSError, ValueError):
            return True  # the socket is gone: so is the daemon's side of it

    def reach(self, buffers: Sequence[memoryview]) -> tuple[int, ...]:
        """The addresses of `buffers` (0 for an empty one), registering each new one (and
        telling the daemon). Regions past the cache's size are revoked afterwards, never one
        that this batch names: the request about to be sent must find all of them registered.

        Raises:
            InvalidArgumentError: one cannot be registered (not contiguous, refused).
        """
        used: set[Region] = set()
        addrs = []
        for buffer in buffers:
            if not buffer.nbytes:
                addrs.append(0)
                continue
            addr = address_of(buffer)
            region = self.memory.find(addr, buffer.nbytes)
            if region is None:
                region, meta = self.memory.register(buffer)
                self.ask(partial(NixlMemoryEvent, agent=meta, regions=region))
                self.prove()
            used.add(region)
            addrs.append(addr)
        old = self.memory.surplus(protect=used)
        if old:
            revoke = tuple(x for r in old for x in r)
            self.ask(lambda rid: NixlMemoryEvent(rid, revoke=revoke))
            for r in old:  # the daemon no longer names them: safe to unregister
                self.memory.deregister(r)
        return tuple(addrs)

    def revoke(self, buffer: memoryview) -> bool:
        """Revoke the region that holds exactly `buffer` (daemon first, then NIXL)."""
        region = (address_of(buffer), buffer.nbytes)
        if region not in self.memory.regions:
            return False
        self.ask(lambda rid: NixlMemoryEvent(rid, revoke=region))
        self.memory.deregister(region)
        return True

    def close(self) -> None:
        if self.unsafe:
            with _quarantine_lock:
                quarantined.append(self)  # kept whole, connection included, until confirmed
            return
        self.conn.close()  # the daemon forgets our agent with the connection
        self.memory.close()


def release_quarantined() -> int:
    """Release the quarantined lanes whose daemon has since answered or closed their
    connection (see the module's docstring). Returns how many were released.

    Called before a NIXL lane is taken; callers may call it too.
    """
    with _quarantine_lock:
        done = [lane for lane in quarantined if lane.confirmed()]
        for lane in done:
            quarantined.remove(lane)
    for lane in done:
        lane.conn.close()
        lane.memory.close()  # deregistered, agent dropped: the buffers are free again
    if done:
        log.info("released %d quarantined NIXL lane(s): their daemon confirmed", len(done))
    return len(done)


class NixlTransport(NativeTransport):
    """`NativeTransport` whose gets and puts move payloads over NIXL."""

    def __init__(self, options: NativeOptions) -> None:
        self._lanes: list[_Lane] = []
        self._lanes_open = 0
        self._lane_cond = threading.Condition()
        self._refused = ""
        self._lane_version = PROTOCOL_VERSION  # lowered once a daemon refuses it
        self._busy: set[_Lane] = set()  # lanes in use: a revoke reaches them when given back
        super().__init__(options)

    # ------------------------------------------------------------------ lanes

    def _take(self) -> _Lane | None:
        """An idle lane (opened if needed), or None when the daemon speaks no NIXL.

        Raises:
            ConfigError: NIXL cannot run here, or the daemon refuses it (TLS, not built).
        """
        if quarantined:
            release_quarantined()
            if len(quarantined) >= _MAX_QUARANTINED:
                log.debug("%d NIXL lanes quarantined: kv:// payloads meanwhile", len(quarantined))
                return None
        with self._lane_cond:
            while True:
                if self._refused:
                    return None
                if self._lanes:
                    lane = self._lanes.pop()
                    self._busy.add(lane)
                    return lane
                if self._lanes_open < self.options.pool:
                    self._lanes_open += 1  # counts lanes in existence, idle or in use
                    break
                self._lane_cond.wait()
        try:
            while True:
                try:
                    lane = _Lane(self.options, self.options.ssl_context(), self._lane_version)
                except _Older:
                    self._lane_version -= 1
                    continue
                with self._lane_cond:
                    self._busy.add(lane)
                return lane
        except _Refused as exc:
            log.warning("%s speaks no NIXL (%s); using kv:// payloads", self.options.url, exc)
            with self._lane_cond:
                self._refused = str(exc)
            return None
        except BaseException:
            with self._lane_cond:
                self._lanes_open -= 1
                self._lane_cond.notify()
            raise

    def _give(self, lane: _Lane, healthy: bool) -> None:
        with self._lane_cond:
            self._busy.discard(lane)
            pending, lane.to_revoke = lane.to_revoke, []
        if healthy and pending and lane.conn.healthy:
            try:
                for buffer in pending:
                    lane.revoke(buffer)
            except KVOffloadError:
                healthy = False  # closing the lane drops its registrations all the same
        with self._lane_cond:
            if healthy and lane.conn.healthy and not self._closed:
                self._lanes.append(lane)
            else:
                lane.close()
                self._lanes_open -= 1
            self._lane_cond.notify()

    def _with_lane(self, work: Callable[[_Lane], T], fallback: Callable[[], T]) -> T:
        """`work` on a lane, once more on a fresh lane after a lost connection."""
        for attempt in range(2):
            lane = self._take()
            if lane is None:
                return fallback()
            try:
                result = work(lane)
            except TransportError:
                self._give(lane, False)
                if attempt:
                    raise
                continue
            except RemoteProtocolError:
                self._give(lane, False)
                raise
            except KVOffloadError:
                self._give(lane, True)
                raise
            except BaseException:
                self._give(lane, False)
                raise
            self._give(lane, True)
            return result
        raise AssertionError("unreachable")

    @property
    def nixl_refused(self) -> str:
        """Why the daemon refused the NIXL data path ("" when it did not, or not yet)."""
        return self._refused

    def revoke(self, buffer: memoryview) -> int:
        """Unregister `buffer` on every lane (the daemon then refuses to touch it): now on idle
        lanes, on lanes in use when they are given back (their request may name it). Returns
        how many idle lanes had it."""
        with self._lane_cond:
            lanes, self._lanes = self._lanes, []
            for busy in self._busy:
                busy.to_revoke.append(buffer)
            self._busy.update(lanes)  # so a revoke meanwhile reaches them when given back
        done = 0
        for lane in lanes:
            try:
                done += lane.revoke(buffer)
            finally:
                self._give(lane, True)
        return done

    # ------------------------------------------------------------------ gets

    def get_into(self, key: bytes, buffer: memoryview) -> HeldBlock | Received | None:
        into = IntoBuffer(buffer)

        def nixl(lane: _Lane) -> HeldBlock | Received | None:
            return self._get([key], [into], lane)[0]

        def plain() -> HeldBlock | Received | None:
            return NativeTransport.get_into(self, key, buffer)

        return received_into(into, lambda: self._with_lane(nixl, plain))

    def get_many_into(
        self, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> list[HeldBlock | Received | None]:
        into = [IntoBuffer(b) for b in buffers]

        def nixl(lane: _Lane) -> list[Received | None]:
            out: list[Received | None] = []
            for i in range(0, len(keys), _BATCH):
                out += self._get(keys[i : i + _BATCH], into[i : i + _BATCH], lane, i)
            return out

        def plain() -> list[Received | None]:
            return cast("list[Received | None]", NativeTransport.get_many_into(self, keys, buffers))

        return list(received_many_into(into, lambda: self._with_lane(nixl, plain)))

    def _get(
        self, keys: Sequence[bytes], into: Sequence[IntoBuffer], lane: _Lane, first: int = 0
    ) -> list[Received | None]:
        addrs = lane.reach([b.buffer for b in into])
        caps = tuple(len(b) for b in into)
        try:
            answer = lane.transfer(partial(NixlGet, keys=tuple(keys), addrs=addrs, caps=caps))
        except BaseException:
            for b in into:  # any of them may have been written: scrubbed on failure
                b.region(0, len(b))
            raise
        got = cast(NixlGetResult, answer)
        if len(got.lengths) != len(keys):
            raise RemoteProtocolError(f"NixlGet of {len(keys)} keys answered {len(got.lengths)}")
        headers = iter(got.headers)
        out: list[Received | None] = []
        for i, length in enumerate(got.lengths):
            if length is None:
                out.append(None)
                continue
            header = memoryview(next(headers))
            if length < HEADER_BYTES:  # not one of ours: the header check says so
                out.append(Received(header, 0))
            elif length - HEADER_BYTES > caps[i]:
                which = "buffer" if len(keys) == 1 else f"buffer {first + i}"
                raise too_small(caps[i], length - HEADER_BYTES, which)
            else:
                into[i].region(0, length - HEADER_BYTES)  # what the daemon wrote
                out.append(Received(header, length - HEADER_BYTES))
        return out

    # ------------------------------------------------------------------ puts

    def put(
        self,
        key: bytes,
        parts: Sequence[object],
        parent: bytes | None,
        durable: bool = False,
        meta: bytes | None = None,
    ) -> None:
        self.put_many([(key, parts, parent, meta)], durable)

    def put_many(self, items: Sequence[PutItem], durable: bool = False) -> None:
        split = [_split(parts) for _, parts, _, _ in items]
        # A value in several pieces, or block metadata (NixlPut carries none): the socket
        # takes the batch.
        if any(s is None for s in split) or any(m is not None for *_, m in items):
            NativeTransport.put_many(self, items, durable)
            return

        def nixl(lane: _Lane) -> None:
            for i in range(0, len(items), _BATCH):
                chunk = items[i : i + _BATCH]
                heads = [cast("tuple[bytes, memoryview]", s) for s in split[i : i + _BATCH]]
                event = partial(
                    NixlPut,
                    keys=tuple(k for k, *_ in chunk),
                    heads=tuple(h for h, _ in heads),
                    addrs=lane.reach([p for _, p in heads]),
                    lengths=tuple(p.nbytes for _, p in heads),
                    parents=_parents(chunk),
                    durable=durable,
                )
                lane.transfer(event)

        self._with_lane(nixl, lambda: NativeTransport.put_many(self, items, durable))

    def close(self) -> None:
        with self._lane_cond:
            lanes, self._lanes = self._lanes, []
            self._refused = self._refused or "closed"
            self._lane_cond.notify_all()
        for lane in lanes:
            lane.close()
        super().close()


def _split(parts: Sequence[object]) -> tuple[bytes, memoryview] | None:
    """(header bytes, the payload's memory) of a value given as header + one payload part."""
    if len(parts) != 2:
        return None
    head, payload = parts
    if not isinstance(head, (bytes, bytearray, memoryview)):
        return None
    view = memoryview(payload)  # type: ignore[arg-type]
    if not view.c_contiguous:
        return None
    return bytes(head), view.cast("B") if view.ndim != 1 or view.format != "B" else view


def _parents(chunk: Sequence[PutItem]) -> tuple[bytes | None, ...]:
    parents = tuple(item[2] for item in chunk)
    return parents if any(p is not None for p in parents) else ()


def open_nixl(options: NativeOptions) -> NixlTransport:
    """The blocking `kv://...?data=nixl` transport to one daemon process."""
    return NixlTransport(options)
