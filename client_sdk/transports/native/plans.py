"""The native protocol's operations, each written once as a plan (see `core`): the sync and
asyncio drivers run the same plans."""

from __future__ import annotations

import hmac
from collections.abc import Callable, Generator, Sequence
from functools import partial
from typing import TypeVar, cast

from kvoffload import __version__
from kvoffload.client_sdk.transports.base import HeldBlock, IntoBuffer, PutItem, Received
from kvoffload.client_sdk.transports.core import Held, one, too_small
from kvoffload.client_sdk.transports.native.options import NativeOptions
from kvoffload.client_sdk.transports.native.session import Call, Plan, Req, Sink
from kvoffload.errors import AuthError, KVOffloadError, RemoteProtocolError
from kvoffload.wire.block import HEADER_BYTES
from kvoffload.wire.hello_auth import client_proof, new_nonce, node_key, server_proof
from kvoffload.wire.native.connection import (
    AUTH_VERSION,
    META_VERSION,
    PROTOCOL_VERSION,
    TIER_LOOKUP_VERSION,
    Auth,
    Challenge,
    Delete,
    DeleteMany,
    DeleteManyResult,
    DeleteResult,
    Describe,
    Described,
    Event,
    Exists,
    ExistsResult,
    Get,
    GetMany,
    GetManyResult,
    GetResult,
    Hello,
    Lookup,
    LookupResult,
    Prefetch,
    PrefetchResult,
    Put,
    PutMany,
    Repair,
    RepairDone,
    Stats,
    StatsResult,
    Welcome,
)
from kvoffload.wire.tiers import Tier, TierRun

__all__ = [
    "delete",
    "delete_many",
    "describe",
    "exists",
    "exists_many",
    "get",
    "get_into",
    "get_into_request",
    "get_many",
    "get_many_into",
    "get_many_into_request",
    "hello",
    "lookup",
    "lookup_tiers",
    "prefetch",
    "put",
    "put_done",
    "put_many",
    "put_many_requests",
    "put_request",
    "repair",
    "stats",
]

T = TypeVar("T")
# Keys per batch frame; keeps a frame's header well under the daemon's limit.
_BATCH_KEYS = 4096
# Exists frames per step of `exists_many`: a step's frames (some 50 bytes each) go out in one
# write and its answers come back before the next step, so both directions stay far within the
# sockets' buffers, and within the daemon's `native.max_pending` (default 256) per connection.
EXISTS_RUN = 128
_CLIENT = f"kvoffload-sdk/{__version__} python"


def _ask(req: Req) -> Generator[list[Req], list[Call], Event]:
    call: Call = yield from one(req)
    return call.result()


def hello(
    options: NativeOptions, version: int = PROTOCOL_VERSION, binding: bytes = b""
) -> Plan[Welcome]:
    """Say Hello; with a token, prove it by challenge–response (`wire.hello_auth`) and check
    the node's proof; `binding`: `hello_auth.tls_binding` of the daemon's certificate over
    TLS, else b"". The token itself goes only to a daemon older than `AUTH_VERSION`, and
    only with `legacy_token`.

    Raises:
        AuthError: refused, or the daemon is not the node it must be (see `options.node`), or
            could not prove it holds its key for the tenant.
    """
    token = options.token
    if not token or version < AUTH_VERSION:
        if token and not options.legacy_token:
            raise AuthError(
                f"{options.url} speaks protocol {version}, before challenge–response: it would "
                "need the token itself, which it could replay; upgrade it, or allow that "
                "with legacy_token=1"
            )
        answer = yield from _ask(
            Req(lambda rid: Hello(rid, version=version, token=token, client=_CLIENT))
        )
        return cast(Welcome, answer)
    nonce = new_nonce()
    challenge = yield from _ask(
        Req(
            lambda rid: Hello(
                rid, version=version, client=_CLIENT, tenant=options.tenant, nonce=nonce
            )
        )
    )
    if not isinstance(challenge, Challenge):
        raise AuthError(f"{options.url} answered a Hello that asked for a Challenge without one")
    node = challenge.node
    if options.node and node != options.node:
        raise AuthError(f"{options.url} is node {node[:80]!r}, not {options.node!r}")
    key = node_key(token, node)
    proof = client_proof(key, options.tenant, node, nonce, challenge.nonce, binding)
    welcome = cast(Welcome, (yield from _ask(Req(lambda rid: Auth(rid, proof)))))
    expected = server_proof(key, welcome.tenant, node, nonce, challenge.nonce, binding)
    if welcome.proof is None or not hmac.compare_digest(welcome.proof, expected):
        raise AuthError(f"{options.url} could not prove it holds node {node[:80]!r}'s key")
    return welcome


