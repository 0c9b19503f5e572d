"""`kvoffload serve`: the daemon package's command."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

__all__ = ["add_commands", "serve"]


def serve(argv: Sequence[str]) -> int:
    """Run the daemon; it parses its own flags, which feed load_config's precedence rules."""
    from kvoffload.nvmeof_target.server import main

    return main(list(argv))


def add_commands(sub: argparse._SubParsersAction[Any]) -> None:
    # Registered for `kvoffload --help` and `kvoffload serve --help`; the root CLI hands
    # `serve`'s arguments to `serve` unparsed.
    from kvoffload.nvmeof_target.config import build_flag_parser

    sub.add_parser(
        "serve",
        parents=[build_flag_parser(add_help=False)],
        help="run the storage daemon (native protocol on 127.0.0.1:7480, NVMe/TCP KV on :4420, "
        "metrics on :9480)",
        description=build_flag_parser().description,
    )
