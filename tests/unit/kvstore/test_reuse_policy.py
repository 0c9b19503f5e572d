"""The `reuse` eviction policy: deadlines from use counts and age, orphans first, its history
of keys after they leave, the weight it learns against LRU, and its selection by config (the
generic policy tests in test_eviction.py cover it too: it is in POLICIES)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from kvoffload.client_sdk import Client
from kvoffload.errors import ConfigError
from kvoffload.kvstore import (
    DramConfig,
    Engine,
    EngineConfig,
    EvictionPolicy,
    Rank,
    ReusePolicy,
    SsdConfig,
    make_policy,
)


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def fixed() -> ReusePolicy:
    """The deadline rule alone, at full weight (a learner starts as LRU)."""
    return ReusePolicy(learn=False)


def test_blocks_used_once_leave_in_lru_order() -> None:
    policy = fixed()
    for i in range(6):
        policy.insert(k(i), Rank.LEAF)
    policy.touch(k(0))  # now used twice: the youngest deadline and a grace on top
    assert policy.evict(5, set()) == [k(1), k(2), k(3), k(4), k(5)]
    assert policy.evict(1, set()) == [k(0)]


def test_a_block_used_often_outlives_a_flood_that_lru_would_let_push_it_out() -> None:
    reuse, lru = fixed(), make_policy("lru")
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
    policy = fixed()
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
    policy = fixed()
    policy.insert(k(0), Rank.LEAF)
    policy.touch(k(0))
    policy.touch(k(0))
    assert policy.evict(1, set()) == [k(0)]
    for i in range(1, 5):
        policy.insert(k(i), Rank.LEAF)
    policy.insert(k(0), Rank.LEAF)  # third... fourth use: remembered
    assert policy.evict(4, set()) == [k(1), k(2), k(3), k(4)]


def hk(i: int) -> bytes:
    """A hashed key, as the engine's block keys are (the learner samples keys by their first
    byte)."""
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def replay(policy: EvictionPolicy, stream: Sequence[bytes], capacity: int) -> int:
    """Hits of `stream` through a cache of `capacity` one-slot blocks ordered by `policy`."""
    hits = 0
    for key in stream:
        if key in policy:
            policy.touch(key)
            hits += 1
        else:
            if len(policy) >= capacity:
                assert policy.evict(1, set()) is not None
            policy.insert(key, Rank.LEAF)
    return hits


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": lambda: make_policy("lru"),
    "learner": lambda: make_policy("reuse"),
    "fixed": fixed,
}


def test_the_learner_stays_with_lru_where_frequency_misleads() -> None:
    """Phases of 300 keys, each read six times round robin, in a cache of 400: LRU keeps each
    new phase whole; the deadline rule keeps the last phase's much-used keys for 3 x 400 ticks
    after they cooled and thrashes the new one. The learner's miniature caches see that and it
    stays within 1% of LRU."""
    stream = [hk(1000 * phase + i) for phase in range(10) for _ in range(6) for i in range(300)]
    hits = {name: replay(make(), stream, 400) for name, make in POLICIES.items()}
    assert hits["fixed"] < 0.8 * hits["lru"]  # the trace does punish the deadlines
    assert hits["learner"] >= 0.99 * hits["lru"]


def test_the_learner_takes_the_deadlines_where_a_scan_flushes_lru() -> None:
    """100 hot keys read once a round between 600 one-off keys, in a cache of 400: LRU never
    hits (each hot key comes back after 700 other keys), the deadlines keep the hot keys once
    they have four uses. The learner switches to them."""
    stream: list[bytes] = []
    for r in range(40):
        stream += [hk(i) for i in range(100)]
        stream += [hk(1_000_000 + 600 * r + j) for j in range(600)]
    hits = {name: replay(make(), stream, 400) for name, make in POLICIES.items()}
    assert hits["lru"] == 0 and hits["fixed"] >= 3000
    assert hits["learner"] >= 0.95 * hits["fixed"]


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
