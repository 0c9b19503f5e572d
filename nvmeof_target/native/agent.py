"""The daemon's NIXL agent and what one connection may reach through it (docs/guides/nixl.md).

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
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvoffload.errors import (
    ConfigError,
    DeadlineExceededError,
    InvalidArgumentError,
    TransportError,
)
from kvoffload.kvstore import Engine
from kvoffload.kvstore.engine import arena_of

__all__ = [
    "LateError",
    "NixlAgent",
    "NixlPeer",
    "StuckError",
    "address_of",
    "agent_name",
    "daemon_tls",
]

log = logging.getLogger("kvoffload.nixl")
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
# Prepared one-descriptor lists kept per connection (`_Lists`): the client's side (its buffers:
# few, reused) and the arena's side (one per slot a block moved from or into).
_MAX_REMOTE_LISTS = 64
_MAX_LOCAL_LISTS = 256
# UCX transports the daemon's agent never uses (docs/guides/nixl.md, "What the daemon trusts
# about a NIXL peer"): with each, the daemon's own process (or its kernel) reaches the peer's
# memory by an identifier the peer's metadata declares and nothing binds to the connection —
# a pid (cma: process_vm_readv/writev; knem; xpmem; posix shm via /proc/<pid>/fd; cuda_ipc and
# rocm_ipc handles), a System V segment id (sysv), or this very process (self). The aliases
# that name any of them (sm, shm, mm) go too. TCP and RDMA stay: there the peer's own worker or
# NIC serves each access, so a client reaches only its own process's memory.
_PID_ADDRESSED = ("sm", "shm", "mm", "cma", "knem", "xpmem", "posix", "sysv", "self")
_REFUSED_TLS = (*_PID_ADDRESSED, "cuda_ipc", "rocm_ipc")


class StuckError(TransportError):
    """A transfer that could not be cancelled: its arena memory must stay held."""


class LateError(DeadlineExceededError):
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


def daemon_tls(operator: str | None) -> str:
    """The daemon agent's UCX_TLS: the operator's setting (None: unset) without the transports
    through which a client could name memory it does not own (`_REFUSED_TLS`).

    Raises:
        ConfigError: the operator's setting leaves no other transport.
    """
    setting = (operator or "").strip()
    if setting.lower() in ("", "all", "^"):
        return "^" + ",".join(_REFUSED_TLS)
    if setting.startswith("^"):
        excluded = [t.strip() for t in setting[1:].split(",") if t.strip()]
        have = {t.lower() for t in excluded}
        return "^" + ",".join([*excluded, *(t for t in _REFUSED_TLS if t not in have)])
    kept = [t.strip() for t in setting.split(",") if t.strip()]
    kept = [t for t in kept if t.lower() not in _REFUSED_TLS]
    if not kept:
        raise ConfigError(
            f"UCX_TLS={setting!r} leaves the daemon's NIXL agent no transport: shared memory "
            "(sm, cma, knem, xpmem, posix, sysv) lets a client name another process's memory; "
            "add tcp or an RDMA transport (docs/guides/nixl.md)"
        )
    return ",".join(kept)


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


def address_of(view: memoryview | np.ndarray[Any, Any]) -> int:
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
        self._lists: dict[str, _Lists] = {}  # prepared descriptor lists, by remote agent
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
        # Before NIXL (and UCX) first load in this process: UCX reads its transports from the
        # environment when the backend is made, and nothing else in the daemon uses UCX.
        # (Idempotent: a second try after a failure derives the same setting again.)
        os.environ["UCX_TLS"] = daemon_tls(os.environ.get("UCX_TLS"))
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
            start = address_of(arena)
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
        # New metadata may register a buffer anew (at an address used before: new keys), so
        # the client's side of every prepared list is made again from what is loaded now.
        lists = self._lists.get(expected)
        if lists is not None:
            lists.drop_remote()
        try:
            name = self._agent.add_remote_agent(metadata)
        except self.errors as exc:
            raise InvalidArgumentError(f"NIXL agent metadata refused: {exc}") from None
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != expected:  # NIXL read the name otherwise than `agent_name`: refuse it
            self.forget(name)
            raise InvalidArgumentError(f"NIXL agent metadata names {name!r}, not {expected!r}")

    def notify(self, name: str, message: bytes) -> None:
        """Send `message` as a NIXL notification to agent `name`, at the worker its metadata
        declares (only that worker's process can echo it).

        Raises:
            TransportError: NIXL could not send it.
        """
        try:
            self._agent.send_notif(name, message)
        except self.errors as exc:
            raise TransportError(f"NIXL notification to the client's agent failed: {exc}") from None

    async def deliver(self, peer: NixlPeer, until: float) -> None:
        """Drive NIXL's progress (no progress thread) until `peer` has echoed its nonce, the
        connection dropped it, or `until` (monotonic): a notification on TCP needs it."""
        nap = _NAP_S
        peer.driving = True
        try:
            while peer.nonce and not peer.proven and time.monotonic() < until:
                try:
                    self._agent.get_new_notifs()  # progress; this agent expects no notifications
                except self.errors as exc:
                    log.debug("NIXL progress for %s: %s", peer.name, exc)
                    return
                await asyncio.sleep(nap)
                nap = min(nap * 2, _MAX_NAP_S)
        finally:
            peer.driving = False

    def revoke(self, name: str, revoke: tuple[int, ...]) -> None:
        """Drop agent `name`'s prepared lists inside the regions it revoked (flat address,
        length pairs): none is ever used for them again."""
        lists = self._lists.get(name)
        if lists is not None:
            for i in range(0, len(revoke), 2):
                lists.drop_remote(revoke[i], revoke[i + 1])

    def prepared(self, name: str) -> list[tuple[int, int]]:
        """The descriptors in agent `name`'s memory that have a prepared list now."""
        lists = self._lists.get(name)
        return [] if lists is None else list(lists.remote_lists)

    def forget(self, name: str) -> None:
        self.names.discard(name)
        lists = self._lists.pop(name, None)
        if lists is not None:
            lists.close()  # before the agent's metadata they were prepared from goes
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
        used: tuple[object, ...] = ()
        try:
            if len(local) == 1:
                # One block (a get_into, a put): the lists prepared for this slot and this
                # buffer, by index; the caller has checked the buffer's region just now.
                lists = self._lists.get(peer)
                if lists is None:
                    lists = self._lists[peer] = _Lists(agent, self.errors)
                used = (lists.local(local[0]), lists.remote(peer, remote[0]))
                handle = agent.make_prepped_xfer(op, used[0], [0], used[1], [0])
            else:
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
                raise LateError(f"the client's time ran out before the NIXL {op}: none posted")
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
                # The lists it was made from stay prepared too (`_Lists.stuck`).
                self.quarantine.append(((held, used), _keep_open(sock)))
                if peer in self._lists:
                    self._lists[peer].stuck = True
                log.error("NIXL %s with %s not cancelled (%s): memory stays held", op, peer, exc)
                stuck = True
            if stuck:
                raise StuckError(f"NIXL {op} did not finish")  # noqa: B012
        if state != "DONE":
            raise TransportError(f"NIXL {op} with the client failed: {state}")


