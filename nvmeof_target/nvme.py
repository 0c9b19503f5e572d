"""The NVMe/TCP front: the NVMe Key Value command set over NVMe/TCP, on the engine.

Each TCP connection is one queue pair: ICReq/ICResp, then a Fabrics Connect makes it the admin
queue of a new controller (qid 0) or an I/O queue of an existing one. A thin shell in the shape
of the native front: read into the codec (`client_sdk/wire/nvme_tcp.py`), drain its events,
call the engine, write completions. Values move without extra copies: a Store's data — in the
capsule or fetched with R2T/H2CData — is received straight into the slot `Engine.reserve` hands
out, and a Retrieve's C2HData is sent straight from the pinned `BlockView`.

A PDU that breaks the transport rules gets a C2HTermReq with its Fatal Error Status and the
connection is closed; other connections carry on. A command that fails gets an NVMe status
(`client_sdk/wire/status.py` maps engine errors). Keep Alive is enforced: a controller that
hears no Keep Alive for KATO is torn down with all its queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from kvoffload.client_sdk.wire import nvme_data as nd
from kvoffload.client_sdk.wire.nvme_cmd import (
    FABRICS,
    KEY_MAX,
    SGL_IN_CAPSULE,
    AdminOpc,
    CmdSc,
    Command,
    Completion,
    FabricsType,
    KvOpc,
    Sc,
    Sct,
    StoreOption,
    kv_key,
)
from kvoffload.client_sdk.wire.nvme_tcp import (
    NEED_DATA,
    R2T,
    C2HData,
    C2HTermReq,
    CapsuleCmd,
    CapsuleResp,
    ConnectionClosed,
    DataEnd,
    Event,
    H2CData,
    H2CTermReq,
    ICReq,
    ICResp,
    NvmeTcpConnection,
    PduError,
    Role,
    SinkFull,
)
from kvoffload.client_sdk.wire.status import nvme_status_of
from kvoffload.errors import KVOffloadError, LocalProtocolError, RemoteProtocolError
from kvoffload.kvstore import BlockView, PutReservation
from kvoffload.nvmeof_target.channel import Channel
from kvoffload.nvmeof_target.config import Config, NvmeConfig
from kvoffload.nvmeof_target.nvme_subsys import (
    AER_LIMIT,
    CommandFailed,
    Controller,
    NvmeNamespace,
    StoreInfo,
    Subsystem,
    build_subsystems,
    connect_invalid,
    invalid_field,
    next_cntlid,
)
from kvoffload.nvmeof_target.services import Services
from kvoffload.nvmeof_target.session import Instruments, Session, stop_sessions

__all__ = ["NvmeFront", "make_front"]

log = logging.getLogger("kvoffload.nvme")
FRONT = "nvme"
T = TypeVar("T")
_WATCH_INTERVAL = 0.1  # keep-alive granularity is 100 ms (Identify KAS = 1)


def make_front(config: Config, services: Services) -> NvmeFront | None:
    return NvmeFront(config.nvme, services) if config.nvme.enabled else None


# A command handler: (queue, command, in-capsule data length) -> what the queue's reader must
# await before it takes the next command (engine work on the I/O threads), or None.
_Handler = Callable[["_Queue", Command, int], "Awaitable[object] | None"]


_CONDITIONS = StoreOption.ONLY_IF_EXISTS | StoreOption.ONLY_IF_ABSENT
# Store options -> the engine's `if_stored` condition for the commit (both: refused earlier).
_IF_STORED: dict[int, bool] = {StoreOption.ONLY_IF_EXISTS: True, StoreOption.ONLY_IF_ABSENT: False}


def _condition_failed(*, present: bool) -> CommandFailed:
    if present:
        return CommandFailed(Sct.GENERIC, Sc.KV_KEY_EXISTS, "key exists")
    return CommandFailed(Sct.GENERIC, Sc.KV_KEY_NOT_EXISTS, "key does not exist")


def _status(sct: int, sc: int, *, dnr: bool = True) -> int:
    return Completion.encode_status(sct, sc, dnr=dnr)


_MISS = _status(Sct.GENERIC, Sc.KV_KEY_NOT_EXISTS)
_STATUS_NAMES: dict[tuple[int, int], str] = {
    **{(Sct.GENERIC, int(sc)): sc.name.lower() for sc in Sc},
    **{(Sct.COMMAND_SPECIFIC, int(sc)): sc.name.lower() for sc in CmdSc},
}


class NvmeFront:
    """Listens for NVMe/TCP connections; owns the subsystems and their controllers."""

    name = FRONT

    def __init__(self, config: NvmeConfig, services: Services) -> None:
        self.config = config
        self.services = services
        self.engine = services.engine
        self.subsystems: dict[str, Subsystem] = build_subsystems(config, services.tenants.named)
        self.controllers: dict[int, Controller] = {}
        self._members: dict[int, set[_Queue]] = {}  # cntlid -> its queues, admin included
        self._queues: dict[_Queue, asyncio.Task[None]] = {}
        self._listener: socket.socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._sweeping = False
        self.instruments = Instruments(services.metrics, FRONT)

    async def start(self) -> list[tuple[str, str, int]]:
        listener = socket.create_server(
            (self.config.host, self.config.port), backlog=self.config.backlog
        )
        listener.setblocking(False)
        self._listener = listener
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._accept(listener)), loop.create_task(self._watch())]
        if not self.config.loopback:
            for sub in self.subsystems.values():
                if not sub.allow_hosts:
                    log.warning(
                        "%s has no allowed hosts and the NVMe/TCP front is not on loopback: "
                        "every host will be refused",
                        sub.nqn,
                    )
        host, port = listener.getsockname()[:2]
        return [(FRONT, str(host), int(port))]

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        metrics = self.services.metrics
        while True:
            try:
                sock, peer = await loop.sock_accept(listener)
            except OSError as exc:
                log.warning("accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            metrics.connections_total.labels(FRONT).inc()
            if len(self._queues) >= self.config.max_connections:
                metrics.refused.labels(FRONT, "too many connections").inc()
                sock.close()  # NVMe/TCP has no PDU to refuse with before ICReq
                continue
            queue = _Queue(self, Channel(sock, loop), f"{peer[0]}:{peer[1]}")
            self._queues[queue] = loop.create_task(queue.run())

    async def _watch(self) -> None:
        """Keep-alive timeouts, connections that never connect, PDUs that trickle in, and the
        sweeps of the List directories."""
        while True:
            await asyncio.sleep(_WATCH_INTERVAL)
            now = time.monotonic()
            for ctrl in list(self.controllers.values()):
                if ctrl.expired(now):
                    log.info(
                        "controller %d of %s: no Keep Alive for %d ms; tearing it down",
                        ctrl.cntlid,
                        ctrl.hostnqn,
                        ctrl.kato_ms,
                    )
                    self.services.metrics.refused.labels(FRONT, "keep-alive timeout").inc()
                    self.drop_controller(ctrl)
            for queue in list(self._queues):
                reason = queue.overdue(now)
                if reason:
                    self.services.metrics.refused.labels(FRONT, reason).inc()
                    log.info("closing %s: %s", queue.peer, reason)
                    queue.abort()
            if not self._sweeping:
                self._sweep()

    def _sweep(self) -> None:
        for sub in self.subsystems.values():
            for ns in sub.namespaces.values():
                if ns.directory.needs_sweep:
                    self._sweeping = True
                    check = ns.directory.begin_sweep()
                    loop = asyncio.get_running_loop()
                    future = loop.run_in_executor(
                        self.services.executor, check, self.engine.contains
                    )
                    future.add_done_callback(functools.partial(self._swept, ns))
                    return

    def _swept(self, ns: NvmeNamespace, future: asyncio.Future[list[bytes]]) -> None:
        self._sweeping = False
        failed = future.cancelled() or future.exception() is not None
        ns.directory.end_sweep(None if failed else future.result())

    # ------------------------------------------------------------------ controllers

    def new_controller(self, sub: Subsystem, data: nd.ConnectData, kato_ms: int) -> Controller:
        ctrl = Controller(
            next_cntlid(self.controllers),
            sub,
            data.hostnqn,
            data.hostid,
            kato_ms,
            self.config,
            max_value=self.engine.max_value_bytes,
        )
        self.controllers[ctrl.cntlid] = ctrl
        self._members[ctrl.cntlid] = set()
        return ctrl

    def attach(self, ctrl: Controller, queue: _Queue) -> None:
        self._members.setdefault(ctrl.cntlid, set()).add(queue)
        if queue.qid:
            ctrl.connected_queues += 1

    def io_queue_taken(self, ctrl: Controller, qid: int) -> bool:
        return any(q.qid == qid for q in self._members.get(ctrl.cntlid, ()))

    def drop_controller(self, ctrl: Controller) -> None:
        """End an association: the controller goes, and every queue of it is closed."""
        if self.controllers.get(ctrl.cntlid) is not ctrl:
            return  # gone already (its id may even serve a newer controller by now)
        del self.controllers[ctrl.cntlid]
        for queue in self._members.pop(ctrl.cntlid, set()):
            queue.abort()

    def forget(self, queue: _Queue) -> None:
        self._queues.pop(queue, None)
        ctrl = queue.ctrl
        if ctrl is None:
            return
        if queue.qid == 0:
            self.drop_controller(ctrl)  # the admin queue is the association
        elif queue in self._members.get(ctrl.cntlid, ()):
            self._members[ctrl.cntlid].discard(queue)
            ctrl.connected_queues -= 1

    def store_info(self, ns: NvmeNamespace) -> Callable[[], StoreInfo]:
        def read() -> StoreInfo:
            stats = self.engine.stats()
            used = sum(t.used_bytes for t in stats.tiers)
            capacity = sum(t.capacity_bytes for t in stats.tiers)
            if ns.tenant.name:
                used = stats.tenant_bytes.get(ns.tenant.name, 0)
            return StoreInfo(
                capacity_bytes=capacity,
                used_bytes=used,
                bytes_read=sum(t.bytes_read for t in stats.tiers),
                bytes_written=sum(t.bytes_written for t in stats.tiers),
                reads=stats.gets,
                writes=stats.puts,
                uptime_s=time.monotonic() - self.services.started,
            )

        return read

    async def stop(self, timeout: float) -> None:
        for task in self._tasks:
            task.cancel()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        await stop_sessions(self._queues, timeout)


@dataclass(frozen=True)
class _Store:
    """A KV Store command whose value is on its way."""

    cid: int
    ns: NvmeNamespace
    key: bytes
    engine_key: bytes
    options: int
    in_capsule: bool


@dataclass
class _Incoming:
    """Data a command is receiving: its in-capsule bytes, or the H2CData an R2T asked for."""

    sink: memoryview | None  # None: drop the bytes
    total: int
    # Called with "every digest matched" once all bytes are in; returns what the reader must
    # await before it goes on (a commit on the I/O threads), or None.
    finish: Callable[[bool], Awaitable[object] | None]
    cleanup: Callable[[], None] = lambda: None  # the connection died first
    received: int = 0
    ok: bool = True


class _Queue(Session):
    """One connection: one NVMe queue pair."""

    def __init__(self, front: NvmeFront, channel: Channel, peer: str) -> None:
        super().__init__(
            FRONT, front.services, channel, peer, front.instruments, front.config.frame_timeout_s
        )
        self.front = front
        self.engine = front.engine
        self.config = front.config
        self.conn = NvmeTcpConnection(
            Role.TARGET,
            max_outstanding=front.config.queue_depth,
            maxh2cdata=front.config.maxh2cdata_bytes,
        )
        self.qid: int | None = None
        self.ctrl: Controller | None = None
        self._slots = front.config.queue_depth  # SQ entries, for SQHD
        self._sqhd = 0
        self._ttag = 0
        self._incoming: dict[int, _Incoming] = {}
        self._aers: set[int] = set()
        self._created = time.monotonic()
        self._frame_since: float | None = None

    # ------------------------------------------------------------------ the loop

    async def _read_loop(self) -> None:
        while self._reading:
            if not await self._drain_events():
                return
            self._frame_since = (
                None if self.conn.at_boundary else self._frame_since or time.monotonic()
            )
            n = await self.channel.recv_into(self.conn.get_buffer())
            if n:
                self.conn.buffer_updated(n)
            else:
                self.conn.receive_eof()

    async def _drain_events(self) -> bool:
        while self._reading:
            if self._inflight_bytes >= self.config.max_inflight_bytes:
                self._room.clear()
                await self._room.wait()
                continue
            event = self.conn.next_event()
            if event is NEED_DATA:
                return True
            if isinstance(event, ConnectionClosed):
                return False
            assert isinstance(event, Event)
            waiting = _EVENTS[type(event)](self, event)
            if waiting is not None:
                await waiting  # engine work on the I/O threads that later commands follow
        return False

    def overdue(self, now: float) -> str:
        if self.qid is None and now - self._created > self.config.connect_timeout_s:
            return "connect timeout"
        if self._frame_since is not None and now - self._frame_since > self.config.frame_timeout_s:
            return "frame timeout"
        if self.send_stalled(now):
            return "send timeout"
        return ""

    def _protocol_error(self, exc: RemoteProtocolError) -> None:
        if isinstance(exc, PduError):
            log.info("protocol error from %s (FES %#x): %s", self.peer, exc.fes, exc)
            self._terminate(exc.fes, exc.fei, exc.pdu)
        else:  # closed in the middle of a PDU: nobody left to tell
            log.info("protocol error from %s: %s", self.peer, exc)

    def _abandon(self) -> None:
        for incoming in self._incoming.values():  # a partial Store never becomes visible
            incoming.cleanup()
        self._incoming.clear()

    def _forget(self) -> None:
        self.front.forget(self)

    def _terminate(self, fes: int, fei: int, pdu: bytes) -> None:
        self._reading = False
        with contextlib.suppress(LocalProtocolError):
            self.channel.write(self.conn.send_parts(C2HTermReq(fes, fei, pdu)))

    # ------------------------------------------------------------------ events

    def _on_icreq(self, event: ICReq) -> None:
        # Grant exactly the digests asked for: Linux's host refuses anything else.
        answer = ICResp(event.hdgst, event.ddgst, self.config.maxh2cdata_bytes)
        self.channel.write(self.conn.send_parts(answer))

    def _on_termreq(self, event: H2CTermReq) -> None:
        log.info("%s terminated the connection (FES %#x, FEI %d)", self.peer, event.fes, event.fei)
        self._reading = False

    def _on_h2c(self, event: H2CData) -> None:
        incoming = self._incoming[event.cccid]  # the codec admits H2CData only for our R2Ts
        incoming.received += event.datal
        if incoming.sink is None:
            self.conn.discard_data()
        else:
            self.conn.set_data_sink([incoming.sink[event.datao : event.datao + event.datal]])

    def _on_data_end(self, event: DataEnd) -> Awaitable[object] | None:
        incoming = self._incoming.get(event.cid)
        if incoming is None:
            return None
        incoming.ok = incoming.ok and event.digest_ok
        if incoming.received == incoming.total:
            del self._incoming[event.cid]
            return incoming.finish(incoming.ok)
        return None

    def _on_sink_full(self, event: SinkFull) -> None:
        self.conn.discard_data()  # every sink set here covers its whole PDU; never reached

    def _on_capsule(self, event: CapsuleCmd) -> Awaitable[object] | None:
        cmd = event.command
        self._sqhd = (self._sqhd + 1) % self._slots
        self._started_now(cmd.cid, _op_name(cmd, self.qid))
        try:
            return self._handler(cmd)(self, cmd, event.data_length)
        except LocalProtocolError:
            raise  # our own bug: costs this connection
        except KVOffloadError as exc:  # a CommandFailed, or from the engine: capacity, I/O...
            self._refuse(cmd.cid, exc, event.data_length)
            return None

    def _refuse(self, cid: int, exc: KVOffloadError, data_length: int) -> None:
        """Fail a command with the status `exc` carries (or the engine error's status)."""
        if isinstance(exc, CommandFailed):
            self._fail(cid, exc.status, exc.dw0, data_length)
        else:
            self._fail(cid, nvme_status_of(exc), 0, data_length)

    def _handler(self, cmd: Command) -> _Handler:
        if cmd.opc == FABRICS:
            handler = _FABRICS.get(cmd.fctype)
            if handler is None:
                raise CommandFailed(Sct.GENERIC, Sc.INVALID_OPCODE, f"fabrics {cmd.fctype:#x}")
            if cmd.fctype != FabricsType.CONNECT and self.qid is None:
                raise CommandFailed(Sct.GENERIC, Sc.COMMAND_SEQUENCE, "Connect first")
            if cmd.fctype in _ADMIN_FABRICS and self.qid != 0:
                raise invalid_field("properties live on the admin queue")
            return handler
        if self.qid is None:
            raise CommandFailed(Sct.GENERIC, Sc.COMMAND_SEQUENCE, "Connect first")
        handler = (_ADMIN if self.qid == 0 else _IO).get(cmd.opc)
        if handler is None:
            raise CommandFailed(Sct.GENERIC, Sc.INVALID_OPCODE, f"opcode {cmd.opc:#x}")
        if not self._controller.ready:
            raise CommandFailed(Sct.GENERIC, Sc.COMMAND_SEQUENCE, "the controller is not ready")
        return handler

    @property
    def _controller(self) -> Controller:
        assert self.ctrl is not None  # only reached after Connect
        return self.ctrl

    # ------------------------------------------------------------------ answering

    def _receive(
        self,
        cid: int,
        sink: memoryview | None,
        total: int,
        finish: Callable[[bool], Awaitable[object] | None],
        *,
        in_capsule: bool,
        cleanup: Callable[[], None] = lambda: None,
    ) -> None:
        """Route a command's data to `sink` (None: drop it), then call `finish`."""
        incoming = _Incoming(sink, total, finish, cleanup)
        self._incoming[cid] = incoming
        if in_capsule:
            incoming.received = total
            if sink is None:
                self.conn.discard_data()
            else:
                self.conn.set_data_sink([sink])

    def _fail(self, cid: int, status: int, dw0: int, data_length: int) -> None:
        if data_length and cid not in self._incoming:
            # The in-capsule bytes follow in the stream: consume them, then answer.
            self._receive(
                cid,
                None,
                data_length,
                lambda ok: self._complete(cid, status, dw0),
                in_capsule=True,
            )
            return
        self._complete(cid, status, dw0)

    def _complete(
        self,
        cid: int,
        status: int = 0,
        dw0: int = 0,
        dw1: int = 0,
        data: memoryview | bytes = b"",
        on_done: Callable[[], None] | None = None,
    ) -> None:
        """Send `data` (C2HData, split at max_c2h_bytes) and the completion of `cid`."""
        parts: list[bytes | memoryview] = []
        try:
            view = memoryview(data)
            step = self.config.max_c2h_bytes
            for pos in range(0, len(view), step):
                chunk = view[pos : pos + step]
                last = pos + len(chunk) == len(view)
                parts += self.conn.send_parts(C2HData(cid, pos, len(chunk), last), [chunk])
            completion = Completion(cid, status, dw0, dw1, self._sqhd, self.qid or 0)
            parts += self.conn.send_parts(CapsuleResp(completion))
        except LocalProtocolError as exc:  # the connection was terminated meanwhile
            log.debug("dropping the completion of %d on %s: %s", cid, self.peer, exc)
            if on_done is not None:
                on_done()
            return
        label = "ok"
        if status:
            label = _STATUS_NAMES.get(((status >> 9) & 7, (status >> 1) & 0xFF), "error")
        self._answer(cid, parts, label, on_done)

    def _wake(self) -> None:
        if self._inflight_bytes < self.config.max_inflight_bytes:
            self._room.set()

    def _read(self, cid: int, work: Callable[[], T], then: Callable[[T], None]) -> None:
        """An engine read (inline, or on the I/O threads with an SSD tier), then `then`."""
        self.read(work, then, lambda exc: self._complete(cid, nvme_status_of(exc)))

    # ------------------------------------------------------------------ Fabrics

    def _connect(self, cmd: Command, data_length: int) -> None:
        if self.qid is not None:
            raise CommandFailed(Sct.GENERIC, Sc.COMMAND_SEQUENCE, "the queue is connected")
        sgl = cmd.sgl
        if sgl.type != SGL_IN_CAPSULE:
            raise CommandFailed(Sct.GENERIC, Sc.SGL_TYPE_INVALID, "Connect data is in-capsule")
        if sgl.length != nd.CONNECT_DATA_BYTES or data_length != sgl.length:
            raise CommandFailed(Sct.GENERIC, Sc.SGL_LENGTH_INVALID, "Connect data is 1024 B")
        buffer = memoryview(bytearray(nd.CONNECT_DATA_BYTES))

        def finish(ok: bool) -> None:
            try:
                if not ok:
                    raise CommandFailed(Sct.GENERIC, Sc.DATA_TRANSFER_ERROR, dnr=False)
                self._complete(cmd.cid, dw0=self._admit(cmd, nd.ConnectData.unpack(buffer)))
            except CommandFailed as exc:
                self._complete(cmd.cid, exc.status, exc.dw0)

        self._receive(cmd.cid, buffer, len(buffer), finish, in_capsule=True)

    def _admit(self, cmd: Command, data: nd.ConnectData) -> int:
        """Check a Connect and make this queue an admin or I/O queue; returns CNTLID."""
        front, metrics = self.front, self.services.metrics
        recfmt, qid, sqsize = cmd.cdw10 & 0xFFFF, cmd.cdw10 >> 16, cmd.cdw11 & 0xFFFF
        if recfmt != 0:
            raise CommandFailed(Sct.COMMAND_SPECIFIC, CmdSc.CONNECT_INCOMPATIBLE_FORMAT, "RECFMT")
        sub = front.subsystems.get(data.subnqn)
        if sub is None:
            raise connect_invalid(nd.CONNECT_DATA_SUBNQN, True, f"no subsystem {data.subnqn}")
        if not sub.admits(data.hostnqn):
            metrics.auth_failures.labels(FRONT).inc()
            log.info("refused host %s for %s (%s)", data.hostnqn, sub.nqn, self.peer)
            raise CommandFailed(
                Sct.COMMAND_SPECIFIC,
                CmdSc.CONNECT_INVALID_HOST,
                "host not allowed",
                dw0=nd.CONNECT_DATA_HOSTNQN | (1 << 16),
            )
        if not 1 <= sqsize < self.config.queue_depth:
            raise connect_invalid(44, False, f"SQSIZE {sqsize}")
        if qid == 0:
            if data.cntlid != nd.DYNAMIC_CNTLID:
                raise connect_invalid(nd.CONNECT_DATA_CNTLID, True, "static controller id")
            ctrl = front.new_controller(sub, data, cmd.cdw12)
        else:
            found = front.controllers.get(data.cntlid)
            if found is None or found.subsystem is not sub or found.hostnqn != data.hostnqn:
                raise connect_invalid(nd.CONNECT_DATA_CNTLID, True, f"no controller {data.cntlid}")
            ctrl = found
            if not ctrl.ready:
                raise CommandFailed(Sct.GENERIC, Sc.COMMAND_SEQUENCE, "controller not enabled")
            if qid > ctrl.granted_queues or front.io_queue_taken(ctrl, qid):
                raise connect_invalid(42, False, f"QID {qid}")
            self.conn.in_capsule = self.config.in_capsule_bytes
        self.qid, self.ctrl = qid, ctrl
        self._slots = sqsize + 1
        self.conn.max_outstanding = sqsize + 1
        front.attach(ctrl, self)
        log.debug("%s: %s queue %d of controller %d", self.peer, data.hostnqn, qid, ctrl.cntlid)
        return ctrl.cntlid

    def _property_get(self, cmd: Command, data_length: int) -> None:
        value = self._controller.property_get(cmd.cdw11, bool(cmd.cdw10 & 0x7))
        self._complete(cmd.cid, dw0=value & 0xFFFF_FFFF, dw1=value >> 32)

    def _property_set(self, cmd: Command, data_length: int) -> None:
        value = cmd.cdw12 | (cmd.cdw13 << 32)
        self._controller.property_set(cmd.cdw11, value, bool(cmd.cdw10 & 0x7))
        self._complete(cmd.cid)

    def _disconnect(self, cmd: Command, data_length: int) -> None:
        self._complete(cmd.cid)
        # Answered; the connection closes once the answer is out (on the admin queue that ends
        # the association, as its closing always does).
        self._reading = False

    # ------------------------------------------------------------------ Admin

    def _identify(self, cmd: Command, data_length: int) -> None:
        ctrl = self._controller
        limit = _read_length(cmd, data_length)
        ns = ctrl.subsystem.namespaces.get(cmd.nsid)
        info = self.front.store_info(ns) if ns is not None else _no_info
        data = ctrl.identify(cmd, info)
        self._complete(cmd.cid, data=data[:limit])

    def _get_log_page(self, cmd: Command, data_length: int) -> None:
        ctrl = self._controller
        limit = _read_length(cmd, data_length)
        first = next(iter(ctrl.namespaces.values()), None)
        info = self.front.store_info(first) if first is not None else _no_info
        self._complete(cmd.cid, data=ctrl.log_page(cmd, info, limit))

    def _set_features(self, cmd: Command, data_length: int) -> None:
        if data_length:
            raise invalid_field("no feature here takes data")
        dw0 = self._controller.set_feature(cmd.cdw10 & 0xFF, cmd.cdw11, bool(cmd.cdw10 >> 31))
        self._complete(cmd.cid, dw0=dw0)

    def _get_features(self, cmd: Command, data_length: int) -> None:
        dw0 = self._controller.get_feature(cmd.cdw10 & 0xFF, (cmd.cdw10 >> 8) & 0x7)
        self._complete(cmd.cid, dw0=dw0)

    def _keep_alive(self, cmd: Command, data_length: int) -> None:
        self._controller.keep_alive()
        self._complete(cmd.cid)

    def _async_event(self, cmd: Command, data_length: int) -> None:
        if len(self._aers) >= AER_LIMIT:
            raise CommandFailed(Sct.COMMAND_SPECIFIC, CmdSc.AER_LIMIT, "too many AERs")
        # Parked: nothing here raises asynchronous events (namespaces never change while the
        # daemon runs), so it completes only if the association ends... which it does not.
        self._aers.add(cmd.cid)
        self._started.pop(cmd.cid, None)

    def _abort(self, cmd: Command, data_length: int) -> None:
        self._complete(cmd.cid, dw0=1)  # DW0 bit 0: the command was not aborted

    # ------------------------------------------------------------------ Key Value

    def _kv_namespace(
        self, cmd: Command, *, empty_key: bool = False
    ) -> tuple[NvmeNamespace, bytes]:
        ns = self._controller.namespace(cmd.nsid)
        kl = cmd.cdw11 & 0xFF
        if not (0 if empty_key else 1) <= kl <= KEY_MAX:
            raise CommandFailed(Sct.GENERIC, Sc.KV_INVALID_KEY_SIZE, f"key length {kl}")
        return ns, kv_key(cmd)

    def _kv_store(self, cmd: Command, data_length: int) -> Awaitable[object] | None:
        ns, key = self._kv_namespace(cmd)
        options = (cmd.cdw11 >> 8) & 0xFF  # bits 7:3 are reserved: ignored
        both = StoreOption.ONLY_IF_EXISTS | StoreOption.ONLY_IF_ABSENT
        if options & both == both:  # contradictory, not reserved
            raise invalid_field(f"store options {options:#x}")
        sgl = cmd.sgl
        in_capsule = _write_sgl(cmd, data_length)
        length = cmd.cdw10
        if length != sgl.length or length > self.engine.max_value_bytes:
            raise CommandFailed(Sct.GENERIC, Sc.KV_INVALID_VALUE_SIZE, f"value size {length}")
        engine_key = ns.engine_key(key)
        self._check_options(options, engine_key)
        reserve = functools.partial(self.engine.reserve, engine_key, length, tenant=ns.tenant.name)
        store = _Store(cmd.cid, ns, key, engine_key, options, in_capsule)
        if not self.services.blocking_engine:
            return self._store_data(store, reserve())
        return self._reserve_off_loop(store, reserve, data_length)

    async def _reserve_off_loop(
        self, store: _Store, reserve: Callable[[], PutReservation], data_length: int
    ) -> None:
        # Reserving may evict, which writes blocks to the SSD: not on the loop. The data that
        # follows has nowhere to go until it is done, so this queue's reader waits.
        try:
            reservation = await self.off_loop(reserve, PutReservation.abort)
        except KVOffloadError as exc:
            self._refuse(store.cid, exc, data_length)
            return
        waiting = self._store_data(store, reservation)
        if waiting is not None:
            await waiting

    def _store_data(self, store: _Store, reservation: PutReservation) -> Awaitable[object] | None:
        """Receive a Store's value into its reservation (asking for it with R2T if it is not in
        the capsule), then commit."""
        finish = functools.partial(self._store_done, store, reservation)
        length = len(reservation)
        if length == 0:
            return finish(True)
        cmd_cid, in_capsule = store.cid, store.in_capsule
        self._receive(
            cmd_cid,
            reservation.buffer,
            length,
            finish,
            in_capsule=in_capsule,
            cleanup=reservation.abort,
        )
        if not in_capsule:
            self._ttag = self._ttag % 0xFFFF + 1
            # One R2T for the whole value; the host splits it at MAXH2CDATA.
            self.channel.write(self.conn.send_parts(R2T(cmd_cid, self._ttag, 0, length)))
        return None

    def _check_options(self, options: int, engine_key: bytes) -> None:
        if_stored = _IF_STORED.get(options & _CONDITIONS)
        if if_stored is not None and self.engine.contains(engine_key) != if_stored:
            raise _condition_failed(present=not if_stored)

    def _store_done(
        self, store: _Store, reservation: PutReservation, ok: bool
    ) -> Awaitable[object] | None:
        if not ok:
            reservation.abort()
            self._complete(store.cid, _status(Sct.GENERIC, Sc.DATA_TRANSFER_ERROR, dnr=False))
            return None

        events = self.services.events
        if events is not None:
            events.expect(
                store.engine_key, store.ns.block_key(store.key), None, store.ns.tenant.name
            )

        def commit() -> None:
            # Checked again by the engine, atomically with the publish: with an SSD tier this
            # runs on an I/O thread, and another connection's store or delete of the key could
            # land between a separate check and the commit.
            if_stored = _IF_STORED.get(store.options & _CONDITIONS)
            try:
                if not reservation.commit(if_stored=if_stored):
                    raise _condition_failed(present=not if_stored)
            finally:
                reservation.abort()  # no-op once committed
                if events is not None:
                    events.settle(store.engine_key)

        def done(_: None) -> None:
            store.ns.directory.add(store.key, store.engine_key)
            self.services.metrics.bytes_in.labels(FRONT).inc(len(reservation))
            self._complete(store.cid)

        return self.in_order(
            commit, done, functools.partial(self._refuse, store.cid, data_length=0)
        )

    def _kv_retrieve(self, cmd: Command, data_length: int) -> None:
        ns, key = self._kv_namespace(cmd)
        limit = min(_read_length(cmd, data_length), cmd.cdw10)
        engine_key = ns.engine_key(key)

        def send(view: BlockView | None) -> None:
            if view is None:
                self._complete(cmd.cid, _MISS)
                return
            n = min(len(view), limit)
            self.services.metrics.bytes_out.labels(FRONT).inc(n)
            # DW0 is the whole value's size: a host whose buffer was short asks again.
            self._complete(cmd.cid, dw0=len(view), data=view.data[:n], on_done=view.release)

        self._read(cmd.cid, lambda: self.engine.get(engine_key), send)

    def _kv_exist(self, cmd: Command, data_length: int) -> None:
        ns, key = self._kv_namespace(cmd)
        _no_data(data_length)
        self._complete(cmd.cid, 0 if self.engine.contains(ns.engine_key(key)) else _MISS)

    def _kv_delete(self, cmd: Command, data_length: int) -> Awaitable[object] | None:
        ns, key = self._kv_namespace(cmd)
        _no_data(data_length)
        engine_key = ns.engine_key(key)

        def done(deleted: bool) -> None:
            ns.directory.remove(key)
            if deleted and self.services.events is not None:
                self.services.events.removed(engine_key)
            self._complete(cmd.cid, 0 if deleted else _MISS)

        # With an SSD tier a delete wipes the block's slot header: in_order takes it off the loop.
        return self.in_order(
            functools.partial(self.engine.delete, engine_key),
            done,
            functools.partial(self._refuse, cmd.cid, data_length=0),
        )

    def _kv_list(self, cmd: Command, data_length: int) -> None:
        ns, start = self._kv_namespace(cmd, empty_key=True)
        limit = min(_read_length(cmd, data_length), cmd.cdw10)
        if limit < 4:
            raise invalid_field("a List buffer holds at least the 4-byte key count")
        keys: list[bytes] = []
        gone: list[bytes] = []
        room = limit - 4
        for key, engine_key in ns.directory.from_key(start):
            entry = (2 + len(key) + 3) // 4 * 4
            if entry > room:
                break
            if self.engine.contains(engine_key):
                keys.append(key)
                room -= entry
            else:
                gone.append(key)  # evicted since it was stored
        for key in gone:
            ns.directory.remove(key)
        data, count = nd.pack_list_data(keys, limit)
        self._complete(cmd.cid, dw0=count, data=data)


# PSDT (CDW0 bits 7:6) is not checked: over fabrics DPTR is always an SGL descriptor, whatever
# PSDT says (SPDK's target does not look either), and its descriptor type beyond "in the
# capsule or not" does not change how TCP moves the data (Sgl.transport_length).


def _read_length(cmd: Command, data_length: int) -> int:
    """Bytes a command that returns data may receive (its SGL's length)."""
    _no_data(data_length)
    if cmd.sgl.type == SGL_IN_CAPSULE:
        raise CommandFailed(Sct.GENERIC, Sc.SGL_TYPE_INVALID, "read data cannot be in-capsule")
    return cmd.sgl.transport_length


def _write_sgl(cmd: Command, data_length: int) -> bool:
    """Check the SGL of a command that sends data; True if the data is in the capsule."""
    sgl = cmd.sgl
    if sgl.type == SGL_IN_CAPSULE:
        if sgl.address != 0:  # ICDOFF is 0: data starts at the capsule's data area
            raise CommandFailed(Sct.GENERIC, Sc.SGL_OFFSET_INVALID, f"offset {sgl.address}")
        if sgl.length != data_length:
            raise CommandFailed(
                Sct.GENERIC,
                Sc.SGL_LENGTH_INVALID,
                f"SGL says {sgl.length} B, the capsule holds {data_length}",
            )
        return True
    _no_data(data_length)
    return False


def _no_data(data_length: int) -> None:
    if data_length:
        raise CommandFailed(Sct.GENERIC, Sc.SGL_LENGTH_INVALID, "unexpected in-capsule data")


def _no_info() -> StoreInfo:
    return StoreInfo(0, 0, 0, 0, 0, 0, 0.0)


_ADMIN_FABRICS = frozenset({FabricsType.PROPERTY_GET, FabricsType.PROPERTY_SET})
_FABRICS: dict[int, _Handler] = {
    FabricsType.CONNECT: _Queue._connect,
    FabricsType.PROPERTY_GET: _Queue._property_get,
    FabricsType.PROPERTY_SET: _Queue._property_set,
    FabricsType.DISCONNECT: _Queue._disconnect,
}
_ADMIN: dict[int, _Handler] = {
    AdminOpc.IDENTIFY: _Queue._identify,
    AdminOpc.GET_LOG_PAGE: _Queue._get_log_page,
    AdminOpc.SET_FEATURES: _Queue._set_features,
    AdminOpc.GET_FEATURES: _Queue._get_features,
    AdminOpc.KEEP_ALIVE: _Queue._keep_alive,
    AdminOpc.ASYNC_EVENT: _Queue._async_event,
    AdminOpc.ABORT: _Queue._abort,
}
_IO: dict[int, _Handler] = {
    KvOpc.STORE: _Queue._kv_store,
    KvOpc.RETRIEVE: _Queue._kv_retrieve,
    KvOpc.EXIST: _Queue._kv_exist,
    KvOpc.DELETE: _Queue._kv_delete,
    KvOpc.LIST: _Queue._kv_list,
}
_EVENTS: dict[type[Event], Callable[[_Queue, Any], Awaitable[object] | None]] = {
    ICReq: _Queue._on_icreq,
    H2CTermReq: _Queue._on_termreq,
    CapsuleCmd: _Queue._on_capsule,
    H2CData: _Queue._on_h2c,
    DataEnd: _Queue._on_data_end,
    SinkFull: _Queue._on_sink_full,
}
_FABRICS_NAMES = {int(t): t.name.lower() for t in FabricsType}
# Admin and KV opcodes overlap (02h, 06h): the queue says which set a command is from.
_ADMIN_NAMES = {int(o): o.name.lower() for o in AdminOpc}
_IO_NAMES = {int(o): o.name.lower() for o in KvOpc}


def _op_name(cmd: Command, qid: int | None) -> str:
    if cmd.opc == FABRICS:
        return _FABRICS_NAMES.get(cmd.fctype, "fabrics")
    names = _ADMIN_NAMES if qid == 0 else _IO_NAMES
    return names.get(cmd.opc, f"opcode_{cmd.opc:#04x}")
