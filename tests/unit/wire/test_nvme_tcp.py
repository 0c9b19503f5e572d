"""The NVMe/TCP PDU codec without sockets: a host and a target codec passing bytes."""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.errors import LocalProtocolError, RemoteProtocolError
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
    Event,
    Fes,
    H2CData,
    H2CTermReq,
    ICReq,
    ICResp,
    NvmeTcpConnection,
    PduError,
    Role,
    SinkFull,
    digest,
)

KEY = bytes(range(16))
CONNECT_DATA = bytes(range(256)) * 4
VALUE = os.urandom(10_000)
IDENTIFY = os.urandom(4096)


def _drain(conn: NvmeTcpConnection) -> list[Event]:
    out: list[Event] = []
    while (event := conn.next_event()) is not NEED_DATA:
        assert isinstance(event, Event)
        out.append(event)
        if isinstance(event, ConnectionClosed):
            break
    return out


def _pair(digests: bool = False, **target: int) -> tuple[NvmeTcpConnection, NvmeTcpConnection]:
    """A host and a target past ICReq/ICResp."""
    host = NvmeTcpConnection(Role.HOST)
    tgt = NvmeTcpConnection(Role.TARGET, **target)
    tgt.receive_data(host.send(ICReq(digests, digests)))
    (req,) = _drain(tgt)
    assert req == ICReq(digests, digests)
    host.receive_data(tgt.send(ICResp(digests, digests, 8192)))
    assert _drain(host) == [ICResp(digests, digests, 8192)]
    return host, tgt


def _host_stream(host: NvmeTcpConnection) -> bytes:
    """What a host sends in a session: Connect with data, Identify, Store via R2T data."""
    out = host.send(CapsuleCmd(nc.connect(1, 0, 31, 15000), len(CONNECT_DATA)), [CONNECT_DATA])
    out += host.send(CapsuleCmd(nc.identify(2, 1)))
    out += host.send(CapsuleCmd(nc.kv_store(3, 1, KEY, len(VALUE), in_capsule=False)))
    return out


def _target_answers(tgt: NvmeTcpConnection) -> bytes:
    out = tgt.send(CapsuleResp(Completion(1, dw0=7)))
    out += tgt.send(C2HData(2, 0, 1000), [IDENTIFY[:1000]])
    out += tgt.send(C2HData(2, 1000, 3096, last=True), [IDENTIFY[1000:]])
    out += tgt.send(CapsuleResp(Completion(2)))
    out += tgt.send(R2T(3, 9, 0, len(VALUE)))
    return out


def _h2c(host: NvmeTcpConnection) -> bytes:
    return host.send(H2CData(3, 9, 0, 8192), [VALUE[:8192]]) + host.send(
        H2CData(3, 9, 8192, len(VALUE) - 8192, last=True), [VALUE[8192:]]
    )


def _collect(events: Sequence[Event]) -> list[object]:
    """Events with allocated data turned into bytes, for comparisons."""
    out: list[object] = []
    for e in events:
        if isinstance(e, DataEnd):
            out.append(("end", e.cid, None if e.data is None else bytes(e.data), e.digest_ok))
        else:
            out.append(e)
    return out


def _session(
    digests: bool, feed: Callable[[NvmeTcpConnection, bytes], list[Event]]
) -> list[object]:
    host, tgt = _pair(digests)
    events = feed(tgt, _host_stream(host))
    events += feed(host, _target_answers(tgt))
    events += feed(tgt, _h2c(host))
    events += feed(host, tgt.send(CapsuleResp(Completion(3))))
    return _collect(events)


def _whole(conn: NvmeTcpConnection, data: bytes) -> list[Event]:
    conn.receive_data(data)
    return _drain(conn)


def _bytewise(conn: NvmeTcpConnection, data: bytes) -> list[Event]:
    out: list[Event] = []
    for i in range(len(data)):
        conn.receive_data(data[i : i + 1])
        out += _drain(conn)
    return out


def test_crc32c_is_castagnoli() -> None:
    assert digest([b"123456789"]) == 0xE3069283
    assert digest([b"1234", memoryview(b"56789")]) == 0xE3069283


@pytest.mark.parametrize("digests", [False, True])
def test_session_round_trips_every_exchange(digests: bool) -> None:
    events = _session(digests, _whole)
    assert events == [
        CapsuleCmd(nc.connect(1, 0, 31, 15000), 1024),
        ("end", 1, CONNECT_DATA, True),
        CapsuleCmd(nc.identify(2, 1)),
        CapsuleCmd(nc.kv_store(3, 1, KEY, len(VALUE), in_capsule=False)),
        CapsuleResp(Completion(1, dw0=7)),
        C2HData(2, 0, 1000),
        ("end", 2, IDENTIFY[:1000], True),
        C2HData(2, 1000, 3096, last=True),
        ("end", 2, IDENTIFY[1000:], True),
        CapsuleResp(Completion(2)),
        R2T(3, 9, 0, len(VALUE)),
        H2CData(3, 9, 0, 8192),
        ("end", 3, VALUE[:8192], True),
        H2CData(3, 9, 8192, len(VALUE) - 8192, last=True),
        ("end", 3, VALUE[8192:], True),
        CapsuleResp(Completion(3)),
    ]


