"""The daemon's `[cluster]` section (its own module: config.py holds the rest of the tree)."""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload.errors import ConfigError, InvalidArgumentError
from kvoffload.wire.membership import MAX_WEIGHT, MIN_WEIGHT, check_name, parse_etcd_url

__all__ = ["ClusterConfig"]


@dataclass(frozen=True)
class ClusterConfig:
    """Membership in a cluster of storage nodes, registered in etcd (docs/guides/cluster.md)."""

    # etcd://HOST:PORT/NAME registers this node in cluster NAME; "" = a standalone node.
    etcd: str = ""
    # The host clients reach the fronts at; "" = each front's own (not a wildcard) address.
    advertise: str = ""
    # "" = generated once and kept in data_dir (a restart rejoins as the same node).
    node_id: str = ""
    # Share of placements against other nodes, MIN_WEIGHT..MAX_WEIGHT (0.001..1e6); 0 = the
    # node's capacity in GiB (kept within that range).
    weight: float = 0.0
    # Seconds a crashed node's record outlives it (its lease is renewed every third of this).
    lease_ttl_s: int = 10

    def __post_init__(self) -> None:
        try:
            self.endpoint  # noqa: B018 - validates the URL
            if self.node_id:
                check_name(self.node_id, "cluster.node_id")
        except InvalidArgumentError as exc:
            raise ConfigError(f"cluster: {exc}") from None
        if not (self.weight == 0 or MIN_WEIGHT <= self.weight <= MAX_WEIGHT):
            raise ConfigError(
                f"cluster.weight must be 0 (capacity) or {MIN_WEIGHT:g}..{MAX_WEIGHT:g}, "
                f"got {self.weight!r}"
            )
        if not 2 <= self.lease_ttl_s <= 3600:
            raise ConfigError("cluster.lease_ttl_s must be 2..3600")

    @property
    def endpoint(self) -> tuple[str, int, str] | None:
        """(etcd host, port, cluster name), or None for a standalone node."""
        return parse_etcd_url(self.etcd) if self.etcd else None
