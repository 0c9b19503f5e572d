"""The live rows of `kvoffload bench cluster` (daemons on loopback): failover measured against
the dead node's share, get_many_into over 1, 2 and 4 targets; and `bench trace` through a
cluster URL."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from kvoffload.bench.cluster import live as cluster_live
from kvoffload.cli import main

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_failover_is_measured_against_the_dead_nodes_share() -> None:
    # With one replica a SIGKILLed node's share misses; the measure says how much, and the
    # reads route around it (a finite failover time: some call stopped waiting on it).
    one = cluster_live.measure_failover(signal.SIGKILL, 1, 1.0, window_s=1.0, seed=1)
    assert one.calls > 0 and one.took_s != float("inf")
    assert 0.3 < one.expected < 1.0 and one.hit_ratio == pytest.approx(one.expected, abs=1e-9)
    two = cluster_live.measure_failover(signal.SIGKILL, 2, 1.0, window_s=1.0, seed=2)
    assert two.expected == 1.0 and two.hit_ratio == 1.0


def test_get_many_into_rows_over_1_2_and_4_targets() -> None:
    rows = {r.case: r for r in cluster_live.throughput_rows(blocks=32, rounds=1, passes=1)}
    assert set(rows) == {f"get_many_into/2MiB/{n}target{'s' * (n > 1)}" for n in (1, 2, 4)}
    assert all(r.unit == "GB/s" and r.value > 0 and r.ref_value for r in rows.values())
    assert rows["get_many_into/2MiB/4targets"].ref == "1 target"
    assert "per target GB/s" in rows["get_many_into/2MiB/4targets"].note


def test_the_trace_bench_replays_through_a_cluster_url(tmp_path: Path) -> None:
    # Everything above the SDK takes a cluster URL unchanged: here `bench trace --url`.
    out = tmp_path / "trace.json"
    with cluster_live.loopback_nodes(2, "32MiB") as nodes:
        url = "cluster://" + ",".join(n.address for n in nodes) + "?replicas=2"
        assert main(["bench", "trace", "--url", url, "--sessions", "3", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    (run,) = data["details"]["runs"]
    assert data["details"]["url"] == url and run["hit_tokens"] > 0
    assert run["verified_blocks"] * data["details"]["block_tokens"] == run["hit_tokens"]
