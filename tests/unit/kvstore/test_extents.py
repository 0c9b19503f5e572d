"""The extent allocator against a page map (hypothesis), and its restore after a restart."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
from hypothesis import given

from kvoffload.kvstore.config import PAGE
from kvoffload.kvstore.extents import ExtentAllocator, slot_bytes, slot_sizes

PAGES = 64


def free_runs(used: list[bool]) -> list[tuple[int, int]]:
    """Maximal runs of free pages, as byte ranges."""
    runs, start = [], None
    for i, busy in enumerate([*used, True]):
        if not busy and start is None:
            start = i
        elif busy and start is not None:
            runs.append((start * PAGE, i * PAGE))
            start = None
    return runs


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 20), st.integers(0, 1000)), max_size=80))
def test_allocator_matches_a_page_map(ops: list[tuple[bool, int, int]]) -> None:
    alloc = ExtentAllocator(PAGES * PAGE)
    used = [False] * PAGES
    slots: dict[int, int] = {}
    for is_alloc, pages, pick in ops:
        if is_alloc or not slots:
            offset = alloc.alloc(pages * PAGE)
            runs = free_runs(used)
            fits = [r for r in runs if r[1] - r[0] >= pages * PAGE]
            if offset is None:
                assert not fits
                continue
            # Best fit: the smallest free run that holds it.
            assert min(r[1] - r[0] for r in fits) == next(
                r[1] - r[0] for r in runs if r[0] == offset
            )
            first = offset // PAGE
            assert not any(used[first : first + pages])
            used[first : first + pages] = [True] * pages
            slots[offset] = pages
        else:
            offset = sorted(slots)[pick % len(slots)]
            pages = slots.pop(offset)
            start, end = alloc.free(offset, pages * PAGE)
            used[offset // PAGE : offset // PAGE + pages] = [False] * pages
            assert (start, end) in free_runs(used) and start <= offset < end
        assert sorted(alloc._starts.items()) == free_runs(used)
        assert alloc.used_bytes == sum(used) * PAGE
        assert alloc.free_extents == len(free_runs(used))
        assert alloc.largest_free == max((e - s for s, e in free_runs(used)), default=0)


def test_restore_keeps_valid_rows_and_frees_the_gaps() -> None:
    alloc = ExtentAllocator(16 * PAGE)
    offsets = np.array([0, 2, 3, 5, 14, 1, 15], dtype=np.int64) * PAGE
    sizes = np.array([2, 2, 1, 4, 3, 1, 1], dtype=np.int64) * PAGE
    offsets[5] += 1  # not page-aligned
    ok = alloc.restore(offsets, sizes)
    # [0,2) kept; [2,4) kept; [3,4) overlaps it; [5,9) kept; [14,17) past the end; unaligned;
    # [15,16) kept.
    assert ok.tolist() == [True, True, False, True, False, False, True]
    assert sorted(alloc._starts.items()) == [(4 * PAGE, 5 * PAGE), (9 * PAGE, 15 * PAGE)]
    assert alloc.used_bytes == 9 * PAGE
    assert alloc.alloc(6 * PAGE) == 9 * PAGE and alloc.alloc(PAGE) == 4 * PAGE
    assert alloc.alloc(PAGE) is None


def test_slot_sizes() -> None:
    assert [slot_bytes(n) for n in (0, 1, PAGE, PAGE + 1)] == [PAGE, PAGE, PAGE, 2 * PAGE]
    lengths = np.array([0, 1, PAGE, PAGE + 1], dtype=np.int64)
    assert slot_sizes(lengths).tolist() == [PAGE, PAGE, PAGE, 2 * PAGE]
