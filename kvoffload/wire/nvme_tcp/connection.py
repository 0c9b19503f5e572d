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

The pieces, shaped like h11's: PDU layouts and events in `nvme_tcp_events`, the state tables
in `nvme_tcp_state`, readers and writers as tables in `nvme_tcp_readers` / `nvme_tcp_writers`;
`NvmeTcpConnection` here frames PDUs and wires them together. Every name is re-exported here.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import ClassVar

import crc32c

from kvoffload.errors import LocalProtocolError, RemoteProtocolError
from kvoffload.wire.nvme_tcp.events import (
    _ALLOWED_FLAGS,
    _DIGEST,
    _DIGESTED,
    _HLEN,
    _TERM_MAX_COPY,
    _TERM_TYPES,
    _WITH_DATA,
    ADMIN_IN_CAPSULE,
    CH,
    FEI_CCCID,
    FEI_CQE_CID,
    FEI_DATAL,
    FEI_DATAO,
    FEI_DGST,
    FEI_FLAGS,
    FEI_HLEN,
    FEI_MAXDATA,
    FEI_PDA,
    FEI_PDO,
    FEI_PFV,
    FEI_PLEN,
    FEI_SQE_CID,
    FEI_TTAG,
    FEI_TYPE,
    FLAG_DDGST,
    FLAG_HDGST,
    FLAG_LAST,
    FLAG_SUCCESS,
    NEED_DATA,
    R2T,
    C2HData,
    C2HTermReq,
    CapsuleCmd,
    CapsuleResp,
    ConnectionClosed,
    DataEnd,
    Event,
    Fes,
    H2CData,
    H2CTermReq,
    ICReq,
    ICResp,
    PduError,
    PduType,
    SinkFull,
    _Fatal,
    _NeedData,
    _TermReq,
    digest,
)
from kvoffload.wire.nvme_tcp.readers import PARSERS, check_lengths
from kvoffload.wire.nvme_tcp.state import (
    _NOW,
    _ON_RECEIVE,
    _ON_SEND,
    _RECEIVABLE,
    _SENDABLE,
    Role,
    _Cmd,
    _Phase,
)
from kvoffload.wire.nvme_tcp.writers import WRITERS
from kvoffload.wire.rxbuffer import ReceiveBuffer

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
    "NvmeTcpConnection",
    "PduError",
    "PduType",
    "R2T",
    "Role",
    "SinkFull",
    "digest",
]


class _Rx(enum.Enum):
    HEAD = "common header"
    HEADER = "PDU header"
    DATA = "data"  # whether a sink is chosen is the ReceiveBuffer's business
    DIGEST = "data digest"


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
        ReceiveBuffer.__init__(self)
        self.role = role
        self.in_capsule = in_capsule
        self.max_outstanding = max_outstanding
        self.maxh2cdata = maxh2cdata
        self.hdgst = False
        self.ddgst = False
        self._asked: ICReq | None = None  # host: what it asked for; target: what it was asked
        self._rx_phase = _Phase.AWAIT_IC
        self._tx_phase = _Phase.AWAIT_IC
        self._cmds: dict[int, _Cmd] = {}
        self._pdu_data = 0  # data bytes the PDU being received declares
        self._data_cid = 0  # the command the data being received belongs to
        self._error: RemoteProtocolError | None = None
        self._eof = False
        self._rx = _Rx.HEAD
        self._ch: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)
        self._need = 0  # header bytes (from the PDU start) to have before parsing
        self._hd = 0  # header digest bytes of the current PDU
        self._ddgst = False
        self._crc = 0

    def _enter(self, phases: tuple[_Phase | None, _Phase | None]) -> None:
        """Move to the phases a row of `_ON_RECEIVE` / `_ON_SEND` gives."""
        rx, tx = phases
        if rx is not None:
            self._rx_phase = rx
        if tx is not None:
            self._tx_phase = tx

    def _ready(self) -> None:
        if self._tx_phase is not _Phase.READY:
            raise LocalProtocolError("the connection is not initialized (ICReq/ICResp) or failed")

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
            self._pdu_data, self._need = check_lengths(self, kind, hlen, pdo, plen, hd)
        self._ch = (kind, flags, hlen, pdo, plen)
        self._rx = _Rx.HEADER

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
        ptype = PduType(kind)
        event = PARSERS[ptype](self, psh, flags)
        phases = _ON_RECEIVE.get(ptype)
        if phases is not None:
            self._enter(phases)
        self._start += self._need
        if self._pdu_data:
            self._ddgst = self.ddgst
            self._crc = 0
            self._rx = _Rx.DATA
            self._expect(self._pdu_data)
        else:
            self._rx = _Rx.HEAD
        return event

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
        psh, flags = WRITERS[kind](self, event, length)
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
        phases = _ON_SEND.get(ptype)
        if phases is not None:
            self._enter(phases)
        return parts

    def send(self, event: Event, data: Sequence[bytes | memoryview] = ()) -> bytes:
        """`send_parts` joined into one bytes object (copies the data)."""
        return b"".join(self.send_parts(event, data))

    def send_failed(self) -> None:
        """The transport failed while sending; nothing more may be sent."""
        self._tx_phase = _Phase.BROKEN
