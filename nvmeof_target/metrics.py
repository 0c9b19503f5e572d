"""Prometheus metrics: request counters and latencies from the fronts, tier counters from the
engine (read from `Engine.stats()` at scrape time, so they never drift from the engine's own).

Each daemon has its own registry; nothing is registered globally.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["LATENCY_BUCKETS", "Metrics", "NodeMetrics"]

# Per-tier fields of `EngineStats.tiers` that only grow; every other numeric field is a gauge.
# Fields the engine adds later (demotions, promotions, corrupt blocks...) are exported without
# touching this module: unknown numbers become gauges, listed names become counters.
_TIER_COUNTERS = {
    "hits",
    "misses",
    "evictions",
    "bytes_written",
    "bytes_read",
    "corrupt_blocks",
    "demotions",
    "promotions",
    "prefetches",
    "io_errors",
    "io_files_refused",
    "io_memory_refused",
    "io_fixed_file_entries",
    "io_fixed_memory_entries",
    "io_submissions",
    "io_entries",
}
_ENGINE_COUNTERS = {"puts", "gets", "hits", "misses", "deletes", "evictions", "neighbour_evictions",
                    "demotions_background", "demotions_inline", "room_waits",
                    "room_wait_seconds", "listener_errors"}  # fmt: skip
# Latency buckets from 50 µs (a lookup on loopback) to 10 s (an 8 MiB durable put on a busy disk).
_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1, 2.5, 10)
LATENCY_BUCKETS = _BUCKETS  # the request histogram's bounds (the C hot path counts in them too)
# Requests that are not data traffic: `kvoffload top` asks for stats every second, and its own
# requests must not make an idle node look busy (or slow).
_CONTROL_OPS = {"hello", "auth", "stats", "?"}
# Answers that are not failures: a miss, a conditional store of a key already there, a key sent
# to the worker that does not hold it (the client retries at the right one).
_NOT_ERRORS = {"ok", "kv_key_not_exists", "kv_key_exists", "wrong_shard"}


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], Mapping[str, Any]], tenant_labels: bool) -> None:
        self._stats = stats
        self._tenant_labels = tenant_labels

    def collect(self) -> Iterator[Metric]:
        stats = dict(self._stats())
        tiers = stats.pop("tiers", ())
        tenants = stats.pop("tenant_bytes", {})
        ssd_tenants = stats.pop("ssd_tenant_bytes", {})
        for name, value in stats.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                yield _family(f"kvoffload_engine_{name}", name in _ENGINE_COUNTERS, value)
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for tier in tiers:
            for name, value in tier.items():
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    continue
                family = families.get(name)
                if family is None:
                    family = families[name] = _labelled(f"kvoffload_tier_{name}", name, "tier")
                family.add_metric([str(tier.get("name", "?"))], value)
        yield from families.values()
        if not self._tenant_labels:  # `metrics.tenant_labels = false`: no names, no usage
            return
        for name, doc, values in (
            ("kvoffload_tenant_bytes", "DRAM bytes held per tenant", tenants),
            ("kvoffload_tenant_ssd_bytes", "SSD slot bytes held per tenant", ssd_tenants),
        ):
            held = GaugeMetricFamily(name, doc, labels=["tenant"])
            for tenant, value in values.items():
                held.add_metric([tenant or "anonymous"], value)
            yield held


def _family(name: str, counter: bool, value: float) -> Metric:
    doc = f"engine {name.removeprefix('kvoffload_engine_')}"
    if counter:
        return CounterMetricFamily(name, doc, value=value)
    return GaugeMetricFamily(name, doc, value=value)


def _labelled(name: str, field: str, label: str) -> CounterMetricFamily | GaugeMetricFamily:
    doc = f"per-tier {field}"
    if field in _TIER_COUNTERS:
        return CounterMetricFamily(name, doc, labels=[label])
    return GaugeMetricFamily(name, doc, labels=[label])


class _EventsCollector(Collector):
    """The KV-event feed's backlog, read at scrape time."""

    def __init__(self, backlog: Callable[[], tuple[int, float]], sent: Callable[[], int]) -> None:
        self._backlog, self._sent = backlog, sent

    def collect(self) -> Iterator[Metric]:
        queued, lag = self._backlog()
        yield GaugeMetricFamily(
            "kvoffload_events_queued", "KV events waiting to be published", value=queued
        )
        yield GaugeMetricFamily(
            "kvoffload_events_lag_seconds",
            "Seconds the KV-event feed has been behind the engine (0: nothing queued)",
            value=lag,
        )
        yield CounterMetricFamily(
            "kvoffload_events_published", "KV events published", value=self._sent()
        )


class _BeforeCollect(Collector):
    """Registered first, so it runs before the request metrics are read: folds in what was
    counted outside prometheus (the C hot path's per-connection counts)."""

    def __init__(self) -> None:
        self.hooks: list[Callable[[], None]] = []

    def collect(self) -> Iterator[Metric]:
        for hook in list(self.hooks):
            hook()
        return iter(())


class _Endpoint:
    """A registry served over HTTP (`/metrics`) from a background thread."""

    registry: CollectorRegistry
    _server: WSGIServer | None = None
    _thread: threading.Thread | None = None

    def serve(self, host: str, port: int) -> tuple[str, int]:
        """Serve `/metrics` over HTTP from a background thread; returns the bound address."""
        server, thread = start_http_server(port, addr=host, registry=self.registry)
        self._server, self._thread = server, thread
        bound_host, bound_port = server.server_address[:2]
        return str(bound_host), int(bound_port)

    def close(self) -> None:
        if self._server is not None:
            # The serving thread polls its stop flag every 0.5 s; a listening socket shut down
            # wakes its select now, so a daemon stops without that wait (accept then fails,
            # which socketserver ignores, until the flag set just below is seen).
            # (If that fails, the flag alone still stops the thread, at its next poll.)
            with contextlib.suppress(OSError):
                self._server.socket.shutdown(socket.SHUT_RDWR)
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


