"""A bare NVMe/TCP queue over a blocking socket, for tests that speak to the target PDU by PDU
(what the SDK's host would never send, or before it would)."""

from __future__ import annotations

import socket
from collections.abc import Sequence

from kvoffload.wire.nvme_tcp import cmd as nc
from kvoffload.wire.nvme_tcp import data as nd
from kvoffload.wire.nvme_tcp.cmd import Command, Completion
from kvoffload.wire.nvme_tcp.connection import (
    NEED_DATA,
    R2T,
    C2HData,
    CapsuleCmd,
    CapsuleResp,
    ConnectionClosed,
    DataEnd,
    Event,
    H2CData,
    ICReq,
    ICResp,
    NvmeTcpConnection,
    Role,
)

SUBNQN = "nqn.2026-11.io.kvoffload:store"
HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000000aa"
CC_ENABLE = (6 << 16) | (4 << 20) | (6 << 4) | 1


class RawQueue:
    def __init__(
        self,
        port: int,
        *,
        digests: bool = False,
        icreq: bool = True,
        sock: socket.socket | None = None,
    ) -> None:
        self.sock = sock or socket.create_connection(("127.0.0.1", port), timeout=30)
        self.sock.settimeout(30)
        self.conn = NvmeTcpConnection(Role.HOST)
        self._cid = 0
        if icreq:
            self.send(ICReq(digests, digests))
            (answer,) = self.events()
            assert isinstance(answer, ICResp), answer

    def send(self, event: Event, data: Sequence[bytes] = ()) -> None:
        self.sock.sendall(self.conn.send(event, data))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def events(self) -> list[Event]:
        """Read until at least one event is complete; the events."""
        out: list[Event] = []
        while not out:
            data = self._recv()
            self.conn.receive_data(data)
            while (event := self.conn.next_event()) is not NEED_DATA:
                assert isinstance(event, Event)
                out.append(event)
                if isinstance(event, ConnectionClosed):
                    return out
        return out

    def until_closed(self) -> list[Event]:
        """Every event until the target closes the connection (the last is ConnectionClosed)."""
        out: list[Event] = []
        while not out or not isinstance(out[-1], ConnectionClosed):
            out += self.events()
        return out

    def _recv(self) -> bytes:
        try:
            return self.sock.recv(1 << 20)
        except ConnectionResetError:
            return b""

    def cid(self) -> int:
        self._cid = self._cid % 0xFFFF + 1
        return self._cid

    def command(self, cmd: Command, data: bytes = b"") -> tuple[Completion, bytes]:
        """Run one command to completion: R2Ts answered, C2HData collected."""
        in_capsule = cmd.sgl.type == nc.SGL_IN_CAPSULE
        self.send(CapsuleCmd(cmd, len(data) if in_capsule else 0), [data] if in_capsule else [])
        read = b""
        while True:
            for event in self.events():
                if isinstance(event, R2T):
                    end = event.r2to + event.r2tl
                    step = self.conn.maxh2cdata
                    for pos in range(event.r2to, end, step):
                        n = min(step, end - pos)
                        pdu = H2CData(event.cccid, event.ttag, pos, n, pos + n == end)
                        self.send(pdu, [data[pos : pos + n]])
                elif isinstance(event, DataEnd) and event.data is not None:
                    read += bytes(event.data)
                elif isinstance(event, CapsuleResp):
                    assert event.completion.cid == cmd.cid
                    return event.completion, read
                elif not isinstance(event, (C2HData, DataEnd)):
                    raise AssertionError(f"unexpected {event}")

    def connect(
        self,
        qid: int = 0,
        *,
        subnqn: str = SUBNQN,
        hostnqn: str = HOSTNQN,
        cntlid: int = nd.DYNAMIC_CNTLID,
        sqsize: int = 31,
        kato_ms: int = 0,
    ) -> Completion:
        data = nd.ConnectData(bytes(16), cntlid, subnqn, hostnqn).pack()
        completion, _ = self.command(nc.connect(self.cid(), qid, sqsize, kato_ms), data)
        return completion

    def enable(self) -> None:
        completion, _ = self.command(nc.property_set(self.cid(), 0x14, CC_ENABLE))
        assert completion.ok

    def close(self) -> None:
        self.sock.close()