@pytest.mark.parametrize("digests", [False, True])
def test_byte_at_a_time_gives_the_same_events(digests: bool) -> None:
    assert _session(digests, _bytewise) == _session(digests, _whole)


@given(st.lists(st.integers(1, 3000), min_size=1, max_size=50), st.booleans())
def test_any_chunking_gives_the_same_events(cuts: list[int], digests: bool) -> None:
    def chunked(conn: NvmeTcpConnection, data: bytes) -> list[Event]:
        out: list[Event] = []
        pos, i = 0, 0
        while pos < len(data):
            n = cuts[i % len(cuts)]
            conn.receive_data(data[pos : pos + n])
            out += _drain(conn)
            pos, i = pos + n, i + 1
        return out

    assert _session(digests, chunked) == _session(digests, _whole)


def test_wire_layout_of_a_capsule_with_digests() -> None:
    host, _ = _pair(True)
    cmd = nc.kv_store(5, 1, KEY, 4, in_capsule=True)
    raw = host.send(CapsuleCmd(cmd, 4), [b"abcd"])
    ptype, flags, hlen, pdo, plen = struct.unpack_from("<BBBBI", raw)
    assert (ptype, flags, hlen, pdo, plen) == (4, 0x3, 72, 76, 72 + 4 + 4 + 4)
    assert raw[8:72] == cmd.pack()
    assert struct.unpack_from("<I", raw, 72)[0] == digest([raw[:72]])  # HDGST covers [0, HLEN)
    assert raw[76:80] == b"abcd"
    assert struct.unpack_from("<I", raw, 80)[0] == digest([b"abcd"])  # DDGST covers the data


def test_icreq_and_icresp_layout() -> None:
    host = NvmeTcpConnection(Role.HOST)
    raw = host.send(ICReq(True, False, maxr2t=3))
    assert len(raw) == 128 and raw[:8] == struct.pack("<BBBBI", 0, 0, 128, 0, 128)
    assert struct.unpack_from("<HBBI", raw, 8) == (0, 0, 1, 3)
    tgt = NvmeTcpConnection(Role.TARGET)
    tgt.receive_data(raw)
    _drain(tgt)
    raw = tgt.send(ICResp(True, False, 1 << 20))
    assert struct.unpack_from("<BBBBIHBBI", raw) == (1, 0, 128, 0, 128, 0, 0, 1, 1 << 20)


def test_sinks_receive_in_place_in_parts() -> None:
    host, tgt = _pair(True)
    tgt.receive_data(
        host.send(CapsuleCmd(nc.kv_store(3, 1, KEY, 100, in_capsule=True), 100), [VALUE[:100]])
    )
    (cmd,) = [tgt.next_event()]
    assert isinstance(cmd, CapsuleCmd) and cmd.data_length == 100
    head, tail = bytearray(10), bytearray(90)
    tgt.set_data_sink([memoryview(head)])
    assert tgt.next_event() == SinkFull(3, 90)
    tgt.set_data_sink([memoryview(tail)[:40], memoryview(tail)[40:]])
    assert tgt.next_event() == DataEnd(3, None, True)
    assert bytes(head + tail) == VALUE[:100]


def test_direct_receive_lands_in_the_sink() -> None:
    host, tgt = _pair()
    raw = host.send(CapsuleCmd(nc.kv_store(3, 1, KEY, 5000, in_capsule=True), 5000), [VALUE[:5000]])
    tgt.receive_data(raw[:72])  # the header only
    assert isinstance(tgt.next_event(), CapsuleCmd)
    sink = bytearray(5000)
    tgt.set_data_sink([memoryview(sink)])
    memory = tgt.get_buffer()
    assert memory.obj is sink  # recv_into would write straight into the destination
    memory[:5000] = raw[72:]
    tgt.buffer_updated(5000)
    assert tgt.next_event() == DataEnd(3, None, True) and sink == VALUE[:5000]


def test_a_bad_data_digest_fails_only_the_data() -> None:
    host, tgt = _pair(True)
    raw = bytearray(
        host.send(CapsuleCmd(nc.kv_store(3, 1, KEY, 8, in_capsule=True), 8), [b"12345678"])
    )
    raw[80] ^= 0xFF  # inside the data, not the header
    tgt.receive_data(bytes(raw))
    events = _drain(tgt)
    assert events[1] == DataEnd(3, None, False)
    tgt.receive_data(host.send(CapsuleCmd(nc.kv_exist(4, 1, KEY))))
    assert isinstance(tgt.next_event(), CapsuleCmd)  # the connection carries on


