"""`kvoffload bench cluster`: how evenly rendezvous placement spreads keys over storage targets
and how few move when a target joins, a 1,000-key lookup, failover and 2 MiB read throughput
over 1, 2 and 4 targets (issue 12's rows).

Targets are named like the ids daemons generate; keys are random 16-byte block keys, fixed by
`--seed`, so a run is reproducible. The ideal values are 1.0 (balance) and 1/5 = 0.2 (moved).
The live rows run real daemons on loopback (`live.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time

import numpy as np

from kvoffload.bench.cluster import live as cluster_live
from kvoffload.bench.common import BenchResult, Row, daemon, time_median
from kvoffload.client_sdk import Client
from kvoffload.client_sdk.cluster import Member, Placement

__all__ = ["HELP", "add_arguments", "balance", "moved_fraction", "run", "run_from_args"]

HELP = (
    "cluster: placement balance, keys moved when a 5th target joins, lookup p50, failover, "
    "get_many_into over 1/2/4 targets"
)

GOAL_BALANCE = 1.05
GOAL_MOVED = 0.22
GOAL_LOOKUP_MS = 3.0


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


def live_lookup_ms(targets_n: int, keys: list[bytes], calls: int) -> tuple[float, float]:
    """(p50, p99) ms of `lookup` over a chain of `keys` through `cluster://` to `targets_n`
    daemons on loopback (every key stored, so each lookup walks the whole chain)."""
    with contextlib.ExitStack() as stack:
        urls = []
        for _ in range(targets_n):
            tmp = stack.enter_context(tempfile.TemporaryDirectory())
            url, _ = stack.enter_context(daemon("128MiB", tmp))
            urls.append(url.removeprefix("kv://"))
        client = stack.enter_context(Client.connect("cluster://" + ",".join(urls)))
        parent = None
        for key in keys:
            client.put(key, b"v" * 64, parent=parent)
            parent = key
        if client.lookup(keys) != len(keys):
            raise RuntimeError("a stored chain did not look up whole")
        for _ in range(3):
            client.lookup(keys)
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            client.lookup(keys)
            times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(0.99 * len(times)))]


def run(
    *,
    keys: int = 100_000,
    seed: int = 0,
    lookups: int = 60,
    failover_window: float = 8.0,
    throughput_rounds: int = 8,
) -> BenchResult:
    result = BenchResult("cluster")
    # The live rows share the host's CPUs with whatever else runs: say how busy it was.
    load_at_start = os.getloadavg()[0]
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
    if lookups:
        p50, p99 = live_lookup_ms(4, lookup, lookups)
        result.rows += [
            Row("lookup/1000keys/4targets", p50, "ms", "goal_p50", GOAL_LOOKUP_MS,
                note=f"p50 of {lookups} lookups of a stored 1,000-key chain through cluster:// "
                "to 4 daemons on loopback (one host: the 4 daemons share its cores)"),
            Row("lookup_p99/1000keys/4targets", p99, "ms", note="p99 of the same run"),
        ]  # fmt: skip
    if failover_window:
        result.rows += cluster_live.failover_rows(failover_window)
    if throughput_rounds:
        result.rows += cluster_live.throughput_rows(rounds=throughput_rounds)
    result.notes.append(
        f"load average {load_at_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end "
        f"({os.cpu_count()} CPUs): the live rows (lookup, failover, get_many_into) run daemons "
        "and clients on this host and move with that load"
    )
    result.notes.append(
        "weighted rendezvous (HRW) hashing, equal weights; the goals are issue 12's; no peer "
        "reference (ref is empty: a goal, not a measured alternative)"
    )
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--keys", type=int, default=100_000, help="keys to place")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random keys")
    parser.add_argument(
        "--lookups", type=int, default=60, help="timed lookups through 4 daemons (0: skip)"
    )
    parser.add_argument(
        "--failover-window", type=float, default=8.0,
        help="seconds a reader loops after a node is signalled (0: skip the failover rows)",
    )  # fmt: skip
    parser.add_argument(
        "--throughput-rounds", type=int, default=8,
        help="batches each of 8 threads reads per pass (0: skip the get_many_into rows)",
    )  # fmt: skip


def run_from_args(args: argparse.Namespace) -> BenchResult:
    return run(
        keys=args.keys,
        seed=args.seed,
        lookups=args.lookups,
        failover_window=args.failover_window,
        throughput_rounds=args.throughput_rounds,
    )
