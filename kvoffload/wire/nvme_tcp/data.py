"""Data structures NVMe commands carry: Connect data, Identify structures, log pages and the KV
List data, each with `pack()` (the controller builds it) and `unpack()` (the host reads it).

Offsets follow `shared/ref/nvme-tcp-kv.md` §1.9, §2.4, §2.6, §2.8 and §3.1; unlisted bytes are
zero. Sans-I/O; shared by the daemon and the SDK host.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvoffload.errors import LocalProtocolError
from kvoffload.wire.nvme_tcp.cmd import KEY_MAX

__all__ = [
    "CONNECT_DATA_BYTES",
    "DYNAMIC_CNTLID",
    "IDENTIFY_BYTES",
    "Cns",
    "ConnectData",
    "Csi",
    "EffectsLog",
    "IdentifyController",
    "KvNamespace",
    "Lid",
    "NamespaceIndependent",
    "Nidt",
    "NvmNamespaceShim",
    "SmartLog",
    "active_namespaces",
    "descriptors",
    "kv_controller",
    "list_data",
    "nqn_bytes",
    "pack_active_namespaces",
    "pack_descriptors",
    "pack_list_data",
]

IDENTIFY_BYTES = 4096
CONNECT_DATA_BYTES = 1024
DYNAMIC_CNTLID = 0xFFFF
NQN_FIELD = 256
NQN_MAX = 223  # NVMe: an NQN is at most 223 bytes of UTF-8


class Cns(enum.IntEnum):
    NAMESPACE = 0x00
    CONTROLLER = 0x01
    ACTIVE_NAMESPACES = 0x02
    DESCRIPTORS = 0x03
    CSI_NAMESPACE = 0x05
    CSI_CONTROLLER = 0x06
    INDEPENDENT_NAMESPACE = 0x08


class Csi(enum.IntEnum):
    NVM = 0x00
    KV = 0x01
    ZNS = 0x02


class Nidt(enum.IntEnum):
    EUI64 = 0x01
    NGUID = 0x02
    UUID = 0x03
    CSI = 0x04


class Lid(enum.IntEnum):
    ERROR = 0x01
    SMART = 0x02
    FIRMWARE_SLOT = 0x03
    EFFECTS = 0x05


def nqn_bytes(nqn: str) -> bytes:
    """An NQN as the NUL-padded 256-byte field of Connect data and Identify Controller.

    Raises:
        LocalProtocolError: empty, not ASCII-printable, or longer than 223 bytes.
    """
    raw = nqn.encode("utf-8", "replace")
    if not raw or len(raw) > NQN_MAX or not nqn.isprintable():
        raise LocalProtocolError(f"not a usable NQN: {nqn!r}")
    return raw.ljust(NQN_FIELD, b"\0")


def _nqn(raw: bytes | memoryview) -> str:
    return bytes(raw).split(b"\0", 1)[0].decode("utf-8", "replace")


def _text(value: str, size: int) -> bytes:
    """An ASCII field padded with spaces (SN, MN, FR)."""
    return value.encode("ascii", "replace")[:size].ljust(size, b" ")


# ---------------------------------------------------------------------------- Connect

_CONNECT = struct.Struct("<16sH238s256s256s256s")


@dataclass(frozen=True, slots=True)
class ConnectData:
    """The 1024 bytes that follow a Fabrics Connect command in its capsule."""

    hostid: bytes
    cntlid: int
    subnqn: str
    hostnqn: str

    def pack(self) -> bytes:
        if len(self.hostid) != 16:
            raise LocalProtocolError("HOSTID is 16 bytes")
        return _CONNECT.pack(
            self.hostid,
            self.cntlid,
            b"",
            nqn_bytes(self.subnqn),
            nqn_bytes(self.hostnqn),
            b"",
        )

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> ConnectData:
        if len(raw) < CONNECT_DATA_BYTES:
            raise LocalProtocolError(f"Connect data of {len(raw)} bytes (1024 expected)")
        hostid, cntlid, _, sub, host, _ = _CONNECT.unpack_from(raw)
        return cls(bytes(hostid), cntlid, _nqn(sub), _nqn(host))


# Byte offsets of Connect data fields, for the IPO of a refused Connect (IATTR = 1).
CONNECT_DATA_CNTLID = 16
CONNECT_DATA_SUBNQN = 256
CONNECT_DATA_HOSTNQN = 512


# ---------------------------------------------------------------------------- Identify


def _put(buf: bytearray, fmt: str, offset: int, *values: object) -> None:
    struct.pack_into("<" + fmt, buf, offset, *values)


@dataclass(frozen=True, slots=True)
class IdentifyController:
    """Identify Controller (CNS 01h): the fields this target sets and hosts check."""

    cntlid: int
    subnqn: str
    sn: str = ""
    mn: str = "kvoffload"
    fr: str = ""
    vid: int = 0
    ssvid: int = 0
    cmic: int = 0x02  # several controllers (hosts) may share the subsystem
    mdts: int = 0
    ver: int = 0x00020000
    oaes: int = 0
    ctratt: int = 0
    cntrltype: int = 1  # I/O controller
    acl: int = 3
    aerl: int = 3  # 0's based: four AERs may be outstanding
    lpa: int = 0x02  # Commands Supported and Effects log page
    kas: int = 1  # keep-alive granularity, 100 ms units
    sqes: int = 0x66
    cqes: int = 0x44
    maxcmd: int = 128
    nn: int = 1
    sgls: int = 0x00100001  # SGLs supported, SGL offset supported
    ioccsz: int = 4
    iorcsz: int = 1
    icdoff: int = 0
    fcatt: int = 0  # dynamic controller model
    msdbd: int = 1

    def pack(self) -> bytes:
        b = bytearray(IDENTIFY_BYTES)
        _put(b, "HH20s40s8s", 0, self.vid, self.ssvid, _text(self.sn, 20), _text(self.mn, 40),
             _text(self.fr, 8))  # fmt: skip
        _put(b, "BBHI", 76, self.cmic, self.mdts, self.cntlid, self.ver)
        _put(b, "II", 92, self.oaes, self.ctratt)
        _put(b, "B", 111, self.cntrltype)
        _put(b, "BB", 258, self.acl, self.aerl)
        _put(b, "B", 261, self.lpa)
        _put(b, "H", 320, self.kas)
        _put(b, "BBHI", 512, self.sqes, self.cqes, self.maxcmd, self.nn)
        _put(b, "I", 536, self.sgls)
        b[768 : 768 + NQN_FIELD] = nqn_bytes(self.subnqn)
        _put(b, "IIHBB", 1792, self.ioccsz, self.iorcsz, self.icdoff, self.fcatt, self.msdbd)
        return bytes(b)

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> IdentifyController:
        _need(raw, 1806, "Identify Controller")
        vid, ssvid, sn, mn, fr = struct.unpack_from("<HH20s40s8s", raw, 0)
        cmic, mdts, cntlid, ver = struct.unpack_from("<BBHI", raw, 76)
        oaes, ctratt = struct.unpack_from("<II", raw, 92)
        acl, aerl = struct.unpack_from("<BB", raw, 258)
        sqes, cqes, maxcmd, nn = struct.unpack_from("<BBHI", raw, 512)
        ioccsz, iorcsz, icdoff, fcatt, msdbd = struct.unpack_from("<IIHBB", raw, 1792)
        return cls(
            cntlid=cntlid,
            subnqn=_nqn(raw[768 : 768 + NQN_FIELD]),
            sn=sn.decode("ascii", "replace").rstrip(),
            mn=mn.decode("ascii", "replace").rstrip(),
            fr=fr.decode("ascii", "replace").rstrip(),
            vid=vid,
            ssvid=ssvid,
            cmic=cmic,
            mdts=mdts,
            ver=ver,
            oaes=oaes,
            ctratt=ctratt,
            cntrltype=raw[111],
            acl=acl,
            aerl=aerl,
            lpa=raw[261],
            kas=struct.unpack_from("<H", raw, 320)[0],
            sqes=sqes,
            cqes=cqes,
            maxcmd=maxcmd,
            nn=nn,
            sgls=struct.unpack_from("<I", raw, 536)[0],
            ioccsz=ioccsz,
            iorcsz=iorcsz,
            icdoff=icdoff,
            fcatt=fcatt,
            msdbd=msdbd,
        )

    @property
    def in_capsule_bytes(self) -> int:
        """Largest in-capsule data an I/O command may carry (IOCCSZ × 16 − 64)."""
        return max(0, self.ioccsz * 16 - 64)


def _need(raw: bytes | memoryview, n: int, what: str) -> None:
    if len(raw) < n:
        raise LocalProtocolError(f"{what}: {len(raw)} bytes, at least {n} expected")


@dataclass(frozen=True, slots=True)
class KvNamespace:
    """KV command-set Identify Namespace (CNS 05h, CSI 01h) with one KV format."""

    nsze: int  # capacity in bytes
    nuse: int  # bytes in use
    max_value: int  # KVVML of format 0
    max_key: int = KEY_MAX  # KVKML
    nguid: bytes = bytes(16)
    nmic: int = 1  # may be attached to several controllers
    novg: int = 4096
    max_keys: int = 0  # MNKS, 0 = not reported

    def pack(self) -> bytes:
        b = bytearray(IDENTIFY_BYTES)
        _put(b, "Q8xQBBB", 0, self.nsze, self.nuse, 0, 0, self.nmic)  # NSFEAT, NKVF (0's based)
        _put(b, "I", 32, self.novg)
        b[48:64] = self.nguid
        _put(b, "H2xII", 72, self.max_key, self.max_value, self.max_keys)
        return bytes(b)

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> KvNamespace:
        _need(raw, 88, "KV Identify Namespace")
        nsze, nuse = struct.unpack_from("<Q8xQ", raw, 0)
        max_key, max_value, max_keys = struct.unpack_from("<H2xII", raw, 72)
        return cls(
            nsze,
            nuse,
            max_value,
            max_key,
            bytes(raw[48:64]),
            raw[26],
            struct.unpack_from("<I", raw, 32)[0],
            max_keys,
        )


@dataclass(frozen=True, slots=True)
class NvmNamespaceShim:
    """An NVM-shaped Identify Namespace (CNS 00h) for the KV namespace: SPDK's host counts a
    namespace as active only if NCAP != 0 here, even a KV one (ref §2.6)."""

    blocks: int  # NSZE = NCAP, in 4 KiB units
    used_blocks: int
    nguid: bytes = bytes(16)
    nmic: int = 1

    def pack(self) -> bytes:
        b = bytearray(IDENTIFY_BYTES)
        _put(b, "QQQ", 0, self.blocks, self.blocks, self.used_blocks)
        _put(b, "B", 30, self.nmic)
        b[104:120] = self.nguid
        _put(b, "HBB", 128, 0, 12, 0)  # LBAF0: no metadata, 2^12-byte blocks
        return bytes(b)

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> NvmNamespaceShim:
        _need(raw, 132, "Identify Namespace")
        nsze, _, nuse = struct.unpack_from("<QQQ", raw, 0)
        return cls(nsze, nuse, bytes(raw[104:120]), raw[30])

    @property
    def ncap(self) -> int:
        return self.blocks


@dataclass(frozen=True, slots=True)
class NamespaceIndependent:
    """I/O Command Set Independent Identify Namespace (CNS 08h)."""

    nmic: int = 1
    ready: bool = True  # NSTAT.NRDY: Linux drops a non-NVM namespace that is not ready

    def pack(self) -> bytes:
        b = bytearray(IDENTIFY_BYTES)
        b[1] = self.nmic
        b[14] = int(self.ready)
        return bytes(b)

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> NamespaceIndependent:
        _need(raw, 16, "Independent Identify Namespace")
        return cls(raw[1], bool(raw[14] & 1))


def kv_controller(version: int = 0x00010300) -> bytes:
    """KV command-set Identify Controller (CNS 06h, CSI 01h): only VER (KV spec 1.3)."""
    b = bytearray(IDENTIFY_BYTES)
    _put(b, "I", 0, version)
    return bytes(b)


def pack_active_namespaces(nsids: Iterable[int], above: int) -> bytes:
    """Active Namespace ID list (CNS 02h): NSIDs greater than `above`, ascending, zero-ended."""
    chosen = sorted(n for n in nsids if n > above)[:1024]
    b = bytearray(IDENTIFY_BYTES)
    struct.pack_into(f"<{len(chosen)}I", b, 0, *chosen)
    return bytes(b)


def active_namespaces(raw: bytes | memoryview) -> list[int]:
    out = []
    for (nsid,) in struct.iter_unpack("<I", bytes(raw[: len(raw) // 4 * 4])):
        if nsid == 0:
            break
        out.append(nsid)
    return out


_NID_LENGTH = {Nidt.EUI64: 8, Nidt.NGUID: 16, Nidt.UUID: 16, Nidt.CSI: 1}


def pack_descriptors(items: Sequence[tuple[int, bytes]]) -> bytes:
    """Namespace Identification Descriptor list (CNS 03h): NIDT, NIDL, 2 reserved, NID."""
    b = bytearray(IDENTIFY_BYTES)
    pos = 0
    for nidt, nid in items:
        b[pos : pos + 4 + len(nid)] = bytes((nidt, len(nid), 0, 0)) + nid
        pos += 4 + len(nid)
    return bytes(b)


def descriptors(raw: bytes | memoryview) -> dict[int, bytes]:
    """NIDT -> NID of a descriptor list (ends at NIDL = 0).

    Raises:
        LocalProtocolError: a descriptor runs past the end or has the wrong length for its type.
    """
    out: dict[int, bytes] = {}
    pos = 0
    while pos + 4 <= len(raw):
        nidt, nidl = raw[pos], raw[pos + 1]
        if nidl == 0:
            break
        if pos + 4 + nidl > len(raw) or _NID_LENGTH.get(nidt, nidl) != nidl:  # type: ignore[call-overload]
            raise LocalProtocolError(f"bad namespace descriptor {nidt:#x} of {nidl} bytes")
        out[nidt] = bytes(raw[pos + 4 : pos + 4 + nidl])
        pos += 4 + nidl
    return out


# ---------------------------------------------------------------------------- log pages


@dataclass(frozen=True, slots=True)
class EffectsLog:
    """Commands Supported and Effects (LID 05h): opcode -> effects dword (bit 0 CSUPP)."""

    admin: Mapping[int, int] = field(default_factory=dict)
    io: Mapping[int, int] = field(default_factory=dict)

    def pack(self) -> bytes:
        b = bytearray(4096)
        for opc, bits in self.admin.items():
            _put(b, "I", 4 * opc, bits)
        for opc, bits in self.io.items():
            _put(b, "I", 1024 + 4 * opc, bits)
        return bytes(b)

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> EffectsLog:
        _need(raw, 2048, "Commands Supported and Effects log")
        words = struct.unpack_from("<512I", raw)
        return cls(
            {i: w for i, w in enumerate(words[:256]) if w},
            {i: w for i, w in enumerate(words[256:]) if w},
        )


@dataclass(frozen=True, slots=True)
class SmartLog:
    """SMART / Health Information (LID 02h), the fields this store can fill."""

    temperature_k: int = 0  # composite temperature; 0 = not reported
    available_spare: int = 100
    spare_threshold: int = 10
    percentage_used: int = 0
    data_units_read: int = 0  # thousands of 512-byte units
    data_units_written: int = 0
    host_reads: int = 0
    host_writes: int = 0
    power_on_hours: int = 0

    def pack(self) -> bytes:
        b = bytearray(512)
        _put(b, "BHBBB", 0, 0, self.temperature_k, self.available_spare, self.spare_threshold,
             self.percentage_used)  # fmt: skip
        for offset, value in (
            (32, self.data_units_read),
            (48, self.data_units_written),
            (64, self.host_reads),
            (80, self.host_writes),
            (128, self.power_on_hours),
        ):
            _put(b, "QQ", offset, value & (2**64 - 1), value >> 64)
        return bytes(b)

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> SmartLog:
        _need(raw, 144, "SMART log")
        _, temp, spare, threshold, used = struct.unpack_from("<BHBBB", raw, 0)

        def u128(offset: int) -> int:
            lo, hi = struct.unpack_from("<QQ", raw, offset)
            return int(lo | (hi << 64))

        return cls(temp, spare, threshold, used, u128(32), u128(48), u128(64), u128(80), u128(128))


# ---------------------------------------------------------------------------- KV List


def pack_list_data(keys: Sequence[bytes], limit: int) -> tuple[bytes, int]:
    """The KV List data structure for as many of `keys` as fit in `limit` bytes.

    Layout [?] (ref §2.4, the NetApp SPDK-fork form): u32 number of returned keys, then per key
    u16 key length, the key, and zero padding so each entry (2 + KL) is a multiple of 4 bytes.

    Returns:
        (the structure, the number of keys in it).
    """
    out = bytearray(4)
    count = 0
    for key in keys:
        entry = struct.pack("<H", len(key)) + key
        entry += bytes(-len(entry) % 4)
        if len(out) + len(entry) > limit:
            break
        out += entry
        count += 1
    struct.pack_into("<I", out, 0, count)
    return bytes(out), count


def list_data(raw: bytes | memoryview) -> list[bytes]:
    """Keys of a KV List data structure (possibly cut short by the host's buffer).

    Raises:
        LocalProtocolError: an entry claims a key longer than 16 bytes.
    """
    if len(raw) < 4:
        return []
    (count,) = struct.unpack_from("<I", raw, 0)
    keys: list[bytes] = []
    pos = 4
    while len(keys) < count and pos + 2 <= len(raw):
        (kl,) = struct.unpack_from("<H", raw, pos)
        if not 0 < kl <= KEY_MAX:
            raise LocalProtocolError(f"List entry with a {kl}-byte key")
        if pos + 2 + kl > len(raw):
            break
        keys.append(bytes(raw[pos + 2 : pos + 2 + kl]))
        pos += (2 + kl + 3) // 4 * 4
    return keys
