"""`kvoffload demo` and `kvoffload bench ...`: the bench package's commands."""

from __future__ import annotations

import argparse
import importlib
import json
from typing import Any

from rich.console import Console

from kvoffload.bench.demo import chat as demo
from kvoffload.bench.registry import BENCHES

__all__ = ["add_commands", "console"]


def console() -> Console:
    out = Console()
    # Piped output gets 80 columns by default, too narrow for the result tables.
    return out if out.is_terminal else Console(width=120)


def _demo(args: argparse.Namespace) -> int:
    if args.synthetic:
        report = demo.run_synthetic(
            args.url,
            turns=args.turns,
            new_tokens=args.new_tokens,
            block_tokens=args.block_tokens,
            console=console(),
        )
    else:
        report = demo.run_demo(
            args.url,
            turns=args.turns,
            new_tokens=args.new_tokens,
            block_tokens=args.block_tokens,
            dtype=args.dtype,
            console=console(),
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
    result.print(console())
    if args.json:
        result.write_json(args.json)
    return 0


def add_commands(sub: argparse._SubParsersAction[Any]) -> None:
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
