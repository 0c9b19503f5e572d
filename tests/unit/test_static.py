"""ruff and mypy --strict over the packages, as part of the suite."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["kvstore", "client_sdk", "nvmeof_target", "connectors", "compression", "bench"]


def test_ruff_is_clean() -> None:
    # Next to this Python too: a venv's tools are there even when it is not activated.
    beside = Path(sys.executable).with_name("ruff")
    ruff = shutil.which("ruff") or (str(beside) if beside.exists() else None)
    assert ruff, "ruff is part of the test extra"
    proc = subprocess.run(
        [ruff, "check", "--output-format", "concise", str(ROOT)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_mypy_strict(tmp_path: Path) -> None:
    # The folders install as kvoffload.<pkg>; mirror that layout with symlinks so mypy sees the
    # modules under their real names.
    root = tmp_path / "kvoffload"
    root.mkdir()
    for path in (ROOT / "kvoffload").glob("*"):
        if path.suffix in (".py", ".typed") or (path / "__init__.py").exists():
            (root / path.name).symlink_to(path)
    for package in PACKAGES:
        (root / package).symlink_to(ROOT / package)
    env = dict(os.environ, MYPY_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "kvoffload"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
