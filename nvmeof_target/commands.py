"""`kvoffload serve`: the daemon package's command."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from kvoffload.errors import KVOffloadError
from kvoffload.nvmeof_target.config import Config, build_flag_parser, load_config
from kvoffload.nvmeof_target.server import serve_one
from kvoffload.nvmeof_target.workers import supervise

__all__ = ["add_commands", "run", "serve"]


def serve(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> int:
    """`kvoffload serve [flags]`: it parses its own flags, which feed load_config's precedence
    rules; returns the exit status."""
    try:
        config = load_config(None, os.environ if environ is None else environ, list(argv))
        return run(config)
    except KVOffloadError as exc:
        print(f"kvoffload serve: {exc}", file=sys.stderr, flush=True)
        return 2
    except OSError as exc:  # a port in use, an unreadable certificate
        print(f"kvoffload serve: {exc}", file=sys.stderr, flush=True)
        return 2


def run(config: Config) -> int:
    """Serve until SIGTERM/SIGINT, in this process or as `server.workers` shard processes."""
    if config.server.workers != 1:
        return supervise(config)
    return serve_one(config)


def add_commands(sub: argparse._SubParsersAction[Any]) -> None:
    # Registered for `kvoffload --help` and `kvoffload serve --help`; the root CLI hands
    # `serve`'s arguments to `serve` unparsed.
    sub.add_parser(
        "serve",
        parents=[build_flag_parser(add_help=False)],
        help="run the storage daemon (native protocol on 127.0.0.1:7480, NVMe/TCP KV on :4420, "
        "metrics on :9480)",
        description=build_flag_parser().description,
    )
