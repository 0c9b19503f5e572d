"""Weighted rendezvous (highest-random-weight) placement of keys over cluster members.

Every (node, key) pair gets a pseudo-random score; a key's owners are the nodes with the highest
scores, so adding or removing a node moves only the keys it wins or held (1/N of them) and no
table has to be agreed on. Weights follow the logarithmic method: score = -weight / ln(u) with u
uniform in (0, 1), which gives each node a share of keys proportional to its weight.

Scores depend only on node ids and key bytes (blake2b and a splitmix64 mix, never Python's
`hash`), so every client and process ranks the same way. Batches are scored with numpy, one
vector operation per node.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvoffload.errors import InvalidArgumentError
from kvoffload.wire.membership import Member

__all__ = ["Placement", "key_hashes"]

_U64 = np.uint64


def _digest64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def key_hashes(keys: Sequence[bytes]) -> npt.NDArray[np.uint64]:
    """64-bit digests of `keys` (block keys are hashes already, but SDK users may store any
    bytes, and similar keys must still spread)."""
    return np.fromiter((_digest64(k) for k in keys), dtype=_U64, count=len(keys))


def _mix(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    # splitmix64's finaliser: a bijection on 64 bits whose output bits each depend on all input
    # bits, so key ^ seed pairs that differ in one bit score independently. uint64 products
    # wrap modulo 2**64, which is the arithmetic the constants are made for.
    with np.errstate(over="ignore"):
        x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    out: npt.NDArray[np.uint64] = x ^ (x >> _U64(31))
    return out


class Placement:
    """The HRW ranking of a fixed set of members (build a new one when membership changes).

    Args:
        members: the live members; their order does not matter.

    Raises:
        InvalidArgumentError: two members share a node id.
    """

    def __init__(self, members: Sequence[Member]) -> None:
        ordered = sorted(members, key=lambda m: m.node_id)
        ids = [m.node_id for m in ordered]
        if len(set(ids)) != len(ids):
            raise InvalidArgumentError(f"duplicate node ids in {ids}")
        self.members: tuple[Member, ...] = tuple(ordered)
        self._seeds = np.array([_digest64(i.encode()) for i in ids], dtype=_U64).reshape(-1, 1)
        self._weights = np.array([m.weight for m in ordered], dtype=np.float64).reshape(-1, 1)

    def __len__(self) -> int:
        return len(self.members)

    def scores(self, hashes: npt.NDArray[np.uint64]) -> npt.NDArray[np.float64]:
        """Scores of every member (rows) for every key digest (columns)."""
        mixed = _mix(hashes.reshape(1, -1) ^ self._seeds)
        # The top 53 bits as a double strictly inside (0, 1), so ln(u) is finite and negative.
        unit = ((mixed >> _U64(11)).astype(np.float64) + 0.5) * 2.0**-53
        scores: npt.NDArray[np.float64] = -self._weights / np.log(unit)
        return scores

    def rank_many(self, keys: Sequence[bytes], replicas: int = 1) -> npt.NDArray[np.intp]:
        """For each key, the indexes (into `members`) of its `replicas` best nodes, best first.

        Returns:
            An array of shape (len(keys), min(replicas, len(members))).

        Raises:
            InvalidArgumentError: replicas < 1.
        """
        if replicas < 1:
            raise InvalidArgumentError(f"replicas must be >= 1, got {replicas}")
        width = min(replicas, len(self.members))
        if not keys or not width:
            return np.zeros((len(keys), width), dtype=np.intp)
        scores = self.scores(key_hashes(keys))
        # A stable sort of the negated scores: equal scores (never seen in practice) fall back
        # to node id order, so every client breaks them the same way.
        order = np.argsort(-scores, axis=0, kind="stable")
        return np.ascontiguousarray(order[:width].T)

    def owners(self, key: bytes, replicas: int = 1) -> list[Member]:
        """The `replicas` members that hold `key`, best first (fewer if there are fewer)."""
        return [self.members[i] for i in self.rank_many([key], replicas)[0]]
