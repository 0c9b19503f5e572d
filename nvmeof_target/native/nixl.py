"""The daemon's side of the NIXL data path (protocol 3; docs/guides/nixl.md).

The native connection stays the control channel; the payload moves one-sided between the
arena and the client's registered memory: a NixlGet WRITEs each hit there, a NixlPut READs
each value into a reserved slot. This process (one per worker) has one NIXL agent, made on
first use in a thread (loading NIXL's plugins takes seconds: the loop keeps serving), with the
whole arena registered once. No progress thread: the handler that waits for a transfer drives
NIXL's progress, yielding to the loop between polls, so an idle connection costs nothing.

The NIXL package is optional: nothing here imports it until a client asks for the data path.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from kvoffload.errors import (
    AuthError,
    ConfigError,
    InvalidArgumentError,
    KVOffloadError,
    TransportError,
)
from kvoffload.kvstore import BlockView, PutReservation
from kvoffload.nvmeof_target.events.publisher import stored_meta
from kvoffload.nvmeof_target.native.agent import (
    NixlAgent,
    NixlPeer,
    StuckError,
    address_of,
    agent_name,
)
from kvoffload.nvmeof_target.native.session import NativeSession
from kvoffload.wire.block import HEADER_BYTES
from kvoffload.wire.blockmeta import BlockMeta
from kvoffload.wire.native.connection import (
    AUTH_VERSION,
    NIXL_DEADLINE_VERSION,
    NIXL_PROOF_PREFIX,
    NixlGet,
    NixlGetResult,
    NixlMemory,
    NixlMemoryDone,
    NixlPut,
    NixlPutDone,
)

__all__ = ["on_nixl_get", "on_nixl_memory", "on_nixl_put"]

log = logging.getLogger("kvoffload.nixl")
T = TypeVar("T")
# How long the daemon drives progress for a proof notification the client has not echoed.
_DELIVER_S = 10.0
# Tasks delivering a proof notification (kept referenced until done).
_DELIVERING: set[asyncio.Task[None]] = set()


async def _agent(s: NativeSession) -> NixlAgent:
    """The process's agent, made on first use.

    Raises:
        ConfigError: the data path is off, refused over TLS, or NIXL cannot run here.
    """
    config = s.config
    if not config.nixl:
        raise ConfigError("this daemon does not serve the NIXL data path (native.nixl = false)")
    if config.tls.enabled and not config.nixl_over_tls:
        # NIXL moves payloads outside the TLS connection: only an operator may allow that.
        raise ConfigError(
            "this daemon serves TLS and NIXL transfers bypass it; set native.nixl_over_tls "
            "to allow them"
        )
    services = s.services
    if services.nixl is None:
        services.nixl = NixlAgent(s.engine, config.nixl_backend)
    agent = services.nixl
    await agent.ready()
    return agent


def _refuse(s: NativeSession, request_id: int, exc: KVOffloadError) -> None:
    """A NIXL request that broke the rules: answer why, then drop only this connection."""
    s.fail(request_id, exc)
    s.end_after_answers()


def _run(
    s: NativeSession, request_id: int, work: Callable[[NixlAgent, NixlPeer], Awaitable[None]]
) -> Awaitable[None]:
    """Run a NIXL request; the reader awaits it (one at a time per connection)."""

    async def run() -> None:
        try:
            _check_version(s)
            agent = await _agent(s)
            if s.nixl is None:
                raise InvalidArgumentError("NixlMemory must name the client's agent first")
            if not s.nixl.proven:
                raise AuthError(
                    "the connection's NIXL agent has not echoed the daemon's notification: "
                    "its worker is not proven to be this client's"
                )
            await work(agent, s.nixl)
        except StuckError as exc:
            # No answer and no close the client can see (`_keep_open`): it keeps its buffer.
            log.error("NIXL transfer with %s stuck: %s; connection parked", s.peer, exc)
            s.abort()
        except TransportError as exc:
            log.info("NIXL transfer with %s failed: %s", s.peer, exc)
            _refuse(s, request_id, exc)
        except (InvalidArgumentError, AuthError, ConfigError) as exc:
            _refuse(s, request_id, exc)
        except KVOffloadError as exc:
            # A store that is full or failed an I/O: an answer, as over kv://; the connection
            # (and the client's registrations on it) stays.
            s.fail(request_id, exc)

    return run()


def _check_version(s: NativeSession) -> None:
    """Raises: ConfigError: a client before protocol 5, which cannot prove its worker."""
    if s.version < AUTH_VERSION:
        raise ConfigError(
            f"the NIXL data path needs protocol {AUTH_VERSION} (the client proves that the "
            "worker its metadata declares is its own); upgrade kvoffload on the client"
        )


def on_nixl_memory(s: NativeSession, event: NixlMemory) -> Awaitable[None]:
    async def run() -> None:
        try:
            _check_version(s)
            agent = await _agent(s)
            if event.echo is not None:
                _proven(s, event.echo)
            if event.agent:
                _own(s, agent, event.agent)
            if s.nixl is None:
                raise InvalidArgumentError("the first NixlMemory must carry the agent's metadata")
            s.nixl.change(event.regions, event.revoke)
            agent.revoke(s.nixl.name, event.revoke)  # and the lists prepared inside them
            if event.agent:
                _challenge(s, agent, s.nixl)
        except KVOffloadError as exc:
            _refuse(s, event.request_id, exc)
            return
        s.reply(NixlMemoryDone(event.request_id))

    return run()


def _challenge(s: NativeSession, agent: NixlAgent, peer: NixlPeer) -> None:
    """After each metadata (which may declare another worker): a fresh nonce to the worker it
    declares; the client must echo it before the next transfer.

    Raises:
        TransportError: NIXL could not send it.
    """
    peer.nonce, peer.proven = secrets.token_bytes(32), False
    agent.notify(peer.name, NIXL_PROOF_PREFIX + peer.nonce)
    if peer.driving:
        return
    until = time.monotonic() + _DELIVER_S
    task = asyncio.ensure_future(agent.deliver(peer, until))
    _DELIVERING.add(task)
    task.add_done_callback(_DELIVERING.discard)


def _proven(s: NativeSession, echo: bytes) -> None:
    """Raises: AuthError: `echo` is not the nonce this connection's agent was sent."""
    peer = s.nixl
    if peer is None or not peer.nonce or not hmac.compare_digest(echo, peer.nonce):
        raise AuthError(
            "the NIXL echo is not the nonce the daemon sent to this connection's agent: the "
            "worker its metadata declares is not this client's"
        )
    peer.nonce, peer.proven = b"", True


