"""NVMe/TCP PDUs: the layouts of `shared/ref/nvme-tcp-kv.md` §1 as constants, and the events.

Events are frozen, slotted dataclasses validated on construction; `nvme_tcp_readers` makes them
from bytes, `nvme_tcp_writers` turns them back into bytes, and `nvme_tcp.NvmeTcpConnection`
wires both to the state of one connection.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import crc32c

from kvoffload.errors import LocalProtocolError, RemoteProtocolError
from kvoffload.wire.nvme_tcp.cmd import Command, Completion

__all__ = [
    "ADMIN_IN_CAPSULE",
    "CH",
    "FEI_CCCID",
    "FEI_CQE_CID",
    "FEI_DATAL",
    "FEI_DATAO",
    "FEI_DGST",
    "FEI_FLAGS",
    "FEI_HLEN",
    "FEI_MAXDATA",
    "FEI_PDA",
    "FEI_PDO",
    "FEI_PFV",
    "FEI_PLEN",
    "FEI_SQE_CID",
    "FEI_TTAG",
    "FEI_TYPE",
    "FLAG_DDGST",
    "FLAG_HDGST",
    "FLAG_LAST",
    "FLAG_SUCCESS",
    "NEED_DATA",
    "C2HData",
    "C2HTermReq",
    "CapsuleCmd",
    "CapsuleResp",
    "ConnectionClosed",
    "DataEnd",
    "Event",
    "Fes",
    "H2CData",
    "H2CTermReq",
    "ICReq",
    "ICResp",
    "PduError",
    "PduType",
    "R2T",
    "SinkFull",
    "digest",
]

ADMIN_IN_CAPSULE = 8192  # fixed by NVMe/TCP for the admin queue (and any queue before Connect)
FLAG_HDGST = 0x01
FLAG_DDGST = 0x02
FLAG_LAST = 0x04
FLAG_SUCCESS = 0x08
CH = struct.Struct("<BBBBI")  # type, flags, hlen, pdo, plen
_IC = struct.Struct("<HBBI")  # pfv, hpda/cpda, dgst, maxr2t/maxh2cdata (then 112 reserved)
_TERM = struct.Struct("<HI")  # fes, fei (then 10 reserved)
_DATA = struct.Struct("<HHII")  # cccid, ttag, datao/r2to, datal/r2tl (then 4 reserved)
_DIGEST = struct.Struct("<I")
_TERM_MAX_COPY = 128  # a TermReq carries at most 128 bytes of the offending PDU
_U16, _U32 = 0xFFFF, 0xFFFF_FFFF


def digest(parts: Sequence[bytes | memoryview]) -> int:
    """CRC32C (Castagnoli) of the concatenation of `parts`, as NVMe/TCP's digests use it."""
    crc = 0
    for part in parts:
        crc = crc32c.crc32c(part, crc)
    return int(crc)


class PduType(enum.IntEnum):
    IC_REQ = 0x00
    IC_RESP = 0x01
    H2C_TERM_REQ = 0x02
    C2H_TERM_REQ = 0x03
    CAPSULE_CMD = 0x04
    CAPSULE_RESP = 0x05
    H2C_DATA = 0x06
    C2H_DATA = 0x07
    R2T = 0x09


class Fes(enum.IntEnum):
    """Fatal Error Status of a TermReq."""

    INVALID_HEADER_FIELD = 0x01
    SEQUENCE_ERROR = 0x02
    HEADER_DIGEST_ERROR = 0x03
    DATA_OUT_OF_RANGE = 0x04
    DATA_LIMIT_EXCEEDED = 0x05  # also "R2T limit exceeded"
    UNSUPPORTED_PARAMETER = 0x06


# Field offsets (from the start of the PDU) reported as FEI.
FEI_TYPE, FEI_FLAGS, FEI_HLEN, FEI_PDO, FEI_PLEN = 0, 1, 2, 3, 4
FEI_PFV, FEI_PDA, FEI_DGST, FEI_MAXDATA = 8, 10, 11, 12
FEI_CCCID, FEI_TTAG, FEI_DATAO, FEI_DATAL = 8, 10, 12, 16
FEI_SQE_CID = 8 + 2
FEI_CQE_CID = 8 + 12

_HLEN = {
    PduType.IC_REQ: 128,
    PduType.IC_RESP: 128,
    PduType.H2C_TERM_REQ: 24,
    PduType.C2H_TERM_REQ: 24,
    PduType.CAPSULE_CMD: 72,
    PduType.CAPSULE_RESP: 24,
    PduType.H2C_DATA: 24,
    PduType.C2H_DATA: 24,
    PduType.R2T: 24,
}
_ALLOWED_FLAGS = {
    PduType.IC_REQ: 0,
    PduType.IC_RESP: 0,
    PduType.H2C_TERM_REQ: 0,
    PduType.C2H_TERM_REQ: 0,
    PduType.CAPSULE_CMD: FLAG_HDGST | FLAG_DDGST,
    PduType.CAPSULE_RESP: FLAG_HDGST,
    PduType.H2C_DATA: FLAG_HDGST | FLAG_DDGST | FLAG_LAST,
    PduType.C2H_DATA: FLAG_HDGST | FLAG_DDGST | FLAG_LAST | FLAG_SUCCESS,
    PduType.R2T: FLAG_HDGST,
}
# PDU types that carry a header digest once one is negotiated (never IC or TermReq PDUs).
_DIGESTED = frozenset(
    {
        PduType.CAPSULE_CMD,
        PduType.CAPSULE_RESP,
        PduType.H2C_DATA,
        PduType.C2H_DATA,
        PduType.R2T,
    }
)
_WITH_DATA = frozenset({PduType.CAPSULE_CMD, PduType.H2C_DATA, PduType.C2H_DATA})
_TERM_TYPES = frozenset({PduType.H2C_TERM_REQ, PduType.C2H_TERM_REQ})


