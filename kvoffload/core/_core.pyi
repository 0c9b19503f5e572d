# Stubs of the C core (_core.c, index.c, hot.c, uring.c); kvoffload.kvstore.dram.DramIndex
# documents the index, kvoffload/core/uring.c the ring.
from collections.abc import Callable, Iterator, Sequence

def copy_crc32c(dst: memoryview, src: memoryview, /) -> int: ...
def hash_key(key: bytes, /) -> int: ...

class DramIndex:
    pinned: set[bytes]
    tick: int
    def __len__(self) -> int: ...
    def __contains__(self, key: object) -> bool: ...
    def lookup(self, key: bytes, /) -> object | None: ...
    def next_tick(self) -> int: ...
    def pin(self, entry: object, /) -> int: ...
    def unpin(self, entry: object, /) -> bool: ...
    def insert(self, entry: object, /) -> None: ...
    def remove(self, key: bytes, /) -> object: ...
    def drain_touches(self) -> list[object]: ...
    def values(self) -> Iterator[object]: ...
    def retire(self) -> None: ...

class HotGets:
    def __init__(
        self,
        lock: object,
        index: DramIndex,
        counters: dict[str, int],
        manager: object,
        apply_touches: object,
        free: object,
        arena: memoryview,
        prefix: object,
        frame_head: object,
        head_state: object,
        touch_ring: int,
        buckets: Sequence[float] | None = None,
        *,
        pins: object = None,
        max_payload: int = 0,
        step: int = 0,
    ) -> None: ...
    def serve(
        self, reader: object, inflight: int, max_inflight: int, most: int, fd: int = -1, /
    ) -> (
        tuple[
            list[object], list[memoryview], list[object], tuple[int, int, int, int], int, int, int
        ]
        | None
    ): ...
    def take_metrics(
        self,
    ) -> tuple[
        tuple[int, int, int, int, int],
        int,
        tuple[tuple[int, ...], ...],
        tuple[float, float, float, float, float],
        int,
    ]: ...
    def put_done(self, parts: list[bytes], fd: int, t0: float, nbytes: int, /) -> list[bytes]: ...
    def release(
        self, views: list[memoryview], entries: list[object], taken: int = 0, /
    ) -> None: ...
    def set_shard(self, index: int, count: int, /) -> None: ...
    # The reader callback: the loop calls the object while it is armed (see hot.c).
    armed: int
    last_rx: float
    def arm(
        self,
        reader: object,
        fd: int,
        most: int,
        max_inflight: int,
        handback: Callable[[int, object, object], object],
        services: object,
        /,
    ) -> None: ...
    def disarm(self) -> None: ...
    def __call__(self) -> None: ...

class SlotRing:
    depth: int
    closed: bool
    broken: bool
    counts: tuple[int, int]
    registered: tuple[int, int]
    fixed: tuple[int, int]
    def __init__(self, depth: int) -> None: ...
    def submit(
        self,
        entries: Sequence[tuple[int, int, object, bool]],
        delay_s: float = 0.0,
        fail: Sequence[tuple[int, int]] | None = None,
        enter_fail: int = 0,
    ) -> list[int]: ...
    def register_files(self, fds: Sequence[int]) -> None: ...
    def register_memory(self, buffer: object) -> None: ...
    def clone_memory(self, ring: SlotRing) -> None: ...
    def close(self) -> bool: ...
