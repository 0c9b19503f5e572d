"""deploy/grafana and deploy/prometheus against the real thing: every metric the dashboard and
the alert rules name is one a real daemon exports after real traffic; every panel's query is
evaluated by a real Prometheus (Debian's `prometheus`) scraping two real daemons, with the
dashboard's node and job variables set as Grafana sets them; the alert rules pass `promtool
check rules` and their own `promtool test rules` cases. Without Debian's `prometheus` package
(`.ci/deps` installs it) these tests fail and say why."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload.client_sdk import Client

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvoffload.json"
ALERTS = ROOT / "deploy" / "prometheus" / "kvoffload-alerts.yml"
ALERT_TESTS = ROOT / "deploy" / "prometheus" / "kvoffload-alerts.test.yml"
SCRAPE_S = 1
# Grafana's $__rate_interval is at least four scrape intervals; more here, so that a scrape
# late on the shared cores leaves two samples in every window.
RATE_INTERVAL = f"{10 * SCRAPE_S}s"
# Panels that must show data while the daemons serve traffic (the rest may be empty: no
# errors, no tenants, nothing corrupt).
MUST_HAVE_DATA = {
    "Nodes up",
    "Hit ratio",
    "Requests/s",
    "In",
    "Out",
    "p99 latency",
    "Hit ratio per tier",
    "Hit ratio per node",
    "Bytes in and out per node",
    "Requests/s by operation",
    "Request latency percentiles",
    "DRAM and SSD fill per node",
    "Evictions, demotions, promotions",
    "Usage per tenant",
    "Open connections",
    "Event lag",
    "Events published/s",
}
# PromQL words that are not metric names.
_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or"}
_WORDS |= {"unless", "offset", "inf", "nan"}
Start = Callable[..., Any]  # the `start_daemon` fixture (conftest.py) -> Daemon


def _binary(name: str) -> str:
    """A check that did not run has not passed: a missing binary fails, saying why."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"{name} is not installed: `apt-get install prometheus` (.ci/deps does this when it "
            "runs as root)"
        )
    return path


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings (label values, regexes)
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range durations
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        word, rest = match.group(), expr[match.end() :].lstrip()
        if rest.startswith("(") or word.lower() in _WORDS:
            continue  # a function, or an operator
        names.add(word)
    return names


def test_metric_names_are_found_in_promql() -> None:
    expr = (
        'sum by (tier) (rate(kvoffload_tier_hits_total{job=~"$job", a="x{y}"}[5s])) / on() '
        "group_left() sum(rate(kvoffload_engine_gets_total[1m])) > bool 0 and up"
    )
    assert metric_names(expr) == {"kvoffload_tier_hits_total", "kvoffload_engine_gets_total", "up"}


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expression) of every query of the dashboard."""
    board = json.loads(DASHBOARD.read_text())
    queries = []
    for panel in board["panels"]:
        for target in panel.get("targets", ()):
            queries.append((panel["title"], target["expr"]))
    return queries


def alert_exprs() -> list[str]:
    return re.findall(r"expr: \|\n((?:          .*\n)+)|expr: (.+)\n", ALERTS.read_text())


def exported_names(text: str) -> set[str]:
    """Every sample name a /metrics page can hold: its samples, and the families it declares
    (a labelled counter that has counted nothing yet is declared without samples)."""
    names = {line.split("{")[0].split()[0] for line in text.splitlines() if line[:1].isalpha()}
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        if kind == "counter":
            names.add(name if name.endswith("_total") else f"{name}_total")
        elif kind == "histogram":
            names.update(f"{name}{s}" for s in ("_bucket", "_count", "_sum"))
        else:
            names.add(name)
    return names


class Traffic:
    """Puts and gets against each URL (some misses), paced, until stopped."""

    def __init__(self, *urls: str) -> None:
        self._stop = threading.Event()
        self.errors: list[BaseException] = []
        self._threads = [threading.Thread(target=self._run, args=(u,), daemon=True) for u in urls]
        for thread in self._threads:
            thread.start()

    def _run(self, url: str) -> None:
        keys = [os.urandom(16) for _ in range(32)]
        value = os.urandom(128 * 1024)
        try:
            with Client.connect(url) as client:
                while not self._stop.is_set():
                    for key in keys[:24]:
                        client.put(key, value)
                    for key in keys:
                        client.get(key)
                    self._stop.wait(0.05)  # leave the shared cores some air
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)
        assert not self.errors, self.errors


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Prometheus:
    """Debian's prometheus on 127.0.0.1, scraping `targets` as job "kvoffload"."""

    def __init__(self, home: Path, targets: list[str]) -> None:
        config = home / "prometheus.yml"
        config.write_text(
            f"global:\n  scrape_interval: {SCRAPE_S}s\n  evaluation_interval: {SCRAPE_S}s\n"
            f"rule_files:\n  - {ALERTS}\n"
            "scrape_configs:\n  - job_name: kvoffload\n    static_configs:\n"
            f"      - targets: [{', '.join(repr(t) for t in targets)}]\n"
        )
        self.base = f"http://127.0.0.1:{_free_port()}"
        self.log = (home / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [
                _binary("prometheus"),
                f"--config.file={config}",
                f"--storage.tsdb.path={home / 'tsdb'}",
                f"--web.listen-address={self.base.removeprefix('http://')}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.wait_for("ready", lambda: self._get("/-/ready") is not None)

    def _get(self, path: str) -> bytes | None:
        try:
            with urllib.request.urlopen(self.base + path, timeout=5) as answer:
                return bytes(answer.read())
        except OSError:
            return None

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.base}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as exc:  # a bad query: 400 with the error in the body
            return json.loads(exc.read())

    def query(self, expr: str) -> Any:
        return self.api("query", query=expr)

    def wait_for(self, what: str, ok: Callable[[], bool], timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while not ok():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"prometheus: {what} not seen")
            time.sleep(0.25)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[list[str]], Prometheus]]:
    started: list[Prometheus] = []

    def start(targets: list[str]) -> Prometheus:
        home = tmp_path / f"prometheus{len(started)}"
        home.mkdir()
        started.append(Prometheus(home, targets))
        return started[-1]

    yield start
    for server in started:
        server.stop()


