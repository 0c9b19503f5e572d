"""The C DramIndex (kvoffload.core._core) against the Python reference (kvstore.dram): the same
random operation sequences through both, every answer, raised error and piece of state compared.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload import core
from kvoffload.kvstore.arena import AlignedBuffer
from kvoffload.kvstore.config import DramConfig
from kvoffload.kvstore.dram import DramEntry, DramIndex, DramTier, new_index

pytestmark = pytest.mark.skipif(
    "c" not in core.available(), reason="the C core is not built (KVOFFLOAD_PURE_PYTHON run)"
)

KEYS = [bytes([i]) * 16 for i in range(6)]


@dataclass
class World:
    """One index and the entries made for it, entries numbered in the order they were made."""

    index: DramIndex
    entries: list[DramEntry]

    def number(self, answer: object) -> object:
        """An answer with entries replaced by their numbers (the two worlds' entries differ)."""
        if isinstance(answer, DramEntry):
            return ("entry", next(i for i, e in enumerate(self.entries) if e is answer))
        if isinstance(answer, list):
            return [self.number(a) for a in answer]
        return answer

    def state(self) -> object:
        return (
            [(e.pins, e.live, e.tick) for e in self.entries],
            sorted(self.index.pinned),
            self.index.tick,
            len(self.index),
            sorted(str(self.number(e)) for e in self.index.values()),
            [k in self.index for k in KEYS],
        )


def _run(world: World, op: tuple[str, int, int]) -> object:
    name, a, b = op
    index, entries = world.index, world.entries
    try:
        if name == "make":
            staging = AlignedBuffer(4096) if b == 1 else None
            entries.append(DramEntry(KEYS[a], a * 4096, 100, 4096, None, index.next_tick(),
                                     pins=b % 2, staging=staging))  # fmt: skip
            return None
        if name in ("lookup", "remove"):
            return world.number(getattr(index, name)(KEYS[a]))
        if name in ("drain_touches", "retire", "next_tick"):
            return world.number(getattr(index, name)())
        if name == "set_tick":
            index.tick = a * 7
            return None
        if not entries:
            return "no entry"
        entry = entries[a % len(entries)]
        return world.number(getattr(index, name)(entry))  # pin, unpin, insert
    except Exception as exc:  # both must raise the same
        return (type(exc).__name__, str(exc))


OPS = st.tuples(
    st.sampled_from(
        ["make", "lookup", "remove", "pin", "pin", "unpin", "insert", "insert", "drain_touches"]
        + ["next_tick", "set_tick", "retire"]
    ),
    st.integers(0, len(KEYS) - 1),
    st.integers(0, 2),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(OPS, max_size=80))
def test_the_c_index_answers_as_the_python_one(ops: list[tuple[str, int, int]]) -> None:
    index_type = core.dram_index_type() or core._EXT.DramIndex  # type: ignore[union-attr]
    python, c = World(DramIndex(), []), World(index_type(), [])
    for op in ops:
        assert _run(c, op) == _run(python, op), op
        assert c.state() == python.state(), op


def test_new_index_follows_the_switch() -> None:
    previous = core.use("python")
    try:
        assert type(new_index()) is DramIndex
        core.use("c")
        assert type(new_index()).__module__ == "kvoffload.core._core"
    finally:
        core.use(previous)
    if os.environ.get("KVOFFLOAD_PURE_PYTHON") != "1":
        tier = DramTier(DramConfig(capacity_bytes=1 << 20))
        assert tier.pinned is tier.index.pinned  # the tier and the manager share the set


def test_the_c_index_frees_what_it_holds() -> None:
    """Dropping the index (an entry in its dict, its pinned set and twice in its ring) gives
    back every reference it took."""
    index_type = core._EXT.DramIndex  # type: ignore[union-attr]
    index = index_type()
    entry = DramEntry(KEYS[0], 0, 10, 4096, None, 1)
    before = sys.getrefcount(entry)
    index.insert(entry)
    index.pin(entry)
    index.pin(entry)
    assert index.lookup(KEYS[0]) is entry and index.pinned == {KEYS[0]}
    assert sys.getrefcount(entry) == before + 3
    del index
    assert sys.getrefcount(entry) == before
    assert entry.live and entry.pins == 2  # dropping the index changes no entry
