"""The supervisor's half of a multi-process daemon's KV events (`kvoffload serve --workers N`).

Workers PUSH their event batches to the relay; one PUB socket publishes them with per-topic
sequence numbers, so a subscriber sees one gap-free sequence per tenant however many workers
there are.

Replay: a router's request on the node's replay endpoint is passed to every worker (the
supervisor asks over each worker's control pipe); each answers through its PUSH channel with
its queued events, then its blocks (`KVEvents.push_snapshot`), then an end mark. The relay
numbers the events as they come, so the blocks of a worker reflect every event numbered before
them. The answer carries, per topic, the number the topic had when the first worker's part
came: a router applies the live events after it, which re-applies some that a later worker's
blocks already reflect (a block is only ever one worker's, and re-applying the events that
led to a state ends in that state). Blocks are ordered parents first across workers (a
child's parent is often another shard's) before they are sent.

Each tenant with endpoints of its own (feeds.py) has its PUB and replay socket here too: the
relay publishes a batch on its topic's feed and answers a replay request with the blocks of the
feed it came in on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import zmq

from kvoffload.nvmeof_target.config import EventsConfig
from kvoffload.nvmeof_target.events.bulk import event_order
from kvoffload.nvmeof_target.events.curve import Curve
from kvoffload.nvmeof_target.events.feeds import Feeds, Sockets
from kvoffload.nvmeof_target.events.publisher import END_SEQ, message_bounds, warn_shared

__all__ = ["EventRelay"]

# A replay request whose workers have not all answered by then is ended with what came (a
# worker's answer lost to a full queue must not leave the router waiting forever).
_REPLAY_TIMEOUT_S = 60.0


@dataclass
class _Request:
    tenant: str  # the feed it came in on
    wanted: bytes
    client: bytes
    waiting: int  # workers that have not sent their end mark
    started: float
    numbers: dict[bytes, int] | None = None  # per topic, when the first part came
    parts: list[tuple[bytes, bytes]] = field(default_factory=list)  # (topic, EventBatch)


class EventRelay:
    """Publishes the workers' batches with node-wide numbers; answers replay requests."""

    def __init__(
        self, config: EventsConfig, inbox: str, workers: int = 1, feeds: Feeds | None = None
    ) -> None:
        """Raises:
        ConfigError: CURVE configured but unavailable, its key files bad, or an endpoint
        that cannot be bound."""
        self._feeds = feeds if feeds is not None else Feeds(config)
        self._curve = (
            Curve(config, self._feeds.curve_clients) if config.curve_secret_key_file else None
        )
        self._context: zmq.Context[Any] = (
            self._curve.context if self._curve is not None else zmq.Context.instance()
        )
        self._sockets = Sockets(self._feeds, self._context, config.hwm, self._curve)
        try:
            self._sockets.bind()
        except BaseException:
            self._sockets.close()
            if self._curve is not None:  # its ZAP thread
                self._curve.close()
            raise
        self._pull: zmq.Socket[bytes] = self._context.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(inbox)
        self.endpoint = self._sockets.endpoint()
        self.replay_endpoint = self._sockets.replay_endpoint()
        warn_shared(self._feeds, self.endpoint)
        self._workers = workers
        # Set by the supervisor once the workers run: sends request (number, feed's tenant,
        # wanted topic) to every worker. Requests before that are answered empty.
        self.ask: Callable[[int, str, bytes], None] | None = None
        self._requests: dict[int, _Request] = {}
        self._asked = 0
        self._seq: dict[bytes, int] = {}
        self._last: dict[tuple[bytes, bytes], int] = {}  # (worker, topic) -> its last number
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvoffload-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        for sock in self._sockets.replays.values():
            poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(100))
            if self._pull in ready:
                self._relay()
            if len(ready) > (self._pull in ready):
                self._accept()
            self._expire()

    def print_tenants(self, say: Callable[[str], None]) -> None:
        """Say where the tenants' own feeds are bound."""
        self._sockets.say_endpoints(say)

    def _relay(self) -> None:
        while True:
            try:
                parts = self._pull.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(parts) == 4:
                self._publish(*parts)
            elif len(parts) == 5 and parts[1] == b"R":
                self._part(int.from_bytes(parts[2], "big"), parts[3], parts[4])
            elif len(parts) == 3 and parts[1] == b"E":
                self._part(int.from_bytes(parts[2], "big"), None, b"")

    def _publish(self, source: bytes, topic: bytes, number: bytes, payload: bytes) -> None:
        theirs = int.from_bytes(number, "big")
        # A batch a worker dropped (its queue to the relay full) leaves a gap in the node's
        # numbers too, so subscribers know to resynchronise.
        lost = max(0, theirs - self._last.get((source, topic), 0) - 1)
        self._last[(source, topic)] = theirs
        seq = self._seq[topic] = self._seq.get(topic, 0) + 1 + lost
        self._sockets.publish(topic, seq.to_bytes(8, "big"), payload)

    def _accept(self) -> None:
        for tenant, client, wanted in self._sockets.requests():
            if self.ask is None:
                self._sockets.answer(tenant, client, END_SEQ, b"")
                continue
            self._asked += 1
            self._requests[self._asked] = _Request(
                tenant, wanted, client, self._workers, time.monotonic()
            )
            self.ask(self._asked, tenant, wanted)

    def _part(self, number: int, topic: bytes | None, payload: bytes) -> None:
        request = self._requests.get(number)
        if request is None:
            return  # expired
        if request.numbers is None:
            request.numbers = dict(self._seq)
        if topic is not None:
            request.parts.append((topic, payload))
            return
        request.waiting -= 1
        if not request.waiting:
            del self._requests[number]
            self._answer(request)

    def _expire(self) -> None:
        now = time.monotonic()
        for number, request in list(self._requests.items()):
            if now - request.started > _REPLAY_TIMEOUT_S:
                del self._requests[number]
                self._answer(request)

    def _answer(self, request: _Request) -> None:
        """Every worker's blocks, parents first across workers, then the end mark."""
        topics: dict[bytes, int] = {}
        events: list[dict[str, Any]] = []
        topic_ids: list[int] = []
        # The workers filtered already; the relay checks again what leaves on this feed.
        keep = self._feeds.replayed(request.tenant, request.wanted)
        for topic, payload in request.parts:
            if not keep(topic):
                continue
            batch = msgpack.unpackb(payload)[1]
            events += batch
            topic_ids += [topics.setdefault(topic, len(topics))] * len(batch)
        digest = np.fromiter((e["block_hashes"][0] for e in events), np.uint64, len(events))
        parents = [e["parent_block_hash"] for e in events]
        order = event_order(
            digest,
            np.fromiter((p or 0 for p in parents), np.uint64, len(events)),
            np.fromiter((p is not None for p in parents), bool, len(events)),
            np.asarray(topic_ids, np.int64),
        )
        names = list(topics)
        numbers = request.numbers or {}
        ordered_topics = np.asarray(topic_ids, np.int64)[order]
        for start, end in message_bounds(ordered_topics):
            topic = names[int(ordered_topics[start])]
            batch = [events[i] for i in order[start:end].tolist()]
            payload = msgpack.packb([time.time(), batch, None])
            self._sockets.answer(
                request.tenant, request.client, numbers.get(topic, 0).to_bytes(8, "big"), payload
            )
        self._sockets.answer(request.tenant, request.client, END_SEQ, b"")

    def close(self) -> None:
        """Call after the workers have stopped: what they sent last is published first."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._relay()
        self._pull.close(linger=0)
        self._sockets.close()
        if self._curve is not None:
            self._curve.close()