def _own(s: NativeSession, agent: NixlAgent, metadata: bytes) -> None:
    """Load metadata only after checking that it names this connection's own agent: loading
    another connection's (even partial metadata) would change what that one reaches.

    Raises:
        AuthError: it names an agent another connection holds.
        InvalidArgumentError: not metadata, or a second agent on this connection.
    """
    name = agent_name(metadata)
    mine = s.nixl.name if s.nixl is not None else None
    if name != mine and name in agent.names:
        raise AuthError(f"NIXL agent {name!r} belongs to another connection")
    if mine is not None and name != mine:
        raise InvalidArgumentError("a connection has one NIXL agent")
    if mine is None:
        agent.names.add(name)  # claimed before loading: no other connection can take it
        try:
            agent.load(metadata, name)
        except BaseException:
            agent.names.discard(name)
            raise
        s.nixl = NixlPeer(name)
    else:
        agent.load(metadata, name)


async def _off(s: NativeSession, work: Callable[[], T], undo: Callable[[T], None]) -> T:
    """`work` inline on a DRAM-only engine, else on the I/O threads."""
    if not s.services.blocking_engine:
        return work()
    return await s.off_loop(work, undo)


def _release(views: list[BlockView | None]) -> None:
    for view in views:
        if view is not None:
            view.release()


def _deadline(s: NativeSession, budget_ms: int | None) -> float:
    """When this request's transfer may no longer be posted: the client's budget (version 4)
    from the moment the request arrived, never past the frame timeout."""
    budget = s.config.frame_timeout_s
    if budget_ms is not None and s.version >= NIXL_DEADLINE_VERSION:
        budget = min(budget, budget_ms / 1000)
    return time.monotonic() + budget


