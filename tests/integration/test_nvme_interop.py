"""Interop: an NVMe/TCP host that shares no code with ours drives the daemon end to end.

No independent NVMe/TCP host installs here: PyPI's `nvmeof` is an RDMA-only initiator (ibverbs,
keyed SGLs), `nvme` 0.2.0 holds NVMe data structures and a Linux ioctl driver but no fabrics
transport, scapy 2.8.0 has no NVMe/TCP layer, `libnvme`/`libnvme3`/Debian's `python3-nvme` and
`nvme-cli` drive the kernel's nvme-fabrics module (no /dev/nvme-fabrics, no modules to load in
this sandbox), and the pure-Python TrueNAS client (`nvmeof-client`) is not on PyPI. So `_Host`
below is written from the byte layouts of shared/ref/nvme-tcp-kv.md with `struct` alone (not
from `kvoffload.wire`), and sends PDUs the way the independent host that found the
bug does: PDO = 72 on every capsule, data or not; an all-zero SGL (type 00h) on commands
without data; MAXR2T carrying 0x400000 in its ICReq. It runs plain and with header and data
digests (CRC32C from the `crc32c` package, checked on every PDU the target sends). Covered:
ICReq/ICResp, Fabrics Connect of the admin queue, Property Get/Set (CAP, CC, CSTS, VS),
Identify Controller / Active Namespace list / Namespace (NVM shim) / descriptors / KV
namespace, Get Log Page, Set Features Number of Queues, Keep Alive, an I/O queue Connect, KV
Store (in capsule, and via R2T + H2CData), Retrieve (C2HData, full and short buffer), Exist,
List, Delete, Fabrics Disconnect of the I/O queue, and a CC.SHN shutdown.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass
from typing import Any

import crc32c
import pytest

from kvoffload.client_sdk import Client

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SUBNQN = "nqn.2026-11.io.kvoffload:store"
HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:3f1c5b2e-0000-4000-8000-00000000beef"
CONFIG = """
[nvme]
in_capsule_bytes = "16KiB"
maxh2cdata_bytes = "8KiB"
"""
# PDU types
IC_REQ, IC_RESP, C2H_TERM, CMD, RESP, H2C_DATA, C2H_DATA, R2T = 0, 1, 3, 4, 5, 6, 7, 9
LAST_PDU = 0x04
# Status codes
SC_KEY_MISSING = 0x87


@dataclass
class Cqe:
    dw0: int
    dw1: int
    sqid: int
    cid: int
    status: int

    @property
    def sc(self) -> int:
        return (self.status >> 1) & 0xFF

    @property
    def sct(self) -> int:
        return (self.status >> 9) & 0x7

    @property
    def ok(self) -> bool:
        return self.sc == 0 and self.sct == 0


def _sqe(
    opc: int,
    cid: int,
    *,
    nsid: int = 0,
    dw: dict[int, int] | None = None,
    sgl: tuple[int, int] = (0, 0),
    key: bytes = b"",
) -> bytes:
    """A 64-byte SQE: PSDT 01b (SGL), SGL1 = (length, type byte) at bytes 32..39, CDW10..15 by
    number in `dw`, a KV key split over CDW2..3 and CDW14..15."""
    sqe = bytearray(64)
    struct.pack_into("<BBHI", sqe, 0, opc, 0x40, cid, nsid)
    length, sgl_type = sgl
    struct.pack_into("<I", sqe, 32, length)
    sqe[39] = sgl_type
    for n, value in (dw or {}).items():
        struct.pack_into("<I", sqe, 4 * n, value)
    if key:
        padded = key.ljust(16, b"\0")
        sqe[8:16] = padded[:8]
        sqe[56:64] = padded[8:]
    return bytes(sqe)


def _ch(ptype: int, flags: int, hlen: int, pdo: int, plen: int) -> bytes:
    # PLEN as three bytes and a reserved one, the way the independent host writes it.
    return bytes((ptype, flags, hlen, pdo)) + plen.to_bytes(3, "little") + b"\0"


def _crc(data: bytes) -> bytes:
    return struct.pack("<I", crc32c.crc32c(data))


class _Host:
    """One NVMe/TCP connection (one queue), blocking; header and data digests if asked."""

    def __init__(self, port: int, digests: bool = False) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.cid = 0
        self.maxh2cdata = 0
        self.digests = digests
        self.hd = 4 if digests else 0

    def _send(self, ptype: int, flags: int, hlen: int, psh: bytes, data: bytes = b"") -> None:
        """One PDU; PDO is set whether data follows or not (the independent host's way)."""
        pdo = hlen + self.hd
        dd = 4 if self.digests and data else 0
        if self.digests:
            flags |= 0x01 | (0x02 if data else 0)
        header = _ch(ptype, flags, hlen, pdo, pdo + len(data) + dd) + psh
        if self.digests:
            header += _crc(header)
        self.sock.sendall(header + data + (_crc(data) if dd else b""))

    def close(self) -> None:
        self.sock.close()

    def _read(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError(f"closed after {len(out)} of {n} bytes")
            out += chunk
        return out

    def pdu(self) -> tuple[int, int, int, bytes]:
        """(type, flags, PDO, whole PDU) of the next PDU the target sends."""
        head = self._read(8)
        ptype, flags, hlen, pdo, plen = struct.unpack("<BBBBI", head)
        assert hlen in (24, 128), head
        raw = head + self._read(plen - 8)
        assert ptype != C2H_TERM, f"target terminated: FES {raw[8:10].hex()} {raw[8:]!r}"
        if self.digests and ptype in (RESP, C2H_DATA, R2T):
            assert flags & 0x01 and raw[hlen : hlen + 4] == _crc(raw[:hlen])
            if ptype == C2H_DATA:
                assert flags & 0x02 and raw[-4:] == _crc(raw[pdo:-4])
                raw = raw[:-4]  # the data digest, checked
        return ptype, flags, pdo, raw

    def icreq(self) -> None:
        asked = 0x3 if self.digests else 0
        body = struct.pack("<HBBI", 0, 0, asked, 0x400000) + bytes(112)
        self.sock.sendall(_ch(IC_REQ, 0, 128, 0, 128) + body)
        digests, self.digests = self.digests, False  # ICResp never carries digests
        ptype, _, _, raw = self.pdu()
        self.digests = digests
        assert ptype == IC_RESP and len(raw) == 128
        pfv, cpda, dgst, self.maxh2cdata = struct.unpack_from("<HBBI", raw, 8)
        assert (pfv, cpda, dgst) == (0, 0, asked)
        assert self.maxh2cdata >= 4096 and self.maxh2cdata % 4 == 0

    def next_cid(self) -> int:
        self.cid = self.cid % 0xFFFF + 1
        return self.cid

    def run(self, sqe: bytes, data: bytes = b"", *, in_capsule: bool = True) -> tuple[Cqe, bytes]:
        """Send one command (PDO = 72 whether data follows or not) and run it to its CQE:
        answer R2Ts with H2CData, gather C2HData."""
        self._send(CMD, 0, 72, sqe, data if in_capsule else b"")
        cid = struct.unpack_from("<H", sqe, 2)[0]
        read = bytearray()
        while True:
            ptype, flags, pdo, raw = self.pdu()
            if ptype == R2T:
                cccid, ttag, r2to, r2tl = struct.unpack_from("<HHII", raw, 8)
                assert cccid == cid and r2to + r2tl <= len(data)
                for pos in range(r2to, r2to + r2tl, self.maxh2cdata):
                    n = min(self.maxh2cdata, r2to + r2tl - pos)
                    last = LAST_PDU if pos + n == r2to + r2tl else 0
                    head = struct.pack("<HHII4x", cid, ttag, pos, n)
                    self._send(H2C_DATA, last, 24, head, data[pos : pos + n])
            elif ptype == C2H_DATA:
                cccid, _, datao, datal = struct.unpack_from("<HHII", raw, 8)
                assert cccid == cid and datao == len(read) and len(raw) - pdo == datal
                read += raw[pdo:]
            else:
                assert ptype == RESP, ptype
                dw0, dw1, _, sqid, rcid, status = struct.unpack_from("<IIHHHH", raw, 8)
                assert rcid == cid
                return Cqe(dw0, dw1, sqid, rcid, status), bytes(read)

    # -------------------------------------------------------------- Fabrics

    def connect(self, qid: int, cntlid: int = 0xFFFF, sqsize: int = 31) -> Cqe:
        data = bytearray(1024)
        data[0:16] = bytes.fromhex("3f1c5b2e00004000800000000000beef")
        struct.pack_into("<H", data, 16, cntlid)
        data[256 : 256 + len(SUBNQN)] = SUBNQN.encode()
        data[512 : 512 + len(HOSTNQN)] = HOSTNQN.encode()
        dw = {10: qid << 16, 11: sqsize}
        sqe = bytearray(_sqe(0x7F, self.next_cid(), sgl=(1024, 0x01), dw=dw))
        sqe[4] = 0x01  # FCTYPE Connect
        return self.run(bytes(sqe), bytes(data))[0]

    def _fabrics(self, fctype: int, dw: dict[int, int]) -> Cqe:
        sqe = bytearray(_sqe(0x7F, self.next_cid(), dw=dw))
        sqe[4] = fctype
        return self.run(bytes(sqe))[0]

    def get_property(self, offset: int, eight: bool = False) -> int:
        c = self._fabrics(0x04, {10: int(eight), 11: offset})
        assert c.ok, c
        return c.dw0 | (c.dw1 << 32)

    def set_property(self, offset: int, value: int) -> Cqe:
        return self._fabrics(0x00, {10: 0, 11: offset, 12: value})

    def disconnect(self) -> Cqe:
        return self._fabrics(0x08, {10: 0})

    # -------------------------------------------------------------- Admin

    def identify(self, cns: int, nsid: int = 0, csi: int = 0) -> bytes:
        sqe = _sqe(0x06, self.next_cid(), nsid=nsid, sgl=(4096, 0x5A), dw={10: cns, 11: csi << 24})
        c, data = self.run(sqe)
        assert c.ok, (cns, c)
        return data

    def log_page(self, lid: int, length: int, csi: int = 0) -> bytes:
        numd = length // 4 - 1
        dw = {10: lid | (numd & 0xFFFF) << 16, 11: numd >> 16, 14: csi << 24}
        c, data = self.run(_sqe(0x02, self.next_cid(), nsid=0xFFFFFFFF, sgl=(length, 0x5A), dw=dw))
        assert c.ok, (lid, c)
        return data

    def admin(self, opc: int, **dw: int) -> Cqe:
        return self.run(_sqe(opc, self.next_cid(), dw={int(k[2:]): v for k, v in dw.items()}))[0]

    # -------------------------------------------------------------- Key Value

    def store(self, nsid: int, key: bytes, value: bytes, in_capsule: bool) -> Cqe:
        sgl = (len(value), 0x01 if in_capsule else 0x5A)
        dw = {10: len(value), 11: len(key)}
        sqe = _sqe(0x01, self.next_cid(), nsid=nsid, dw=dw, sgl=sgl, key=key)
        return self.run(sqe, value, in_capsule=in_capsule)[0]

    def retrieve(self, nsid: int, key: bytes, size: int) -> tuple[Cqe, bytes]:
        dw = {10: size, 11: len(key)}
        return self.run(_sqe(0x02, self.next_cid(), nsid=nsid, dw=dw, sgl=(size, 0x5A), key=key))

    def keyed(self, opc: int, nsid: int, key: bytes) -> Cqe:
        return self.run(_sqe(opc, self.next_cid(), nsid=nsid, dw={11: len(key)}, key=key))[0]

    def list_keys(self, nsid: int, size: int) -> list[bytes]:
        sqe = _sqe(0x06, self.next_cid(), nsid=nsid, dw={10: size, 11: 0}, sgl=(size, 0x5A))
        c, data = self.run(sqe)
        assert c.ok, c
        (count,) = struct.unpack_from("<I", data)
        keys, pos = [], 4
        for _ in range(count):  # u16 length, key, entry padded to 4 bytes
            (kl,) = struct.unpack_from("<H", data, pos)
            keys.append(data[pos + 2 : pos + 2 + kl])
            pos += (2 + kl + 3) // 4 * 4
        return keys


@pytest.mark.parametrize("digests", [False, True], ids=["plain", "digests"])
def test_an_independent_host_runs_a_whole_session(start_daemon: Any, digests: bool) -> None:
    daemon = start_daemon(config=CONFIG)
    port = daemon.ports["nvme"]

    # ---- admin queue: connect and enable the controller the way the host does
    admin = _Host(port, digests)
    admin.icreq()
    c = admin.connect(0)
    assert c.ok, c
    cntlid = c.dw0 & 0xFFFF
    cap = admin.get_property(0x00, eight=True)
    assert cap & 0xFFFF >= 1 and (cap >> 37) & 0x41 == 0x41  # NVM + "I/O command sets" in CSS
    assert admin.set_property(0x14, (6 << 16) | (4 << 20) | (6 << 4) | 1).ok
    assert admin.get_property(0x1C) & 1  # CSTS.RDY
    assert admin.get_property(0x08) >= 0x00010300

    # ---- Identify: the fields a Linux or SPDK host checks before it goes on
    ctrl = admin.identify(1)
    assert struct.unpack_from("<H", ctrl, 78)[0] == cntlid
    assert ctrl[768:1024].split(b"\0")[0].decode() == SUBNQN
    ioccsz, iorcsz, icdoff = struct.unpack_from("<IIH", ctrl, 1792)
    assert ioccsz >= 4 and iorcsz >= 1 and icdoff == 0
    assert struct.unpack_from("<I", ctrl, 536)[0] & 0x3  # SGLs supported
    assert struct.unpack_from("<H", ctrl, 320)[0]  # KAS
    in_capsule = ioccsz * 16 - 64
    nsids = [n for (n,) in struct.iter_unpack("<I", admin.identify(2)) if n]
    assert nsids == [1]
    shim = admin.identify(0, nsid=1)
    assert struct.unpack_from("<Q", shim, 8)[0] > 0  # NCAP (SPDK's "active" test)
    descriptors = admin.identify(3, nsid=1)
    found, pos = {}, 0
    while descriptors[pos + 1]:
        nidt, nidl = descriptors[pos], descriptors[pos + 1]
        found[nidt] = descriptors[pos + 4 : pos + 4 + nidl]
        pos += 4 + nidl
    assert found[0x04] == b"\x01"  # CSI: Key Value
    kv_ns = admin.identify(5, nsid=1, csi=1)
    kvkml, kvvml = struct.unpack_from("<H2xI", kv_ns, 72)
    assert kvkml == 16 and kvvml > 0
    effects = admin.log_page(0x05, 4096, csi=1)
    assert struct.unpack_from("<I", effects, 1024 + 4 * 0x01)[0] & 1  # Store supported
    granted = admin.admin(0x09, dw10=0x07, dw11=0)  # Set Features: one I/O queue
    assert granted.ok and (granted.dw0 & 0xFFFF) == 0
    assert admin.admin(0x18).ok  # Keep Alive

    # ---- I/O queue: KV commands
    io = _Host(port, digests)
    io.icreq()
    assert io.connect(1, cntlid).ok
    small, small_value = os.urandom(16), os.urandom(100)
    large, large_value = os.urandom(16), os.urandom(3 * in_capsule + 5)  # R2T, several H2CData
    assert io.store(1, small, small_value, in_capsule=True).ok
    assert io.store(1, large, large_value, in_capsule=False).ok
    for key, value in ((small, small_value), (large, large_value)):
        c, data = io.retrieve(1, key, kvvml)
        assert c.ok and c.dw0 == len(value) and data == value
    c, data = io.retrieve(1, large, 1000)  # a short buffer: the first bytes, DW0 the full size
    assert c.ok and c.dw0 == len(large_value) and data == large_value[:1000]
    assert io.keyed(0x14, 1, small).ok  # Exist
    assert sorted(io.list_keys(1, 4096)) == sorted([small, large])
    assert io.keyed(0x10, 1, small).ok  # Delete
    missing = io.keyed(0x14, 1, small)
    assert (missing.sct, missing.sc) == (0, SC_KEY_MISSING)
    assert io.disconnect().ok
    io.close()

    # ---- shutdown: CC.SHN = 01b, then CSTS.SHST = 10b
    assert admin.set_property(0x14, (6 << 16) | (4 << 20) | (6 << 4) | 1 | (1 << 14)).ok
    assert (admin.get_property(0x1C) >> 2) & 0x3 == 0x2
    admin.close()

    # The daemon lives on for our own SDK.
    with Client.connect(daemon.nvme_url()) as client:
        client.put(b"k" * 16, b"after the interop session")
        assert client.get(b"k" * 16) == b"after the interop session"


def test_descriptor_and_field_forms_other_hosts_use(start_daemon: Any) -> None:
    # Fields Linux's nvmet or SPDK's target accept are accepted: PSDT other than 01b (DPTR is
    # an SGL over fabrics whatever it says), a transport SGL with subtype 0h (SPDK) or a data
    # block descriptor (Linux) for read data, reserved KV Store option bits. What cannot work
    # gets an NVMe status, and the queue goes on.
    daemon = start_daemon(config=CONFIG)
    port = daemon.ports["nvme"]
    admin = _Host(port)
    admin.icreq()
    cntlid = admin.connect(0).dw0 & 0xFFFF
    assert admin.set_property(0x14, (6 << 16) | (4 << 20) | (6 << 4) | 1).ok
    for psdt, sgl_type in ((0x00, 0x5A), (0x80, 0x5A), (0x40, 0x50), (0x40, 0x00)):
        sqe = bytearray(_sqe(0x06, admin.next_cid(), sgl=(4096, sgl_type), dw={10: 1}))
        sqe[1] = psdt
        c, data = admin.run(bytes(sqe))
        assert c.ok and len(data) == 4096, (psdt, sgl_type)
        assert data[768:1024].split(b"\0")[0].decode() == SUBNQN
    # Read data cannot be in the capsule: SGL Descriptor Type Invalid, not a dropped queue.
    c, _ = admin.run(_sqe(0x06, admin.next_cid(), sgl=(4096, 0x01), dw={10: 1}))
    assert (c.sct, c.sc) == (0, 0x11)
    assert admin.admin(0x09, dw10=0x07, dw11=0).ok
    io = _Host(port)
    io.icreq()
    assert io.connect(1, cntlid).ok
    key, value = os.urandom(16), os.urandom(64)
    sqe = _sqe(0x01, io.next_cid(), nsid=1, dw={10: 64, 11: 16 | 0xF8 << 8}, sgl=(64, 1), key=key)
    assert io.run(sqe, value)[0].ok  # option bits 7:3 are reserved: ignored
    c, data = io.retrieve(1, key, 64)
    assert c.ok and data == value
    both = _sqe(0x01, io.next_cid(), nsid=1, dw={10: 64, 11: 16 | 0x03 << 8}, sgl=(64, 1), key=key)
    c, _ = io.run(both, value)  # "only if it exists" and "only if it does not": contradictory
    assert (c.sct, c.sc) == (0, 0x02)
    assert io.keyed(0x14, 1, key).ok
    io.close()
    admin.close()


def test_an_io_queue_connect_without_set_features_is_admitted(start_daemon: Any) -> None:
    """The exact sequence of the third-party host that found the bug: Connect, Identify and the
    namespace list on the admin queue, then (no Set Features Number of Queues) the I/O queue's
    Connect on a second TCP connection: queue 1, SQSIZE 127. Linux nvmet admits it (up to the
    subsystem's maximum); we refused it with SCT 1 / SC 0x82."""
    daemon = start_daemon(config=CONFIG)
    port = daemon.ports["nvme"]
    admin = _Host(port)
    admin.icreq()
    c = admin.connect(0)
    assert c.ok, c
    cntlid = c.dw0 & 0xFFFF
    assert admin.set_property(0x14, (6 << 16) | (4 << 20) | (6 << 4) | 1).ok
    assert admin.get_property(0x1C) & 1  # CSTS.RDY
    admin.identify(1)
    assert [n for (n,) in struct.iter_unpack("<I", admin.identify(2)) if n] == [1]
    io = _Host(port)
    io.icreq()
    c = io.connect(1, cntlid, sqsize=127)
    assert c.ok, (c.sct, hex(c.sc))
    key, value = os.urandom(16), os.urandom(100)
    assert io.store(1, key, value, in_capsule=True).ok
    c, data = io.retrieve(1, key, 4096)
    assert c.ok and data == value
    # Beyond the subsystem's maximum (16 I/O queues by default) it is still refused.
    over = _Host(port)
    over.icreq()
    c = over.connect(17, cntlid)
    assert (c.sct, c.sc) == (1, 0x82), c
    for host in (over, io, admin):
        host.close()
