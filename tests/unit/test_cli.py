from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvoffload
from kvoffload.cli import main
from kvoffload.wire.hello_auth import node_key


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert kvoffload.__version__ in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [[], ["demo"], ["bench"], ["bench", "engine"], ["bench", "codecs"], ["stats"], ["node-key"]],
)
def test_help_on_every_command(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    assert "usage: kvoffload" in capsys.readouterr().out


def test_stats_of_a_store(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "local://?dram=8MiB&prefault=0", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["store"]["tiers"][0]["capacity_bytes"] == 8 << 20
    assert main(["stats", "local://?dram=8MiB&prefault=0"]) == 0
    assert "tier dram" in capsys.readouterr().out


def test_bad_url_is_a_clean_error_exit(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "gopher://x"]) == 2
    assert "unknown URL scheme" in capsys.readouterr().err


def test_console_script_is_installed(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and kvoffload.__version__ in proc.stdout


def test_node_key_reads_the_secret_from_stdin(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("s3cret\n"))
    assert main(["node-key", "--node", "n1"]) == 0
    assert capsys.readouterr().out.strip() == node_key("s3cret", "n1").hex()
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert main(["node-key", "--node", "n1"]) == 2
    assert "reads the tenant's secret from stdin" in capsys.readouterr().err
