"""`kvoffload stats URL`: the SDK package's command (it reads any store the SDK can reach)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console

__all__ = ["add_commands"]


def _stats(args: argparse.Namespace) -> int:
    from kvoffload.client_sdk import Client

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
        )
    for name, value in store.items():
        console.print(f"  {name}: {value}")
    return 0


def add_commands(sub: argparse._SubParsersAction[Any]) -> None:
    stats = sub.add_parser(
        "stats",
        help="print a store's counters",
        description="Print the counters of the store at URL.",
    )
    stats.add_argument("url", nargs="?", default="local://", help="store URL")
    stats.add_argument("--json", action="store_true", help="print raw JSON")
    stats.set_defaults(func=_stats)
