"""The daemon's `[cluster]` section (its own module: config.py holds the rest of the tree)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvoffload.errors import ConfigError, InvalidArgumentError
from kvoffload.wire.membership import (
    MAX_WEIGHT,
    MIN_WEIGHT,
    EtcdAccess,
    EtcdEndpoint,
    MembersKey,
    check_name,
    parse_etcd_url,
)

__all__ = ["ClusterConfig"]


@dataclass(frozen=True)
class ClusterConfig:
    """Membership in a cluster of storage nodes, registered in etcd (docs/guides/cluster.md)."""

    # etcd[s]://[USER[:PASS]@]HOST:PORT/NAME registers this node in cluster NAME; "" = a
    # standalone node. etcds:// is etcd over TLS.
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
    # etcd's v3 auth user and a file holding its password (kept out of the URL and the config);
    # each may be in the URL instead (USER@, ?password_file=), not in both.
    etcd_user: str = ""
    etcd_password_file: str = ""
    # etcds://: the CA that signed etcd's certificate ("" = the system's), and this node's client
    # certificate and key for an etcd that checks them. The URL's ca=, cert=, key= say the same.
    etcd_ca: str = ""
    etcd_cert: str = ""
    etcd_key: str = ""
    # A file holding the cluster's membership key (64 hex digits): the node signs its record
    # with it, so clients that hold the key ignore records nobody with the key wrote. "" =
    # unsigned records.
    members_key_file: str = ""

    def __post_init__(self) -> None:
        try:
            self.endpoint  # noqa: B018 - validates the URL and the etcd_* keys
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

    def _keys(self) -> dict[str, str]:
        """The etcd_* keys that are set, by the EtcdAccess field each sets."""
        keys = {
            "user": self.etcd_user,
            "password_file": self.etcd_password_file,
            "ca": self.etcd_ca,
            "cert": self.etcd_cert,
            "key": self.etcd_key,
        }
        return {name: value for name, value in keys.items() if value}

    def members_key(self) -> MembersKey | None:
        """The membership key (read from its file now), or None.

        Raises:
            ConfigError: the file cannot be read or holds no key.
        """
        return MembersKey.from_file(self.members_key_file) if self.members_key_file else None

    @property
    def endpoint(self) -> EtcdEndpoint | None:
        """etcd's address, the cluster name and how to reach etcd (the URL with the etcd_*
        keys), or None for a standalone node.

        Raises:
            InvalidArgumentError: a bad URL, or a setting both in the URL and in a key.
        """
        if not self.etcd:
            return None
        endpoint = parse_etcd_url(self.etcd)
        access = endpoint.access
        keys = self._keys()
        twice = [f"etcd_{name}" for name in keys if getattr(access, name)]
        if twice:
            raise InvalidArgumentError(f"{', '.join(twice)} also given in the etcd URL")
        if not keys:
            return endpoint
        merged = EtcdAccess(
            tls=access.tls,
            user=self.etcd_user or access.user,
            password=access.password,
            password_file=self.etcd_password_file or access.password_file,
            ca=self.etcd_ca or access.ca,
            cert=self.etcd_cert or access.cert,
            key=self.etcd_key or access.key,
        )
        return replace(endpoint, access=merged)
