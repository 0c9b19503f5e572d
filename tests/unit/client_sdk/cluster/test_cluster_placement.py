"""Weighted rendezvous placement: balance, minimal movement, weights, determinism."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest

from kvoffload.client_sdk.cluster import Member, Placement
from kvoffload.errors import InvalidArgumentError


def _nodes(n: int, weight: float = 1.0) -> list[Member]:
    return [Member(f"kv-{i}", {"native": f"10.0.0.{i + 1}:7480"}, weight) for i in range(n)]


def _keys(n: int, seed: int = 0) -> list[bytes]:
    raw = np.random.default_rng(seed).bytes(16 * n)
    return [raw[i : i + 16] for i in range(0, len(raw), 16)]


def test_four_equal_nodes_share_keys_evenly() -> None:
    owners = Placement(_nodes(4)).rank_many(_keys(20_000))[:, 0]
    counts = np.bincount(owners, minlength=4)
    assert counts.max() / counts.mean() < 1.05


def test_adding_a_fifth_node_moves_only_its_share() -> None:
    keys = _keys(20_000)
    before = [m.node_id for m in np.array(Placement(_nodes(4)).members)]
    four = Placement(_nodes(4)).rank_many(keys)[:, 0]
    five_p = Placement(_nodes(5))
    five = five_p.rank_many(keys)[:, 0]
    moved = [i for i in range(len(keys)) if five_p.members[five[i]].node_id != before[four[i]]]
    assert 0.17 < len(moved) / len(keys) < 0.23
    # Every key that moved went to the new node: nothing shuffles between the old ones.
    assert all(five_p.members[five[i]].node_id == "kv-4" for i in moved)


def test_weights_set_the_share() -> None:
    nodes = [*_nodes(2), Member("kv-big", {"native": "10.0.0.9:7480"}, 2.0)]
    owners = Placement(nodes).rank_many(_keys(20_000))[:, 0]
    share = np.bincount(owners, minlength=3) / 20_000
    big = [m.node_id for m in Placement(nodes).members].index("kv-big")
    assert 0.47 < share[big] < 0.53


def test_replicas_are_distinct_and_the_first_is_the_owner() -> None:
    placement = Placement(_nodes(5))
    keys = _keys(500)
    ranked = placement.rank_many(keys, replicas=3)
    assert ranked.shape == (500, 3)
    assert all(len(set(row)) == 3 for row in ranked.tolist())
    assert (ranked[:, 0] == placement.rank_many(keys)[:, 0]).all()
    assert [m.node_id for m in placement.owners(keys[7], 3)] == [
        placement.members[i].node_id for i in ranked[7]
    ]


def test_ranking_ignores_member_order_and_survives_processes() -> None:
    nodes = _nodes(4)
    keys = _keys(100)
    a = Placement(nodes).rank_many(keys, 4)
    b = Placement(list(reversed(nodes))).rank_many(keys, 4)
    assert (a == b).all()
    # Pinned values: a change to the hash or the mix would re-place every stored block.
    assert [m.node_id for m in Placement(nodes).owners(b"\x00" * 16, 4)] == [
        "kv-3", "kv-2", "kv-0", "kv-1"
    ]  # fmt: skip


def _reference_rank(nodes: list[Member], key: bytes) -> list[str]:
    """The documented formula in plain Python integers and floats, one pair at a time."""

    def digest(data: bytes) -> int:
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")

    def score(node: Member) -> float:
        x, m = digest(key) ^ digest(node.node_id.encode()), (1 << 64) - 1
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
        x ^= x >> 31
        return -node.weight / math.log(((x >> 11) + 0.5) * 2.0**-53)

    return [n.node_id for n in sorted(nodes, key=score, reverse=True)]


def test_the_vectorised_ranking_is_the_formula() -> None:
    nodes = [*_nodes(6), Member("kv-heavy", {"native": "10.0.0.9:7480"}, 3.0)]
    placement = Placement(nodes)
    keys = _keys(300, seed=5)
    for key, row in zip(keys, placement.rank_many(keys, len(nodes)).tolist(), strict=True):
        assert [placement.members[i].node_id for i in row] == _reference_rank(nodes, key)


def test_edges() -> None:
    assert Placement(_nodes(2)).rank_many([], 2).shape == (0, 2)
    assert Placement([]).rank_many(_keys(3)).shape == (3, 0)
    assert len(Placement(_nodes(2)).owners(b"k", replicas=5)) == 2
    with pytest.raises(InvalidArgumentError):
        Placement(_nodes(2)).rank_many([b"k"], replicas=0)
    with pytest.raises(InvalidArgumentError, match="duplicate"):
        Placement([*_nodes(2), *_nodes(1)])
