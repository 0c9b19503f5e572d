"""KV events for KV-aware routers, in vLLM's format (ref/integrations.md §6).

Each message is a ZMQ PUB multipart ``(topic, seq as 8 bytes big-endian, msgpack EventBatch)``;
the batch is ``[ts, [event, ...], None]`` with events as vLLM 0.33.0 tagged maps
(``{"type": "BlockStored", ...}``). A block becoming readable in a tier is a `BlockStored`, leaving
it a `BlockRemoved`, with ``medium="CPU"`` for DRAM and ``"STORAGE"`` for the SSD: a demotion is
a Removed(CPU) + Stored(STORAGE) pair, a promotion a Stored(CPU). Hashes are 64-bit ints, the low
64 bits of the client's 16-byte block key read big-endian, as vLLM does with its digests.

Token ids are not known to the store, so `BlockStored` events are vLLM's placeholders
(``token_ids=[]``, ``block_size=0``): consumers that re-hash tokens (Dynamo, llm-d) cannot use
them yet; consumers that track block hashes can.

Tier moves are reported by the engine from whichever thread made them, under its lock, so they
only go into a thread-safe deque; the loop publishes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from typing import Any

import msgpack
import zmq

from kvoffload.nvmeof_target.config import EventsConfig

__all__ = ["KVEvents", "event_hash"]

_MASK64 = (1 << 64) - 1
MEDIUM_DRAM = "CPU"
MEDIA = {"dram": MEDIUM_DRAM, "ssd": "STORAGE"}
# Events per message at most; a burst of evictions is split over several messages.
_MAX_BATCH = 4096


def event_hash(key: bytes) -> int:
    """The 64-bit id a block key is published under."""
    return int.from_bytes(key, "big") & _MASK64


class KVEvents:
    """Collects block events and publishes them in batches on a ZMQ PUB socket."""

    def __init__(self, config: EventsConfig) -> None:
        self._config = config
        self._topic = config.topic.encode()
        self._context: zmq.Context[Any] = zmq.Context.instance()
        self._socket: zmq.Socket[bytes] = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, config.hwm)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._pending: collections.deque[dict[str, object]] = collections.deque()
        # Engine key -> (published hash, parent hash, tiers it is published in), for blocks
        # whose BlockStored went out, so that tier moves (reported by engine key) name the block.
        self._published: dict[bytes, tuple[int, int | None, set[str]]] = {}
        self._lock = threading.Lock()
        self._seq = 0
        self._task: asyncio.Task[None] | None = None
        self.endpoint = ""

    def start(self) -> str:
        """Bind the socket and start publishing; returns the bound endpoint."""
        self._socket.bind(self._config.endpoint)
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self.endpoint

    def _stored_event(self, digest: int, parent: int | None, tier: str) -> dict[str, object]:
        return {
            "type": "BlockStored",
            "block_hashes": [digest],
            "parent_block_hash": parent,
            "token_ids": [],
            "block_size": 0,
            "lora_id": None,
            "medium": MEDIA[tier],
            "lora_name": None,
            "locality": "LOCAL",
        }

    def stored(self, engine_key: bytes, key: bytes, parent: bytes | None) -> None:
        """A client's put landed in DRAM."""
        digest = event_hash(key)
        parent_digest = None if parent is None else event_hash(parent)
        with self._lock:
            self._published[engine_key] = (digest, parent_digest, {"dram"})
        self._pending.append(self._stored_event(digest, parent_digest, "dram"))

    def moved(self, kind: str, engine_key: bytes, tier: str) -> None:
        """The engine stored a block in, or removed it from, a tier (any thread; no I/O)."""
        with self._lock:
            entry = self._published.get(engine_key)
            if entry is None:
                return  # never published by this daemon (e.g. stored before a restart)
            digest, parent, tiers = entry
            if (kind == "stored") == (tier in tiers):
                return
            if kind == "stored":
                tiers.add(tier)
            else:
                tiers.discard(tier)
                if not tiers:
                    del self._published[engine_key]
        if kind == "stored":
            self._pending.append(self._stored_event(digest, parent, tier))
        else:
            self._pending.append(
                {"type": "BlockRemoved", "block_hashes": [digest], "medium": MEDIA[tier]}
            )

    def removed(self, engine_key: bytes) -> None:
        """A client's delete: the block left every tier it was published in."""
        with self._lock:
            entry = self._published.pop(engine_key, None)
        if entry is None:
            return
        digest, _, tiers = entry
        for tier in sorted(tiers):
            self._pending.append(
                {"type": "BlockRemoved", "block_hashes": [digest], "medium": MEDIA[tier]}
            )

    def flush(self) -> None:
        while self._pending:
            events = [self._pending.popleft() for _ in range(min(len(self._pending), _MAX_BATCH))]
            payload = msgpack.packb([time.time(), events, None], use_bin_type=True)
            self._seq += 1
            # PUB drops when subscribers lag: routers resynchronise from later events.
            with contextlib.suppress(zmq.Again):
                self._socket.send_multipart(
                    [self._topic, self._seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK
                )

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._config.flush_interval_s)
            self.flush()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.flush()
        self._socket.close(linger=0)
