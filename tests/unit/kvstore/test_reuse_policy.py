"""The `reuse` eviction policy: deadlines from use counts and age, orphans first, its history
of keys after they leave, and its selection by config (the generic policy tests in
test_eviction.py cover it too: it is in POLICIES)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload.client_sdk import Client
from kvoffload.errors import ConfigError
from kvoffload.kvstore import (
    DramConfig,
    Engine,
    EngineConfig,
    Rank,
    ReusePolicy,
    SsdConfig,
    make_policy,
)


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_blocks_used_once_leave_in_lru_order() -> None:
    policy = make_policy("reuse")
    for i in range(6):
        policy.insert(k(i), Rank.LEAF)
    policy.touch(k(0))  # now used twice: the youngest deadline and a grace on top
    assert policy.evict(5, set()) == [k(1), k(2), k(3), k(4), k(5)]
    assert policy.evict(1, set()) == [k(0)]


def test_a_block_used_often_outlives_a_flood_that_lru_would_let_push_it_out() -> None:
    reuse, lru = make_policy("reuse"), make_policy("lru")
    for policy in (reuse, lru):
        for i in range(10):
            policy.insert(k(i), Rank.LEAF)
        for _ in range(3):
            policy.touch(k(0))  # four uses: grace of 3 x the resident count
        for i in range(10, 30):  # 20 one-off blocks, each making room for itself
            assert policy.evict(1, set()) is not None
            policy.insert(k(i), Rank.LEAF)
    assert k(0) in reuse and len(reuse) == 10
    assert k(0) not in lru  # LRU let it go after the nine older blocks


def test_orphans_go_first_however_recent() -> None:
    policy = make_policy("reuse")
    for i in range(4):
        policy.insert(k(i), Rank.LEAF)
    policy.set_rank(k(3), Rank.ORPHAN)
    policy.set_rank(k(42), Rank.ORPHAN)  # not ours: ignored, never a victim
    assert policy.evict(1, set()) == [k(3)]
    policy.set_rank(k(2), Rank.ORPHAN)
    policy.set_rank(k(2), Rank.LEAF)  # its parent came back
    assert policy.evict(2, {k(0)}) == [k(1), k(2)]
    assert policy.evict(1, set()) == [k(0)] and len(policy) == 0


def test_uses_are_remembered_after_eviction() -> None:
    """A key evicted and stored again (the common case of a prefix coming back) gets the grace
    of its past uses at once, where a newcomer gets none."""
    policy = make_policy("reuse")
    policy.insert(k(0), Rank.LEAF)
    policy.touch(k(0))
    policy.touch(k(0))
    assert policy.evict(1, set()) == [k(0)]
    for i in range(1, 5):
        policy.insert(k(i), Rank.LEAF)
    policy.insert(k(0), Rank.LEAF)  # third... fourth use: remembered
    assert policy.evict(4, set()) == [k(1), k(2), k(3), k(4)]


def test_selected_by_config_in_the_engine_and_a_local_url() -> None:
    config = EngineConfig(dram=DramConfig(capacity_bytes=64 << 10, max_value_bytes=4096,
                                          policy="reuse", prefault=False))  # fmt: skip
    with Engine(config) as engine:
        for i in range(40):  # 16 slots: evictions happen
            engine.put(k(i), bytes(4000))
        stats = engine.stats()
        assert stats.policy == "reuse" and stats.evictions > 0
    with Client.connect("local://?dram=64KiB&max_value=4096&prefault=0&policy=reuse") as client:
        client.put(k(1), b"x" * 100)
        assert client.get(k(1)) == b"x" * 100
        assert client.stats().store["policy"] == "reuse"
    with pytest.raises(ConfigError, match="reuse"):
        DramConfig(policy="nope")
    assert isinstance(make_policy("reuse"), ReusePolicy)


def test_a_dram_only_policy_leaves_the_ssd_tier_on_lru(tmp_path: Path) -> None:
    """The SSD tier implements lru, s3fifo and prefix itself: with dram.policy = "reuse" and no
    ssd.policy it runs LRU (it used to fail the store's start with a ValueError), and naming
    "reuse" for the SSD is a clear config error."""
    config = EngineConfig(
        dram=DramConfig(capacity_bytes=64 << 10, max_value_bytes=4096, policy="reuse",
                        prefault=False),
        ssd=SsdConfig(capacity_bytes=1 << 20),
        data_dir=str(tmp_path / "store"),
    )  # fmt: skip
    assert config.ssd_policy == "lru"
    with Engine(config) as engine:
        for i in range(40):  # 16 DRAM slots: the rest go down to the SSD
            engine.put(k(i), i.to_bytes(2, "little") * 2000)
        for i in range(40):
            view = engine.get(k(i))
            assert view is not None
            with view:
                assert bytes(view.data) == i.to_bytes(2, "little") * 2000
    assert EngineConfig(dram=DramConfig(policy="prefix")).ssd_policy == "prefix"
    with pytest.raises(ConfigError, match="the SSD tier has"):
        SsdConfig(capacity_bytes=1 << 20, policy="reuse")
