"""One NVMe/TCP queue pair: its TCP connection, command ids and data transfers (in the
capsule, on R2T, into a read sink), over the sans-I/O codec in `wire.nvme_tcp.connection`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvoffload.client_sdk.transports import core
from kvoffload.client_sdk.transports.core import SyncRunner, connect, left, lost, receive, send_all
from kvoffload.client_sdk.transports.nvme.options import NvmeOptions
from kvoffload.errors import (
    DeadlineExceededError,
    KVOffloadError,
    RemoteProtocolError,
    TransportError,
)
from kvoffload.wire.nvme_tcp import cmd as nc
from kvoffload.wire.nvme_tcp.cmd import Command, Completion
from kvoffload.wire.nvme_tcp.connection import (
    NEED_DATA,
    R2T,
    C2HData,
    C2HTermReq,
    CapsuleCmd,
    CapsuleResp,
    ConnectionClosed,
    DataEnd,
    H2CData,
    H2CTermReq,
    ICReq,
    ICResp,
    NvmeTcpConnection,
    PduError,
    Role,
    SinkFull,
)
from kvoffload.wire.status import nvme_error_for

__all__ = ["Call", "Cmd", "Plan", "Queue", "Sink", "views"]

T = TypeVar("T")

# A read sink: (offset in the command's data, bytes still to come in this PDU) -> buffers for
# the next bytes (they may cover fewer), or None to drop the rest of the PDU.
Sink = Callable[[int, int], "list[memoryview] | None"]


@dataclass
class Cmd:
    """One command a plan wants executed."""

    make: Callable[[int], Command]  # cid -> command
    data: Sequence[memoryview] = ()  # what it writes: in the capsule or on R2T
    sink: Sink | None = None  # where what it reads goes (None: allocated)


@dataclass
class Call:
    command: Command
    data: Sequence[memoryview] = ()
    sink: Sink | None = None
    completion: Completion | None = None
    chunks: list[memoryview] = field(default_factory=list)  # allocated read data
    received: int = 0
    digest_ok: bool = True
    error: KVOffloadError | None = None
    pos: int = 0  # offset of the next read byte
    left: int = 0  # bytes of the current C2HData still without a sink

    @property
    def done(self) -> bool:
        return self.completion is not None or self.error is not None

    def result(self) -> Completion:
        """The completion (success or not); raises if the call failed in transport."""
        if self.error is not None:
            raise self.error
        assert self.completion is not None
        if not self.digest_ok:  # a data digest failed: the data is not to be trusted
            raise TransportError("data digest mismatch; the command can be retried")
        return self.completion

    def ok(self, what: str) -> Completion:
        """The completion; raises the status's exception unless it succeeded."""
        c = self.result()
        if not c.ok:
            raise nvme_error_for(c.status, what)
        return c

    def check(self, what: str) -> Call:
        """This call, once `ok` said it succeeded."""
        self.ok(what)
        return self

    def read_data(self) -> memoryview:
        if len(self.chunks) == 1:
            return self.chunks[0]
        return memoryview(b"".join(self.chunks))


Plan = core.Plan[Cmd, Call, T]


def views(parts: Sequence[object]) -> list[memoryview]:
    views = [memoryview(p).cast("B") for p in parts]  # type: ignore[arg-type]
    return [v for v in views if len(v)]


def _cut(views: Sequence[memoryview], start: int, end: int) -> list[memoryview]:
    """The bytes [start, end) of the concatenation of `views`, as views."""
    out, pos = [], 0
    for view in views:
        lo, hi = max(start, pos), min(end, pos + len(view))
        if lo < hi:
            out.append(view[lo - pos : hi - pos])
        pos += len(view)
        if pos >= end:
            break
    return out


