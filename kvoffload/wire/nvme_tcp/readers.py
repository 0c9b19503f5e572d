"""NVMe/TCP readers: a received PDU header, checked against the queue's state, to its event.

`PARSERS` dispatches on the PDU type; each reader raises `_Fatal` (which the connection turns
into `PduError`) for what the peer may not send, and records what the PDU changes.
"""

from __future__ import annotations

from collections.abc import Callable

from kvoffload.wire.nvme_tcp.cmd import Command, Completion, Direction
from kvoffload.wire.nvme_tcp.events import (
    _DATA,
    _HLEN,
    _IC,
    _TERM,
    _WITH_DATA,
    CH,
    FEI_CCCID,
    FEI_CQE_CID,
    FEI_DATAL,
    FEI_DATAO,
    FEI_DGST,
    FEI_FLAGS,
    FEI_MAXDATA,
    FEI_PDA,
    FEI_PDO,
    FEI_PFV,
    FEI_PLEN,
    FEI_SQE_CID,
    FEI_TTAG,
    FEI_TYPE,
    FLAG_LAST,
    FLAG_SUCCESS,
    R2T,
    C2HData,
    C2HTermReq,
    CapsuleCmd,
    CapsuleResp,
    Event,
    Fes,
    H2CData,
    H2CTermReq,
    ICReq,
    ICResp,
    PduType,
    _Fatal,
)
from kvoffload.wire.nvme_tcp.state import QueueState, Role, _Cmd, _R2TWindow

__all__ = ["PARSERS", "check_lengths"]


