"""`kvoffload bench ssd --restart only`: the restart rows, with a real `kvoffload serve` on a
store of blocks with metadata that it announces while serving."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload.bench.micro.ssd_bench import run

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_restart_rows_time_the_open_the_listing_and_a_daemon(tmp_path: Path) -> None:
    result = run(directory=str(tmp_path), entries=3000, restart="only")
    rows = {r.case: r for r in result.rows}
    assert {"restart/3k", "restart_journal/3k", "restart_announce/3k",
            "restart_announce_cpu/3k", "restart_announce_lock/3k", "restart_serve/3k",
            "restart_serve_announce/3k"} <= set(rows)  # fmt: skip
    assert not any(case.startswith(("read", "write")) for case in rows)  # only the restart rows
    assert rows["restart_serve/3k"].value > 0 and rows["restart_serve/3k"].ref == "goal_5s"
    # The daemon's announce thread logged its 3000 blocks (the row exists only then).
    assert "(3000 blocks" in rows["restart_serve_announce/3k"].note
    assert rows["restart_announce_lock/3k"].value >= 0
    assert not list(tmp_path.glob("kvoffload-bench-ssd-*"))  # cleaned up
