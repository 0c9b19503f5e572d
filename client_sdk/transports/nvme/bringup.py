"""Bringing an NVMe/TCP KV controller up, in a Linux host's order (ref §1.10) and with the
checks Linux and SPDK make of its answers: Connect, enable, Identify, queues, Keep Alive
timeout, the KV namespace, then the I/O queues' own Connects."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from kvoffload.client_sdk.transports.core import one
from kvoffload.client_sdk.transports.nvme.options import NvmeOptions
from kvoffload.client_sdk.transports.nvme.queue import Call, Cmd, Plan, Queue
from kvoffload.errors import ConfigError, DeadlineExceededError, RemoteProtocolError
from kvoffload.wire.nvme_tcp import cmd as nc
from kvoffload.wire.nvme_tcp import data as nd
from kvoffload.wire.nvme_tcp.cmd import Command
from kvoffload.wire.status import nvme_error_for

__all__ = ["ADMIN_DEPTH", "CC_CONFIG", "CC_CSS_ALL", "CC_EN", "Controller", "bring_up"]

ADMIN_DEPTH = 32  # admin queue entries, as Linux asks for
CC_CONFIG = (6 << 16) | (4 << 20)  # IOSQES 64 B, IOCQES 16 B, MPS 4 KiB, AMS round robin
CC_CSS_ALL = 6 << 4  # CC.CSS 110b: every I/O command set the controller supports (KV)
CC_EN = 0x1
_CSTS_RDY, _CSTS_CFS = 0x1, 0x2


@dataclass(frozen=True)
class Controller:
    """What bring-up learned of the controller."""

    cntlid: int
    version: int
    controller: nd.IdentifyController
    kato_ms: int
    nsid: int
    namespace: nd.KvNamespace
    in_capsule: int


def bring_up(options: NvmeOptions, admin: Queue, io: list[Queue], deadline: float) -> Controller:
    """Bring the controller up over `admin` and connect the I/O queues, appending each to `io`
    as it opens (the caller closes them if this raises)."""
    return _BringUp(options, admin, deadline).run(io)


def _admin(make: Callable[[int], Command], what: str) -> Plan[Call]:
    call: Call = yield from one(Cmd(make))
    call.ok(what)
    return call


class _BringUp:
    def __init__(self, options: NvmeOptions, admin: Queue, deadline: float) -> None:
        self.options = options
        self.admin = admin
        self.deadline = deadline

    def connect(self, queue: Queue, sqsize: int, cntlid: int) -> int:
        options = self.options
        data = nd.ConnectData(options.hostid, cntlid, options.subnqn, options.hostnqn)
        kato = options.kato_ms if queue.qid == 0 else 0
        make = partial(nc.connect, qid=queue.qid, sqsize=sqsize, kato_ms=kato)
        call: Call = queue.run(one(Cmd(make, [memoryview(data.pack())])), self.deadline)
        c = call.result()
        if not c.ok:
            raise nvme_error_for(c.status, f"{options.url} refused Connect (DW0 {c.dw0:#x})")
        return c.dw0 & 0xFFFF

    def do(self, make: Callable[[int], Command], what: str) -> Call:
        return self.admin.run(_admin(make, what), self.deadline)

    def prop(self, offset: int, eight: bool) -> int:
        c = self.do(partial(nc.property_get, offset=offset, eight=eight), "Property Get")
        return c.ok("").dw0 | (c.ok("").dw1 << 32)

    def identify(self, cns: int, nsid: int = 0, csi: int = 0) -> Call:
        make = partial(nc.identify, cns=cns, nsid=nsid, csi=csi)
        call: Call = self.admin.run(one(Cmd(make)), self.deadline)
        return call

    def run(self, io: list[Queue]) -> Controller:
        options, admin, deadline = self.options, self.admin, self.deadline
        cntlid = self.connect(admin, ADMIN_DEPTH - 1, nd.DYNAMIC_CNTLID)
        cap = self.prop(0x00, True)
        css = CC_CSS_ALL if cap >> 43 & 1 else 0  # CAP.CSS bit 6: I/O command sets via CSS
        if not css:
            raise ConfigError(f"{options.url} reports no I/O command sets (CAP.CSS)")
        self.do(partial(nc.property_set, offset=0x14, value=CC_CONFIG | css), "CC")
        self.do(partial(nc.property_set, offset=0x14, value=CC_CONFIG | css | CC_EN), "CC")
        ready_by = time.monotonic() + ((cap >> 24) & 0xFF) * 0.5
        while True:
            csts = self.prop(0x1C, False)
            if csts & _CSTS_CFS:
                raise RemoteProtocolError(f"{options.url}: controller fatal status on enable")
            if csts & _CSTS_RDY:
                break
            if time.monotonic() > ready_by:
                raise DeadlineExceededError(f"{options.url} never became ready")
            time.sleep(0.01)
        version = self.prop(0x08, False)
        ctrl = nd.IdentifyController.unpack(
            self.identify(nd.Cns.CONTROLLER).check("Identify").read_data()
        )
        problems = []
        if ctrl.cntlid != cntlid:
            problems.append(f"CNTLID {ctrl.cntlid} != {cntlid} from Connect")
        if ctrl.kas == 0 or ctrl.ioccsz < 4 or ctrl.iorcsz < 1 or ctrl.icdoff != 0:
            problems.append("KAS, IOCCSZ, IORCSZ or ICDOFF unusable")
        if ctrl.sgls & 0x3 == 0:
            problems.append("no SGL support")
        if ctrl.subnqn != options.subnqn:
            problems.append(f"SUBNQN {ctrl.subnqn!r}")
        if problems:
            raise RemoteProtocolError(f"{options.url}: bad Identify Controller: {problems}")
        # Tolerated like Linux/SPDK: an NVM controller structure, the KV one.
        self.identify(nd.Cns.CSI_CONTROLLER, csi=nd.Csi.NVM)
        self.identify(nd.Cns.CSI_CONTROLLER, csi=nd.Csi.KV)
        wanted = options.queues
        granted = self.do(
            partial(nc.set_features, fid=0x07, cdw11=(wanted - 1) | ((wanted - 1) << 16)),
            "Set Features (number of queues)",
        ).ok("")
        queues = min(wanted, (granted.dw0 & 0xFFFF) + 1, (granted.dw0 >> 16) + 1)
        kato = self.kato()
        kato_ms = options.kato_ms if kato is None else kato
        nsid, namespace = self.namespace()
        self.do(nc.keep_alive, "Keep Alive")
        # One AER, parked by the target until something happens (nothing does, here).
        aer = admin.start(Cmd(nc.async_event), deadline)
        admin.parked.add(aer.command.cid)
        depth = min(options.depth, ctrl.maxcmd, ((cap & 0xFFFF) + 1))
        for qid in range(1, queues + 1):
            queue = Queue(options, qid, depth, deadline)
            io.append(queue)
            self.connect(queue, depth - 1, cntlid)
            queue.conn.in_capsule = ctrl.in_capsule_bytes
        return Controller(cntlid, version, ctrl, kato_ms, nsid, namespace, ctrl.in_capsule_bytes)

    def kato(self) -> int | None:
        """The Keep Alive timeout the controller granted (None: it does not say)."""
        call: Call = self.admin.run(one(Cmd(partial(nc.get_features, fid=0x0F))), self.deadline)
        c = call.result()
        return c.dw0 if c.ok else None

    def namespace(self) -> tuple[int, nd.KvNamespace]:
        options = self.options
        listed = nd.active_namespaces(
            self.identify(nd.Cns.ACTIVE_NAMESPACES).check("Identify").read_data()
        )
        wanted = [options.nsid] if options.nsid else listed
        for nsid in wanted:
            if nsid not in listed:
                raise ConfigError(f"{options.url} has no namespace {nsid} for this host")
            ids = nd.descriptors(
                self.identify(nd.Cns.DESCRIPTORS, nsid=nsid).check("Identify").read_data()
            )
            if ids.get(nd.Nidt.CSI) != bytes((nd.Csi.KV,)):
                continue
            independent = nd.NamespaceIndependent.unpack(
                self.identify(nd.Cns.INDEPENDENT_NAMESPACE, nsid=nsid).check("Identify").read_data()
            )
            if not independent.ready:
                continue
            kv = nd.KvNamespace.unpack(
                self.identify(nd.Cns.CSI_NAMESPACE, nsid=nsid, csi=nd.Csi.KV)
                .check("Identify")
                .read_data()
            )
            # SPDK counts a namespace as active only with NCAP != 0 in the NVM structure.
            nvm = nd.NvmNamespaceShim.unpack(
                self.identify(nd.Cns.NAMESPACE, nsid=nsid).check("Identify").read_data()
            )
            effects = nd.EffectsLog.unpack(
                self.do(
                    partial(nc.get_log_page, lid=nd.Lid.EFFECTS, length=4096, csi=nd.Csi.KV),
                    "Get Log Page (effects)",
                ).read_data()
            )
            needed = (nc.KvOpc.STORE, nc.KvOpc.RETRIEVE, nc.KvOpc.EXIST, nc.KvOpc.DELETE)
            if nvm.ncap and all(effects.io.get(opc, 0) & 1 for opc in needed):
                return nsid, kv
        raise ConfigError(f"{options.url} offers this host no usable KV namespace")
