"""Who is in the cluster: a static list from the URL, or the records daemons keep in etcd.

Both sources answer the same three questions — the members now, a generation number that moves
on every change, and a way to wait for the next change — so placement and the transport never
know where membership comes from.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import parse_qsl, unquote, urlsplit

from kvoffload.client_sdk.cluster.gateway import EtcdGateway
from kvoffload.errors import AuthError, ConfigError, InvalidArgumentError, KVOffloadError
from kvoffload.wire.membership import (
    ETCD_PARAMS,
    NO_ACCESS,
    EtcdAccess,
    Member,
    MembersKey,
    decode_member,
    nodes_prefix,
    parse_range,
    parse_watch,
    range_request,
    redact_url,
    watch_request,
)

__all__ = [
    "ClusterURL",
    "EtcdMembership",
    "Member",
    "WATCH_RETRY_MAX_S",
    "Membership",
    "StaticMembership",
    "open_membership",
    "parse_cluster_url",
    "read_members",
]

log = logging.getLogger("kvoffload.cluster")

# URL parameters a cluster URL may carry (name -> meaning); the transport reads the rest.
PARAMS = {
    "replicas": "copies of each block (default 1)",
    "front": "native (default) or nvme",
    "members_key": "file with the cluster's membership key: ignore records not signed with it",
    # cluster+etcds:// (etcd over TLS) and etcd credentials; the nodes' TLS is the transport's.
    **{f"etcd_{name}": f"etcd: {meaning}" for name, meaning in ETCD_PARAMS.items()},
}
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,252}")
# Retry pauses while etcd is unreachable: short first (a restart), capped (a long outage).
_RETRY_FIRST_S, _RETRY_MAX_S = 0.2, 2.0
# The longest a client whose watch broke waits before listing the members again.
WATCH_RETRY_MAX_S = _RETRY_MAX_S


class Membership(Protocol):
    """A source of cluster members."""

    def members(self) -> tuple[Member, ...]:
        """The members now, sorted by node id (empty while none is known)."""
        ...

    @property
    def generation(self) -> int:
        """A number that grows each time `members` changes."""
        ...

    @property
    def ignored(self) -> int:
        """Records seen and ignored: malformed, foreign, or (with a membership key) unsigned
        or badly signed; each version of a record counts once."""
        ...

    def wait_changed(self, generation: int, timeout_s: float) -> int:
        """Wait until the generation differs from `generation` or `timeout_s` passes; return
        the generation then."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class ClusterURL:
    """A parsed cluster URL: `cluster://h1:p1,h2:p2[/nqn]?replicas=2` (static) or
    `cluster+etcd[s]://[user[:pass]@]host:port/NAME?replicas=2` (etcd; `etcd` says how to
    reach it: TLS, credentials)."""

    source: str  # "static" or "etcd"
    replicas: int = 1
    front: str = "native"
    # static: the nodes' front addresses; etcd: the one etcd endpoint
    addresses: tuple[tuple[str, int], ...] = ()
    # static nvme: the subsystem NQN; etcd: the cluster name
    path: str = ""
    extra: dict[str, str] = field(default_factory=dict)
    etcd: EtcdAccess = NO_ACCESS
    members_key: str = ""  # etcd: a file with the key records must be signed with


def _address(text: str, url: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not _HOST.fullmatch(host) or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"cluster URL {url!r}: {text!r} is not host:port")
    return host, int(port)


