"""`kvoffload serve --workers N`: one storage node served by N processes, one shard each.

CPython's GIL keeps threads from spreading Python work over cores, so the node runs N worker
processes. Each is a complete daemon (`server.Daemon`) over its own engine — DRAM/N, SSD/N in
``<data_dir>/shard-<i>``, tenant quotas/N — holding the keys that `client_sdk.shards.shard_of`
assigns it. Every worker accepts on the node's port (one listening socket, shared) and on a
port of its own; Welcome tells a client the shard it reached and every shard's port, and the
SDK then sends each key straight to its shard, as Redis Cluster clients do. Nothing crosses
processes on the data path. See docs/guides/daemon.md#workers for why this design and its limits.

The supervisor (this module, no event loop) binds the shared socket, starts the workers,
hands them the port map, and then serves what belongs to the node as a whole: `/metrics`
(the workers' request metrics through prometheus-client's multiprocess files, plus their
engines' stats summed) and the KV event stream (one PUB socket; per-tenant sequence numbers
stay gap-free however many workers publish). Each worker's NVMe/TCP front is its own
subsystem (NQN ``<nqn>.shard<i>``, port ``<port>+i``): an NVMe controller's queues all live in
one process. A worker that dies takes the node down (exit status 1) so that the service
manager restarts it whole, rather than serving with a shard missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import io
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

from kvoffload.errors import ConfigError
from kvoffload.nvmeof_target.cluster.registration import Registration
from kvoffload.nvmeof_target.config import Config
from kvoffload.nvmeof_target.events.feeds import Feeds
from kvoffload.nvmeof_target.events.relay import EventRelay
from kvoffload.nvmeof_target.layout import shard_config, shard_count, write_layout
from kvoffload.nvmeof_target.metrics import NodeMetrics
from kvoffload.nvmeof_target.server import Daemon, event_loop_factory, serve_one, setup_logging
from kvoffload.nvmeof_target.services import ShardRole
from kvoffload.wire.shards import merge_stats

__all__ = ["supervise"]

log = logging.getLogger("kvoffload.serve")
# How long the supervisor waits for a worker to open its engine (a journal replay may be long).
_START_TIMEOUT_S = 600.0
_STATS_TIMEOUT_S = 5.0
# A worker's engine close (journal flush, checkpoint) after its requests are done.
_CLOSE_TIMEOUT_S = 600.0
_SCRATCH_PREFIX = "kvoffload-node-"
_PR_SET_PDEATHSIG = 1


# ---------------------------------------------------------------------------- the supervisor


class _Stopped(Exception):
    """SIGTERM/SIGINT while the workers were starting."""


class _Worker:
    """A worker process and the supervisor's end of its control pipe."""

    def __init__(
        self,
        ctx: Any,
        config: Config,
        index: int,
        count: int,
        listener: socket.socket | None,
        events: str,
    ) -> None:
        self.index = index
        self.conn, child = multiprocessing.Pipe()
        self.process = ctx.Process(
            target=_worker_main,
            args=(config, index, count, listener, child, events),
            name=f"kvoffload-shard-{index}",
        )
        self.process.start()
        child.close()
        self.lock = threading.Lock()  # the pipe is shared by the scrape thread and the main one
        self.addresses: list[tuple[str, str, int]] = []
        self._asked = 0  # stats requests sent: an answer to an older one is stale
        # The last stats it answered: a scrape that finds it silent (hung, stopping) exports
        # these, so the node's counters never go backwards (Prometheus reads a drop as a reset).
        self.last: dict[str, object] | None = None

    def expect(self, kind: str, deadline: float, stop: threading.Event) -> Any:
        while True:
            if stop.is_set():
                raise _Stopped
            if self.conn.poll(min(0.2, max(0.0, deadline - time.monotonic()))):
                try:
                    what, value = self.conn.recv()
                except (EOFError, OSError):
                    what, value = "failed", "exited"
                if what == "failed":
                    raise ConfigError(f"worker {self.index} could not start: {value}")
                if what == kind:
                    return value
            elif not self.process.is_alive():
                raise ConfigError(
                    f"worker {self.index} exited with status {self.process.exitcode} "
                    "while starting (see its log above)"
                )
            elif time.monotonic() >= deadline:
                raise ConfigError(f"worker {self.index} did not start in time")

    def stats(self) -> dict[str, object] | None:
        """The worker's engine stats, or None if it does not answer in time (an answer that
        comes later is recognised by its number and dropped, never taken for a newer one)."""
        with self.lock:
            self._asked += 1
            try:
                self.conn.send(("stats", self._asked))
                deadline = time.monotonic() + _STATS_TIMEOUT_S
                while self.conn.poll(max(0.0, deadline - time.monotonic())):
                    what, (number, value) = self.conn.recv()
                    if what == "stats" and number == self._asked:
                        if value is None:  # its stats failed (logged there): as silent
                            return None
                        self.last = dict(value)
                        return dict(value)
            except (EOFError, OSError):
                pass
        return None

    def stop(self) -> None:
        with self.lock, contextlib.suppress(OSError):
            self.conn.send(("stop", None))

    def replay(self, number: int, tenant: str, wanted: bytes) -> None:
        """Ask for the worker's part of replay request `number`, made on `tenant`'s feed (it
        answers to the relay)."""
        with self.lock, contextlib.suppress(OSError):
            self.conn.send(("replay", (number, tenant, wanted)))


