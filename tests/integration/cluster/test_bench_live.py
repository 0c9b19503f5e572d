"""The live rows of `kvoffload bench cluster` (daemons on loopback): failover measured against
the dead node's share, get_many_into over 1, 2 and 4 targets; `bench trace` through a cluster
URL; and `bench trace --live cluster`: a Mooncake slice replayed through `cluster+etcd://` to 3
nodes in network namespaces while one is SIGKILLed or blackholed (root; a CI slice of a few
seconds each)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from kvoffload.bench.cluster import live as cluster_live
from kvoffload.bench.cluster.faults import NetnsCluster
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


TRACE = (
    Path(__file__).resolve().parents[3] / "bench/data/mooncake-fast25/conversation_trace.jsonl.xz"
)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


@needs_root
@pytest.mark.parametrize("fault", ["kill", "blackhole"])
def test_a_live_replay_through_a_netns_cluster_rides_out_a_fault(
    tmp_path: Path, fault: str
) -> None:
    # 100 s of the trace at 20x (~290 requests in 5 s), node 1 faulted 2 s in: no load
    # fails, no block is wrong, no put raises (the replay's keys are content-named:
    # immutable=1, issue 32), the windows around the fault are reported, nothing is left.
    out = tmp_path / "live.json"
    args = ["bench", "trace", "--trace", str(TRACE), "--window", "0:100", "--block-tokens",
            "512", "--live", "cluster", "--speedup", "20", "--workers", "8", "--fault", fault,
            "--fault-at", "2", "--fault-node", "1", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    data = json.loads(out.read_text())
    live, cluster = data["details"]["live"], data["details"]["cluster"]
    assert live["errors"] == 0 and live["wrong_blocks"] == 0, live["messages"]
    assert data["details"]["url"].endswith("&immutable=1")
    assert live["store_errors"] == 0, live["store_messages"]
    assert live["requests"] > 200 and live["hit_blocks"] > 0
    assert cluster["faults"] == [{"fault": fault, "node": 1, "node_id": cluster["nodes"][1]["id"]}]
    windows = live["windows"]
    assert windows["at_s"] == live["events"][fault] and windows["before_p99_ms"] > 0
    ks = [w["k"] for w in windows["windows"]]
    assert ks[0] < 0 <= ks[-1] and ks == list(range(ks[0], ks[-1] + 1))
    assert {"live/before_p99", "live/after_p99", "live/recovery"} <= {
        r["case"] for r in data["rows"]
    }
    assert not {n["netns"] for n in cluster["nodes"]} & _namespaces()


@needs_root
def test_the_netns_cluster_is_removed_on_ctrl_c() -> None:
    with pytest.raises(KeyboardInterrupt), NetnsCluster(2, "16MiB") as cluster:
        names = {n.host.netns for n in cluster.nodes}
        procs = [n.proc for n in cluster.nodes]
        assert names <= _namespaces()
        raise KeyboardInterrupt
    assert not names & _namespaces()
    assert all(p.poll() is not None for p in procs)


@needs_root
def test_a_second_signal_during_cleanup_is_held_until_everything_is_removed() -> None:
    # As `bench trace --live cluster` does: SIGTERM raises KeyboardInterrupt. A SIGTERM that
    # lands while the cluster is being removed (here: as etcd stops) used to abort the removal.
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        with pytest.raises(KeyboardInterrupt), NetnsCluster(1, "16MiB") as cluster:
            names = {n.host.netns for n in cluster.nodes}
            etcd = cluster._etcd
            assert etcd is not None
            stop = etcd.stop

            def signalled_stop() -> None:
                os.kill(os.getpid(), signal.SIGTERM)
                stop()

            etcd.stop = signalled_stop  # type: ignore[method-assign]
            raise KeyboardInterrupt  # the first Ctrl-C
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert names and not names & _namespaces()
    assert etcd.proc is None or etcd.proc.poll() is not None
