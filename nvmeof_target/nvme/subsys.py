"""NVMe subsystems, namespaces and controllers of the NVMe/TCP front: who may connect, what each
controller sees, its properties and features, and the Identify and log page data it returns.

No sockets here: `nvme.py` drives these objects from the event loop. Values follow
`shared/ref/nvme-tcp-kv.md` §1.9 (properties), §2.6-2.8 (Identify, logs, features) and §3.1
(Identify Controller).
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from blake3 import blake3

from kvoffload import __version__
from kvoffload.errors import KVOffloadError
from kvoffload.nvmeof_target.config import NvmeConfig, SubsystemConfig
from kvoffload.nvmeof_target.nvme.keydir import KeyDirectory
from kvoffload.nvmeof_target.tenants import Tenant
from kvoffload.wire.nvme_tcp import data as nd
from kvoffload.wire.nvme_tcp.cmd import (
    FABRICS,
    KEY_MAX,
    SGL_IN_CAPSULE,
    AdminOpc,
    CmdSc,
    Command,
    Completion,
    KvOpc,
    Sc,
    Sct,
)

__all__ = [
    "CommandFailed",
    "Controller",
    "NvmeNamespace",
    "StoreInfo",
    "Subsystem",
    "build_subsystems",
]

# Property offsets and their sizes (bytes).
CAP, VS, CC, CSTS = 0x00, 0x08, 0x14, 0x1C
_PROPERTY_SIZE = {CAP: 8, VS: 4, CC: 4, CSTS: 4}
VERSION = 0x00020000  # NVMe 2.0: Linux then reads the I/O-command-set-independent namespace
# CC fields
CC_EN = 0x1
CC_SHN_SHIFT, CC_SHN_MASK = 14, 0x3
CSTS_RDY, CSTS_CFS = 0x1, 0x2
CSTS_SHST_DONE = 0x2 << 2
# Features
FID_NUM_QUEUES, FID_ASYNC_EVENT, FID_KATO = 0x07, 0x0B, 0x0F
AER_LIMIT = 4  # Identify AERL + 1
# Zeros a Get Log Page may read past a page's end (hosts that read a fixed 4 KiB); more is
# Invalid Field rather than memory and bandwidth spent on nothing.
LOG_PAD_MAX = 64 << 10
KAS_MS = 100  # keep-alive granularity (Identify KAS = 1)
_CSUPP, _LBCC = 0x1, 0x2


class CommandFailed(KVOffloadError):
    """A command completes with this NVMe status (raised inside handlers, answered by the
    queue: never escapes the front)."""

    def __init__(self, sct: int, sc: int, message: str = "", *, dnr: bool = True, dw0: int = 0):
        super().__init__(message or f"SCT {sct:#x} SC {sc:#04x}")
        self.status = Completion.encode_status(sct, sc, dnr=dnr)
        self.dw0 = dw0


def invalid_field(why: str = "") -> CommandFailed:
    return CommandFailed(Sct.GENERIC, Sc.INVALID_FIELD, why)


def connect_invalid(ipo: int, in_data: bool, why: str) -> CommandFailed:
    """Connect Invalid Parameters: DW0 holds the offset of the bad field (IPO) and whether it is
    in the Connect data (IATTR)."""
    return CommandFailed(
        Sct.COMMAND_SPECIFIC,
        CmdSc.CONNECT_INVALID_PARAMETERS,
        why,
        dw0=ipo | (int(in_data) << 16),
    )


@dataclass(frozen=True)
class StoreInfo:
    """What Identify and SMART report about the store, read when asked."""

    capacity_bytes: int
    used_bytes: int
    bytes_read: int
    bytes_written: int
    reads: int
    writes: int
    uptime_s: float


@dataclass
class NvmeNamespace:
    """One KV namespace: a tenant's key space, visible to some hosts."""

    nsid: int
    tenant: Tenant
    hosts: frozenset[str]
    nguid: bytes
    directory: KeyDirectory = field(default_factory=KeyDirectory)

    def visible_to(self, hostnqn: str) -> bool:
        return not self.hosts or hostnqn in self.hosts

    @staticmethod
    def block_key(key: bytes) -> bytes:
        """The 16-byte block key of a namespace key of 1..16 bytes. 16-byte keys (the SDK's
        block keys) are used as they are, so the native front and NVMe hosts of one tenant
        share blocks; shorter keys are hashed with their length so that no two collide."""
        if len(key) == KEY_MAX:
            return key
        hasher = blake3(b"kvoffload short key\0" + bytes((len(key),)) + key)
        digest: bytes = hasher.digest(length=KEY_MAX)
        return digest

    def engine_key(self, key: bytes) -> bytes:
        """The engine key: the block key mixed with the namespace's tenant."""
        return self.tenant.key(self.block_key(key))


