"""The NVMe/TCP front's Fabrics and Admin commands, as handler tables the queue dispatches on.

Each handler takes the queue, the command and its in-capsule data length; it answers through
`NvmeQueue.complete` (now, or once data is in) and raises `CommandFailed` for a status.
"""

from __future__ import annotations

import logging

from kvoffload.nvmeof_target.nvme.queue import Handler, NvmeQueue
from kvoffload.nvmeof_target.nvme.subsys import (
    AER_LIMIT,
    CommandFailed,
    connect_invalid,
    invalid_field,
    no_info,
    read_length,
)
from kvoffload.wire.nvme_tcp import data as nd
from kvoffload.wire.nvme_tcp.cmd import (
    SGL_IN_CAPSULE,
    AdminOpc,
    CmdSc,
    Command,
    FabricsType,
    Sc,
    Sct,
)

__all__ = ["ADMIN", "ADMIN_FABRICS", "FABRICS"]

log = logging.getLogger("kvoffload.nvme")

# ------------------------------------------------------------------ Fabrics


def _connect(q: NvmeQueue, cmd: Command, data_length: int) -> None:
    if q.qid is not None:
        raise CommandFailed(Sct.GENERIC, Sc.COMMAND_SEQUENCE, "the queue is connected")
    sgl = cmd.sgl
    if sgl.type != SGL_IN_CAPSULE:
        raise CommandFailed(Sct.GENERIC, Sc.SGL_TYPE_INVALID, "Connect data is in-capsule")
    if sgl.length != nd.CONNECT_DATA_BYTES or data_length != sgl.length:
        raise CommandFailed(Sct.GENERIC, Sc.SGL_LENGTH_INVALID, "Connect data is 1024 B")
    buffer = memoryview(bytearray(nd.CONNECT_DATA_BYTES))

    def finish(ok: bool) -> None:
        try:
            if not ok:
                raise CommandFailed(Sct.GENERIC, Sc.DATA_TRANSFER_ERROR, dnr=False)
            q.complete(cmd.cid, dw0=_admit(q, cmd, nd.ConnectData.unpack(buffer)))
        except CommandFailed as exc:
            q.complete(cmd.cid, exc.status, exc.dw0)

    q.receive(cmd.cid, buffer, len(buffer), finish, in_capsule=True)


def _admit(q: NvmeQueue, cmd: Command, data: nd.ConnectData) -> int:
    """Check a Connect and make this queue an admin or I/O queue; returns CNTLID."""
    front, metrics = q.front, q.services.metrics
    recfmt, qid, sqsize = cmd.cdw10 & 0xFFFF, cmd.cdw10 >> 16, cmd.cdw11 & 0xFFFF
    if recfmt != 0:
        raise CommandFailed(Sct.COMMAND_SPECIFIC, CmdSc.CONNECT_INCOMPATIBLE_FORMAT, "RECFMT")
    sub = front.subsystems.get(data.subnqn)
    if sub is None:
        raise connect_invalid(nd.CONNECT_DATA_SUBNQN, True, f"no subsystem {data.subnqn}")
    if not sub.admits(data.hostnqn):
        metrics.auth_failures.labels(q.front_name).inc()
        log.info("refused host %s for %s (%s)", data.hostnqn, sub.nqn, q.peer)
        raise CommandFailed(
            Sct.COMMAND_SPECIFIC,
            CmdSc.CONNECT_INVALID_HOST,
            "host not allowed",
            dw0=nd.CONNECT_DATA_HOSTNQN | (1 << 16),
        )
    if not 1 <= sqsize < q.config.queue_depth:
        raise connect_invalid(44, False, f"SQSIZE {sqsize}")
    if qid == 0:
        if data.cntlid != nd.DYNAMIC_CNTLID:
            raise connect_invalid(nd.CONNECT_DATA_CNTLID, True, "static controller id")
        ctrl = front.new_controller(sub, data, cmd.cdw12)
    else:
        found = front.controllers.get(data.cntlid)
        if found is None or found.subsystem is not sub or found.hostnqn != data.hostnqn:
            raise connect_invalid(nd.CONNECT_DATA_CNTLID, True, f"no controller {data.cntlid}")
        ctrl = found
        if not ctrl.ready:
            raise CommandFailed(Sct.GENERIC, Sc.COMMAND_SEQUENCE, "controller not enabled")
        if qid > ctrl.io_queues or front.io_queue_taken(ctrl, qid):
            raise connect_invalid(42, False, f"QID {qid}")
        q.conn.in_capsule = q.config.in_capsule_bytes
    q.qid, q.ctrl = qid, ctrl
    q.slots = sqsize + 1
    q.conn.max_outstanding = sqsize + 1
    front.attach(ctrl, q)
    log.debug("%s: %s queue %d of controller %d", q.peer, data.hostnqn, qid, ctrl.cntlid)
    return ctrl.cntlid


