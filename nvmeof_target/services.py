"""What the daemon hands its fronts: the shared `Services`, and the `Front` protocol each
front implements. Its own module so that the fronts and the daemon (`server.py`, which imports
the fronts) depend on it rather than on each other.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvoffload import __version__, core
from kvoffload.errors import WrongShardError
from kvoffload.kvstore import Engine
from kvoffload.nvmeof_target.config import Config
from kvoffload.nvmeof_target.events.publisher import KVEvents
from kvoffload.nvmeof_target.metrics import Metrics
from kvoffload.nvmeof_target.tenants import Tenants
from kvoffload.nvmeof_target.tombstones import Tombstones
from kvoffload.wire.shards import shard_of

if TYPE_CHECKING:
    from kvoffload.nvmeof_target.native.agent import NixlAgent

__all__ = ["Front", "Services", "ShardRole"]


@dataclass
class ShardRole:
    """This process serves shard `index` of `count` (a daemon with several workers).

    `listeners` are the native sockets it accepts on: the node's shared port (every worker
    accepts there) and its own; `ports` are every shard's own port, in shard order, which
    Welcome hands to clients so that they route each key straight to its shard.
    """

    index: int
    count: int
    listeners: list[socket.socket]
    ports: list[int]

    def check(self, key: bytes) -> None:
        """Raises: WrongShardError: another worker holds `key` (the client's map is stale)."""
        owner = shard_of(key, self.count)
        if owner != self.index:
            raise WrongShardError(
                f"key {key.hex()} belongs to shard {owner} of {self.count}, not {self.index}: "
                "the client's shard map is out of date"
            )

    def check_all(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self.check(key)

    def own_parent(self, parent: bytes | None) -> bytes | None:
        """`parent` if this shard holds it, else None: a parent another worker holds is
        unknown to this engine, and the block starts a chain here rather than look like an
        orphan (the first to be evicted)."""
        return parent if parent is None or shard_of(parent, self.count) == self.index else None


class PinBudget:
    """Bytes of the arena that answers still being sent hold pinned, across connections.

    Taken from any thread (reads run on the I/O threads with an SSD tier), given back when the
    kernel has an answer's bytes.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._lock = threading.Lock()

    def take(self, n: int, first: bool) -> bool:
        """Hold `n` more bytes if they fit; the first value of an answer always fits (an answer
        carries at least one value, or the client could never read a block)."""
        with self._lock:
            if not first and self.held + n > self.limit:
                return False
            self.held += n
            return True

    def give_back(self, n: int) -> None:
        with self._lock:
            self.held -= n


@dataclass
class Services:
    """What every front shares."""

    config: Config
    engine: Engine
    tenants: Tenants
    metrics: Metrics
    executor: ThreadPoolExecutor
    events: KVEvents | None = None
    # True when engine calls that move blocks may wait on a device (SSD tier): fronts run
    # reads, reservations (which may evict to the SSD), commits and deletes in `executor`.
    blocking_engine: bool = False
    hot_gets: int = 0  # gets the native front answered in C (`NativeSession.start_hot`)
    hot_exists: int = 0  # and exists requests
    hot_lookups: int = 0  # and lookups
    hot_get_manys: int = 0  # and batch gets
    # Python-path GetMany answers, those cut short by `answer_pins` or max_payload_bytes (the
    # client asks again for the rest), and the hits they had read but dropped unsent.
    get_many_answers: int = 0
    get_many_cut: int = 0
    get_many_dropped: int = 0
    hot_put_answers: int = 0  # puts whose answer C sent and counted (`HotGets.put_done`)
    # Of the hot requests, those the C reader callback received and answered with no Python
    # session code between (`NativeSession._read_in_c`), and how often it handed back.
    hot_reader_requests: int = 0
    hot_reader_handbacks: int = 0
    hot_reader_puts: int = 0  # puts whose payload the C reader received into the slot
    shard: ShardRole | None = None
    # This process's NIXL agent, made when a client first asks for the NIXL data path.
    nixl: NixlAgent | None = None
    started: float = field(default_factory=time.monotonic)
    answer_pins: PinBudget = field(init=False)
    # Keys deleted lately, which a cluster's read repair must not bring back (`Repair`).
    tombstones: Tombstones = field(default_factory=Tombstones)

    def __post_init__(self) -> None:
        share = self.config.native.answer_pin_share
        self.answer_pins = PinBudget(int(self.config.dram.capacity_bytes * share))

    def server_info(self) -> dict[str, object]:
        return {
            "version": __version__,
            "uptime_s": round(time.monotonic() - self.started, 3),
            # "c" or "python" (KVOFFLOAD_PURE_PYTHON=1): which core this daemon runs
            "core": core.IMPLEMENTATION,
            "hot_gets": self.hot_gets,
            "hot_exists": self.hot_exists,
            "hot_lookups": self.hot_lookups,
            "hot_get_manys": self.hot_get_manys,
            "get_many_answers": self.get_many_answers,
            "get_many_cut": self.get_many_cut,
            "get_many_dropped": self.get_many_dropped,
            "hot_put_answers": self.hot_put_answers,
            "hot_reader_requests": self.hot_reader_requests,
            "hot_reader_handbacks": self.hot_reader_handbacks,
            "hot_reader_puts": self.hot_reader_puts,
        }


class Front(Protocol):
    """A network front: started once, stopped once."""

    name: str

    async def start(self) -> list[tuple[str, str, int]]:
        """Begin serving; returns (what, host, port) for each listener."""
        ...

    async def stop(self, timeout: float) -> None:
        """Stop accepting, finish in-flight requests (for at most `timeout` s), close."""
        ...

    def drop_connections(self) -> None:
        """Close every connection now, dropping what it queued (a cluster node rejoining:
        a write sent before it dropped its blocks must not land after)."""
        ...
