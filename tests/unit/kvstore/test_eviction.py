from __future__ import annotations

import pytest

from kvoffload.errors import ConfigError
from kvoffload.kvstore import POLICIES, EvictionPolicy, Rank, make_policy, register_policy
from kvoffload.kvstore.eviction import LRUPolicy


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def fill(policy: EvictionPolicy, n: int) -> None:
    for i in range(n):
        policy.insert(k(i), Rank.LEAF)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_evict_is_atomic_when_everything_is_protected(name: str) -> None:
    policy = make_policy(name)
    fill(policy, 4)
    protected = {k(0), k(1), k(2)}
    assert policy.evict(2, protected) is None
    assert len(policy) == 4
    assert policy.evict(1, protected) == [k(3)]
    assert len(policy) == 3


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_removed_keys_are_never_victims(name: str) -> None:
    policy = make_policy(name)
    fill(policy, 5)
    policy.remove(k(0))
    policy.remove(k(42))  # unknown keys are ignored
    victims = policy.evict(4, set())
    assert victims is not None and k(0) not in victims
    assert sorted(victims) == sorted(k(i) for i in range(1, 5))
    assert len(policy) == 0


def test_lru_order_follows_touches() -> None:
    policy = make_policy("lru")
    fill(policy, 3)
    policy.touch(k(0))
    assert policy.evict(2, set()) == [k(1), k(2)]


def test_s3fifo_keeps_reused_blocks_over_one_hit_wonders() -> None:
    policy = make_policy("s3fifo")
    fill(policy, 10)
    for i in range(3):
        policy.touch(k(i))  # read again while probationary
    for i in range(10, 40):  # a scan of one-hit wonders
        policy.insert(k(i), Rank.LEAF)
        policy.evict(1, set())
    survivors = {k(i) for i in range(3)}
    assert all(s in policy for s in survivors)


def test_s3fifo_ghost_hit_goes_to_main() -> None:
    policy = make_policy("s3fifo")
    fill(policy, 2)
    assert policy.evict(1, set()) == [k(0)]
    policy.insert(k(0), Rank.LEAF)  # re-inserted soon after eviction
    for i in range(2, 12):
        policy.insert(k(i), Rank.LEAF)
    victims = policy.evict(5, set())
    assert victims is not None and k(0) not in victims


def test_prefix_evicts_orphans_then_leaves_then_interior() -> None:
    policy = make_policy("prefix")
    policy.insert(k(0), Rank.INTERIOR)  # oldest
    policy.insert(k(1), Rank.LEAF)
    policy.insert(k(2), Rank.ORPHAN)  # newest
    assert policy.evict(3, set()) == [k(2), k(1), k(0)]


def test_prefix_parent_becoming_leaf_keeps_its_age() -> None:
    policy = make_policy("prefix")
    policy.insert(k(0), Rank.INTERIOR)
    policy.insert(k(1), Rank.LEAF)  # child of 0
    policy.insert(k(9), Rank.LEAF)  # unrelated, newer
    assert policy.evict(1, set()) == [k(1)]
    policy.set_rank(k(0), Rank.LEAF)  # the engine reports its last child left
    # k(0) was used before k(9): it goes first, not to the back of the queue.
    assert policy.evict(1, set()) == [k(0)]


def test_registry_refuses_duplicates_and_unknown_names() -> None:
    with pytest.raises(ConfigError, match="already registered"):
        register_policy(LRUPolicy)
    with pytest.raises(ConfigError, match="choose one of"):
        make_policy("random")