def older_version(exc: KVOffloadError, version: int) -> int | None:
    """The version to try after a refused Hello: one below `version` when the daemon refused
    the version itself (an older daemon; none speaks below 1), else None."""
    if version > 1 and isinstance(exc, RemoteProtocolError) and "protocol version" in str(exc):
        return version - 1
    return None


def _nbytes(parts: Sequence[object]) -> int:
    total = 0
    for part in parts:
        total += memoryview(part).nbytes  # type: ignore[arg-type]
    return total


def put(
    key: bytes,
    parts: Sequence[object],
    parent: bytes | None,
    durable: bool,
    meta: bytes | None = None,
) -> Plan[None]:
    yield from _ask(put_request(key, parts, parent, durable, meta))


def put_request(
    key: bytes,
    parts: Sequence[object],
    parent: bytes | None,
    durable: bool,
    meta: bytes | None = None,
) -> Req:
    """The one request of `put` (a driver may send it without running the plan). `meta` only
    for a daemon that accepted protocol `META_VERSION` (see `metadata_for`)."""
    return Req(partial(_put_event, key, _nbytes(parts), parent, durable, meta), parts)


def metadata_for(version: int, items: Sequence[PutItem]) -> Sequence[PutItem]:
    """`items` as a daemon speaking `version` accepts them: without metadata below
    `META_VERSION` (such a daemon refuses a frame with fields it does not know)."""
    if version >= META_VERSION or all(item[3] is None for item in items):
        return items
    return [(key, parts, parent, None) for key, parts, parent, _ in items]


def put_done(call: Call) -> None:
    """`put`'s result from its answered call."""
    call.result()


def _put_event(
    key: bytes, length: int, parent: bytes | None, durable: bool, meta: bytes | None, rid: int
) -> Event:
    return Put(rid, key, length, parent, durable, meta)


def _put_many_event(
    keys: tuple[bytes, ...],
    lengths: tuple[int, ...],
    parents: tuple[bytes | None, ...],
    durable: bool,
    metas: tuple[bytes | None, ...],
    rid: int,
) -> Event:
    used = parents if any(p is not None for p in parents) else ()
    described = metas if any(m is not None for m in metas) else ()
    return PutMany(rid, keys, lengths, used, durable, described)


def _keys_event(
    cls: Callable[[int, tuple[bytes, ...]], Event], keys: tuple[bytes, ...], rid: int
) -> Event:
    return cls(rid, keys)


def _key_event(cls: Callable[[int, bytes], Event], key: bytes, rid: int) -> Event:
    return cls(rid, key)


def put_many(items: Sequence[PutItem], durable: bool, budget: int) -> Plan[None]:
    calls = yield put_many_requests(items, durable, budget)
    for call in calls:  # the first failure in order is the one to report
        call.result()


def put_many_requests(items: Sequence[PutItem], durable: bool, budget: int) -> list[Req]:
    """`put_many`'s requests, one per frame (a driver may send a lone one itself)."""
    reqs: list[Req] = []
    for chunk in _chunks(items, budget):
        keys = tuple(item[0] for item in chunk)
        lengths = tuple(_nbytes(item[1]) for item in chunk)
        parents = tuple(item[2] for item in chunk)
        metas = tuple(item[3] for item in chunk)
        payload = [p for item in chunk for p in item[1]]
        event = partial(_put_many_event, keys, lengths, parents, durable, metas)
        reqs.append(Req(event, payload))
    return reqs


