"""NVMe commands as NVMe/TCP carries them: the 64-byte SQE, the 16-byte CQE, SGL descriptors,
opcodes, status codes, and builders for the Fabrics, Admin and Key Value commands.

Sans-I/O and shared by the daemon's NVMe/TCP front and the SDK's `nvme+tcp://` host. Byte
layouts follow `shared/ref/nvme-tcp-kv.md` (§1.4, §1.6, §1.9, §2.2); every multi-byte field is
little-endian.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from kvoffload.errors import LocalProtocolError

__all__ = [
    "CQE",
    "FABRICS",
    "KEY_MAX",
    "NULL_SGL",
    "PSDT_SGL",
    "SGL_IN_CAPSULE",
    "SGL_TRANSPORT",
    "SQE",
    "AdminOpc",
    "CmdSc",
    "Command",
    "Completion",
    "Direction",
    "FabricsType",
    "KvOpc",
    "Sc",
    "Sct",
    "Sgl",
    "StoreOption",
    "abort",
    "async_event",
    "connect",
    "direction",
    "disconnect",
    "get_features",
    "get_log_page",
    "identify",
    "keep_alive",
    "kv_delete",
    "kv_exist",
    "kv_key",
    "kv_list",
    "kv_retrieve",
    "kv_store",
    "property_get",
    "property_set",
    "set_features",
]

# opc, flags, cid, nsid, cdw2, cdw3, mptr, sgl address, sgl length, sgl reserved, sgl type,
# cdw10..cdw15
SQE = struct.Struct("<BBHIIIQQI3sBIIIIII")
CQE = struct.Struct("<IIHHHH")  # dw0, dw1, sqhd, sqid, cid, status
assert SQE.size == 64 and CQE.size == 16

PSDT_SGL = 0x40  # CDW0 bits 7:6 = 01b: data pointer is an SGL (the only form over fabrics)
SGL_IN_CAPSULE = 0x01  # Data Block descriptor, Offset subtype: data is in the capsule
SGL_TRANSPORT = 0x5A  # Transport SGL Data Block: data moves by R2T/H2CData or C2HData
FABRICS = 0x7F
KEY_MAX = 16  # KVKML: the largest key the KV command set carries in the SQE


class AdminOpc(enum.IntEnum):
    GET_LOG_PAGE = 0x02
    IDENTIFY = 0x06
    ABORT = 0x08
    SET_FEATURES = 0x09
    GET_FEATURES = 0x0A
    ASYNC_EVENT = 0x0C
    KEEP_ALIVE = 0x18


class FabricsType(enum.IntEnum):
    """FCTYPE, SQE byte 4 of a Fabrics command (opcode 7Fh)."""

    PROPERTY_SET = 0x00
    CONNECT = 0x01
    PROPERTY_GET = 0x04
    AUTH_SEND = 0x05
    AUTH_RECEIVE = 0x06
    DISCONNECT = 0x08


class KvOpc(enum.IntEnum):
    """The Key Value command set (CSI 01h) I/O opcodes."""

    STORE = 0x01
    RETRIEVE = 0x02
    LIST = 0x06
    DELETE = 0x10
    EXIST = 0x14


class StoreOption(enum.IntFlag):
    """Store CDW11 bits 15:8."""

    ONLY_IF_EXISTS = 0x01  # "do not store if the key does not exist"
    ONLY_IF_ABSENT = 0x02  # "do not store if the key exists"
    NO_COMPRESS = 0x04  # accepted and ignored: the store never compresses


class Direction(enum.Enum):
    NONE = 0
    TO_CONTROLLER = 1  # host -> controller: in-capsule or R2T/H2CData
    TO_HOST = 2  # controller -> host: C2HData
    BOTH = 3


_FABRICS_DIRECTION: dict[int, Direction] = {
    FabricsType.AUTH_SEND: Direction.TO_CONTROLLER,
    FabricsType.AUTH_RECEIVE: Direction.TO_HOST,
    # Connect's 1024 data bytes always travel in the capsule.
    FabricsType.CONNECT: Direction.TO_CONTROLLER,
}


def direction(opc: int, fctype: int = 0) -> Direction:
    """Which way a command's data moves: opcode bits 1:0 (Fabrics: by command type)."""
    if opc == FABRICS:
        return _FABRICS_DIRECTION.get(fctype, Direction.NONE)
    return Direction(opc & 0x3)


