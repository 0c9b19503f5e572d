"""The daemon's configuration: one frozen dataclass tree and one pure loader.

Precedence: defaults < TOML file < ``KVOFFLOAD_…`` environment (``__`` nests:
``KVOFFLOAD_NATIVE__PORT=7481``, ``KVOFFLOAD_TENANTS__ALICE__TOKEN=…``) < command-line flags.
Unknown keys and bad values are `ConfigError`s that say what is valid. Environment variables whose
first segment names no section are left alone: other tools share the prefix.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, cast

from kvoffload.errors import ConfigError, InvalidArgumentError
from kvoffload.kvstore import DramConfig, EngineConfig, parse_size
from kvoffload.kvstore.config import SsdConfig
from kvoffload.nvmeof_target.cluster.config import ClusterConfig
from kvoffload.wire.hello_auth import parse_node_key

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

__all__ = [
    "DEFAULT_SUBNQN",
    "ClusterConfig",
    "Config",
    "EventsConfig",
    "MetricsConfig",
    "NamespaceConfig",
    "NativeConfig",
    "NvmeConfig",
    "ServerConfig",
    "SubsystemConfig",
    "TenantConfig",
    "TenantEventsConfig",
    "TlsConfig",
    "build_flag_parser",
    "load_config",
]

ENV_PREFIX = "KVOFFLOAD_"
DEFAULT_SUBNQN = "nqn.2026-11.io.kvoffload:store"
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_LOOPS = ("auto", "asyncio", "uvloop")
_LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class ServerConfig:
    """The process: event loop, worker threads, shutdown."""

    # "auto" uses uvloop when it is installed, else the standard asyncio loop.
    loop: str = "auto"
    # Threads for engine calls that may block (SSD reads, durable commits).
    io_threads: int = 4
    # How long a graceful stop waits for in-flight requests before closing connections.
    shutdown_timeout_s: float = 10.0
    log_level: str = "info"
    # Processes serving the node, each one shard of the keys with its own engine (DRAM/N,
    # SSD/N, data_dir/shard-<i>); 0 = one per core. See docs/guides/daemon.md#workers.
    workers: int = 1

    def __post_init__(self) -> None:
        if self.workers < 0 or self.workers > 256:
            raise ConfigError(
                f"server.workers must be in 0..256 (0 = one per core), got {self.workers}"
            )
        if self.loop not in _LOOPS:
            raise ConfigError(f"server.loop must be one of {_LOOPS}, got {self.loop!r}")
        if self.log_level not in _LOG_LEVELS:
            raise ConfigError(f"server.log_level must be one of {_LOG_LEVELS}")
        if self.io_threads < 1 or self.shutdown_timeout_s < 0:
            raise ConfigError("server.io_threads must be >= 1, shutdown_timeout_s >= 0")


@dataclass(frozen=True)
class TlsConfig:
    """TLS on the native front: on when a certificate is given."""

    cert_file: str = ""
    key_file: str = ""  # "" when the key is in cert_file

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)


@dataclass(frozen=True)
class NativeConfig:
    """The native protocol front (DESIGN §5)."""

    enabled: bool = True
    host: str = "127.0.0.1"
    # 0 binds any free port (the daemon prints the one it got).
    port: int = 7480
    tls: TlsConfig = TlsConfig()
    # Connections beyond this are answered with an "unavailable" error and closed.
    max_connections: int = 1024
    # Answer bytes one connection may have queued (and pinned in the arena) before the daemon
    # stops reading its requests; bounds memory held for a slow reader.
    max_inflight_bytes: int = 256 << 20
    # Requests one connection may have in progress before the daemon stops reading it (>= 2).
    max_pending: int = 256
    # Largest msgpack header of a frame (bounds batch key lists).
    max_header_bytes: int = 4 << 20
    # Largest payload of one frame (a put_many batch, a get_many answer).
    max_payload_bytes: int = 256 << 20
    # A connection with nothing in progress and no bytes for this long is closed.
    idle_timeout_s: float = 300.0
    # A new connection must have its Hello accepted within this long (TLS handshake included).
    hello_timeout_s: float = 5.0
    # Connections whose Hello is not accepted yet have a budget of their own, in all and per
    # peer address; a new one beyond it closes the oldest such connection (of that peer first),
    # so connections that never say Hello cannot lock tenants out. Authenticated connections are
    # never closed to make room: up to max_connections, they always find room.
    max_unauthenticated: int = 64
    max_unauthenticated_per_peer: int = 8
    # A frame that has begun must be complete within this long (defeats slow partial frames),
    # and a peer that takes none of its queued answers for this long is closed (its pinned
    # blocks released).
    frame_timeout_s: float = 60.0
    backlog: int = 512
    # Serve the NIXL data path (protocol 3) to clients that ask, where nixl is installed.
    nixl: bool = True
    # The NIXL backend the daemon's agent moves payloads with (UCX: RDMA, shared memory, TCP).
    nixl_backend: str = "UCX"
    # NIXL transfers bypass TLS: a TLS daemon refuses them unless this allows it.
    nixl_over_tls: bool = False
    # Compatibility: also accept the old Hello that carries a tenant's token itself (protocol
    # 1-4 clients, and clients with legacy_token=1). Off: only challenge–response, so this node
    # never receives a secret it could replay (docs/guides/daemon.md#tenants).
    token_hello: bool = False
    # Share of the DRAM tier that get_many answers still on their way may hold pinned, all
    # connections together: past it an answer is cut short (the client asks again for the
    # rest; at least one value an answer), so a slow reader cannot starve writers of the tier.
    answer_pin_share: float = 0.25

    def __post_init__(self) -> None:
        if not 0 < self.answer_pin_share <= 1:
            raise ConfigError(
                f"native.answer_pin_share must be in (0, 1], got {self.answer_pin_share}"
            )
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"native.port must be in 0..65535, got {self.port}")
        for name in ("max_connections", "max_inflight_bytes", "max_pending", "backlog"):
            if getattr(self, name) < 1:
                raise ConfigError(f"native.{name} must be positive")
        if self.max_pending < 2:
            # A put counts as pending from its header on, and the session reads no further
            # (not even the put's own payload) while max_pending are pending: at 1 the first
            # put would wait for itself.
            raise ConfigError(f"native.max_pending must be >= 2, got {self.max_pending}")
        if self.max_header_bytes < 4096 or self.max_payload_bytes < 1 << 20:
            raise ConfigError("native.max_header_bytes >= 4 KiB, max_payload_bytes >= 1 MiB")
        if min(self.idle_timeout_s, self.frame_timeout_s, self.hello_timeout_s) <= 0:
            raise ConfigError("native timeouts must be positive")
        if not 1 <= self.max_unauthenticated_per_peer <= self.max_unauthenticated:
            raise ConfigError(
                "native: need 1 <= max_unauthenticated_per_peer <= max_unauthenticated, got "
                f"{self.max_unauthenticated_per_peer} and {self.max_unauthenticated}"
            )


def _check_nqn(nqn: str, what: str) -> None:
    # NVMe: "nqn." + at most 223 bytes of UTF-8 in all; printable so it fits the C strings
    # hosts keep it in.
    if not nqn.startswith("nqn.") or len(nqn.encode()) > 223 or not nqn.isprintable():
        raise ConfigError(f"{what} {nqn!r} is not an NQN (nqn.<date>.<domain>:<name>, <= 223 B)")


@dataclass(frozen=True)
class NamespaceConfig:
    """One KV namespace of a subsystem: which tenant's keys it holds and who may see it."""

    nsid: int
    # The tenant whose key space the namespace is ("" = the open store's keys).
    tenant: str = ""
    # Host NQNs that see this namespace; empty = every host the subsystem admits.
    hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.nsid <= 1024:
            raise ConfigError(f"namespace id {self.nsid} must be in 1..1024")
        for host in self.hosts:
            _check_nqn(host, f"namespace {self.nsid} host")


