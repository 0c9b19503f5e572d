"""Which feed carries which tenant's events, and replay's exact topic match: a request for
``kv/alice`` never gets ``kv/alice2``'s blocks (a prefix match once gave them)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import msgpack
import pytest

from kvoffload.client_sdk import BlockMeta
from kvoffload.kvstore import DescribedBlock
from kvoffload.nvmeof_target.config import EventsConfig, TenantConfig, TenantEventsConfig
from kvoffload.nvmeof_target.events.feeds import Feeds
from kvoffload.nvmeof_target.events.publisher import KVEvents

CONFIG = EventsConfig(enabled=True, endpoint="tcp://127.0.0.1:*", topic="kv")
TENANTS = (
    TenantConfig("alice", "a"),
    TenantConfig("alice2", "b", events=TenantEventsConfig("tcp://127.0.0.1:*")),
    TenantConfig("bob", "c"),
)


@pytest.fixture
def events() -> Iterator[KVEvents]:
    made = KVEvents(CONFIG)
    yield made
    asyncio.run(made.close())


def _tokens(messages: list[tuple[bytes, bytes, bytes]]) -> dict[bytes, set[int]]:
    """The first token id of every block of a replay answer, per topic."""
    out: dict[bytes, set[int]] = {}
    for topic, _, payload in messages:
        out.setdefault(topic, set()).update(e["token_ids"][0] for e in msgpack.unpackb(payload)[1])
    return out


def test_replay_names_a_topic_exactly(events: KVEvents) -> None:
    # Announced blocks (rows of the bulk table) of three tenants ...
    listed = [
        DescribedBlock(bytes([i]) * 16, tenant, BlockMeta((i,), block_hash=i).encode(), ("dram",))
        for i, tenant in enumerate(["alice", "alice2", "alice", "", "alice2"])
    ]
    events.announce(listed)
    # ... and blocks put since (published one by one).
    for i, tenant in ((10, "alice"), (11, "alice2")):
        events.expect(bytes([i]) * 16, bytes([i]) * 16, None, tenant, BlockMeta((i,)))
        events.moved("stored", bytes([i]) * 16, "dram")
    assert _tokens(events.snapshot(b"kv/alice")) == {b"kv/alice": {0, 2, 10}}
    assert _tokens(events.snapshot(b"kv/alice2")) == {b"kv/alice2": {1, 4, 11}}
    assert _tokens(events.snapshot(b"kv")) == {b"kv": {3}}
    assert events.snapshot(b"kv/al") == [] and events.snapshot(b"kv/alice/") == []
    assert set(_tokens(events.snapshot())) == {b"kv", b"kv/alice", b"kv/alice2"}


def test_each_topic_goes_to_its_tenants_feed() -> None:
    feeds = Feeds(CONFIG, TENANTS)
    assert feeds.feed_of(b"kv/alice2").tenant == "alice2"
    for topic in (b"kv/alice", b"kv/bob", b"kv", b"kv/alice2/x", b"kv/alice22"):
        assert feeds.feed_of(topic).tenant == ""
    assert feeds.on_shared == ["alice", "bob"]
    # The shared feed's replay never answers with alice2's blocks, whatever it names.
    shared = feeds.replayed("", b"")
    assert shared(b"kv/alice") and shared(b"kv") and not shared(b"kv/alice2")
    assert not feeds.replayed("", b"kv/alice2")(b"kv/alice2")
    assert not feeds.replayed("", b"kv/alice")(b"kv/alice2")
    # alice2's feed answers with its own topic only.
    own = feeds.replayed("alice2", b"")
    assert own(b"kv/alice2") and not own(b"kv/alice") and not own(b"kv")
    assert not feeds.replayed("alice2", b"kv/alice")(b"kv/alice")
