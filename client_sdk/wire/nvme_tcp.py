"""NVMe/TCP (the NVMe-oF TCP transport binding), sans-I/O: PDUs in, events out, and back.

One `NvmeTcpConnection` per TCP connection and side (`Role.HOST` or `Role.TARGET`), shaped like
h11's `Connection`: `receive_data` (or `get_buffer` / `buffer_updated`), `next_event`,
`send` / `send_parts`, `send_failed`. Layouts follow `shared/ref/nvme-tcp-kv.md` §1:

* an 8-byte common header (type, flags, HLEN, PDO, PLEN), a PDU-specific header, an optional
  CRC32C header digest, then PDU data and an optional CRC32C data digest;
* nine PDU types: ICReq/ICResp, H2C/C2HTermReq, CapsuleCmd/CapsuleResp, H2CData/C2HData, R2T;
* CPDA = HPDA = 0 (no padding: data starts right after the header and its digest).

A PDU that carries data (a CapsuleCmd with in-capsule data, H2CData, C2HData) yields its event
as soon as its header is in; the receiver then points the data at its own memory
(`set_data_sink`, possibly only part of it: `SinkFull` then asks again), drops it
(`discard_data`) or lets the connection allocate, and `DataEnd` follows once the last byte and
the data digest are in. Byte-at-a-time feeding yields exactly the same events.

Both directions are checked: what a peer sends (framing, digests, which PDU may come when, the
R2T/H2CData and C2HData bookkeeping of every command) raises `PduError` — a
`RemoteProtocolError` carrying the Fatal Error Status and offset a C2HTermReq/H2CTermReq reports
— and leaves the connection broken; what we would send wrongly raises `LocalProtocolError`.
A bad *data* digest is not fatal: `DataEnd.digest_ok` is False and the command fails alone.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import crc32c

from kvoffload.client_sdk.wire.nvme_cmd import (
    SGL_IN_CAPSULE,
    SGL_TRANSPORT,
    Command,
    Completion,
    Direction,
)
from kvoffload.client_sdk.wire.rxbuffer import ReceiveBuffer
from kvoffload.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "ADMIN_IN_CAPSULE",
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
    "NvmeTcpConnection",
    "PduError",
    "PduType",
    "R2T",
    "Role",
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


class _Rx(enum.Enum):
    HEAD = "common header"
    HEADER = "PDU header"
    DATA = "data"  # whether a sink is chosen is the ReceiveBuffer's business
    DIGEST = "data digest"


# ---------------------------------------------------------------------------- the connection


class NvmeTcpConnection(ReceiveBuffer):
    """One side of one NVMe/TCP connection (one queue pair); no I/O.

    Args:
        role: HOST or TARGET.
        in_capsule: the most in-capsule data one command may carry (a target refuses more; a
            host sends no more). 8192 until the application raises it for an I/O queue.
        max_outstanding: commands one queue may have in progress (a target refuses more).
        maxh2cdata: a target's MAXH2CDATA (sent in its ICResp); a host learns it from ICResp.
    """

    # A host's C2HData may declare up to its whole read buffer, whose size comes from the
    # target (KVVML): allocate as the bytes come, not as declared.
    _alloc_ahead: ClassVar[int | None] = 16 << 20

    def __init__(
        self,
        role: Role,
        *,
        in_capsule: int = ADMIN_IN_CAPSULE,
        max_outstanding: int = 128,
        maxh2cdata: int = 1 << 20,
    ) -> None:
        super().__init__()
        self.role = role
        self.in_capsule = in_capsule
        self.max_outstanding = max_outstanding
        self.maxh2cdata = maxh2cdata
        self.hdgst = False
        self.ddgst = False
        self._asked: ICReq | None = None  # host: what it asked for; target: what it was asked
        self._rx_phase = _Phase.AWAIT_IC
        self._tx_phase = _Phase.AWAIT_IC
        self._error: RemoteProtocolError | None = None
        self._eof = False
        self._cmds: dict[int, _Cmd] = {}
        self._rx = _Rx.HEAD
        self._ch: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)
        self._need = 0  # header bytes (from the PDU start) to have before parsing
        self._hd = 0  # header digest bytes of the current PDU
        self._pdu_data = 0  # data bytes the current PDU declares
        self._data_cid = 0
        self._ddgst = False
        self._crc = 0

    # ------------------------------------------------------------------ receiving

    @property
    def at_boundary(self) -> bool:
        """Between PDUs, nothing partial buffered."""
        return self._rx is _Rx.HEAD and self._start == self._end

    @property
    def outstanding(self) -> int:
        """Commands sent (host) or received (target) and not yet completed."""
        return len(self._cmds)

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Feed received bytes (copied in through `get_buffer`); `b""` means the peer closed."""
        if not len(data):
            self._eof = True
            return
        self._feed(data)

    def _header_room(self) -> int:
        return self._need if self._rx is _Rx.HEADER else CH.size

    def _landed(self, data: memoryview) -> None:
        if self._ddgst:
            self._crc = crc32c.crc32c(data, self._crc)

    def receive_eof(self) -> None:
        self._eof = True

    def set_data_sink(self, buffers: Sequence[memoryview]) -> None:
        """Put the next bytes of the current PDU's data into `buffers` (in order). They may
        add up to less than what remains (`SinkFull` follows when they are full).

        Raises:
            LocalProtocolError: no data is waiting, or the buffers hold more than remains.
        """
        if not self._unclaimed:
            raise LocalProtocolError("no PDU data is waiting for a sink")
        views = [memoryview(b).cast("B") for b in buffers]
        views = [v for v in views if len(v)]
        if not views or sum(len(v) for v in views) > self._left:
            raise LocalProtocolError(
                f"sink of {sum(len(v) for v in views)} bytes for {self._left} data bytes"
            )
        self._claim(views, discard=False)

    def discard_data(self) -> None:
        """Read and drop the rest of the current PDU's data (its digest is still checked)."""
        if not self._unclaimed:
            raise LocalProtocolError("no PDU data is waiting to be discarded")
        self._claim([], discard=True)

    def next_event(self) -> Event | _NeedData:
        """The next event, `NEED_DATA`, or `ConnectionClosed` after a clean EOF.

        Raises:
            PduError: the peer sent a PDU that ends the connection (send the TermReq it
                describes, then close).
            RemoteProtocolError: the peer closed in the middle of a PDU, or the connection
                failed before.
        """
        if self._error is not None:
            raise self._error
        try:
            return self._next()
        except _Fatal as exc:
            start = self._start
            end = min(start + min(self._need, _TERM_MAX_COPY), self._end)
            pdu = bytes(self._view[start:end])
            self._error = PduError(str(exc), exc.fes, exc.fei, pdu)
        except LocalProtocolError as exc:
            self._error = RemoteProtocolError(str(exc))
        self._rx_phase = _Phase.BROKEN
        raise self._error

    def _next(self) -> Event | _NeedData:
        if self._rx is _Rx.HEAD:
            if self.buffered < CH.size:
                return self._at_eof()
            self._parse_ch()
        if self._rx is _Rx.HEADER:
            if self.buffered < self._need:
                return self._at_eof()
            return self._parse_header()
        if self._rx is _Rx.DATA:
            if self._unclaimed:  # nobody chose a sink (after the event or a SinkFull)
                self._allocate()
            self._drain()
            if self._left:
                if self._unclaimed:  # a partial sink filled up: ask for the next one
                    return SinkFull(self._data_cid, self._left)
                return self._at_eof()
            if not self._ddgst:
                return self._data_end(True)
            self._rx = _Rx.DIGEST
        if self.buffered < _DIGEST.size:
            return self._at_eof()
        (sent,) = _DIGEST.unpack_from(self._buf, self._start)
        self._start += _DIGEST.size
        return self._data_end(sent == self._crc)

    def _at_eof(self) -> Event | _NeedData:
        if not self._eof:
            return NEED_DATA
        if not self.at_boundary:
            raise LocalProtocolError("connection closed in the middle of a PDU")
        return ConnectionClosed()

    # ------------------------------------------------------------------ parsing

    def _parse_ch(self) -> None:
        # Liberal in what we accept, as Linux's nvmet and SPDK are: only what breaks framing
        # (type, HLEN, PLEN, where the data starts) or the session (sequence) is refused.
        # FLAGS bits a type does not define, and PDO where no data follows, are ignored; the
        # digest flags too: the digests negotiated in ICReq/ICResp decide where the bytes
        # are, and the digests themselves are checked.
        ptype, flags, hlen, pdo, plen = CH.unpack_from(self._buf, self._start)
        self._need = CH.size  # what a TermReq quotes if this header is the bad one
        if ptype not in _RECEIVABLE[self.role]:
            raise _Fatal(
                f"PDU type {ptype:#x} cannot come from the peer", Fes.INVALID_HEADER_FIELD, FEI_TYPE
            )
        kind = PduType(ptype)
        if kind not in _NOW.get((self.role, self._rx_phase), ()):
            raise _Fatal(f"{kind.name} out of sequence", Fes.SEQUENCE_ERROR, FEI_TYPE)
        if hlen != _HLEN[kind]:
            raise _Fatal(f"{kind.name} with HLEN {hlen}", Fes.INVALID_HEADER_FIELD, FEI_HLEN)
        flags &= _ALLOWED_FLAGS[kind]
        hd = 4 if self.hdgst and kind in _DIGESTED else 0
        self._hd = hd
        if kind in _TERM_TYPES:
            if not hlen <= plen <= hlen + _TERM_MAX_COPY:
                raise _Fatal(f"TermReq PLEN {plen}", Fes.INVALID_HEADER_FIELD, FEI_PLEN)
            self._pdu_data = 0
            self._need = plen
        else:
            self._pdu_data, self._need = self._check_lengths(kind, hlen, pdo, plen, hd)
        self._ch = (kind, flags, hlen, pdo, plen)
        self._rx = _Rx.HEADER

    def _check_lengths(
        self, kind: PduType, hlen: int, pdo: int, plen: int, hd: int
    ) -> tuple[int, int]:
        """(data bytes the PDU declares, bytes up to where its data starts), from PLEN and PDO.

        PDO counts only when data follows. It may leave padding after the header (SPDK's
        target skips it too); data that would start inside the header, or no room for data
        between PDO and the end, breaks the framing.
        """
        rest = plen - hlen - hd
        if rest < 0 or (rest and kind not in _WITH_DATA):
            raise _Fatal(f"{kind.name} with PLEN {plen}", Fes.INVALID_HEADER_FIELD, FEI_PLEN)
        if rest == 0:
            if kind in (PduType.H2C_DATA, PduType.C2H_DATA):
                raise _Fatal(f"{kind.name} without data", Fes.INVALID_HEADER_FIELD, FEI_PLEN)
            return 0, hlen + hd
        dd = 4 if self.ddgst else 0
        if not hlen + hd <= pdo < plen - dd:
            raise _Fatal(f"{kind.name} with PDO {pdo}", Fes.INVALID_HEADER_FIELD, FEI_PDO)
        length = plen - pdo - dd
        if kind is PduType.CAPSULE_CMD and length > self.in_capsule:
            raise _Fatal(
                f"{length} bytes of in-capsule data (this queue takes {self.in_capsule})",
                Fes.DATA_LIMIT_EXCEEDED,
                FEI_PLEN,
            )
        if kind is PduType.H2C_DATA and length > self.maxh2cdata:
            raise _Fatal(
                f"H2CData of {length} bytes (MAXH2CDATA is {self.maxh2cdata})",
                Fes.DATA_LIMIT_EXCEEDED,
                FEI_PLEN,
            )
        return length, pdo

    def _parse_header(self) -> Event:
        kind, flags, hlen, _, plen = self._ch
        start = self._start
        if self._hd:
            (sent,) = _DIGEST.unpack_from(self._buf, start + hlen)
            if sent != crc32c.crc32c(self._view[start : start + hlen]):
                raise _Fatal(
                    f"{PduType(kind).name} header digest mismatch", Fes.HEADER_DIGEST_ERROR, hlen
                )
        psh = self._view[start : start + self._need]
        event = _PARSERS[PduType(kind)](self, psh, flags)
        self._start += self._need
        if self._pdu_data:
            self._ddgst = self.ddgst
            self._crc = 0
            self._rx = _Rx.DATA
            self._expect(self._pdu_data)
        else:
            self._rx = _Rx.HEAD
        return event

    def _parse_icreq(self, psh: memoryview, flags: int) -> Event:
        pfv, hpda, dgst, maxr2t = _IC.unpack_from(psh, CH.size)
        if pfv != 0:
            raise _Fatal(f"ICReq PFV {pfv}", Fes.UNSUPPORTED_PARAMETER, FEI_PFV)
        if hpda != 0:  # like Linux's target: no padding support
            raise _Fatal(f"ICReq HPDA {hpda}", Fes.UNSUPPORTED_PARAMETER, FEI_PDA)
        # DGST bits 7:2 and bytes 16..127 are reserved: ignored, as Linux and SPDK do.
        event = ICReq(bool(dgst & 1), bool(dgst & 2), maxr2t, hpda, pfv)
        self._asked = event
        self._rx_phase = _Phase.READY
        return event

    def _parse_icresp(self, psh: memoryview, flags: int) -> Event:
        pfv, cpda, dgst, maxh2cdata = _IC.unpack_from(psh, CH.size)
        asked = self._asked or ICReq()
        if pfv != 0:
            raise _Fatal(f"ICResp PFV {pfv}", Fes.UNSUPPORTED_PARAMETER, FEI_PFV)
        if cpda != 0:
            raise _Fatal(f"ICResp CPDA {cpda}", Fes.UNSUPPORTED_PARAMETER, FEI_PDA)
        dgst &= 0x3  # bits 7:2 are reserved
        if dgst != asked.hdgst | (asked.ddgst << 1):
            raise _Fatal(
                f"ICResp grants digests {dgst:#x}, not what was asked",
                Fes.UNSUPPORTED_PARAMETER,
                FEI_DGST,
            )
        if maxh2cdata % 4 or maxh2cdata < 4096:
            raise _Fatal(f"ICResp MAXH2CDATA {maxh2cdata}", Fes.UNSUPPORTED_PARAMETER, FEI_MAXDATA)
        self.hdgst, self.ddgst, self.maxh2cdata = bool(dgst & 1), bool(dgst & 2), maxh2cdata
        self._rx_phase = self._tx_phase = _Phase.READY
        return ICResp(self.hdgst, self.ddgst, maxh2cdata, cpda, pfv)

    def _parse_term(self, psh: memoryview, flags: int) -> Event:
        fes, fei = _TERM.unpack_from(psh, CH.size)
        cls = H2CTermReq if self.role is Role.TARGET else C2HTermReq
        self._rx_phase = _Phase.BROKEN  # nothing may follow a TermReq
        return cls(fes, fei, bytes(psh[_HLEN[PduType.H2C_TERM_REQ] :]))

    def _parse_cmd(self, psh: memoryview, flags: int) -> Event:
        command = Command.unpack(psh, CH.size)
        if command.cid in self._cmds:
            raise _Fatal(
                f"command id {command.cid} is already in progress",
                Fes.INVALID_HEADER_FIELD,
                FEI_SQE_CID,
            )
        if len(self._cmds) >= self.max_outstanding:
            raise _Fatal(
                f"more than {self.max_outstanding} commands in progress on one queue",
                Fes.SEQUENCE_ERROR,
                FEI_TYPE,
            )
        self._cmds[command.cid] = _Cmd(command.direction, command.sgl.transport_length)
        self._data_cid = command.cid
        return CapsuleCmd(command, self._pdu_data)

    def _parse_resp(self, psh: memoryview, flags: int) -> Event:
        completion = Completion.unpack(psh, CH.size)
        if self._cmds.pop(completion.cid, None) is None:
            raise _Fatal(
                f"completion of unknown command {completion.cid}",
                Fes.INVALID_HEADER_FIELD,
                FEI_CQE_CID,
            )
        return CapsuleResp(completion)

    def _parse_h2c(self, psh: memoryview, flags: int) -> Event:
        cccid, ttag, datao, datal = _DATA.unpack_from(psh, CH.size)
        cmd = self._cmds.get(cccid)
        if cmd is None:
            raise _Fatal(
                f"H2CData for unknown command {cccid}", Fes.INVALID_HEADER_FIELD, FEI_CCCID
            )
        window = cmd.r2t
        if window is None:
            raise _Fatal(
                f"H2CData for command {cccid} without an R2T", Fes.SEQUENCE_ERROR, FEI_TYPE
            )
        if ttag != window.ttag:
            raise _Fatal(
                f"H2CData with TTAG {ttag} (R2T gave {window.ttag})",
                Fes.INVALID_HEADER_FIELD,
                FEI_TTAG,
            )
        self._check_data(PduType.H2C_DATA, datao, datal, window.next, window.end)
        # The byte count, not LAST_PDU, says when the R2T's data is in (as Linux's target
        # and SPDK's count it): a host that sets the flag early or late moves the same bytes.
        last = datao + datal == window.end
        window.next += datal
        cmd.moved += datal
        if last:
            cmd.r2t = None
        self._data_cid = cccid
        return H2CData(cccid, ttag, datao, datal, last)

    def _parse_c2h(self, psh: memoryview, flags: int) -> Event:
        cccid, _, datao, datal = _DATA.unpack_from(psh, CH.size)
        cmd = self._cmds.get(cccid)
        if cmd is None or cmd.direction not in (Direction.TO_HOST, Direction.BOTH):
            raise _Fatal(
                f"C2HData for command {cccid}, which reads nothing",
                Fes.INVALID_HEADER_FIELD,
                FEI_CCCID,
            )
        if flags & FLAG_SUCCESS:  # only allowed with SQ flow control disabled, never asked for
            raise _Fatal("C2HData with the SUCCESS flag", Fes.INVALID_HEADER_FIELD, FEI_FLAGS)
        # LAST_PDU is informational here too: DATAO must continue the data and stay inside
        # the buffer whatever the flag said before.
        self._check_data(PduType.C2H_DATA, datao, datal, cmd.moved, cmd.length)
        cmd.moved += datal
        self._data_cid = cccid
        return C2HData(cccid, datao, datal, bool(flags & FLAG_LAST))

    def _check_data(self, kind: PduType, datao: int, datal: int, expected: int, end: int) -> None:
        """What H2CData and C2HData share: DATAL is the PDU's data, DATAO continues where the
        data stands, and the data fits the command (or R2T)."""
        if datal != self._pdu_data:
            raise _Fatal(
                f"{kind.name} DATAL {datal} but {self._pdu_data} data bytes",
                Fes.INVALID_HEADER_FIELD,
                FEI_DATAL,
            )
        if datao != expected:
            raise _Fatal(
                f"{kind.name} DATAO {datao}, expected {expected}",
                Fes.INVALID_HEADER_FIELD,
                FEI_DATAO,
            )
        if datao + datal > end:
            raise _Fatal(
                f"{kind.name} [{datao}, {datao + datal}) beyond the end at {end}",
                Fes.DATA_OUT_OF_RANGE,
                FEI_DATAO,
            )

    def _parse_r2t(self, psh: memoryview, flags: int) -> Event:
        cccid, ttag, r2to, r2tl = _DATA.unpack_from(psh, CH.size)
        cmd = self._cmds.get(cccid)
        if cmd is None or cmd.direction is not Direction.TO_CONTROLLER or not cmd.length:
            raise _Fatal(
                f"R2T for command {cccid}, which has no data to fetch",
                Fes.INVALID_HEADER_FIELD,
                FEI_CCCID,
            )
        if cmd.r2t is not None:
            raise _Fatal(
                f"a second R2T for command {cccid} (MAXR2T is 0)", Fes.DATA_LIMIT_EXCEEDED, FEI_TYPE
            )
        if r2tl == 0:
            raise _Fatal("R2T of 0 bytes", Fes.INVALID_HEADER_FIELD, FEI_DATAL)
        if r2to != cmd.moved:
            raise _Fatal(
                f"R2T R2TO {r2to}, {cmd.moved} bytes sent so far",
                Fes.INVALID_HEADER_FIELD,
                FEI_DATAO,
            )
        if r2to + r2tl > cmd.length:
            raise _Fatal(
                f"R2T [{r2to}, {r2to + r2tl}) beyond the command's {cmd.length} bytes",
                Fes.DATA_OUT_OF_RANGE,
                FEI_DATAO,
            )
        cmd.r2t = _R2TWindow(ttag, r2to + r2tl, r2to)
        return R2T(cccid, ttag, r2to, r2tl)

    # ------------------------------------------------------------------ data

    def _data_end(self, digest_ok: bool) -> DataEnd:
        allocated = self._payload_done()
        self._rx = _Rx.HEAD
        return DataEnd(self._data_cid, allocated if digest_ok else None, digest_ok)

    # ------------------------------------------------------------------ sending

    def send_parts(
        self, event: Event, data: Sequence[bytes | memoryview] = ()
    ) -> list[bytes | memoryview]:
        """The buffers that carry `event` and its `data` (referenced, not copied).

        Raises:
            LocalProtocolError: the PDU is not allowed now, or `data` does not match it.
        """
        kind = type(event)
        if kind not in _SENDABLE[self.role]:
            raise LocalProtocolError(f"a {self.role.value} cannot send {kind.__name__}")
        if self._tx_phase is _Phase.BROKEN and not isinstance(event, _TermReq):
            raise LocalProtocolError("the connection failed; only a TermReq may still be sent")
        views = [memoryview(d).cast("B") for d in data]
        views = [v for v in views if len(v)]
        length = sum(len(v) for v in views)
        psh, flags = _WRITERS[kind](self, event, length)
        ptype = event.TYPE
        assert ptype is not None
        hd = 4 if self.hdgst and ptype in _DIGESTED else 0
        dd = 4 if self.ddgst and length and ptype in _WITH_DATA else 0
        hlen = _HLEN[ptype]
        flags |= (FLAG_HDGST if hd else 0) | (FLAG_DDGST if dd else 0)
        pdo = hlen + hd if length and ptype in _WITH_DATA else 0
        # CH.size + len(psh) is HLEN, except for a TermReq, whose header carries the bad PDU.
        plen = CH.size + len(psh) + hd + length + dd
        header = CH.pack(ptype, flags, hlen, pdo, plen) + psh
        if hd:
            header += _DIGEST.pack(crc32c.crc32c(header))
        parts: list[bytes | memoryview] = [header, *views]
        if dd:
            parts.append(_DIGEST.pack(digest(views)))
        if isinstance(event, _TermReq):
            self._tx_phase = _Phase.BROKEN
        return parts

    def send(self, event: Event, data: Sequence[bytes | memoryview] = ()) -> bytes:
        """`send_parts` joined into one bytes object (copies the data)."""
        return b"".join(self.send_parts(event, data))

    def send_failed(self) -> None:
        """The transport failed while sending; nothing more may be sent."""
        self._tx_phase = _Phase.BROKEN

    def _write_icreq(self, event: ICReq, length: int) -> tuple[bytes, int]:
        if self._tx_phase is not _Phase.AWAIT_IC or self._asked is not None:
            raise LocalProtocolError("ICReq is sent once, first")
        self._asked = event
        dgst = event.hdgst | (event.ddgst << 1)
        return _IC.pack(event.pfv, event.hpda, dgst, event.maxr2t) + bytes(112), 0

    def _write_icresp(self, event: ICResp, length: int) -> tuple[bytes, int]:
        if self._asked is None or self._tx_phase is not _Phase.AWAIT_IC:
            raise LocalProtocolError("ICResp answers one ICReq")
        if event.maxh2cdata % 4 or event.maxh2cdata < 4096 or event.cpda:
            raise LocalProtocolError(f"unusable ICResp {event}")
        self.hdgst, self.ddgst, self.maxh2cdata = event.hdgst, event.ddgst, event.maxh2cdata
        self._tx_phase = _Phase.READY
        dgst = event.hdgst | (event.ddgst << 1)
        return _IC.pack(event.pfv, event.cpda, dgst, event.maxh2cdata) + bytes(112), 0

    def _write_term(self, event: _TermReq, length: int) -> tuple[bytes, int]:
        if length:
            raise LocalProtocolError("a TermReq's data is its `pdu` field")
        # The copied header is not PDU data in the digest sense: it rides in the header part.
        return _TERM.pack(event.fes, event.fei) + bytes(10) + event.pdu, 0

    def _write_cmd(self, event: CapsuleCmd, length: int) -> tuple[bytes, int]:
        self._ready()
        command = event.command
        if command.cid in self._cmds:
            raise LocalProtocolError(f"command id {command.cid} is already in progress")
        if length != event.data_length:
            raise LocalProtocolError(f"CapsuleCmd declares {event.data_length} bytes, got {length}")
        if length > self.in_capsule:
            raise LocalProtocolError(f"{length} bytes of in-capsule data exceed {self.in_capsule}")
        sgl = command.sgl
        if length and (sgl.type != SGL_IN_CAPSULE or sgl.length != length):
            raise LocalProtocolError("in-capsule data needs an in-capsule SGL of its length")
        self._cmds[command.cid] = _Cmd(
            command.direction, sgl.length if sgl.type == SGL_TRANSPORT else 0
        )
        return command.pack(), 0

    def _write_resp(self, event: CapsuleResp, length: int) -> tuple[bytes, int]:
        self._ready()
        cmd = self._cmds.get(event.completion.cid)
        if cmd is None:
            raise LocalProtocolError(f"no command {event.completion.cid} to complete")
        if cmd.r2t is not None:
            raise LocalProtocolError("a command is completed only after its R2T's data is in")
        del self._cmds[event.completion.cid]
        return event.completion.pack(), 0

    def _write_h2c(self, event: H2CData, length: int) -> tuple[bytes, int]:
        self._ready()
        cmd = self._cmds.get(event.cccid)
        window = cmd.r2t if cmd is not None else None
        if cmd is None or window is None or window.ttag != event.ttag:
            raise LocalProtocolError(f"no R2T {event.ttag} for command {event.cccid}")
        end = event.datao + event.datal
        if (
            length != event.datal
            or not length
            or length > self.maxh2cdata
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

    def _write_c2h(self, event: C2HData, length: int) -> tuple[bytes, int]:
        self._ready()
        cmd = self._cmds.get(event.cccid)
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

    def _write_r2t(self, event: R2T, length: int) -> tuple[bytes, int]:
        self._ready()
        cmd = self._cmds.get(event.cccid)
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

    def _ready(self) -> None:
        if self._tx_phase is not _Phase.READY:
            raise LocalProtocolError("the connection is not initialized (ICReq/ICResp) or failed")


_PARSERS: dict[PduType, Callable[[NvmeTcpConnection, memoryview, int], Event]] = {
    PduType.IC_REQ: NvmeTcpConnection._parse_icreq,
    PduType.IC_RESP: NvmeTcpConnection._parse_icresp,
    PduType.H2C_TERM_REQ: NvmeTcpConnection._parse_term,
    PduType.C2H_TERM_REQ: NvmeTcpConnection._parse_term,
    PduType.CAPSULE_CMD: NvmeTcpConnection._parse_cmd,
    PduType.CAPSULE_RESP: NvmeTcpConnection._parse_resp,
    PduType.H2C_DATA: NvmeTcpConnection._parse_h2c,
    PduType.C2H_DATA: NvmeTcpConnection._parse_c2h,
    PduType.R2T: NvmeTcpConnection._parse_r2t,
}
_WRITERS: dict[type[Event], Callable[[NvmeTcpConnection, object, int], tuple[bytes, int]]] = {
    ICReq: NvmeTcpConnection._write_icreq,  # type: ignore[dict-item]
    ICResp: NvmeTcpConnection._write_icresp,  # type: ignore[dict-item]
    H2CTermReq: NvmeTcpConnection._write_term,  # type: ignore[dict-item]
    C2HTermReq: NvmeTcpConnection._write_term,  # type: ignore[dict-item]
    CapsuleCmd: NvmeTcpConnection._write_cmd,  # type: ignore[dict-item]
    CapsuleResp: NvmeTcpConnection._write_resp,  # type: ignore[dict-item]
    H2CData: NvmeTcpConnection._write_h2c,  # type: ignore[dict-item]
    C2HData: NvmeTcpConnection._write_c2h,  # type: ignore[dict-item]
    R2T: NvmeTcpConnection._write_r2t,  # type: ignore[dict-item]
}