def test_discarded_data_is_consumed() -> None:
    host, tgt = _pair(True)
    tgt.receive_data(
        host.send(CapsuleCmd(nc.kv_store(3, 1, KEY, 300, in_capsule=True), 300), [VALUE[:300]])
    )
    assert isinstance(tgt.next_event(), CapsuleCmd)
    tgt.discard_data()
    assert tgt.next_event() == DataEnd(3, None, True)
    assert tgt.next_event() is NEED_DATA and tgt.at_boundary


def test_eof() -> None:
    host, tgt = _pair()
    tgt.receive_data(b"")
    assert tgt.next_event() == ConnectionClosed()
    host, tgt = _pair()
    tgt.receive_data(host.send(CapsuleCmd(nc.kv_exist(1, 1, KEY)))[:30])
    tgt.receive_eof()
    with pytest.raises(RemoteProtocolError, match="middle of a PDU") as info:
        tgt.next_event()
    assert not isinstance(info.value, PduError)


def test_term_req_round_trip_and_nothing_after_it() -> None:
    host, tgt = _pair()
    raw = tgt.send(C2HTermReq(Fes.HEADER_DIGEST_ERROR, 24, b"\x04" * 28))
    assert struct.unpack_from("<BBBBI", raw) == (3, 0, 24, 0, 24 + 28)
    host.receive_data(raw)
    assert _drain(host) == [C2HTermReq(Fes.HEADER_DIGEST_ERROR, 24, b"\x04" * 28)]
    with pytest.raises(LocalProtocolError):
        tgt.send(CapsuleResp(Completion(1)))
    host, tgt = _pair()
    tgt.receive_data(host.send(H2CTermReq(Fes.INVALID_HEADER_FIELD, 2, b"x" * 8)))
    assert tgt.next_event() == H2CTermReq(Fes.INVALID_HEADER_FIELD, 2, b"x" * 8)
    tgt.receive_data(_cmd_pdu(nc.kv_exist(1, 1, KEY)))
    with pytest.raises(PduError):  # nothing may follow a TermReq
        tgt.next_event()


# ---------------------------------------------------------------------------- fatal errors


def _ch(ptype: int, flags: int, hlen: int, pdo: int, plen: int) -> bytes:
    return struct.pack("<BBBBI", ptype, flags, hlen, pdo, plen)


def _target_error(
    data: bytes, digests: bool = False, ready: bool = True, **limits: int
) -> PduError:
    if ready:
        _, tgt = _pair(digests, **limits)
    else:
        tgt = NvmeTcpConnection(Role.TARGET, **limits)
    tgt.receive_data(data)
    with pytest.raises(PduError) as info:
        _drain(tgt)
    with pytest.raises(PduError):  # and it stays broken
        tgt.next_event()
    return info.value


def _cmd_pdu(cmd: Command, data: bytes = b"") -> bytes:
    host, _ = _pair()
    host.in_capsule = 1 << 30
    return host.send(CapsuleCmd(cmd, len(data)), [data] if data else [])


STORE_R2T = nc.kv_store(3, 1, KEY, 100, in_capsule=False)


