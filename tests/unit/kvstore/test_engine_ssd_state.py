"""The two-tier engine against a dict model (hypothesis), with reopens.

With every evicted block admitted to an SSD that holds the whole key space, nothing may ever
miss: each get returns exactly the last value put, in either tier, across clean restarts.
"""

from __future__ import annotations

import shutil
import tempfile

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvoffload.errors import CapacityError
from kvoffload.kvstore import BlockView, DramConfig, Engine, EngineConfig, SsdConfig

KEYS = [bytes([i]) * 16 for i in range(20)]
SIZES = st.sampled_from([0, 1, 4000, 4097, 20_000, 50_000, 65_000])


class TieredMachine(RuleBasedStateMachine):
    policy = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvoffload-state-")
        self.config = EngineConfig(
            DramConfig(capacity_bytes=512 << 10, max_value_bytes=64 << 10, policy=self.policy,
                       prefault=False),
            SsdConfig(capacity_bytes=8 << 20, admission_min_uses=1, sync_interval_s=0.01),
            data_dir=self.dir,
        )  # fmt: skip
        self.engine = Engine(self.config)
        self.model: dict[bytes, bytes] = {}
        self.held: list[tuple[BlockView, bytes]] = []
        self.counter = 0

    def _value(self, size: int) -> bytes:
        self.counter += 1
        return (self.counter.to_bytes(4, "little") * (size // 4 + 1))[:size]

    @rule(key=st.sampled_from(KEYS), size=SIZES, durable=st.booleans(),
          parent=st.none() | st.sampled_from(KEYS))  # fmt: skip
    def put(self, key: bytes, size: int, durable: bool, parent: bytes | None) -> None:
        value = self._value(size)
        try:
            self.engine.put(key, value, durable=durable, parent=parent)
        except CapacityError:
            # Only legal when pinned views hold every DRAM slab that could make room; the old
            # value (if any) stays.
            assert self.held
            return
        self.model[key] = value

    @rule(key=st.sampled_from(KEYS))
    def get(self, key: bytes) -> None:
        buf = bytearray(70_000)
        n = self.engine.get_into(key, buf)
        if key in self.model:
            assert n is not None, "a stored block missed"
            assert bytes(buf[:n]) == self.model[key]
        else:
            assert n is None

    @precondition(lambda self: len(self.held) < 4)
    @rule(key=st.sampled_from(KEYS))
    def pin(self, key: bytes) -> None:
        view = self.engine.get(key)
        assert (view is None) == (key not in self.model)
        if view is not None:
            assert bytes(view.data) == self.model[key]
            self.held.append((view, self.model[key]))

    @precondition(lambda self: bool(self.held))
    @rule()
    def release(self) -> None:
        self.held.pop()[0].release()

    @rule(key=st.sampled_from(KEYS))
    def delete(self, key: bytes) -> None:
        assert self.engine.delete(key) == (key in self.model)
        self.model.pop(key, None)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=6))
    def lookup_and_prefetch(self, keys: list[bytes]) -> None:
        expected = 0
        for key in keys:
            if key not in self.model:
                break
            expected += 1
        assert self.engine.lookup(keys) == expected
        assert self.engine.prefetch(keys) == sum(1 for k in keys if k in self.model)

    @rule()
    def reopen(self) -> None:
        for view, _ in self.held:
            view.release()
        self.held.clear()
        self.engine.close()
        self.engine = Engine(self.config)

    @rule()
    def checkpoint(self) -> None:
        self.engine.checkpoint()

    @invariant()
    def bounds_and_pins(self) -> None:
        for view, expected in self.held:
            assert bytes(view.data) == expected
        stats = self.engine.stats()
        for tier in stats.tiers:
            assert tier.used_bytes <= tier.capacity_bytes
            assert tier.corrupt_blocks == 0 and tier.io_errors == 0
        assert stats.tiers[1].evictions == 0  # the SSD holds the whole key space
        # The per-tenant SSD bytes kept on every insert and removal (and rebuilt on reopen)
        # equal the slot bytes of the rows the index holds.
        ssd = self.engine._ssd
        assert ssd is not None
        rows = ssd.index.live_rows()
        held = sum(4096 + -(-int(n) // 4096) * 4096 for n in ssd.index.rows["length"][rows])
        assert stats.ssd_tenant_bytes == ({"": held} if held else {})

    def teardown(self) -> None:
        for view, _ in self.held:
            view.release()
        self.engine.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def test_lru() -> None:
    run_state_machine_as_test(TieredMachine, settings=settings(stateful_step_count=50))


def test_prefix() -> None:
    machine = type("PrefixMachine", (TieredMachine,), {"policy": "prefix"})
    run_state_machine_as_test(machine, settings=settings(stateful_step_count=50))


def test_s3fifo() -> None:
    machine = type("S3Machine", (TieredMachine,), {"policy": "s3fifo"})
    run_state_machine_as_test(machine, settings=settings(stateful_step_count=50))