def _chunks(items: Sequence[PutItem], budget: int) -> list[list[PutItem]]:
    """Split a batch so that each frame stays within `budget` payload bytes and _BATCH_KEYS."""
    chunks: list[list[PutItem]] = [[]]
    size = 0
    for item in items:
        n = _nbytes(item[1])
        if chunks[-1] and (size + n > budget or len(chunks[-1]) >= _BATCH_KEYS):
            chunks.append([])
            size = 0
        chunks[-1].append(item)
        size += n
    return [c for c in chunks if c]


def get(key: bytes) -> Plan[HeldBlock | None]:
    (call,) = yield [Req(partial(_key_event, Get, key))]
    answer = cast(GetResult, call.result())
    if answer.length is None:
        return None
    return Held(call.payload if call.payload is not None else memoryview(b""))


def get_into(key: bytes, buffer: IntoBuffer) -> Plan[Received | None]:
    req, finish = get_into_request(key, buffer)
    (call,) = yield [req]
    return finish(call)


def get_into_request(
    key: bytes, buffer: IntoBuffer
) -> tuple[Req, Callable[[Call], Received | None]]:
    """The one request of `get_into`, and how its answered call becomes the result (a driver
    may send it without running the plan)."""
    got: Received | None = None

    def sink(event: Event) -> list[memoryview]:
        nonlocal got
        parts: list[memoryview] = []
        got = _land(buffer, cast(GetResult, event).length or 0, parts)
        return parts

    def finish(call: Call) -> Received | None:
        answer = cast(GetResult, call.result())
        if answer.length is None:
            return None
        if got is None:  # an empty value: no payload came, so no sink call
            return Received(memoryview(bytearray(HEADER_BYTES)), 0)
        return got

    return Req(partial(_key_event, Get, key), sink=sink, key=key), finish


def _land(into: IntoBuffer, length: int, parts: list[memoryview], index: int = -1) -> Received:
    """Where a stored block of `length` bytes goes, appended to `parts`: its header into a
    small buffer of its own, its payload to the start of the caller's buffer `into`."""
    if length < HEADER_BYTES:  # not one of ours: verification will say so
        header = memoryview(bytearray(length))
        parts.append(header)
        return Received(header, 0)
    if length - HEADER_BYTES > len(into):
        which = "buffer" if index < 0 else f"buffer {index}"
        raise too_small(len(into), length - HEADER_BYTES, which)
    header = memoryview(bytearray(HEADER_BYTES))
    parts += [header, into.region(0, length - HEADER_BYTES)]
    return Received(header, length - HEADER_BYTES)


def _get_batches(
    keys: Sequence[bytes],
    sink: Callable[[int], Sink] | None,
    take: Callable[[int, GetManyResult, Call], list[T]],
) -> Plan[list[T]]:
    """GetMany in frames of up to _BATCH_KEYS keys, asking again from where the daemon
    answered only a prefix; `sink(first)` places the payload of the frame starting at key
    `first`, `take` turns its answer into one result per answered key."""
    out: list[T] = []
    done = 0
    while done < len(keys):
        starts = range(done, len(keys), _BATCH_KEYS)
        calls = yield [
            Req(
                partial(_keys_event, GetMany, tuple(keys[i : i + _BATCH_KEYS])),
                sink=None if sink is None else sink(i),
            )
            for i in starts
        ]
        for first, call in zip(starts, calls, strict=True):
            answer = cast(GetManyResult, call.result())
            asked = min(_BATCH_KEYS, len(keys) - first)
            # A prefix of at least one key, or the loop would ask again forever (or the
            # results would not line up with the keys).
            if not 1 <= len(answer.lengths) <= asked:
                raise RemoteProtocolError(
                    f"the daemon answered {len(answer.lengths)} keys of {asked} asked for"
                )
            out += take(first, answer, call)
            done = first + len(answer.lengths)
            if len(answer.lengths) < asked:
                break  # the daemon answered a prefix; ask again from there
    return out


