"""The bulk announce (events_bulk.py): what it publishes is what one event dict per block
would say, parents first, and blocks it listed follow the tier moves made meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest

from kvoffload.client_sdk import BlockMeta
from kvoffload.kvstore import DescribedBlock
from kvoffload.nvmeof_target.config import EventsConfig
from kvoffload.nvmeof_target.events.publisher import KVEvents

Sent = list[tuple[bytes, dict[str, object]]]


@pytest.fixture
def events() -> Iterator[KVEvents]:
    made = KVEvents(EventsConfig(enabled=True, endpoint="tcp://127.0.0.1:*", topic="kv"))
    yield made
    asyncio.run(made.close())


def _published(events: KVEvents) -> Sent:
    """Flush everything queued; the events as a subscriber decodes them, with their topics."""
    sent: list[tuple[bytes, bytes]] = []
    events._send = lambda topic, payload: sent.append((topic, payload))  # type: ignore[method-assign]
    events.flush()
    return [(t, e) for t, p in sent for e in msgpack.unpackb(p)[1]]


def _store(count: int, seed: int = 3) -> list[tuple[DescribedBlock, BlockMeta]]:
    rng = np.random.default_rng(seed)
    out: list[tuple[DescribedBlock, BlockMeta]] = []
    for i in range(count):
        tokens = tuple(int(t) for t in rng.integers(0, 2**32, int(rng.integers(0, 40))))
        meta = BlockMeta(
            tokens,
            block_hash=int(rng.integers(0, 2**62)) * 4 + 3,
            parent_hash=out[-1][1].block_hash if out and i % 7 else None,
            lora_name=f"lora-{i}" if i % 11 == 0 else "x" * 60 if i % 13 == 0 else None,
            cache_salt="salt" if i % 17 == 0 else None,
            block_size=0 if i % 3 else 16,
        )
        tiers = (("ssd",), ("dram",), ("ssd", "dram"))[i % 3]
        out.append((DescribedBlock(rng.bytes(16), ("", "t1")[i % 2], meta.encode(), tiers), meta))
    # Newest first, as an index may list them: children come before their parents.
    return out[::-1]


def _expected(store: list[tuple[DescribedBlock, BlockMeta]]) -> dict[tuple[object, ...], object]:
    out: dict[tuple[object, ...], object] = {}
    for block, meta in store:
        topic = b"kv" + (b"/" + block.tenant.encode() if block.tenant else b"")
        for tier in block.tiers:
            medium = {"ssd": "STORAGE", "dram": "CPU"}[tier]
            out[(topic, meta.block_hash, medium)] = {
                "type": "BlockStored",
                "block_hashes": [meta.block_hash],
                "parent_block_hash": meta.parent_hash,
                "token_ids": list(meta.token_ids),
                "block_size": meta.tokens_per_block,
                "lora_id": None,
                "medium": medium,
                "lora_name": meta.lora_name,
                "locality": "LOCAL",
            }
    return out


def _check(sent: Sent, store: list[tuple[DescribedBlock, BlockMeta]]) -> None:
    expected = _expected(store)
    got = {(t, e["block_hashes"][0], e["medium"]): e for t, e in sent}  # type: ignore[index]
    assert len(got) == len(sent) == len(expected)
    assert got == expected
    first: dict[tuple[bytes, object], int] = {}
    for i, (topic, event) in enumerate(sent):
        first.setdefault((topic, event["block_hashes"][0]), i)  # type: ignore[index]
    for (topic, digest), at in first.items():
        parent = expected[(topic, digest, "STORAGE")] if (topic, digest, "STORAGE") in expected \
            else expected[(topic, digest, "CPU")]  # fmt: skip
        up = parent["parent_block_hash"]  # type: ignore[index]
        if (topic, up) in first:
            assert first[(topic, up)] < at  # a router files a block under a known parent


def test_the_bulk_announce_says_what_one_event_per_block_would(events: KVEvents) -> None:
    store = _store(3000)
    malformed = DescribedBlock(b"m" * 16, "", b"\x01\x00garbage", ("ssd",))
    unnamed = DescribedBlock(b"n" * 16, "", BlockMeta((1, 2)).encode(), ("ssd",))
    assert events.announce([b for b, _ in store] + [malformed, unnamed]) == len(store)
    sent = _published(events)
    _check(sent, store)
    # A replay answers with the same blocks (its own snapshot of the announced rows).
    replayed = [e for _, _, p in events.snapshot() for e in msgpack.unpackb(p)[1]]
    assert sorted(map(repr, replayed)) == sorted(map(repr, (e for _, e in sent)))
    assert len(events.snapshot(b"kv/t1")) < len(events.snapshot())


def test_announced_blocks_follow_later_moves_and_deletes(events: KVEvents) -> None:
    store = _store(50)
    events.announce([b for b, _ in store])
    _published(events)
    on_ssd = next(b for b, _ in store if b.tiers == ("ssd",))
    both = next(b for b, _ in store if b.tiers == ("ssd", "dram"))
    events.moved("removed", on_ssd.key, "ssd")
    events.removed(both.key)
    removed = _published(events)
    assert sorted(str(e["medium"]) for _, e in removed) == ["CPU", "STORAGE", "STORAGE"]
    assert all(e["type"] == "BlockRemoved" for _, e in removed)
    replayed = [e for _, _, p in events.snapshot() for e in msgpack.unpackb(p)[1]]
    assert len(replayed) == len(_expected(store)) - 3


def test_moves_while_the_store_is_listed_are_not_lost(events: KVEvents) -> None:
    store = _store(20)
    on_ssd = next(b for b, _ in store if b.tiers == ("ssd",))
    in_dram = next(b for b, _ in store if b.tiers == ("dram",))

    def listing() -> list[DescribedBlock]:
        # The engine evicts and demotes while the announce lists it; the listing is older.
        events.moved("removed", on_ssd.key, "ssd")
        events.moved("stored", in_dram.key, "ssd")
        return [b for b, _ in store]

    events.announce_later(listing)
    assert events._announcer is not None
    events._announcer.join(30)
    sent = _published(events)
    mine = {(e["block_hashes"][0], e["medium"]) for _, e in sent}  # type: ignore[index]
    meta = {b.key: m for b, m in store}
    assert (meta[on_ssd.key].block_hash, "STORAGE") not in mine
    assert (meta[in_dram.key].block_hash, "STORAGE") in mine
    assert len(sent) == len(_expected(store))  # one dropped, one added


def test_a_put_during_the_announce_keeps_its_own_events(events: KVEvents) -> None:
    store = _store(10)
    block, _ = store[0]
    events.expect(block.key, block.key, None, "", BlockMeta((9,), block_hash=77))
    events.moved("stored", block.key, "dram")
    events.settle(block.key)
    assert events.announce([b for b, _ in store]) == len(store) - 1
    hashes = [e["block_hashes"] for _, e in _published(events)]
    assert hashes[0] == [77] and hashes.count([77]) == 1
