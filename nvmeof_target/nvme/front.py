"""The NVMe/TCP front: the NVMe Key Value command set over NVMe/TCP, on the engine.

Each TCP connection is one queue pair: ICReq/ICResp, then a Fabrics Connect makes it the admin
queue of a new controller (qid 0) or an I/O queue of an existing one. A thin shell in the shape
of the native front: read into the codec (`wire.nvme_tcp.connection`), drain its events,
call the engine, write completions. Values move without extra copies: a Store's data — in the
capsule or fetched with R2T/H2CData — is received straight into the slot `Engine.reserve` hands
out, and a Retrieve's C2HData is sent straight from the pinned `BlockView`.

The front owns the listener, the subsystems and their controllers, and the watchdog;
`nvme_queue.NvmeQueue` serves each connection, with the commands in `nvme_admin` and `nvme_io`.

A PDU that breaks the transport rules gets a C2HTermReq with its Fatal Error Status and the
connection is closed; other connections carry on. A command that fails gets an NVMe status
(`kvoffload/wire/status.py` maps engine errors). Keep Alive is enforced: a controller that
hears no Keep Alive for KATO is torn down with all its queues.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import time
from collections.abc import Callable

from kvoffload.nvmeof_target.channel import Channel
from kvoffload.nvmeof_target.config import Config, NvmeConfig
from kvoffload.nvmeof_target.nvme.admin import ADMIN, ADMIN_FABRICS, FABRICS
from kvoffload.nvmeof_target.nvme.io import IO
from kvoffload.nvmeof_target.nvme.queue import FRONT, CommandTables, NvmeQueue
from kvoffload.nvmeof_target.nvme.subsys import (
    Controller,
    NvmeNamespace,
    StoreInfo,
    Subsystem,
    build_subsystems,
    next_cntlid,
)
from kvoffload.nvmeof_target.services import Services
from kvoffload.nvmeof_target.session import Instruments, RoomLimits, make_room, stop_sessions
from kvoffload.wire.nvme_tcp import data as nd

__all__ = ["NvmeFront", "make_front"]

log = logging.getLogger("kvoffload.nvme")
_WATCH_INTERVAL = 0.1  # keep-alive granularity is 100 ms (Identify KAS = 1)


def make_front(config: Config, services: Services) -> NvmeFront | None:
    if config.nvme.enabled is None and config.tenants:
        log.warning(
            "NVMe/TCP front not started: tenants are configured and the NVMe/TCP front has no "
            "tenant authentication (set nvme.enabled = false to say so and silence this)"
        )
    return NvmeFront(config.nvme, services) if config.nvme_serves else None


class NvmeFront:
    """Listens for NVMe/TCP connections; owns the subsystems and their controllers."""

    name = FRONT

    def __init__(self, config: NvmeConfig, services: Services) -> None:
        self.config = config
        self.services = services
        self.engine = services.engine
        self.tables = CommandTables(FABRICS, ADMIN_FABRICS, ADMIN, IO)
        self.subsystems: dict[str, Subsystem] = build_subsystems(config, services.tenants.named)
        self.controllers: dict[int, Controller] = {}
        self._members: dict[int, set[NvmeQueue]] = {}  # cntlid -> its queues, admin included
        self._queues: dict[NvmeQueue, asyncio.Task[None]] = {}
        self._listener: socket.socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._sweeping = False
        self.instruments = Instruments(services.metrics, FRONT, log)
        self._budget = RoomLimits(
            config.max_connections,
            config.max_unconnected,
            config.max_unconnected_per_peer,
            "unconnected",
        )

    async def start(self) -> list[tuple[str, str, int]]:
        listener = socket.create_server(
            (self.config.host, self.config.port), backlog=self.config.backlog
        )
        listener.setblocking(False)
        self._listener = listener
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._accept(listener)), loop.create_task(self._watch())]
        if not self.config.loopback:
            for sub in self.subsystems.values():
                if not sub.allow_hosts:
                    log.warning(
                        "%s has no allowed hosts and the NVMe/TCP front is not on loopback: "
                        "every host will be refused",
                        sub.nqn,
                    )
        host, port = listener.getsockname()[:2]
        return [(FRONT, str(host), int(port))]

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        metrics = self.services.metrics
        while True:
            try:
                sock, peer = await loop.sock_accept(listener)
            except OSError as exc:
                log.warning("accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            self.instruments.connections_total.inc()
            if not make_room(
                self._queues,
                _admitted,
                str(peer[0]),
                self._budget,
                self.services.metrics,
                FRONT,
                self.instruments.peer_log,
            ):
                metrics.refused.labels(FRONT, "too many connections").inc()
                sock.close()  # NVMe/TCP has no PDU to refuse with before ICReq
                continue
            queue = NvmeQueue(self, Channel(sock, loop), f"{peer[0]}:{peer[1]}")
            self._queues[queue] = loop.create_task(queue.run())

    async def _watch(self) -> None:
        """Keep-alive timeouts, connections that never connect, PDUs that trickle in, and the
        sweeps of the List directories."""
        while True:
            await asyncio.sleep(_WATCH_INTERVAL)
            now = time.monotonic()
            for ctrl in list(self.controllers.values()):
                if ctrl.expired(now):
                    log.info(
                        "controller %d of %s: no Keep Alive for %d ms; tearing it down",
                        ctrl.cntlid,
                        ctrl.hostnqn,
                        ctrl.kato_ms,
                    )
                    self.services.metrics.refused.labels(FRONT, "keep-alive timeout").inc()
                    self.drop_controller(ctrl)
            for queue in list(self._queues):
                reason = queue.overdue(now)
                if reason:
                    self.services.metrics.refused.labels(FRONT, reason).inc()
                    queue.peer_log.info("closing %s: %s", queue.peer, reason)
                    queue.abort()
            if not self._sweeping:
                self._sweep()

    def _sweep(self) -> None:
        for sub in self.subsystems.values():
            for ns in sub.namespaces.values():
                if ns.directory.needs_sweep:
                    self._sweeping = True
                    check = ns.directory.begin_sweep()
                    loop = asyncio.get_running_loop()
                    future = loop.run_in_executor(
                        self.services.executor, check, self.engine.contains
                    )
                    future.add_done_callback(functools.partial(self._swept, ns))
                    return

    def _swept(self, ns: NvmeNamespace, future: asyncio.Future[list[bytes]]) -> None:
        self._sweeping = False
        failed = future.cancelled() or future.exception() is not None
        ns.directory.end_sweep(None if failed else future.result())

    # ------------------------------------------------------------------ controllers

    def new_controller(self, sub: Subsystem, data: nd.ConnectData, kato_ms: int) -> Controller:
        ctrl = Controller(
            next_cntlid(self.controllers),
            sub,
            data.hostnqn,
            data.hostid,
            kato_ms,
            self.config,
            max_value=self.engine.max_value_bytes,
        )
        self.controllers[ctrl.cntlid] = ctrl
        self._members[ctrl.cntlid] = set()
        return ctrl

    def attach(self, ctrl: Controller, queue: NvmeQueue) -> None:
        self._members.setdefault(ctrl.cntlid, set()).add(queue)
        if queue.qid:
            ctrl.connected_queues += 1

    def io_queue_taken(self, ctrl: Controller, qid: int) -> bool:
        return any(q.qid == qid for q in self._members.get(ctrl.cntlid, ()))

    def drop_controller(self, ctrl: Controller) -> None:
        """End an association: the controller goes, and every queue of it is closed."""
        if self.controllers.get(ctrl.cntlid) is not ctrl:
            return  # gone already (its id may even serve a newer controller by now)
        del self.controllers[ctrl.cntlid]
        for queue in self._members.pop(ctrl.cntlid, set()):
            queue.abort()

    def forget(self, queue: NvmeQueue) -> None:
        self._queues.pop(queue, None)
        ctrl = queue.ctrl
        if ctrl is None:
            return
        if queue.qid == 0:
            self.drop_controller(ctrl)  # the admin queue is the association
        elif queue in self._members.get(ctrl.cntlid, ()):
            self._members[ctrl.cntlid].discard(queue)
            ctrl.connected_queues -= 1

    def store_info(self, ns: NvmeNamespace) -> Callable[[], StoreInfo]:
        def read() -> StoreInfo:
            stats = self.engine.stats()
            used = sum(t.used_bytes for t in stats.tiers)
            capacity = sum(t.capacity_bytes for t in stats.tiers)
            if ns.tenant.name:
                used = stats.tenant_bytes.get(ns.tenant.name, 0)
            return StoreInfo(
                capacity_bytes=capacity,
                used_bytes=used,
                bytes_read=sum(t.bytes_read for t in stats.tiers),
                bytes_written=sum(t.bytes_written for t in stats.tiers),
                reads=stats.gets,
                writes=stats.puts,
                uptime_s=time.monotonic() - self.services.started,
            )

        return read

    def drop_connections(self) -> None:
        for queue in list(self._queues):
            queue.abort()

    async def stop(self, timeout: float) -> None:
        for task in self._tasks:
            task.cancel()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        await stop_sessions(self._queues, timeout)


def _admitted(queue: NvmeQueue) -> bool:
    return queue.qid is not None
