"""`kvoffload stats URL`: the SDK package's command (it reads any store the SDK can reach)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console

from kvoffload.client_sdk.client import Client
from kvoffload.client_sdk.cluster.status import cluster_status
from kvoffload.client_sdk.top import run_top
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
        if tier.get("io_rings"):  # the io_uring pool: what the kernel let it register
            console.print(
                "    io_uring: {io_rings} ring(s), {io_rings_with_file} with the slot file, "
                "{io_rings_with_memory} with the arena; refused: files {io_files_refused}, "
                "memory {io_memory_refused}; fixed entries: file {io_fixed_file_entries:,}, "
                "memory {io_fixed_memory_entries:,} of {io_entries:,} in {io_submissions:,} "
                "submissions".format_map(tier)
            )
    for name, value in store.items():
        console.print(f"  {name}: {value}")
    return 0


def _top(args: argparse.Namespace) -> int:
    return run_top(
        args.url,
        interval_s=args.interval,
        once=args.once,
        timeout_s=args.timeout,
        token=args.token,
        ca=args.ca,
    )


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

    top = sub.add_parser(
        "top",
        help="live view of a node's or a cluster's traffic, hit ratio, latency and fill",
        description="Show the figures of the node (kv://HOST:PORT) or cluster (cluster://..., "
        "cluster+etcd[s]://...) at URL, refreshed every interval: per node ops/s, payload "
        "bytes in and out, hit ratio per tier, latency p50/p99, DRAM/SSD fill, evictions and "
        "errors, and the cluster's totals. Keys: q quits (Ctrl-C too). Output that is not a "
        "terminal, or --once, gets plain-text tables instead of a live screen.",
    )
    top.add_argument("url", help="kv://HOST:PORT, cluster://h1:p1,... or cluster+etcd[s]://...")
    top.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    top.add_argument(
        "--once", action="store_true", help="print one table (after one interval) and exit"
    )
    top.add_argument("--timeout", type=float, default=1.0, help="seconds per node (default 1)")
    top.add_argument("--token", default="", help="tenant token the nodes require")
    top.add_argument("--ca", default="", help="CA file of a cluster's TLS nodes' certificates")
    top.set_defaults(func=_top)