@dataclass(frozen=True)
class SubsystemConfig:
    """An NVMe subsystem: its NQN, the hosts allowed to connect and its namespaces."""

    nqn: str
    # Host NQNs that may connect; empty = any host, but only while the front listens on
    # loopback (a refused host gets Connect "Invalid Host").
    allow_hosts: tuple[str, ...] = ()
    # nsid -> namespace; empty = namespace 1 holding the open store's keys.
    namespaces: tuple[NamespaceConfig, ...] = ()

    def __post_init__(self) -> None:
        _check_nqn(self.nqn, "subsystem")
        for host in self.allow_hosts:
            _check_nqn(host, f"{self.nqn} allowed host")
        ids = [n.nsid for n in self.namespaces]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"{self.nqn}: duplicate namespace ids {ids}")

    @property
    def active(self) -> tuple[NamespaceConfig, ...]:
        return self.namespaces or (NamespaceConfig(1),)


@dataclass(frozen=True)
class NvmeConfig:
    """The NVMe/TCP front: the NVMe Key Value command set over NVMe/TCP (DESIGN §5)."""

    # Unset (the default): the front starts, unless tenants are configured; then it is skipped
    # with a warning, since it has no tenant authentication (no DH-HMAC-CHAP, and a host NQN
    # is no credential). true with tenants is a config error; false never starts it.
    enabled: bool | None = None
    host: str = "127.0.0.1"
    # 0 binds any free port (the daemon prints the one it got). 4420 is IANA's NVMe/TCP port.
    port: int = 4420
    # The subsystem served when `subsystems` is empty (one namespace, the open store's keys).
    subnqn: str = DEFAULT_SUBNQN
    subsystems: tuple[SubsystemConfig, ...] = ()
    # Largest value an I/O command may carry in its capsule (one round trip; larger values are
    # fetched with R2T). Sets IOCCSZ. Received straight into the store, so it costs no memory.
    in_capsule_bytes: int = 2 << 20
    # MAXH2CDATA: the most data one H2CData PDU may carry (4 KiB..4 MiB, multiple of 4).
    maxh2cdata_bytes: int = 1 << 20
    # Most data one C2HData PDU carries; a longer transfer is split.
    max_c2h_bytes: int = 8 << 20
    # I/O queues one controller may connect (Set Features Number of Queues is capped here).
    max_io_queues: int = 16
    # Commands one queue may hold (CAP.MQES + 1, MAXCMD).
    queue_depth: int = 128
    max_connections: int = 1024
    # Answer bytes one connection may have queued before the daemon stops reading it.
    max_inflight_bytes: int = 256 << 20
    # A new connection must finish ICReq and Connect within this long.
    connect_timeout_s: float = 5.0
    # Connections that have not finished Connect have their own budget, in all and per peer
    # address: past it the oldest of them is closed (never a connected queue), so strangers
    # cannot hold every slot.
    max_unconnected: int = 64
    max_unconnected_per_peer: int = 8
    # A PDU that has begun must be complete within this long, and a host that takes none of
    # its queued data and completions for this long is disconnected.
    frame_timeout_s: float = 60.0
    backlog: int = 512

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"nvme.port must be in 0..65535, got {self.port}")
        _check_nqn(self.subnqn, "nvme.subnqn")
        nqns = [s.nqn for s in self.subsystems]
        if len(set(nqns)) != len(nqns):
            raise ConfigError(f"duplicate subsystem NQNs {nqns}")
        if self.in_capsule_bytes < 4096 or self.in_capsule_bytes % 16:
            raise ConfigError("nvme.in_capsule_bytes must be >= 4 KiB and a multiple of 16")
        h2c = self.maxh2cdata_bytes
        if h2c % 4 or not 4096 <= h2c <= 4 << 20:
            raise ConfigError("nvme.maxh2cdata_bytes must be 4 KiB..4 MiB and a multiple of 4")
        if self.max_c2h_bytes < 4096:
            raise ConfigError("nvme.max_c2h_bytes must be >= 4 KiB")
        if not 1 <= self.max_io_queues <= 0xFFFE or not 2 <= self.queue_depth <= 0x10000:
            raise ConfigError("nvme.max_io_queues must be 1..65534, queue_depth 2..65536")
        for name in ("max_connections", "max_inflight_bytes", "backlog"):
            if getattr(self, name) < 1:
                raise ConfigError(f"nvme.{name} must be positive")
        if self.connect_timeout_s <= 0 or self.frame_timeout_s <= 0:
            raise ConfigError("nvme timeouts must be positive")
        if not 1 <= self.max_unconnected_per_peer <= self.max_unconnected:
            raise ConfigError(
                "nvme: need 1 <= max_unconnected_per_peer <= max_unconnected, got "
                f"{self.max_unconnected_per_peer} and {self.max_unconnected}"
            )

    @property
    def explicit(self) -> bool:
        """The operator asked for this front: `enabled = true`, or subsystems configured."""
        return self.enabled is True or bool(self.subsystems)

    @property
    def served(self) -> tuple[SubsystemConfig, ...]:
        """The subsystems this front serves."""
        return self.subsystems or (SubsystemConfig(self.subnqn),)

    @property
    def loopback(self) -> bool:
        return self.host in _LOOPBACK