def on_nixl_get(s: NativeSession, event: NixlGet) -> Awaitable[None]:
    deadline = _deadline(s, event.budget_ms)

    async def work(agent: NixlAgent, peer: NixlPeer) -> None:
        keys = s.me.keys(event.keys)

        def fetch() -> list[BlockView | None]:
            views: list[BlockView | None] = []
            try:
                for key in keys:
                    views.append(s.engine.get(key))
            except BaseException:
                _release(views)
                raise
            return views

        views = await _off(s, fetch, _release)
        start, end = agent.arena
        kept = False
        try:
            local: list[tuple[int, int]] = []
            remote: list[tuple[int, int]] = []
            headers: list[bytes] = []
            for i, (view, addr, cap) in enumerate(zip(views, event.addrs, event.caps, strict=True)):
                if view is None:
                    continue
                at = address_of(view.data)
                if not start <= at < end:
                    # Served from outside the arena (an SSD hit staged aside while DRAM is
                    # pinned full): not registered with NIXL, so a miss (the client recomputes).
                    view.release()
                    views[i] = None
                    continue
                headers.append(bytes(view.data[:HEADER_BYTES]))
                n = len(view) - HEADER_BYTES
                if n <= 0 or n > cap:
                    continue  # not one of ours, or too big: the client says which
                peer.check(addr, n)
                local.append((at + HEADER_BYTES, n))
                remote.append((addr, n))
            await agent.move("WRITE", local, remote, peer.name, deadline, views, s.channel.sock)
            s.bytes_out.inc(sum(n for _, n in local))
            lengths = tuple(None if v is None else len(v) for v in views)
        except StuckError:
            kept = True
            raise
        finally:
            if not kept:
                _release(views)
        s.reply(NixlGetResult(event.request_id, lengths, tuple(headers)))

    return _run(s, event.request_id, work)


def _abort(reservations: list[PutReservation]) -> None:
    for reservation in reservations:
        reservation.abort()


def on_nixl_put(s: NativeSession, event: NixlPut) -> Awaitable[None]:
    deadline = _deadline(s, event.budget_ms)

    async def work(agent: NixlAgent, peer: NixlPeer) -> None:
        for addr, n in zip(event.addrs, event.lengths, strict=True):
            if n:
                peer.check(addr, n)  # before any slot is claimed
        me, shard = s.me, s.services.shard
        parents = event.parents or (None,) * len(event.keys)
        # With events on, every put keeps the hashes a restarted daemon announces (as over
        # the socket; NixlPut carries no client metadata).
        metas: list[bytes | None] = [
            stored_meta(key, parent, None) if s.services.events is not None else None
            for key, parent in zip(event.keys, parents, strict=True)
        ]

        def reserve() -> list[PutReservation]:
            out: list[PutReservation] = []
            try:
                for key, head, n, parent, meta in zip(
                    event.keys, event.heads, event.lengths, parents, metas, strict=True
                ):
                    if shard is not None:
                        shard.check(key)
                        parent = shard.own_parent(parent)
                    out.append(
                        s.engine.reserve(
                            me.key(key),
                            len(head) + n,
                            parent=me.opt_key(parent),
                            durable=event.durable,
                            tenant=me.name,
                            meta=meta,
                        )
                    )
            except BaseException:
                _abort(out)
                raise
            return out

        reservations = await _off(s, reserve, _abort)
        committed = kept = False
        try:
            local: list[tuple[int, int]] = []
            remote: list[tuple[int, int]] = []
            for r, head, addr, n in zip(
                reservations, event.heads, event.addrs, event.lengths, strict=True
            ):
                r.buffer[: len(head)] = head
                if n:
                    local.append((address_of(r.array) + len(head), n))
                    remote.append((addr, n))
            sock = s.channel.sock
            try:
                await agent.move("READ", local, remote, peer.name, deadline, reservations, sock)
            except StuckError:
                kept = True
                raise
            await _commit(s, event, reservations, metas)
            committed = True
        finally:
            if not committed and not kept:
                _abort(reservations)
        s.bytes_in.inc(sum(event.lengths))
        s.reply(NixlPutDone(event.request_id))

    return _run(s, event.request_id, work)


async def _commit(
    s: NativeSession,
    event: NixlPut,
    reservations: list[PutReservation],
    metas: list[bytes | None],
) -> None:
    events, me = s.services.events, s.me
    keys = [me.key(key) for key in event.keys]
    parents = event.parents or (None,) * len(event.keys)
    if events is not None:
        for engine_key, key, parent, meta in zip(keys, event.keys, parents, metas, strict=True):
            decoded = None if meta is None else BlockMeta.decode(meta)
            events.expect(engine_key, key, parent, me.name, decoded)

    def commit() -> None:
        try:
            for reservation in reservations:
                reservation.commit()
        finally:
            _abort(reservations)  # a no-op for the committed ones
            if events is not None:
                for engine_key in keys:
                    events.settle(engine_key)

    if s.services.blocking_engine or event.durable:
        await s.off_loop(commit, lambda _: None)
    else:
        commit()
