"""Native-protocol events (DESIGN §5): one frozen, slotted dataclass per message, validated on
construction, and `_decode` from a received frame. `native.NativeConnection` wires them to
the state of one connection; every name is re-exported from `native`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import ClassVar

from kvoffload.errors import LocalProtocolError
from kvoffload.wire.native.fields import KEY_BYTES, VALIDATORS, fail
from kvoffload.wire.native.frames import FLAG_RESPONSE, MAX_REQUEST_ID, Frame, Need

__all__ = [
    "AUTH_VERSION",
    "KEY_BYTES",
    "META_VERSION",
    "NEED_DATA",
    "NIXL_DEADLINE_VERSION",
    "NIXL_PROOF_PREFIX",
    "NIXL_VERSION",
    "PROTOCOL_VERSION",
    "PROTOCOL_VERSIONS",
    "REPAIR_HOLD_S",
    "REPAIR_MAX_AGE_S",
    "REPAIR_VERSION",
    "TOMBSTONE_RETENTION_S",
    "TIER_LOOKUP_VERSION",
    "Auth",
    "Challenge",
    "ConnectionClosed",
    "Delete",
    "DeleteMany",
    "DeleteManyResult",
    "DeleteResult",
    "Describe",
    "Described",
    "ErrorReply",
    "Event",
    "Exists",
    "ExistsResult",
    "Get",
    "GetMany",
    "GetManyResult",
    "GetResult",
    "Hello",
    "Lookup",
    "LookupResult",
    "NixlGet",
    "NixlGetResult",
    "NixlMemory",
    "NixlMemoryDone",
    "NixlPut",
    "NixlPutDone",
    "Prefetch",
    "PrefetchResult",
    "Put",
    "PutDone",
    "PutMany",
    "PutManyDone",
    "Repair",
    "RepairDone",
    "Stats",
    "StatsResult",
    "Welcome",
]

# 2: Welcome names the shard a connection reached and every shard's port (a daemon with
# several workers). A daemon still answers version 1 Hellos, without those fields.
# 3: the NIXL data path (NixlMemory, NixlGet, NixlPut; a version 3 client falls back to kv://
# payloads with a version 2 daemon), and Put / PutMany may carry block metadata (`block_meta`,
# `block_metas`; a version 2 daemon rejects fields it does not know, so clients send them only
# once a daemon accepted version 3). A daemon answers version 1 and 2 Hellos as before.
# 4: Lookup may ask for the run's tiers (`tiers`) and LookupResult carries them (`tiers`); a
# client asks only once a daemon accepted version 4 (else every hit's tier is UNKNOWN); and
# NixlGet / NixlPut carry the client's remaining time (`budget_ms`): the daemon posts no
# transfer once it is spent (sent only to a daemon that accepted version 4).
# 5: Repair (a cluster's read-repair copy: stored only where the key is absent and was not
# deleted lately), Describe (a block's parent and metadata, so that a copy keeps them) and
# DeleteMany; a cluster client sends them only to a daemon that accepted version 5. And
# challenge–response at Hello (`wire.hello_auth`): a Hello with a `nonce` (and maybe a
# `tenant`) carries no token and is answered by a Challenge; the client's Auth is answered by
# a Welcome with the node's `proof`. A Hello without a nonce is answered as before. And the
# NIXL data path needs version 5: NixlMemory's `echo` proves the declared worker is the client's.
PROTOCOL_VERSION = 5
PROTOCOL_VERSIONS = (1, 2, 3, 4, 5)
AUTH_VERSION = 5
# The NIXL notification that carries the daemon's nonce to the client's agent (version 5).
NIXL_PROOF_PREFIX = b"kvoffload nixl proof v1\0"
NIXL_VERSION = 3
META_VERSION = 3
TIER_LOOKUP_VERSION = 4
NIXL_DEADLINE_VERSION = 4
REPAIR_VERSION = 5
# Read repair against deletes and restarts, on each machine's own monotonic clock (only
# durations are compared, never one machine's time with another's): a client sends a repair
# only within REPAIR_MAX_AGE_S of the moment it sent the read the copy comes from; a daemon
# keeps a deleted key's tombstone for TOMBSTONE_RETENTION_S and refuses every repair for
# REPAIR_HOLD_S after it starts or drops its blocks to rejoin a cluster. The margins cover
# a repair's time in flight (a node's deadline, seconds).
REPAIR_MAX_AGE_S = 10.0
TOMBSTONE_RETENTION_S = 60.0
REPAIR_HOLD_S = 30.0
NEED_DATA = Need.DATA
# ---------------------------------------------------------------------------- events


class Event:
    """Base of every native-protocol event. Subclasses are frozen, slotted dataclasses.

    Class attributes: `OP` (the frame type), `RESPONSE` (direction), `CHECKS` (field name ->
    validator name in `VALIDATORS`, for fields whose name is not itself a validator).
    """

    __slots__ = ()
    OP: ClassVar[int] = 0
    RESPONSE: ClassVar[bool] = False
    CHECKS: ClassVar[dict[str, str]] = {}
    request_id: int

    def __post_init__(self) -> None:
        checks = _CHECKS.get(type(self)) or _checks(type(self))
        for name, check in checks:
            value = getattr(self, name)
            checked = check(value)
            if checked is not value:  # lists become tuples; most values come back as they are
                object.__setattr__(self, name, checked)
        if self.request_id > MAX_REQUEST_ID or (
            self.request_id == 0 and type(self) is not ErrorReply
        ):
            raise fail("request id", self.request_id)

    @property
    def payload_length(self) -> int:
        """Raw bytes that follow this event's frame header."""
        return 0

    def meta(self) -> dict[str, object]:
        names = _NAMES_IN_ORDER.get(type(self))
        if names is None:
            _names(type(self))
            names = _NAMES_IN_ORDER[type(self)]
        return {name: getattr(self, name) for name in names}