@dataclass(frozen=True)
class MetricsConfig:
    """Prometheus `/metrics` over HTTP."""

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = 9480  # 0 binds any free port
    # Export each tenant's DRAM and SSD bytes labelled with its name; false drops those two
    # families (tenant names and their usage are then not visible to whoever scrapes).
    tenant_labels: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"metrics.port must be in 0..65535, got {self.port}")


@dataclass(frozen=True)
class EventsConfig:
    """KV events in vLLM's format (ZMQ PUB) for KV-aware routers."""

    enabled: bool = False
    # ZMQ endpoint to bind; "tcp://127.0.0.1:*" binds any free port (printed at start).
    endpoint: str = "tcp://127.0.0.1:5557"
    topic: str = ""
    # Events are batched for at most this long before they are published.
    flush_interval_s: float = 0.005
    # Messages ZMQ queues per subscriber before dropping (PUB semantics).
    hwm: int = 100_000
    # At start, publish a BlockStored for every block the store holds with metadata (read from
    # the engine's indexes), so routers already subscribed learn what a restarted store holds.
    announce: bool = True
    # ZMQ ROUTER endpoint answering replay requests (vLLM's framing): a router that starts after
    # the store asks, and gets every block held now; "" = off. Loopback unless told otherwise:
    # the answer holds token ids, i.e. prompt content.
    replay_endpoint: str = ""
    # ZMQ CURVE for the publisher and the replay endpoint: the server's secret key file
    # (zmq.auth's format, `zmq.auth.create_certificates`), and the clients allowed: a public
    # key file or a directory of them. Both or neither; with them, other clients get nothing.
    # The key pair also serves the tenants' own endpoints (`tenants.<name>.events`).
    curve_secret_key_file: str = ""
    curve_clients: str = ""

    def __post_init__(self) -> None:
        if not self.endpoint or self.flush_interval_s <= 0 or self.hwm < 1:
            raise ConfigError("events: endpoint must be set, flush_interval_s and hwm positive")
        if bool(self.curve_secret_key_file) != bool(self.curve_clients):
            raise ConfigError(
                "events: curve_secret_key_file and curve_clients go together (a server key "
                "without allowed clients, or clients without a server key, secures nothing)"
            )