def supervise(config: Config, out: TextIO | None = None) -> int:
    """Run the node as `config.server.workers` shard processes until SIGTERM/SIGINT."""
    setup_logging(config, "supervisor ")
    count = shard_count(config)
    if count == 1:
        return serve_one(replace(config, server=replace(config.server, workers=1)))
    configs = [shard_config(config, i, count) for i in range(count)]  # validates the shares
    largest = config.dram.effective_max_value_bytes
    for tenant in configs[0].tenants:
        if tenant.quota_bytes and tenant.quota_bytes < largest:
            log.warning(
                "tenant %s: its quota per worker (%d bytes) is below the largest value "
                "(%d bytes); its larger values will not fit",
                tenant.name,
                tenant.quota_bytes,
                largest,
            )
    write_layout(config, count)
    stream = out or sys.stdout

    def say(line: str) -> None:
        print(f"kvoffload: {line}", file=stream, flush=True)

    listener = None
    if config.native.enabled:
        listener = socket.create_server(
            (config.native.host, config.native.port), backlog=config.native.backlog
        )
    _remove_stale_scratch()
    scratch = tempfile.mkdtemp(prefix=f"{_SCRATCH_PREFIX}{os.getpid()}-")
    metrics_dir = os.path.join(scratch, "metrics")
    os.mkdir(metrics_dir)
    # Read by prometheus-client when each worker imports it: their metrics go to files here.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    relay = None
    metrics = None
    registration: Registration | None = None
    workers: list[_Worker] = []
    status = 0
    try:
        if config.events.enabled:
            relay = EventRelay(
                config.events,
                f"ipc://{scratch}/events",
                count,
                Feeds(config.events, config.tenants),
            )
        ctx = multiprocessing.get_context("spawn")
        inbox = f"ipc://{scratch}/events" if relay else ""
        workers = [_Worker(ctx, configs[i], i, count, listener, inbox) for i in range(count)]
        deadline = time.monotonic() + _START_TIMEOUT_S
        ports = [int(w.expect("port", deadline, stop)) for w in workers]
        for w in workers:
            w.conn.send(("map", ports))
        if listener is not None:
            # Every worker holds its own copy now; the supervisor's would keep the port
            # accepting (and connections waiting) after the workers stop.
            node_host, node_port = listener.getsockname()[:2]
            listener.close()
            listener = None
        for w in workers:
            w.addresses = list(w.expect("ready", deadline, stop))
        if config.native.enabled:
            tls = "+tls" if config.native.tls.enabled else ""
            say(f"native{tls} listening on {node_host}:{node_port}")
        for w in workers:
            for what, host, port in w.addresses:
                say(f"{what} shard {w.index} listening on {host}:{port}")
        if relay is not None:
            say(f"events publishing on {relay.endpoint}")
            if relay.replay_endpoint:
                relay.ask = lambda number, tenant, wanted: _ask_replay(
                    workers, number, tenant, wanted
                )
                say(f"events replay on {relay.replay_endpoint}")
            relay.print_tenants(say)
        if config.metrics.enabled:
            metrics = NodeMetrics(
                metrics_dir, lambda: _node_stats(workers), config.metrics.tenant_labels
            )
            host, port = metrics.serve(config.metrics.host, config.metrics.port)
            say(f"metrics listening on {host}:{port}")
        if config.cluster.etcd and config.native.enabled:
            # One record for the node: its port; clients find the shards from there. Named as
            # the single-process daemon names it, so clients know to use TLS.
            front = "native+tls" if config.native.tls.enabled else "native"
            registration = Registration(config, {front: (node_host, node_port)})
            registration.open()
            say(f"cluster {registration.cluster} node {registration.node_id}")
        log.info("serving %d shards", count)
        say("ready")
        while not stop.wait(0.2):
            dead = [w for w in workers if not w.process.is_alive()]
            if dead:
                log.error(
                    "worker %d exited with status %s; stopping the node",
                    dead[0].index,
                    dead[0].process.exitcode,
                )
                status = 1
                break
    except ConfigError as exc:
        print(f"kvoffload serve: {exc}", file=sys.stderr, flush=True)
        status = 2
    except _Stopped:
        log.info("stopped while starting")
    finally:
        if registration is not None:
            registration.close()  # clients drop the node before its workers stop
        _stop_all(workers, config.server.shutdown_timeout_s)
        if listener is not None:
            listener.close()
        if metrics is not None:
            metrics.close()
        if relay is not None:
            relay.close()
        shutil.rmtree(scratch, ignore_errors=True)
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    say("stopped")
    return status


def _remove_stale_scratch() -> None:
    """Scratch directories (metrics files, event socket) of supervisors that were killed."""
    for path in Path(tempfile.gettempdir()).glob(f"{_SCRATCH_PREFIX}*-*"):
        pid = path.name[len(_SCRATCH_PREFIX) :].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(path, ignore_errors=True)