# Event class -> (field name, validator) in field order, request_id first; built once per class
# because dataclasses.fields() on every event costs more than the validation itself.
_CHECKS: dict[type[Event], tuple[tuple[str, Callable[[object], object]], ...]] = {}


def _checks(cls: type[Event]) -> tuple[tuple[str, Callable[[object], object]], ...]:
    found = _CHECKS.get(cls)
    if found is None:
        names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
        assert names[0] == "request_id"
        found = tuple((n, VALIDATORS[cls.CHECKS.get(n, n)]) for n in names)
        _CHECKS[cls] = found
    return found


@dataclass(frozen=True, slots=True)
class Hello(Event):
    """First request on a connection: protocol version, and either the tenant's token (the
    old, replayable form) or, from version 5, a fresh `nonce` that asks for a Challenge
    (`tenant`: the tenant's name, or "" to let the node find it by the proof)."""

    OP: ClassVar[int] = 1
    CHECKS: ClassVar[dict[str, str]] = {"nonce": "opt_nonce"}
    request_id: int
    version: int = PROTOCOL_VERSION
    token: str = ""
    client: str = ""
    tenant: str = ""
    nonce: bytes | None = None

    def __post_init__(self) -> None:
        Event.__post_init__(self)
        if self.nonce is None and self.tenant:
            raise LocalProtocolError("a Hello names its tenant only with a nonce")
        if self.nonce is not None and (self.token or self.version < AUTH_VERSION):
            raise LocalProtocolError(
                f"a Hello with a nonce carries no token and needs version >= {AUTH_VERSION}"
            )

    @property
    def challenges(self) -> bool:
        """It asks for a Challenge (and Auth must follow it)."""
        return self.nonce is not None

    def meta(self) -> dict[str, object]:
        meta = Event.meta(self)
        if self.nonce is None:  # absent, so that a version 4 daemon accepts the frame
            del meta["tenant"], meta["nonce"]
        return meta


@dataclass(frozen=True, slots=True)
class Challenge(Event):
    """Version 5: the answer to a Hello with a nonce: who the node is, and its fresh nonce."""

    OP: ClassVar[int] = 17
    RESPONSE: ClassVar[bool] = True
    request_id: int
    node: str
    nonce: bytes


@dataclass(frozen=True, slots=True)
class Auth(Event):
    """Version 5: the client's proof (`hello_auth.client_proof`), answered by a Welcome."""

    OP: ClassVar[int] = 17
    request_id: int
    proof: bytes


