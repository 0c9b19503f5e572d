"""A storage node's membership: its record in etcd, held by a lease this module keeps alive.

`kvoffload serve --cluster etcd[s]://[USER@]HOST:PORT/NAME` puts ``/kvoffload/NAME/nodes/<node
id>`` (the node's fronts and weight, `kvoffload.wire.membership`) under a lease of
`cluster.lease_ttl_s`, and a thread renews it every third of that. The node id is generated once
and kept in the data dir, with the random nonces of the processes that used it: a record carrying
one of those nonces is a crashed predecessor's and is replaced at once; any other record under the
id belongs to another live daemon, and registering is refused (`NodeIdClaimedError`). A file lock
on the data dir keeps two processes on one dir from both calling themselves the predecessor.

etcd refusing the node's user (a wrong password, a user without write access to the node's
record key) stops the node at start: that is a configuration to fix, not an outage to wait out.
etcd being unreachable never stops the node serving: the first attempt logs a warning, and the
thread registers again (new lease, same id) as soon as etcd answers; a node whose lease lapsed
while it was cut off is back within `rejoin_within_s(lease_ttl_s)` of etcd answering again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import secrets
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

from kvoffload.errors import AuthError, ConfigError, KVOffloadError, RemoteProtocolError
from kvoffload.nvmeof_target.cluster.etcd import EtcdClient
from kvoffload.nvmeof_target.config import Config
from kvoffload.wire.membership import (
    MAX_WEIGHT,
    MIN_WEIGHT,
    Member,
    Request,
    claim_request,
    decode_member,
    encode_member,
    get_request,
    grant_request,
    keepalive_request,
    lease_ttl,
    nodes_prefix,
    parse_claim,
    parse_grant,
    parse_range,
    revoke_request,
)

__all__ = [
    "CALL_TIMEOUT_S",
    "NodeIdClaimedError",
    "Registration",
    "join",
    "leave",
    "rejoin_within_s",
    "with_node_id",
]

log = logging.getLogger("kvoffload.cluster")

ID_FILE = "cluster-node.json"
LOCK_FILE = "cluster.lock"
# Nonces of earlier processes kept in ID_FILE: enough to cover crashes between writing the file
# and putting the record, a few times over.
_KEEP_NONCES = 8
_WILDCARDS = ("", "0.0.0.0", "::")
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
# Pauses between registration attempts while etcd is unreachable.
_RETRY_FIRST_S, _RETRY_MAX_S = 0.5, 3.0
# Each call to etcd gives up after this long.
CALL_TIMEOUT_S = 2.0


def rejoin_within_s(lease_ttl_s: float) -> float:
    """The bound on how long after etcd is reachable again a node whose lease lapsed (a cut
    link, etcd down past the TTL) has its record back: the next renewal (a third of the TTL),
    a call in flight when the link came back timing out, one failed retry's pause, and the
    renewal, grant and claim calls."""
    return lease_ttl_s / 3 + _RETRY_MAX_S + 4 * CALL_TIMEOUT_S


def with_node_id(config: Config) -> Config:
    """`config` with the node id a cluster node will register under filled in (the one kept
    in its data dir, else a new one), so that every worker proves the same id at Hello as
    clients find in etcd. Unchanged for a standalone node or a configured id.

    Raises:
        ConfigError: an unreadable identity file.
    """
    if not config.cluster.etcd or config.cluster.node_id:
        return config
    path = Path(config.data_dir) / ID_FILE
    kept: object = {}
    try:
        kept = json.loads(path.read_text())
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} is unreadable ({exc}); remove it to make a new id") from None
    node_id = str(kept.get("node_id") or "") if isinstance(kept, dict) else ""
    node_id = node_id or f"kv-{secrets.token_hex(6)}"  # kept once the node registers
    return dataclasses.replace(config, cluster=dataclasses.replace(config.cluster, node_id=node_id))


class NodeIdClaimedError(ConfigError):
    """Another live daemon holds this node id in etcd."""


class Registration:
    """This node's record in etcd (open → a keepalive thread → close)."""

    def __init__(
        self,
        config: Config,
        addresses: Mapping[str, tuple[str, int]],
        fence: Callable[[], object] | None = None,
    ) -> None:
        """`fence`: drops the node's blocks before it registers again after its lease lapsed
        (clients placed its keys elsewhere meanwhile: what it holds may be older)."""
        endpoint = config.cluster.endpoint
        assert endpoint is not None, "Registration needs [cluster] etcd"
        self.cluster = endpoint.cluster
        self.etcd_url = str(endpoint)  # no password in it: it goes to logs
        self._etcd = EtcdClient(endpoint, CALL_TIMEOUT_S)
        self._members_key = config.cluster.members_key()  # read now: a bad file fails at start
        self._config = config
        self._ttl = config.cluster.lease_ttl_s
        self._dir = Path(config.data_dir)
        self._fronts = _fronts(config, addresses)
        self._prefix = nodes_prefix(self.cluster)
        self.nonce = secrets.token_hex(8)
        self.node_id = config.cluster.node_id  # or, when "", the data dir's (open)
        self._own: set[str] = {self.nonce}
        self._lease = 0
        self._value = b""  # the record as last put, to tell when someone changed it
        self._fence = fence
        self._fenced = True  # the blocks held now are as new as the registration
        self._lock_fd = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def open(self) -> None:
        """Claim the node id (lock, id file), register once and start the keepalive thread.

        Raises:
            NodeIdClaimedError: another live daemon has this id.
            ConfigError: the data dir is in use by another daemon, or unusable.
        """
        self._dir.mkdir(parents=True, exist_ok=True)
        self._lock()
        try:
            self.node_id = self._load_identity()
            self._register()
        except (ConfigError, OSError):  # a claimed id, an unusable identity file
            self._unlock()
            raise
        except AuthError as exc:  # the wrong user or password: no retry will fix it
            self._unlock()
            # With per-node etcd users a role grants one key: say which, so the fix is clear.
            key = (self._prefix + self.node_id.encode()).decode()
            raise ConfigError(
                f"cluster {self.cluster} ({self.etcd_url}): {exc} (node {self.node_id} needs "
                f"readwrite on key {key})"
            ) from None
        except KVOffloadError as exc:
            log.warning(
                "cluster %s: %s unreachable (%s); serving, registering when it answers",
                self.cluster,
                self.etcd_url,
                exc,
            )
        self._thread = threading.Thread(target=self._run, name="kvoffload-cluster", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop renewing and remove the record (clients drop the node at once)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._lease:
            with contextlib.suppress(KVOffloadError):
                self._call(revoke_request(self._lease))
            self._lease = 0
        self._unlock()

    @property
    def member(self) -> Member:
        weight = self._config.cluster.weight or _capacity_gib(self._config)
        return Member(self.node_id, self._fronts, weight, self.nonce)

    # ------------------------------------------------------------------ identity

    def _lock(self) -> None:
        fd = os.open(self._dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                f"another kvoffload serve is running on data dir {self._dir} (it holds "
                f"{LOCK_FILE}); give each daemon its own data dir"
            ) from None
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # closing releases the flock
            self._lock_fd = -1

    def _load_identity(self) -> str:
        """The node id (configured, kept, or new) and the nonces of this dir's past processes;
        this process's nonce is on disk before its record is in etcd."""
        path = self._dir / ID_FILE
        kept: dict[str, Any] = {}
        try:
            kept = json.loads(path.read_text())
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path} is unreadable ({exc}); remove it to make a new id") from None
        if not isinstance(kept, dict):
            raise ConfigError(f"{path} is not a node identity file; remove it to make a new id")
        node_id = self._config.cluster.node_id or str(kept.get("node_id") or "")
        node_id = node_id or f"kv-{secrets.token_hex(6)}"
        nonces = [n for n in kept.get("nonces", []) if isinstance(n, str)][-_KEEP_NONCES:]
        self._own.update(nonces)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as fh:
            json.dump({"node_id": node_id, "nonces": [*nonces, self.nonce]}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        return node_id

    # ------------------------------------------------------------------ etcd

    def _register(self) -> None:
        """Grant a lease and put the record under it (replacing our own stale one).

        Raises:
            NodeIdClaimedError: a live daemon's record holds the id (the lease is revoked).
            TransportError, RemoteProtocolError: etcd is unreachable or answered nonsense.
        """
        self._claim(parse_grant(self._call(grant_request(self._ttl))))

    def _claim(self, lease: int) -> None:
        """Put the record under `lease` (see _register); revokes the lease when refused."""
        key = self._prefix + self.node_id.encode()
        # Signed for this lease: a new lease (a rejoin) gets a new signature.
        value = encode_member(self.member, self._members_key, key=key, lease=lease)
        replace, theirs = 0, ""
        for _ in range(4):  # each retry follows a record that changed under us
            done, current = parse_claim(self._call(claim_request(key, value, lease, replace)))
            if done:
                self._lease, self._value = lease, value
                log.info("cluster %s: registered node %s", self.cluster, self.node_id)
                return
            if current is None:  # it expired between the compare and the read
                replace = 0
                continue
            try:
                theirs = decode_member(current.key, current.value, self._prefix).nonce
            except RemoteProtocolError:
                theirs = "(unreadable record)"
            if theirs not in self._own:
                break
            replace = current.mod_revision  # our crashed predecessor's: take it over
        with contextlib.suppress(KVOffloadError):
            self._call(revoke_request(lease))
        if lease == self._lease:
            self._lease = 0
        raise NodeIdClaimedError(
            f"node id {self.node_id!r} is held in cluster {self.cluster!r} by another live "
            f"daemon (its record's nonce is {theirs!r}, not one of this data dir's); stop it, "
            f"or give this node another id ([cluster] node_id, or remove {self._dir / ID_FILE}). "
            f"A dead node's record expires within {self._ttl} s."
        )

    def _run(self) -> None:
        pause = _RETRY_FIRST_S
        while True:
            wait = self._ttl / 3 if self._lease else pause
            if self._stop.wait(wait):
                return
            try:
                if self._lease and lease_ttl(self._call(keepalive_request(self._lease))) > 0:
                    pause = _RETRY_FIRST_S
                    if not self._record_is_ours():
                        log.warning(
                            "cluster %s: record gone or changed; putting it back", self.cluster
                        )
                        self._claim(self._lease)
                    continue
                if self._lease:
                    log.warning("cluster %s: lease expired; registering again", self.cluster)
                    self._lease = 0
                    self._fenced = False
                if not self._fenced and self._fence is not None:
                    # Before the record is back: no client places a key here meanwhile.
                    self._fence()
                    self._fenced = True
                self._register()
                pause = _RETRY_FIRST_S
            except (NodeIdClaimedError, AuthError) as exc:
                log.error("cluster %s: %s", self.cluster, exc)
            except KVOffloadError as exc:
                if pause == _RETRY_FIRST_S:  # once per outage
                    log.warning(
                        "cluster %s: etcd unreachable (%s); still serving", self.cluster, exc
                    )
            pause = min(pause * 2, _RETRY_MAX_S)

    def _record_is_ours(self) -> bool:
        """Whether our record is still in etcd as we put it (someone may have deleted it, or
        rewritten it under our lease: a signature-checking client would drop the node)."""
        _, kvs = parse_range(self._call(get_request(self._prefix + self.node_id.encode())))
        return any(kv.lease == self._lease and kv.value == self._value for kv in kvs)

    def _call(self, request: Request) -> dict[str, Any]:
        return self._etcd.call(request)


def _fronts(config: Config, addresses: Mapping[str, tuple[str, int]]) -> dict[str, str]:
    fronts = {}
    advertise = config.cluster.advertise
    for name, (host, port) in addresses.items():
        if name == "metrics" or (advertise and advertise not in _LOOPBACK and host in _LOOPBACK):
            continue  # not a data front, or one that only this host can reach
        host = advertise or host
        if host in _WILDCARDS:
            raise ConfigError(
                f"the {name} front listens on {host or 'every address'}: tell clients where "
                "to reach this node with --advertise HOST ([cluster] advertise)"
            )
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        fronts[name] = address + (f"/{config.nvme.subnqn}" if name == "nvme" else "")
    return fronts


def _capacity_gib(config: Config) -> float:
    capacity = config.ssd.capacity_bytes or config.dram.capacity_bytes
    return min(max(round(capacity / 2**30, 3), MIN_WEIGHT), MAX_WEIGHT)


async def join(
    config: Config,
    addresses: Mapping[str, tuple[str, int]],
    out: TextIO,
    fence: Callable[[], object] | None = None,
) -> Registration | None:
    """Register this node when `[cluster] etcd` is set (None otherwise); prints its id.

    Raises:
        NodeIdClaimedError, ConfigError: see Registration.open.
    """
    if not config.cluster.etcd:
        return None
    registration = Registration(config, addresses, fence)
    await asyncio.get_running_loop().run_in_executor(None, registration.open)
    print(
        f"kvoffload: cluster {registration.cluster} node {registration.node_id}",
        file=out,
        flush=True,
    )
    return registration


async def leave(registration: Registration | None) -> None:
    if registration is not None:
        await asyncio.get_running_loop().run_in_executor(None, registration.close)
