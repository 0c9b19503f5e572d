"""The engine against a plain dict model, under every eviction policy (hypothesis)."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvoffload.errors import CapacityError
from kvoffload.kvstore import POLICIES, BlockView, DramConfig, Engine, EngineConfig

KEYS = [bytes([i]) * 16 for i in range(24)]
# Sizes across several size classes, so slabs are shared, reclaimed and stolen.
SIZES = st.sampled_from([0, 1, 100, 4096, 4097, 9000, 20_000, 40_000, 65_000])
QUOTA = 160 << 10  # tenant "q" may hold this many slot bytes


class EngineMachine(RuleBasedStateMachine):
    policy = "lru"

    def __init__(self) -> None:
        super().__init__()
        config = DramConfig(
            capacity_bytes=512 << 10, max_value_bytes=64 << 10, policy=self.policy, prefault=False
        )
        self.engine = Engine(EngineConfig(dram=config))
        self.engine.set_quota("q", QUOTA)
        self.model: dict[bytes, bytes] = {}
        self.counter = 0
        # held view -> (key, expected bytes, still the live value of key?)
        self.held: dict[int, tuple[BlockView, bytes, bytes]] = {}
        self.live_pins: dict[int, bool] = {}

    views = Bundle("views")

    def _value(self, size: int) -> bytes:
        self.counter += 1
        return (self.counter.to_bytes(4, "little") * (size // 4 + 1))[:size]

    def _invalidate(self, key: bytes) -> None:
        for vid, (_, k, _) in self.held.items():
            if k == key:
                self.live_pins[vid] = False

    @rule(
        key=st.sampled_from(KEYS),
        size=SIZES,
        parent=st.none() | st.sampled_from(KEYS),
        tenant=st.sampled_from(["", "q"]),
    )
    def put(self, key: bytes, size: int, parent: bytes | None, tenant: str) -> None:
        value = self._value(size)
        try:
            self.engine.put(key, value, parent=parent, tenant=tenant)
        except CapacityError:
            # Only legal when pins block every way to make room.
            assert self.held
            return
        self._invalidate(key)
        self.model[key] = value

    @rule(key=st.sampled_from(KEYS))
    def get_into(self, key: bytes) -> None:
        buf = bytearray(70_000)
        n = self.engine.get_into(key, buf)
        if n is not None:
            assert bytes(buf[:n]) == self.model[key]

    @precondition(lambda self: len(self.held) < 12)
    @rule(target=views, key=st.sampled_from(KEYS))
    def pin(self, key: bytes) -> int:
        view = self.engine.get(key)
        if view is None:
            return -1
        assert bytes(view.data) == self.model[key]
        vid = id(view)
        self.held[vid] = (view, key, self.model[key])
        self.live_pins[vid] = True
        return vid

    @rule(vid=consumes(views))
    def release(self, vid: int) -> None:
        if vid in self.held:
            view, _, _ = self.held.pop(vid)
            self.live_pins.pop(vid)
            view.release()
            view.release()  # idempotent

    @rule(key=st.sampled_from(KEYS))
    def delete(self, key: bytes) -> None:
        existed = self.engine.delete(key)
        if existed:
            assert key in self.model
        self.model.pop(key, None)
        self._invalidate(key)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=8))
    def lookup(self, keys: list[bytes]) -> None:
        n = self.engine.lookup(keys)
        expected = 0
        for key in keys:
            if not self.engine.contains(key):
                break
            expected += 1
        assert n == expected

    @invariant()
    def quota_is_a_hard_bound(self) -> None:
        assert self.engine.stats().tenant_bytes["q"] <= QUOTA

    @invariant()
    def capacity_is_a_hard_bound(self) -> None:
        tier = self.engine.stats().tiers[0]
        assert tier.used_bytes <= tier.capacity_bytes
        assert tier.stored_bytes <= tier.used_bytes

    @invariant()
    def pinned_bytes_never_change_and_pinned_blocks_stay(self) -> None:
        for vid, (view, key, expected) in self.held.items():
            assert bytes(view.data) == expected
            if self.live_pins[vid]:
                assert self.engine.contains(key), "a pinned block was evicted"

    @invariant()
    def stored_values_are_the_last_put(self) -> None:
        for key in KEYS:
            size = self.engine.size_of(key)
            if size is not None:
                assert size == len(self.model[key])

    def teardown(self) -> None:
        for view, _, _ in self.held.values():
            view.release()
        self.engine.close()


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_engine_matches_dict_model(policy: str) -> None:
    machine = type(f"EngineMachine_{policy}", (EngineMachine,), {"policy": policy})
    run_state_machine_as_test(machine, settings=settings(stateful_step_count=60))
