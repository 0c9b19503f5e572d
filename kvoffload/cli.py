"""The `kvoffload` command: parses arguments and dispatches to each package's commands."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import kvoffload
from kvoffload.bench import commands as bench
from kvoffload.client_sdk import commands as sdk
from kvoffload.errors import KVOffloadError
from kvoffload.kvstore import commands as store
from kvoffload.nvmeof_target import commands as daemon

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvoffload", description="KV-cache offload store: demo, benchmarks, stats."
    )
    parser.add_argument("--version", action="version", version=f"kvoffload {kvoffload.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    bench.add_commands(sub)  # demo, bench
    store.add_commands(sub)  # fsck
    daemon.add_commands(sub)  # serve
    sdk.add_commands(sub)  # stats, cluster, top
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        return daemon.serve(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        code = int(args.func(args))
    except KVOffloadError as exc:
        # Plain stderr: the root stays free of the packages' presentation choices.
        print(f"kvoffload: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