@dataclass(frozen=True, slots=True)
class Welcome(Event):
    """Hello accepted: who the connection is, and the store's limits."""

    OP: ClassVar[int] = 1
    RESPONSE: ClassVar[bool] = True
    CHECKS: ClassVar[dict[str, str]] = {"proof": "opt_proof"}
    request_id: int
    version: int
    tenant: str
    max_value_bytes: int
    max_payload_bytes: int
    server: str = ""
    # Version 2: this connection's shard and every shard's port on the daemon's host, in shard
    # order (empty: one process serves every key).
    shard: int = 0
    shard_ports: tuple[int, ...] = ()
    # Version 5, answering an Auth: the node's proof that it holds its key for the tenant.
    proof: bytes | None = None

    def meta(self) -> dict[str, object]:
        meta = Event.meta(self)
        if self.version < 2:  # a version 1 peer rejects fields it does not know
            del meta["shard"], meta["shard_ports"]
        if self.proof is None:  # absent, so that a version 4 client accepts the frame
            del meta["proof"]
        return meta


@dataclass(frozen=True, slots=True)
class Put(Event):
    """Store `length` payload bytes under `key`."""

    OP: ClassVar[int] = 2
    request_id: int
    key: bytes
    length: int
    parent: bytes | None = None
    durable: bool = False
    block_meta: bytes | None = None  # version 3: `BlockMeta` in its byte form

    @property
    def payload_length(self) -> int:
        return self.length

    def meta(self) -> dict[str, object]:
        meta = Event.meta(self)
        if self.block_meta is None:  # absent, so that a version 2 daemon accepts the frame
            del meta["block_meta"]
        return meta


@dataclass(frozen=True, slots=True)
class PutDone(Event):
    OP: ClassVar[int] = 2
    RESPONSE: ClassVar[bool] = True
    request_id: int


@dataclass(frozen=True, slots=True)
class Get(Event):
    OP: ClassVar[int] = 3
    request_id: int
    key: bytes


@dataclass(frozen=True, slots=True)
class GetResult(Event):
    """The value's length and then its bytes as payload; `length` None is a miss."""

    OP: ClassVar[int] = 3
    RESPONSE: ClassVar[bool] = True
    CHECKS: ClassVar[dict[str, str]] = {"length": "opt_length"}
    request_id: int
    length: int | None

    @property
    def payload_length(self) -> int:
        return self.length or 0


@dataclass(frozen=True, slots=True)
class Exists(Event):
    OP: ClassVar[int] = 4
    request_id: int
    key: bytes


@dataclass(frozen=True, slots=True)
class ExistsResult(Event):
    OP: ClassVar[int] = 4
    RESPONSE: ClassVar[bool] = True
    request_id: int
    found: bool


@dataclass(frozen=True, slots=True)
class Delete(Event):
    OP: ClassVar[int] = 5
    request_id: int
    key: bytes


@dataclass(frozen=True, slots=True)
class DeleteResult(Event):
    OP: ClassVar[int] = 5
    RESPONSE: ClassVar[bool] = True
    request_id: int
    deleted: bool


@dataclass(frozen=True, slots=True)
class PutMany(Event):
    """Store several values; the payload is their concatenation, in order."""

    OP: ClassVar[int] = 6
    request_id: int
    keys: tuple[bytes, ...]
    lengths: tuple[int, ...]
    parents: tuple[bytes | None, ...] = ()
    durable: bool = False
    block_metas: tuple[bytes | None, ...] = ()  # version 3: one per key, or none at all

    def __post_init__(self) -> None:
        Event.__post_init__(self)
        n = len(self.keys)
        if (
            len(self.lengths) != n
            or len(self.parents) not in (0, n)
            or len(self.block_metas) not in (0, n)
        ):
            raise LocalProtocolError(
                f"put_many of {n} keys with {len(self.lengths)} lengths, "
                f"{len(self.parents)} parents and {len(self.block_metas)} metadata entries"
            )

    def meta(self) -> dict[str, object]:
        meta = Event.meta(self)
        if not self.block_metas:  # absent, so that a version 2 daemon accepts the frame
            del meta["block_metas"]
        return meta

    @property
    def payload_length(self) -> int:
        return sum(self.lengths)


@dataclass(frozen=True, slots=True)
class PutManyDone(Event):
    OP: ClassVar[int] = 6
    RESPONSE: ClassVar[bool] = True
    request_id: int


