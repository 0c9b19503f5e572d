"""One NVMe/TCP connection of the target: one NVMe queue pair (`NvmeQueue`).

A thin shell in the shape of h11's example servers: read into the codec
(`wire.nvme_tcp.connection`), drain its events through `_EVENTS`, hand each command to its
handler from the tables its front hands it (`Host.tables`: Fabrics and Admin from `admin`, Key
Value from `io`), and write what they answer. The queue only routes data and answers; the
handlers decide. They import the queue; it never imports them back.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

from kvoffload.errors import KVOffloadError, LocalProtocolError, RemoteProtocolError
from kvoffload.kvstore import Engine
from kvoffload.nvmeof_target.channel import Channel
from kvoffload.nvmeof_target.config import NvmeConfig
from kvoffload.nvmeof_target.nvme.subsys import (
    CommandFailed,
    Controller,
    NvmeNamespace,
    StoreInfo,
    Subsystem,
    invalid_field,
)
from kvoffload.nvmeof_target.services import Services
from kvoffload.nvmeof_target.session import Instruments, Session
from kvoffload.wire.nvme_tcp import data as nd
from kvoffload.wire.nvme_tcp.cmd import (
    FABRICS as FABRICS_OPC,
)
from kvoffload.wire.nvme_tcp.cmd import (
    AdminOpc,
    CmdSc,
    Command,
    Completion,
    FabricsType,
    KvOpc,
    Sc,
    Sct,
)
from kvoffload.wire.nvme_tcp.connection import (
    NEED_DATA,
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
from kvoffload.wire.status import nvme_status_of

__all__ = ["FRONT", "CommandTables", "Handler", "Host", "NvmeQueue"]

log = logging.getLogger("kvoffload.nvme")
FRONT = "nvme"
T = TypeVar("T")

# A command handler: (queue, command, in-capsule data length) -> what the queue's reader must
# await before it takes the next command (engine work on the I/O threads), or None.
Handler = Callable[["NvmeQueue", Command, int], "Awaitable[object] | None"]


@dataclass(frozen=True)
class CommandTables:
    """Opcode -> handler, per command set (built by the front from `admin` and `io`)."""

    fabrics: Mapping[int, Handler]  # by fctype
    admin_fabrics: frozenset[int]  # the Fabrics commands only the admin queue takes
    admin: Mapping[int, Handler]
    io: Mapping[int, Handler]


class Host(Protocol):
    """What a queue and its handlers need of the front that accepted it (`front.NvmeFront`)."""

    config: NvmeConfig
    services: Services
    engine: Engine
    instruments: Instruments
    tables: CommandTables
    subsystems: dict[str, Subsystem]
    controllers: dict[int, Controller]

    def new_controller(self, sub: Subsystem, data: nd.ConnectData, kato_ms: int) -> Controller: ...

    def attach(self, ctrl: Controller, queue: NvmeQueue) -> None: ...

    def io_queue_taken(self, ctrl: Controller, qid: int) -> bool: ...

    def forget(self, queue: NvmeQueue) -> None: ...

    def store_info(self, ns: NvmeNamespace) -> Callable[[], StoreInfo]: ...


_STATUS_NAMES: dict[tuple[int, int], str] = {
    **{(Sct.GENERIC, int(sc)): sc.name.lower() for sc in Sc},
    **{(Sct.COMMAND_SPECIFIC, int(sc)): sc.name.lower() for sc in CmdSc},
}


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


class NvmeQueue(Session):
    """One connection: one NVMe queue pair."""

    def __init__(self, front: Host, channel: Channel, peer: str) -> None:
        super().__init__(
            FRONT, front.services, channel, peer, front.instruments, front.config.frame_timeout_s
        )
        self.front = front
        self._tables = front.tables
        self.engine = front.engine
        self.config = front.config
        self.conn = NvmeTcpConnection(
            Role.TARGET,
            max_outstanding=front.config.queue_depth,
            maxh2cdata=front.config.maxh2cdata_bytes,
        )
        self.qid: int | None = None
        self.ctrl: Controller | None = None
        self.slots = front.config.queue_depth  # SQ entries, for SQHD
        self._sqhd = 0
        self._ttag = 0
        self._incoming: dict[int, _Incoming] = {}
        self.aers: set[int] = set()  # parked Asynchronous Event Requests
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
            await self._next_step()  # a payload streaming in counts too

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
            await self._next_step()
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
            self.peer_log.info("protocol error from %s (FES %#x): %s", self.peer, exc.fes, exc)
            self._terminate(exc.fes, exc.fei, exc.pdu)
        else:  # closed in the middle of a PDU: nobody left to tell
            self.peer_log.info("protocol error from %s: %s", self.peer, exc)

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
        self.peer_log.info(
            "%s terminated the connection (FES %#x, FEI %d)", self.peer, event.fes, event.fei
        )
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
        self._sqhd = (self._sqhd + 1) % self.slots
        self._started_now(cmd.cid, _op_name(cmd, self.qid))
        try:
            return self._handler(cmd)(self, cmd, event.data_length)
        except LocalProtocolError:
            raise  # our own bug: costs this connection
        except KVOffloadError as exc:  # a CommandFailed, or from the engine: capacity, I/O...
            self.refuse(cmd.cid, exc, event.data_length)
            return None

    def refuse(self, cid: int, exc: KVOffloadError, data_length: int) -> None:
        """Fail a command with the status `exc` carries (or the engine error's status)."""
        if isinstance(exc, CommandFailed):
            self._fail(cid, exc.status, exc.dw0, data_length)
        else:
            self._fail(cid, nvme_status_of(exc), 0, data_length)

    def _handler(self, cmd: Command) -> Handler:
        if cmd.opc == FABRICS_OPC:
            handler = self._tables.fabrics.get(cmd.fctype)
            if handler is None:
                raise CommandFailed(Sct.GENERIC, Sc.INVALID_OPCODE, f"fabrics {cmd.fctype:#x}")
            if cmd.fctype != FabricsType.CONNECT and self.qid is None:
                raise CommandFailed(Sct.GENERIC, Sc.COMMAND_SEQUENCE, "Connect first")
            if cmd.fctype in self._tables.admin_fabrics and self.qid != 0:
                raise invalid_field("properties live on the admin queue")
            return handler
        if self.qid is None:
            raise CommandFailed(Sct.GENERIC, Sc.COMMAND_SEQUENCE, "Connect first")
        handler = (self._tables.admin if self.qid == 0 else self._tables.io).get(cmd.opc)
        if handler is None:
            raise CommandFailed(Sct.GENERIC, Sc.INVALID_OPCODE, f"opcode {cmd.opc:#x}")
        if not self.controller.ready:
            raise CommandFailed(Sct.GENERIC, Sc.COMMAND_SEQUENCE, "the controller is not ready")
        return handler

    @property
    def controller(self) -> Controller:
        assert self.ctrl is not None  # only reached after Connect
        return self.ctrl

    # ------------------------------------------------------------------ answering

    def receive(
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
            self.receive(
                cid,
                None,
                data_length,
                lambda ok: self.complete(cid, status, dw0),
                in_capsule=True,
            )
            return
        self.complete(cid, status, dw0)

    def complete(
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

    def read_then(self, cid: int, work: Callable[[], T], then: Callable[[T], None]) -> None:
        """An engine read (inline, or on the I/O threads with an SSD tier), then `then`."""
        self.read(work, then, lambda exc: self.complete(cid, nvme_status_of(exc)))

    # ------------------------------------------------------------------ for the handlers

    def next_ttag(self) -> int:
        """A transfer tag for the next R2T (1..65535, wrapping)."""
        self._ttag = self._ttag % 0xFFFF + 1
        return self._ttag

    def park_aer(self, cid: int) -> None:
        """Hold an Asynchronous Event Request (answered only when an event happens)."""
        self.aers.add(cid)
        self._started.pop(cid, None)  # not a request that waits: keep it out of the latencies


E = TypeVar("E", bound=Event)


def _row(
    kind: type[E], on: Callable[[NvmeQueue, E], Awaitable[object] | None]
) -> tuple[type[Event], Callable[..., Awaitable[object] | None]]:
    """A table row whose handler mypy checks against its event type."""
    return kind, on


# Event type -> what the queue does with it (the codec admits no other event on a target).
_EVENTS: dict[type[Event], Callable[..., Awaitable[object] | None]] = dict(
    [
        _row(ICReq, NvmeQueue._on_icreq),
        _row(H2CTermReq, NvmeQueue._on_termreq),
        _row(CapsuleCmd, NvmeQueue._on_capsule),
        _row(H2CData, NvmeQueue._on_h2c),
        _row(DataEnd, NvmeQueue._on_data_end),
        _row(SinkFull, NvmeQueue._on_sink_full),
    ]
)
_FABRICS_NAMES = {int(t): t.name.lower() for t in FabricsType}
# Admin and KV opcodes overlap (02h, 06h): the queue says which set a command is from.
_ADMIN_NAMES = {int(o): o.name.lower() for o in AdminOpc}
_IO_NAMES = {int(o): o.name.lower() for o in KvOpc}


def _op_name(cmd: Command, qid: int | None) -> str:
    if cmd.opc == FABRICS_OPC:
        return _FABRICS_NAMES.get(cmd.fctype, "fabrics")
    names = _ADMIN_NAMES if qid == 0 else _IO_NAMES
    return names.get(cmd.opc, f"opcode_{cmd.opc:#04x}")
