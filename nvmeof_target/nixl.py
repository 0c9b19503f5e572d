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
import importlib
import logging
import os
import select
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from kvoffload.client_sdk.wire.block import HEADER_BYTES
from kvoffload.client_sdk.wire.blockmeta import BlockMeta
from kvoffload.client_sdk.wire.native import (
    NIXL_DEADLINE_VERSION,
    NIXL_VERSION,
    NixlGet,
    NixlGetResult,
    NixlMemory,
    NixlMemoryDone,
    NixlPut,
    NixlPutDone,
)
from kvoffload.client_sdk.wire.shards import shard_of
from kvoffload.errors import (
    AuthError,
    ConfigError,
    DeadlineExceededError,
    InvalidArgumentError,
    KVOffloadError,
    TransportError,
)
from kvoffload.kvstore import BlockView, Engine, PutReservation
from kvoffload.kvstore.engine import arena_of
from kvoffload.nvmeof_target.events import stored_meta

if TYPE_CHECKING:
    from kvoffload.nvmeof_target.native_session import NativeSession

__all__ = ["NixlAgent", "NixlPeer", "on_nixl_get", "on_nixl_memory", "on_nixl_put"]

log = logging.getLogger("kvoffload.nixl")
T = TypeVar("T")
# Regions one connection may have registered at once (the client's cache holds fewer).
_MAX_REGIONS = 4096
# Waiting for a transfer: this many polls yield to the loop without sleeping, then the naps
# double from _NAP_S to _MAX_NAP_S, so a long transfer does not spin the loop at 100 % (each
# poll costs ~0.1 ms of Python and UCX progress: at 1 ms naps that was still ~10 % of a core).
_SPINS = 16
_NAP_S = 0.00005
_MAX_NAP_S = 0.002
# NIXL's serialised agent metadata starts with the agent's name: read before anything loads.
_SERDES = b"nixlSerDes|Agent"
_MAX_NAME = 256


class _StuckError(TransportError):
    """A transfer that could not be cancelled: its arena memory must stay held."""


class _LateError(DeadlineExceededError):
    """The client's time ran out (or it hung up) before the transfer was posted: nothing
    moved, so the connection may stay."""


def agent_name(metadata: bytes) -> str:
    """The name of the agent NIXL metadata describes, read without loading it.

    Raises:
        InvalidArgumentError: not NIXL agent metadata.
    """
    at = len(_SERDES)
    size = int.from_bytes(metadata[at : at + 8], "little")
    name = metadata[at + 8 : at + 8 + size]
    if (
        not metadata.startswith(_SERDES)
        or not 0 < size <= _MAX_NAME
        or len(name) != size
        or metadata[at + 8 + size : at + 9 + size] != b"|"
    ):
        raise InvalidArgumentError("not NIXL agent metadata")
    try:
        return name.decode()
    except UnicodeDecodeError:
        raise InvalidArgumentError("NIXL agent metadata names no readable agent") from None