@pytest.mark.parametrize(
    ("name", "data", "fes", "fei"),
    [
        ("type a target never receives", _ch(7, 0, 24, 0, 24), Fes.INVALID_HEADER_FIELD, 0),
        ("unknown type", _ch(0x42, 0, 24, 0, 24), Fes.INVALID_HEADER_FIELD, 0),
        ("second ICReq", _ch(0, 0, 128, 0, 128) + bytes(120), Fes.SEQUENCE_ERROR, 0),
        ("wrong HLEN", _ch(4, 0, 64, 0, 64), Fes.INVALID_HEADER_FIELD, 2),
        # A digest nobody negotiated: its 4 bytes are data that starts inside the header.
        ("data at PDO 0", _ch(4, 1, 72, 0, 76), Fes.INVALID_HEADER_FIELD, 3),
        ("PLEN shorter than the header", _ch(4, 0, 72, 0, 40), Fes.INVALID_HEADER_FIELD, 4),
        ("PDO inside the header", _ch(4, 0, 72, 64, 100), Fes.INVALID_HEADER_FIELD, 3),
        ("PDO at the end of the PDU", _ch(4, 0, 72, 100, 100), Fes.INVALID_HEADER_FIELD, 3),
        ("PDO past the end of the PDU", _ch(4, 0, 72, 200, 100), Fes.INVALID_HEADER_FIELD, 3),
        ("H2CData with no data", _ch(6, 4, 24, 24, 24), Fes.INVALID_HEADER_FIELD, 4),
        ("R2T from a host", _ch(9, 0, 24, 0, 24), Fes.INVALID_HEADER_FIELD, 0),
        ("TermReq shorter than its header", _ch(2, 0, 24, 0, 20), Fes.INVALID_HEADER_FIELD, 4),
        (
            "in-capsule data over the limit",
            _ch(4, 0, 72, 72, 72 + 8193),
            Fes.DATA_LIMIT_EXCEEDED,
            4,
        ),
        ("H2CData over MAXH2CDATA", _ch(6, 4, 24, 24, 24 + 8193), Fes.DATA_LIMIT_EXCEEDED, 4),
        ("TermReq too long", _ch(2, 0, 24, 0, 24 + 129), Fes.INVALID_HEADER_FIELD, 4),
        (
            "H2CData without an R2T",
            _cmd_pdu(STORE_R2T)
            + _ch(6, 4, 24, 24, 124)
            + struct.pack("<HHII4x", 3, 1, 0, 100)
            + bytes(100),
            Fes.SEQUENCE_ERROR,
            0,
        ),
        (
            "H2CData for an unknown command",
            _ch(6, 4, 24, 24, 124) + struct.pack("<HHII4x", 3, 1, 0, 100) + bytes(100),
            Fes.INVALID_HEADER_FIELD,
            8,
        ),
        (
            "a command id already in progress",
            _cmd_pdu(nc.kv_exist(5, 1, KEY)) + _cmd_pdu(nc.kv_exist(5, 1, KEY)),
            Fes.INVALID_HEADER_FIELD,
            10,
        ),
    ],
)
def test_target_refuses_bad_pdus(name: str, data: bytes, fes: Fes, fei: int) -> None:
    error = _target_error(data)
    assert (error.fes, error.fei) == (fes, fei), name
    assert 0 < len(error.pdu) <= 128  # the offending header, for the C2HTermReq


@pytest.mark.parametrize(
    ("name", "icreq", "fes", "fei"),
    [
        ("PFV", struct.pack("<HBBI", 1, 0, 0, 0), Fes.UNSUPPORTED_PARAMETER, 8),
        ("HPDA", struct.pack("<HBBI", 0, 3, 0, 0), Fes.UNSUPPORTED_PARAMETER, 10),
    ],
)
def test_target_refuses_bad_icreq(name: str, icreq: bytes, fes: Fes, fei: int) -> None:
    error = _target_error(_ch(0, 0, 128, 0, 128) + icreq + bytes(112), ready=False)
    assert (error.fes, error.fei) == (fes, fei), name


def test_anything_before_icreq_is_out_of_sequence() -> None:
    error = _target_error(_cmd_pdu(nc.kv_exist(1, 1, KEY)), ready=False)
    assert error.fes == Fes.SEQUENCE_ERROR


def test_a_bad_header_digest_is_fatal() -> None:
    host, tgt = _pair(True)
    raw = bytearray(host.send(CapsuleCmd(nc.kv_exist(1, 1, KEY))))
    raw[20] ^= 1
    tgt.receive_data(bytes(raw))
    with pytest.raises(PduError) as info:
        tgt.next_event()
    assert (info.value.fes, info.value.fei) == (Fes.HEADER_DIGEST_ERROR, 72)
    assert info.value.pdu == bytes(raw[:76])


def test_missing_digests_once_negotiated_are_fatal() -> None:
    # The negotiated digests decide the framing (the flags do not): a capsule without its
    # digest is 4 bytes short of its header.
    plain, _ = _pair(False)
    error = _target_error(plain.send(CapsuleCmd(nc.kv_exist(1, 1, KEY))), digests=True)
    assert (error.fes, error.fei) == (Fes.INVALID_HEADER_FIELD, 4)


def _r2t_pair() -> tuple[NvmeTcpConnection, NvmeTcpConnection]:
    host, tgt = _pair(maxh2cdata=4096)
    tgt.receive_data(host.send(CapsuleCmd(STORE_R2T)))
    _drain(tgt)
    host.receive_data(tgt.send(R2T(3, 7, 0, 100)))
    _drain(host)
    return host, tgt


def _h2c_pdu(
    ttag: int, datao: int, datal: int, flags: int = 4, payload: int | None = None
) -> bytes:
    n = datal if payload is None else payload
    return _ch(6, flags, 24, 24, 24 + n) + struct.pack("<HHII4x", 3, ttag, datao, datal) + bytes(n)


