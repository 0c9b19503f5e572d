"""`kvoffload fsck`: the engine package's command."""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["add_commands"]


def _fsck(args: argparse.Namespace) -> int:
    from kvoffload.kvstore.ssd.fsck import fsck

    report = fsck(args.directory, rebuild=args.rebuild)
    if args.json:
        print(json.dumps(vars(report), indent=2, default=str))
        return 0 if report.clean or report.rebuilt else 1
    print(f"fsck {report.directory}  ({report.seconds:.2f} s)")
    print(
        f"  checkpoint: {report.checkpoint_records:,} records; journal: "
        f"{report.journal_records:,} records; torn tail: {report.torn_bytes:,} bytes"
    )
    print(
        f"  blocks: {report.indexed_blocks:,} indexed, {report.good_blocks:,} verified, "
        f"{len(report.bad_blocks):,} bad"
    )
    for key, reason in report.bad_blocks[:20]:
        print(f"  bad {key}: {reason}")
    for note in report.notes:
        print(f"  {note}")
    if report.rebuilt:
        print("  index rebuilt from slot headers")
    elif report.clean:
        print("  clean")
    else:
        print("  problems found; `kvoffload fsck --rebuild DIR` rebuilds")
    return 0 if report.clean or report.rebuilt else 1


def add_commands(sub: argparse._SubParsersAction[Any]) -> None:
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
