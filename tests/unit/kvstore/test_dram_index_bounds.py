"""The C DramIndex's 64-bit counts at their ends (found by the sanitized fuzz target
`dram-index`): Python's ints grow, C's would wrap, so C refuses with OverflowError and
changes nothing."""

from __future__ import annotations

import pytest

from kvoffload import core
from kvoffload.kvstore.dram import DramEntry

pytestmark = pytest.mark.skipif(
    "c" not in core.available(), reason="the C core is not built (KVOFFLOAD_PURE_PYTHON run)"
)
KEY = bytes(16)
TOP, BOTTOM = 2**63 - 1, -(2**63)


def _index() -> object:
    return core._EXT.DramIndex()  # type: ignore[union-attr]


def test_the_recency_clock_refuses_to_wrap() -> None:
    index = _index()
    entry = DramEntry(KEY, 0, 10, 4096, None, 1)
    index.insert(entry)  # type: ignore[attr-defined]
    index.tick = TOP  # type: ignore[attr-defined]
    with pytest.raises(OverflowError):
        index.next_tick()  # type: ignore[attr-defined]
    with pytest.raises(OverflowError):
        index.pin(entry)  # type: ignore[attr-defined]  # a hit ticks the clock
    assert index.tick == TOP and entry.pins == 0  # type: ignore[attr-defined]
    assert index.drain_touches() == [] and not index.pinned  # type: ignore[attr-defined]
    entry.live = False  # a dead entry's pin does not tick: still allowed
    assert index.pin(entry) == 0 and entry.pins == 1  # type: ignore[attr-defined]


@pytest.mark.parametrize(("pins", "op"), [(TOP, "pin"), (BOTTOM, "unpin")])
def test_a_pin_count_refuses_to_wrap(pins: int, op: str) -> None:
    index = _index()
    entry = DramEntry(KEY, 0, 10, 4096, None, 1, pins=pins)
    index.insert(entry)  # type: ignore[attr-defined]
    with pytest.raises(OverflowError):
        getattr(index, op)(entry)
    assert entry.pins == pins and index.tick == 0  # type: ignore[attr-defined]
    assert index.drain_touches() == []  # type: ignore[attr-defined]