@pytest.mark.parametrize(
    ("name", "pdu", "fes", "fei"),
    [
        ("wrong TTAG", _h2c_pdu(8, 0, 100), Fes.INVALID_HEADER_FIELD, 10),
        (
            "DATAL disagrees with PLEN",
            _h2c_pdu(7, 0, 90, payload=100),
            Fes.INVALID_HEADER_FIELD,
            16,
        ),
        ("DATAO not where the data stands", _h2c_pdu(7, 10, 90), Fes.INVALID_HEADER_FIELD, 12),
        ("beyond the R2T", _h2c_pdu(7, 0, 120), Fes.DATA_OUT_OF_RANGE, 12),
        (
            "PDO inside the header",
            _h2c_pdu(7, 0, 100)[:3] + b"\x10" + _h2c_pdu(7, 0, 100)[4:],
            Fes.INVALID_HEADER_FIELD,
            3,
        ),  # fmt: skip
    ],
)
def test_h2c_data_must_follow_its_r2t(name: str, pdu: bytes, fes: Fes, fei: int) -> None:
    _, tgt = _r2t_pair()
    tgt.receive_data(pdu)
    with pytest.raises(PduError) as info:
        _drain(tgt)
    assert (info.value.fes, info.value.fei) == (fes, fei), name


# ------------------------------------------------------------------ liberal in what we accept
# Fields that Linux's nvmet and SPDK's target ignore are ignored here too (reserved bits,
# FLAGS bits a PDU type does not define, PDO when no data follows); only what breaks the
# framing is refused (above).


def _with(pdu: bytes, *, flags: int | None = None, pdo: int | None = None) -> bytes:
    """`pdu` with its common header's FLAGS and/or PDO replaced."""
    raw = bytearray(pdu)
    if flags is not None:
        raw[1] = flags
    if pdo is not None:
        raw[3] = pdo
    return bytes(raw)


EXIST = nc.kv_exist(5, 1, KEY)


@pytest.mark.parametrize(
    ("name", "pdu"),
    [
        # What the independent host sent: PDO = 72 on a capsule with no data.
        ("PDO set on a capsule without data", _with(_cmd_pdu(EXIST), pdo=72)),
        ("PDO 255 on a capsule without data", _with(_cmd_pdu(EXIST), pdo=255)),
        ("FLAGS bits CapsuleCmd does not define", _with(_cmd_pdu(EXIST), flags=0xF4)),
        ("a header digest flag nobody negotiated", _with(_cmd_pdu(EXIST), flags=0x01)),
        ("a data digest flag with no data", _with(_cmd_pdu(EXIST), flags=0x02)),
    ],
)
def test_target_accepts_ignored_fields_of_a_capsule(name: str, pdu: bytes) -> None:
    _, tgt = _pair()
    tgt.receive_data(pdu)
    assert _drain(tgt) == [CapsuleCmd(EXIST, 0)], name


@given(st.integers(0, 255), st.integers(0, 255), st.booleans())
def test_flags_and_pdo_never_matter_without_data(flags: int, pdo: int, digests: bool) -> None:
    host, tgt = _pair(digests)
    raw = bytearray(host.send(CapsuleCmd(EXIST)))
    raw[1], raw[3] = flags, pdo
    if digests:  # the sender's header digest covers its own FLAGS and PDO
        raw[72:76] = struct.pack("<I", digest([bytes(raw[:72])]))
    tgt.receive_data(bytes(raw))
    assert _drain(tgt) == [CapsuleCmd(EXIST, 0)]


def test_target_accepts_the_failing_hosts_admin_sequence() -> None:
    # Property Set and Identify, each with PDO = 72 and no data, then one with in-capsule data
    # (PDO = 72 is right there), all after an ICReq whose reserved fields are not zero.
    tgt = NvmeTcpConnection(Role.TARGET)
    icreq = bytearray(_ch(0, 0xF0, 128, 0x48, 128) + struct.pack("<HBBI", 0, 0, 0xFC, 0x400000))
    icreq += b"\xff" * 112
    tgt.receive_data(bytes(icreq))
    assert _drain(tgt) == [ICReq(maxr2t=0x400000)]
    tgt.send(ICResp())
    prop = nc.property_set(1, 0x14, 0x460001)
    ident = nc.identify(2, 1)
    tgt.receive_data(_with(_cmd_pdu(prop), pdo=72) + _with(_cmd_pdu(ident), pdo=72))
    tgt.receive_data(_cmd_pdu(nc.kv_store(3, 1, KEY, 4, in_capsule=True), b"abcd"))
    assert _collect(_drain(tgt)) == [
        CapsuleCmd(prop, 0),
        CapsuleCmd(ident, 0),
        CapsuleCmd(nc.kv_store(3, 1, KEY, 4, in_capsule=True), 4),
        ("end", 3, b"abcd", True),
    ]


def test_padding_between_header_and_data_is_skipped() -> None:
    # PDO past the header: the bytes between are padding (SPDK skips them the same way).
    for digests in (False, True):
        host, tgt = _pair(digests)
        cmd = nc.kv_store(3, 1, KEY, 5, in_capsule=True)
        raw = host.send(CapsuleCmd(cmd, 5), [b"hello"])
        start = 72 + (4 if digests else 0)
        padded = bytearray(raw[:start] + bytes(12) + raw[start:])
        padded[3] = start + 12
        padded[4:8] = struct.pack("<I", len(padded))
        if digests:
            padded[72:76] = struct.pack("<I", digest([bytes(padded[:72])]))
        for i in range(len(padded)):  # byte at a time: the padding is never taken for data
            tgt.receive_data(bytes(padded[i : i + 1]))
        assert _collect(_drain(tgt)) == [CapsuleCmd(cmd, 5), ("end", 3, b"hello", True)]