@dataclass(frozen=True)
class TenantEventsConfig:
    """A tenant's own KV-event endpoints (`[tenants.<name>.events]`): they carry only its
    events, and with CURVE admit only its routers. A tenant without them is published on the
    shared `[events]` endpoints, where every router they admit may subscribe to it."""

    # ZMQ PUB endpoint of the tenant's events; "" = the shared endpoint carries them.
    endpoint: str = ""
    # ZMQ ROUTER endpoint answering the tenant's replay requests; "" = none.
    replay_endpoint: str = ""
    # With `events.curve_secret_key_file`: the public key file (or directory of them) of the
    # routers allowed this tenant's events. Required then; refused without it.
    curve_clients: str = ""


@dataclass(frozen=True)
class TenantConfig:
    """One tenant: what authenticates it (its secret, or only this node's key derived from
    it) and its capacity quota."""

    name: str
    # The tenant's secret (clients' `token`): this node derives its own key from it.
    token: str = ""
    # This node's key for the tenant, hex (`kvoffload node-key`), instead of the secret: the
    # node then holds nothing that authenticates the tenant to another node.
    node_key: str = ""
    # Bytes of DRAM the tenant may hold; 0 = no quota.
    quota_bytes: int = 0
    # Bytes of SSD slots the tenant may hold (needs an SSD tier); 0 = no quota.
    ssd_quota_bytes: int = 0
    events: TenantEventsConfig = TenantEventsConfig()

    def __post_init__(self) -> None:
        if not self.name or bool(self.token) == bool(self.node_key):
            raise ConfigError(
                f"tenant {self.name!r} needs a name and exactly one of token (the tenant's "
                "secret) and node_key (this node's key, from `kvoffload node-key`)"
            )
        if self.node_key:
            try:
                parse_node_key(self.node_key)
            except InvalidArgumentError as exc:
                raise ConfigError(f"tenants.{self.name}.node_key: {exc}") from None
        for key in ("quota_bytes", "ssd_quota_bytes"):
            if getattr(self, key) < 0:
                raise ConfigError(f"tenants.{self.name}.{key} must not be negative")
        if (self.events.replay_endpoint or self.events.curve_clients) and not self.events.endpoint:
            raise ConfigError(
                f"tenants.{self.name}.events: replay_endpoint and curve_clients need the "
                f"tenant's own endpoint (tenants.{self.name}.events.endpoint)"
            )


