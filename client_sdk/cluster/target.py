"""One storage node as a cluster client sees it: its transport, a circuit breaker and counters.

The breaker opens on the first failed call (a node that is down, cut off or past its deadline)
so later calls skip the node instead of paying its timeout; after a back-off (doubling up to a
cap) a background thread probes the node with one small request, and a success closes the
breaker again. The probe is not a caller's request: a node that is cut off (no reset, every
request waits out its deadline) costs callers one deadline when it fails, not one per back-off.
A breaker (and its probe) is one per node per process (`BREAKERS`), shared by every cluster
client that reaches the node the same way: N clients pay a dead node's deadline once, not N
times. Counters stay per client.

Only a failure of the node opens the breaker (`node_failed`): it is down, cut off, past its
deadline, broke the protocol or failed inside. A caller's error (`CALLER_ERRORS`: a buffer too
small, a bad key or value) would fail on every node alike; it is raised to the caller and never
held against a node. A refusal (`REFUSALS`: the node is full) is an answer from a node that
works: the put goes to another node, and the breaker stays as it is.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from kvoffload.client_sdk.transports.base import Transport
from kvoffload.errors import (
    CapacityError,
    ConfigError,
    InvalidArgumentError,
    KVOffloadError,
    TransportError,
)
from kvoffload.wire.membership import Member

__all__ = [
    "BREAKERS",
    "CALLER_ERRORS",
    "COUNTERS",
    "REFUSALS",
    "Breaker",
    "Breakers",
    "Target",
    "node_failed",
]

log = logging.getLogger("kvoffload.cluster")

# Back-off of an open breaker: short first (a restart, a blip), capped (a long outage).
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.5, 5.0
COUNTERS = (
    "requests",  # batched requests sent to the node
    "failures",  # requests that failed (down, deadline, cut off)
    "skipped",  # requests not sent because the breaker was open
    "hits",
    "misses",
    "blocks_put",
    "rerouted_in",  # blocks put here because an owner before it failed
    "repairs",  # blocks copied here from a previous owner after a miss
    "probes",  # background requests that tested a failed node
)
# The caller's errors: raised to the caller as over kv://, never a failure of the node (a
# ConfigError: the client's URL does not fit the node, e.g. no tls=1 for a TLS node).
CALLER_ERRORS: tuple[type[KVOffloadError], ...] = (InvalidArgumentError, ConfigError)
# A node's refusal of one request: it works (the breaker stays as it is); try another node.
REFUSALS: tuple[type[KVOffloadError], ...] = (CapacityError,)


def node_failed(exc: BaseException) -> bool:
    """Whether `exc` from a call to a node is a failure of the node (its breaker opens)."""
    return not isinstance(exc, CALLER_ERRORS + REFUSALS)


# What a probe asks: any answer (here: "no") shows the node is back.
_PROBE_KEY = bytes(16)


class Breaker:
    """One node's circuit breaker, shared by every cluster client of the process that reaches
    the node the same way (`Breakers`): once one client's call found the node failing, the
    others skip it too instead of each paying its deadline once."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self._lock = threading.Lock()
        self._failing = False
        self._open_until = 0.0
        self._backoff = BACKOFF_FIRST_S
        self._probing = False
        self.users = 0  # targets holding it (changed under `Breakers`' lock only)

    @property
    def up(self) -> bool:
        """False while the breaker is open."""
        return not self._failing

    def admit(self) -> tuple[bool, bool]:
        """(whether a call may use the node now, whether this caller starts the probe): one
        probe at a time per node in the process, once the back-off has passed."""
        with self._lock:
            if not self._failing:
                return True, False
            if self._probing or time.monotonic() < self._open_until:
                return False, False
            self._probing = True
            return False, True

    def probed(self) -> None:
        with self._lock:
            self._probing = False

    def succeeded(self) -> None:
        with self._lock:
            if self._failing:
                log.warning("cluster: node %s answers again", self.node_id)
                self._failing = False
                self._backoff = BACKOFF_FIRST_S

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            now = time.monotonic()
            if not self._failing:
                log.warning("cluster: node %s failed (%s); skipping it for now", self.node_id, exc)
            elif now >= self._open_until:
                # Failed again after its back-off: wait longer. Calls already in flight when
                # it opened (several clients, several threads) fail too but say nothing new.
                self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)
            self._failing = True
            self._open_until = max(self._open_until, now + self._backoff)