class PduError(RemoteProtocolError):
    """The peer sent a PDU that ends the connection; `fes`/`fei` go into the TermReq we send,
    with `pdu` (the offending header as received, at most 128 bytes)."""

    def __init__(self, message: str, fes: Fes, fei: int, pdu: bytes = b"") -> None:
        super().__init__(message)
        self.fes = fes
        self.fei = fei
        self.pdu = pdu


class _Fatal(LocalProtocolError):
    """Internal: raised while parsing, re-raised by `next_event` as `PduError`."""

    def __init__(self, message: str, fes: Fes, fei: int) -> None:
        super().__init__(message)
        self.fes = fes
        self.fei = fei


def _range(value: int, top: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
        raise LocalProtocolError(f"{what} out of range: {value!r}")


# ---------------------------------------------------------------------------- events


class Event:
    """Base of the PDU events. Subclasses are frozen, slotted dataclasses."""

    __slots__ = ()
    TYPE: ClassVar[PduType | None] = None


@dataclass(frozen=True, slots=True)
class ICReq(Event):
    TYPE: ClassVar[PduType | None] = PduType.IC_REQ
    hdgst: bool = False
    ddgst: bool = False
    maxr2t: int = 0  # 0's based outstanding R2Ts per command the host accepts
    hpda: int = 0
    pfv: int = 0

    def __post_init__(self) -> None:
        _range(self.maxr2t, _U32, "MAXR2T")
        _range(self.hpda, 31, "HPDA")
        _range(self.pfv, _U16, "PFV")


@dataclass(frozen=True, slots=True)
class ICResp(Event):
    TYPE: ClassVar[PduType | None] = PduType.IC_RESP
    hdgst: bool = False
    ddgst: bool = False
    maxh2cdata: int = 1 << 20
    cpda: int = 0
    pfv: int = 0

    def __post_init__(self) -> None:
        _range(self.maxh2cdata, _U32, "MAXH2CDATA")
        _range(self.cpda, 31, "CPDA")
        _range(self.pfv, _U16, "PFV")


@dataclass(frozen=True, slots=True)
class _TermReq(Event):
    fes: int
    fei: int = 0
    pdu: bytes = b""  # the offending PDU's header, as received

    def __post_init__(self) -> None:
        _range(self.fes, _U16, "FES")
        _range(self.fei, _U32, "FEI")
        if len(self.pdu) > _TERM_MAX_COPY:
            raise LocalProtocolError("a TermReq carries at most 128 bytes of the bad PDU")


@dataclass(frozen=True, slots=True)
class H2CTermReq(_TermReq):
    TYPE: ClassVar[PduType | None] = PduType.H2C_TERM_REQ


@dataclass(frozen=True, slots=True)
class C2HTermReq(_TermReq):
    TYPE: ClassVar[PduType | None] = PduType.C2H_TERM_REQ


@dataclass(frozen=True, slots=True)
class CapsuleCmd(Event):
    """A command; `data_length` in-capsule bytes follow (see `DataEnd`)."""

    TYPE: ClassVar[PduType | None] = PduType.CAPSULE_CMD
    command: Command
    data_length: int = 0


@dataclass(frozen=True, slots=True)
class CapsuleResp(Event):
    TYPE: ClassVar[PduType | None] = PduType.CAPSULE_RESP
    completion: Completion


@dataclass(frozen=True, slots=True)
class H2CData(Event):
    TYPE: ClassVar[PduType | None] = PduType.H2C_DATA
    cccid: int
    ttag: int
    datao: int
    datal: int
    last: bool = False

    def __post_init__(self) -> None:
        _range(self.cccid, _U16, "CCCID")
        _range(self.ttag, _U16, "TTAG")
        _range(self.datao, _U32, "DATAO")
        _range(self.datal, _U32, "DATAL")


@dataclass(frozen=True, slots=True)
class C2HData(Event):
    TYPE: ClassVar[PduType | None] = PduType.C2H_DATA
    cccid: int
    datao: int
    datal: int
    last: bool = False
    success: bool = False  # never sent by this code: it needs SQ flow control disabled

    def __post_init__(self) -> None:
        _range(self.cccid, _U16, "CCCID")
        _range(self.datao, _U32, "DATAO")
        _range(self.datal, _U32, "DATAL")


@dataclass(frozen=True, slots=True)
class R2T(Event):
    TYPE: ClassVar[PduType | None] = PduType.R2T
    cccid: int
    ttag: int
    r2to: int
    r2tl: int

    def __post_init__(self) -> None:
        _range(self.cccid, _U16, "CCCID")
        _range(self.ttag, _U16, "TTAG")
        _range(self.r2to, _U32, "R2TO")
        _range(self.r2tl, _U32, "R2TL")


@dataclass(frozen=True, slots=True)
class DataEnd(Event):
    """The data of the last data-bearing PDU of command `cid` is complete.

    `data` holds it when the connection allocated the memory (no sink was set); it is None
    when it went into a sink or was discarded. `digest_ok` is False when a negotiated data
    digest did not match (the bytes are in place but must not be used).
    """

    cid: int
    data: memoryview | None = None
    digest_ok: bool = True


@dataclass(frozen=True, slots=True)
class SinkFull(Event):
    """The sink given to `set_data_sink` is full; `remaining` bytes of this PDU's data follow.
    Set another sink, discard, or (doing neither) let the connection allocate the rest."""

    cid: int
    remaining: int


@dataclass(frozen=True, slots=True)
class ConnectionClosed(Event):
    """The peer closed its side between PDUs."""


class _NeedData(enum.Enum):
    DATA = "need data"


NEED_DATA = _NeedData.DATA