@dataclass
class Subsystem:
    nqn: str
    allow_hosts: frozenset[str]
    namespaces: dict[int, NvmeNamespace]
    serial: str
    open_to_any: bool  # no allow list and bound to loopback

    def admits(self, hostnqn: str) -> bool:
        return hostnqn in self.allow_hosts if self.allow_hosts else self.open_to_any

    @property
    def nn(self) -> int:
        return max(self.namespaces, default=0)


def build_subsystems(config: NvmeConfig, tenant: Callable[[str], Tenant]) -> dict[str, Subsystem]:
    """The subsystems of the config, with each namespace's tenant resolved."""
    out = {}
    for sub in config.served:
        out[sub.nqn] = _subsystem(sub, config.loopback, tenant)
    return out


def _subsystem(sub: SubsystemConfig, loopback: bool, tenant: Callable[[str], Tenant]) -> Subsystem:
    namespaces = {
        ns.nsid: NvmeNamespace(
            ns.nsid,
            tenant(ns.tenant),
            frozenset(ns.hosts),
            blake3(f"kvoffload nguid\0{sub.nqn}\0{ns.nsid}".encode()).digest(length=16),
        )
        for ns in sub.active
    }
    serial = hashlib.sha256(sub.nqn.encode()).hexdigest()[:20]
    return Subsystem(sub.nqn, frozenset(sub.allow_hosts), namespaces, serial, loopback)


_CNTLIDS = itertools.count(1)


def next_cntlid(in_use: Mapping[int, object]) -> int:
    """A controller id not in use (1..0xFFEF; the values above are reserved)."""
    for _ in range(0xFFEF):
        cntlid = (next(_CNTLIDS) - 1) % 0xFFEF + 1
        if cntlid not in in_use:
            return cntlid
    raise CommandFailed(
        Sct.COMMAND_SPECIFIC, CmdSc.CONNECT_CONTROLLER_BUSY, "no free controller id"
    )