def default_data_dir(environ: Mapping[str, str]) -> str:
    """``$XDG_DATA_HOME/kvoffload``, else ``~/.local/share/kvoffload``."""
    base = environ.get("XDG_DATA_HOME") or os.path.join(
        environ.get("HOME") or os.path.expanduser("~"), ".local", "share"
    )
    return os.path.join(base, "kvoffload")


@dataclass(frozen=True)
class Config:
    """Everything `kvoffload serve` needs. `dram`, `ssd` and `data_dir` form the engine's."""

    server: ServerConfig = ServerConfig()
    native: NativeConfig = NativeConfig()
    nvme: NvmeConfig = NvmeConfig()
    metrics: MetricsConfig = MetricsConfig()
    events: EventsConfig = EventsConfig()
    cluster: ClusterConfig = ClusterConfig()
    dram: DramConfig = DramConfig()
    ssd: SsdConfig = SsdConfig(capacity_bytes=4 << 30)
    # Directory of the SSD tier, its journal and checkpoints.
    data_dir: str = field(default_factory=lambda: default_data_dir(os.environ))
    # With no tenants the store is open: one anonymous tenant, no token.
    tenants: tuple[TenantConfig, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ConfigError(f"duplicate tenant names in {names}")
        tokens = [t.token for t in self.tenants if t.token]
        keys = [t.node_key.strip().lower() for t in self.tenants if t.node_key]
        if len(set(tokens)) != len(tokens) or len(set(keys)) != len(keys):
            raise ConfigError("two tenants share a token (or a node key)")
        if keys and not self.cluster.node_id:
            raise ConfigError(
                "tenants with a node_key need [cluster] node_id: the key is derived for one "
                "node id, which clients must be told (`kvoffload node-key --node ID`)"
            )
        EngineConfig(dram=self.dram, ssd=self.ssd, data_dir=self.data_dir)  # validates them
        if self.tenants and self.nvme.explicit:
            raise ConfigError(
                "the NVMe/TCP front cannot run with [tenants]: it has no tenant authentication "
                "(no NVMe in-band authentication; a host NQN is not a credential, any host can "
                "present one), so any process that reaches it could read and forge every "
                "tenant's blocks. Serve tenants on the native front alone: set "
                "nvme.enabled = false and remove [nvme.subsystems]; or remove [tenants] to "
                "serve an open store over NVMe/TCP"
            )
        _check_event_feeds(self.events, self.tenants)
        for subsystem in self.nvme.served:
            for ns in subsystem.active:
                if ns.tenant and ns.tenant not in names:
                    raise ConfigError(
                        f"namespace {ns.nsid} of {subsystem.nqn} maps to tenant {ns.tenant!r}, "
                        f"which is not configured (tenants: {names})"
                    )

    @property
    def nvme_serves(self) -> bool:
        """Whether the NVMe/TCP front starts (see `NvmeConfig.enabled`)."""
        if self.nvme.enabled is None:
            return not self.tenants
        return self.nvme.enabled

    @property
    def engine(self) -> EngineConfig:
        return EngineConfig(dram=self.dram, ssd=self.ssd, data_dir=self.data_dir)


def _check_event_feeds(events: EventsConfig, tenants: Sequence[TenantConfig]) -> None:
    """The tenants' own event endpoints agree with `[events]`: CURVE on all or none, no
    endpoint bound twice.

    Raises:
        ConfigError: they do not.
    """
    bound = [events.endpoint, events.replay_endpoint]
    for t in tenants:
        own = t.events
        if not own.endpoint:
            continue
        where = f"tenants.{t.name}.events"
        if own.curve_clients and not events.curve_secret_key_file:
            raise ConfigError(
                f"{where}.curve_clients needs events.curve_secret_key_file (the daemon's CURVE "
                "key pair) and events.curve_clients"
            )
        if events.curve_secret_key_file and not own.curve_clients:
            raise ConfigError(
                f"{where}.curve_clients must name the routers allowed {t.name}'s events: with "
                "CURVE on, every events endpoint admits only its own list"
            )
        bound += [own.endpoint, own.replay_endpoint]
    # A port of "*" (any free port) may repeat; a named address binds once.
    named = [e for e in bound if e and not e.endswith(":*")]
    twice = sorted({e for e in named if named.count(e) > 1})
    if twice:
        raise ConfigError(f"events endpoints bound twice: {twice} (each feed needs its own)")


# ---------------------------------------------------------------------------- flags

# flag dest -> config path
_FLAGS: dict[str, tuple[str, ...]] = {
    "host": ("native", "host"),
    "port": ("native", "port"),
    "metrics_port": ("metrics", "port"),
    "data_dir": ("data_dir",),
    "dram": ("dram", "capacity_bytes"),
    "ssd": ("ssd", "capacity_bytes"),
    "loop": ("server", "loop"),
    "log_level": ("server", "log_level"),
    "tls_cert": ("native", "tls", "cert_file"),
    "tls_key": ("native", "tls", "key_file"),
    "events": ("events", "endpoint"),
    "nvme_port": ("nvme", "port"),
    "subnqn": ("nvme", "subnqn"),
    "workers": ("server", "workers"),
    "cluster": ("cluster", "etcd"),
    "advertise": ("cluster", "advertise"),
}


def build_flag_parser(
    prog: str = "kvoffload serve", *, add_help: bool = True
) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        add_help=add_help,
        description="Run the kvoffload storage daemon (native protocol, NVMe/TCP KV, metrics, KV "
        "events). "
        "Settings: defaults < --config TOML < KVOFFLOAD_SECTION__KEY environment < flags.",
    )
    add = parser.add_argument
    add("--config", metavar="FILE", help="TOML configuration file")
    add("--host", help="native front address (default 127.0.0.1)")
    add("--port", type=int, help="native front port (default 7480; 0 = any free port)")
    add("--metrics-port", type=int, help="Prometheus port (default 9480; 0 = any free port)")
    add("--data-dir", help="directory of the SSD tier and its journal")
    add("--dram", help="DRAM tier size, e.g. 1GiB")
    add("--ssd", help="SSD tier size, e.g. 4GiB (0 = no SSD tier)")
    add("--loop", choices=_LOOPS, help="event loop (default auto: uvloop when installed)")
    add("--log-level", choices=_LOG_LEVELS)
    add("--tls-cert", metavar="PEM", help="serve the native front over TLS with this certificate")
    add("--tls-key", metavar="PEM", help="private key of --tls-cert (if not in the same file)")
    add("--events", metavar="ENDPOINT", help="publish KV events on this ZMQ endpoint")
    add("--nvme-port", type=int, help="NVMe/TCP front port (default 4420; 0 = any free port)")
    add("--subnqn", metavar="NQN", help=f"NVMe subsystem NQN (default {DEFAULT_SUBNQN})")
    add(
        "--workers",
        type=int,
        help="processes serving the node, one shard of the keys each (default 1; 0 = one per core)",
    )
    add(
        "--cluster",
        metavar="etcd[s]://[USER@]HOST:PORT/NAME",
        help="register in this cluster's etcd",
    )
    add("--advertise", metavar="HOST", help="address clients reach this node at (clusters)")
    return parser


