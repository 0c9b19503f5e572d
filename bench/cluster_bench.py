"""`kvoffload bench cluster`: how evenly rendezvous placement spreads keys over storage targets
and how few move when a target joins (issue 12's placement rows).

Targets are named like the ids daemons generate; keys are random 16-byte block keys, fixed by
`--seed`, so a run is reproducible. The ideal values are 1.0 (balance) and 1/5 = 0.2 (moved).
"""

from __future__ import annotations

import argparse

import numpy as np

from kvoffload.bench.common import BenchResult, Row, time_median
from kvoffload.client_sdk.cluster import Member, Placement

__all__ = ["HELP", "add_arguments", "balance", "moved_fraction", "run", "run_from_args"]

HELP = "cluster placement: balance over 4 targets, keys moved when a 5th joins"

GOAL_BALANCE = 1.05
GOAL_MOVED = 0.22


def targets(n: int) -> list[Member]:
    return [Member(f"kv-{i:012x}", {"native": f"10.77.0.{10 + i}:7480"}) for i in range(n)]


def block_keys(n: int, seed: int) -> list[bytes]:
    raw = np.random.default_rng(seed).bytes(16 * n)
    return [raw[i : i + 16] for i in range(0, len(raw), 16)]


def balance(members: list[Member], keys: list[bytes]) -> float:
    """Max ÷ mean keys per target (1.0 = perfectly even)."""
    owners = Placement(members).rank_many(keys)[:, 0]
    counts = np.bincount(owners, minlength=len(members))
    return float(counts.max() / counts.mean())


def moved_fraction(before: list[Member], after: list[Member], keys: list[bytes]) -> float:
    """The fraction of keys whose owner differs between the two memberships."""
    old, new = Placement(before), Placement(after)
    old_ids = np.array([m.node_id for m in old.members])[old.rank_many(keys)[:, 0]]
    new_ids = np.array([m.node_id for m in new.members])[new.rank_many(keys)[:, 0]]
    return float(np.mean(old_ids != new_ids))


def run(*, keys: int = 100_000, seed: int = 0) -> BenchResult:
    result = BenchResult("cluster")
    chosen = block_keys(keys, seed)
    bal = balance(targets(4), chosen)
    moved = moved_fraction(targets(4), targets(5), chosen)
    lookup = block_keys(1000, seed + 1)
    four = Placement(targets(4))
    place_ms = time_median(lambda: four.rank_many(lookup, 2), 21) * 1e3
    verdict = {True: "met", False: "NOT met"}
    result.rows += [
        Row("balance/4targets", bal, "max/mean",
            note=f"{keys:,} keys; ideal 1.0; goal <= {GOAL_BALANCE} "
            f"({verdict[bal <= GOAL_BALANCE]})"),
        Row("moved_on_add/4to5", moved, "fraction",
            note=f"{keys:,} keys; ideal 0.2; goal <= {GOAL_MOVED} "
            f"({verdict[moved <= GOAL_MOVED]})"),
        Row("place/1000keys/4targets", place_ms, "ms",
            note="CPU time to rank 1,000 keys for 2 replicas (median of 21): the placement "
            "part of a cluster lookup"),
    ]  # fmt: skip
    result.notes.append(
        "weighted rendezvous (HRW) hashing, equal weights; the goals are issue 12's; no peer "
        "reference (ref is empty: a goal, not a measured alternative)"
    )
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--keys", type=int, default=100_000, help="keys to place")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random keys")


def run_from_args(args: argparse.Namespace) -> BenchResult:
    return run(keys=args.keys, seed=args.seed)