@dataclass(frozen=True, slots=True)
class GetMany(Event):
    OP: ClassVar[int] = 7
    request_id: int
    keys: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class GetManyResult(Event):
    """Lengths for a prefix of the requested keys (None = miss), then the hits' bytes in order.

    The server answers fewer keys than asked when the values would not fit one frame; the client
    asks again for the rest.
    """

    OP: ClassVar[int] = 7
    RESPONSE: ClassVar[bool] = True
    CHECKS: ClassVar[dict[str, str]] = {"lengths": "opt_lengths"}
    request_id: int
    lengths: tuple[int | None, ...]

    @property
    def payload_length(self) -> int:
        return sum(n for n in self.lengths if n is not None)


@dataclass(frozen=True, slots=True)
class Lookup(Event):
    """How many leading keys of a chain are stored; version 4: with `tiers`, also where."""

    OP: ClassVar[int] = 8
    CHECKS: ClassVar[dict[str, str]] = {"tiers": "flag"}
    request_id: int
    keys: tuple[bytes, ...]
    tiers: bool = False

    def meta(self) -> dict[str, object]:
        meta = Event.meta(self)
        if not self.tiers:  # absent, so that a version 3 daemon accepts the frame
            del meta["tiers"]
        return meta


@dataclass(frozen=True, slots=True)
class LookupResult(Event):
    """`count` leading keys stored; version 4, when asked: `tiers`, the run as flat (tier
    code, length) pairs in key order (`wire.tiers.TierRun`), adding up to `count`."""

    OP: ClassVar[int] = 8
    RESPONSE: ClassVar[bool] = True
    CHECKS: ClassVar[dict[str, str]] = {"tiers": "tier_pairs"}
    request_id: int
    count: int
    tiers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        Event.__post_init__(self)
        if self.tiers is not None and sum(self.tiers[1::2]) != self.count:
            raise LocalProtocolError(f"tier runs {self.tiers[:8]} do not add up to {self.count}")

    def meta(self) -> dict[str, object]:
        meta = Event.meta(self)
        if self.tiers is None:  # absent, so that a version 3 client accepts the frame
            del meta["tiers"]
        return meta


@dataclass(frozen=True, slots=True)
class Prefetch(Event):
    OP: ClassVar[int] = 9
    request_id: int
    keys: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class PrefetchResult(Event):
    OP: ClassVar[int] = 9
    RESPONSE: ClassVar[bool] = True
    request_id: int
    count: int


@dataclass(frozen=True, slots=True)
class Stats(Event):
    OP: ClassVar[int] = 10
    request_id: int


@dataclass(frozen=True, slots=True)
class StatsResult(Event):
    OP: ClassVar[int] = 10
    RESPONSE: ClassVar[bool] = True
    request_id: int
    stats: dict[str, object]


@dataclass(frozen=True, slots=True)
class ErrorReply(Event):
    """A request failed (`status` from wire/status.py); request id 0: the connection did."""

    OP: ClassVar[int] = 0x7F
    RESPONSE: ClassVar[bool] = True
    request_id: int
    status: int
    message: str = ""


@dataclass(frozen=True, slots=True)
class NixlMemory(Event):
    """Version 3: NIXL agent metadata (whole, then partial for new regions) and the flat
    (address, length) pairs this connection may name from now on (`regions`) or no more.
    Version 5: after each metadata the daemon sends a nonce as a NIXL notification
    (`NIXL_PROOF_PREFIX` + nonce) to the agent it names, and serves no transfer until the
    client echoes it here (`echo`): proof that the declared worker is the client's."""

    OP: ClassVar[int] = 11
    CHECKS: ClassVar[dict[str, str]] = {
        "regions": "uints",
        "revoke": "uints",
        "echo": "opt_nonce",
    }
    request_id: int
    agent: bytes = b""
    regions: tuple[int, ...] = ()
    revoke: tuple[int, ...] = ()
    echo: bytes | None = None

    def __post_init__(self) -> None:
        Event.__post_init__(self)
        if len(self.regions) % 2 or len(self.revoke) % 2:
            raise LocalProtocolError("NIXL regions come in (address, length) pairs")

    def meta(self) -> dict[str, object]:
        meta = Event.meta(self)
        if self.echo is None:  # absent, so that a version 4 daemon accepts the frame
            del meta["echo"]
        return meta