def get_many(keys: Sequence[bytes]) -> Plan[list[HeldBlock | None]]:
    return (yield from _get_batches(keys, None, lambda _, a, c: _split(a.lengths, c.payload)))


def get_many_into(
    keys: Sequence[bytes], buffers: Sequence[IntoBuffer]
) -> Plan[list[Received | None]]:
    """GetMany whose answers are received straight into the caller's buffers (one per key):
    each block's header into a small buffer of its own, its payload into the key's buffer."""
    answered: dict[int, list[Received | None]] = {}

    def take(first: int, answer: GetManyResult, _: Call) -> list[Received | None]:
        # No sink call: nothing had a payload (every key a miss).
        return answered.pop(first, [None] * len(answer.lengths))

    def sink(first: int) -> Sink:
        return partial(_many_sink, buffers, answered, first)

    return (yield from _get_batches(keys, sink, take))


def get_many_into_request(
    keys: Sequence[bytes], buffers: Sequence[IntoBuffer]
) -> tuple[Req, Callable[[Call], list[Received | None]]]:
    """The one GetMany of up to _BATCH_KEYS keys, and how its answered call becomes the
    results of the keys it answered: a prefix, for which the caller asks again (a driver may
    send it without running the plan)."""
    answered: dict[int, list[Received | None]] = {}

    def finish(call: Call) -> list[Received | None]:
        answer = cast(GetManyResult, call.result())
        if not 1 <= len(answer.lengths) <= len(keys):
            raise RemoteProtocolError(
                f"the daemon answered {len(answer.lengths)} keys of {len(keys)} asked for"
            )
        return answered.pop(0, [None] * len(answer.lengths))

    event = partial(_keys_event, GetMany, tuple(keys))
    return Req(event, sink=partial(_many_sink, buffers, answered, 0)), finish


def _many_sink(
    buffers: Sequence[IntoBuffer],
    answered: dict[int, list[Received | None]],
    first: int,
    event: Event,
) -> list[memoryview]:
    """Where a GetManyResult for keys from `first` on goes; records what each key got."""
    parts: list[memoryview] = []
    got = answered[first] = []
    for i, length in enumerate(cast(GetManyResult, event).lengths):
        if length is None:
            got.append(None)
            continue
        got.append(_land(buffers[first + i], length, parts, first + i))
    return parts


def _split(lengths: Sequence[int | None], payload: memoryview | None) -> list[HeldBlock | None]:
    out: list[HeldBlock | None] = []
    pos = 0
    data = payload if payload is not None else memoryview(b"")
    for n in lengths:
        if n is None:
            out.append(None)
        else:
            out.append(Held(data[pos : pos + n]))
            pos += n
    return out


def exists(key: bytes) -> Plan[bool]:
    answer = yield from _ask(Req(partial(_key_event, Exists, key)))
    return cast(ExistsResult, answer).found


def exists_many(keys: Sequence[bytes]) -> Plan[list[bool]]:
    """`exists` for each key, pipelined: no new frame, `EXISTS_RUN` Exists requests a step
    (the daemon's C hot path answers a run of them in one pass)."""
    out: list[bool] = []
    for i in range(0, len(keys), EXISTS_RUN):
        step = keys[i : i + EXISTS_RUN]
        calls = yield [Req(partial(_key_event, Exists, k), small=True) for k in step]
        out += [cast(ExistsResult, call.result()).found for call in calls]
    return out


def delete(key: bytes) -> Plan[bool]:
    answer = yield from _ask(Req(partial(_key_event, Delete, key)))
    return cast(DeleteResult, answer).deleted


def repair(
    key: bytes, parts: Sequence[object], parent: bytes | None, meta: bytes | None
) -> Plan[bool]:
    """Protocol 5: a cluster's read-repair copy (stored only if absent and not deleted lately)."""
    length = _nbytes(parts)
    answer = yield from _ask(Req(lambda rid: Repair(rid, key, length, parent, meta), parts))
    return cast(RepairDone, answer).stored


