"""`kvoffload bench nvme` runs end to end and writes its rows against the native front."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.bench.micro.nvme_bench import run

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]


def test_rows_cover_every_case() -> None:
    result = run(working_set=1 << 20, rounds=1, sizes={"4KiB": 4 << 10, "1MiB": 1 << 20})
    rows = {r.case: r for r in result.rows}
    for op in ("store", "retrieve", "store_digests", "retrieve_digests"):
        for size in ("4KiB", "1MiB"):
            row = rows[f"{op}/{size}"]
            assert row.unit == "GB/s" and row.value > 0 and row.ref == "native"
            assert row.ref_value and row.ratio


def test_cli_writes_the_json(tmp_path: Path) -> None:
    out = tmp_path / "nvme.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "bench", "nvme", "--working-set", "8"]
        + ["--rounds", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["bench"] == "nvme" and data["machine"]["cpus"]
    cases = {(r["case"], r["ref"]) for r in data["rows"]}
    for size in ("4KiB", "1MiB", "8MiB"):
        assert ("store/" + size, "native") in cases and (
            "retrieve_digests/" + size,
            "native",
        ) in cases
    assert all(r["ratio"] for r in data["rows"])
