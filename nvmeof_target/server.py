"""`kvoffload serve`: one asyncio process holding the engine and its network fronts.

The daemon opens the engine, applies tenant quotas, starts metrics and KV events, then starts
every front in `FRONTS` (the native front, then the NVMe/TCP one). Each front gets the whole
config and the shared `Services` (services.py) and picks its own section.
SIGTERM/SIGINT stop it gracefully: fronts stop accepting, finish the requests they have, and the
engine is closed last (which flushes its journal).

Once serving, it prints one line per listener, ``kvoffload: <what> listening on <host>:<port>``
(ports chosen with 0 included), then ``kvoffload: ready``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TextIO, cast

from kvoffload.errors import ConfigError
from kvoffload.kvstore import Engine
from kvoffload.nvmeof_target.cluster import registration as cluster
from kvoffload.nvmeof_target.config import Config
from kvoffload.nvmeof_target.events.feeds import Feeds
from kvoffload.nvmeof_target.events.publisher import KVEvents
from kvoffload.nvmeof_target.layout import shard_count
from kvoffload.nvmeof_target.metrics import Metrics
from kvoffload.nvmeof_target.native import front as native
from kvoffload.nvmeof_target.nvme import front as nvme
from kvoffload.nvmeof_target.services import Front, Services, ShardRole
from kvoffload.nvmeof_target.tenants import Tenants

__all__ = ["FRONTS", "Daemon", "Front", "Services", "serve_one"]

log = logging.getLogger("kvoffload.serve")


# The fronts the daemon starts, in order: name -> factory (None: disabled in the config).
FRONTS: dict[str, Callable[[Config, Services], Front | None]] = {
    "native": native.make_front,
    "nvme": nvme.make_front,
}


class Daemon:
    """The engine plus its fronts, metrics and events, in one event loop."""

    def __init__(
        self,
        config: Config,
        out: TextIO | None = None,
        shard: ShardRole | None = None,
        events_relay: str = "",
    ) -> None:
        """`shard` and `events_relay`: this daemon is one worker of a multi-process daemon
        (workers.py), serving one shard and sending its KV events to the supervisor."""
        self.config = config
        self._out = out or sys.stdout
        self._shard = shard
        self._events_relay = events_relay
        self._fronts: list[Front] = []
        self._services: Services | None = None
        self._cluster: cluster.Registration | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the fence's thread calls into it
        self._stop = asyncio.Event()
        self.addresses: dict[str, tuple[str, int]] = {}

    def _announce(self, what: str, host: str, port: int) -> None:
        self.addresses[what] = (host, port)
        print(f"kvoffload: {what} listening on {host}:{port}", file=self._out, flush=True)

    async def start(self) -> None:
        """Open the engine and start everything.

        Raises:
            ConfigError, KVOffloadError, OSError: the engine or a listener could not start.
        """
        config = self.config
        made: list[Path] = []  # parents of the data directory made here, outermost first
        if config.ssd.capacity_bytes and config.data_dir and not config.ssd.path:
            # The engine makes the data directory itself (and removes it if creating the
            # store fails); its parents are made here, and removed again in that case.
            for parent in reversed(Path(config.data_dir).absolute().parents):
                if not parent.exists():
                    parent.mkdir()
                    made.append(parent)
        loop = self._loop = asyncio.get_running_loop()
        executor = ThreadPoolExecutor(config.server.io_threads, thread_name_prefix="kvoffload-io")
        # Opening may replay a journal or prefault the arena: keep the loop responsive.
        try:
            engine = await loop.run_in_executor(executor, Engine, config.engine)
        except BaseException:
            executor.shutdown(wait=False)
            for parent in reversed(made):
                with contextlib.suppress(OSError):
                    parent.rmdir()
            raise
        # A node clients may have known (it registered from this data dir before, which kept
        # its id) holds no tombstones of what was deleted lately: repairs wait (`Tombstones`).
        # Not the id alone: every cluster node has one by now (`with_node_id`), new ones too.
        node_dir = Path(config.data_dir).parent if self._shard else Path(config.data_dir)
        rejoining = bool(config.cluster.etcd) and (node_dir / cluster.ID_FILE).exists()
        if config.cluster.etcd:
            # A cluster node's blocks from before this start may be older than its replicas'
            # (a delete or overwrite acknowledged while it was down): none is served again.
            dropped = await loop.run_in_executor(executor, engine.clear)
            if dropped:
                log.warning("cluster node: dropped %d block(s) from before this start", dropped)
        tenants = Tenants(config.tenants, config.cluster.node_id)
        tenants.apply_quotas(engine)
        metrics = Metrics(lambda: engine.stats().as_dict(), config.metrics.tenant_labels)
        services = Services(
            config,
            engine,
            tenants,
            metrics,
            executor,
            blocking_engine=config.ssd.capacity_bytes > 0 and _has_ssd_tier(engine),
            shard=self._shard,
        )
        if rejoining:
            services.tombstones.hold()
        self._services = services
        if config.events.enabled:
            services.events = KVEvents(
                config.events,
                self._events_relay,
                self._shard.index if self._shard else 0,
                Feeds(config.events, config.tenants),
            )
            endpoint = services.events.start()
            engine.set_tier_listener(services.events.moved)
            events = services.events
            metrics.watch_events(events.backlog, lambda: events.sent_events)
            print(f"kvoffload: events publishing on {endpoint}", file=self._out, flush=True)
            if services.events.replay_endpoint:
                print(f"kvoffload: events replay on {services.events.replay_endpoint}",
                      file=self._out, flush=True)  # fmt: skip
            services.events.print_tenants(
                lambda line: print(f"kvoffload: {line}", file=self._out, flush=True)
            )
        if config.metrics.enabled:
            self._announce("metrics", *metrics.serve(config.metrics.host, config.metrics.port))
        for make_front in FRONTS.values():
            front = make_front(config, services)
            if front is None:
                continue
            self._fronts.append(front)
            for what, host, port in await front.start():
                self._announce(what, host, port)
        if services.events is not None and config.events.announce:
            # After the fronts start, on a thread: a store of millions of blocks serves at once.
            services.events.announce_later(engine.described_table)
        if not tenants.open:
            log.info("%d tenant(s) configured; tokens required", len(config.tenants))
        elif config.native.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning(
                "serving on %s without tenants: anyone who can connect may read and "
                "write every block",
                config.native.host,
            )
        if self._shard is None:  # a worker's node registers from its supervisor (workers.py)
            self._cluster = await cluster.join(config, self.addresses, self._out, self._fence)
        print("kvoffload: ready", file=self._out, flush=True)

    def _fence(self) -> None:
        """Drop every block before registering again after the lease lapsed (clients placed
        this node's keys elsewhere meanwhile), and refuse repairs for a while (`Tombstones`)."""
        services, loop = self._services, self._loop
        if services is None or loop is None:
            return
        # First the connections: a request sent before the cut (a TCP retransmission after
        # the link came back) must not be applied after the blocks are gone.
        asyncio.run_coroutine_threadsafe(self._drop_connections(), loop).result(30)
        dropped = services.engine.clear()
        services.tombstones.hold()
        log.warning("cluster: dropped %d block(s) and every connection to rejoin", dropped)

    async def _drop_connections(self) -> None:
        for front in self._fronts:
            front.drop_connections()

    @property
    def engine(self) -> Engine | None:
        return self._services.engine if self._services else None

    @property
    def events(self) -> KVEvents | None:
        return self._services.events if self._services else None

    @property
    def metrics(self) -> Metrics | None:
        return self._services.metrics if self._services else None

    def request_stop(self) -> None:
        self._stop.set()

    async def wait(self) -> None:
        await self._stop.wait()

    async def stop(self) -> None:
        """Stop fronts (finishing in-flight requests), then events, metrics and the engine."""
        await cluster.leave(self._cluster)  # clients drop the node before its fronts close
        self._cluster = None
        timeout = self.config.server.shutdown_timeout_s
        for front in reversed(self._fronts):
            try:
                await front.stop(timeout)
            except Exception:  # one front failing to stop must not keep the engine open
                log.exception("front %s did not stop cleanly", front.name)
        self._fronts.clear()
        services = self._services
        if services is None:
            return
        self._services = None
        if services.events is not None:
            await services.events.close()
        services.metrics.close()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(services.executor, services.engine.close)
        services.executor.shutdown(wait=True)
        print("kvoffload: stopped", file=self._out, flush=True)


def _has_ssd_tier(engine: Engine) -> bool:
    return len(engine.stats().tiers) > 1


async def _serve(config: Config) -> int:
    daemon = Daemon(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, daemon.request_stop)
    try:
        await daemon.start()
        await daemon.wait()
        log.info("stopping")
    finally:
        await daemon.stop()
    return 0


def event_loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop]:
    if choice in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise ConfigError("server.loop = uvloop, but uvloop is not installed") from None
        else:
            return cast(Callable[[], asyncio.AbstractEventLoop], uvloop.new_event_loop)
    return asyncio.new_event_loop


def setup_logging(config: Config, prefix: str = "") -> None:
    logging.basicConfig(
        level=config.server.log_level.upper(),
        format=f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s",
    )


def serve_one(config: Config) -> int:
    """Serve in this process until SIGTERM/SIGINT; returns the exit status."""
    shard_count(config)  # refuses a data directory that holds a multi-worker store
    setup_logging(config)
    loop = event_loop_factory(config.server.loop)()
    try:
        return loop.run_until_complete(_serve(config))
    finally:
        loop.close()