def delete_many(keys: Sequence[bytes]) -> Plan[list[bool]]:
    """Protocol 5: delete several keys; which were stored."""
    out: list[bool] = []
    for i in range(0, len(keys), _BATCH_KEYS):
        chunk = tuple(keys[i : i + _BATCH_KEYS])
        answer = yield from _ask(Req(partial(_keys_event, DeleteMany, chunk)))
        out.extend(cast(DeleteManyResult, answer).deleted)
    return out


def describe(key: bytes) -> Plan[tuple[bool, bytes | None, bytes | None]]:
    """Protocol 5: whether `key` is stored, with its parent and block metadata."""
    answer = cast(Described, (yield from _ask(Req(partial(_key_event, Describe, key)))))
    return answer.found, answer.parent, answer.block_meta


def stats() -> Plan[dict[str, object]]:
    answer = yield from _ask(Req(Stats))
    return cast(StatsResult, answer).stats


def lookup_request(keys: Sequence[bytes]) -> tuple[Req, Callable[[Call], int]]:
    """The one Lookup of up to _BATCH_KEYS keys (a driver may send it without running the
    plan; `Req.lookup` lets the C exchange frame it), and how its answered call becomes the
    count."""
    chunk = tuple(keys)

    def finish(call: Call) -> int:
        answer = cast(LookupResult, call.result())
        if not 0 <= answer.count <= len(chunk):
            raise RemoteProtocolError(f"lookup of {len(chunk)} keys answered {answer.count}")
        return answer.count

    return Req(partial(_keys_event, Lookup, chunk), lookup=chunk), finish


def lookup(keys: Sequence[bytes]) -> Plan[int]:
    total = 0
    for i in range(0, len(keys), _BATCH_KEYS):
        chunk = tuple(keys[i : i + _BATCH_KEYS])
        answer = cast(LookupResult, (yield from _ask(Req(partial(_keys_event, Lookup, chunk)))))
        if not 0 <= answer.count <= len(chunk):
            raise RemoteProtocolError(f"lookup of {len(chunk)} keys answered {answer.count}")
        total += answer.count
        if answer.count < len(chunk):
            break
    return total


def lookup_tiers(keys: Sequence[bytes], version: int) -> Plan[TierRun]:
    """`lookup` with the run's tiers, from a daemon that accepted `TIER_LOOKUP_VERSION`; an
    older one cannot say, so its run is all `Tier.UNKNOWN`."""
    if version < TIER_LOOKUP_VERSION:
        return TierRun.of(Tier.UNKNOWN, (yield from lookup(keys)))
    run = TierRun()
    for i in range(0, len(keys), _BATCH_KEYS):
        chunk = tuple(keys[i : i + _BATCH_KEYS])
        event = partial(_tiers_event, chunk)
        answer = cast(LookupResult, (yield from _ask(Req(event))))
        if not 0 <= answer.count <= len(chunk) or answer.tiers is None:
            raise RemoteProtocolError(
                f"lookup of {len(chunk)} keys with tiers answered {answer.count}, {answer.tiers}"
            )
        run = run.then(TierRun.from_wire(answer.tiers))
        if answer.count < len(chunk):
            break
    return run


def _tiers_event(keys: tuple[bytes, ...], rid: int) -> Event:
    return Lookup(rid, keys, tiers=True)


def prefetch(keys: Sequence[bytes]) -> Plan[int]:
    chunks = [tuple(keys[i : i + _BATCH_KEYS]) for i in range(0, len(keys), _BATCH_KEYS)]
    calls = yield [Req(partial(_keys_event, Prefetch, c)) for c in chunks]
    counts = [cast(PrefetchResult, call.result()).count for call in calls]
    if any(not 0 <= n <= len(c) for n, c in zip(counts, chunks, strict=True)):
        raise RemoteProtocolError(f"prefetch answered {counts} for chunks of {len(chunks[0])}")
    return sum(counts)