def test_negotiated_digests_decide_even_when_the_flags_are_clear() -> None:
    host, tgt = _pair(True)
    cmd = nc.kv_store(3, 1, KEY, 4, in_capsule=True)
    raw = bytearray(_with(host.send(CapsuleCmd(cmd, 4), [b"abcd"]), flags=0))
    raw[72:76] = struct.pack("<I", digest([bytes(raw[:72])]))  # its sender's header digest
    tgt.receive_data(bytes(raw))  # digests present and right, HDGSTF/DDGSTF clear
    assert _collect(_drain(tgt)) == [CapsuleCmd(cmd, 4), ("end", 3, b"abcd", True)]


@pytest.mark.parametrize(
    ("name", "pdus", "last"),
    [
        ("LAST_PDU missing at the end", [(0, 60, 0), (60, 40, 0)], False),
        ("LAST_PDU before the end", [(0, 60, 4), (60, 40, 4)], True),
        ("FLAGS bits H2CData does not define", [(0, 100, 0xF4)], True),
    ],
)
def test_target_counts_h2c_bytes_not_flags(
    name: str, pdus: list[tuple[int, int, int]], last: bool
) -> None:
    _, tgt = _r2t_pair()
    tgt.receive_data(b"".join(_h2c_pdu(7, datao, datal, flags) for datao, datal, flags in pdus))
    events = _drain(tgt)
    datas = [e for e in events if isinstance(e, H2CData)]
    assert [(e.datao, e.datal) for e in datas] == [(o, n) for o, n, _ in pdus], name
    assert datas[-1].last  # the R2T's data is complete at its last byte, whatever the flag
    tgt.send(CapsuleResp(Completion(3)))  # so the command may complete


def test_host_accepts_ignored_fields() -> None:
    host, tgt = _pair()
    host.send(CapsuleCmd(READ))
    host.send(CapsuleCmd(STORE_R2T))
    tgt.receive_data(b"".join([_cmd_pdu(READ), _cmd_pdu(STORE_R2T)]))
    _drain(tgt)
    stream = _with(tgt.send(R2T(3, 1, 0, 100)), flags=0xF0, pdo=24)
    stream += _c2h_pdu(2, 0, 10) + _c2h_pdu(2, 10, 10, flags=0xF4)  # data after a LAST_PDU
    stream += _ch(5, 0xFE, 24, 24, 24) + Completion(2).pack()  # PDO set, no data
    host.receive_data(stream)
    events = _collect(_drain(host))
    assert events == [
        R2T(3, 1, 0, 100),
        C2HData(2, 0, 10, True),
        ("end", 2, bytes(10), True),
        C2HData(2, 10, 10, True),
        ("end", 2, bytes(10), True),
        CapsuleResp(Completion(2)),
    ]


def test_host_ignores_reserved_icresp_digest_bits() -> None:
    host = NvmeTcpConnection(Role.HOST)
    host.send(ICReq())
    host.receive_data(_ch(1, 0, 128, 0, 128) + struct.pack("<HBBI", 0, 0, 0xFC, 8192) + bytes(112))
    assert _drain(host) == [ICResp(maxh2cdata=8192)]


def test_a_declared_length_costs_memory_only_as_it_arrives() -> None:
    # A C2HData may declare the host's whole read buffer (a size the target chose) in one PDU:
    # with no sink set, memory grows with the bytes that come, not with DATAL.
    host, tgt = _pair()
    big = nc.kv_retrieve(2, 1, KEY, 1 << 30)
    host.send(CapsuleCmd(big))
    host.receive_data(_ch(7, 4, 24, 24, 24 + (1 << 30)) + struct.pack("<HHII4x", 2, 0, 0, 1 << 30))
    (event,) = _drain(host)
    assert isinstance(event, C2HData) and event.datal == 1 << 30
    host.receive_data(bytes(1000))
    assert host._allocated is not None and len(host._allocated) <= 16 << 20
    # ... and a payload that does arrive whole comes back whole.
    host2, tgt2 = _pair()
    value = os.urandom(40 << 20)
    host2.send(CapsuleCmd(nc.kv_retrieve(2, 1, KEY, len(value))))
    tgt2.receive_data(_cmd_pdu(nc.kv_retrieve(2, 1, KEY, len(value))))
    _drain(tgt2)
    raw = tgt2.send(C2HData(2, 0, len(value), True), [value])
    events: list[Event] = []
    for pos in range(0, len(raw), 3 << 20):
        host2.receive_data(raw[pos : pos + (3 << 20)])
        events += _drain(host2)
    assert _collect(events)[-1] == ("end", 2, value, True)


