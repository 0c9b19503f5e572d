"""Live replay of a Mooncake slice against a real daemon on 127.0.0.1 (a short slice: CI)."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvoffload.bench.trace.live import LiveResult, live_replay, windows
from kvoffload.bench.trace.model import Workload
from kvoffload.bench.trace.mooncake import read_trace, window
from kvoffload.bench.trace.replay import Payloads
from kvoffload.bench.trace.workload import PROFILES
from kvoffload.cli import main
from kvoffload.client_sdk import Client
from kvoffload.errors import ConfigError

ROOT = Path(__file__).resolve().parents[4]
TRACE = ROOT / "bench" / "data" / "mooncake-fast25" / "conversation_trace.jsonl.xz"
PAYLOAD = 3968


@pytest.fixture(scope="module")
def work() -> Workload:
    return Workload.build(window(read_trace(TRACE), 0, 40), PROFILES["llama-3.1-8b"], 512)


def _arrivals(work: Workload) -> list[float]:
    return [r.arrival for r in work.trace.requests]


def test_a_slice_against_a_daemon_loads_right_bytes_without_errors(
    start_daemon: Callable[..., Any], work: Workload
) -> None:
    daemon = start_daemon("--dram", "8MiB")  # ~2,000 blocks: it evicts
    result = live_replay(daemon.url(), work.namespace, work.chains, _arrivals(work),
                         Payloads(PAYLOAD), speedup=20, workers=4)  # fmt: skip
    summary = result.summary()
    assert result.errors == 0 and result.wrong_blocks == 0, result.messages
    assert summary["requests"] == len(work.chains) > 100
    assert result.hit_blocks.sum() > 0  # block 0 and continued prefixes come back
    assert 0 < summary["load_p50_ms"] <= summary["load_p99_ms"]  # type: ignore[operator]


def test_a_wrong_block_is_counted_not_hit(start_daemon: Callable[..., Any], work: Workload) -> None:
    daemon = start_daemon()
    payloads = Payloads(PAYLOAD)
    first = work.chains[0][0]  # the block every request starts with
    bad = payloads.fresh(first)
    bad[100] ^= 1
    with Client.connect(daemon.url(), namespace=work.namespace) as client:
        client.put(first, bad)
    chains = work.chains[:5]
    result = live_replay(daemon.url(), work.namespace, chains, _arrivals(work)[:5], payloads,
                         speedup=1000, workers=1)  # fmt: skip
    assert result.errors == 0
    # the first request finds it, counts it, does not hit it, and stores the right bytes over it
    assert result.wrong_blocks == 1 and result.hit_blocks[0] == 0
    assert all(h >= 1 for h in result.hit_blocks[1:])


def test_an_unreachable_store_is_counted_not_a_crash(work: Workload) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url, chains, arrivals = f"kv://127.0.0.1:{port}", work.chains[:3], _arrivals(work)[:3]
    result = live_replay(url, work.namespace, chains, arrivals, Payloads(PAYLOAD),
                         speedup=1000, workers=2)  # fmt: skip
    # The SDK answers a lookup it cannot make with a miss (no load: no error); each request's
    # put then raises, counted apart as a store error (served, not offloaded).
    assert result.store_errors == 3 and result.store_messages and result.errors == 0
    assert result.wrong_blocks == 0 and result.hit_blocks.sum() == 0
    with pytest.raises(ConfigError):
        live_replay("kv://127.0.0.1:1", work.namespace, [], [], Payloads(PAYLOAD), speedup=0)


def test_bench_trace_live_cli(start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    daemon = start_daemon()
    out = tmp_path / "live.json"
    args = ["bench", "trace", "--trace", str(TRACE), "--window", "0:20", "--live",
            daemon.url(), "--speedup", "20", "--workers", "4", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    data = json.loads(out.read_text())
    live = data["details"]["live"]
    assert live["errors"] == 0 and live["wrong_blocks"] == 0 and live["speedup"] == 20
    assert {r["case"] for r in data["rows"]} >= {"live/load_p50", "live/load_p99", "live/errors"}


def test_windows_around_a_fault() -> None:
    # 10 requests a second for 6 s, 10 ms each; the fault at 3 s; the window starting at it
    # has one 100 ms load (over 2x the 10 ms before), the next 30 ms (over), then 10 ms again.
    # A load that started before the fault and ended after it (200 ms) counts after it.
    start = np.arange(60) / 10 + 0.05
    load = np.full(60, 0.010)
    load[29], load[31], load[41] = 0.200, 0.100, 0.030
    n = len(start)
    result = LiveResult(load, np.zeros(n), start, np.zeros(n, dtype=np.int64), 10.0, 4, 6.0)
    report = windows(result, 3.0)
    assert report["before_p99_ms"] == pytest.approx(10.0)
    rows = report["windows"]
    assert [w["k"] for w in rows] == [-3, -2, -1, 0, 1, 2]  # type: ignore[index]
    assert [w["requests"] for w in rows] == [10, 10, 9, 11, 10, 10]  # type: ignore[index]
    assert rows[3]["load_p99_ms"] > 100  # type: ignore[index]
    # windows 0 and 1 are over 2x; from 2 s on within
    assert report["back_s"] == 2.0 and report["settled_s"] == 2.0 and report["over_after"] == []
    load[41], load[51] = 0.015, 0.050  # window 1 within; window 2 spikes again
    report = windows(result, 3.0)
    assert report["back_s"] == 1.0 and report["settled_s"] == 3.0 and report["over_after"] == [2]
    load[29], load[31], load[51] = 0.010, 0.015, 0.010
    assert windows(result, 3.0)["back_s"] == 0.0 and windows(result, 3.0)["settled_s"] == 0.0


def test_a_fault_needs_the_cluster_and_a_node_it_has(tmp_path: Path) -> None:
    base = ["bench", "trace", "--trace", str(TRACE), "--window", "0:5", "--block-tokens", "512"]
    assert main([*base, "--live", "kv://127.0.0.1:1", "--fault", "kill"]) == 2
    assert main([*base, "--live", "cluster", "--fault", "kill", "--fault-node", "3"]) == 2
    assert main([*base, "--live", "cluster", "--replicas", "0"]) == 2
    assert main([*base, "--live", "cluster", "--lease-ttl", "1"]) == 2


def test_a_bad_url_is_a_config_error_not_a_count(work: Workload) -> None:
    with pytest.raises(ConfigError):
        live_replay("kv://127.0.0.1:1?retries=x", work.namespace, work.chains[:2],
                    _arrivals(work)[:2], Payloads(PAYLOAD), speedup=1000)  # fmt: skip
