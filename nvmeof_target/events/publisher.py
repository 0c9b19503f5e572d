"""KV events for KV-aware routers, in vLLM's format (ref/integrations.md §6).

Each message is a ZMQ PUB multipart ``(topic, seq as 8 bytes big-endian, msgpack EventBatch)``;
the batch is ``[ts, [event, ...], None]`` with events as vLLM 0.33.0 tagged maps
(``{"type": "BlockStored", ...}``). A block becoming readable in a tier is a `BlockStored`, leaving
it a `BlockRemoved`, with ``medium="CPU"`` for DRAM and ``"STORAGE"`` for the SSD: a demotion is
a Removed(CPU) + Stored(STORAGE) pair, a promotion a Stored(CPU). Hashes are 64-bit ints, the low
64 bits of the client's 16-byte block key read big-endian, as vLLM does with its digests.
Tenants use the same client keys, so each configured tenant's events go out on its own topic,
``<topic>/<tenant>``, with its own sequence numbers (a subscription to ``<topic>`` gets all), on
the tenant's own endpoints when it has them, else on the shared ones (feeds.py).

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
an unknown medium as GPU). docs/reference/events.md has the table.

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
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt
import zmq

from kvoffload.kvstore import DescribedBlock, DescribedTable
from kvoffload.nvmeof_target.config import EventsConfig
from kvoffload.nvmeof_target.events import bulk
from kvoffload.nvmeof_target.events.curve import Curve
from kvoffload.nvmeof_target.events.feeds import Feeds, Sockets
from kvoffload.wire.blockmeta import BlockMeta

__all__ = ["END_SEQ", "KVEvents", "event_hash", "stored_meta", "warn_shared"]

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
MEDIUM_DRAM = "CPU"
MEDIA = {"dram": MEDIUM_DRAM, "ssd": "STORAGE"}
# Events per message at most; a burst of evictions is split over several messages.
_MAX_BATCH = 4096
# Announce messages one flush sends at most: a restart's millions of blocks go out at a bounded
# rate, and the loop keeps serving between flushes.
_ANNOUNCE_PER_FLUSH = 2
_TIER_BITS = {("ssd",): bulk.SSD, ("dram",): bulk.DRAM, ("ssd", "dram"): bulk.SSD | bulk.DRAM,
              ("dram", "ssd"): bulk.SSD | bulk.DRAM}  # fmt: skip
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


def warn_shared(feeds: Feeds, endpoint: str) -> None:
    """Log which tenants share the shared feed: each router it admits hears all of them."""
    if feeds.on_shared:
        log.warning(
            "events: tenant(s) %s have no events endpoint of their own "
            "(tenants.<name>.events.endpoint): their events go out on %s, where every router "
            "it admits may subscribe to all of them",
            ", ".join(feeds.on_shared),
            endpoint,
        )


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


class _Chunks:
    """An announce's messages in the queue: (topic, events, packed events) each, appended by
    the thread that encodes them; `done` once all are."""

    def __init__(self) -> None:
        self.messages: list[tuple[bytes, int, bytes]] = []
        self.sent = 0
        self.done = False


_EMPTY = bulk.decode([])


def _events_of(
    tiers: npt.NDArray[np.uint8], order: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """(block, medium code) of each `BlockStored` of blocks in `order`: SSD before DRAM."""
    has = np.stack([(tiers[order] & bulk.SSD) != 0, (tiers[order] & bulk.DRAM) != 0], axis=1)
    flat = has.ravel()
    return np.repeat(order, 2)[flat], np.tile(np.arange(2), len(order))[flat]


def message_bounds(topic: npt.NDArray[np.int64]) -> list[tuple[int, int]]:
    """Runs of events on one topic, at most `_MAX_BATCH` each."""
    cuts = [0, *(np.flatnonzero(np.diff(topic)) + 1).tolist(), len(topic)]
    return [(s, min(s + _MAX_BATCH, e)) for a, e in zip(cuts, cuts[1:], strict=False)
            for s in range(a, e, _MAX_BATCH)]  # fmt: skip


class KVEvents:
    """Follows the blocks a daemon holds and publishes their `BlockStored`/`BlockRemoved`:
    batches events and publishes them on a ZMQ PUB socket (or a worker's channel to the
    supervisor's relay); answers replay requests."""

    def __init__(
        self,
        config: EventsConfig,
        forward_to: str = "",
        source: int = 0,
        feeds: Feeds | None = None,
    ) -> None:
        """`forward_to`: worker `source` of a multi-process daemon sends its batches to the
        supervisor's `EventRelay` there (which numbers and publishes them) instead of binding.
        `feeds`: the tenants' own endpoints (default: none, every topic on `config`'s)."""
        self._config = config
        self._forward_to = forward_to
        self._source = source.to_bytes(2, "big")
        self._feeds = feeds if feeds is not None else Feeds(config)
        # A worker's channel to the relay is a private ipc socket: CURVE is the relay's.
        self._curve = (
            Curve(config, self._feeds.curve_clients)
            if config.curve_secret_key_file and not forward_to
            else None
        )
        self._context: zmq.Context[Any] = (
            self._curve.context if self._curve is not None else zmq.Context.instance()
        )
        self._push: zmq.Socket[bytes] | None = None
        self._sockets: Sockets | None = None
        if forward_to:
            self._push = self._context.socket(zmq.PUSH)
            self._push.setsockopt(zmq.SNDHWM, config.hwm)
            self._push.setsockopt(zmq.LINGER, 0)
        else:  # bound by `start`; what is sent before goes nowhere, as on any PUB socket
            self._sockets = Sockets(self._feeds, self._context, config.hwm, self._curve)
        # (topic, event), or an announce's messages (`_Chunks`) in their place in the order.
        self._pending: collections.deque[tuple[bytes, dict[str, object] | _Chunks]] = (
            collections.deque()
        )
        self._lock = threading.Lock()
        self._seq: dict[bytes, int] = {}  # per topic: a subscriber of one sees no gaps
        # When the queue was last seen empty: the feed has been behind the engine since then
        # (the `kvoffload_events_lag_seconds` gauge), and events sent so far.
        self._drained_at = time.monotonic()
        self.sent_events = 0
        self._task: asyncio.Task[None] | None = None
        self.endpoint = ""
        self.replay_endpoint = ""
        self._announcer: threading.Thread | None = None
        self._closing = False
        # Engine key -> the block, for blocks published or announced, so that tier moves
        # (reported by engine key) name the block.
        self._published: dict[bytes, _Block] = {}
        # Blocks announced at start and untouched since, as arrays (events_bulk.py).
        self._table: bulk.Announced | None = None
        # While an announce lists the store: moves of blocks it may list, applied to its rows.
        self._recording: list[tuple[str, bytes, str]] | None = None

    def start(self) -> str:
        """Bind the sockets and start publishing; returns the shared feed's bound endpoint.

        Raises:
            ConfigError: an endpoint cannot be bound.
        """
        if self._push is not None:
            self._push.connect(self._forward_to)
            self.endpoint = self._forward_to
        elif self._sockets is not None:
            self._sockets.bind()
            self.endpoint = self._sockets.endpoint()
            self.replay_endpoint = self._sockets.replay_endpoint()
            warn_shared(self._feeds, self.endpoint)
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self.endpoint

    def print_tenants(self, say: Callable[[str], None]) -> None:
        """Say where the tenants' own feeds are bound."""
        if self._sockets is not None:
            self._sockets.say_endpoints(say)

    def _send(self, topic: bytes, payload: bytes) -> None:
        seq = self._seq[topic] = self._seq.get(topic, 0) + 1
        if self._push is not None:  # the relay renumbers it; a gap in ours becomes one in its
            with contextlib.suppress(zmq.Again):
                self._push.send_multipart(
                    [self._source, topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK
                )
        elif self._sockets is not None:
            self._sockets.publish(topic, seq.to_bytes(8, "big"), payload)

    def flush(self, announce_limit: int | None = None) -> None:
        """Publish the queued events; at most `announce_limit` messages of an announce (the
        events queued after it wait for it)."""
        sent = 0
        while self._pending:
            topic, head = self._pending[0]
            if isinstance(head, _Chunks):
                while head.sent < len(head.messages) and (
                    announce_limit is None or sent < announce_limit
                ):
                    topic, count, packed = head.messages[head.sent]
                    head.sent += 1
                    sent += 1
                    self._send(topic, bulk.payload(time.time(), count, packed))
                    self.sent_events += count
                if not head.done or head.sent < len(head.messages):
                    return
                self._pending.popleft()
                continue
            # One message per run of events on the same topic, in order.
            events: list[dict[str, object]] = []
            while self._pending and len(events) < _MAX_BATCH:
                next_topic, event = self._pending[0]
                if next_topic != topic or isinstance(event, _Chunks):
                    break
                events.append(event)
                self._pending.popleft()
            self._send(topic, msgpack.packb([time.time(), events, None], use_bin_type=True))
            self.sent_events += len(events)
        self._drained_at = time.monotonic()

    def backlog(self) -> tuple[int, float]:
        """Entries queued for the feed (an announce's block list counts as one), and the
        seconds since the queue was last empty (0 when it is): how far the feed is behind."""
        queued = len(self._pending)
        return queued, (time.monotonic() - self._drained_at) if queued else 0.0

    def serve_replay(self) -> int:
        """Answer the replay requests that arrived: each gets every block of its feed held
        now, as `BlockStored` batches numbered with its topic's current sequence number (live
        events after it continue from there), then `END_SEQ`. A request is ``[start seq]``
        (ignored: the answer is the whole state, not a backlog) or ``[start seq, topic]`` to
        get one topic's blocks (that topic exactly). Returns how many requests were answered."""
        if self._sockets is None:
            return 0
        answered = 0
        for tenant, client, wanted in self._sockets.requests():
            self.flush()  # what happened before the snapshot goes out first
            for _, seq, payload in self.snapshot(self._feeds.replayed(tenant, wanted)):
                self._sockets.answer(tenant, client, seq, payload)
            self._sockets.answer(tenant, client, END_SEQ, b"")
            answered += 1
        return answered

    def push_snapshot(self, number: int, tenant: str, wanted: bytes) -> None:
        """A worker's part of the node's replay request `number` on `tenant`'s feed (on the
        loop): its queued events, then its blocks, then an end mark, all through the channel
        to the relay, so the relay numbers the events before the blocks they led to."""
        assert self._push is not None
        self.flush()
        tag = number.to_bytes(8, "big")
        for topic, _, payload in self.snapshot(self._feeds.replayed(tenant, wanted)):
            with contextlib.suppress(zmq.Again):
                self._push.send_multipart([self._source, b"R", tag, topic, payload], zmq.NOBLOCK)
        with contextlib.suppress(zmq.Again):
            self._push.send_multipart([self._source, b"E", tag], zmq.NOBLOCK)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._config.flush_interval_s)
            self.flush(_ANNOUNCE_PER_FLUSH)
            self.serve_replay()

    async def close(self) -> None:
        self._closing = True
        if self._announcer is not None:  # it stops at its next message
            await asyncio.get_running_loop().run_in_executor(None, self._announcer.join, 10)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.flush()
        # A worker's last batches still have to reach the relay.
        if self._push is not None:
            self._push.close(linger=1000)
        if self._sockets is not None:
            self._sockets.close()
        if self._curve is not None:
            self._curve.close()

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
        return self._feeds.topic_of(tenant)

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
            old = block = self._published.get(engine_key) or self._adopt(engine_key)
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

    def _adopt(self, engine_key: bytes) -> _Block | None:
        """The announced row of `engine_key` as a `_Block` in `_published` (lock held)."""
        table = self._table
        row = None if table is None else table.row_of.pop(engine_key, None)
        if table is None or row is None or not table.tiers[row]:
            return None
        bits, dec = int(table.tiers[row]), table.dec
        table.tiers[row] = 0
        block = _Block(int(dec.digest[row]), int(dec.parent[row]) if dec.has_parent[row] else None,
                       table.topics[int(table.topic[row])],
                       {t for t, b in (("ssd", bulk.SSD), ("dram", bulk.DRAM)) if bits & b},
                       meta=dec.meta(row))  # fmt: skip
        self._published[engine_key] = block
        return block

    def announce(self, blocks: DescribedTable | list[DescribedBlock]) -> int:
        """Publish what a (restarted) store holds, as the engine's indexes describe it: one
        `BlockStored` per block and tier, SSD first, parents first. Returns how many blocks
        are announced (blocks whose metadata names no hash, stored without events, are not).
        The events are queued now and go out at a bounded rate (`_ANNOUNCE_PER_FLUSH`)."""
        with self._lock:
            if self._recording is None:
                self._recording = []
        return self._announce(blocks)

    def announce_later(self, fetch: Callable[[], DescribedTable]) -> None:
        """`announce(fetch())` on a thread: the daemon serves meanwhile. Tier moves and deletes
        that happen while `fetch` lists the store are applied to what it listed."""
        with self._lock:
            self._recording = []

        def work() -> None:
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                count = self._announce(fetch())
            except Exception:  # a failed announce must not stop the events that follow it
                log.exception("announcing the stored blocks failed")
                with self._lock:
                    self._recording = None
                return
            log.info("announced %d stored blocks: %.2f s, %.2f CPU-s", count,
                     time.perf_counter() - wall, time.thread_time() - cpu)  # fmt: skip

        self._announcer = threading.Thread(target=work, name="kvoffload-announce", daemon=True)
        self._announcer.start()

    def _announce(self, blocks: DescribedTable | list[DescribedBlock]) -> int:
        table_in = blocks if isinstance(blocks, DescribedTable) else DescribedTable.of(blocks)
        dec = bulk.decode_joined(table_in.meta, table_in.starts, table_in.lengths)
        topic, keys, names = table_in.tenant, table_in.keys, table_in.tenants
        tiers = table_in.tiers.copy()  # the kvstore's tier bits are events_bulk's SSD and DRAM
        ok = np.flatnonzero(dec.ok)
        order = ok[bulk.event_order(dec.digest[ok], dec.parent[ok], dec.has_parent[ok], topic[ok])]
        row_of = dict(zip([keys[i] for i in ok.tolist()], ok.tolist(), strict=True))
        job = _Chunks()
        with self._lock:
            if self._table is not None:  # an earlier announce's rows become blocks
                for key in list(self._table.row_of):
                    self._adopt(key)
            for key in self._published:  # a put since the start published it
                row = row_of.pop(key, None)
                if row is not None:
                    tiers[row] = 0
            tiers[~dec.ok] = 0
            table = bulk.Announced(keys, dec, topic, [self.topic_of(t) for t in names], tiers,
                                   row_of)  # fmt: skip
            for kind, key, tier in self._recording or ():
                row = row_of.get(key)
                if row is not None:
                    bit = bulk.SSD if tier == "ssd" else bulk.DRAM
                    keep = 0 if kind == "gone" else (3 ^ bit) if kind == "removed" else 3
                    tiers[row] = (tiers[row] & keep) | (bit if kind == "stored" else 0)
            self._recording = None
            self._table = table
            snapshot = tiers.copy()  # later moves are queued after these events
            self._pending.append((b"", job))
        try:
            order = order[snapshot[order] != 0]
            rows, media = _events_of(snapshot, order)
            for s, e in message_bounds(topic[rows]):
                if self._closing:
                    break
                job.messages.append((table.topics[int(topic[rows[s]])], e - s,
                                     bulk.encode_events(dec, rows[s:e], media[s:e])))  # fmt: skip
        finally:
            job.done = True
        return len(order)

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
            block = self._published.get(engine_key) or self._adopt(engine_key)
            if block is None:
                if self._recording is not None:
                    self._recording.append((kind, engine_key, tier))
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
            if self._adopt(engine_key) is None and self._recording is not None:
                self._recording.append(("gone", engine_key, ""))
            block = self._published.pop(engine_key, None)
        if block is None:
            return
        for tier in sorted(block.tiers):
            self._pending.append((block.topic, _removed_event(block.digest, tier)))

    def snapshot(
        self, wanted: bytes | Callable[[bytes], bool] = b""
    ) -> list[tuple[bytes, bytes, bytes]]:
        """Every block held now on the topic `wanted` (b"" = every topic; or the topics a
        predicate accepts), as replay messages ``(topic, its seq now, EventBatch)``:
        `BlockStored` events, parents first. Topics match exactly, never by prefix."""
        keep = wanted if callable(wanted) else (lambda t: not wanted or t == wanted)
        with self._lock:
            blocks = [b for b in self._published.values() if b.tiers and keep(b.topic)]
            table = self._table
            dec, topics, rows = _EMPTY, [], np.zeros(0, np.int64)
            if table is not None:
                dec, topics = table.dec, table.topics
                mine = np.asarray([keep(t) for t in topics] + [False], bool)
                rows = np.flatnonzero((table.tiers != 0) & mine[table.topic])
                table_tiers = table.tiers[rows]
            seqs = dict(self._seq)
        nt = len(rows)
        ids = {t: i for i, t in enumerate(topics)}
        topic = np.concatenate([table.topic[rows] if table is not None else rows,
                                np.fromiter((ids.setdefault(b.topic, len(ids)) for b in blocks),
                                            np.int64, len(blocks))])  # fmt: skip
        topics = list(ids)
        tiers = np.concatenate([table_tiers if table is not None else np.zeros(0, np.uint8),
                                np.fromiter((_TIER_BITS.get(tuple(sorted(b.tiers, reverse=True)), 0)
                                             for b in blocks), np.uint8, len(blocks))])  # fmt: skip
        digest = np.concatenate([dec.digest[rows], np.fromiter(
            (b.digest for b in blocks), np.uint64, len(blocks))])  # fmt: skip
        parent = np.concatenate([dec.parent[rows], np.fromiter(
            (b.parent or 0 for b in blocks), np.uint64, len(blocks))])  # fmt: skip
        has_parent = np.concatenate([dec.has_parent[rows], np.fromiter(
            (b.parent is not None for b in blocks), bool, len(blocks))])  # fmt: skip
        which, media = _events_of(tiers, bulk.event_order(digest, parent, has_parent, topic))
        out: list[tuple[bytes, bytes, bytes]] = []
        for s, e in message_bounds(topic[which]):
            part, kinds = which[s:e], media[s:e]
            extras = [
                msgpack.packb(self._stored_event(blocks[i - nt], ("ssd", "dram")[m]))
                for i, m in zip(part.tolist(), kinds.tolist(), strict=True)
                if i >= nt
            ]
            mine_topic = topics[int(topic[part[0]])]
            in_table = rows[np.minimum(part, nt - 1)] if nt else -1
            packed = bulk.encode_events(dec, np.where(part < nt, in_table, -1), kinds, extras)
            out.append((mine_topic, seqs.get(mine_topic, 0).to_bytes(8, "big"),
                        bulk.payload(time.time(), e - s, packed)))  # fmt: skip
        return out
