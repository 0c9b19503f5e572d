"""`kvoffload stats URL`: the SDK package's command (it reads any store the SDK can reach)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console

from kvoffload.client_sdk.client import Client
from kvoffload.client_sdk.cluster.status import cluster_status
from kvoffload.wire.membership import redact_url

__all__ = ["add_commands"]


def _stats(args: argparse.Namespace) -> int:
    with Client.connect(args.url) as client:
        stats = client.stats().as_dict()
    if args.json:
        print(json.dumps(stats, indent=2, default=str))
        return 0
    console = Console()
    store = stats.pop("store")
    console.print(f"[bold]store[/] {args.url}")
    assert isinstance(store, dict)
    server = store.pop("server", None)
    if isinstance(server, dict):
        console.print(
            "  daemon: kvoffload {version}, up {uptime_s:,.0f} s, {connections} connection(s), "
            "tenant {tenant!r}".format_map({"tenant": "", "connections": "?", **server})
        )
    for tier in store.pop("tiers", ()):
        console.print(
            f"  tier {tier['name']}: {tier['entries']:,} blocks, "
            f"{tier['used_bytes'] / 2**20:,.1f} / {tier['capacity_bytes'] / 2**20:,.1f} MiB, "
            f"hits {tier['hits']:,}, misses {tier['misses']:,}, evictions {tier['evictions']:,}"
            + (f", slot I/O {tier['io_engine']}" if tier.get("io_engine") else "")
        )
    for name, value in store.items():
        console.print(f"  {name}: {value}")
    return 0


def _cluster_status(args: argparse.Namespace) -> int:
    nodes = cluster_status(args.url, timeout_s=args.timeout, token=args.token, ca=args.ca)
    if args.json:
        print(json.dumps([n.as_dict() for n in nodes], indent=2))
    else:
        _print_cluster(args.url, nodes)
    return 0 if nodes and all(n.up for n in nodes) else 1


def _print_cluster(url: str, nodes: list[Any]) -> None:
    from rich.table import Table

    total = sum(n.weight for n in nodes) or 1.0
    shown = redact_url(url)  # a password in the URL stays off the screen
    table = Table(title=f"cluster {shown}: {sum(n.up for n in nodes)}/{len(nodes)} node(s) up")
    for name in ("node", "address", "share", "health", "used / capacity", "blocks", "hit ratio"):
        table.add_column(name, justify="left" if name in ("node", "address", "health") else "right")
    for n in nodes:
        ratio = n.hit_ratio
        table.add_row(
            n.node_id,
            n.address,
            f"{n.weight / total:.1%}",
            "up" if n.up else f"[red]down[/] {n.error[:60]}",
            f"{n.used_bytes / 2**30:,.2f} / {n.capacity_bytes / 2**30:,.2f} GiB" if n.up else "",
            f"{n.blocks:,}" if n.up else "",
            "" if ratio is None else f"{ratio:.1%}",
        )
    console = Console()
    # Piped output gets 80 columns by default, too narrow for the table.
    (console if console.is_terminal else Console(width=140)).print(table)


def add_commands(sub: argparse._SubParsersAction[Any]) -> None:
    stats = sub.add_parser(
        "stats",
        help="print a store's counters",
        description="Print the counters of the store at URL.",
    )
    stats.add_argument("url", nargs="?", default="local://", help="store URL")
    stats.add_argument("--json", action="store_true", help="print raw JSON")
    stats.set_defaults(func=_stats)

    cluster = sub.add_parser("cluster", help="inspect a cluster of storage nodes")
    cluster_sub = cluster.add_subparsers(dest="cluster_command", required=True)
    status = cluster_sub.add_parser(
        "status",
        help="members, health, capacity and hit ratio of each node",
        description="List a cluster's members (from etcd or a static URL) and ask each for its "
        "stats. Exit status 0 when every member answers, 1 otherwise.",
    )
    status.add_argument(
        "url",
        help="etcd[s]://[USER@]HOST:PORT/NAME, cluster+etcd[s]://... or cluster://h1:p1,...",
    )
    status.add_argument("--timeout", type=float, default=2.0, help="seconds per node (default 2)")
    status.add_argument("--token", default="", help="tenant token the nodes require")
    status.add_argument("--ca", default="", help="CA file of TLS nodes' certificates")
    status.add_argument("--json", action="store_true", help="print raw JSON")
    status.set_defaults(func=_cluster_status)
