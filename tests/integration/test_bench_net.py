"""`kvoffload bench net` runs end to end and writes one row per reference (DESIGN §9)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.bench.micro.net import run

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]
HAVE_REDIS = shutil.which("redis-server") is not None and importlib.util.find_spec("redis")


def test_rows_cover_every_case_and_reference() -> None:
    result = run(
        working_set=1 << 20, rounds=1, sizes={"64KiB": 64 << 10}, lookups=5, cpu_requests=2000
    )
    rows = {(r.case, r.ref): r for r in result.rows}
    for op in ("put", "get", "put_pipelined", "get_pipelined"):
        for ref in ("raw_socket", "redis", "lmcache"):
            row = rows[(f"{op}/64KiB", ref)]
            assert row.value > 0 and row.unit == "GB/s"
        assert rows[(f"{op}/64KiB", "raw_socket")].ref_value
        redis = rows[(f"{op}/64KiB", "redis")]
        if HAVE_REDIS:
            assert redis.ref_value and redis.ratio
            assert redis.note == "redis-py + hiredis"  # the test extra installs the C parser
        else:
            assert redis.ref_value is None and "not installed" in redis.note
        lmcache = rows[(f"{op}/64KiB", "lmcache")]
        # Issue 29's goals against lm://: 1.5× at get/64KiB, 1.0× elsewhere.
        assert lmcache.note.endswith("goal ≥ 1.5×" if op == "get" else "goal ≥ 1.0×")
        if importlib.util.find_spec("lmcache") is None:  # measured in the engines suite
            assert lmcache.ref_value is None and "lmcache not installed" in lmcache.note
        else:
            assert lmcache.ref_value and lmcache.note.startswith("LMCache")
    lookup = rows[("lookup/1000keys", "goal_p50")]
    assert lookup.unit == "ms" and lookup.value > 0 and lookup.ref_value == 0.3
    cpu = rows[("daemon_cpu_us/get/64KiB", "raw_socket")]
    # A process spends at least some µs of CPU per request; a wrong pid or field reads 0 or tiny
    # (the raw server's 64 KiB send alone is a kernel copy of several µs).
    assert cpu.unit == "us" and 1 < cpu.value < 100_000
    assert cpu.ref_value is not None and 1 < cpu.ref_value < 100_000
    assert "2,000 gets" in cpu.note and "goal ≤ 1.5×" in cpu.note
    put_cpu = rows[("daemon_cpu_us/put/64KiB", "raw_socket")]
    assert put_cpu.unit == "us" and 1 < put_cpu.value < 100_000
    assert put_cpu.ref_value is not None and 1 < put_cpu.ref_value < 100_000
    assert "2,000 puts" in put_cpu.note
    # 8 client processes against every worker, next to a forking raw server under them.
    mc = rows[("get_mc8/2MiB", "raw_socket_mp")]
    assert mc.unit == "GB/s" and mc.value > 0 and mc.ref_value and mc.ref_value > 0
    scaling = rows[("workers_scaling/2MiB", "workers_1")]
    assert scaling.value == mc.value
    assert scaling.ref_value is None or scaling.ref_value > 0  # None on a one-core machine


def test_cli_writes_the_json(tmp_path: Path) -> None:
    out = tmp_path / "net.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "bench", "net", "--working-set", "1"]
        + ["--rounds", "1", "--cpu-requests", "500", "--no-multi-client", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["bench"] == "net" and data["machine"]["cpus"]
    cases = {(r["case"], r.get("ref")) for r in data["rows"]}
    assert ("get/2MiB", "raw_socket") in cases and ("put/8MiB", "lmcache") in cases
    assert all("ratio" in r for r in data["rows"])
    assert not any(case.startswith("get_mc8") for case, _ in cases)
