"""`kvoffload top URL`: a live terminal view of a node's or a cluster's figures.

Every node is asked for its stats (the SDK's stats request, as `kvoffload stats` does) once per
refresh; two answers make the rates of the last interval: requests, payload bytes in and out,
hit ratio per tier, latency percentiles (from the daemon's latency histogram, interpolated as
Prometheus' `histogram_quantile` does), evictions and errors; DRAM/SSD fill is read as is.
A node that does not answer is shown as down and asked again at the next refresh.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import sys
import termios
import time
import tty
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from kvoffload.client_sdk.client import Client
from kvoffload.client_sdk.cluster.status import members_of
from kvoffload.errors import ConfigError, KVOffloadError

__all__ = ["Figures", "Top", "quantile", "run_top", "shown_url"]

_MEMBERS_EVERY_S = 5.0  # how often a cluster's membership is read again


def shown_url(url: str) -> str:
    """`url` without its user part and query: tokens and passwords stay off the screen."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, tail = rest.partition("/")
    address = netloc.rpartition("@")[2]
    if not slash:
        address = address.partition("?")[0]
    return f"{scheme}{sep}{address}{slash}{tail.partition('?')[0]}"


def _secrets(url: str) -> set[str]:
    """The password and token values a URL holds."""
    scheme, _, rest = url.partition("://")
    user = rest.partition("/")[0].partition("?")[0].rpartition("@")[0]
    found = {user.partition(":")[2]}
    for part in rest.partition("?")[2].split("&"):
        name, _, value = part.partition("=")
        if name in ("token", "password", "seal_key"):
            found.add(value)
    return found - {""}


def quantile(q: float, bounds: Sequence[float], counts: Sequence[float]) -> float | None:
    """The `q` quantile of a histogram given as cumulative `counts` at `bounds` (linear within
    a bucket, as `histogram_quantile`); None when it holds nothing. Observations above the
    last bound are reported as the last bound."""
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    lower, below = 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= rank:
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, count
    return bounds[-1]


