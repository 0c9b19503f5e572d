from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from kvoffload.bench.registry import BENCHES
from kvoffload.bench.trace import report
from kvoffload.cli import main

PNG = b"\x89PNG\r\n\x1a\n"
SMALL = ["--engine-working-set", "2", "--engine-rounds", "1", "--sessions", "3",
         "--model", "smollm2-135m",
         "--capacities", "30,100", "--ssd-capacities", "30", "--peers", "vllm_arc"]  # fmt: skip


def test_report_renders_with_plots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVOFFLOAD_VLLM_PYTHON", sys.executable)  # not a peer's venv
    argv = ["bench", "report", "--out", str(tmp_path), "--date", "d", "--only",
            "engine,trace,net,nosuch", "--net-working-set", "2", "--dir", str(tmp_path), *SMALL,
            "--net-args", "--cpu-requests 0 --no-multi-client --nixl no",
            "--tiers", "dram"]  # fmt: skip
    assert main(argv) == 0
    folder = tmp_path / "d"
    text = (folder / "report.md").read_text()
    assert "## Workload benchmark" in text and "## bench engine" in text
    assert "## bench net" in text and "net" in BENCHES
    assert "### Goal at 30% of the working set" in text and "prefix vs lru at 30%" in text
    assert "### Where prefix-aware eviction wins and loses" in text
    assert "bench nosuch: not part of this build" in text
    assert "vllm_arc: absent or failed" in text and ".ci/engines.sh vllm" in text
    for name in ("hit_ratio", "throughput", "latency_cdf"):
        png = folder / f"{name}.png"
        assert png.read_bytes()[:8] == PNG and png.stat().st_size > 10_000
        assert f"]({name}.png)" in text
    trace = json.loads((folder / "trace.json").read_text())
    assert trace["bench"] == "trace" and trace["details"]["runs"]
    assert json.loads((folder / "engine.json").read_text())["bench"] == "engine"

    # --from renders the same report again from the JSON alone, command line included
    (folder / "report.md").unlink()
    (folder / "hit_ratio.png").unlink()
    assert main(["bench", "report", "--from", str(folder)]) == 0
    again = (folder / "report.md").read_text()
    assert again.split("## Notes")[0] == text.split("## Notes")[0]
    assert (folder / "hit_ratio.png").exists()
    assert main(["bench", "report", "--from", str(tmp_path / "nothing")]) == 2


def test_report_without_matplotlib_still_writes_tables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec

    def no_matplotlib(name: str, *args: Any) -> Any:
        return None if name == "matplotlib" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", no_matplotlib)
    argv = ["bench", "report", "--out", str(tmp_path), "--date", "d", "--only", "trace",
            "--dir", str(tmp_path), *SMALL, "--tiers", "dram", "--peers", ""]  # fmt: skip
    assert main(argv) == 0
    text = (tmp_path / "d" / "report.md").read_text()
    assert "matplotlib is not installed" in text and "| capacity |" in text
    assert not list((tmp_path / "d").glob("*.png"))


def _details(prefix: int, lru: int, arc: int | None) -> dict[str, Any]:
    runs: list[dict[str, Any]] = [
        {"system": "prefix", "tier": "dram", "percent": 30, "hit_tokens": prefix},
        {"system": "lru", "tier": "dram", "percent": 30, "hit_tokens": lru},
    ]
    if arc is None:
        runs.append({"system": "vllm_arc", "tier": "dram", "percent": 30, "error": "absent"})
    else:
        runs.append({"system": "vllm_arc", "tier": "dram", "percent": 30, "hit_tokens": arc})
    return {"runs": runs}


def test_goal_lines() -> None:
    met = report.goal_lines(_details(1200, 1000, 1200))
    assert "1.200×" in met[0] and "met" in met[0] and "not met" not in met[0]
    assert "1.000×" in met[1] and "not met" not in met[1]
    missed = report.goal_lines(_details(1100, 1000, 1150))
    assert all("not met" in line for line in missed)
    absent = report.goal_lines(_details(1100, 1000, None))
    assert "not measured (absent)" in absent[1]
    assert "not evaluated" in report.goal_lines({"runs": []})[0]


@pytest.mark.parametrize("bench", ["trace", "report"])
def test_help(bench: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", bench, "--help"])
    assert info.value.code == 0 and "usage: kvoffload bench" in capsys.readouterr().out


def test_a_bench_that_cannot_run_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_torch(name: str, argv: Any) -> Any:
        raise ImportError("No module named 'torch'")

    monkeypatch.setattr(report, "_run_bench", no_torch)
    report.run(out_dir=str(tmp_path), date="d", benches=["codecs"])
    text = (tmp_path / "d" / "report.md").read_text()
    assert "bench codecs: could not run here, not in this report: No module named 'torch'" in text
