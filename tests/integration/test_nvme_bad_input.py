"""The NVMe/TCP front under malformed, truncated, out-of-order and oversized PDUs: a C2HTermReq
with the right Fatal Error Status, that connection closed, the daemon and its other
connections carrying on, nothing stored damaged, memory bounded."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nvme_raw import RawQueue
from probes import closed, eventually, pinned, refused, small_window

from kvoffload.client_sdk import Client
from kvoffload.errors import RemoteProtocolError
from kvoffload.wire.nvme_tcp import cmd as nc
from kvoffload.wire.nvme_tcp import data as nd
from kvoffload.wire.nvme_tcp.connection import (
    R2T,
    C2HTermReq,
    CapsuleCmd,
    ConnectionClosed,
    Fes,
    H2CData,
    ICReq,
    NvmeTcpConnection,
    Role,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
Start = Callable[..., Any]

LIMITS = """
[nvme]
in_capsule_bytes = "16KiB"
maxh2cdata_bytes = "8KiB"
connect_timeout_s = 1.0
frame_timeout_s = 1.0
max_connections = 8
"""


def _ch(ptype: int, flags: int, hlen: int, pdo: int, plen: int) -> bytes:
    return struct.pack("<BBBBI", ptype, flags, hlen, pdo, plen)


def _seed(url: str) -> dict[bytes, bytes]:
    sizes = (1000, 50_000, 150_000)  # three size classes: no eviction in a 64 MiB arena
    blocks = {os.urandom(16): os.urandom(sizes[i % 3]) for i in range(20)}
    with Client.connect(url) as client:
        for key, value in blocks.items():
            client.put(key, value)
    return blocks


def _intact(url: str, blocks: dict[bytes, bytes]) -> None:
    with Client.connect(url) as client:
        for key, value in blocks.items():
            assert client.get(key) == value
        assert client.stats().corrupt_blocks == 0


def _terminated(q: RawQueue) -> C2HTermReq:
    """The target's answer to a fatal PDU: one C2HTermReq, then the connection closes."""
    events = q.until_closed()
    q.close()
    assert isinstance(events[-1], ConnectionClosed), events
    terms = [e for e in events if isinstance(e, C2HTermReq)]
    assert len(terms) == 1, events
    return terms[0]


def _io_queue(port: int, sock: socket.socket | None = None) -> tuple[RawQueue, RawQueue]:
    """An admin queue, enabled, and one I/O queue (over `sock` if given) of its controller."""
    admin = RawQueue(port)
    c = admin.connect()
    admin.enable()
    assert admin.command(nc.set_features(admin.cid(), 0x07, 0))[0].ok
    io = RawQueue(port, sock=sock)
    assert io.connect(1, cntlid=c.dw0).ok
    return admin, io


STORE_R2T = nc.kv_store(40, 1, b"r" * 16, 20_000, in_capsule=False)

# (name, PDUs after a good ICReq/ICResp, expected FES)
AFTER_IC: list[tuple[str, bytes, Fes]] = [
    ("a type the host may not send", _ch(7, 0, 24, 0, 24), Fes.INVALID_HEADER_FIELD),
    ("an unknown type", _ch(0x33, 0, 24, 0, 24), Fes.INVALID_HEADER_FIELD),
    ("a second ICReq", _ch(0, 0, 128, 0, 128) + bytes(120), Fes.SEQUENCE_ERROR),
    ("a CapsuleCmd with HLEN 24", _ch(4, 0, 24, 0, 24) + bytes(16), Fes.INVALID_HEADER_FIELD),
    ("data inside the header (PDO 0)", _ch(4, 1, 72, 0, 76) + bytes(68), Fes.INVALID_HEADER_FIELD),
    ("a CapsuleResp from the host", _ch(5, 0, 24, 0, 24) + bytes(16), Fes.INVALID_HEADER_FIELD),
    ("H2CData nobody asked for", _ch(6, 4, 24, 24, 32) + bytes(24), Fes.INVALID_HEADER_FIELD),
    # Oversized: declared lengths are refused before anything is allocated.
    ("a gigabyte of in-capsule data", _ch(4, 0, 72, 72, 1 << 30), Fes.DATA_LIMIT_EXCEEDED),
    ("H2CData beyond MAXH2CDATA", _ch(6, 4, 24, 24, 24 + (1 << 30)), Fes.DATA_LIMIT_EXCEEDED),
    ("a TermReq too long", _ch(2, 0, 24, 0, 1000), Fes.INVALID_HEADER_FIELD),
]