def check_lengths(
    st: QueueState, kind: PduType, hlen: int, pdo: int, plen: int, hd: int
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
    dd = 4 if st.ddgst else 0
    if not hlen + hd <= pdo < plen - dd:
        raise _Fatal(f"{kind.name} with PDO {pdo}", Fes.INVALID_HEADER_FIELD, FEI_PDO)
    length = plen - pdo - dd
    if kind is PduType.CAPSULE_CMD and length > st.in_capsule:
        raise _Fatal(
            f"{length} bytes of in-capsule data (this queue takes {st.in_capsule})",
            Fes.DATA_LIMIT_EXCEEDED,
            FEI_PLEN,
        )
    if kind is PduType.H2C_DATA and length > st.maxh2cdata:
        raise _Fatal(
            f"H2CData of {length} bytes (MAXH2CDATA is {st.maxh2cdata})",
            Fes.DATA_LIMIT_EXCEEDED,
            FEI_PLEN,
        )
    return length, pdo


def read_icreq(st: QueueState, psh: memoryview, flags: int) -> Event:
    pfv, hpda, dgst, maxr2t = _IC.unpack_from(psh, CH.size)
    if pfv != 0:
        raise _Fatal(f"ICReq PFV {pfv}", Fes.UNSUPPORTED_PARAMETER, FEI_PFV)
    if hpda != 0:  # like Linux's target: no padding support
        raise _Fatal(f"ICReq HPDA {hpda}", Fes.UNSUPPORTED_PARAMETER, FEI_PDA)
    # DGST bits 7:2 and bytes 16..127 are reserved: ignored, as Linux and SPDK do.
    event = ICReq(bool(dgst & 1), bool(dgst & 2), maxr2t, hpda, pfv)
    st._asked = event
    return event


def read_icresp(st: QueueState, psh: memoryview, flags: int) -> Event:
    pfv, cpda, dgst, maxh2cdata = _IC.unpack_from(psh, CH.size)
    asked = st._asked or ICReq()
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
    st.hdgst, st.ddgst, st.maxh2cdata = bool(dgst & 1), bool(dgst & 2), maxh2cdata
    return ICResp(st.hdgst, st.ddgst, maxh2cdata, cpda, pfv)


def read_term(st: QueueState, psh: memoryview, flags: int) -> Event:
    fes, fei = _TERM.unpack_from(psh, CH.size)
    cls = H2CTermReq if st.role is Role.TARGET else C2HTermReq
    return cls(fes, fei, bytes(psh[_HLEN[PduType.H2C_TERM_REQ] :]))


def read_cmd(st: QueueState, psh: memoryview, flags: int) -> Event:
    command = Command.unpack(psh, CH.size)
    if command.cid in st._cmds:
        raise _Fatal(
            f"command id {command.cid} is already in progress",
            Fes.INVALID_HEADER_FIELD,
            FEI_SQE_CID,
        )
    if len(st._cmds) >= st.max_outstanding:
        raise _Fatal(
            f"more than {st.max_outstanding} commands in progress on one queue",
            Fes.SEQUENCE_ERROR,
            FEI_TYPE,
        )
    st._cmds[command.cid] = _Cmd(command.direction, command.sgl.transport_length)
    st._data_cid = command.cid
    return CapsuleCmd(command, st._pdu_data)


def read_resp(st: QueueState, psh: memoryview, flags: int) -> Event:
    completion = Completion.unpack(psh, CH.size)
    if st._cmds.pop(completion.cid, None) is None:
        raise _Fatal(
            f"completion of unknown command {completion.cid}",
            Fes.INVALID_HEADER_FIELD,
            FEI_CQE_CID,
        )
    return CapsuleResp(completion)


def read_h2c(st: QueueState, psh: memoryview, flags: int) -> Event:
    cccid, ttag, datao, datal = _DATA.unpack_from(psh, CH.size)
    cmd = st._cmds.get(cccid)
    if cmd is None:
        raise _Fatal(f"H2CData for unknown command {cccid}", Fes.INVALID_HEADER_FIELD, FEI_CCCID)
    window = cmd.r2t
    if window is None:
        raise _Fatal(f"H2CData for command {cccid} without an R2T", Fes.SEQUENCE_ERROR, FEI_TYPE)
    if ttag != window.ttag:
        raise _Fatal(
            f"H2CData with TTAG {ttag} (R2T gave {window.ttag})",
            Fes.INVALID_HEADER_FIELD,
            FEI_TTAG,
        )
    _check_data(st, PduType.H2C_DATA, datao, datal, window.next, window.end)
    # The byte count, not LAST_PDU, says when the R2T's data is in (as Linux's target
    # and SPDK's count it): a host that sets the flag early or late moves the same bytes.
    last = datao + datal == window.end
    window.next += datal
    cmd.moved += datal
    if last:
        cmd.r2t = None
    st._data_cid = cccid
    return H2CData(cccid, ttag, datao, datal, last)


def read_c2h(st: QueueState, psh: memoryview, flags: int) -> Event:
    cccid, _, datao, datal = _DATA.unpack_from(psh, CH.size)
    cmd = st._cmds.get(cccid)
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
    _check_data(st, PduType.C2H_DATA, datao, datal, cmd.moved, cmd.length)
    cmd.moved += datal
    st._data_cid = cccid
    return C2HData(cccid, datao, datal, bool(flags & FLAG_LAST))


def _check_data(
    st: QueueState, kind: PduType, datao: int, datal: int, expected: int, end: int
) -> None:
    """What H2CData and C2HData share: DATAL is the PDU's data, DATAO continues where the
    data stands, and the data fits the command (or R2T)."""
    if datal != st._pdu_data:
        raise _Fatal(
            f"{kind.name} DATAL {datal} but {st._pdu_data} data bytes",
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


def read_r2t(st: QueueState, psh: memoryview, flags: int) -> Event:
    cccid, ttag, r2to, r2tl = _DATA.unpack_from(psh, CH.size)
    cmd = st._cmds.get(cccid)
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


# PDU type -> reader of its header (`psh`: the whole header as received, `flags`: its
# defined FLAGS bits).
PARSERS: dict[PduType, Callable[[QueueState, memoryview, int], Event]] = {
    PduType.IC_REQ: read_icreq,
    PduType.IC_RESP: read_icresp,
    PduType.H2C_TERM_REQ: read_term,
    PduType.C2H_TERM_REQ: read_term,
    PduType.CAPSULE_CMD: read_cmd,
    PduType.CAPSULE_RESP: read_resp,
    PduType.H2C_DATA: read_h2c,
    PduType.C2H_DATA: read_c2h,
    PduType.R2T: read_r2t,
}