class Sct(enum.IntEnum):
    GENERIC = 0
    COMMAND_SPECIFIC = 1


class Sc(enum.IntEnum):
    """Generic command status codes (SCT 0), the KV command set's included."""

    SUCCESS = 0x00
    INVALID_OPCODE = 0x01
    INVALID_FIELD = 0x02
    DATA_TRANSFER_ERROR = 0x04
    INTERNAL = 0x06
    INVALID_NAMESPACE = 0x0B
    COMMAND_SEQUENCE = 0x0C
    SGL_LENGTH_INVALID = 0x0F
    SGL_TYPE_INVALID = 0x11
    SGL_OFFSET_INVALID = 0x16
    TRANSIENT_TRANSPORT = 0x22
    CAPACITY_EXCEEDED = 0x81
    NAMESPACE_NOT_READY = 0x82
    KV_INVALID_VALUE_SIZE = 0x85
    KV_INVALID_KEY_SIZE = 0x86
    KV_KEY_NOT_EXISTS = 0x87
    KV_UNRECOVERED = 0x88
    KV_KEY_EXISTS = 0x89


class CmdSc(enum.IntEnum):
    """Command specific status codes (SCT 1) used here."""

    AER_LIMIT = 0x05
    INVALID_LOG_PAGE = 0x09
    CONNECT_INCOMPATIBLE_FORMAT = 0x80
    CONNECT_CONTROLLER_BUSY = 0x81
    CONNECT_INVALID_PARAMETERS = 0x82
    CONNECT_INVALID_HOST = 0x84
    FEATURE_NOT_SAVEABLE = 0x0D