def test_too_many_commands_in_progress() -> None:
    host, tgt = _pair(max_outstanding=2)
    data = b"".join(host.send(CapsuleCmd(nc.kv_exist(i, 1, KEY))) for i in range(3))
    tgt.receive_data(data)
    with pytest.raises(PduError) as info:
        _drain(tgt)
    assert info.value.fes == Fes.SEQUENCE_ERROR


def _host_error(data: bytes, cmds: Sequence[Command] = ()) -> PduError:
    host, tgt = _pair()
    for cmd in cmds:
        tgt.receive_data(host.send(CapsuleCmd(cmd)))
        _drain(tgt)
    host.receive_data(data)
    with pytest.raises(PduError) as info:
        _drain(host)
    return info.value


def _c2h_pdu(cid: int, datao: int, datal: int, flags: int = 4) -> bytes:
    return (
        _ch(7, flags, 24, 24, 24 + datal)
        + struct.pack("<HHII4x", cid, 0, datao, datal)
        + bytes(datal)
    )


def _r2t_raw(cid: int, r2to: int, r2tl: int) -> bytes:
    return _ch(9, 0, 24, 0, 24) + struct.pack("<HHII4x", cid, 1, r2to, r2tl)


READ = nc.kv_retrieve(2, 1, KEY, 100)


@pytest.mark.parametrize(
    ("name", "data", "cmds", "fes", "fei"),
    [
        (
            "completion of an unknown command",
            _ch(5, 0, 24, 0, 24) + Completion(9).pack(),
            [],
            Fes.INVALID_HEADER_FIELD,
            20,
        ),
        ("C2HData for a write", _c2h_pdu(3, 0, 10), [STORE_R2T], Fes.INVALID_HEADER_FIELD, 8),
        ("C2HData beyond the buffer", _c2h_pdu(2, 0, 101), [READ], Fes.DATA_OUT_OF_RANGE, 12),
        ("C2HData out of order", _c2h_pdu(2, 5, 10), [READ], Fes.INVALID_HEADER_FIELD, 12),
        (
            "C2HData with SUCCESS",
            _c2h_pdu(2, 0, 10, flags=0xC),
            [READ],
            Fes.INVALID_HEADER_FIELD,
            1,
        ),
        (
            "C2HData that skips bytes after a LAST_PDU",
            _c2h_pdu(2, 0, 10) + _c2h_pdu(2, 20, 10),
            [READ],
            Fes.INVALID_HEADER_FIELD,
            12,
        ),
        ("R2T for a read", _r2t_raw(2, 0, 10), [READ], Fes.INVALID_HEADER_FIELD, 8),
        ("R2T of nothing", _r2t_raw(3, 0, 0), [STORE_R2T], Fes.INVALID_HEADER_FIELD, 16),
        ("R2T beyond the value", _r2t_raw(3, 0, 101), [STORE_R2T], Fes.DATA_OUT_OF_RANGE, 12),
        (
            "a second R2T at once",
            _r2t_raw(3, 0, 50) + _r2t_raw(3, 50, 50),
            [STORE_R2T],
            Fes.DATA_LIMIT_EXCEEDED,
            0,
        ),
    ],
)
def test_host_refuses_bad_pdus(
    name: str, data: bytes, cmds: list[Command], fes: Fes, fei: int
) -> None:
    error = _host_error(data, cmds)
    assert (error.fes, error.fei) == (fes, fei), name


@pytest.mark.parametrize(
    ("name", "icresp", "fes", "fei"),
    [
        (
            "digests not as asked",
            struct.pack("<HBBI", 0, 0, 1, 8192),
            Fes.UNSUPPORTED_PARAMETER,
            11,
        ),
        ("CPDA", struct.pack("<HBBI", 0, 1, 0, 8192), Fes.UNSUPPORTED_PARAMETER, 10),
        (
            "MAXH2CDATA too small",
            struct.pack("<HBBI", 0, 0, 0, 1024),
            Fes.UNSUPPORTED_PARAMETER,
            12,
        ),
        (
            "MAXH2CDATA unaligned",
            struct.pack("<HBBI", 0, 0, 0, 8190),
            Fes.UNSUPPORTED_PARAMETER,
            12,
        ),
    ],
)
def test_host_refuses_a_bad_icresp(name: str, icresp: bytes, fes: Fes, fei: int) -> None:
    host = NvmeTcpConnection(Role.HOST)
    host.send(ICReq())
    host.receive_data(_ch(1, 0, 128, 0, 128) + icresp + bytes(112))
    with pytest.raises(PduError) as info:
        host.next_event()
    assert (info.value.fes, info.value.fei) == (fes, fei), name


