"""NVMe/TCP writers: an event to send, checked against the queue's state, to its PDU header.

`WRITERS` dispatches on the event's type. Each writer returns the PDU-specific header and the
FLAGS bits it sets; `NvmeTcpConnection.send_parts` adds the common header and the digests.
What we may not send raises `LocalProtocolError`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from kvoffload.errors import LocalProtocolError
from kvoffload.wire.nvme_tcp.cmd import SGL_IN_CAPSULE, SGL_TRANSPORT, Direction
from kvoffload.wire.nvme_tcp.events import (
    _DATA,
    _IC,
    _TERM,
    FLAG_LAST,
    R2T,
    C2HData,
    C2HTermReq,
    CapsuleCmd,
    CapsuleResp,
    Event,
    H2CData,
    H2CTermReq,
    ICReq,
    ICResp,
    _TermReq,
)
from kvoffload.wire.nvme_tcp.state import QueueState, _Cmd, _Phase, _R2TWindow

__all__ = ["WRITERS"]

E = TypeVar("E", bound=Event)
# (state, event, data bytes that follow) -> (PDU-specific header, FLAGS)
Writer = Callable[[QueueState, E, int], tuple[bytes, int]]


def write_icreq(st: QueueState, event: ICReq, length: int) -> tuple[bytes, int]:
    if st._tx_phase is not _Phase.AWAIT_IC or st._asked is not None:
        raise LocalProtocolError("ICReq is sent once, first")
    st._asked = event
    dgst = event.hdgst | (event.ddgst << 1)
    return _IC.pack(event.pfv, event.hpda, dgst, event.maxr2t) + bytes(112), 0


def write_icresp(st: QueueState, event: ICResp, length: int) -> tuple[bytes, int]:
    if st._asked is None or st._tx_phase is not _Phase.AWAIT_IC:
        raise LocalProtocolError("ICResp answers one ICReq")
    if event.maxh2cdata % 4 or event.maxh2cdata < 4096 or event.cpda:
        raise LocalProtocolError(f"unusable ICResp {event}")
    st.hdgst, st.ddgst, st.maxh2cdata = event.hdgst, event.ddgst, event.maxh2cdata
    dgst = event.hdgst | (event.ddgst << 1)
    return _IC.pack(event.pfv, event.cpda, dgst, event.maxh2cdata) + bytes(112), 0


def write_term(st: QueueState, event: _TermReq, length: int) -> tuple[bytes, int]:
    if length:
        raise LocalProtocolError("a TermReq's data is its `pdu` field")
    # The copied header is not PDU data in the digest sense: it rides in the header part.
    return _TERM.pack(event.fes, event.fei) + bytes(10) + event.pdu, 0


def write_cmd(st: QueueState, event: CapsuleCmd, length: int) -> tuple[bytes, int]:
    st._ready()
    command = event.command
    if command.cid in st._cmds:
        raise LocalProtocolError(f"command id {command.cid} is already in progress")
    if length != event.data_length:
        raise LocalProtocolError(f"CapsuleCmd declares {event.data_length} bytes, got {length}")
    if length > st.in_capsule:
        raise LocalProtocolError(f"{length} bytes of in-capsule data exceed {st.in_capsule}")
    sgl = command.sgl
    if length and (sgl.type != SGL_IN_CAPSULE or sgl.length != length):
        raise LocalProtocolError("in-capsule data needs an in-capsule SGL of its length")
    st._cmds[command.cid] = _Cmd(command.direction, sgl.length if sgl.type == SGL_TRANSPORT else 0)
    return command.pack(), 0


def write_resp(st: QueueState, event: CapsuleResp, length: int) -> tuple[bytes, int]:
    st._ready()
    cmd = st._cmds.get(event.completion.cid)
    if cmd is None:
        raise LocalProtocolError(f"no command {event.completion.cid} to complete")
    if cmd.r2t is not None:
        raise LocalProtocolError("a command is completed only after its R2T's data is in")
    del st._cmds[event.completion.cid]
    return event.completion.pack(), 0


def write_h2c(st: QueueState, event: H2CData, length: int) -> tuple[bytes, int]:
    st._ready()
    cmd = st._cmds.get(event.cccid)
    window = cmd.r2t if cmd is not None else None
    if cmd is None or window is None or window.ttag != event.ttag:
        raise LocalProtocolError(f"no R2T {event.ttag} for command {event.cccid}")
    end = event.datao + event.datal
    if (
        length != event.datal
        or not length
        or length > st.maxh2cdata
        or event.datao != window.next
        or end > window.end
        or event.last != (end == window.end)
    ):
        raise LocalProtocolError(f"{event} does not continue R2T data at {window.next}")
    window.next = end
    cmd.moved += length
    if event.last:
        cmd.r2t = None
    psh = _DATA.pack(event.cccid, event.ttag, event.datao, event.datal) + bytes(4)
    return psh, FLAG_LAST if event.last else 0


def write_c2h(st: QueueState, event: C2HData, length: int) -> tuple[bytes, int]:
    st._ready()
    cmd = st._cmds.get(event.cccid)
    if cmd is None or cmd.direction not in (Direction.TO_HOST, Direction.BOTH):
        raise LocalProtocolError(f"command {event.cccid} reads no data")
    if (
        event.success
        or cmd.last
        or length != event.datal
        or not length
        or event.datao != cmd.moved
        or event.datao + length > cmd.length
    ):
        raise LocalProtocolError(f"{event} does not continue command data at {cmd.moved}")
    cmd.moved += length
    cmd.last = event.last
    psh = _DATA.pack(event.cccid, 0, event.datao, event.datal) + bytes(4)
    return psh, FLAG_LAST if event.last else 0


def write_r2t(st: QueueState, event: R2T, length: int) -> tuple[bytes, int]:
    st._ready()
    cmd = st._cmds.get(event.cccid)
    if (
        cmd is None
        or cmd.direction is not Direction.TO_CONTROLLER
        or cmd.r2t is not None
        or length
        or not event.r2tl
        or event.r2to != cmd.moved
        or event.r2to + event.r2tl > cmd.length
    ):
        raise LocalProtocolError(f"{event} is not a valid R2T now")
    cmd.r2t = _R2TWindow(event.ttag, event.r2to + event.r2tl, event.r2to)
    return _DATA.pack(event.cccid, event.ttag, event.r2to, event.r2tl) + bytes(4), 0


def _row(kind: type[E], writer: Writer[E]) -> tuple[type[Event], Callable[..., tuple[bytes, int]]]:
    """A table row whose writer mypy checks against its event type; looking writers up by
    `type(event)` keeps that true when the table is used."""
    return kind, writer


# Event type -> its writer.
WRITERS: dict[type[Event], Callable[..., tuple[bytes, int]]] = dict(
    [
        _row(ICReq, write_icreq),
        _row(ICResp, write_icresp),
        _row(H2CTermReq, write_term),
        _row(C2HTermReq, write_term),
        _row(CapsuleCmd, write_cmd),
        _row(CapsuleResp, write_resp),
        _row(H2CData, write_h2c),
        _row(C2HData, write_c2h),
        _row(R2T, write_r2t),
    ]
)
