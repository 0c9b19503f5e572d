"""`kvoffload cluster status`: each member's health, capacity and hit ratio from its own stats.

Members come from etcd (one listing) or from a static cluster URL; each is asked for its stats
over the native protocol, all in parallel, with a short deadline, so a dead node costs one
timeout, not one per node.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from kvoffload.client_sdk.client import Client
from kvoffload.client_sdk.cluster.membership import (
    ClusterURL,
    Member,
    StaticMembership,
    parse_cluster_url,
    read_members,
)
from kvoffload.errors import ConfigError, InvalidArgumentError, KVOffloadError
from kvoffload.wire.membership import MembersKey, parse_etcd_url

__all__ = ["NodeStatus", "cluster_status", "members_of"]


@dataclass(frozen=True)
class NodeStatus:
    node_id: str
    address: str  # the native front, "" when the node has none
    weight: float
    up: bool
    error: str = ""
    capacity_bytes: int = 0
    used_bytes: int = 0
    blocks: int = 0
    hits: int = 0
    misses: int = 0
    version: str = ""

    @property
    def hit_ratio(self) -> float | None:
        asked = self.hits + self.misses
        return self.hits / asked if asked else None

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "hit_ratio": self.hit_ratio}


def members_of(url: str, *, timeout_s: float = 2.0) -> tuple[ClusterURL, list[Member]]:
    """The members a cluster URL names (a node's `etcd[s]://...` URL is read as its
    cluster's `cluster+etcd[s]://...`).

    Raises:
        ConfigError: not a cluster URL, or its members_key file holds no key.
        TransportError: etcd cannot be reached.
        AuthError: etcd refused the URL's credentials.
    """
    if url.startswith(("etcd://", "etcds://")):
        try:
            endpoint = parse_etcd_url(url)
        except InvalidArgumentError as exc:
            raise ConfigError(str(exc)) from None
        address = ((endpoint.host, endpoint.port),)
        spec = ClusterURL("etcd", addresses=address, path=endpoint.cluster, etcd=endpoint.access)
    else:
        spec = parse_cluster_url(url)
    if spec.source == "static":
        return spec, list(StaticMembership.from_spec(spec).members())
    ((host, port),) = spec.addresses
    # members_key= in the URL: show only the records signed with it, as a client would use.
    key = MembersKey.from_file(spec.members_key) if spec.members_key else None
    return spec, read_members(
        host, port, spec.path, timeout_s=timeout_s, access=spec.etcd, members_key=key
    )


def _probe(member: Member, timeout_s: float, token: str, ca: str) -> NodeStatus:
    address = member.fronts.get("native") or member.fronts.get("native+tls", "")
    if not address:
        return NodeStatus(member.node_id, "", member.weight, False, "no native front")
    query = f"timeout={timeout_s}&connect_timeout={timeout_s}&retries=0"
    if "native+tls" in member.fronts and "native" not in member.fronts:
        query += "&tls=1" + (f"&ca={ca}" if ca else "")
    if token:
        query += f"&token={token}"
    try:
        with Client.connect(f"kv://{address}?{query}") as client:
            store = client.stats().store
    except KVOffloadError as exc:
        return NodeStatus(member.node_id, address, member.weight, False, str(exc))
    tiers = store.get("tiers")
    tiers = tiers if isinstance(tiers, list) else []
    server = store.get("server")
    return NodeStatus(
        member.node_id,
        address,
        member.weight,
        True,
        capacity_bytes=sum(int(t.get("capacity_bytes", 0)) for t in tiers),
        used_bytes=sum(int(t.get("used_bytes", 0)) for t in tiers),
        blocks=sum(int(t.get("entries", 0)) for t in tiers),
        hits=int(store.get("hits", 0) or 0),  # type: ignore[call-overload]
        misses=int(store.get("misses", 0) or 0),  # type: ignore[call-overload]
        version=str(server.get("version", "")) if isinstance(server, dict) else "",
    )


def cluster_status(
    url: str, *, timeout_s: float = 2.0, token: str = "", ca: str = ""
) -> list[NodeStatus]:
    """Every member's status, in node id order (`ca`: the CA of TLS nodes' certificates).

    Raises:
        ConfigError: not a cluster URL.
        TransportError: etcd cannot be reached.
    """
    if timeout_s <= 0:
        raise ConfigError(f"timeout must be positive, got {timeout_s}")
    _, members = members_of(url, timeout_s=timeout_s)
    if not members:
        return []
    with ThreadPoolExecutor(min(16, len(members))) as pool:
        return list(pool.map(lambda m: _probe(m, timeout_s, token, ca), members))