# ---------------------------------------------------------------------------- the loader


def load_config(
    toml_path: str | None, environ: Mapping[str, str], argv: Sequence[str] = ()
) -> Config:
    """Build the config from a TOML file, the environment and flags (see the module doc).

    `argv` holds `kvoffload serve` flags; a ``--config`` there names the TOML file when
    `toml_path` is None.

    Raises:
        ConfigError: unreadable file, unknown key, bad value.
    """
    args = build_flag_parser().parse_args(list(argv))
    tree: dict[str, Any] = {"data_dir": default_data_dir(environ)}
    path = toml_path or args.config
    if path:
        try:
            with open(path, "rb") as fh:
                _merge(tree, tomllib.load(fh))
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    sections = {f.name for f in dataclasses.fields(Config)}
    for name, value in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX):
            continue
        parts = name[len(ENV_PREFIX) :].lower().split("__")
        if parts[0] in sections:
            _set(tree, parts, value)
    for dest, target in _FLAGS.items():
        value = getattr(args, dest)
        if value is not None:
            _set(tree, list(target), value)
    if args.events is not None:
        _set(tree, ["events", "enabled"], True)
    return cast(Config, _build(Config, tree, ""))


def _merge(into: dict[str, Any], src: Mapping[str, Any]) -> None:
    for key, value in src.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        elif isinstance(value, Mapping):
            into[key] = {}
            _merge(into[key], value)
        else:
            into[key] = value