class _Lists:
    """One connection's prepared one-descriptor lists (NIXL's `prep_xfer_dlist`): the client's
    side by (address, length) in its buffers, the arena's side by (slot address, length).

    A transfer of one block then costs `make_prepped_xfer` by index instead of two descriptor
    lists and `initialize_xfer`, whose checks and look-ups (the remote agent's registrations,
    the backend's) it would repeat per request. Safe because a list is used only after the
    region check of the same request (`NixlPeer.check`), and because the client's side is
    dropped when its region is revoked and whenever the client's metadata is loaded again (a
    buffer registered anew, even at the same address, gets lists made from its new
    registration). Bounded (least recently used dropped first); one connection's requests run
    one at a time, so a list dropped here is in no transfer in flight.
    """

    def __init__(self, agent: Any, errors: tuple[type[Exception], ...]) -> None:
        self._agent, self._errors = agent, errors
        self._local: OrderedDict[tuple[int, int], Any] = OrderedDict()
        self.remote_lists: OrderedDict[tuple[int, int], Any] = OrderedDict()
        # A transfer made from these lists could not be cancelled: never release them (the
        # quarantine keeps the ones it used).
        self.stuck = False

    def local(self, desc: tuple[int, int]) -> Any:
        return self._get(self._local, desc, "NIXL_INIT_AGENT", _MAX_LOCAL_LISTS)

    def remote(self, peer: str, desc: tuple[int, int]) -> Any:
        return self._get(self.remote_lists, desc, peer, _MAX_REMOTE_LISTS)

    def _get(
        self, lists: OrderedDict[tuple[int, int], Any], desc: tuple[int, int], who: str, most: int
    ) -> Any:
        handle = lists.get(desc)
        if handle is not None:
            lists.move_to_end(desc)
            return handle
        handle = self._agent.prep_xfer_dlist(who, [(*desc, 0)], "DRAM")
        lists[desc] = handle
        while len(lists) > most:
            self._release(lists.popitem(last=False)[1])
        return handle

    def drop_remote(self, start: int = 0, size: int = -1) -> None:
        """Drop the client-side lists inside [start, start+size) (all by default)."""
        for addr, n in list(self.remote_lists):
            if size < 0 or (start <= addr and addr + n <= start + size):
                self._release(self.remote_lists.pop((addr, n)))

    def close(self) -> None:
        for lists in (self._local, self.remote_lists):
            while lists:
                self._release(lists.popitem()[1])

    def _release(self, handle: Any) -> None:
        if self.stuck:
            return  # dropped, not released (the quarantine holds the ones in use)
        try:
            handle.release()
        except self._errors as exc:
            log.debug("releasing a prepared NIXL list: %s", exc)


@dataclass
class NixlPeer:
    """One connection's NIXL state: its client's agent and the memory it registered."""

    name: str
    regions: set[tuple[int, int]] = field(default_factory=set)
    # The nonce last sent to the agent's worker (b"": none outstanding), and whether the
    # client has echoed it since its last metadata: no transfer is served until it has.
    nonce: bytes = b""
    proven: bool = False
    driving: bool = False  # a task drives progress until the nonce is echoed (one at a time)

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
