"""What an `nvme+tcp://` URL says: the target, this host's identity, queues and digests."""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvoffload.client_sdk.transports.core import RETRY_PARAMS, typed_params
from kvoffload.client_sdk.url import StoreURL
from kvoffload.errors import ConfigError, LocalProtocolError
from kvoffload.wire.nvme_tcp import data as nd

__all__ = ["DEFAULT_PORT", "DEFAULT_SUBNQN", "NvmeOptions"]

DEFAULT_PORT = 4420
DEFAULT_SUBNQN = "nqn.2026-11.io.kvoffload:store"
_PARAMS = {
    "hostnqn": "this host's NQN (default /etc/nvme/hostnqn or one from the machine id)",
    "nsid": "KV namespace id (default: the first KV namespace)",
    "queues": "I/O queues (default 4)",
    "depth": "commands in flight per queue (default 32)",
    "hdgst": "1 for CRC32C header digests",
    "ddgst": "1 for CRC32C data digests",
    "kato": "keep-alive timeout in ms (default 15000; 0 = none)",
    "shards": "a daemon with N workers: one subsystem <NQN>.shard<i> per worker on port+i",
    "ports": "the workers' NVMe ports, comma-separated, when not consecutive",
    **RETRY_PARAMS,
}


def _shard_ports(params: dict[str, str], port: int) -> tuple[int, ...]:
    try:
        if "ports" in params:
            ports = tuple(int(p) for p in params["ports"].split(","))
        elif "shards" in params:
            ports = tuple(port + i for i in range(int(params["shards"])))
        else:
            return ()
    except ValueError:
        raise ConfigError("nvme+tcp:// shards must be a count and ports a list of ports") from None
    if not 1 <= len(ports) <= 256 or not all(0 < p < 65536 for p in ports):
        raise ConfigError(f"nvme+tcp:// needs 1..256 shard ports in 1..65535, got {ports}")
    return ports if len(ports) > 1 else ()


def _default_host() -> tuple[str, bytes]:
    """(host NQN, host id) like nvme-cli's: /etc/nvme/hostnqn, else from the machine id."""
    with contextlib.suppress(OSError):
        nqn = Path("/etc/nvme/hostnqn").read_text().strip()
        if nqn.startswith("nqn."):
            return nqn, uuid.uuid5(uuid.NAMESPACE_URL, nqn).bytes
    try:
        seed = Path("/etc/machine-id").read_text().strip()
        host = uuid.uuid5(uuid.NAMESPACE_OID, f"kvoffload {seed}")
    except OSError:
        host = uuid.uuid4()
    return f"nqn.2014-08.org.nvmexpress:uuid:{host}", host.bytes


@dataclass(frozen=True)
class NvmeOptions:
    """Where and how to reach an NVMe/TCP KV target (from an `nvme+tcp://` URL)."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    subnqn: str = DEFAULT_SUBNQN
    hostnqn: str = ""
    hostid: bytes = b""
    nsid: int = 0
    queues: int = 4
    depth: int = 32
    hdgst: bool = False
    ddgst: bool = False
    kato_ms: int = 15000
    timeout: float = 30.0
    connect_timeout: float = 5.0
    retries: int = 3
    backoff: float = 0.05
    # A multi-worker daemon's subsystems (`<subnqn>.shard<i>`), one port each, in shard order.
    shard_ports: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.hostnqn:
            nqn, hostid = _default_host()
            object.__setattr__(self, "hostnqn", nqn)
            object.__setattr__(self, "hostid", self.hostid or hostid)
        if not self.hostid:
            host_uuid = uuid.uuid5(uuid.NAMESPACE_URL, self.hostnqn)
            object.__setattr__(self, "hostid", host_uuid.bytes)
        if not 1 <= self.queues <= 0xFFFE or not 1 <= self.depth <= 1024:
            raise ConfigError("nvme+tcp:// queues must be 1..65534 and depth 1..1024")
        if self.timeout <= 0 or self.connect_timeout <= 0 or self.backoff < 0 or self.retries < 0:
            raise ConfigError("nvme+tcp:// timeouts must be positive, retries and backoff >= 0")
        if not 0 <= self.kato_ms <= 0xFFFF_FFFF or not 0 <= self.nsid < 0xFFFF_FFFF:
            raise ConfigError("nvme+tcp:// kato and nsid must be 32-bit")
        for nqn in (self.subnqn, self.hostnqn):
            try:
                nd.nqn_bytes(nqn)
            except LocalProtocolError as exc:
                raise ConfigError(str(exc)) from None

    @classmethod
    def from_url(cls, url: StoreURL) -> NvmeOptions:
        """Raises: ConfigError: unknown parameter or bad value."""
        params = url.take(_PARAMS)
        kwargs: dict[str, Any] = {"host": url.host or "127.0.0.1", "port": url.port or DEFAULT_PORT}
        subnqn = url.path.lstrip("/")
        if subnqn:
            kwargs["subnqn"] = subnqn
        kwargs |= typed_params(
            "nvme+tcp://",
            params,
            floats=("timeout", "connect_timeout", "backoff"),
            ints={
                "queues": "queues",
                "depth": "depth",
                "retries": "retries",
                "nsid": "nsid",
                "kato": "kato_ms",
            },
            flags=("hdgst", "ddgst"),
        )
        if "hostnqn" in params:
            kwargs["hostnqn"] = params["hostnqn"]
        kwargs["shard_ports"] = _shard_ports(params, kwargs["port"])
        return cls(**kwargs)

    def shard(self, index: int) -> NvmeOptions:
        """Options for shard `index`'s own subsystem."""
        return replace(
            self,
            port=self.shard_ports[index],
            subnqn=f"{self.subnqn}.shard{index}",
            shard_ports=(),
        )

    @property
    def url(self) -> str:
        return f"nvme+tcp://{self.host}:{self.port}/{self.subnqn}"