def _hung_up(sock: socket.socket) -> bool:
    """The client shut its side of the control connection (it gave up on its request)."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLRDHUP)
    return bool(poller.poll(0))


def _keep_open(sock: socket.socket) -> int:
    """A duplicate of `sock`'s descriptor, never closed: the peer sees no close (-1 if the
    socket is closed already)."""
    try:
        return os.dup(sock.fileno())
    except OSError:
        return -1


def _address(view: memoryview | np.ndarray[Any, Any]) -> int:
    array = view if isinstance(view, np.ndarray) else np.frombuffer(view, dtype=np.uint8)
    return int(array.ctypes.data)


class NixlAgent:
    """This process's NIXL agent, with the engine's arena registered.

    Raises (constructor):
        ConfigError: NIXL is not installed, or its backend cannot be created here.
    """

    def __init__(self, engine: Engine, backend: str) -> None:
        self._engine, self._backend = engine, backend
        self._agent: Any = None
        self._making: asyncio.Future[None] | None = None
        self.arena = (0, 0)  # the registered arena: [start, end) addresses
        self.errors: tuple[type[Exception], ...] = (RuntimeError, ValueError)
        self.names: set[str] = set()  # remote agents loaded, one per connection
        # Views and reservations of transfers that could not be cancelled: the client's NIXL
        # may still touch their memory, so they are never given back (logged, counted).
        self.quarantine: list[object] = []

    async def ready(self) -> None:
        """Make the agent (once, in a thread: importing NIXL and loading its plugins takes
        seconds, and the loop must go on serving other connections meanwhile).

        Raises:
            ConfigError: NIXL is not installed, or its backend cannot be created here (a
                later request tries again).
        """
        if self._agent is not None:
            return
        if self._making is None:
            self._making = asyncio.ensure_future(asyncio.to_thread(self._make))
        making = self._making
        try:
            await asyncio.shield(making)  # a waiter that goes away leaves it to the others
        except ConfigError:
            if self._making is making:
                self._making = None
            raise

    def _make(self) -> None:
        engine, backend = self._engine, self._backend
        try:
            api = importlib.import_module("nixl._api")
            bindings = importlib.import_module("nixl._bindings")
        except ImportError as exc:
            raise ConfigError(f"the NIXL data path needs the nixl package: {exc}") from None
        # NIXL raises its own exception types, all plain Exception subclasses.
        self.errors = (
            RuntimeError,
            ValueError,
            *(
                getattr(bindings, n)
                for n in dir(bindings)
                if n.startswith("nixl") and n.endswith("Error")
            ),
        )
        name = f"kvoffload-daemon-{os.getpid()}"
        config = api.nixl_agent_config(enable_prog_thread=False, backends=[])
        try:
            agent = api.nixl_agent(name, config)
            agent.create_backend(backend)
            arena = arena_of(engine)
            start = _address(arena)
            agent.register_memory([(start, len(arena), 0, "")], "DRAM")
        except self.errors as exc:
            raise ConfigError(f"NIXL backend {backend!r} cannot be created: {exc}") from None
        self.arena = (start, start + len(arena))
        self._agent = agent

    def load(self, metadata: bytes, expected: str) -> None:
        """Load a client's agent metadata (whole or partial), whose owner the caller has
        checked: it names agent `expected`.

        Raises:
            InvalidArgumentError: NIXL does not accept it.
        """
        try:
            name = self._agent.add_remote_agent(metadata)
        except self.errors as exc:
            raise InvalidArgumentError(f"NIXL agent metadata refused: {exc}") from None
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != expected:  # NIXL read the name otherwise than `agent_name`: refuse it
            self.forget(name)
            raise InvalidArgumentError(f"NIXL agent metadata names {name!r}, not {expected!r}")

    def forget(self, name: str) -> None:
        self.names.discard(name)
        try:
            self._agent.remove_remote_agent(name)
        except self.errors as exc:
            log.debug("removing NIXL agent %s: %s", name, exc)

    async def move(
        self,
        op: str,
        local: list[tuple[int, int]],
        remote: list[tuple[int, int]],
        peer: str,
        deadline: float,
        held: object,
        sock: socket.socket,
    ) -> None:
        """Run one transfer (WRITE: arena -> client; READ: client -> arena), driving NIXL's
        progress while it runs, until `deadline` (monotonic). Nothing is posted once the
        deadline has passed or the client has shut its side of `sock`: a client that gave up
        may have handed its buffer back to its caller.

        Raises:
            InvalidArgumentError: NIXL refused the descriptors (not the client's memory).
            TransportError: the transfer failed or timed out (the client went away), or was
                never posted; if it could not be cancelled, `held` (what pins its arena
                memory) is kept forever.
        """
        if not local:
            return
        agent = self._agent
        try:
            handle = agent.initialize_xfer(
                op,
                agent.get_xfer_descs([(a, n, 0) for a, n in local], "DRAM"),
                agent.get_xfer_descs([(a, n, 0) for a, n in remote], "DRAM"),
                peer,
            )
        except self.errors as exc:
            raise InvalidArgumentError(f"NIXL refused the transfer: {exc}") from None
        state, stuck, polls, nap = "ERR", False, 0, _NAP_S
        try:
            if time.monotonic() >= deadline or _hung_up(sock):
                raise _LateError(f"the client's time ran out before the NIXL {op}: none posted")
            state = agent.transfer(handle)
            while state == "PROC" and time.monotonic() < deadline:
                polls += 1  # other connections run between progress polls
                if polls <= _SPINS:
                    await asyncio.sleep(0)
                else:
                    await asyncio.sleep(nap)
                    nap = min(nap * 2, _MAX_NAP_S)
                state = agent.check_xfer_state(handle)
        except self.errors as exc:
            state = f"ERR ({exc})"
        finally:  # also when the connection is cut (cancelled) mid-transfer
            try:
                handle.release()  # cancels one still in progress
            except self.errors as exc:
                # The client frees its buffer once this connection answers or closes, so
                # neither may happen while the transfer can still land there: a duplicate of
                # the socket keeps the connection open (no FIN) for as long as `held` lives.
                self.quarantine.append((held, _keep_open(sock)))
                log.error("NIXL %s with %s not cancelled (%s): memory stays held", op, peer, exc)
                stuck = True
            if stuck:
                raise _StuckError(f"NIXL {op} did not finish")  # noqa: B012
        if state != "DONE":
            raise TransportError(f"NIXL {op} with the client failed: {state}")


@dataclass
class NixlPeer:
    """One connection's NIXL state: its client's agent and the memory it registered."""

    name: str
    regions: set[tuple[int, int]] = field(default_factory=set)

    def change(self, add: tuple[int, ...], revoke: tuple[int, ...]) -> None:
        for i in range(0, len(revoke), 2):
            self.regions.discard((revoke[i], revoke[i + 1]))
        for i in range(0, len(add), 2):
            self.regions.add((add[i], add[i + 1]))
        if len(self.regions) > _MAX_REGIONS:
            raise InvalidArgumentError(f"more than {_MAX_REGIONS} NIXL regions on one connection")

    def check(self, addr: int, length: int) -> None:
        """Raises: InvalidArgumentError: [addr, addr+length) is not inside one region this
        connection has registered (and not revoked)."""
        for start, size in self.regions:
            if start <= addr and addr + length <= start + size:
                return
        raise InvalidArgumentError(
            f"descriptor {addr:#x}+{length} is outside this connection's registered memory"
        )


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
            if s.version < NIXL_VERSION:
                raise InvalidArgumentError("NIXL requests need protocol version 3")
            agent = await _agent(s)
            if s.nixl is None:
                raise InvalidArgumentError("NixlMemory must name the client's agent first")
            await work(agent, s.nixl)
        except _StuckError as exc:
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


def on_nixl_memory(s: NativeSession, event: NixlMemory) -> Awaitable[None]:
    async def run() -> None:
        try:
            if s.version < NIXL_VERSION:
                raise InvalidArgumentError("NIXL requests need protocol version 3")
            agent = await _agent(s)
            if event.agent:
                _own(s, agent, event.agent)
            if s.nixl is None:
                raise InvalidArgumentError("the first NixlMemory must carry the agent's metadata")
            s.nixl.change(event.regions, event.revoke)
        except KVOffloadError as exc:
            _refuse(s, event.request_id, exc)
            return
        s.reply(NixlMemoryDone(event.request_id))

    return run()


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


def forget(s: NativeSession) -> None:
    """The connection ended: the daemon no longer reaches its client's memory."""
    if s.nixl is not None and s.services.nixl is not None:
        s.services.nixl.forget(s.nixl.name)
    s.nixl = None


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
                at = _address(view.data)
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
        except _StuckError:
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
                        if parent is not None and shard_of(parent, shard.count) != shard.index:
                            parent = None  # held by another worker: unknown to this engine
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
                    local.append((_address(r.array) + len(head), n))
                    remote.append((addr, n))
            sock = s.channel.sock
            try:
                await agent.move("READ", local, remote, peer.name, deadline, reservations, sock)
            except _StuckError:
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