@dataclass
class Controller:
    """One host's association with a subsystem (dynamic controller model)."""

    cntlid: int
    subsystem: Subsystem
    hostnqn: str
    hostid: bytes
    kato_ms: int
    config: NvmeConfig
    cc: int = 0
    csts: int = 0
    aec: int = 0
    granted_queues: int = 0  # I/O queues granted by Set Features Number of Queues
    connected_queues: int = 0
    last_keep_alive: float = field(default_factory=time.monotonic)
    max_value: int = 0  # KVVML: the engine's largest value

    @property
    def io_queues(self) -> int:
        """I/O queues this controller admits: those granted by Set Features Number of Queues,
        or (a host that never sent it, as Linux nvmet allows) the subsystem's maximum."""
        return self.granted_queues or self.config.max_io_queues

    @property
    def namespaces(self) -> dict[int, NvmeNamespace]:
        return {
            nsid: ns
            for nsid, ns in self.subsystem.namespaces.items()
            if ns.visible_to(self.hostnqn)
        }

    def namespace(self, nsid: int) -> NvmeNamespace:
        """The namespace `nsid` as this controller sees it.

        Raises:
            CommandFailed: Invalid Namespace or Format (absent, or not attached to this host).
        """
        ns = self.subsystem.namespaces.get(nsid)
        if ns is None or not ns.visible_to(self.hostnqn):
            raise CommandFailed(Sct.GENERIC, Sc.INVALID_NAMESPACE, f"no namespace {nsid}")
        return ns

    @property
    def ready(self) -> bool:
        """Enabled, ready and not shut down: I/O and admin commands may run."""
        return bool(self.cc & CC_EN) and self.csts & (CSTS_RDY | CSTS_CFS | 0xC) == CSTS_RDY

    def keep_alive(self) -> None:
        self.last_keep_alive = time.monotonic()

    def expired(self, now: float) -> bool:
        return self.kato_ms > 0 and now - self.last_keep_alive > self.kato_ms / 1000

    # ------------------------------------------------------------------ properties

    @property
    def cap(self) -> int:
        mqes = self.config.queue_depth - 1
        css = 0x41  # NVM command set, and bit 6: one or more I/O command sets (KV) via CC.CSS
        timeout = 30  # CAP.TO, 500 ms units: how long a host waits for CSTS.RDY
        return mqes | (1 << 16) | (timeout << 24) | (css << 37)

    def property_get(self, offset: int, eight: bool) -> int:
        size = _PROPERTY_SIZE.get(offset)
        if size is None or (size == 8) != eight:
            raise invalid_field(f"no {8 if eight else 4}-byte property at {offset:#x}")
        values = {CAP: self.cap, VS: VERSION, CC: self.cc, CSTS: self.csts}
        return values[offset]

    def property_set(self, offset: int, value: int, eight: bool) -> None:
        if offset != CC or eight:
            raise invalid_field(f"property {offset:#x} is not writable")
        self.set_cc(value & 0xFFFF_FFFF)

    def set_cc(self, value: int) -> None:
        old, self.cc = self.cc, value
        if value & CC_EN and not old & CC_EN:
            iosqes, iocqes = (value >> 16) & 0xF, (value >> 20) & 0xF
            css, mps, ams = (value >> 4) & 0x7, (value >> 7) & 0xF, (value >> 11) & 0x7
            # CSS 0 (NVM) or 6 (every supported I/O command set); CAP allows only MPS 0, AMS 0.
            if (iosqes, iocqes, mps, ams) != (6, 4, 0, 0) or css not in (0, 6):
                self.csts |= CSTS_CFS
            else:
                self.csts = CSTS_RDY
        elif old & CC_EN and not value & CC_EN:
            self.csts = 0  # a reset: RDY, CFS and the shutdown status clear
        if (value >> CC_SHN_SHIFT) & CC_SHN_MASK:
            # Nothing to flush: acknowledged blocks are already in the engine.
            self.csts = (self.csts & ~0xC) | CSTS_SHST_DONE

    # ------------------------------------------------------------------ features

    def set_feature(self, fid: int, cdw11: int, save: bool) -> int:
        """Set Features; returns DW0."""
        if save:
            raise CommandFailed(Sct.COMMAND_SPECIFIC, CmdSc.FEATURE_NOT_SAVEABLE, "not saveable")
        if fid == FID_NUM_QUEUES:
            nsqr, ncqr = cdw11 & 0xFFFF, cdw11 >> 16
            if 0xFFFF in (nsqr, ncqr):
                raise invalid_field("number of queues 65536")
            if self.connected_queues:
                raise CommandFailed(Sct.GENERIC, Sc.COMMAND_SEQUENCE, "I/O queues exist already")
            top = self.config.max_io_queues
            nsqa, ncqa = min(nsqr + 1, top), min(ncqr + 1, top)
            self.granted_queues = min(nsqa, ncqa)
            return (nsqa - 1) | ((ncqa - 1) << 16)
        if fid == FID_ASYNC_EVENT:
            self.aec = cdw11
            return 0
        if fid == FID_KATO:
            # Rounded up to the keep-alive granularity (KAS).
            self.kato_ms = -(-cdw11 // KAS_MS) * KAS_MS
            self.keep_alive()
            return 0
        raise invalid_field(f"feature {fid:#x} is not supported")

    def get_feature(self, fid: int, select: int) -> int:
        """Get Features (current, default or saved value); returns DW0."""
        if select == 3:  # supported capabilities: changeable, not saveable
            if fid in (FID_NUM_QUEUES, FID_ASYNC_EVENT, FID_KATO):
                return 0x4
            raise invalid_field(f"feature {fid:#x} is not supported")
        if fid == FID_NUM_QUEUES:
            n = self.io_queues - 1
            return n | (n << 16)
        if fid == FID_ASYNC_EVENT:
            return self.aec
        if fid == FID_KATO:
            return self.kato_ms
        raise invalid_field(f"feature {fid:#x} is not supported")

    # ------------------------------------------------------------------ Identify

    def identify(self, cmd: Command, store: Callable[[], StoreInfo]) -> bytes:
        """The Identify data of `cmd` (CNS in CDW10, CSI in CDW11 bits 31:24).

        Raises:
            CommandFailed: unsupported CNS/CSI, or a namespace id this host cannot use.
        """
        cns, csi, nsid = cmd.cdw10 & 0xFF, cmd.cdw11 >> 24, cmd.nsid
        handler = _IDENTIFY.get(cns)
        if handler is None:
            raise invalid_field(f"Identify CNS {cns:#x} is not supported")
        return handler(self, nsid, csi, store)

    def _active(self, nsid: int) -> NvmeNamespace | None:
        """The namespace if active for this host; None if inactive (a valid NSID that holds
        nothing for it). Raises Invalid Namespace for NSIDs that are not valid at all."""
        if nsid == 0 or nsid > max(self.subsystem.nn, 1):
            raise CommandFailed(Sct.GENERIC, Sc.INVALID_NAMESPACE, f"invalid namespace {nsid}")
        ns = self.subsystem.namespaces.get(nsid)
        return ns if ns is not None and ns.visible_to(self.hostnqn) else None

    def _id_controller(self, nsid: int, csi: int, store: Callable[[], StoreInfo]) -> bytes:
        return nd.IdentifyController(
            cntlid=self.cntlid,
            subnqn=self.subsystem.nqn,
            sn=self.subsystem.serial,
            mn="kvoffload KV store",
            fr=__version__,
            maxcmd=self.config.queue_depth,
            nn=self.subsystem.nn,
            ioccsz=(64 + self.config.in_capsule_bytes) // 16,
            aerl=AER_LIMIT - 1,
            kas=1,
        ).pack()

    def _id_namespace(self, nsid: int, csi: int, store: Callable[[], StoreInfo]) -> bytes:
        ns = self._active(nsid)
        if ns is None:
            return bytes(nd.IDENTIFY_BYTES)
        info = store()
        return nd.NvmNamespaceShim(
            max(1, info.capacity_bytes // 4096), info.used_bytes // 4096, ns.nguid
        ).pack()

    def _id_active(self, nsid: int, csi: int, store: Callable[[], StoreInfo]) -> bytes:
        if nsid >= 0xFFFF_FFFE:
            raise CommandFailed(Sct.GENERIC, Sc.INVALID_NAMESPACE, f"list above {nsid:#x}")
        return nd.pack_active_namespaces(self.namespaces, nsid)

    def _id_descriptors(self, nsid: int, csi: int, store: Callable[[], StoreInfo]) -> bytes:
        ns = self._active(nsid)
        if ns is None:
            raise invalid_field(f"namespace {nsid} is not active")
        return nd.pack_descriptors(((nd.Nidt.NGUID, ns.nguid), (nd.Nidt.CSI, bytes((nd.Csi.KV,)))))

    def _id_csi_namespace(self, nsid: int, csi: int, store: Callable[[], StoreInfo]) -> bytes:
        if csi != nd.Csi.KV:
            raise invalid_field(f"namespaces here use the KV command set, not CSI {csi}")
        ns = self._active(nsid)
        if ns is None:
            return bytes(nd.IDENTIFY_BYTES)
        info = store()
        return nd.KvNamespace(
            info.capacity_bytes, info.used_bytes, self.max_value, nguid=ns.nguid
        ).pack()

    def _id_csi_controller(self, nsid: int, csi: int, store: Callable[[], StoreInfo]) -> bytes:
        if csi == nd.Csi.NVM:
            return bytes(nd.IDENTIFY_BYTES)  # no NVM limits to report
        if csi == nd.Csi.KV:
            return nd.kv_controller()
        # Must fail for ZNS: SPDK's host otherwise demands a ZNS effects log (ref §1.11).
        raise invalid_field(f"I/O command set {csi} is not supported")

    def _id_independent(self, nsid: int, csi: int, store: Callable[[], StoreInfo]) -> bytes:
        if self._active(nsid) is None:
            return bytes(nd.IDENTIFY_BYTES)
        return nd.NamespaceIndependent().pack()

    # ------------------------------------------------------------------ log pages

    def log_page(self, cmd: Command, store: Callable[[], StoreInfo], limit: int) -> bytes:
        """The Get Log Page data of `cmd`: NUMD dwords from its offset, cut to the `limit`
        bytes its SGL takes, zero-padded past the page's end (up to `LOG_PAD_MAX` bytes).

        Only what is sent is built: NUMD (up to 16 GiB) and the SGL length (up to 4 GiB) are
        the host's words, not sizes to allocate.

        Raises:
            CommandFailed: unknown page, unaligned offset, an offset past the page, or a read
                that would pad more than `LOG_PAD_MAX` bytes of zeros (Invalid Field).
        """
        lid = cmd.cdw10 & 0xFF
        numd = (((cmd.cdw11 & 0xFFFF) << 16) | (cmd.cdw10 >> 16)) + 1
        offset = cmd.cdw12 | (cmd.cdw13 << 32)
        csi = cmd.cdw14 >> 24
        if offset % 4:
            raise invalid_field("log page offset is not dword aligned")
        if lid == nd.Lid.ERROR:
            page = bytes(64)
        elif lid == nd.Lid.SMART:
            page = _smart(store())
        elif lid == nd.Lid.FIRMWARE_SLOT:
            slots = bytearray(512)
            slots[0] = 1  # slot 1 active
            slots[8:16] = __version__.encode()[:8].ljust(8, b" ")
            page = bytes(slots)
        elif lid == nd.Lid.EFFECTS:
            page = _effects(csi)
        else:
            raise CommandFailed(Sct.COMMAND_SPECIFIC, CmdSc.INVALID_LOG_PAGE, f"log page {lid:#x}")
        if offset > len(page):
            raise invalid_field(f"log page offset {offset} beyond its {len(page)} bytes")
        length = min(numd * 4, limit)
        data = page[offset : offset + length]
        if length - len(data) > LOG_PAD_MAX:
            raise invalid_field(f"{length} bytes asked of a {len(page)}-byte log page")
        return data + bytes(length - len(data))


def _smart(info: StoreInfo) -> bytes:
    # Data units are thousands of 512-byte units, rounded up (NVMe's definition).
    def units(nbytes: int) -> int:
        return -(-nbytes // 512_000)

    return nd.SmartLog(
        data_units_read=units(info.bytes_read),
        data_units_written=units(info.bytes_written),
        host_reads=info.reads,
        host_writes=info.writes,
        power_on_hours=int(info.uptime_s // 3600),
    ).pack()


_ADMIN_SUPPORTED = (
    AdminOpc.GET_LOG_PAGE,
    AdminOpc.IDENTIFY,
    AdminOpc.ABORT,
    AdminOpc.SET_FEATURES,
    AdminOpc.GET_FEATURES,
    AdminOpc.ASYNC_EVENT,
    AdminOpc.KEEP_ALIVE,
)
_KV_EFFECTS = {
    # Store and Delete change what the namespace holds (LBCC: "logical block content change").
    KvOpc.STORE: _CSUPP | _LBCC,
    KvOpc.DELETE: _CSUPP | _LBCC,
    KvOpc.RETRIEVE: _CSUPP,
    KvOpc.LIST: _CSUPP,
    KvOpc.EXIST: _CSUPP,
}


def _effects(csi: int) -> bytes:
    if csi not in (nd.Csi.NVM, nd.Csi.KV):
        raise invalid_field(f"no effects log for I/O command set {csi}")
    admin = {int(opc): _CSUPP for opc in _ADMIN_SUPPORTED}
    admin[FABRICS] = _CSUPP
    io = {int(opc): bits for opc, bits in _KV_EFFECTS.items()} if csi == nd.Csi.KV else {}
    return nd.EffectsLog(admin, io).pack()


_IDENTIFY: dict[int, Callable[[Controller, int, int, Callable[[], StoreInfo]], bytes]] = {
    nd.Cns.NAMESPACE: Controller._id_namespace,
    nd.Cns.CONTROLLER: Controller._id_controller,
    nd.Cns.ACTIVE_NAMESPACES: Controller._id_active,
    nd.Cns.DESCRIPTORS: Controller._id_descriptors,
    nd.Cns.CSI_NAMESPACE: Controller._id_csi_namespace,
    nd.Cns.CSI_CONTROLLER: Controller._id_csi_controller,
    nd.Cns.INDEPENDENT_NAMESPACE: Controller._id_independent,
}


# ---------------------------------------------------------------------------- command data

# PSDT (CDW0 bits 7:6) is not checked: over fabrics DPTR is always an SGL descriptor, whatever
# PSDT says (SPDK's target does not look either), and its descriptor type beyond "in the
# capsule or not" does not change how TCP moves the data (Sgl.transport_length).


def read_length(cmd: Command, data_length: int) -> int:
    """Bytes a command that returns data may receive (its SGL's length)."""
    no_data(data_length)
    if cmd.sgl.type == SGL_IN_CAPSULE:
        raise CommandFailed(Sct.GENERIC, Sc.SGL_TYPE_INVALID, "read data cannot be in-capsule")
    return cmd.sgl.transport_length


def write_sgl(cmd: Command, data_length: int) -> bool:
    """Check the SGL of a command that sends data; True if the data is in the capsule."""
    sgl = cmd.sgl
    if sgl.type == SGL_IN_CAPSULE:
        if sgl.address != 0:  # ICDOFF is 0: data starts at the capsule's data area
            raise CommandFailed(Sct.GENERIC, Sc.SGL_OFFSET_INVALID, f"offset {sgl.address}")
        if sgl.length != data_length:
            raise CommandFailed(
                Sct.GENERIC,
                Sc.SGL_LENGTH_INVALID,
                f"SGL says {sgl.length} B, the capsule holds {data_length}",
            )
        return True
    no_data(data_length)
    return False


def no_data(data_length: int) -> None:
    if data_length:
        raise CommandFailed(Sct.GENERIC, Sc.SGL_LENGTH_INVALID, "unexpected in-capsule data")


def no_info() -> StoreInfo:
    return StoreInfo(0, 0, 0, 0, 0, 0, 0.0)
