"""`kvoffload fsck`: the engine package's command."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvoffload.kvstore.ssd.fsck import FsckReport, fsck

__all__ = ["add_commands"]


def _stores(directory: str) -> tuple[list[str], list[str]]:
    """The store in `directory`, or each shard's (``shard-<i>``, a multi-worker daemon's, as
    many as its ``shards.json`` says): (stores to check, shards that are missing)."""
    root = Path(directory)
    try:
        count = int(json.loads((root / "shards.json").read_text())["shards"])
    except (OSError, ValueError, KeyError, TypeError):
        count = 0
    found = [p for p in root.glob("shard-*") if p.is_dir() and p.name[6:].isdigit()]
    count = max([count, *(int(p.name[6:]) + 1 for p in found)])
    if not count:
        return [directory], []
    shards = [root / f"shard-{i}" for i in range(count)]
    return [str(p) for p in shards if p.is_dir()], [str(p) for p in shards if not p.is_dir()]


def _fsck(args: argparse.Namespace) -> int:
    stores, missing = _stores(args.directory)
    reports = [fsck(store, rebuild=args.rebuild) for store in stores]
    if args.json:
        found = [vars(r) for r in reports]
        sharded = {"shards": found, "missing": missing}
        print(json.dumps(sharded if missing or len(found) > 1 else found[0], indent=2, default=str))
    else:
        for report in reports:
            _print(report)
        for path in missing:
            print(f"fsck {path}\n  missing: the store has this shard, its directory is gone")
    return 0 if not missing and all(r.clean or r.rebuilt for r in reports) else 1


def _print(report: FsckReport) -> None:
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


def add_commands(sub: argparse._SubParsersAction[Any]) -> None:
    check = sub.add_parser(
        "fsck",
        help="verify a store's journal, checkpoint and slots; --rebuild from slot headers",
        description="Verify a stopped store: replay checkpoint and journal, read back every "
        "block and check its checksum. With --rebuild, reconstruct the index from the slot "
        "headers alone (a fresh checkpoint replaces checkpoint and journals). Exit status 1 "
        "when problems remain.",
    )
    check.add_argument(
        "directory",
        help="the store's data directory (a multi-worker daemon's: every shard-<i> in it)",
    )
    check.add_argument("--rebuild", action="store_true", help="rebuild the index from the slots")
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.set_defaults(func=_fsck)