def _ask_replay(workers: list[_Worker], number: int, tenant: str, wanted: bytes) -> None:
    """On a thread: a stats scrape may hold a worker's pipe for seconds; the relay waits not."""

    def ask() -> None:
        for w in workers:
            w.replay(number, tenant, wanted)

    threading.Thread(target=ask, name="kvoffload-replay", daemon=True).start()


def _node_stats(workers: list[_Worker]) -> dict[str, object]:
    """Every worker asked at once (one silent worker costs a scrape its timeout once, not
    once per worker); one that does not answer counts with the last stats it gave."""
    fresh: list[dict[str, object] | None] = [None] * len(workers)

    def ask(i: int) -> None:
        fresh[i] = workers[i].stats()

    askers = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(len(workers))]
    for t in askers:
        t.start()
    for t in askers:
        t.join()
    parts = [f if f is not None else w.last for f, w in zip(fresh, workers, strict=True)]
    stats = merge_stats([p for p in parts if p is not None])
    stats["workers"] = len(workers)
    stats["workers_answering"] = sum(f is not None for f in fresh)
    return stats


def _stop_all(workers: list[_Worker], shutdown_timeout: float) -> None:
    """Stop every worker as a one-process daemon stops (finishing its requests, then closing
    its engine, however long that takes); kill only one that is stuck."""
    for w in workers:
        w.stop()
    for w in workers:
        w.process.join(shutdown_timeout + _CLOSE_TIMEOUT_S)
        if w.process.is_alive():
            log.error("worker %d did not stop in time; killing it", w.index)
            w.process.kill()
            w.process.join(5)
        w.conn.close()


# ---------------------------------------------------------------------------- a worker


def _worker_main(
    config: Config,
    index: int,
    count: int,
    listener: socket.socket | None,
    conn: multiprocessing.connection.Connection,
    events: str,
) -> None:
    setup_logging(config, f"shard{index} ")
    _die_with_parent()
    listeners: list[socket.socket] = []
    port = 0
    if listener is not None:
        # The node's port + 1 + index, so that a restarted node keeps its shard map (clients
        # holding it reconnect where they were); any free port when the node's is 0.
        port = config.native.port + 1 + index if config.native.port else 0
        try:
            own = socket.create_server((config.native.host, port), backlog=config.native.backlog)
        except OSError as exc:
            conn.send(("failed", f"cannot listen on {config.native.host}:{port}: {exc}"))
            return
        port = own.getsockname()[1]
        listeners = [listener, own]
    conn.send(("port", port))
    try:
        what, ports = conn.recv()
    except EOFError:
        return
    if what != "map":
        return
    role = ShardRole(index, count, listeners, list(ports))
    loop = event_loop_factory(config.server.loop)()
    try:
        code = loop.run_until_complete(_serve_worker(config, role, conn, events))
    finally:
        loop.close()
    sys.exit(code)


def _die_with_parent() -> None:
    """A supervisor killed outright (SIGKILL, the OOM killer) takes its workers with it, as a
    one-process daemon would go: the store recovers them as from any crash."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the control pipe's EOF stops the worker
        pass
    if os.getppid() == 1:  # the supervisor died before the call
        os._exit(1)


async def _serve_worker(
    config: Config, role: ShardRole, conn: multiprocessing.connection.Connection, events: str
) -> int:
    daemon = Daemon(config, out=io.StringIO(), shard=role, events_relay=events)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, daemon.request_stop)
    try:
        await daemon.start()
    except Exception as exc:  # the supervisor reports it and stops the node
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        await daemon.stop()
        return 2
    conn.send(("ready", [(what, host, port) for what, (host, port) in daemon.addresses.items()]))
    threading.Thread(
        target=_control, args=(conn, daemon, loop), name="kvoffload-control", daemon=True
    ).start()
    await daemon.wait()
    await daemon.stop()
    return 0


def _control(
    conn: multiprocessing.connection.Connection, daemon: Any, loop: asyncio.AbstractEventLoop
) -> None:
    """Answer the supervisor: stats when it scrapes (with the C hot path's counts folded
    into the metrics files first), a replay request (its part goes to the
    relay), stop when told (or when it is gone)."""
    while True:
        try:
            what, number = conn.recv()
        except (EOFError, OSError):
            what = "stop"
        if what == "stats":
            engine, metrics = daemon.engine, daemon.metrics
            try:
                if metrics is not None:  # the node reads this worker's metrics files next
                    metrics.fold_pending()
                stats = engine.stats().as_dict() if engine else {}
            except Exception:  # a failed fold or stats must not end this thread: answer anyway
                log.exception("worker stats failed")
                stats = None  # the node counts it as silent (its last stats)
            try:
                conn.send(("stats", (number, stats)))
            except OSError:
                what = "stop"
        if what == "replay" and daemon.events is not None:
            loop.call_soon_threadsafe(daemon.events.push_snapshot, *number)
        if what == "stop":
            loop.call_soon_threadsafe(daemon.request_stop)
            return
