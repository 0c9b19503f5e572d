"""What routers hear when a published block is put again under other metadata (found by review:
the old copies' removals were lost, leaving a router with phantom hits)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from kvoffload.client_sdk import BlockMeta
from kvoffload.nvmeof_target.config import EventsConfig
from kvoffload.nvmeof_target.events.publisher import KVEvents, event_hash


@pytest.fixture
def events() -> Iterator[KVEvents]:
    made = KVEvents(EventsConfig(enabled=True, endpoint="tcp://127.0.0.1:*"))
    yield made
    asyncio.run(made.close())


def _queued(events: KVEvents) -> list[dict[str, object]]:
    """The events waiting to be published (what a subscriber receives next), drained."""
    out = [event for _, event in events._pending]
    events._pending.clear()
    return out


def _stored_on_ssd(events: KVEvents, key: bytes, meta: BlockMeta | None) -> None:
    events.expect(key, key, None, "", meta)
    events.moved("stored", key, "dram")
    events.moved("stored", key, "ssd")
    events.settle(key)


def test_new_metadata_under_the_same_hash_keeps_the_copies_known(events: KVEvents) -> None:
    key = bytes(range(16))
    _stored_on_ssd(events, key, BlockMeta(token_ids=(1, 2, 3)))
    _queued(events)
    events.expect(key, key, None, "", BlockMeta(token_ids=(4, 5, 6)))  # same hash: the key's
    events.moved("removed", key, "ssd")  # the engine drops the old SSD copy
    removed = _queued(events)
    assert [e.get("block_hashes") for e in removed] == [[event_hash(key)]]


def test_a_new_hash_removes_the_old_names_copies(events: KVEvents) -> None:
    key = bytes(range(16))
    _stored_on_ssd(events, key, None)
    _queued(events)
    events.expect(key, key, None, "", BlockMeta(block_hash=12345))
    removed = _queued(events)
    assert sorted(e.get("medium") for e in removed) == ["CPU", "STORAGE"]
    assert all(e.get("block_hashes") == [event_hash(key)] for e in removed)


def test_backlog_counts_what_is_queued_and_since_when_until_a_flush(events: KVEvents) -> None:
    assert events.backlog() == (0, 0.0)
    sent: list[bytes] = []
    events._send = lambda topic, payload: sent.append(payload)  # type: ignore[method-assign]
    key = bytes(range(16))
    _stored_on_ssd(events, key, None)
    queued, lag = events.backlog()
    assert queued == 2 and lag >= 0.0
    assert events.backlog()[1] >= lag  # behind for as long as nothing is flushed
    events.flush()
    assert events.backlog() == (0, 0.0)
    assert len(sent) == 1 and events.sent_events == 2
