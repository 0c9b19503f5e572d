"""The live rows of `kvoffload bench cluster` (daemons on loopback): failover measured against
the dead node's share, and get_many_into over 1, 2 and 4 targets."""

from __future__ import annotations

import signal

import pytest

from kvoffload.bench import cluster_live

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_failover_is_measured_against_the_dead_nodes_share() -> None:
    # With one replica a SIGKILLed node's share misses; the measure says how much, and the
    # reads route around it (a finite failover time: some call stopped waiting on it).
    one = cluster_live.measure_failover(signal.SIGKILL, 1, 1.0, window_s=1.0, seed=1)
    assert one.calls > 0 and one.took_s != float("inf")
    assert 0.3 < one.expected < 1.0 and one.hit_ratio == one.expected
    two = cluster_live.measure_failover(signal.SIGKILL, 2, 1.0, window_s=1.0, seed=2)
    assert two.expected == 1.0 and two.hit_ratio == 1.0


def test_get_many_into_rows_over_1_2_and_4_targets() -> None:
    rows = {r.case: r for r in cluster_live.throughput_rows(blocks=32, rounds=1, passes=1)}
    assert set(rows) == {f"get_many_into/2MiB/{n}target{'s' * (n > 1)}" for n in (1, 2, 4)}
    assert all(r.unit == "GB/s" and r.value > 0 and r.ref_value for r in rows.values())
    assert rows["get_many_into/2MiB/4targets"].ref == "1 target"
    assert "per target GB/s" in rows["get_many_into/2MiB/4targets"].note
