"""The `kvoffload` command line: demo, bench, stats."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence

from rich.console import Console

import kvoffload
from kvoffload.errors import KVOffloadError

__all__ = ["BENCHES", "main"]

# `kvoffload bench <name>`: name -> module defining HELP, add_arguments(parser) and
# run_from_args(args) -> BenchResult. Modules are imported to build the parser, so they must not
# import heavy optional packages (torch, peers) at module level.
BENCHES: dict[str, str] = {
    "engine": "kvoffload.bench.engine",
    "ssd": "kvoffload.bench.ssd",
    "net": "kvoffload.bench.net",
    "codecs": "kvoffload.bench.codecs",
    "nvme": "kvoffload.bench.nvme",
    "trace": "kvoffload.bench.trace",
    "fuzz": "kvoffload.bench.fuzz",
    # Last: it runs the benches above.
    "report": "kvoffload.bench.report",
}


def _console() -> Console:
    console = Console()
    # Piped output gets 80 columns by default, too narrow for the result tables.
    return console if console.is_terminal else Console(width=120)


def _demo(args: argparse.Namespace) -> int:
    from kvoffload.bench import demo

    console = _console()

    if args.synthetic:
        report = demo.run_synthetic(
            args.url,
            turns=args.turns,
            new_tokens=args.new_tokens,
            block_tokens=args.block_tokens,
            console=console,
        )
    else:
        report = demo.run_demo(
            args.url,
            turns=args.turns,
            new_tokens=args.new_tokens,
            block_tokens=args.block_tokens,
            dtype=args.dtype,
            console=console,
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "model": report.model,
                    "url": report.url,
                    "synthetic": report.synthetic,
                    "turns": [vars(t) for t in report.turns],
                    "store": report.store_stats,
                },
                fh,
                indent=2,
                default=str,
            )
    if not report.all_same:
        Console(stderr=True).print("[red]outputs differ between the store and recompute runs[/]")
        return 1
    return 0


def _bench(args: argparse.Namespace) -> int:
    result = importlib.import_module(BENCHES[args.bench]).run_from_args(args)
    result.print(_console())
    if args.json:
        result.write_json(args.json)
    return 0


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


def _fsck(args: argparse.Namespace) -> int:
    from kvoffload.kvstore.ssd.fsck import fsck

    report = fsck(args.directory, rebuild=args.rebuild)
    if args.json:
        print(json.dumps(vars(report), indent=2, default=str))
        return 0 if report.clean or report.rebuilt else 1
    console = _console()
    console.print(f"[bold]fsck[/] {report.directory}  ({report.seconds:.2f} s)")
    console.print(
        f"  checkpoint: {report.checkpoint_records:,} records; journal: "
        f"{report.journal_records:,} records; torn tail: {report.torn_bytes:,} bytes"
    )
    console.print(
        f"  blocks: {report.indexed_blocks:,} indexed, {report.good_blocks:,} verified, "
        f"{len(report.bad_blocks):,} bad"
    )
    for key, reason in report.bad_blocks[:20]:
        console.print(f"  [red]bad[/] {key}: {reason}")
    for note in report.notes:
        console.print(f"  {note}")
    if report.rebuilt:
        console.print("  [green]index rebuilt from slot headers[/]")
    elif report.clean:
        console.print("  [green]clean[/]")
    else:
        console.print("  [yellow]problems found; `kvoffload fsck --rebuild DIR` rebuilds[/]")
    return 0 if report.clean or report.rebuilt else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvoffload", description="KV-cache offload store: demo, benchmarks, stats."
    )
    parser.add_argument("--version", action="version", version=f"kvoffload {kvoffload.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo",
        help="multi-turn chat with SmolLM2-135M, prefix KV served from the store",
        description="Runs a multi-turn chat twice per turn (prefix from the store vs full "
        "recompute) and reports TTFT, hit tokens, bytes moved and whether outputs match.",
    )
    demo.add_argument("--url", help="store URL (default: embedded local://?dram=1GiB)")
    demo.add_argument("--turns", type=int, default=4, help="conversation turns (max 5)")
    demo.add_argument("--new-tokens", type=int, default=32, help="tokens generated per turn")
    demo.add_argument("--block-tokens", type=int, default=16, help="tokens per stored block")
    demo.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="model dtype; bfloat16 rounding can flip near-tie tokens",
    )
    demo.add_argument(
        "--synthetic",
        action="store_true",
        help="random KV, no model, modelled TTFT (needs no torch)",
    )
    demo.add_argument("--json", metavar="FILE", help="also write the per-turn report as JSON")
    demo.set_defaults(func=_demo)

    bench = sub.add_parser("bench", help="benchmarks that measure their reference in the same run")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, module_name in BENCHES.items():
        module = importlib.import_module(module_name)
        parser_ = bench_sub.add_parser(name, help=module.HELP, description=module.__doc__)
        parser_.add_argument("--json", metavar="FILE", help="write results as JSON (DESIGN §9)")
        module.add_arguments(parser_)
        parser_.set_defaults(func=_bench)

    check = sub.add_parser(
        "fsck",
        help="verify a store's journal, checkpoint and slots; --rebuild from slot headers",
        description="Verify a stopped store: replay checkpoint and journal, read back every "
        "block and check its checksum. With --rebuild, reconstruct the index from the slot "
        "headers alone (a fresh checkpoint replaces checkpoint and journals). Exit status 1 "
        "when problems remain.",
    )
    check.add_argument("directory", help="the store's data directory")
    check.add_argument("--rebuild", action="store_true", help="rebuild the index from the slots")
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.set_defaults(func=_fsck)
    from kvoffload.nvmeof_target.config import build_flag_parser

    sub.add_parser(
        "serve",
        parents=[build_flag_parser(add_help=False)],
        help="run the storage daemon (native protocol on 127.0.0.1:7480, NVMe/TCP KV on :4420, "
        "metrics on :9480)",
        description=build_flag_parser().description,
    )

    stats = sub.add_parser(
        "stats",
        help="print a store's counters",
        description="Print the counters of the store at URL.",
    )
    stats.add_argument("url", nargs="?", default="local://", help="store URL")
    stats.add_argument("--json", action="store_true", help="print raw JSON")
    stats.set_defaults(func=_stats)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        # The daemon parses its own flags: they feed load_config's precedence rules.
        from kvoffload.nvmeof_target.server import main as serve

        return serve(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except KVOffloadError as exc:
        Console(stderr=True).print(f"[red]kvoffload: {exc}[/]")
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
