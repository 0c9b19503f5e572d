from __future__ import annotations

from kvoffload.kvstore.config import PAGE
from kvoffload.kvstore.slabs import SizeClasses, SlabAllocator


def test_classes_are_page_multiples_with_bounded_waste() -> None:
    classes = SizeClasses(64 << 20, 1.05)
    assert classes.sizes[0] == PAGE
    assert classes.sizes[-1] == 64 << 20
    assert all(s % PAGE == 0 for s in classes.sizes)
    assert all(b > a for a, b in zip(classes.sizes, classes.sizes[1:], strict=False))
    for length in (1, 4096, 4097, 100_000, 368_736, 2 << 20, (64 << 20) - 1, 64 << 20):
        size = classes.sizes[classes.class_of(length)]
        assert size >= length
        # Waste is below the growth ratio (or one page for small values).
        assert size <= max(length * 1.05 + PAGE, PAGE)


def test_allocator_reuses_and_returns_empty_slabs() -> None:
    classes = SizeClasses(64 << 10, 1.05)
    alloc = SlabAllocator(4, 64 << 10, classes)
    small = classes.class_of(4096)
    big = classes.class_of(64 << 10)
    offsets = [alloc.alloc(small) for _ in range(16)]
    assert None not in offsets
    assert len(set(offsets)) == 16
    assert alloc.free_slabs == 3
    assert all(o is not None and o % PAGE == 0 for o in offsets)
    for o in offsets:
        assert o is not None
        alloc.free(o)
    # A slab whose last slot is freed goes back to the shared pool at once.
    assert alloc.free_slabs == 4
    assert alloc.used_bytes == 0
    bigs = [alloc.alloc(big) for _ in range(4)]
    assert None not in bigs
    assert alloc.alloc(big) is None
    assert alloc.alloc(small) is None