@dataclass(frozen=True, slots=True)
class NixlMemoryDone(Event):
    OP: ClassVar[int] = 11
    RESPONSE: ClassVar[bool] = True
    request_id: int


@dataclass(frozen=True, slots=True)
class NixlGet(Event):
    """Version 3: the daemon WRITEs each hit's payload (the value past its header) to
    `addrs[i]` in the client's registered memory, if it fits `caps[i]` bytes."""

    OP: ClassVar[int] = 12
    CHECKS: ClassVar[dict[str, str]] = {
        "addrs": "uints",
        "caps": "uints",
        "budget_ms": "opt_length",
    }
    request_id: int
    keys: tuple[bytes, ...]
    addrs: tuple[int, ...]
    caps: tuple[int, ...]
    budget_ms: int | None = None  # version 4: the client's time left; no transfer after it

    def __post_init__(self) -> None:
        Event.__post_init__(self)
        if not len(self.keys) == len(self.addrs) == len(self.caps):
            raise LocalProtocolError("NixlGet needs one address and capacity per key")

    def meta(self) -> dict[str, object]:
        return _without_budget(self)


@dataclass(frozen=True, slots=True)
class NixlGetResult(Event):
    """Stored value length per key (None: a miss) and each hit's header bytes, in order; a
    hit's payload is in the client's buffer, unless it did not fit (nothing was written)."""

    OP: ClassVar[int] = 12
    RESPONSE: ClassVar[bool] = True
    CHECKS: ClassVar[dict[str, str]] = {"lengths": "opt_lengths", "headers": "blobs"}
    request_id: int
    lengths: tuple[int | None, ...]
    headers: tuple[bytes, ...]

    def __post_init__(self) -> None:
        Event.__post_init__(self)
        if len(self.headers) != sum(n is not None for n in self.lengths):
            raise LocalProtocolError("NixlGetResult needs one header per hit")


@dataclass(frozen=True, slots=True)
class NixlPut(Event):
    """Version 3: store `heads[i]` followed by `lengths[i]` bytes the daemon READs from
    `addrs[i]` in the client's registered memory, under `keys[i]`."""

    OP: ClassVar[int] = 13
    CHECKS: ClassVar[dict[str, str]] = {
        "heads": "blobs",
        "addrs": "uints",
        "budget_ms": "opt_length",
    }
    request_id: int
    keys: tuple[bytes, ...]
    heads: tuple[bytes, ...]
    addrs: tuple[int, ...]
    lengths: tuple[int, ...]
    parents: tuple[bytes | None, ...] = ()
    durable: bool = False
    budget_ms: int | None = None  # version 4, as for NixlGet

    def __post_init__(self) -> None:
        Event.__post_init__(self)
        n = len(self.keys)
        if not n == len(self.heads) == len(self.addrs) == len(self.lengths) or len(
            self.parents
        ) not in (0, n):
            raise LocalProtocolError("NixlPut needs one head, address and length per key")

    def meta(self) -> dict[str, object]:
        return _without_budget(self)


@dataclass(frozen=True, slots=True)
class NixlPutDone(Event):
    OP: ClassVar[int] = 13
    RESPONSE: ClassVar[bool] = True
    request_id: int


@dataclass(frozen=True, slots=True)
class Repair(Event):
    """Version 5: store `length` payload bytes under `key` only if no tier holds the key and
    it was not deleted within the daemon's tombstone retention (a read repair never lands over
    a newer value or after a delete)."""

    OP: ClassVar[int] = 14
    request_id: int
    key: bytes
    length: int
    parent: bytes | None = None
    block_meta: bytes | None = None

    durable: ClassVar[bool] = False  # a repair is a copy of what a replica holds, never durable

    @property
    def payload_length(self) -> int:
        return self.length


@dataclass(frozen=True, slots=True)
class RepairDone(Event):
    """`stored`: the copy was stored (False: the key is held, or was deleted lately)."""

    OP: ClassVar[int] = 14
    RESPONSE: ClassVar[bool] = True
    CHECKS: ClassVar[dict[str, str]] = {"stored": "flag"}
    request_id: int
    stored: bool


