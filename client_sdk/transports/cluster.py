"""`cluster://` and `cluster+etcd://`: one transport over many storage nodes.

Keys are placed by weighted rendezvous hashing over the nodes that answer (`Placement`); with
`replicas=R` a put goes to a key's R best nodes and a read tries its R + 1 best in order, so
after a membership change the previous owner (now one rank down) still answers, and the block
is copied to the new owner. Every batch is one request per node, all nodes side by side; a read
that needs a second rank sends a second batch only for the keys still missing.

Failures are misses: a node that fails (down, past the deadline, cut off) answers nothing for
that call and its breaker opens (`cluster.target`); a put meant for it goes to the next node in
HRW order. A put raises when some block could be stored on no node at all, and (etcd
membership) when it is not acknowledged, below.

With etcd membership a put or delete is acknowledged only when every one of each key's R + 1
best members (down or not) answered: a node that missed a write keeps its record only until the
lease lapses, and drops its blocks when it rejoins (the daemon), so it cannot serve the older
value. A client whose keys name their content (`immutable=1`: chained block keys, DESIGN §3)
has no older value to fear: its puts are acknowledged once each block is on one node (a lost
owner's share goes to the next live node in the key's order, where reads look), and they
clear no next rank; its deletes still need every member. A strict put that is not
acknowledged removes the copies it left beyond a key's R + 1 best members (two failures in one
put): reads find them while one of those members is skipped, and no later put or delete reaches
them. An `immutable=1` put leaves them (the same block; a removal by key could take another
client's acknowledged copy).

Read repair only copies forward: the node stores a copy only where the key is absent and was
not deleted lately (`Repair`, protocol 5), with the source's parent and metadata.

A caller's error (`InvalidArgumentError`: a buffer too small, a value too large) is raised to the
caller as over `kv://` and is no failure of the node; a full node's `CapacityError` sends the put
to the next node without opening its breaker, and is raised if no node could take the block.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import partial
from typing import TypeVar
from urllib.parse import urlencode

import numpy as np
import numpy.typing as npt

from kvoffload.client_sdk.cluster.membership import Membership, open_membership, parse_cluster_url
from kvoffload.client_sdk.cluster.placement import Placement
from kvoffload.client_sdk.cluster.target import CALLER_ERRORS, REFUSALS, Target
from kvoffload.client_sdk.transports import open_transport
from kvoffload.client_sdk.transports.base import (
    HeldBlock,
    PutItem,
    Received,
    Repairing,
    ThreadedAsyncTransport,
    Transport,
)
from kvoffload.client_sdk.transports.sharding import Got, release
from kvoffload.client_sdk.url import StoreURL, parse_url
from kvoffload.errors import (
    CapacityError,
    ConfigError,
    InvalidArgumentError,
    KVOffloadError,
    TransportError,
)
from kvoffload.wire.membership import Member
from kvoffload.wire.native.connection import REPAIR_MAX_AGE_S
from kvoffload.wire.shards import merge_stats
from kvoffload.wire.tiers import Tier, TierRun

__all__ = ["ClusterTransport", "open_cluster", "open_cluster_async"]

log = logging.getLogger("kvoffload.cluster")
T = TypeVar("T")

DEFAULT_DEADLINE_S = 2.0
_PARAMS = {
    "timeout": f"seconds per call to a node (default {DEFAULT_DEADLINE_S:g})",
    "token": "the tenant's secret on every node (front=native; never sent, see kv://)",
    "tenant": "the tenant's name (front=native; optional)",
    "legacy_token": "1: send the token itself to nodes older than protocol 5 (front=native)",
    "data": "kv (default) or nixl: how payloads move to native nodes",
    "nixl_cache_bytes": "data=nixl: bytes kept registered per node connection",
    "hostnqn": "this host's NQN on every node (front=nvme; default as for nvme+tcp://)",
    "tls": "1: reach the nodes' native fronts over TLS (their native+tls fronts)",
    "ca": "tls=1: CA file that signed the nodes' certificates (default: the system's CAs)",
    "server_name": "tls=1: certificate name to expect (default: each node's host)",
    "immutable": "1: every key this client puts names its content (chained block keys): a put "
    "is acknowledged once each block is on one of its key's replicas + 1 best members "
    "(default 0: over etcd membership, every one of them must hold it or answer)",
}
# Repairs (copies to a new owner) run in the background; past this many waiting, skip them.
_MAX_REPAIRS = 64
_POOL_THREADS = 32


def _store_url(url: StoreURL) -> str:
    """The URL text again (Client.connect parsed it; the cluster parser wants it whole)."""
    netloc = (f"{url.userinfo}@" if url.userinfo else "") + url.host
    netloc += f":{url.port}" if url.port else ""
    query = f"?{urlencode(dict(url.params))}" if url.params else ""
    return f"{url.scheme}://{netloc}{url.path}{query}"


class ClusterTransport:
    """A blocking transport over the members of `membership`: their placement and side-by-side
    calls to them.

    Args:
        membership: where the members come from (static list or etcd watch).
        replicas: copies of each block.
        open_node: opens a member's transport (called on its first use).
        deadline_s: the node transports' deadline; also the breaker's probe window.
        durable_puts: whether the nodes' front can store durably (NVMe/TCP cannot).
        strict_puts: a put is acknowledged only when every one of each key's R + 1 best
            members holds the new value or nothing (etcd membership: a member that missed it
            has a lease that lapses, and drops its blocks when it rejoins).
        immutable_puts: every key put names its content, so no node can hold an older value
            of it: a put is acknowledged once each block is on one node, and clears no next
            rank (`strict_puts` then applies to deletes only).
        node_route: how this client reaches a member (its node URL); the clients of a process
            that reach a node by the same route share its breaker (`cluster.target`). None:
            each target keeps a breaker of its own.
    """

    def __init__(
        self,
        membership: Membership,
        replicas: int,
        open_node: Callable[[Member], Transport],
        deadline_s: float = DEFAULT_DEADLINE_S,
        durable_puts: bool = True,
        strict_puts: bool = False,
        immutable_puts: bool = False,
        node_route: Callable[[Member], str] | None = None,
    ) -> None:
        self.replicas = replicas
        self._node_route = node_route
        self.immutable_puts = immutable_puts
        self._durable_puts = durable_puts
        self._strict_puts = strict_puts
        self._membership = membership
        self._open_node = open_node
        self._deadline_s = deadline_s
        self._targets: dict[tuple[str, tuple[tuple[str, str], ...]], Target] = {}
        self._generation = -1
        self._members: tuple[Target, ...] = ()
        self._placements: dict[tuple[tuple[str, float], ...], Placement] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(_POOL_THREADS, "kvoffload-cluster")
        # Copies to new owners on their own threads, so they never queue ahead of reads.
        self._repair_pool = ThreadPoolExecutor(2, "kvoffload-cluster-repair")
        self._repairs = threading.BoundedSemaphore(_MAX_REPAIRS)
        self._max_value_bytes: int | None = None
        self._closed = False
        self.counters = dict.fromkeys(
            (
                "puts_rerouted",
                "puts_short",
                "puts_lost",
                "puts_misplaced",
                "strays_removed",
                "strays_left",
                "clears_failed",
                "repairs",
                "repairs_skipped",
                "repairs_refused",
            ),
            0,
        )

    # ------------------------------------------------------------------ members and placement

    def _current(self) -> tuple[Target, ...]:
        """The targets of the members now: a new Target when a node's fronts change; a node
        back at the same fronts keeps its Target (transport, breaker, counters) with its record
        refreshed, so a new weight places keys at once."""
        generation = self._membership.generation
        if generation != self._generation:
            with self._lock:
                if self._closed:
                    raise TransportError("the client is closed")
                # By node id, as Placement orders them: its ranks index `live` in `_plan`.
                members = sorted(self._membership.members(), key=lambda m: m.node_id)
                targets = []
                for member in members:
                    ident = (member.node_id, tuple(sorted(member.fronts.items())))
                    target = self._targets.get(ident)
                    if target is None:
                        route = self._node_route(member) if self._node_route else None
                        opener = partial(self._open_node, member)
                        target = Target(member, opener, self._deadline_s, route)
                        self._targets[ident] = target
                    elif target.member != member:
                        target.member = member  # a new weight or nonce, the same address
                    targets.append(target)
                self._members, self._generation = tuple(targets), generation
        if self._closed:
            raise TransportError("the client is closed")
        return self._members

    def _plan(
        self,
        keys: Sequence[bytes],
        width: int,
        exclude: frozenset[Target] = frozenset(),
        members: tuple[Target, ...] | None = None,
    ) -> tuple[list[Target], npt.NDArray[np.intp]]:
        """The nodes of `members` (default: the current ones) that may be used now and, per
        key, the indexes of its `width` best among them (HRW over the admitted nodes = HRW over
        all with the others skipped)."""
        live = [t for t in members or self._current() if t not in exclude and t.admit()]
        if not live or not keys:
            return live, np.zeros((len(keys), 0), dtype=np.intp)
        # Placement sorts members by node id, like `live` (`_current` sorts them).
        return live, self._placement(live).rank_many(keys, width)

    def _placement(self, targets: Sequence[Target]) -> Placement:
        members = [t.member for t in targets]
        # Keyed by ids and weights: a node whose weight changed is ranked anew.
        ident = tuple((m.node_id, m.weight) for m in members)
        placement = self._placements.get(ident)
        if placement is None:
            if len(self._placements) > 64:
                self._placements.clear()
            placement = self._placements[ident] = Placement(members)
        return placement

    def _owners(
        self, key: bytes, width: int, members: tuple[Target, ...] | None = None
    ) -> list[Target]:
        """The key's `width` best members, whether their breaker is open or not."""
        members = members or self._current()
        if not members:
            return []
        return [members[n] for n in self._placement(members).rank_many([key], width)[0]]

    def _fanout(
        self,
        groups: dict[Target, list[int]],
        call: Callable[[Target, list[int]], T],
        counted: bool = True,
        raise_caller: bool = True,
    ) -> list[tuple[Target, list[int], T | None, BaseException | None]]:
        """`call(target, positions)` for each group side by side (the last in this thread);
        each answer or error, with the breaker told which (only a node's failure opens it).
        Once all have answered, a caller's error is raised (`raise_caller`; else the caller
        raises it with `_raise_caller_error` when it has taken the other answers in)."""

        def one(target: Target, at: list[int]) -> T:
            try:
                result = call(target, at)
            except KVOffloadError as exc:
                target.answered(exc, counted)
                raise
            target.succeeded(counted)
            return result

        items = list(groups.items())
        futures: list[Future[T]] = []
        try:
            for t, at in items[:-1]:
                futures.append(self._pool.submit(one, t, at))
        except RuntimeError:  # the pool shut down: close() ran while this call was under way
            wait(futures)
            raise TransportError("the client is closed") from None
        out: list[tuple[Target, list[int], T | None, BaseException | None]] = []
        if items:
            target, at = items[-1]
            try:
                out.append((target, at, one(target, at), None))
            except KVOffloadError as exc:
                out.append((target, at, None, exc))
        wait(futures)
        for (target, at), future in zip(items, futures, strict=False):
            error = future.exception()
            if error is not None and not isinstance(error, KVOffloadError):
                raise error
            out.append((target, at, None if error else future.result(), error))
        if raise_caller:
            self._raise_caller_error(out)
        return out

    @staticmethod
    def _raise_caller_error(
        answers: Sequence[tuple[Target, list[int], object, BaseException | None]],
    ) -> None:
        """Raise the first caller's error among `answers` (it would fail on any node)."""
        for _, _, _, exc in answers:
            if isinstance(exc, CALLER_ERRORS):
                raise exc

    @staticmethod
    def _group(
        live: list[Target],
        ranks: npt.NDArray[np.intp],
        rank: int,
        at: Sequence[int] | npt.NDArray[np.intp],
    ) -> dict[Target, list[int]]:
        """Positions `at` grouped by their node of rank `rank` (vectorised: one pass per node)."""
        where = np.asarray(at, dtype=np.intp)
        nodes = ranks[where, rank] if len(where) else where
        return {live[n]: where[nodes == n].tolist() for n in np.unique(nodes)}

    @staticmethod
    def _skip_open(groups: dict[Target, list[int]]) -> tuple[dict[Target, list[int]], list[int]]:
        """`groups` less the nodes whose breaker opened since the call made its plan (a
        failure at an earlier rank of this call, or in another call), and their positions:
        a call goes on to the next rank instead of waiting out a silent node's deadline once
        per rank."""
        kept = {t: at for t, at in groups.items() if t.up}
        return kept, [i for t, at in groups.items() if not t.up for i in at]

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._membership.close()
        self._pool.shutdown(wait=True)
        self._repair_pool.shutdown(wait=True)
        for target in list(self._targets.values()):
            target.close()

    # ------------------------------------------------------------------ the Transport API

    @property
    def max_value_bytes(self) -> int:
        if self._max_value_bytes is None:
            for target in self._current():
                if not target.admit():
                    continue
                try:
                    self._max_value_bytes = target.transport.max_value_bytes
                    target.succeeded(counted=False)
                    break
                except KVOffloadError as exc:
                    target.answered(exc, counted=False)
                    if isinstance(exc, CALLER_ERRORS):
                        raise
            else:
                raise TransportError("no storage node of the cluster can be reached")
        return self._max_value_bytes

    def put(
        self,
        key: bytes,
        parts: Sequence[object],
        parent: bytes | None,
        durable: bool = False,
        meta: bytes | None = None,
    ) -> None:
        self.put_many([(key, parts, parent, meta)], durable)

    def put_many(self, items: Sequence[PutItem], durable: bool = False) -> None:
        """Each block to its R best nodes; a failed node's blocks to the next node in HRW order.

        Raises:
            InvalidArgumentError: a durable put over fronts that cannot store durably, or a
                node refused an item as the caller's error (as over `kv://`).
            CapacityError: some block could be stored on no node, and every node that was
                asked refused it as full.
            TransportError: some block could be stored on no node (none answers).
        """
        if durable and not self._durable_puts:
            # Refused here: sent on, every node would refuse it and look down to the breaker.
            raise InvalidArgumentError("cluster front=nvme has no durable stores (no FUA)")
        keys = [item[0] for item in items]
        # One membership for the plan and the acknowledgement: a node that joins meanwhile
        # was sent nothing, and holds no copy either (a node drops its blocks to join).
        members = self._current()
        stored = [0] * len(items)
        owners_of: list[set[Target]] = [set() for _ in items]  # hold the new value
        cleared_on: list[set[Target]] = [set() for _ in items]  # hold no copy now
        failed: set[Target] = set()
        refusals = errors = 0  # a full node's refusals, and all errors
        pending = list(range(len(items)))
        for attempt in range(2):
            # The first round also clears each key off its next node (rank R): a copy put
            # there while an owner was down must not outlive this put (it would be read
            # when the owners miss, an older value). A content-named key has no older value.
            width = self.replicas + (attempt == 0 and not self.immutable_puts)
            live, ranks = self._plan([keys[i] for i in pending], width, frozenset(failed), members)
            groups: dict[Target, list[int]] = {}
            clears: dict[Target, set[int]] = {}
            for row, i in enumerate(pending):
                for r in range(ranks.shape[1]):
                    target = live[ranks[row, r]]
                    if r == self.replicas:
                        clears.setdefault(target, set()).add(i)
                        groups.setdefault(target, []).append(i)
                    elif target not in owners_of[i]:
                        groups.setdefault(target, []).append(i)

            def call(t: Target, at: list[int], clears: dict[Target, set[int]] = clears) -> None:
                cleared = clears.get(t, set())
                puts = [items[i] for i in at if i not in cleared]
                if puts:
                    t.transport.put_many(puts, durable)
                if cleared:
                    self._clear(t, [keys[i] for i in at if i in cleared])

            sent = self._fanout(groups, call)
            retry: set[int] = set()
            for target, at, _, exc in sent:
                cleared = clears.get(target, set())
                put_at = [i for i in at if i not in cleared]
                if exc is not None:
                    errors += 1
                    refusals += isinstance(exc, REFUSALS)
                    failed.add(target)
                    retry.update(put_at)
                    if len(put_at) < len(at):
                        self._count("clears_failed", len(at) - len(put_at))
                    continue
                for i in cleared.intersection(at):
                    cleared_on[i].add(target)
                target.count("blocks_put", len(put_at))
                if attempt:
                    target.count("rerouted_in", len(put_at))
                for i in put_at:
                    stored[i] += 1
                    owners_of[i].add(target)
            pending = sorted(i for i in retry if stored[i] < self.replicas)
            if not pending:
                break
            if not attempt:
                self._count("puts_rerouted", len(pending))
        unacknowledged: TransportError | None = None
        if self.immutable_puts or self._strict_puts:
            unacknowledged = self._acknowledgement(keys, owners_of, cleared_on, members)
        self._settle_puts(stored, durable, full=0 < refusals == errors)
        if unacknowledged is not None:
            raise unacknowledged

    def _acknowledgement(
        self,
        keys: Sequence[bytes],
        owners_of: list[set[Target]],
        cleared_on: list[set[Target]],
        members: tuple[Target, ...],
    ) -> TransportError | None:
        """The error to raise unless the put is acknowledged; a copy it left beyond a key's
        R + 1 best members (two failures in the put) is removed first.

        `immutable=1`: each block must be on one of its key's R + 1 best members: once two of
        them failed, a rerouted copy can land further down, where reads stop looking when
        they answer again, and deletes never look. Otherwise (strict): every one of those
        members (down or not) must hold the new value or no copy: one that missed the put may
        serve the older value once it answers again."""
        if not members or not keys:
            return None
        ranks = self._placement(members).rank_many(keys, self.replicas + 1)
        missed: set[str] = set()
        short: list[int] = []
        for i, row in enumerate(ranks):
            best = [members[r] for r in row]
            if self.immutable_puts:
                # A block on no node at all is `puts_lost` (`_settle_puts` raises for it).
                if owners_of[i] and not any(t in owners_of[i] for t in best):
                    short.append(i)
                continue
            absent = [t.node_id for t in best if t not in owners_of[i] | cleared_on[i]]
            if absent:
                short.append(i)
                missed.update(absent)
        if not short:
            return None
        if self.immutable_puts:
            # No stray removal: a delete goes by key, and another client whose membership
            # differs (etcd records lapsing at different times, other static lists) may count
            # that node among the key's best and have had its own put acknowledged there. A
            # content-named copy is the same block: left, it can at worst bring a deleted
            # block back, which a content-named key may serve.
            self._count("puts_misplaced", len(short))
            why = (
                f"stored only on nodes beyond each key's {self.replicas + 1} best, where reads "
                "stop looking once those answer again (those copies left in place)"
            )
        else:
            self._remove_strays(keys, owners_of, members, ranks, short)
            why = (
                f"node(s) {', '.join(sorted(missed))} did not answer (stored on the others; a "
                "member that misses an overwrite could serve the older value)"
            )
        return TransportError(
            f"put not acknowledged for {len(short)} of {len(keys)} block(s): {why}; retry"
        )

    def _remove_strays(
        self,
        keys: Sequence[bytes],
        owners_of: list[set[Target]],
        members: tuple[Target, ...],
        ranks: npt.NDArray[np.intp],
        short: list[int],
    ) -> None:
        """Delete the copies an unacknowledged strict put left beyond its key's R + 1 best
        members (best effort; `strays_removed`, or `strays_left` where the node did not
        answer). The delete goes by key: a client whose membership view differs may hold its
        own acknowledged copy there, and loses it (a miss; docs/guides/cluster.md), which is
        still better than an older value served later.

        Such a copy is read while one of those members is skipped (breaker open, or its record
        gone), yet no later put clears it (puts clear rank R only) and no delete reaches it: an
        overwrite acknowledged afterwards could lose to it, and a deleted block come back."""
        strays: dict[Target, list[int]] = {}
        for i in short:
            best = {members[r] for r in ranks[i]}
            for target in owners_of[i] - best:
                strays.setdefault(target, []).append(i)
        if not strays:
            return
        answers = self._fanout(
            strays, lambda t, at: self._clear(t, [keys[i] for i in at]), raise_caller=False
        )
        for _, at, _, exc in answers:
            self._count("strays_left" if exc is not None else "strays_removed", len(at))
            if exc is not None:
                log.warning(
                    "cluster: %d stray cop(ies) of an unacknowledged put left (%s)", len(at), exc
                )

    @staticmethod
    def _clear(target: Target, keys: list[bytes]) -> None:
        """Drop `keys`' copies on `target` (a batch where the node can, else one by one)."""
        transport = target.transport
        if isinstance(transport, Repairing) and transport.delete_many(keys) is not None:
            return
        for key in keys:
            transport.delete(key)

    def _settle_puts(self, stored: list[int], durable: bool, full: bool = False) -> None:
        lost = sum(1 for n in stored if n == 0)
        short = sum(1 for n in stored if 0 < n < self.replicas)
        if short:
            self._count("puts_short", short)
            log.debug("cluster: %d block(s) stored on fewer than %d nodes", short, self.replicas)
        if lost:
            self._count("puts_lost", lost)
            if full:
                raise CapacityError(
                    f"{lost} of {len(stored)} block(s) could not be stored: "
                    "every node asked is full"
                )
            raise TransportError(
                f"{lost} of {len(stored)} block(s) could not be stored on any cluster node"
                + (" durably" if durable else "")
            )

    def get(self, key: bytes) -> HeldBlock | None:
        return self.get_many([key])[0]

    def get_into(self, key: bytes, buffer: memoryview) -> Got:
        return self.get_many_into([key], [buffer])[0]

    def get_many(self, keys: Sequence[bytes]) -> list[HeldBlock | None]:
        got = self._read(keys, lambda t, at: t.transport.get_many([keys[i] for i in at]))
        return [g if not isinstance(g, Received) else None for g in got]

    def get_many_into(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[Got]:
        return self._read(
            keys,
            lambda t, at: t.transport.get_many_into(
                [keys[i] for i in at], [buffers[i] for i in at]
            ),
            buffers,
        )

    def _read(
        self,
        keys: Sequence[bytes],
        call: Callable[[Target, list[int]], Sequence[Got]],
        buffers: Sequence[memoryview] | None = None,
    ) -> list[Got]:
        """Rank by rank: the keys still missing go to their next node (up to R + 1 ranks); a
        block found below an owner that answered "miss" is copied to that owner."""
        sent_at = time.monotonic()  # a repair's age counts from before the read went out
        out: list[Got] = [None] * len(keys)
        source: dict[int, Target] = {}
        live, ranks = self._plan(keys, self.replicas + 1)
        missed: dict[int, list[Target]] = {}
        pending = list(range(len(keys)))
        try:
            for rank in range(ranks.shape[1]):
                groups, still = self._skip_open(self._group(live, ranks, rank, pending))
                answers = self._fanout(groups, call, raise_caller=False)
                for target, at, got, exc in answers:
                    if exc is not None or got is None:
                        still.extend(at)
                        continue
                    hits = 0
                    for i, block in zip(at, got, strict=True):
                        if block is None:
                            still.append(i)
                            if rank < self.replicas:
                                missed.setdefault(i, []).append(target)
                        else:
                            out[i], hits = block, hits + 1
                            source[i] = target
                    target.count("hits", hits)
                    target.count("misses", len(at) - hits)
                # Raised once this rank's blocks are in `out`, so that they are released.
                self._raise_caller_error(answers)
                pending = sorted(still)
                if not pending:
                    break
        except BaseException:
            release([], [b for b in out if b is not None])
            raise
        for i, owners in missed.items():
            if out[i] is not None:
                buffer = buffers[i] if buffers is not None else None
                self._repair(keys[i], out[i], buffer, owners, source[i], sent_at)
        return out

    def _repair(
        self,
        key: bytes,
        block: Got,
        buffer: memoryview | None,
        owners: list[Target],
        source: Target,
        sent_at: float,
    ) -> None:
        """Copy a block found below its owners to the owners that missed it (background).

        A copy only ever moves forward: it carries the source's parent and metadata, and the
        owner stores it only where the key is absent and was not deleted lately (`Repair`);
        it is dropped past `REPAIR_MAX_AGE_S` from the read, and when the source no longer
        holds the key. Nodes that cannot check (an older daemon, the NVMe/TCP front) get no
        copy: a read still finds the block below."""
        if not self._repairs.acquire(blocking=False):
            self._count("repairs_skipped")
            return
        if isinstance(block, Received):
            assert buffer is not None
            value = bytes(block.header) + bytes(buffer[: block.length])
        else:
            value = bytes(block.data) if block is not None else b""

        def fresh() -> bool:
            if time.monotonic() - sent_at <= REPAIR_MAX_AGE_S:
                return True
            self._count("repairs_skipped")
            return False

        def copy() -> None:
            try:
                origin = source.transport
                if not fresh() or not isinstance(origin, Repairing):
                    return
                try:
                    described = origin.describe(key)
                except KVOffloadError as exc:
                    source.answered(exc)
                    return
                if described is None or not described[0]:
                    return  # gone from the source since (deleted): nothing to copy
                _, parent, meta = described
                for target in owners:
                    into = target.transport
                    if not fresh() or not isinstance(into, Repairing):
                        continue
                    try:
                        stored = into.repair(key, [value], parent, meta)
                    except KVOffloadError as exc:
                        target.answered(exc)
                        continue
                    if stored:
                        target.count("repairs")
                    elif stored is not None:
                        self._count("repairs_refused")
            finally:
                self._repairs.release()

        try:
            self._repair_pool.submit(copy)
        except RuntimeError:  # closed since the read: no copy (a later read finds it below)
            self._repairs.release()
            return
        self._count("repairs")

    def exists(self, key: bytes) -> bool:
        live, ranks = self._plan([key], self.replicas + 1)
        for rank in range(ranks.shape[1]):
            target = live[ranks[0, rank]]
            try:
                found = target.transport.exists(key)
            except KVOffloadError as exc:
                target.answered(exc)
                if isinstance(exc, CALLER_ERRORS):
                    raise
                continue
            target.succeeded()
            if found:
                return True
        return False

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        """`exists` for each key: rank by rank, each rank's nodes asked (one batch per node,
        side by side) only about the keys no better node had; a node that fails is passed
        over, as `exists` does."""
        live, ranks = self._plan(keys, self.replicas + 1)
        present = np.zeros(len(keys), dtype=bool)
        for rank in range(ranks.shape[1]):
            unknown = np.flatnonzero(~present)
            if not len(unknown):
                break
            groups, _ = self._skip_open(self._group(live, ranks, rank, unknown))
            answers = self._fanout(
                groups, lambda t, at: t.transport.exists_many([keys[i] for i in at])
            )
            for _, at, found, _ in answers:
                if found is not None:
                    present[[i for i, one in zip(at, found, strict=True) if one]] = True
        return [bool(one) for one in present]

    def lookup(self, keys: Sequence[bytes]) -> int:
        """The chain's leading run; a key counts as present if any of its R + 1 best nodes has
        it. Rank by rank, each rank asked only about the keys not yet known present past the
        run so far. A node's leading run says nothing past its first miss, so when keys turned
        up below their best node (after a membership change) the ranks are asked once more
        about what is still unknown; the answer can fall short, never over."""
        live, ranks = self._plan(keys, self.replicas + 1)
        present = np.zeros(len(keys), dtype=bool)
        run = 0
        for _ in range(2):
            found_below = False
            for rank in range(ranks.shape[1]):
                unknown = np.flatnonzero(~present[run:]) + run
                # Keys of a node whose breaker opened stay unknown, for the next rank.
                groups, _ = self._skip_open(self._group(live, ranks, rank, unknown))
                answers = self._fanout(
                    groups, lambda t, at: t.transport.lookup([keys[i] for i in at])
                )
                for _, at, found, _ in answers:
                    present[at[: found or 0]] = True
                    found_below = found_below or (rank > 0 and bool(found))
                missing = np.flatnonzero(~present[run:])
                run = run + int(missing[0]) if len(missing) else len(keys)
                if run == len(keys):
                    return run
            if not found_below:
                break
        return run

    def lookup_tiers(self, keys: Sequence[bytes]) -> TierRun:
        """`lookup`'s run, every block `Tier.REMOTE`: it is loaded from a storage node across
        the network, whatever tier the node holds it in."""
        return TierRun.of(Tier.REMOTE, self.lookup(keys))

    def prefetch(self, keys: Sequence[bytes]) -> int:
        live, ranks = self._plan(keys, 1)
        if not ranks.shape[1]:
            return 0
        groups = self._group(live, ranks, 0, range(len(keys)))
        answers = self._fanout(groups, lambda t, at: t.transport.prefetch([keys[i] for i in at]))
        return sum(n or 0 for _, _, n, _ in answers)

    def delete(self, key: bytes) -> bool:
        """Delete the key on its R + 1 best nodes. Acknowledged (returns) only when every one
        of its R + 1 best *members* answered: a member that did not (down while its record
        lives, cut off) may still serve the key, so the delete raises, and the caller retries
        (it succeeds once the node answers, or once its record is gone: a node that returns
        to the membership drops its blocks first).

        Raises:
            TransportError: some of the key's R + 1 best members did not answer.
        """
        members = self._current()  # one membership for the plan and the acknowledgement
        live, ranks = self._plan([key], self.replicas + 1, members=members)
        groups = {live[r]: [0] for r in ranks[0]}
        answers = self._fanout(groups, lambda t, at: t.transport.delete(key))
        answered = {t for t, _, _, exc in answers if exc is None}
        owners = self._owners(key, self.replicas + 1, members)
        missing = [t.node_id for t in owners if t not in answered]
        if missing:
            raise TransportError(
                f"delete not acknowledged: node(s) {', '.join(missing)} did not answer "
                "(a member that misses a delete could serve the key again); retry"
            )
        return any(found for _, _, found, _ in answers)

    def stats(self) -> dict[str, object]:
        """The nodes' stats added up, plus "nodes": {node id: this client's counters, "up"}
        and "cluster": placement counters."""
        targets = self._current()
        groups = {t: [0] for t in targets if t.admit()}
        answers = self._fanout(groups, lambda t, at: t.transport.stats(), counted=False)
        merged = merge_stats([s for _, _, s, _ in answers if s is not None])
        merged["nodes"] = {
            t.node_id: {**t.snapshot(), "weight": t.member.weight, "fronts": dict(t.member.fronts)}
            for t in targets
        }
        with self._lock:
            merged["cluster"] = {
                **self.counters,
                "replicas": self.replicas,
                "members": len(targets),
                "records_ignored": self._membership.ignored,
                "immutable": self.immutable_puts,
            }
        return merged


class _ThreadedCluster(ThreadedAsyncTransport):
    """The async API over a cluster: every call may wait on the network (a node's deadline),
    so each runs in a worker thread (`ThreadedAsyncTransport` does so for index calls of a
    transport that is not `index_inline`), never on the event loop; so does close, which
    waits for the calls under way."""

    def __init__(self, inner: ClusterTransport) -> None:
        super().__init__(inner)
        self._cluster = inner

    async def close(self) -> None:
        await asyncio.to_thread(self._cluster.close)


def open_cluster(url: StoreURL) -> ClusterTransport:
    """Open `cluster://h1:p1,h2:p2?replicas=R&timeout=S` or
    `cluster+etcd[s]://[user:pass@]host:port/NAME?...`.

    Raises:
        ConfigError: a bad cluster URL.
        AuthError: etcd refused the URL's credentials.
    """
    spec = parse_cluster_url(_store_url(url), _PARAMS)
    try:
        deadline = float(spec.extra.get("timeout", DEFAULT_DEADLINE_S))
    except ValueError:
        deadline = -1.0
    if not 0 < deadline <= 3600:
        raise ConfigError(
            f"cluster URL: timeout must be seconds > 0, got {spec.extra['timeout']!r}"
        )
    # retries=0: a node's own retries (back-off up to the deadline) would keep every caller
    # on a dead node; here its replicas and its breaker answer for it at once.
    node_params = {"timeout": f"{deadline:g}", "connect_timeout": f"{deadline:g}", "retries": "0"}
    # Each front authenticates its own way: a tenant's secret (native), the host's NQN
    # (NVMe/TCP); data= chooses how payloads move to native nodes.
    for name, front in (
        ("token", "native"),
        ("tenant", "native"),
        ("legacy_token", "native"),
        ("data", "native"),
        ("nixl_cache_bytes", "native"),
        ("hostnqn", "nvme"),
        ("tls", "native"),
        ("ca", "native"),
        ("server_name", "native"),
    ):
        if name in spec.extra:
            if spec.front != front:
                raise ConfigError(f"cluster URL: {name}= applies to front={front} only")
            node_params[name] = spec.extra[name]
    immutable = spec.extra.get("immutable", "0")
    if immutable not in ("0", "1"):
        raise ConfigError(f"cluster URL: immutable must be 0 or 1, got {immutable!r}")
    scheme, front = ("kv", "native") if spec.front == "native" else ("nvme+tcp", "nvme")
    tls = node_params.get("tls", "0") == "1"
    if node_params.get("tls", "0") not in ("0", "1"):
        raise ConfigError(f"cluster URL: tls must be 0 or 1, got {node_params['tls']!r}")
    if tls:
        front += "+tls"  # a TLS node registers its native front so; a client never falls back
    query = urlencode(node_params)

    # Nodes found in etcd must prove at Hello that they are the node of their record: a
    # rogue member cannot relay another node's challenge to a client (static URLs name
    # addresses, not node ids).
    pin = spec.source == "etcd" and "token" in node_params

    def node_url(member: Member) -> str:
        pinned = f"&{urlencode({'node': member.node_id})}" if pin else ""
        return f"{scheme}://{member.fronts.get(front, '')}?{query}{pinned}"

    def open_node(member: Member) -> Transport:
        address = member.fronts.get(front)
        if address is None:
            # The client's configuration, not the node's failure: raised to the caller, never a
            # plaintext fallback.
            if "native+tls" in member.fronts and not tls:
                raise ConfigError(
                    f"node {member.node_id} serves its native front over TLS only: "
                    "connect with tls=1 (and ca=)"
                )
            # A node without TLS is skipped like a down one by a tls=1 client (a cluster
            # moving to TLS node by node keeps serving from the TLS ones).
            raise TransportError(f"node {member.node_id} has no {front} front")
        return open_transport(parse_url(node_url(member)))

    membership = open_membership(spec, timeout_s=deadline)
    return ClusterTransport(
        membership,
        spec.replicas,
        open_node,
        deadline,
        durable_puts=front == "native",
        strict_puts=spec.source == "etcd",
        immutable_puts=immutable == "1",
        node_route=node_url,
    )


def open_cluster_async(url: StoreURL) -> _ThreadedCluster:
    """`open_cluster` served to asyncio from worker threads."""
    return _ThreadedCluster(open_cluster(url))
