"""KV events for KV-aware routers, in vLLM's format (ref/integrations.md §6).

Each message is a ZMQ PUB multipart ``(topic, seq as 8 bytes big-endian, msgpack EventBatch)``;
the batch is ``[ts, [event, ...], None]`` with events as vLLM 0.33.0 tagged maps
(``{"type": "BlockStored", ...}``). A block becoming readable in DRAM is a `BlockStored` with
``medium="CPU"``; leaving DRAM (delete or eviction) a `BlockRemoved`. Hashes are 64-bit ints,
the low 64 bits of the client's 16-byte block key read big-endian, as vLLM does with its digests.

Token ids are not known to the store, so `BlockStored` events are vLLM's placeholders
(``token_ids=[]``, ``block_size=0``): consumers that re-hash tokens (Dynamo, llm-d) cannot use
them yet; consumers that track block hashes can.

Evictions are reported by the engine from whichever thread made room, under its lock, so they
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
        # Engine key -> published hash, for the blocks whose BlockStored went out, so that a
        # removal (which the engine reports by engine key) names the same block.
        self._published: dict[bytes, int] = {}
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

    def stored(self, engine_key: bytes, key: bytes, parent: bytes | None) -> None:
        digest = event_hash(key)
        with self._lock:
            self._published[engine_key] = digest
        self._pending.append(
            {
                "type": "BlockStored",
                "block_hashes": [digest],
                "parent_block_hash": None if parent is None else event_hash(parent),
                "token_ids": [],
                "block_size": 0,
                "lora_id": None,
                "medium": MEDIUM_DRAM,
                "lora_name": None,
                "locality": "LOCAL",
            }
        )

    def removed(self, engine_key: bytes, tier: str = "dram") -> None:
        """A block left a tier (any thread; cheap, no I/O)."""
        with self._lock:
            digest = self._published.pop(engine_key, None)
        if digest is not None:
            self._pending.append(
                {"type": "BlockRemoved", "block_hashes": [digest], "medium": MEDIUM_DRAM}
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
