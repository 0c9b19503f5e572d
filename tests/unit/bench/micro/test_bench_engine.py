from __future__ import annotations

import json
from pathlib import Path

from kvoffload.bench.micro import engine_bench as engine
from kvoffload.cli import main


def test_engine_bench_rows_and_json(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    assert main(["bench", "engine", "--working-set", "4", "--rounds", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["bench"] == "engine" and data["machine"]["cpus"]
    cases = {row["case"] for row in data["rows"]}
    for op in ("put", "get", "get_into", "client_put_sealed", "client_get_into_sealed"):
        for size in engine.SIZES:
            assert f"{op}/{size}" in cases
    rows = {row["case"]: row for row in data["rows"]}
    for size in engine.SIZES:
        for op in ("client_put", "client_get_into"):
            cost = rows[f"seal_cost/{op}/{size}"]
            assert cost["ref"] == "crc32c"
            assert cost["value"] == rows[f"{op}_sealed/{size}"]["value"]
            assert cost["ref_value"] == rows[f"{op}/{size}"]["value"]
    fill = next(row for row in data["rows"] if row["case"] == "dram_fill/mixed")
    assert fill["value"] >= 0.85 and fill["ref"] == "goal_0.85"
    for row in data["rows"]:
        if row is fill:
            continue
        assert row["ref"] in ("memcpy", "crc32c") and row["unit"] == "GB/s"
        assert row["value"] > 0 and row["ref_value"] > 0
        assert abs(row["ratio"] - row["value"] / row["ref_value"]) < 1e-2


def test_ssd_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "ssd.json"
    # One round of each alternating arm: the rows' shape is what a smoke test checks (the
    # default 3 rounds only steady the medians; 30 s of CI for no assertion).
    argv = ["bench", "ssd", "--dir", str(tmp_path), "--size", "4", "--entries", "2000"]
    assert main([*argv, "--rounds", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = {(r["case"], r["ref"]): r for r in data["rows"]}
    for size in ("128KiB", "2MiB", "8MiB"):
        for op in ("read", "write"):
            assert rows[(f"{op}/{size}", "odirect")]["value"] > 0
            fio = rows[(f"{op}/{size}", "fio")]
            assert fio["ref_value"] is None or fio["ref_value"] > 0
    for label in ("2MiB", "640KiB", "160KiB"):  # the batched reads, a layer part's size too
        assert rows[(f"read_batch/{label}", "odirect")]["value"] > 0
        assert rows[(f"cpu_us/read_batch/{label}", "odirect")]["ref_value"] > 0
        # the least a verified read costs, and the I/O engine the engine's own arm ran against
        assert rows[(f"cpu_us/read_batch/{label}", "odirect_crc")]["ref_value"] > 0
        assert rows[(f"read_batch/{label}", "serial")]["ref_value"] > 0
        engines = {rows[(f"read_batch/{label}", "odirect")]["note"].split(";")[0]}
        assert engines <= {"io_uring", "threads"}
        if engines == {"io_uring"}:
            assert rows[(f"read_batch/{label}", "threads")]["ref_value"] > 0
            # the same ring without its registered slot file and memory
            assert rows[(f"read_batch/{label}", "io_uring_plain")]["ref_value"] > 0
    assert rows[("restart/2k", "goal_5s")]["unit"] == "s"
    assert 0 < rows[("index_bytes/2k", "goal_128B")]["value"] < 4096
    assert not list(tmp_path.glob("kvoffload-bench-ssd-*"))  # cleaned up


def test_ssd_bench_write_rows(tmp_path: Path) -> None:
    # `--write only`: durable 2 MiB puts on each slot I/O engine against raw O_DIRECT pwrite +
    # fdatasync, and the background demotion writer's rate, and nothing else.
    out = tmp_path / "ssd.json"
    argv = ["bench", "ssd", "--dir", str(tmp_path), "--size", "32", "--write", "only"]
    assert main([*argv, "--rounds", "1", "--json", str(out)]) == 0
    rows = {(r["case"], r["ref"]): r for r in json.loads(out.read_text())["rows"]}
    engines = {case.split("/")[0].removeprefix("write_durable_") for case, ref in rows
               if case.startswith("write_durable_")}  # fmt: skip
    assert "threads" in engines and engines <= {"io_uring", "io_uring_plain", "threads"}
    for name in engines:
        raw = rows[(f"write_durable_{name}/2MiB", "odirect")]
        assert raw["value"] > 0 and raw["ref_value"] > 0 and "load average" in raw["note"]
        assert rows[(f"cpu_us/write_durable_{name}/2MiB", "odirect")]["value"] > 0
        demote = [r for (case, _), r in rows.items() if case == f"demote_{name}/2MiB"]
        # one row against each other engine
        assert len(demote) == len(engines) - 1 and demote[0]["value"] > 0
        assert "of them by the writer" in demote[0]["note"]  # the share that goes in batches
    assert not any(case.startswith(("read", "restart")) for case, _ in rows)
    assert not list(tmp_path.glob("kvoffload-bench-ssd-*"))  # cleaned up
