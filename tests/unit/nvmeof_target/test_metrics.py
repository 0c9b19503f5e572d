from __future__ import annotations

import socket
import socketserver
import threading
import urllib.request

import pytest
from prometheus_client import generate_latest

from kvoffload.nvmeof_target.metrics import Metrics


def test_engine_counters_are_exported_per_tier() -> None:
    stats = {
        "policy": "lru",
        "puts": 3,
        "hits": 2,
        "tiers": [
            {"name": "dram", "hits": 2, "misses": 1, "used_bytes": 4096, "corrupt_blocks": 1},
            {"name": "ssd", "hits": 5, "used_bytes": 0, "demotions": 7, "io_errors": 2},
        ],
        "tenant_bytes": {"": 4096, "alice": 0},
    }
    metrics = Metrics(lambda: stats)
    metrics.requests.labels("native", "get", "ok").inc()
    text = generate_latest(metrics.registry).decode()
    assert 'kvoffload_tier_hits_total{tier="dram"} 2.0' in text
    assert 'kvoffload_tier_hits_total{tier="ssd"} 5.0' in text
    assert 'kvoffload_tier_corrupt_blocks_total{tier="dram"} 1.0' in text
    assert 'kvoffload_tier_demotions_total{tier="ssd"} 7.0' in text  # a field added later
    # Only grows: a counter (the alert rules take its increase).
    assert 'kvoffload_tier_io_errors_total{tier="ssd"} 2.0' in text
    assert 'kvoffload_tier_used_bytes{tier="dram"} 4096.0' in text  # a gauge
    assert "kvoffload_engine_puts_total 3.0" in text
    assert 'kvoffload_tenant_bytes{tenant="anonymous"} 4096.0' in text
    assert 'kvoffload_requests_total{front="native",op="get",status="ok"} 1.0' in text
    assert "policy" not in text.replace("kvoffload", "")  # strings are not metrics


def test_tenant_labels_can_be_dropped() -> None:
    stats = {"puts": 3, "tenant_bytes": {"alice": 4096}, "ssd_tenant_bytes": {"alice": 8192}}
    text = generate_latest(Metrics(lambda: stats, tenant_labels=False).registry).decode()
    assert "alice" not in text and "kvoffload_tenant_" not in text
    assert "kvoffload_engine_puts_total 3.0" in text
    text = generate_latest(Metrics(lambda: stats).registry).decode()
    assert 'kvoffload_tenant_ssd_bytes{tenant="alice"} 8192.0' in text


def test_hooks_fold_their_counts_in_before_every_scrape() -> None:
    metrics = Metrics(lambda: {})
    folded: list[int] = []

    def fold() -> None:  # as the C hot path's counts are folded in: only when scraped
        folded.append(1)
        metrics.requests.labels("native", "get", "ok").inc(2)
        metrics.latency.labels("native", "get").observe(1e-4)

    metrics.before_collect(fold)
    assert not folded
    text = generate_latest(metrics.registry).decode()
    assert 'kvoffload_requests_total{front="native",op="get",status="ok"} 2.0' in text
    assert 'kvoffload_request_seconds_count{front="native",op="get"} 1.0' in text
    generate_latest(metrics.registry)
    assert len(folded) == 2


def test_traffic_sums_data_requests_failures_and_latency_for_the_stats_reply() -> None:
    metrics = Metrics(lambda: {})
    metrics.requests.labels("native", "put", "ok").inc(3)
    metrics.requests.labels("native", "get", "capacity").inc()  # a failure
    metrics.requests.labels("nvme", "retrieve", "kv_key_not_exists").inc(2)  # misses
    metrics.requests.labels("native", "stats", "ok").inc(5)  # control: `top`'s own asking
    metrics.protocol_errors.labels("nvme").inc()
    metrics.auth_failures.labels("native").inc()
    metrics.bytes_in.labels("native").inc(100)
    metrics.bytes_in.labels("nvme").inc(20)
    metrics.bytes_out.labels("native").inc(7)
    metrics.latency.labels("native", "put").observe(3e-4)
    metrics.latency.labels("native", "put").observe(2)
    metrics.latency.labels("native", "stats").observe(20)  # not in the data histogram

    def fold() -> None:  # the C hot path's counts are folded in first
        metrics.requests.labels("native", "get", "ok").inc(4)

    metrics.before_collect(fold)
    traffic = metrics.traffic()
    assert traffic["requests"] == 3 + 1 + 2 + 4
    assert traffic["errors"] == 1 + 1 + 1
    assert (traffic["bytes_in"], traffic["bytes_out"]) == (120, 7)
    buckets = traffic["latency_buckets"]
    assert isinstance(buckets, dict) and len(buckets) == 15
    assert buckets["0.00025"] == 0 and buckets["0.0005"] == 1
    assert buckets["2.5"] == 2 and buckets["10"] == 2


def test_the_event_feeds_backlog_is_exported() -> None:
    metrics = Metrics(lambda: {})
    metrics.watch_events(lambda: (3, 1.5), lambda: 42)
    text = generate_latest(metrics.registry).decode()
    assert "kvoffload_events_queued 3.0" in text
    assert "kvoffload_events_lag_seconds 1.5" in text
    assert "kvoffload_events_published_total 42.0" in text


def test_close_wakes_the_serving_thread_instead_of_waiting_for_its_poll(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # serve_forever sees a stop request only when its select returns: with an hour between
    # polls, close() ends in time only if it wakes that select (every daemon stop once waited
    # out the default 0.5 s here).
    forever = socketserver.BaseServer.serve_forever
    monkeypatch.setattr(socketserver.BaseServer, "serve_forever",
                        lambda self, poll_interval=0.5: forever(self, 3600))  # fmt: skip
    metrics = Metrics(lambda: {"puts": 1})
    host, port = metrics.serve("127.0.0.1", 0)
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=30) as answer:
        assert b"kvoffload_engine_puts_total 1.0" in answer.read()
    closer = threading.Thread(target=metrics.close, daemon=True)
    closer.start()
    closer.join(60)
    assert not closer.is_alive(), "close() waited for the serving thread's next poll"
    with pytest.raises(OSError):
        socket.create_connection((host, port), timeout=5).close()
