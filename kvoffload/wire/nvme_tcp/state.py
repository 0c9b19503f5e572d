"""NVMe/TCP state: which PDU each side may receive and send when, and what one queue tracks.

The tables here are the whole state machine; `readers` and `writers` move
a queue (`QueueState`, the face of `NvmeTcpConnection` they see) through them, one PDU at a time.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from kvoffload.wire.nvme_tcp.cmd import Direction
from kvoffload.wire.nvme_tcp.events import (
    R2T,
    C2HData,
    C2HTermReq,
    CapsuleCmd,
    CapsuleResp,
    H2CData,
    H2CTermReq,
    ICReq,
    ICResp,
    PduType,
)

__all__ = ["QueueState", "Role"]


class Role(enum.Enum):
    HOST = "host"
    TARGET = "target"


class _Phase(enum.Enum):
    AWAIT_IC = "initialize connection"
    READY = "ready"
    BROKEN = "broken"


# (role, phase) -> PDU types that role may receive then. A type the role can never receive is an
# invalid header field; a receivable type at the wrong time is a sequence error.
_RECEIVABLE = {
    Role.TARGET: frozenset(
        {PduType.IC_REQ, PduType.H2C_TERM_REQ, PduType.CAPSULE_CMD, PduType.H2C_DATA}
    ),
    Role.HOST: frozenset(
        {
            PduType.IC_RESP,
            PduType.C2H_TERM_REQ,
            PduType.CAPSULE_RESP,
            PduType.C2H_DATA,
            PduType.R2T,
        }
    ),
}
_NOW = {
    (Role.TARGET, _Phase.AWAIT_IC): frozenset({PduType.IC_REQ}),
    (Role.TARGET, _Phase.READY): frozenset(
        {PduType.H2C_TERM_REQ, PduType.CAPSULE_CMD, PduType.H2C_DATA}
    ),
    (Role.HOST, _Phase.AWAIT_IC): frozenset({PduType.IC_RESP, PduType.C2H_TERM_REQ}),
    (Role.HOST, _Phase.READY): _RECEIVABLE[Role.HOST] - {PduType.IC_RESP},
}
# PDU type -> the phases receiving / sending it moves to, as (receive side, send side); None
# leaves that side as it is. Each type comes from one role only, so the type is the key.
_ON_RECEIVE: dict[PduType, tuple[_Phase | None, _Phase | None]] = {
    PduType.IC_REQ: (_Phase.READY, None),  # a target: its ICResp is still to be sent
    PduType.IC_RESP: (_Phase.READY, _Phase.READY),  # a host: initialized both ways
    PduType.H2C_TERM_REQ: (_Phase.BROKEN, None),  # nothing may follow a TermReq
    PduType.C2H_TERM_REQ: (_Phase.BROKEN, None),
}
_ON_SEND: dict[PduType, tuple[_Phase | None, _Phase | None]] = {
    PduType.IC_RESP: (None, _Phase.READY),
    PduType.H2C_TERM_REQ: (None, _Phase.BROKEN),
    PduType.C2H_TERM_REQ: (None, _Phase.BROKEN),
}
_SENDABLE = {
    Role.HOST: frozenset({ICReq, H2CTermReq, CapsuleCmd, H2CData}),
    Role.TARGET: frozenset({ICResp, C2HTermReq, CapsuleResp, C2HData, R2T}),
}


@dataclass
class _Cmd:
    """A command between its CapsuleCmd and its CapsuleResp, as far as data moves."""

    direction: Direction
    length: int  # bytes the transport SGL allows to move (0 for in-capsule or no data)
    moved: int = 0  # bytes moved so far by R2T/H2CData or C2HData
    last: bool = False  # a C2HData with LAST_PDU was sent (what we send stays strict)
    r2t: _R2TWindow | None = None


@dataclass
class _R2TWindow:
    ttag: int
    end: int
    next: int


class QueueState(Protocol):
    """What the readers and writers of one queue share: its limits, what ICReq/ICResp
    negotiated, each direction's phase, and the commands in progress (`NvmeTcpConnection`
    holds it; this is the narrow face the reader and writer tables see)."""

    role: Role
    in_capsule: int
    max_outstanding: int
    maxh2cdata: int
    hdgst: bool
    ddgst: bool
    _asked: ICReq | None
    _rx_phase: _Phase
    _tx_phase: _Phase
    _cmds: dict[int, _Cmd]
    _pdu_data: int
    _data_cid: int

    def _enter(self, phases: tuple[_Phase | None, _Phase | None]) -> None: ...

    def _ready(self) -> None: ...