def _property_get(q: NvmeQueue, cmd: Command, data_length: int) -> None:
    value = q.controller.property_get(cmd.cdw11, bool(cmd.cdw10 & 0x7))
    q.complete(cmd.cid, dw0=value & 0xFFFF_FFFF, dw1=value >> 32)


def _property_set(q: NvmeQueue, cmd: Command, data_length: int) -> None:
    value = cmd.cdw12 | (cmd.cdw13 << 32)
    q.controller.property_set(cmd.cdw11, value, bool(cmd.cdw10 & 0x7))
    q.complete(cmd.cid)


def _disconnect(q: NvmeQueue, cmd: Command, data_length: int) -> None:
    q.complete(cmd.cid)
    # Answered; the connection closes once the answer is out (on the admin queue that ends
    # the association, as its closing always does).
    q.end_after_answers()


# ------------------------------------------------------------------ Admin


def _identify(q: NvmeQueue, cmd: Command, data_length: int) -> None:
    ctrl = q.controller
    limit = read_length(cmd, data_length)
    ns = ctrl.subsystem.namespaces.get(cmd.nsid)
    info = q.front.store_info(ns) if ns is not None else no_info
    data = ctrl.identify(cmd, info)
    q.complete(cmd.cid, data=data[:limit])


def _get_log_page(q: NvmeQueue, cmd: Command, data_length: int) -> None:
    ctrl = q.controller
    limit = read_length(cmd, data_length)
    first = next(iter(ctrl.namespaces.values()), None)
    info = q.front.store_info(first) if first is not None else no_info
    q.complete(cmd.cid, data=ctrl.log_page(cmd, info, limit))


def _set_features(q: NvmeQueue, cmd: Command, data_length: int) -> None:
    if data_length:
        raise invalid_field("no feature here takes data")
    dw0 = q.controller.set_feature(cmd.cdw10 & 0xFF, cmd.cdw11, bool(cmd.cdw10 >> 31))
    q.complete(cmd.cid, dw0=dw0)


def _get_features(q: NvmeQueue, cmd: Command, data_length: int) -> None:
    dw0 = q.controller.get_feature(cmd.cdw10 & 0xFF, (cmd.cdw10 >> 8) & 0x7)
    q.complete(cmd.cid, dw0=dw0)


def _keep_alive(q: NvmeQueue, cmd: Command, data_length: int) -> None:
    q.controller.keep_alive()
    q.complete(cmd.cid)


def _async_event(q: NvmeQueue, cmd: Command, data_length: int) -> None:
    if len(q.aers) >= AER_LIMIT:
        raise CommandFailed(Sct.COMMAND_SPECIFIC, CmdSc.AER_LIMIT, "too many AERs")
    # Parked: nothing here raises asynchronous events (namespaces never change while the
    # daemon runs), so it completes only if the association ends... which it does not.
    q.park_aer(cmd.cid)


def _abort(q: NvmeQueue, cmd: Command, data_length: int) -> None:
    q.complete(cmd.cid, dw0=1)  # DW0 bit 0: the command was not aborted


# Fabrics commands by FCTYPE; the property ones only on the admin queue.
ADMIN_FABRICS = frozenset({FabricsType.PROPERTY_GET, FabricsType.PROPERTY_SET})
FABRICS: dict[int, Handler] = {
    FabricsType.CONNECT: _connect,
    FabricsType.PROPERTY_GET: _property_get,
    FabricsType.PROPERTY_SET: _property_set,
    FabricsType.DISCONNECT: _disconnect,
}
# Admin commands by opcode (on queue 0).
ADMIN: dict[int, Handler] = {
    AdminOpc.IDENTIFY: _identify,
    AdminOpc.GET_LOG_PAGE: _get_log_page,
    AdminOpc.SET_FEATURES: _set_features,
    AdminOpc.GET_FEATURES: _get_features,
    AdminOpc.KEEP_ALIVE: _keep_alive,
    AdminOpc.ASYNC_EVENT: _async_event,
    AdminOpc.ABORT: _abort,
}