def _instantiate(expr: str, job: str, instance: str) -> str:
    """The query as Grafana sends it, with the variables' values in."""
    return (
        expr.replace("$__rate_interval", RATE_INTERVAL)
        .replace("$job", job)
        .replace("$instance", instance)
    )


def _samples(answer: Any) -> list[Any]:
    assert answer["status"] == "success", answer
    result = answer["data"]["result"]
    return list(result) if answer["data"]["resultType"] == "vector" else [result]


def _finite(answer: Any) -> bool:
    samples = _samples(answer)
    return bool(samples) and all(math.isfinite(float(s["value"][1])) for s in samples)


def test_dashboard_queries_run_on_prometheus_scraping_real_daemons(
    start_daemon: Start, prometheus: Callable[[list[str]], Prometheus]
) -> None:
    # A cluster of two: one with a small DRAM tier over an SSD tier (evictions, demotions,
    # SSD hits) that publishes KV events, one DRAM only.
    a = start_daemon("--dram", "2MiB", "--ssd", "16MiB", "--events", "tcp://127.0.0.1:0")
    b = start_daemon("--events", "tcp://127.0.0.1:0")
    traffic = Traffic(a.url(), b.url())
    try:
        used = {name for _, expr in dashboard_queries() for name in metric_names(expr)}
        used |= {name for parts in alert_exprs() for name in metric_names("".join(parts))}
        assert "kvoffload_request_seconds_bucket" in used and "up" in used  # the parse works
        exported: set[str] = set()

        def served() -> bool:  # after some real traffic: gets and puts answered
            with urllib.request.urlopen(a.metrics_url, timeout=10) as answer:
                text = answer.read().decode()
            exported.update(exported_names(text))
            return 'op="get",status="ok"' in text and 'op="put",status="ok"' in text

        deadline = time.monotonic() + 30
        while not served():
            assert time.monotonic() < deadline, "no traffic on the daemon's metrics"
            time.sleep(0.2)
        assert used - {"up"} <= exported, sorted(used - {"up"} - exported)

        nodes = [f"127.0.0.1:{a.ports['metrics']}", f"127.0.0.1:{b.ports['metrics']}"]
        server = prometheus(nodes)
        server.wait_for(
            "both nodes' samples",
            lambda: sorted(server.api("label/instance/values")["data"]) == sorted(nodes),
        )
        # The variables' own queries (label_values): both nodes of the job are offered.
        values = server.api(
            "label/instance/values", **{"match[]": 'kvoffload_requests_total{job=~"kvoffload"}'}
        )
        assert sorted(values["data"]) == sorted(nodes)
        jobs = server.api("label/job/values", **{"match[]": "kvoffload_requests_total"})
        assert jobs["data"] == ["kvoffload"]

        everything = ("kvoffload", ".*")  # one job chosen; every node ("All")
        for title, expr in dashboard_queries():
            query = _instantiate(expr, *everything)
            if title in MUST_HAVE_DATA:
                server.wait_for(f"{title}: {query}", lambda q=query: _finite(server.query(q)))
            else:
                _samples(server.query(query))  # it runs; it may be empty
        # One node chosen: a per-node panel shows that node only; All shows both.
        per_node = next(e for t, e in dashboard_queries() if t == "Hit ratio per node")
        for chosen, expected in ((nodes[0], [nodes[0]]), (".*", sorted(nodes))):
            query = _instantiate(per_node, "kvoffload", chosen)

            def shown(q: str = query, expected: list[str] = expected) -> bool:
                found = sorted(s["metric"]["instance"] for s in _samples(server.query(q)))
                assert set(found) <= set(expected), found  # never a node not chosen
                return found == expected

            server.wait_for(f"{expected} in {query}", shown)
        # The alert rules load, and none fires on healthy nodes.
        rules = server.api("rules")["data"]["groups"]
        assert {r["name"] for g in rules for r in g["rules"]} >= {"KVOffloadNodeDown"}
        assert all(r["health"] == "ok" for g in rules for r in g["rules"]), rules
        assert server.api("alerts")["data"]["alerts"] == []
    finally:
        traffic.stop()


def test_alert_rules_pass_promtool() -> None:
    check = subprocess.run(
        [_binary("promtool"), "check", "rules", str(ALERTS)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 7 rules found" in check.stdout
    tests = subprocess.run(
        [_binary("promtool"), "test", "rules", str(ALERT_TESTS)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert tests.returncode == 0, tests.stdout + tests.stderr
    # Each alert has a case where it fires and one where it does not.
    cases = ALERT_TESTS.read_text()
    for alert in re.findall(r"- alert: (\w+)", ALERTS.read_text()):
        tests_of = re.findall(rf"alertname: {alert}\n\s+exp_alerts:(.*)", cases)
        assert "" in tests_of and " []" in tests_of, (alert, tests_of)


def test_dashboard_is_a_well_formed_grafana_dashboard() -> None:
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] == "kvoffload" and board["schemaVersion"] >= 36
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    for name in ("job", "instance"):  # one node, several, or all of a cluster
        assert variables[name]["multi"] and variables[name]["includeAll"]
        assert variables[name]["allValue"] == ".*"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        mine = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}"
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            # Every query follows the variables, so that a node or a cluster can be chosen.
            assert 'job=~"$job", instance=~"$instance"' in target["expr"], target["expr"]