class Queue(SyncRunner[Cmd, Call]):
    """One TCP connection, one queue pair; used by one thread at a time."""

    def __init__(self, options: NvmeOptions, qid: int, depth: int, deadline: float) -> None:
        self.options = options
        self.qid = qid
        self.depth = depth
        self.conn = NvmeTcpConnection(Role.HOST)
        self.calls: dict[int, Call] = {}
        self._free = list(range(depth, 0, -1))  # command ids
        self.parked: set[int] = set()  # AERs: outstanding for good, never waited for
        self.broken: KVOffloadError | None = None
        sock = connect(options, deadline)
        self.sock = sock
        try:
            self._initialize(deadline)
        except BaseException:
            self.close()
            raise

    def _initialize(self, deadline: float) -> None:
        self._send(self.conn.send_parts(ICReq(self.options.hdgst, self.options.ddgst)), deadline)
        while True:
            event = self._next(deadline)
            if isinstance(event, ICResp):
                return
            raise RemoteProtocolError(f"expected ICResp, got {type(event).__name__}")

    def _next(self, deadline: float) -> object:
        while (event := self._event()) is NEED_DATA:
            self._recv(deadline)
        return event

    def _event(self) -> object:
        try:
            return self.conn.next_event()
        except PduError as exc:
            # Tell the target why before closing, as a host does (H2CTermReq).
            with contextlib.suppress(KVOffloadError, OSError):
                self.sock.sendall(self.conn.send(H2CTermReq(exc.fes, exc.fei, exc.pdu)))
            error = TransportError(f"{self.options.url} broke the protocol: {exc}")
            raise self._fail(error) from None
        except RemoteProtocolError as exc:
            raise self._fail(TransportError(f"{self.options.url}: {exc}")) from None

    # ------------------------------------------------------------------ runner

    def exchange(self, requests: Sequence[Cmd], deadline: float) -> list[Call]:
        if self.broken is not None:
            raise self.broken
        return super().exchange(requests, deadline)

    def room(self, calls: list[Call]) -> bool:
        return bool(self._free)

    def start(self, request: Cmd, deadline: float) -> Call:
        cid = self._free.pop()
        command = request.make(cid)
        data = list(request.data)
        in_capsule = command.sgl.type == nc.SGL_IN_CAPSULE and bool(data)
        call = Call(command, data, request.sink)
        self.calls[cid] = call
        payload = data if in_capsule else []
        length = sum(len(v) for v in payload)
        self._send(self.conn.send_parts(CapsuleCmd(command, length), payload), deadline)
        return call

    def pump(self, deadline: float) -> None:
        self._recv(deadline)
        while (event := self._event()) is not NEED_DATA:
            _EVENTS[type(event)](self, event, deadline)

    # ------------------------------------------------------------------ events

    def _on_resp(self, event: CapsuleResp, deadline: float) -> None:
        completion = event.completion
        call = self.calls.pop(completion.cid)  # the codec checked it is outstanding
        call.completion = completion
        if completion.cid in self.parked:
            self.parked.discard(completion.cid)
        self._free.append(completion.cid)

    def _on_c2h(self, event: C2HData, deadline: float) -> None:
        call = self.calls[event.cccid]
        call.pos, call.left = event.datao, event.datal
        call.received += event.datal
        self._give_sink(call)

    def _on_sink_full(self, event: SinkFull, deadline: float) -> None:
        self._give_sink(self.calls[event.cid])

    def _give_sink(self, call: Call) -> None:
        if call.sink is None:
            return  # the codec allocates; DataEnd brings it
        buffers = call.sink(call.pos, call.left)
        if buffers is None:
            self.conn.discard_data()
            return
        self.conn.set_data_sink(buffers)
        n = sum(len(b) for b in buffers)
        call.pos += n
        call.left -= n

    def _on_data_end(self, event: DataEnd, deadline: float) -> None:
        call = self.calls[event.cid]
        call.digest_ok = call.digest_ok and event.digest_ok
        if event.data is not None:
            call.chunks.append(event.data)

    def _on_r2t(self, event: R2T, deadline: float) -> None:
        call = self.calls[event.cccid]
        step = self.conn.maxh2cdata
        end = event.r2to + event.r2tl
        parts: list[bytes | memoryview] = []
        for pos in range(event.r2to, end, step):
            n = min(step, end - pos)
            pdu = H2CData(event.cccid, event.ttag, pos, n, pos + n == end)
            parts += self.conn.send_parts(pdu, _cut(call.data, pos, pos + n))
        self._send(parts, deadline)

    def _on_term(self, event: C2HTermReq, deadline: float) -> None:
        raise self._fail(
            TransportError(
                f"{self.options.url} terminated the connection (FES {event.fes:#x}, "
                f"FEI {event.fei})"
            )
        )

    def _on_closed(self, event: ConnectionClosed, deadline: float) -> None:
        raise self._fail(TransportError(f"{self.options.url} closed the connection"))

    # ------------------------------------------------------------------ bytes

    def _send(self, parts: Sequence[bytes | memoryview], deadline: float) -> None:
        try:
            self.sock.settimeout(left(deadline))
            send_all(self.sock, parts)
        except DeadlineExceededError as exc:
            raise self._fail(exc) from None
        except OSError as exc:
            raise self._lost(exc) from None

    def _recv(self, deadline: float) -> None:
        try:
            receive(self.sock, self.conn, left(deadline))
        except DeadlineExceededError as exc:
            raise self._fail(exc) from None
        except OSError as exc:
            raise self._lost(exc) from None

    def _lost(self, exc: OSError) -> KVOffloadError:
        return self._fail(lost(self.options.url, exc))

    def _fail(self, error: KVOffloadError) -> KVOffloadError:
        """The queue is unusable: every call in flight fails with `error`."""
        if self.broken is None:
            self.broken = error
        for call in self.calls.values():
            call.error = call.error or error
        self.calls.clear()
        self.conn.send_failed()
        self.close()
        return error

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


_EVENTS: dict[type, Callable[[Queue, Any, float], None]] = {
    CapsuleResp: Queue._on_resp,
    C2HData: Queue._on_c2h,
    SinkFull: Queue._on_sink_full,
    DataEnd: Queue._on_data_end,
    R2T: Queue._on_r2t,
    C2HTermReq: Queue._on_term,
    ConnectionClosed: Queue._on_closed,
    ICResp: lambda q, e, d: None,  # cannot happen twice: the codec refuses a second one
}