class Metrics(_Endpoint):
    """The daemon's metrics registry and its HTTP endpoint."""

    def __init__(
        self, engine_stats: Callable[[], Mapping[str, Any]], tenant_labels: bool = True
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._before = _BeforeCollect()
        r.register(self._before)
        self.requests = Counter(
            "kvoffload_requests", "Requests answered", ["front", "op", "status"], registry=r
        )
        self.latency = Histogram(
            "kvoffload_request_seconds",
            "Time from a request's header to its answer being queued",
            ["front", "op"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.bytes_in = Counter(
            "kvoffload_payload_bytes_in", "Value bytes received", ["front"], registry=r
        )
        self.bytes_out = Counter(
            "kvoffload_payload_bytes_out", "Value bytes sent", ["front"], registry=r
        )
        self.connections = Gauge(
            "kvoffload_connections",
            "Open client connections",
            ["front"],
            registry=r,
            multiprocess_mode="livesum",  # the node's sum over live workers
        )
        self.connections_total = Counter(
            "kvoffload_connections_accepted", "Connections accepted", ["front"], registry=r
        )
        self.refused = Counter(
            "kvoffload_connections_refused",
            "Connections closed by the daemon, by reason",
            ["front", "reason"],
            registry=r,
        )
        self.protocol_errors = Counter(
            "kvoffload_protocol_errors",
            "Connections closed for a protocol error",
            ["front"],
            registry=r,
        )
        self.auth_failures = Counter(
            "kvoffload_auth_failures", "Refused authentications", ["front"], registry=r
        )
        r.register(_EngineCollector(engine_stats, tenant_labels))

    def traffic(self) -> dict[str, object]:
        """This process's request figures since it started, for the stats reply (`kvoffload
        top` turns two of them into rates): payload bytes, data requests answered, failures
        (error answers, protocol errors, refused authentications), and the data requests'
        latency histogram as cumulative counts per finite upper bound (`latency_buckets`, keyed
        by the bound in seconds as text: a map, so a node's shards' answers add up per key)."""
        self.fold_pending()
        requests = errors = 0.0
        for sample in _samples(self.requests):
            if sample.labels["op"] in _CONTROL_OPS:
                continue
            requests += sample.value
            if sample.labels["status"] not in _NOT_ERRORS:
                errors += sample.value
        for counter in (self.protocol_errors, self.auth_failures):
            errors += sum(s.value for s in _samples(counter))
        counts = [0.0] * len(_BUCKETS)
        where = {bound: i for i, bound in enumerate(_BUCKETS)}
        for sample in _samples(self.latency, "_bucket"):
            i = where.get(float(sample.labels["le"]))
            if i is not None and sample.labels["op"] not in _CONTROL_OPS:
                counts[i] += sample.value
        return {
            "bytes_in": int(sum(s.value for s in _samples(self.bytes_in))),
            "bytes_out": int(sum(s.value for s in _samples(self.bytes_out))),
            "requests": int(requests),
            "errors": int(errors),
            "latency_buckets": {f"{b:g}": int(c) for b, c in zip(_BUCKETS, counts, strict=True)},
        }

    def watch_events(
        self, backlog: Callable[[], tuple[int, float]], sent: Callable[[], int]
    ) -> None:
        """Export the KV-event feed's backlog (queued entries, lag) and events published."""
        self.registry.register(_EventsCollector(backlog, sent))

    def before_collect(self, hook: Callable[[], None]) -> None:
        """Run `hook` (on the scraping thread) before every collection of the registry."""
        self._before.hooks.append(hook)

    def fold_pending(self) -> None:
        """Fold in what was counted outside prometheus (the C hot path) now, as a scrape does
        first: a worker of a multi-worker daemon, whose metrics the supervisor reads from the
        multiprocess files, does this when the supervisor asks for its stats."""
        self._before.collect()


def _samples(metric: Counter | Histogram, suffix: str = "_total") -> Iterator[Any]:
    """The samples of one of this process's metrics whose name ends with `suffix`."""
    for family in metric.collect():
        for sample in family.samples:
            if sample.name.endswith(suffix):
                yield sample


class NodeMetrics(_Endpoint):
    """The /metrics of a daemon with several workers: the request metrics every worker writes
    (prometheus-client's multiprocess files under `path`) plus the sum of their engines'
    stats, which `engine_stats` gathers when scraped."""

    def __init__(
        self, path: str, engine_stats: Callable[[], Mapping[str, Any]], tenant_labels: bool = True
    ) -> None:
        from prometheus_client.multiprocess import MultiProcessCollector

        self.registry = CollectorRegistry()
        # The workers' stats are asked for first: a worker folds what its C hot path counted
        # into its files as it answers (`Metrics.fold_pending`), so the files read next count
        # every request answered before the scrape. The engine collector reports those stats.
        latest: list[Mapping[str, Any]] = [{}]

        def ask() -> None:
            latest[0] = engine_stats()

        before = _BeforeCollect()
        before.hooks.append(ask)
        self.registry.register(before)
        MultiProcessCollector(self.registry, path=path)  # type: ignore[no-untyped-call]
        self.registry.register(_EngineCollector(lambda: latest[0], tenant_labels))