# ---------------------------------------------------------------------------- what we send


def test_local_rules() -> None:
    host = NvmeTcpConnection(Role.HOST)
    with pytest.raises(LocalProtocolError):
        host.send(CapsuleCmd(nc.kv_exist(1, 1, KEY)))  # before ICResp
    with pytest.raises(LocalProtocolError):
        host.send(R2T(1, 1, 0, 1))  # a target's PDU
    host, tgt = _pair()
    with pytest.raises(LocalProtocolError):
        host.send(H2CData(3, 1, 0, 4), [b"abcd"])  # no R2T
    with pytest.raises(LocalProtocolError):
        host.send(CapsuleCmd(nc.kv_store(4, 1, KEY, 9000, in_capsule=True), 9000), [bytes(9000)])
    with pytest.raises(LocalProtocolError):
        host.send(CapsuleCmd(nc.kv_store(4, 1, KEY, 5, in_capsule=True), 4), [bytes(4)])
    with pytest.raises(LocalProtocolError):
        tgt.send(CapsuleResp(Completion(1)))  # nothing to complete
    tgt.receive_data(host.send(CapsuleCmd(STORE_R2T)))
    _drain(tgt)
    with pytest.raises(LocalProtocolError):
        tgt.send(R2T(3, 1, 10, 90))  # must start where the data stands
    tgt.send(R2T(3, 1, 0, 100))
    with pytest.raises(LocalProtocolError):
        tgt.send(CapsuleResp(Completion(3)))  # before the R2T's data is in
    with pytest.raises(LocalProtocolError):
        tgt.send(C2HData(3, 0, 4), [b"abcd"])  # a Store reads nothing
    host.send_failed()
    with pytest.raises(LocalProtocolError):
        host.send(CapsuleCmd(nc.kv_exist(9, 1, KEY)))
    host.send(H2CTermReq(Fes.SEQUENCE_ERROR))  # a TermReq may still go out


def test_events_validate_their_fields() -> None:
    with pytest.raises(LocalProtocolError):
        H2CData(1 << 16, 0, 0, 1)
    with pytest.raises(LocalProtocolError):
        C2HTermReq(1, 0, bytes(129))
    with pytest.raises(LocalProtocolError):
        ICResp(maxh2cdata=-1)


# ---------------------------------------------------------------------------- fuzzing


def _only_protocol_errors(conn: NvmeTcpConnection, data: bytes) -> None:
    try:
        conn.receive_data(data)
        conn.receive_eof()
        for _ in range(10_000):
            if isinstance(conn.next_event(), ConnectionClosed):
                return
    except RemoteProtocolError:
        return


@given(st.binary(max_size=600), st.booleans())
def test_random_bytes_parse_or_raise_remote_protocol_error(data: bytes, initialized: bool) -> None:
    tgt = _pair()[1] if initialized else NvmeTcpConnection(Role.TARGET)
    _only_protocol_errors(tgt, data)
    host = _pair()[0] if initialized else NvmeTcpConnection(Role.HOST)
    _only_protocol_errors(host, data)


def _streams(digests: bool) -> tuple[bytes, bytes]:
    """Everything the host and the target send in a whole session."""
    host, tgt = NvmeTcpConnection(Role.HOST), NvmeTcpConnection(Role.TARGET)
    sent = {Role.HOST: b"", Role.TARGET: b""}

    def move(src: NvmeTcpConnection, dst: NvmeTcpConnection, data: bytes) -> None:
        sent[src.role] += data
        dst.receive_data(data)
        _drain(dst)

    move(host, tgt, host.send(ICReq(digests, digests)))
    move(tgt, host, tgt.send(ICResp(digests, digests, 8192)))
    move(host, tgt, _host_stream(host))
    move(tgt, host, _target_answers(tgt))
    move(host, tgt, _h2c(host))
    move(tgt, host, tgt.send(CapsuleResp(Completion(3))))
    return sent[Role.HOST], sent[Role.TARGET]


STREAMS = {d: _streams(d) for d in (False, True)}


@given(st.data())
def test_mutated_sessions_parse_or_raise_remote_protocol_error(data: st.DataObject) -> None:
    digests = data.draw(st.booleans())
    to_target, to_host = (bytearray(s) for s in STREAMS[digests])
    for stream in (to_target, to_host):
        for _ in range(data.draw(st.integers(1, 8))):
            pos = data.draw(st.integers(0, len(stream) - 1))
            stream[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(to_target)))
    _only_protocol_errors(NvmeTcpConnection(Role.TARGET), bytes(to_target[:cut]))
    host = NvmeTcpConnection(Role.HOST)
    host.send(ICReq(digests, digests))
    host.receive_data(STREAMS[digests][1][:128])  # the real ICResp
    _drain(host)
    _host_stream(host)  # the commands the answers answer
    _only_protocol_errors(host, bytes(to_host[128:]))