@dataclass
class Figures:
    """One node's (or the cluster's summed) counts over one interval, and its fill now."""

    seconds: float = 0.0
    gets: float = 0.0
    hits: float = 0.0
    tier_hits: dict[str, float] = field(default_factory=dict)
    requests: float = 0.0
    bytes_in: float = 0.0
    bytes_out: float = 0.0
    evictions: float = 0.0
    errors: float = 0.0
    bounds: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)  # cumulative counts at `bounds`
    used: dict[str, float] = field(default_factory=dict)
    capacity: dict[str, float] = field(default_factory=dict)

    def add(self, other: Figures) -> None:
        """Sum `other` into this one (a cluster's totals; rates add, ratios re-derive)."""
        self.seconds = max(self.seconds, other.seconds)
        for name in ("gets", "hits", "requests", "bytes_in", "bytes_out", "evictions", "errors"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in (
            (self.tier_hits, other.tier_hits),
            (self.used, other.used),
            (self.capacity, other.capacity),
        ):
            for key, value in theirs.items():
                mine[key] = mine.get(key, 0.0) + value
        if other.bounds and (not self.bounds or self.bounds == other.bounds):
            self.bounds = list(other.bounds)
            mine_counts = self.latency or [0.0] * len(other.latency)
            self.latency = [a + b for a, b in zip(mine_counts, other.latency, strict=True)]

    def rate(self, count: float) -> float | None:
        return count / self.seconds if self.seconds > 0 else None

    def ratio(self, hits: float) -> float | None:
        return hits / self.gets if self.gets > 0 else None

    def percentile(self, q: float) -> float | None:
        return quantile(q, self.bounds, self.latency)


def _number(mapping: Mapping[str, Any], name: str) -> float:
    value = mapping.get(name, 0)
    return float(value) if isinstance(value, (int, float)) else 0.0


def _tiers(store: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    tiers = store.get("tiers")
    if not isinstance(tiers, list):
        return {}
    return {str(t.get("name", "?")): t for t in tiers if isinstance(t, dict)}


def _traffic(store: Mapping[str, Any]) -> Mapping[str, Any]:
    server = store.get("server")
    traffic = server.get("traffic") if isinstance(server, dict) else None
    return traffic if isinstance(traffic, dict) else {}


def _buckets(traffic: Mapping[str, Any]) -> dict[float, float]:
    """The latency histogram of a stats answer's traffic: upper bound -> cumulative count."""
    buckets = traffic.get("latency_buckets")
    if not isinstance(buckets, dict):
        return {}
    out = {}
    for bound, count in buckets.items():
        try:
            out[float(bound)] = float(count)
        except (TypeError, ValueError):
            continue  # a key from a newer daemon that is no bound: not ours to show
    return out


def figures(before: Mapping[str, Any] | None, now: Mapping[str, Any], seconds: float) -> Figures:
    """The figures between two stats answers of one node (`before` None: fill only). A node
    that restarted in between (its counters went back) counts from zero."""
    tiers = _tiers(now)
    out = Figures(
        used={name: _number(t, "used_bytes") for name, t in tiers.items()},
        capacity={name: _number(t, "capacity_bytes") for name, t in tiers.items()},
    )
    if before is None:
        return out
    traffic, was = _traffic(now), _traffic(before)
    restarted = _number(traffic, "requests") < _number(was, "requests") or _number(
        now, "gets"
    ) < _number(before, "gets")
    old_tiers = {} if restarted else _tiers(before)
    if restarted:
        before, was = {}, {}

    def delta(new: Mapping[str, Any], old: Mapping[str, Any], name: str) -> float:
        return max(0.0, _number(new, name) - _number(old, name))

    out.seconds = seconds
    out.gets = delta(now, before, "gets")
    out.hits = delta(now, before, "hits")
    out.evictions = delta(now, before, "evictions")
    out.tier_hits = {n: delta(t, old_tiers.get(n, {}), "hits") for n, t in tiers.items()}
    for name in ("requests", "bytes_in", "bytes_out", "errors"):
        setattr(out, name, delta(traffic, was, name))
    now_buckets, old_buckets = _buckets(traffic), _buckets(was)
    out.bounds = sorted(now_buckets)
    out.latency = [max(0.0, now_buckets[b] - old_buckets.get(b, 0.0)) for b in out.bounds]
    return out


@dataclass
class Node:
    """One node on the screen: its last stats answer, or why there is none."""

    name: str
    url: str  # the kv:// URL it is asked at (may hold a token: never shown)
    address: str
    up: bool = False
    error: str = "not asked yet"
    store: dict[str, Any] | None = None
    at: float = 0.0
    now: Figures = field(default_factory=Figures)


class Top:
    """The nodes of a URL and their figures, sampled on `sample()`."""

    def __init__(self, url: str, *, timeout_s: float = 1.0, token: str = "", ca: str = ""):
        if timeout_s <= 0:
            raise ConfigError(f"timeout must be positive, got {timeout_s}")
        self.url = url
        self.timeout_s = timeout_s
        self._token, self._ca = token, ca
        self.cluster = url.startswith(("cluster://", "cluster+etcd", "etcd://", "etcds://"))
        if not self.cluster and not url.startswith("kv://"):
            raise ConfigError(f"top shows kv:// nodes and cluster URLs, not {shown_url(url)}")
        self.nodes: dict[str, Node] = {}
        self.problem = ""  # why the member list could not be read (etcd down)
        self._members_at = -_MEMBERS_EVERY_S
        self._clients: dict[str, Client] = {}
        self._pool = ThreadPoolExecutor(8, thread_name_prefix="kvoffload-top")

    def _node_url(self, address: str, tls: bool) -> str:
        query = f"timeout={self.timeout_s}&connect_timeout={self.timeout_s}&retries=0"
        if tls:
            query += "&tls=1" + (f"&ca={self._ca}" if self._ca else "")
        if self._token:
            query += f"&token={self._token}"
        return f"kv://{address}?{query}"

    def _refresh_members(self) -> None:
        if not self.cluster:
            if not self.nodes:
                base, _, query = self.url.partition("?")
                given = {part.partition("=")[0] for part in query.split("&") if part}
                # Short deadlines unless the URL sets its own (a repeated parameter is refused).
                ours: dict[str, object] = {"timeout": self.timeout_s}
                ours |= {"connect_timeout": self.timeout_s, "retries": 0, "token": self._token}
                added = [f"{k}={v}" for k, v in ours.items() if v != "" and k not in given]
                url = f"{base}?{'&'.join([query, *added] if query else added)}"
                address = shown_url(base).removeprefix("kv://")
                self.nodes[address] = Node(address, url, address)
            return
        if time.monotonic() - self._members_at < _MEMBERS_EVERY_S:
            return
        try:
            _, members = members_of(self.url, timeout_s=self.timeout_s)
        except KVOffloadError as exc:
            self.problem = f"members unknown: {exc}"  # keep showing the nodes known so far
            return
        self._members_at = time.monotonic()
        self.problem = ""
        seen: dict[str, Node] = {}
        for member in members:
            address = member.fronts.get("native") or member.fronts.get("native+tls", "")
            tls = "native" not in member.fronts and "native+tls" in member.fronts
            node = self.nodes.get(member.node_id)
            url = self._node_url(address, tls) if address else ""
            if node is None or node.url != url:
                node = Node(member.node_id, url, address, error="no native front")
            seen[member.node_id] = node
        for name in set(self.nodes) - set(seen):
            self._forget(self.nodes[name].url)
        self.nodes = seen

    def _forget(self, url: str) -> None:
        client = self._clients.pop(url, None)
        if client is not None:
            with contextlib.suppress(KVOffloadError):  # a connection already gone
                client.close()

    def _ask(self, node: Node) -> tuple[dict[str, Any] | None, str]:
        if not node.url:
            return None, "no native front"
        try:
            client = self._clients.get(node.url)
            if client is None:
                client = self._clients[node.url] = Client.connect(node.url)
            return dict(client.stats().store), ""
        except KVOffloadError as exc:
            self._forget(node.url)  # a fresh connection next time
            return None, self._scrubbed(str(exc) or type(exc).__name__, node.url)

    def _scrubbed(self, message: str, url: str) -> str:
        """`message` without the URL's query or the token (an error may quote its URL)."""
        message = message.replace(url, shown_url(url))
        for secret in {self._token, *_secrets(self.url)} - {""}:
            message = message.replace(secret, "***")
        return message

    def sample(self) -> list[Node]:
        """Ask every node for its stats (in parallel) and update their figures."""
        self._refresh_members()
        nodes = sorted(self.nodes.values(), key=lambda n: n.name)
        answers = list(self._pool.map(self._ask, nodes))
        at = time.monotonic()
        for node, (store, error) in zip(nodes, answers, strict=True):
            if store is None:
                node.up, node.error, node.store, node.now = False, error, None, Figures()
                continue
            seconds = at - node.at if node.store is not None else 0.0
            node.now = figures(node.store, store, seconds)
            node.up, node.error, node.store, node.at = True, "", store, at
        return nodes

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for url in list(self._clients):
            self._forget(url)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _bytes_rate(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1e9:.2f} GB/s" if value >= 1e8 else f"{value / 1e6:.1f} MB/s"


def _per_s(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.2f} ms"


def render(top: Top, nodes: Sequence[Node], interval_s: float, live: bool = True) -> Table:
    """The screen: one row per node and the cluster's totals (`live`: with the keys' help)."""
    tiers = sorted({t for n in nodes for t in n.now.capacity}, key=lambda t: (t != "dram", t))
    up = sum(n.up for n in nodes)
    title = f"kvoffload top  {shown_url(top.url)}  {up}/{len(nodes)} up  every {interval_s:g} s"
    if top.problem:
        title += f"  ({top.problem})"
    table = Table(title=title, caption="q or Ctrl-C to quit" if live else None, expand=False)
    table.add_column("node", no_wrap=True)
    table.add_column("state", no_wrap=True)
    for name in ("ops/s", "in", "out", "hit"):
        table.add_column(name, justify="right", no_wrap=True)
    for tier in tiers:
        table.add_column(f"{tier} hit", justify="right", no_wrap=True)
    for name in ("p50", "p99"):
        table.add_column(name, justify="right", no_wrap=True)
    for tier in tiers:
        table.add_column(f"{tier} fill", justify="right", no_wrap=True)
    for name in ("evict/s", "err/s"):
        table.add_column(name, justify="right", no_wrap=True)

    def row(name: str, state: str, f: Figures, style: str = "") -> None:
        cells = [name, state, _per_s(f.rate(f.requests))]
        cells += [_bytes_rate(f.rate(f.bytes_in)), _bytes_rate(f.rate(f.bytes_out))]
        cells.append(_pct(f.ratio(f.hits)))
        cells += [_pct(f.ratio(f.tier_hits[t])) if t in f.tier_hits else "-" for t in tiers]
        cells += [_ms(f.percentile(0.5)), _ms(f.percentile(0.99))]
        cells += [_pct(f.used[t] / f.capacity[t]) if f.capacity.get(t) else "-" for t in tiers]
        cells += [_per_s(f.rate(f.evictions)), _per_s(f.rate(f.errors))]
        table.add_row(*cells, style=style)

    total = Figures()
    for node in nodes:
        if node.up:
            total.add(node.now)
            row(node.name, "up", node.now)
        else:
            table.add_row(node.name, f"[red]DOWN[/] {node.error[:60]}")
    if len(nodes) > 1 or top.cluster:
        row("cluster", f"{up}/{len(nodes)} up", total, style="bold")
    return table


def _wait_for_quit(fd: int | None, seconds: float) -> bool:
    """Wait up to `seconds`; True when `q` was typed on `fd`."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if fd is None:
            time.sleep(left)
            return False
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            typed = os.read(fd, 64)
            if not typed or b"q" in typed.lower():
                return True  # `q`, or the terminal went away
    return False


def _live(top: Top, console: Console, interval_s: float) -> int:
    fd = sys.stdin.fileno() if sys.stdin.isatty() else None
    saved = termios.tcgetattr(fd) if fd is not None else None
    try:
        if fd is not None:
            tty.setcbreak(fd)  # keys arrive one by one, unechoed; Ctrl-C still interrupts
        with Live(console=console, screen=True, auto_refresh=False) as live:
            while True:
                started = time.monotonic()
                live.update(render(top, top.sample(), interval_s), refresh=True)
                if _wait_for_quit(fd, interval_s - (time.monotonic() - started)):
                    return 0
    except KeyboardInterrupt:
        return 0
    finally:
        if fd is not None and saved is not None:
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _plain(top: Top, console: Console, interval_s: float, once: bool) -> int:
    try:
        top.sample()
        while True:
            time.sleep(interval_s)
            console.print(render(top, top.sample(), interval_s, live=False))
            if once:
                return 0
    except KeyboardInterrupt:
        return 0


def run_top(
    url: str,
    *,
    interval_s: float = 1.0,
    once: bool = False,
    timeout_s: float = 1.0,
    token: str = "",
    ca: str = "",
    console: Console | None = None,
    live: Callable[[Console], bool] = lambda c: c.is_terminal,
) -> int:
    """Show `url`'s figures every `interval_s` until `q` or Ctrl-C; `once` (or output that is
    not a terminal) prints plain tables instead of a live screen, one after the first interval
    with `once`.

    Raises:
        ConfigError: a URL that names no node or cluster, or a bad interval or timeout.
    """
    if interval_s <= 0:
        raise ConfigError(f"interval must be positive, got {interval_s}")
    top = Top(url, timeout_s=timeout_s, token=token, ca=ca)
    console = console or Console()
    # A node that is down is shown as down: the SDK's warnings about it (its loggers are all
    # under "kvoffload") would only scribble over the screen.
    sdk_log = logging.getLogger("kvoffload")
    level = sdk_log.level
    sdk_log.setLevel(logging.ERROR)
    try:
        if once or not live(console):
            if not console.is_terminal:
                console = Console(width=200, color_system=None)  # plain text, one line a row
            return _plain(top, console, interval_s, once)
        return _live(top, console, interval_s)
    finally:
        sdk_log.setLevel(level)
        top.close()
