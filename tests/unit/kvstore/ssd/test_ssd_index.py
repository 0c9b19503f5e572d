"""The compact SSD index against a dict model (hypothesis) and its vectorised bulk paths."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from kvoffload.kvstore.ssd.index import EMPTY, ROW_DTYPE, SsdIndex

# Keys with trailing zero bytes and shared prefixes on purpose (numpy S16 strips NULs).
KEYS = [bytes([i % 3, 0, 0, 0, 0, 0, 0, i]) + bytes(8) for i in range(40)]


def no_rank(index: SsdIndex, row: int) -> int:
    return 2


class IndexMachine(RuleBasedStateMachine):
    policy = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.index = SsdIndex(policy=self.policy, capacity=4)
        self.model: dict[bytes, tuple[int, bytes | None]] = {}
        self.seq = 0

    @rule(key=st.sampled_from(KEYS), parent=st.none() | st.sampled_from(KEYS))
    def insert(self, key: bytes, parent: bytes | None) -> None:
        if key in self.model:
            self.index.remove(self.index.find(key))
        self.seq += 1
        self.index.insert(key, page=self.seq, length=self.seq, seq=self.seq, crc=7,
                          parent=parent, tenant=1, tick=self.seq)  # fmt: skip
        self.model[key] = (self.seq, parent)

    @rule(key=st.sampled_from(KEYS))
    def remove(self, key: bytes) -> None:
        row = self.index.find(key)
        assert (row != EMPTY) == (key in self.model)
        if row != EMPTY:
            self.index.remove(row)
            del self.model[key]

    @rule(key=st.sampled_from(KEYS))
    def touch(self, key: bytes) -> None:
        row = self.index.find(key)
        if row != EMPTY:
            self.seq += 1
            self.index.touch(row, self.seq)

    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        members = list(self.model)
        protected_keys = data.draw(st.sets(st.sampled_from(members))) if members else set()
        protected = {self.index.find(k) for k in protected_keys}
        row = self.index.choose_victim(protected, no_rank)
        if row == EMPTY:
            assert set(members) <= protected_keys
            return
        key = self.index.key_of(row)
        assert key in members and key not in protected_keys
        self.index.remove(row)
        del self.model[key]

    @invariant()
    def matches_model(self) -> None:
        assert len(self.index) == len(self.model)
        for key in KEYS:
            row = self.index.find(key)
            if key not in self.model:
                assert row == EMPTY
                continue
            seq, parent = self.model[key]
            assert self.index.key_of(row) == key
            assert self.index.parent_of(row) == parent
            assert int(self.index.rows["seq"][row]) == seq and self.index.live[row]
        for key in KEYS[:10]:
            expected = any(v[1] == key for v in self.model.values())
            assert self.index.has_child(key) == expected
        # Tenant 1's slot bytes: a header page plus the value's pages (length = seq here).
        held = sum(4096 + -(-seq // 4096) * 4096 for seq, _ in self.model.values())
        assert self.index.tenant_bytes == ({1: held} if held else {})


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "prefix"])
def test_index_matches_dict_model(policy: str) -> None:
    machine = type(f"IndexMachine_{policy}", (IndexMachine,), {"policy": policy})
    run_state_machine_as_test(machine, settings=settings(stateful_step_count=80))


def test_lru_order_and_touch() -> None:
    index = SsdIndex("lru")
    rows = [index.insert(k, page=0, length=1, seq=1, crc=0, parent=None, tenant=0,
                         tick=i) for i, k in enumerate(KEYS[:4])]  # fmt: skip
    index.touch(rows[0], 10)
    assert index.choose_victim(set(), no_rank) == rows[1]
    assert index.choose_victim({rows[1]}, no_rank) == rows[2]


def test_prefix_prefers_orphans_then_leaves() -> None:
    index = SsdIndex("prefix")
    rows = [index.insert(k, page=0, length=1, seq=1, crc=0, parent=None, tenant=0,
                         tick=i) for i, k in enumerate(KEYS[:4])]  # fmt: skip
    ranks = {rows[0]: 2, rows[1]: 1, rows[2]: 0, rows[3]: 1}
    assert index.choose_victim(set(), lambda _, r: ranks[r]) == rows[2]
    assert index.choose_victim({rows[2]}, lambda _, r: ranks[r]) == rows[1]


def test_s3fifo_keeps_reused_rows() -> None:
    index = SsdIndex("s3fifo")
    hot = index.insert(KEYS[0], page=0, length=1, seq=1, crc=0, parent=None, tenant=0,
                       tick=0)  # fmt: skip
    index.touch(hot, 1)
    for i, key in enumerate(KEYS[1:30], start=2):
        index.insert(key, page=0, length=1, seq=i, crc=0, parent=None, tenant=0, tick=i)
        victim = index.choose_victim(set(), no_rank)
        assert victim != hot
        index.remove(victim)
    assert index.find(KEYS[0]) == hot


def test_export_load_round_trip_and_growth() -> None:
    index = SsdIndex("lru", capacity=16)
    rng = np.random.default_rng(1)
    keys = [rng.bytes(16) for _ in range(5000)]
    for i, key in enumerate(keys):
        parent = keys[i - 1] if i else None
        index.insert(key, page=i, length=i, seq=i, crc=i, parent=parent, tenant=0,
                     tick=i)  # fmt: skip
    for key in keys[::7]:
        index.remove(index.find(key))
    records = index.export()
    again = SsdIndex("lru")
    again.load(records)
    assert len(again) == len(index) and again.tenant_bytes == index.tenant_bytes
    for i, key in enumerate(keys):
        row = again.find(key)
        assert (row == EMPTY) == (i % 7 == 0)
        if row != EMPTY:
            assert int(again.rows["page"][row]) == i
    assert again.has_child(keys[100]) and not again.has_child(keys[-1])
    assert again.memory_bytes() / len(again) < 128


def test_load_places_keys_whose_home_is_the_last_slots() -> None:
    # A loaded index of 12 rows has a 32-slot table (at least 16 rows of room); keys hashing
    # to its last two slots push the rows after them past the end, to wrap to slot 0.
    from kvoffload.kvstore.ssd.keyhash import hash_key

    near_end = [k for k in (i.to_bytes(16, "little") for i in range(1, 5000))
                if hash_key(k) & 31 >= 30][:8]  # fmt: skip
    elsewhere = [k for k in (i.to_bytes(16, "little") for i in range(5000, 9000))
                 if hash_key(k) & 31 < 2][:4]  # fmt: skip
    keys = near_end + elsewhere
    rows = np.zeros(len(keys), dtype=ROW_DTYPE)
    rows["key"] = keys
    rows["seq"] = np.arange(len(keys))
    index = SsdIndex(policy="lru")
    index.load(rows)
    assert [index.find(k) for k in keys] == list(range(len(keys)))
    assert index.find((9999).to_bytes(16, "little")) == EMPTY
    for row in (3, 9):  # probing still finds the rest once rows are taken out
        index.remove(row)
    assert [index.find(k) for k in keys] == [EMPTY if i in (3, 9) else i for i in range(12)]
