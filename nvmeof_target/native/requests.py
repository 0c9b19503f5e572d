"""The native front's requests, as the handler table its sessions dispatch on.

A handler takes the session and the request; it answers through `NativeSession.reply` (now,
or once engine work on the I/O threads is done) and returns what the reader must await before
it takes the next request, or None. Puts are in `native_puts`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TypeVar

from kvoffload import __version__
from kvoffload.errors import AuthError, KVOffloadError, RemoteProtocolError
from kvoffload.kvstore import BlockView
from kvoffload.nvmeof_target.native.nixl import on_nixl_get, on_nixl_memory, on_nixl_put
from kvoffload.nvmeof_target.native.puts import on_put, on_put_many, on_repair
from kvoffload.nvmeof_target.native.session import NativeSession
from kvoffload.nvmeof_target.tenants import Tenant
from kvoffload.wire.native.connection import (
    PROTOCOL_VERSIONS,
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
    Get,
    GetMany,
    GetManyResult,
    Hello,
    Lookup,
    LookupResult,
    NixlGet,
    NixlMemory,
    NixlPut,
    Prefetch,
    PrefetchResult,
    Put,
    PutMany,
    Repair,
    Stats,
    StatsResult,
    Welcome,
)
from kvoffload.wire.tiers import wire_pairs

__all__ = ["HANDLERS"]

log = logging.getLogger("kvoffload.native")


def on_hello(s: NativeSession, event: Hello) -> None:
    shard = s.services.shard
    refusal = ""
    if event.version not in PROTOCOL_VERSIONS:
        refusal = (
            f"protocol version {event.version} is not supported (this daemon speaks "
            f"{', '.join(map(str, PROTOCOL_VERSIONS))})"
        )
    elif shard is not None and event.version < 2:
        # A version 1 client cannot follow the shard map and would see 1/N of the store.
        refusal = (
            f"this daemon serves its keys from {shard.count} worker processes; a client "
            f"speaking protocol {event.version} cannot reach them all: upgrade kvoffload"
        )
    if refusal:
        s.fail(event.request_id, RemoteProtocolError(refusal))
        s.end_after_answers()
        return
    tenants = s.services.tenants
    try:
        if event.nonce is not None:  # challenge–response: Auth follows our Challenge
            s.challenge = tenants.challenge(event.tenant, event.nonce, event.version)
            s.reply(Challenge(event.request_id, tenants.node, s.challenge.node_nonce))
            return
        if event.token and not s.config.token_hello:
            raise AuthError(
                "this node does not take tokens in a Hello (native.token_hello is off): "
                "use a client that speaks protocol 5 or later (challenge–response)"
            )
        tenant = tenants.authenticate(event.token)
    except AuthError as exc:
        _refuse(s, event.request_id, exc)
        return
    _welcome(s, event.request_id, event.version, tenant, None)


def on_auth(s: NativeSession, event: Auth) -> None:
    pending, s.challenge = s.challenge, None
    if pending is None:  # the codec admits Auth only after a Hello that asked for a Challenge
        _refuse(s, event.request_id, AuthError("Auth without a Challenge"))
        return
    try:
        tenant, proof = s.services.tenants.answer(pending, event.proof, s.tls_binding)
    except AuthError as exc:
        _refuse(s, event.request_id, exc)
        return
    _welcome(s, event.request_id, pending.version, tenant, proof)


def _refuse(s: NativeSession, request_id: int, exc: AuthError) -> None:
    s.services.metrics.auth_failures.labels(s.front_name).inc()
    log.info("refused %s: %s", s.peer, exc)
    s.fail(request_id, exc)
    s.end_after_answers()  # nothing pipelined behind a refused Hello is served


def _welcome(
    s: NativeSession, request_id: int, version: int, tenant: Tenant, proof: bytes | None
) -> None:
    shard = s.services.shard
    s.tenant = tenant
    s.conn.set_limits(s.front.limits)
    s.version = version
    s.start_hot()
    s.reply(
        Welcome(
            request_id,
            version,
            tenant.name,
            s.engine.max_value_bytes,
            s.config.max_payload_bytes,
            server=f"kvoffload {__version__}",
            shard=shard.index if shard else 0,
            shard_ports=tuple(shard.ports) if shard else (),
            proof=proof,
        )
    )


def on_get(s: NativeSession, event: Get) -> None:
    key = s.me.key(event.key)
    rid = event.request_id
    if s.services.blocking_engine:  # the read may wait on the SSD: off the loop
        s.read_request(rid, lambda: s.engine.get(key), partial(s.reply_get, rid))
        return
    try:  # DRAM only: inline, without the closures `read_request` takes
        view = s.engine.get(key)
    except KVOffloadError as exc:
        s.fail(rid, exc)
        return
    s.reply_get(rid, view)


def on_get_many(s: NativeSession, event: GetMany) -> None:
    keys = s.me.keys(event.keys)
    budget = s.config.max_payload_bytes
    pins = s.services.answer_pins
    taken = 0  # bytes this answer holds in `pins`, given back once sent (or on failure)

    def fetch() -> list[BlockView | None]:
        nonlocal taken
        views: list[BlockView | None] = []
        # Chunks of `ssd.read_depth` keys: the SSD-only blocks of each are read together.
        step = s.engine.config.ssd.read_depth
        try:
            for at in range(0, len(keys), step):
                chunk = s.engine.get_many(keys[at : at + step])
                for i, view in enumerate(chunk):
                    size = len(view) if view is not None else 0
                    if view is not None and (
                        (views and taken + size > budget) or not pins.take(size, taken == 0)
                    ):
                        # Answer a prefix; the client asks again for the rest.
                        dropped = 0
                        for rest in chunk[i:]:
                            if rest is not None:
                                rest.release()
                                dropped += 1
                        s.services.get_many_cut += 1
                        s.services.get_many_dropped += dropped
                        return views
                    taken += size
                    views.append(view)
        except BaseException:
            # A get that fails part-way (a promotion finding every DRAM block pinned, some
            # by this very request) must not leave the views taken so far pinned for good.
            for view in views:
                if view is not None:
                    view.release()
            pins.give_back(taken)
            raise
        return views

    def send(views: list[BlockView | None]) -> None:
        s.services.get_many_answers += 1
        hits = [v for v in views if v is not None]
        lengths = tuple(None if v is None else len(v) for v in views)
        s.bytes_out.inc(sum(len(v) for v in hits))

        def release() -> None:
            for view in hits:
                view.release()
            pins.give_back(taken)

        s.reply(GetManyResult(event.request_id, lengths), [v.data for v in hits], release)

    s.read_request(event.request_id, fetch, send)


def on_exists(s: NativeSession, event: Exists) -> None:
    found = s.engine.contains(s.me.key(event.key))
    s.reply_exists(event.request_id, found)


def on_lookup(s: NativeSession, event: Lookup) -> None:
    if not event.tiers:
        s.reply(LookupResult(event.request_id, s.engine.lookup(s.me.keys(event.keys))))
        return
    where: list[str] = []  # protocol 4: the run's tiers, from the engine's indexes
    count = s.engine.lookup(s.me.keys(event.keys), where)
    s.reply(LookupResult(event.request_id, count, wire_pairs(where)))


def on_prefetch(s: NativeSession, event: Prefetch) -> None:
    keys = s.me.keys(event.keys)
    s.read_request(
        event.request_id,
        lambda: s.engine.prefetch(keys),
        lambda n: s.reply(PrefetchResult(event.request_id, n)),
    )


def on_delete(s: NativeSession, event: Delete) -> Awaitable[object] | None:
    engine_key = s.me.key(event.key)
    s.services.tombstones.deleting(engine_key)  # before the engine: see `Tombstones`

    def done(deleted: bool) -> None:
        if deleted and s.services.events is not None:
            s.services.events.removed(engine_key)
        s.reply(DeleteResult(event.request_id, deleted))

    # With an SSD tier a delete wipes the block's slot header: in_order takes it off the loop.
    return s.in_order(partial(s.engine.delete, engine_key), done, partial(s.fail, event.request_id))


def on_delete_many(s: NativeSession, event: DeleteMany) -> Awaitable[object] | None:
    """Version 5: `on_delete` for several keys, in order, in one answer, without tombstones
    (see `DeleteMany`)."""
    engine_keys = s.me.keys(event.keys)

    def run() -> list[bool]:
        return [s.engine.delete(k) for k in engine_keys]

    def done(deleted: list[bool]) -> None:
        if s.services.events is not None:
            for engine_key, gone in zip(engine_keys, deleted, strict=True):
                if gone:
                    s.services.events.removed(engine_key)
        s.reply(DeleteManyResult(event.request_id, tuple(deleted)))

    return s.in_order(run, done, partial(s.fail, event.request_id))


def on_describe(s: NativeSession, event: Describe) -> None:
    """Version 5: the block's parent and metadata, for a cluster's read repair. The engine
    holds a tenant's parent as its engine key, which names no client key: with tenants the
    parent is left out (the copy then starts a chain, as a put without a parent does)."""
    found, parent, meta = s.engine.describe(s.me.key(event.key))
    if s.me.name:
        parent = None
    s.reply(Described(event.request_id, found, parent, meta))


def on_stats(s: NativeSession, event: Stats) -> None:
    stats = s.engine.stats().as_dict()
    me = s.me
    for field in ("tenant_bytes", "ssd_tenant_bytes"):
        held = stats.get(field)
        if isinstance(held, dict) and me.name:
            # A tenant sees its own usage, not who else uses the store.
            stats[field] = {me.name: held.get(me.name, 0)}
    stats["server"] = {
        **s.services.server_info(),
        "tenant": me.name,
        "connections": s.front.connection_count,
        "traffic": s.services.metrics.traffic(),
    }
    s.reply(StatsResult(event.request_id, stats))


R = TypeVar("R", bound=Event)


def _row(
    kind: type[R], handler: Callable[[NativeSession, R], Awaitable[object] | None]
) -> tuple[type[Event], Callable[..., Awaitable[object] | None]]:
    """A table row whose handler mypy checks against its request type."""
    return kind, handler


# Request type -> its handler.
HANDLERS: dict[type[object], Callable[..., Awaitable[object] | None]] = dict(
    [
        _row(Hello, on_hello),
        _row(Auth, on_auth),
        _row(Put, on_put),
        _row(PutMany, on_put_many),
        _row(Get, on_get),
        _row(GetMany, on_get_many),
        _row(Exists, on_exists),
        _row(Lookup, on_lookup),
        _row(Prefetch, on_prefetch),
        _row(Delete, on_delete),
        _row(Stats, on_stats),
        _row(NixlMemory, on_nixl_memory),
        _row(NixlGet, on_nixl_get),
        _row(NixlPut, on_nixl_put),
        _row(Repair, on_repair),
        _row(Describe, on_describe),
        _row(DeleteMany, on_delete_many),
    ]
)