def _set(tree: dict[str, Any], path: Sequence[str], value: object) -> None:
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(path)}: {part} is a value, not a section")
        node = child
    node[path[-1]] = value


def _build(cls: type[Any], values: Mapping[str, Any], where: str) -> Any:
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where.rstrip('.') or 'config'} must be a table")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(
            f"unknown config key(s) {[where + k for k in unknown]}; valid in "
            f"{where.rstrip('.') or 'the top level'}: {sorted(known)}"
        )
    kwargs: dict[str, Any] = {}
    for name, value in values.items():
        kwargs[name] = _convert(hints[name], value, where + name)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{where.rstrip('.') or 'config'}: {exc}") from None


def _convert(tp: Any, value: Any, name: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, name + ".")  # type: ignore[arg-type]
    if typing.get_origin(tp) is tuple:
        (item, *_) = typing.get_args(tp)
        if item is str:  # a list of strings: a TOML array, or "a,b" from the environment
            if isinstance(value, str):
                return tuple(v.strip() for v in value.split(",") if v.strip())
            if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
                return tuple(value)
            return _bad(name, value, "a list of strings")
        # A keyed table (tenants, subsystems, namespaces): each key fills the item's first field.
        if not isinstance(value, Mapping):
            raise ConfigError(f"{name} must be a table")
        first = dataclasses.fields(item)[0].name
        return tuple(
            _build(item, {**_table(v, f"{name}.{k}"), first: k}, f"{name}.{k}.")
            for k, v in value.items()
        )
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        # `X | None`: None is the unset default; a value given is an X.
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise ConfigError(f"{name}: unsupported option type")  # pragma: no cover
        return _convert(args[0], value, name)
    return _SCALARS[tp](value, name)


def _table(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{name} must be a table")
    return dict(value)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _to_bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise ConfigError(f"{name} must be true or false, got {value!r}")


def _to_int(value: Any, name: str) -> int:
    if name.endswith("_bytes"):
        return parse_size(value) if isinstance(value, (str, int)) else _bad(name, value, "a size")
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    return _bad(name, value, "an integer")


def _to_float(value: Any, name: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return _bad(name, value, "a number")


def _to_str(value: Any, name: str) -> str:
    return value if isinstance(value, str) else _bad(name, value, "a string")


def _bad(name: str, value: Any, what: str) -> NoReturn:
    raise ConfigError(f"{name} must be {what}, got {value!r}")


_SCALARS: dict[Any, Any] = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}
