"""KV events for KV-aware routers, in vLLM's format (ref/integrations.md §6).

Each message is a ZMQ PUB multipart ``(topic, seq as 8 bytes big-endian, msgpack EventBatch)``;
the batch is ``[ts, [event, ...], None]`` with events as vLLM 0.33.0 tagged maps
(``{"type": "BlockStored", ...}``). A block becoming readable in a tier is a `BlockStored`, leaving
it a `BlockRemoved`, with ``medium="CPU"`` for DRAM and ``"STORAGE"`` for the SSD: a demotion is
a Removed(CPU) + Stored(STORAGE) pair, a promotion a Stored(CPU). Hashes are 64-bit ints, the low
64 bits of the client's 16-byte block key read big-endian, as vLLM does with its digests.
Tenants use the same client keys, so each configured tenant's events go out on its own topic,
``<topic>/<tenant>``, with its own sequence numbers (a subscription to ``<topic>`` gets all).

A put that carries block metadata (`BlockMeta`: token ids, the serving engine's block hash and
its parent's, LoRA name) is published with it: real ``token_ids`` and ``block_size``, so routers
that re-hash tokens (Dynamo, llm-d) can index it, and the engine's own hash as the block hash
(else the key's). The daemon stores the metadata with the block, with the hashes filled in, so
that after a restart it announces what the store holds from the engine's indexes alone
(`announce`) and answers a router's replay request with everything it holds (`serve_replay`).
Without metadata, `BlockStored` carries vLLM's placeholders (``token_ids=[]``,
``block_size=0``).

Medium: ``"CPU"`` and ``"STORAGE"`` are vLLM's own names (`vllm.distributed.kv_events`, and its
`kv_offload` `Medium` enum, which drops other values); Dynamo's router (`lib/kv-router`,
`StorageTier::from_kv_medium`) maps ``CPU`` to host memory and ``STORAGE`` to disk (older
releases knew only ``CPU_PINNED``/``CPU_TIER1`` and ``CPU_TIER2``/``DISK``/``NVME``; they count
an unknown medium as GPU). docs/events.md has the table.

Tier moves are reported by the engine from whichever thread made them, under its lock, so they
only go into a thread-safe deque; the loop publishes. The engine also reports a client's put
landing in DRAM, under the same lock, so a front only announces the put (`expect`) before its
commit runs: a durable put's SSD copy, the commit and an eviction right after it are then
published in the order they happened.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from kvoffload.client_sdk.wire.blockmeta import BlockMeta
from kvoffload.errors import LocalProtocolError
from kvoffload.kvstore import DescribedBlock
from kvoffload.nvmeof_target.config import EventsConfig

__all__ = ["EventRelay", "KVEvents", "event_hash", "stored_meta"]

_MASK64 = (1 << 64) - 1
MEDIUM_DRAM = "CPU"
MEDIA = {"dram": MEDIUM_DRAM, "ssd": "STORAGE"}
# Events per message at most; a burst of evictions is split over several messages.
_MAX_BATCH = 4096
# A replay answer ends with this sequence number and an empty payload (vLLM's END_SEQ).
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def event_hash(key: bytes) -> int:
    """The 64-bit id a block key is published under."""
    return int.from_bytes(key, "big") & _MASK64


def stored_meta(key: bytes, parent: bytes | None, raw: bytes | None) -> bytes:
    """The metadata a daemon with events stores for a put: the client's, with the block's and
    its parent's hashes filled in from the keys where the client gave none, so that a restarted
    daemon can name the block (the engine keeps no client key).

    Raises:
        LocalProtocolError: `raw` is malformed (the wire layer checked it already).
    """
    meta = BlockMeta.decode(raw) if raw is not None else BlockMeta()
    if meta.block_hash is not None and (meta.parent_hash is not None or parent is None):
        return raw if raw is not None else meta.encode()
    return BlockMeta(
        meta.token_ids,
        event_hash(key) if meta.block_hash is None else meta.block_hash,
        meta.parent_hash if meta.parent_hash is not None or parent is None else event_hash(parent),
        meta.lora_name,
        meta.cache_salt,
        meta.block_size,
    ).encode()


def _removed_event(digest: int, tier: str) -> dict[str, object]:
    return {"type": "BlockRemoved", "block_hashes": [digest], "medium": MEDIA[tier]}


@dataclass(slots=True)
class _Block:
    """A block this daemon has published (or is about to): what names it, where it is."""

    digest: int
    parent: int | None
    topic: bytes  # the tenant's topic
    tiers: set[str] = field(default_factory=set)
    pending: int = 0  # puts announced by `expect` and not yet settled
    meta: BlockMeta | None = None


def _parents_first(blocks: list[_Block]) -> list[_Block]:
    """`blocks` ordered so that a block comes after its parent when that is among them: a
    router files a block under its parent and drops one whose parent it does not know, and a
    parent evicted and stored again is newer than its children."""
    by_digest = {b.digest: b for b in blocks}
    depth: dict[int, int] = {}
    for block in blocks:
        chain: list[int] = []
        seen: set[int] = set()  # a cycle (hash collisions) must not loop
        b: _Block | None = block
        while b is not None and b.digest not in depth and b.digest not in seen:
            chain.append(b.digest)
            seen.add(b.digest)
            b = by_digest.get(b.parent) if b.parent is not None else None
        base = depth.get(b.digest, 0) if b is not None else -1
        for i, digest in enumerate(reversed(chain)):
            depth[digest] = base + 1 + i
    return sorted(blocks, key=lambda b: depth[b.digest])


class KVEvents:
    """Collects block events and publishes them in batches on a ZMQ PUB socket."""

    def __init__(self, config: EventsConfig, forward_to: str = "", source: int = 0) -> None:
        """`forward_to`: worker `source` of a multi-process daemon sends its batches to the
        supervisor's `EventRelay` there (which numbers and publishes them) instead of binding."""
        self._config = config
        self._forward_to = forward_to
        self._source = source.to_bytes(2, "big")
        self._topic = config.topic.encode()
        self._context: zmq.Context[Any] = zmq.Context.instance()
        self._socket: zmq.Socket[bytes] = self._context.socket(zmq.PUSH if forward_to else zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, config.hwm)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._pending: collections.deque[tuple[bytes, dict[str, object]]] = collections.deque()
        # Engine key -> the block, for blocks published or announced, so that tier moves
        # (reported by engine key) name the block.
        self._published: dict[bytes, _Block] = {}
        self._lock = threading.Lock()
        self._seq: dict[bytes, int] = {}  # per topic: a subscriber of one sees no gaps
        self._task: asyncio.Task[None] | None = None
        self.endpoint = ""
        self.replay_endpoint = ""
        self._replay: zmq.Socket[bytes] | None = None

    def start(self) -> str:
        """Bind the socket and start publishing; returns the bound endpoint."""
        if self._forward_to:
            self._socket.connect(self._forward_to)
            self.endpoint = self._forward_to
        else:
            self._socket.bind(self._config.endpoint)
            self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
            if self._config.replay_endpoint:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(self._config.replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self.endpoint

    def _stored_event(self, block: _Block, tier: str) -> dict[str, object]:
        meta = block.meta
        return {
            "type": "BlockStored",
            "block_hashes": [block.digest],
            "parent_block_hash": block.parent,
            # msgpack writes a tuple as an array: no copy into a list.
            "token_ids": meta.token_ids if meta is not None else (),
            "block_size": meta.tokens_per_block if meta is not None else 0,
            "lora_id": None,
            "medium": MEDIA[tier],
            "lora_name": meta.lora_name if meta is not None else None,
            "locality": "LOCAL",
        }

    def topic_of(self, tenant: str) -> bytes:
        """The configured topic, with ``/<tenant>`` appended for a configured tenant."""
        return self._topic + (b"/" + tenant.encode() if tenant else b"")

    def expect(
        self,
        engine_key: bytes,
        key: bytes,
        parent: bytes | None,
        tenant: str = "",
        meta: BlockMeta | None = None,
    ) -> None:
        """A client's put of `key` is about to be committed: from now on the engine's reports
        for `engine_key` (the commit itself, an SSD copy, an eviction) are published under its
        hash (the metadata's block hash, else the key's), on the tenant's topic. Call `settle`
        once the commit has succeeded or failed."""
        digest = event_hash(key)
        parent_digest = None if parent is None else event_hash(parent)
        if meta is not None:
            digest = digest if meta.block_hash is None else meta.block_hash
            parent_digest = parent_digest if meta.parent_hash is None else meta.parent_hash
        gone: list[tuple[bytes, dict[str, object]]] = []
        with self._lock:
            old = block = self._published.get(engine_key)
            if block is None or block.digest != digest or block.meta != meta:
                block = _Block(digest, parent_digest, self.topic_of(tenant), meta=meta)
                self._published[engine_key] = block
                if old is not None:
                    block.pending = old.pending
                    if old.digest == digest:  # the same block to a router: its copies stay
                        block.tiers = old.tiers
                    else:  # the old name's copies go as the engine replaces them
                        gone = [(old.topic, _removed_event(old.digest, t)) for t in old.tiers]
            block.pending += 1
        self._pending.extend(gone)

    def announce(self, blocks: list[DescribedBlock]) -> int:
        """Publish what a (restarted) store holds, as the engine's indexes describe it: one
        `BlockStored` per block and tier, SSD first. Returns how many blocks were announced
        (blocks whose metadata names no hash, stored without events, are not)."""
        found: list[_Block] = []
        topics: dict[str, bytes] = {}
        with self._lock:  # once: a restart may announce millions of blocks
            for described in blocks:
                try:
                    meta = BlockMeta.decode(described.meta)
                except LocalProtocolError:
                    continue  # not written by a daemon (an embedded engine's own metadata)
                if meta.block_hash is None or described.key in self._published:
                    continue  # no name for it, or a put since the start published it
                topic = topics.get(described.tenant)
                if topic is None:
                    topic = topics[described.tenant] = self.topic_of(described.tenant)
                block = _Block(meta.block_hash, meta.parent_hash, topic, set(described.tiers),
                               meta=meta)  # fmt: skip
                self._published[described.key] = block
                found.append(block)
        for block in _parents_first(found):
            for tier in sorted(block.tiers, reverse=True):  # "ssd" first
                self._pending.append((block.topic, self._stored_event(block, tier)))
        return len(found)

    def settle(self, engine_key: bytes) -> None:
        """An announced put finished (its events, if any, went out as the engine reported)."""
        with self._lock:
            block = self._published.get(engine_key)
            if block is not None and block.pending:
                block.pending -= 1
                if not block.tiers and not block.pending:
                    del self._published[engine_key]

    def moved(self, kind: str, engine_key: bytes, tier: str) -> None:
        """The engine stored a block in, or removed it from, a tier (any thread; no I/O)."""
        with self._lock:
            block = self._published.get(engine_key)
            if block is None:
                return  # never published by this daemon (e.g. stored before a restart)
            if kind == "removed" and tier not in block.tiers:
                return
            # A block stored again (a put replacing it) is announced again: PUB drops messages
            # when a subscriber lags, and a repeat lets it catch up.
            if kind == "stored":
                block.tiers.add(tier)
            else:
                block.tiers.discard(tier)
                if not block.tiers and not block.pending:
                    del self._published[engine_key]
        if kind == "stored":
            self._pending.append((block.topic, self._stored_event(block, tier)))
        else:
            self._pending.append((block.topic, _removed_event(block.digest, tier)))

    def removed(self, engine_key: bytes) -> None:
        """A client's delete: the block left every tier it was published in."""
        with self._lock:
            block = self._published.pop(engine_key, None)
        if block is None:
            return
        for tier in sorted(block.tiers):
            self._pending.append((block.topic, _removed_event(block.digest, tier)))

    def flush(self) -> None:
        while self._pending:
            # One message per run of events on the same topic, in order.
            topic = self._pending[0][0]
            events: list[dict[str, object]] = []
            while self._pending and self._pending[0][0] == topic and len(events) < _MAX_BATCH:
                events.append(self._pending.popleft()[1])
            payload = msgpack.packb([time.time(), events, None], use_bin_type=True)
            seq = self._seq[topic] = self._seq.get(topic, 0) + 1
            if self._forward_to:  # the relay renumbers it; a gap in ours becomes one in its
                with contextlib.suppress(zmq.Again):
                    self._socket.send_multipart(
                        [self._source, topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK
                    )
                continue
            # PUB drops when subscribers lag: routers resynchronise from later events.
            with contextlib.suppress(zmq.Again):
                self._socket.send_multipart(
                    [topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK
                )

    def serve_replay(self) -> int:
        """Answer the replay requests that arrived: each gets every block held now, as
        `BlockStored` batches numbered with its topic's current sequence number (live events
        after it continue from there), then `END_SEQ`. A request is ``[start seq]`` (ignored:
        the answer is the whole state, not a backlog) or ``[start seq, topic]`` to get one
        tenant's blocks. Returns how many requests were answered."""
        if self._replay is None:
            return 0
        answered = 0
        while True:
            try:
                frames = self._replay.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return answered
            if len(frames) < 3 or frames[1] != b"":
                continue  # not a REQ/DEALER request in vLLM's framing
            client, wanted = frames[0], frames[3] if len(frames) > 3 else b""
            self.flush()  # what happened before the snapshot goes out first
            with self._lock:
                blocks = _parents_first([b for b in self._published.values() if b.tiers
                                         and b.topic.startswith(wanted)])  # fmt: skip
                snapshot = [(b.topic, self._stored_event(b, tier), self._seq.get(b.topic, 0))
                            for b in blocks for tier in sorted(b.tiers, reverse=True)]  # fmt: skip
            for start in range(0, len(snapshot), _MAX_BATCH):
                part = snapshot[start : start + _MAX_BATCH]
                payload = msgpack.packb([time.time(), [e for _, e, _ in part], None],
                                        use_bin_type=True)  # fmt: skip
                with contextlib.suppress(zmq.Again):
                    self._replay.send_multipart(
                        [client, b"", part[-1][2].to_bytes(8, "big"), payload], zmq.NOBLOCK
                    )
            with contextlib.suppress(zmq.Again):
                self._replay.send_multipart([client, b"", END_SEQ, b""], zmq.NOBLOCK)
            answered += 1

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._config.flush_interval_s)
            self.flush()
            self.serve_replay()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.flush()
        # A worker's last batches still have to reach the relay.
        self._socket.close(linger=1000 if self._forward_to else 0)
        if self._replay is not None:
            self._replay.close(linger=0)


class EventRelay:
    """The supervisor's half of a multi-process daemon's events: workers PUSH their batches
    here; one PUB socket publishes them with per-topic sequence numbers, so a subscriber sees
    one gap-free sequence per tenant however many workers there are."""

    def __init__(self, config: EventsConfig, inbox: str) -> None:
        self._context: zmq.Context[Any] = zmq.Context.instance()
        self._pub: zmq.Socket[bytes] = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pull: zmq.Socket[bytes] = self._context.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pub.bind(config.endpoint)
        self._pull.bind(inbox)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._seq: dict[bytes, int] = {}
        self._last: dict[tuple[bytes, bytes], int] = {}  # (worker, topic) -> its last number
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvoffload-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(100):
                self._relay()

    def _relay(self) -> None:
        while True:
            try:
                parts = self._pull.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(parts) != 4:
                continue  # only our workers connect here
            source, topic, number, payload = parts
            theirs = int.from_bytes(number, "big")
            # A batch a worker dropped (its queue to the relay full) leaves a gap in the
            # node's numbers too, so subscribers know to resynchronise.
            lost = max(0, theirs - self._last.get((source, topic), 0) - 1)
            self._last[(source, topic)] = theirs
            seq = self._seq[topic] = self._seq.get(topic, 0) + 1 + lost
            with contextlib.suppress(zmq.Again):
                self._pub.send_multipart([topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)

    def close(self) -> None:
        """Call after the workers have stopped: what they sent last is published first."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._relay()
        self._pull.close(linger=0)
        self._pub.close(linger=0)
