"""Which endpoints carry which tenant's KV events, and their sockets.

A ZMQ PUB socket cannot tell its subscribers apart: whoever it admits may subscribe to any
topic, and ZMQ matches subscriptions by prefix (a subscriber of ``kv/alice`` also receives
``kv/alice2``). So a topic is no authorisation. A tenant with endpoints of its own
(`tenants.<name>.events`) gets a *feed*: a PUB socket that carries only its topic and a replay
socket that answers only its blocks, each admitting (with CURVE) only its routers' keys. The
other tenants, and an open store, share the `[events]` endpoints: the shared feed, which never
carries a tenant that has its own. A replay request names its topic exactly: ``kv/alice`` is
never answered with ``kv/alice2``'s blocks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from kvoffload.errors import ConfigError
from kvoffload.nvmeof_target.config import EventsConfig, TenantConfig
from kvoffload.nvmeof_target.events.curve import Curve

__all__ = ["Feed", "Feeds", "Sockets"]


@dataclass(frozen=True)
class Feed:
    """A PUB endpoint and its replay endpoint ("" = none); `tenant` "" is the shared feed."""

    tenant: str
    endpoint: str
    replay_endpoint: str


class Feeds:
    """The shared feed and the tenants' own, and which topic goes out on which."""

    def __init__(self, events: EventsConfig, tenants: Sequence[TenantConfig] = ()) -> None:
        self._topic = events.topic.encode()
        self.shared = Feed("", events.endpoint, events.replay_endpoint)
        own = [t for t in tenants if t.events.endpoint]
        self.by_tenant = {"": self.shared} | {
            t.name: Feed(t.name, t.events.endpoint, t.events.replay_endpoint) for t in own
        }
        self._by_topic = {self.topic_of(t.name): self.by_tenant[t.name] for t in own}
        # tenant -> its routers' public keys, for `Curve`
        self.curve_clients = {t.name: t.events.curve_clients for t in own if t.events.curve_clients}
        # Tenants published on the shared feed: every router it admits may hear all of them.
        self.on_shared = [t.name for t in tenants if not t.events.endpoint]

    def topic_of(self, tenant: str) -> bytes:
        """The configured topic, with ``/<tenant>`` appended for a configured tenant."""
        return self._topic + (b"/" + tenant.encode() if tenant else b"")

    def feed_of(self, topic: bytes) -> Feed:
        return self._by_topic.get(topic, self.shared)

    def replayed(self, tenant: str, wanted: bytes) -> Callable[[bytes], bool]:
        """The topics a replay request on `tenant`'s feed that names `wanted` (b"" = every
        topic of the feed) is answered with: exact matches only."""
        return lambda topic: (
            self.feed_of(topic).tenant == tenant and (not wanted or topic == wanted)
        )


class Sockets:
    """Every feed's PUB socket and replay ROUTER socket (`bind` binds them)."""

    def __init__(
        self, feeds: Feeds, context: zmq.Context[Any], hwm: int, curve: Curve | None
    ) -> None:
        self._feeds = feeds
        self.pubs: dict[str, zmq.Socket[bytes]] = {}
        self.replays: dict[str, zmq.Socket[bytes]] = {}
        for feed in feeds.by_tenant.values():
            self.pubs[feed.tenant] = self._socket(context, zmq.PUB, feed.tenant, curve)
            self.pubs[feed.tenant].setsockopt(zmq.SNDHWM, hwm)
            if feed.replay_endpoint:
                self.replays[feed.tenant] = self._socket(context, zmq.ROUTER, feed.tenant, curve)

    @staticmethod
    def _socket(
        context: zmq.Context[Any], kind: int, tenant: str, curve: Curve | None
    ) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.secure(sock, tenant)
        return sock

    def bind(self) -> None:
        """Raises:
        ConfigError: an endpoint cannot be bound (in use, malformed)."""
        for tenant, feed in self._feeds.by_tenant.items():
            bound = [(self.pubs[tenant], feed.endpoint)]
            if tenant in self.replays:
                bound.append((self.replays[tenant], feed.replay_endpoint))
            for sock, endpoint in bound:
                try:
                    sock.bind(endpoint)
                except zmq.ZMQError as exc:
                    owner = f"tenant {tenant}'s" if tenant else "the"
                    raise ConfigError(
                        f"events: cannot bind {owner} endpoint {endpoint}: {exc}"
                    ) from None

    def endpoint(self, tenant: str = "") -> str:
        return self.pubs[tenant].getsockopt_string(zmq.LAST_ENDPOINT)

    def replay_endpoint(self, tenant: str = "") -> str:
        sock = self.replays.get(tenant)
        return "" if sock is None else sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def say_endpoints(self, say: Callable[[str], None]) -> None:
        """Print the tenants' own bound endpoints (the shared ones are the caller's lines)."""
        for tenant in self.pubs:
            if tenant:
                say(f"events of tenant {tenant} publishing on {self.endpoint(tenant)}")
                if tenant in self.replays:
                    say(f"events of tenant {tenant} replay on {self.replay_endpoint(tenant)}")

    def publish(self, topic: bytes, seq: bytes, payload: bytes) -> None:
        """On the topic's feed; PUB drops when subscribers lag (routers resynchronise)."""
        sock = self.pubs[self._feeds.feed_of(topic).tenant]
        with contextlib.suppress(zmq.Again):
            sock.send_multipart([topic, seq, payload], flags=zmq.NOBLOCK)

    def requests(self) -> Iterator[tuple[str, bytes, bytes]]:
        """The replay requests that arrived, as (feed's tenant, client, wanted topic)."""
        for tenant, sock in self.replays.items():
            while True:
                try:
                    frames = sock.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) < 3 or frames[1] != b"":
                    continue  # not a REQ/DEALER request in vLLM's framing
                yield tenant, frames[0], frames[3] if len(frames) > 3 else b""

    def answer(self, tenant: str, client: bytes, seq: bytes, payload: bytes) -> None:
        with contextlib.suppress(zmq.Again):
            self.replays[tenant].send_multipart([client, b"", seq, payload], zmq.NOBLOCK)

    def close(self) -> None:
        for sock in [*self.pubs.values(), *self.replays.values()]:
            sock.close(linger=0)