@dataclass(frozen=True, slots=True)
class Describe(Event):
    """Version 5: whether `key` is stored, with its parent key and block metadata."""

    OP: ClassVar[int] = 15
    request_id: int
    key: bytes


@dataclass(frozen=True, slots=True)
class Described(Event):
    OP: ClassVar[int] = 15
    RESPONSE: ClassVar[bool] = True
    request_id: int
    found: bool
    parent: bytes | None = None
    block_meta: bytes | None = None


@dataclass(frozen=True, slots=True)
class DeleteMany(Event):
    """Version 5: drop several keys' copies (a cluster put clears older copies off a key's
    next node). Unlike Delete it leaves no tombstones: it is not a delete a caller asked for,
    and a put's clears must not crowd the deletes' tombstones out."""

    OP: ClassVar[int] = 16
    request_id: int
    keys: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class DeleteManyResult(Event):
    OP: ClassVar[int] = 16
    RESPONSE: ClassVar[bool] = True
    CHECKS: ClassVar[dict[str, str]] = {"deleted": "flags"}
    request_id: int
    deleted: tuple[bool, ...]


def _without_budget(event: NixlGet | NixlPut) -> dict[str, object]:
    meta = Event.meta(event)
    if event.budget_ms is None:  # absent, so that a version 3 daemon accepts the frame
        del meta["budget_ms"]
    return meta


@dataclass(frozen=True, slots=True)
class ConnectionClosed:
    """The peer closed its side at a frame boundary."""


# Request class -> the answer it admits besides ErrorReply (and `_ALSO`).
_ANSWER: dict[type[Event], type[Event]] = {
    Hello: Welcome,
    Auth: Welcome,
    Put: PutDone,
    Get: GetResult,
    Exists: ExistsResult,
    Delete: DeleteResult,
    PutMany: PutManyDone,
    GetMany: GetManyResult,
    Lookup: LookupResult,
    Prefetch: PrefetchResult,
    Stats: StatsResult,
    NixlMemory: NixlMemoryDone,
    NixlGet: NixlGetResult,
    NixlPut: NixlPutDone,
    Repair: RepairDone,
    Describe: Described,
    DeleteMany: DeleteManyResult,
}
# Request class -> another answer it admits: a Hello with a nonce is answered by a Challenge.
_ALSO: dict[type[Event], type[Event]] = {Hello: Challenge}
# (frame type, is response) -> event class: the parser's dispatch table.
_ALL: tuple[type[Event], ...] = (*_ANSWER, *_ANSWER.values(), *_ALSO.values(), ErrorReply)
_BY_FRAME: dict[tuple[int, bool], type[Event]] = {(c.OP, c.RESPONSE): c for c in _ALL}


def _decode(frame: Frame) -> Event:
    cls = _BY_FRAME.get((frame.type, bool(frame.flags & FLAG_RESPONSE)))
    if cls is None:
        raise LocalProtocolError(f"unknown frame type {frame.type}")
    names = _NAMES.get(cls)
    if names is None:
        names = _names(cls)
    meta = frame.meta
    if not meta.keys() <= names:
        unknown = set(meta) - names
        # The names are the peer's: quote a few, shortened (the message is logged and sent).
        named = [name[:40] for name in sorted(unknown)[:3]]
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        raise LocalProtocolError(f"unknown fields {named}{more} in {cls.__name__}")
    try:
        event = cls(request_id=frame.request_id, **frame.meta)  # type: ignore[call-arg]
    except TypeError as exc:  # a required field is missing
        raise LocalProtocolError(f"malformed {cls.__name__}: {exc}") from None
    if event.payload_length != frame.payload_length:
        raise LocalProtocolError(
            f"{cls.__name__} declares {event.payload_length} payload bytes, frame carries "
            f"{frame.payload_length}"
        )
    return event


# Event class -> the names its frame header may carry (all fields but request_id), once per
# class: building the set on every decoded frame cost more than checking it.
_NAMES: dict[type[Event], frozenset[str]] = {}
_NAMES_IN_ORDER: dict[type[Event], tuple[str, ...]] = {}


def _names(cls: type[Event]) -> frozenset[str]:
    ordered = tuple(name for name, _ in _checks(cls)[1:])
    _NAMES_IN_ORDER[cls] = ordered
    names = _NAMES[cls] = frozenset(ordered)
    return names
