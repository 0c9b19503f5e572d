"""`kvoffload serve` and `kvoffload node-key`: the daemon package's commands."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from kvoffload.errors import InvalidArgumentError, KVOffloadError
from kvoffload.nvmeof_target.cluster.registration import with_node_id
from kvoffload.nvmeof_target.config import Config, build_flag_parser, load_config
from kvoffload.nvmeof_target.server import serve_one
from kvoffload.nvmeof_target.workers import supervise
from kvoffload.wire.hello_auth import node_key

__all__ = ["add_commands", "node_key_command", "run", "serve"]


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
    config = with_node_id(config)
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
    keys = sub.add_parser(
        "node-key",
        help="derive a node's key for a tenant from the tenant's secret (read from stdin)",
        description="Print the key node --node holds for a tenant ([tenants.NAME] node_key), "
        "derived from the tenant's secret (the clients' token), read from standard input (one "
        "line; never an argument, which other users could read). A node configured with its "
        "key alone can authenticate the tenant's clients but cannot pose as them to any "
        "other node.",
    )
    keys.add_argument("--node", required=True, help="the node's id ([cluster] node_id)")
    keys.set_defaults(func=node_key_command)


def node_key_command(args: argparse.Namespace) -> int:
    """Print `args.node`'s key for the secret on stdin.

    Raises:
        InvalidArgumentError: no secret on stdin.
    """
    secret = sys.stdin.readline().rstrip("\r\n")
    if not secret:
        raise InvalidArgumentError("node-key reads the tenant's secret from stdin; got none")
    print(node_key(secret, args.node).hex())
    return 0