_U8, _U16, _U32, _U64 = 0xFF, 0xFFFF, 0xFFFF_FFFF, (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class Sgl:
    """SGL descriptor 1 (SQE bytes 24..39)."""

    address: int = 0
    length: int = 0
    type: int = SGL_TRANSPORT

    def __post_init__(self) -> None:
        if not (0 <= self.address <= _U64 and 0 <= self.length <= _U32 and 0 <= self.type <= _U8):
            raise LocalProtocolError(f"SGL field out of range: {self}")

    @property
    def transport_length(self) -> int:
        """Bytes the transport moves for this descriptor (R2T/H2CData or C2HData): its length
        unless the data is in the capsule. Like Linux's target, every descriptor other than
        the in-capsule one counts as transport data, whatever its type and subtype say: over
        TCP the address means nothing, and a host that sends 0x50 or 0x00 still means "move
        this many bytes"."""
        return 0 if self.type == SGL_IN_CAPSULE else self.length


NULL_SGL = Sgl()


@dataclass(frozen=True, slots=True)
class Command:
    """One submission queue entry. For Fabrics commands `nsid`'s low byte is FCTYPE."""

    opc: int
    cid: int = 0
    nsid: int = 0
    cdw2: int = 0
    cdw3: int = 0
    sgl: Sgl = NULL_SGL
    cdw10: int = 0
    cdw11: int = 0
    cdw12: int = 0
    cdw13: int = 0
    cdw14: int = 0
    cdw15: int = 0
    flags: int = PSDT_SGL
    mptr: int = 0

    def __post_init__(self) -> None:
        if not (
            0 <= self.opc <= _U8
            and 0 <= self.flags <= _U8
            and 0 <= self.cid <= _U16
            and 0 <= self.mptr <= _U64
            and all(
                0 <= v <= _U32
                for v in (
                    self.nsid,
                    self.cdw2,
                    self.cdw3,
                    self.cdw10,
                    self.cdw11,
                    self.cdw12,
                    self.cdw13,
                    self.cdw14,
                    self.cdw15,
                )
            )
        ):
            raise LocalProtocolError(f"SQE field out of range: {self}")

    @property
    def fctype(self) -> int:
        return self.nsid & 0xFF

    @property
    def direction(self) -> Direction:
        return direction(self.opc, self.fctype)

    def pack(self) -> bytes:
        s = self.sgl
        return SQE.pack(
            self.opc,
            self.flags,
            self.cid,
            self.nsid,
            self.cdw2,
            self.cdw3,
            self.mptr,
            s.address,
            s.length,
            b"\0\0\0",
            s.type,
            self.cdw10,
            self.cdw11,
            self.cdw12,
            self.cdw13,
            self.cdw14,
            self.cdw15,
        )

    @classmethod
    def unpack(cls, raw: bytes | memoryview, offset: int = 0) -> Command:
        (
            opc,
            flags,
            cid,
            nsid,
            c2,
            c3,
            mptr,
            addr,
            length,
            _,
            stype,
            d10,
            d11,
            d12,
            d13,
            d14,
            d15,
        ) = SQE.unpack_from(raw, offset)
        sgl = Sgl(addr, length, stype)
        return cls(opc, cid, nsid, c2, c3, sgl, d10, d11, d12, d13, d14, d15, flags, mptr)


@dataclass(frozen=True, slots=True)
class Completion:
    """One completion queue entry; `status` is the raw 16-bit field (phase bit 0 over fabrics)."""

    cid: int
    status: int = 0
    dw0: int = 0
    dw1: int = 0
    sqhd: int = 0
    sqid: int = 0

    def __post_init__(self) -> None:
        if not (
            0 <= self.cid <= _U16
            and 0 <= self.status <= _U16
            and 0 <= self.dw0 <= _U32
            and 0 <= self.dw1 <= _U32
            and 0 <= self.sqhd <= _U16
            and 0 <= self.sqid <= _U16
        ):
            raise LocalProtocolError(f"CQE field out of range: {self}")

    @staticmethod
    def encode_status(sct: int, sc: int, *, dnr: bool = True, more: bool = False) -> int:
        return (sc << 1) | (sct << 9) | (more << 14) | (dnr << 15)

    @property
    def sc(self) -> int:
        return (self.status >> 1) & 0xFF

    @property
    def sct(self) -> int:
        return (self.status >> 9) & 0x7

    @property
    def dnr(self) -> bool:
        return bool(self.status & 0x8000)

    @property
    def ok(self) -> bool:
        return self.sc == 0 and self.sct == 0

    def pack(self) -> bytes:
        return CQE.pack(self.dw0, self.dw1, self.sqhd, self.sqid, self.cid, self.status)

    @classmethod
    def unpack(cls, raw: bytes | memoryview, offset: int = 0) -> Completion:
        dw0, dw1, sqhd, sqid, cid, status = CQE.unpack_from(raw, offset)
        return cls(cid, status, dw0, dw1, sqhd, sqid)


# ---------------------------------------------------------------------------- Fabrics builders


def connect(cid: int, qid: int, sqsize: int, kato_ms: int = 0, cattr: int = 0) -> Command:
    """Fabrics Connect; its 1024-byte data (`nvme_data.ConnectData`) travels in the capsule.

    `sqsize` is 0's based (the queue holds sqsize + 1 commands).
    """
    return Command(
        FABRICS,
        cid,
        FabricsType.CONNECT,
        sgl=Sgl(0, 1024, SGL_IN_CAPSULE),
        cdw10=qid << 16,  # RECFMT 0 in bits 15:0
        cdw11=sqsize | (cattr << 16),
        cdw12=kato_ms,
    )


def property_get(cid: int, offset: int, eight: bool) -> Command:
    return Command(FABRICS, cid, FabricsType.PROPERTY_GET, cdw10=int(eight), cdw11=offset)


def property_set(cid: int, offset: int, value: int, eight: bool = False) -> Command:
    return Command(
        FABRICS,
        cid,
        FabricsType.PROPERTY_SET,
        cdw10=int(eight),
        cdw11=offset,
        cdw12=value & _U32,
        cdw13=value >> 32,
    )


def disconnect(cid: int) -> Command:
    return Command(FABRICS, cid, FabricsType.DISCONNECT, cdw10=0)


# ---------------------------------------------------------------------------- Admin builders


def identify(cid: int, cns: int, nsid: int = 0, csi: int = 0, length: int = 4096) -> Command:
    return Command(AdminOpc.IDENTIFY, cid, nsid, sgl=Sgl(0, length), cdw10=cns, cdw11=csi << 24)


def get_log_page(
    cid: int, lid: int, length: int, *, csi: int = 0, offset: int = 0, nsid: int = _U32
) -> Command:
    numd = length // 4 - 1  # 0's based dwords
    return Command(
        AdminOpc.GET_LOG_PAGE,
        cid,
        nsid,
        sgl=Sgl(0, length),
        cdw10=lid | ((numd & 0xFFFF) << 16),
        cdw11=numd >> 16,
        cdw12=offset & _U32,
        cdw13=offset >> 32,
        cdw14=csi << 24,
    )


def set_features(cid: int, fid: int, cdw11: int) -> Command:
    return Command(AdminOpc.SET_FEATURES, cid, cdw10=fid, cdw11=cdw11)


def get_features(cid: int, fid: int) -> Command:
    return Command(AdminOpc.GET_FEATURES, cid, cdw10=fid)


def keep_alive(cid: int) -> Command:
    return Command(AdminOpc.KEEP_ALIVE, cid)


def async_event(cid: int) -> Command:
    return Command(AdminOpc.ASYNC_EVENT, cid)


def abort(cid: int, sqid: int, target_cid: int) -> Command:
    return Command(AdminOpc.ABORT, cid, cdw10=sqid | (target_cid << 16))


# ---------------------------------------------------------------------------- KV builders


def _key_fields(key: bytes) -> tuple[int, int, int, int]:
    if not 0 <= len(key) <= KEY_MAX:
        raise LocalProtocolError(f"a KV key has 1 to {KEY_MAX} bytes, got {len(key)}")
    # Byte copy: key[0:8] into CDW2..3, key[8:16] into CDW14..15, zero-filled beyond KL.
    padded = key.ljust(KEY_MAX, b"\0")
    c2, c3, c14, c15 = struct.unpack("<IIII", padded)
    return c2, c3, c14, c15


def _kv(
    opc: int, cid: int, nsid: int, key: bytes, sgl: Sgl, cdw10: int, options: int = 0
) -> Command:
    c2, c3, c14, c15 = _key_fields(key)
    return Command(
        opc,
        cid,
        nsid,
        c2,
        c3,
        sgl,
        cdw10=cdw10,
        cdw11=len(key) | (options << 8),
        cdw14=c14,
        cdw15=c15,
    )


def kv_store(
    cid: int, nsid: int, key: bytes, length: int, *, in_capsule: bool, options: int = 0
) -> Command:
    """Store `length` value bytes: in the capsule, or fetched by the controller with R2T."""
    sgl = Sgl(0, length, SGL_IN_CAPSULE if in_capsule else SGL_TRANSPORT)
    return _kv(KvOpc.STORE, cid, nsid, key, sgl, length, options)


def kv_retrieve(cid: int, nsid: int, key: bytes, buffer_size: int) -> Command:
    return _kv(KvOpc.RETRIEVE, cid, nsid, key, Sgl(0, buffer_size), buffer_size)


def kv_exist(cid: int, nsid: int, key: bytes) -> Command:
    return _kv(KvOpc.EXIST, cid, nsid, key, NULL_SGL, 0)


def kv_delete(cid: int, nsid: int, key: bytes) -> Command:
    return _kv(KvOpc.DELETE, cid, nsid, key, NULL_SGL, 0)


def kv_list(cid: int, nsid: int, start: bytes, buffer_size: int) -> Command:
    """List keys from `start` on (b"" = from the beginning)."""
    return _kv(KvOpc.LIST, cid, nsid, start, Sgl(0, buffer_size), buffer_size)


def kv_key(cmd: Command) -> bytes:
    """The key a KV command carries (its length is CDW11 bits 7:0; callers check the range)."""
    raw = struct.pack("<IIII", cmd.cdw2, cmd.cdw3, cmd.cdw14, cmd.cdw15)
    return raw[: min(cmd.cdw11 & 0xFF, KEY_MAX)]