class Breakers:
    """The process's breakers by node identity: a node id and the route a client reaches it
    by (front, address, credentials, deadline; clients that reach it differently may see it
    differently: a wrong token fails only its own client). A breaker lives while some
    client's target holds it, so a node's state goes when the last client closes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_node: dict[tuple[str, str], Breaker] = {}

    def take(self, node_id: str, route: str) -> Breaker:
        with self._lock:
            breaker = self._by_node.get((node_id, route))
            if breaker is None:
                breaker = self._by_node[node_id, route] = Breaker(node_id)
            breaker.users += 1
            return breaker

    def give_back(self, node_id: str, route: str, breaker: Breaker) -> None:
        with self._lock:
            breaker.users -= 1
            if breaker.users == 0 and self._by_node.get((node_id, route)) is breaker:
                del self._by_node[node_id, route]

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_node)

    def forget(self) -> None:
        """Start empty with a new lock (a forked child: its parent's probe threads did not
        come along, so a breaker inherited mid-probe would skip its node forever, and a lock
        held at the fork would never be released)."""
        self._lock = threading.Lock()
        self._by_node = {}


# Process-wide on purpose: the connectors and applications open their clients independently,
# and a dead node should cost the process one deadline, not one per client.
BREAKERS = Breakers()
# A forked child's clients start from no breaker state (targets it inherited keep theirs).
os.register_at_fork(after_in_child=BREAKERS.forget)


class Target:
    """A member's transport (opened on first use), its breaker and this client's counters.

    Args:
        member: the node's record.
        open_transport: opens this client's transport to the node.
        deadline_s: the node transport's deadline.
        route: how this client reaches the node (its node URL); targets of one process with
            the same node id and route share one breaker. None: a breaker of its own.
    """

    def __init__(
        self,
        member: Member,
        open_transport: Callable[[], Transport],
        deadline_s: float,
        route: str | None = None,
    ):
        self.member = member
        self._open = open_transport
        self._deadline_s = deadline_s
        self._transport: Transport | None = None
        self._lock = threading.Lock()
        self._route = route
        self._breaker = (
            BREAKERS.take(member.node_id, route) if route is not None else Breaker(member.node_id)
        )
        self._closed = False
        self.counters = dict.fromkeys(COUNTERS, 0)

    @property
    def node_id(self) -> str:
        return self.member.node_id

    @property
    def transport(self) -> Transport:
        transport = self._transport
        if transport is None:
            with self._lock:
                if self._closed:  # a late probe must not open what close() has closed
                    raise TransportError(f"node {self.node_id}: the client is closed")
                transport = self._transport = self._transport or self._open()
        return transport

    @property
    def up(self) -> bool:
        """False while the breaker is open."""
        return self._breaker.up

    def admit(self) -> bool:
        """Whether a call may use this node now: not while the breaker is open. Once its
        back-off has passed, the first caller in the process starts a background probe over
        its own transport (and still skips the node); the probe's answer closes the breaker or
        opens it for a longer back-off."""
        admitted, probe = self._breaker.admit()
        if admitted:
            return True
        self.count("skipped")
        if probe:
            if self._closed:
                self._breaker.probed()
            else:
                threading.Thread(
                    target=self._probe, name="kvoffload-cluster-probe", daemon=True
                ).start()
        return False

    def _probe(self) -> None:
        try:
            self.transport.exists(_PROBE_KEY)
        except (KVOffloadError, OSError) as exc:  # a thread boundary: the failure is the result
            self.failed(exc, counted=False)  # ignored if the client closed under it
        else:
            self.succeeded(counted=False)
        finally:
            self._breaker.probed()
            self.count("probes")

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def succeeded(self, counted: bool = True) -> None:
        """The node answered (`counted`: a data request, not a stats or limits query)."""
        if self._closed:
            return
        with self._lock:
            self.counters["requests"] += counted
        self._breaker.succeeded()

    def answered(self, exc: BaseException, counted: bool = True) -> None:
        """A call ended in `exc`: a node failure opens the breaker (`failed`); a caller's error
        or a refusal only counts the request and leaves the breaker as it is."""
        if self._closed:
            return
        if node_failed(exc):
            self.failed(exc, counted)
        else:
            self.count("requests", counted)

    def failed(self, exc: BaseException, counted: bool = True) -> None:
        """The node failed: its breaker opens. Not once this client closed: a call in flight
        then fails because of the close ("the client is closed", a closed socket), which says
        nothing of the node, and the breaker is shared with other clients."""
        if self._closed:
            return
        with self._lock:
            self.counters["requests"] += counted
            self.counters["failures"] += counted
        self._breaker.failed(exc)

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            return {**self.counters, "up": self._breaker.up}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            transport, self._transport = self._transport, None
        if self._route is not None:
            BREAKERS.give_back(self.node_id, self._route, self._breaker)
        if transport is not None:
            transport.close()