def test_bad_pdus_get_a_term_req_and_others_carry_on(start_daemon: Start) -> None:
    daemon = start_daemon(config=LIMITS)
    port = daemon.ports["nvme"]
    blocks = _seed(daemon.nvme_url())
    survivor = Client.connect(daemon.nvme_url())  # opened before, used after
    rss_before = daemon.rss_bytes()
    for _ in range(3):
        for name, data, fes in AFTER_IC:
            q = RawQueue(port)
            q.send_raw(data)
            assert _terminated(q).fes == fes, name
        q = RawQueue(port, icreq=False)  # a command before ICReq
        q.send_raw(_ch(4, 0, 72, 0, 72) + bytes(64))
        assert _terminated(q).fes == Fes.SEQUENCE_ERROR
        q = RawQueue(port, icreq=False)
        q.send_raw(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _terminated(q).fes == Fes.INVALID_HEADER_FIELD
        q = RawQueue(port, icreq=False)  # HPDA != 0: padding is not supported
        q.send_raw(_ch(0, 0, 128, 0, 128) + struct.pack("<HBBI", 0, 2, 0, 0) + bytes(112))
        term = _terminated(q)
        assert (term.fes, term.fei) == (Fes.UNSUPPORTED_PARAMETER, 10)
    assert daemon.rss_bytes() - rss_before < 64 << 20  # nothing of the declared sizes
    key = os.urandom(16)
    survivor.put(key, b"still here")
    assert survivor.get(key) == b"still here"
    survivor.close()
    _intact(daemon.nvme_url(), blocks)
    with urllib.request.urlopen(daemon.metrics_url, timeout=10) as resp:
        metrics = resp.read().decode()
    assert 'kvoffload_protocol_errors_total{front="nvme"}' in metrics


def _memory(daemon: Any, field: str) -> int:
    """The daemon's VmRSS (now) or VmHWM (peak), in bytes."""
    with open(f"/proc/{daemon.proc.pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field}")


def _numd(cmd: nc.Command, nbytes: int) -> nc.Command:
    """`cmd` (a Get Log Page) asking for `nbytes` whatever its SGL takes."""
    numd = nbytes // 4 - 1
    lid = cmd.cdw10 & 0xFF
    return replace(cmd, cdw10=lid | (numd & 0xFFFF) << 16, cdw11=numd >> 16)


def test_get_log_page_builds_only_what_its_sgl_takes(start_daemon: Start) -> None:
    # NUMD = 1 GiB with a 4 KiB SGL once took the daemon from 116 to 1139 MiB and held its
    # loop for 0.67 s: the whole page was built, then cut to the SGL.
    daemon = start_daemon()
    admin = RawQueue(daemon.ports["nvme"])
    assert admin.connect().ok
    admin.enable()
    page = nc.get_log_page(admin.cid(), nd.Lid.EFFECTS, 4096, csi=nd.Csi.KV)
    c, expected = admin.command(page)
    assert c.ok and len(expected) == 4096
    rss, peak = _memory(daemon, "VmRSS"), _memory(daemon, "VmHWM")
    for _ in range(3):
        cmd = _numd(nc.get_log_page(admin.cid(), nd.Lid.EFFECTS, 4096, csi=nd.Csi.KV), 1 << 30)
        c, data = admin.command(cmd)
        assert c.ok and data == expected  # 4 KiB, the ones a 4 KiB read gets
        c, data = admin.command(_numd(nc.get_log_page(admin.cid(), nd.Lid.SMART, 512), 1 << 30))
        assert c.ok and len(data) == 512
    assert _memory(daemon, "VmHWM") - peak < 8 << 20  # nothing built of the asked sizes
    assert _memory(daemon, "VmRSS") - rss < 8 << 20
    # A read that would be mostly zeros past the page: Invalid Field, and the queue goes on.
    big = nc.get_log_page(admin.cid(), nd.Lid.SMART, (1 << 30) - 4)
    c, data = admin.command(big)
    assert (c.sct, c.sc, data) == (0, 0x02, b"")
    assert admin.command(nc.keep_alive(admin.cid()))[0].ok
    assert _memory(daemon, "VmHWM") - peak < 8 << 20
    admin.close()


def test_a_bad_header_digest_is_fatal(start_daemon: Start) -> None:
    daemon = start_daemon()
    q = RawQueue(daemon.ports["nvme"], digests=True)
    raw = bytearray(q.conn.send(CapsuleCmd(nc.kv_exist(1, 1, bytes(16)))))
    raw[30] ^= 0x40
    q.send_raw(bytes(raw))
    term = _terminated(q)
    assert (term.fes, term.fei) == (Fes.HEADER_DIGEST_ERROR, 72)
    assert term.pdu == bytes(raw[:76])  # the offending header, digest included


def test_bad_data_digest_fails_the_store_only(start_daemon: Start) -> None:
    daemon = start_daemon()
    admin = RawQueue(daemon.ports["nvme"], digests=True)
    c = admin.connect()
    admin.enable()
    admin.command(nc.set_features(admin.cid(), 0x07, 0))
    io = RawQueue(daemon.ports["nvme"], digests=True)
    assert io.connect(1, cntlid=c.dw0).ok
    key = os.urandom(16)
    assert io.command(nc.kv_store(io.cid(), 1, key, 4, in_capsule=True), b"good")[0].ok
    raw = bytearray(
        io.conn.send(CapsuleCmd(nc.kv_store(io.cid(), 1, key, 4, in_capsule=True), 4), [b"evil"])
    )
    raw[-5] ^= 1  # the last data byte, not its digest
    io.send_raw(bytes(raw))
    (answer,) = io.events()
    assert (answer.completion.sct, answer.completion.sc) == (0, 0x04)  # type: ignore[attr-defined]
    assert not answer.completion.dnr  # type: ignore[attr-defined]  # a retry may succeed
    c, data = io.command(nc.kv_retrieve(io.cid(), 1, key, 100))
    assert c.ok and data == b"good"  # the damaged store changed nothing


def test_h2c_data_out_of_order_or_range(start_daemon: Start) -> None:
    daemon = start_daemon(config=LIMITS)
    port = daemon.ports["nvme"]
    blocks = _seed(daemon.nvme_url())
    old = os.urandom(20_000)
    with Client.connect(daemon.nvme_url()) as client:
        client.put(b"r" * 16, old)
    cases = [
        ("DATAO ahead of the data", lambda t: H2CData(40, t, 100, 8192), Fes.INVALID_HEADER_FIELD),
        ("another TTAG", lambda t: H2CData(40, t + 1, 0, 8192), Fes.INVALID_HEADER_FIELD),
        ("past the R2T", lambda t: H2CData(40, t, 12_000, 8192), Fes.DATA_OUT_OF_RANGE),
    ]
    for name, make, fes in cases:
        admin, io = _io_queue(port)
        io.send(CapsuleCmd(STORE_R2T))
        (r2t,) = io.events()
        assert isinstance(r2t, R2T) and (r2t.r2to, r2t.r2tl) == (0, 20_000)
        io.send(H2CData(40, r2t.ttag, 0, 8192), [bytes(8192)])
        pdu = make(r2t.ttag)
        if name == "past the R2T":
            io.send(H2CData(40, r2t.ttag, 8192, 3808), [bytes(3808)])
        io.send_raw(_h2c_raw(pdu))
        assert _terminated(io).fes == fes, name
        admin.close()
    with Client.connect(daemon.nvme_url()) as client:
        assert client.get(b"r" * 16) == old  # the half-received stores never became visible
    _intact(daemon.nvme_url(), blocks)


def _h2c_raw(pdu: H2CData, data: bytes | None = None) -> bytes:
    flags = 0x4 if pdu.last else 0
    return (
        _ch(6, flags, 24, 24, 24 + pdu.datal)
        + struct.pack("<HHII4x", pdu.cccid, pdu.ttag, pdu.datao, pdu.datal)
        + (bytes(pdu.datal) if data is None else data)
    )


def test_the_byte_count_not_last_pdu_ends_a_stores_data(start_daemon: Start) -> None:
    # Linux's and SPDK's targets count H2CData bytes; so does this one: LAST_PDU set early
    # or missing at the end changes nothing.
    daemon = start_daemon(config=LIMITS)
    admin, io = _io_queue(daemon.ports["nvme"])
    for flags in ((True, False, False), (False, False, False), (True, True, True)):
        key = os.urandom(16)
        value = os.urandom(20_000)
        io.send(CapsuleCmd(nc.kv_store(40, 1, key, len(value), in_capsule=False)))
        (r2t,) = io.events()
        assert isinstance(r2t, R2T)
        pieces = [(0, 8192), (8192, 8192), (16384, 3616)]
        io.send_raw(
            b"".join(
                _h2c_raw(H2CData(40, r2t.ttag, o, n, last), value[o : o + n])
                for (o, n), last in zip(pieces, flags, strict=True)
            )
        )
        (done,) = io.events()
        assert done.completion.ok, flags  # type: ignore[attr-defined]
        c, data = io.command(nc.kv_retrieve(io.cid(), 1, key, 30_000))
        assert c.ok and data == value
    admin.close()
    io.close()


def test_truncated_and_silent_connections_are_closed(start_daemon: Start) -> None:
    daemon = start_daemon(config=LIMITS)
    port = daemon.ports["nvme"]
    blocks = _seed(daemon.nvme_url())
    # Half a PDU, then the host goes away: nothing to answer, the daemon just forgets it.
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(NvmeTcpConnection(Role.HOST).send(ICReq())[:60])
    # A connection that never sends ICReq, and one that stops in the middle of a PDU.
    silent = RawQueue(port, icreq=False)
    assert isinstance(silent.until_closed()[-1], ConnectionClosed)
    slow = RawQueue(port)
    slow.send_raw(_ch(4, 0, 72, 0, 72) + bytes(10))
    assert isinstance(slow.until_closed()[-1], ConnectionClosed)
    _intact(daemon.nvme_url(), blocks)


def test_a_host_that_stops_reading_is_cut_off_and_its_blocks_released(start_daemon: Start) -> None:
    # C2HData waiting for a host that takes none of it pins the values it is sent from; after
    # frame_timeout_s without progress the queue is closed and they are released.
    daemon = start_daemon(config=LIMITS)
    keys = [os.urandom(16) for _ in range(30)]
    with Client.connect(daemon.url()) as client:  # the native front fills the same store
        for key in keys:
            client.put(key, os.urandom(1 << 20))
        port = daemon.ports["nvme"]
        admin, io = _io_queue(port, small_window(port))
        retrieves = [CapsuleCmd(nc.kv_retrieve(cid, 1, k, 2 << 20)) for cid, k in enumerate(keys)]
        io.send_raw(b"".join(io.conn.send(r) for r in retrieves))
        # ... and never reads.
        assert eventually(lambda: client.stats().store["gets"] == len(keys))
        assert eventually(lambda: pinned(client) == 0)
        assert refused(daemon, "send timeout", "nvme") == 1.0
        assert closed(io.sock)
        io.close()
        admin.close()


def test_too_many_connections_are_refused(start_daemon: Start) -> None:
    daemon = start_daemon(config="[nvme]\nmax_connections = 8\n")
    port = daemon.ports["nvme"]
    held = [RawQueue(port) for _ in range(8)]
    extra = RawQueue(port, icreq=False)
    assert isinstance(extra.until_closed()[-1], ConnectionClosed)
    for q in held:
        q.close()


def test_mutated_sessions_never_hurt_the_daemon(start_daemon: Start) -> None:
    daemon = start_daemon(config=LIMITS)
    port = daemon.ports["nvme"]
    blocks = _seed(daemon.nvme_url())

    @settings(max_examples=25, deadline=None)
    @given(st.data())
    def session(data: st.DataObject) -> None:
        admin, io = _io_queue(port)
        key = data.draw(st.binary(min_size=16, max_size=16))
        stream = bytearray(
            io.conn.send(
                CapsuleCmd(nc.kv_store(7, 1, key, 300, in_capsule=True), 300), [bytes(300)]
            )
            + io.conn.send(CapsuleCmd(nc.kv_retrieve(8, 1, key, 300)))
            + io.conn.send(CapsuleCmd(nc.kv_list(9, 1, b"", 4096)))
        )
        for _ in range(data.draw(st.integers(1, 6))):
            stream[data.draw(st.integers(0, len(stream) - 1))] = data.draw(st.integers(0, 255))
        io.send_raw(bytes(stream))
        io.sock.shutdown(socket.SHUT_WR)
        # Whatever the target makes of it, it answers or ends the connection, and lives on.
        # (our codec may refuse answers to commands the mutation made up)
        with contextlib.suppress(RemoteProtocolError):
            io.until_closed()
        io.close()
        admin.close()

    session()
    _intact(daemon.nvme_url(), blocks)