def parse_cluster_url(url: str, allowed_extra: dict[str, str] | None = None) -> ClusterURL:
    """Parse a cluster URL.

    Args:
        url: the URL.
        allowed_extra: further parameters the caller accepts (name -> meaning).

    Raises:
        ConfigError: an unknown scheme or parameter, a bad address, replicas or front.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    url = redact_url(url)  # the form every message below shows
    if scheme not in ("cluster", "cluster+etcd", "cluster+etcds") or not parts.netloc:
        raise ConfigError(
            f"not a cluster URL: {url!r} (expected cluster://h1:7480,h2:7480 or "
            "cluster+etcd://etcd-host:2379/NAME)"
        )
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    params = dict(pairs)
    allowed = {**PARAMS, **(allowed_extra or {})}
    unknown = sorted(set(params) - set(allowed))
    if unknown or len(params) != len(pairs):
        valid = ", ".join(f"{k} ({v})" for k, v in allowed.items())
        raise ConfigError(f"cluster URL {url!r}: unknown or repeated parameter(s); valid: {valid}")
    replicas = params.pop("replicas", "1")
    if not replicas.isdigit() or not 1 <= int(replicas) <= 16:
        raise ConfigError(f"cluster URL {url!r}: replicas must be 1..16, got {replicas!r}")
    front = params.pop("front", "native")
    if front not in ("native", "nvme"):
        raise ConfigError(f"cluster URL {url!r}: front must be native or nvme, got {front!r}")
    user, at, netloc = parts.netloc.rpartition("@")
    addresses = tuple(_address(a, url) for a in netloc.split(","))
    path = parts.path.strip("/")
    etcd = {k.removeprefix("etcd_"): params.pop(k) for k in list(params) if k.startswith("etcd_")}
    members_key = params.pop("members_key", None)
    if members_key is not None and (scheme == "cluster" or not members_key):
        raise ConfigError(f"cluster URL {url!r}: members_key needs cluster+etcd and a file")
    if scheme != "cluster":
        if len(addresses) != 1:
            raise ConfigError(f"cluster URL {url!r}: name one etcd endpoint")
        name, _, password = user.partition(":")
        try:
            nodes_prefix(path)
            access = EtcdAccess(
                tls=scheme == "cluster+etcds",
                user=unquote(name),
                password=unquote(password),
                **etcd,
            )
        except InvalidArgumentError as exc:
            raise ConfigError(f"cluster URL {url!r}: {exc}") from None
        return ClusterURL(
            "etcd", int(replicas), front, addresses, path, params, access, members_key or ""
        )
    if at or etcd:
        raise ConfigError(f"cluster URL {url!r}: etcd credentials and options need cluster+etcd")
    if len(set(addresses)) != len(addresses):
        raise ConfigError(f"cluster URL {url!r}: a node is listed twice")
    if front == "nvme" and not path.startswith("nqn."):
        raise ConfigError(f"cluster URL {url!r}: front=nvme needs the subsystem NQN as the path")
    return ClusterURL("static", int(replicas), front, addresses, path, params)


def open_membership(spec: ClusterURL, *, timeout_s: float = 2.0) -> Membership:
    """The membership source a parsed URL names (an etcd one is watching when returned).

    Raises: ConfigError: the members_key file cannot be read or holds no key.
    """
    if spec.source == "etcd":
        ((host, port),) = spec.addresses
        key = MembersKey.from_file(spec.members_key) if spec.members_key else None
        return EtcdMembership(
            host, port, spec.path, timeout_s=timeout_s, access=spec.etcd, members_key=key
        )
    return StaticMembership.from_spec(spec)


class StaticMembership:
    """A fixed list of nodes; the node id of each is its address ("host-port")."""

    def __init__(self, members: tuple[Member, ...]) -> None:
        self._members = tuple(sorted(members, key=lambda m: m.node_id))
        self._closed = threading.Event()

    @classmethod
    def from_url(cls, url: str) -> StaticMembership:
        """Raises: ConfigError: not a static cluster URL, or a bad one."""
        spec = parse_cluster_url(url)
        if spec.source != "static":
            shown = redact_url(url)
            raise ConfigError(f"{shown!r} is not a static cluster URL (cluster://h1:p1,h2:p2)")
        return cls.from_spec(spec)

    @classmethod
    def from_spec(cls, spec: ClusterURL) -> StaticMembership:
        # The nodes listed serve TLS when the URL says tls=1: name their fronts as a TLS node's
        # record does, so that one lookup serves both kinds of membership.
        front = spec.front + ("+tls" if spec.extra.get("tls") == "1" else "")
        members = []
        for host, port in spec.addresses:
            address = f"{host}:{port}" + (f"/{spec.path}" if spec.front == "nvme" else "")
            members.append(Member(f"{host}-{port}", {front: address}))
        return cls(tuple(members))

    def members(self) -> tuple[Member, ...]:
        return self._members

    @property
    def generation(self) -> int:
        return 0

    @property
    def ignored(self) -> int:
        return 0

    def wait_changed(self, generation: int, timeout_s: float) -> int:
        # Nothing ever changes: wait the time asked for (or until closed).
        if generation == 0:
            self._closed.wait(timeout_s)
        return 0

    def close(self) -> None:
        self._closed.set()


def read_members(
    host: str,
    port: int,
    cluster: str,
    *,
    timeout_s: float = 2.0,
    access: EtcdAccess = NO_ACCESS,
    members_key: MembersKey | None = None,
) -> list[Member]:
    """List the members registered in etcd once (no watch), skipping bad records (with
    `members_key`, unsigned and badly signed ones too) with a log line.

    Raises:
        TransportError, RemoteProtocolError: etcd cannot be reached or answered nonsense.
        AuthError: etcd refused the credentials.
    """
    prefix = nodes_prefix(cluster)
    gateway = EtcdGateway(host, port, timeout_s, access)
    _, kvs = parse_range(gateway.call(range_request(prefix)))
    members = []
    for kv in kvs:
        try:
            members.append(decode_member(kv.key, kv.value, prefix, members_key, kv.lease))
        except KVOffloadError as exc:
            log.warning("cluster %s: ignoring record %r: %s", cluster, kv.key, exc)
    return sorted(members, key=lambda m: m.node_id)


class EtcdMembership:
    """The nodes registered under ``/kvoffload/<cluster>/nodes/`` in etcd, kept current by a
    watch in a background thread.

    While etcd is unreachable the last known members stay (a client keeps serving from the
    nodes it knew); when it is back the thread lists the prefix again and resumes watching.
    Malformed or foreign records are skipped with one log line each.
    """

    def __init__(
        self,
        host: str,
        port: int,
        cluster: str,
        *,
        timeout_s: float = 2.0,
        access: EtcdAccess = NO_ACCESS,
        members_key: MembersKey | None = None,
    ) -> None:
        """With `members_key`, only records signed with it count (the others are ignored,
        logged once and counted in `ignored`).

        Raises: ConfigError: a TLS or password file cannot be read; AuthError: etcd refused
        the credentials (a wrong password is no outage to wait out)."""
        self.cluster = cluster
        self._members_key = members_key
        self._ignored = 0
        self._prefix = nodes_prefix(cluster)
        self._gateway = EtcdGateway(host, port, timeout_s, access)
        self._records: dict[bytes, Member] = {}
        self._members: tuple[Member, ...] = ()
        self._generation = 0
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._logged: set[tuple[bytes, int]] = set()
        self._revision = self._list_or_keep(first=True)
        self._thread = threading.Thread(
            target=self._run, name=f"kvoffload-membership-{cluster}", daemon=True
        )
        self._thread.start()

    def __repr__(self) -> str:
        return f"EtcdMembership({self._gateway!r}, {self.cluster!r}, {len(self._members)} nodes)"

    def members(self) -> tuple[Member, ...]:
        return self._members

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def ignored(self) -> int:
        return self._ignored

    def wait_changed(self, generation: int, timeout_s: float) -> int:
        with self._changed:
            self._changed.wait_for(lambda: self._generation != generation, timeout_s)
            return self._generation

    def close(self) -> None:
        self._stop.set()
        self._gateway.close()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ the watch thread

    def _list_or_keep(self, first: bool = False) -> int:
        """List the prefix; 0 (and the members unchanged) when etcd cannot be reached. The
        `first` listing raises a refusal of the credentials: a wrong password, unlike an
        outage, does not pass by itself."""
        try:
            revision, kvs = parse_range(self._gateway.call(range_request(self._prefix)))
        except AuthError:
            if first:
                raise
            log.exception("cluster %s: etcd refused this client", self.cluster)
            return 0
        except KVOffloadError as exc:
            log.warning(
                "cluster %s: etcd unreachable (%s); keeping %d known node(s)",
                self.cluster,
                exc,
                len(self._members),
            )
            return 0
        records: dict[bytes, Member] = {}
        for kv in kvs:
            member = self._decode(kv.key, kv.value, kv.mod_revision, kv.lease)
            if member is not None:
                records[kv.key] = member
        self._publish(records)
        return revision

    def _run(self) -> None:
        pause = _RETRY_FIRST_S
        while not self._stop.is_set():
            if self._revision:
                try:
                    self._follow(self._revision)
                    pause = _RETRY_FIRST_S
                except KVOffloadError as exc:
                    log.warning(
                        "cluster %s: watch broke (%s); keeping %d known node(s)",
                        self.cluster,
                        exc,
                        len(self._members),
                    )
            if self._stop.wait(pause):
                return
            pause = min(pause * 2, _RETRY_MAX_S)
            self._revision = self._list_or_keep()

    def _follow(self, revision: int) -> None:
        """Apply watch events from `revision` + 1 on until the stream ends."""
        records = dict(self._records)
        for line in self._gateway.watch(watch_request(self._prefix, revision + 1)):
            events, ended = parse_watch(line)
            for event in events:
                member = None
                if event.value is not None:
                    member = self._decode(event.key, event.value, event.revision, event.lease)
                if member is None:
                    records.pop(event.key, None)
                else:
                    records[event.key] = member
            if events:
                self._publish(dict(records))
            if ended:
                return

    def _decode(self, key: bytes, value: bytes, revision: int, lease: int) -> Member | None:
        try:
            return decode_member(key, value, self._prefix, self._members_key, lease)
        except KVOffloadError as exc:
            if (key, revision) not in self._logged:
                if len(self._logged) > 10_000:
                    self._logged.clear()
                self._logged.add((key, revision))
                log.warning("cluster %s: ignoring record %r: %s", self.cluster, key, exc)
                self._ignored += 1  # after the line: whoever sees the count finds the line
            return None

    def _publish(self, records: dict[bytes, Member]) -> None:
        members = tuple(sorted(records.values(), key=lambda m: m.node_id))
        with self._changed:
            self._records = records
            if members != self._members:
                self._members = members
                self._generation += 1
                self._changed.notify_all()
