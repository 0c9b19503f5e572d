"""A plain (non-editable) install exposes the documented imports and ships its data."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import kvoffload, kvoffload.bench.demo.chat as demo
from kvoffload.client_sdk import Client, AsyncClient, Namespace, block_keys
from kvoffload.kvstore import Engine
from kvoffload.compression import CODEC_NONE
import kvoffload.nvmeof_target, kvoffload.connectors
assert kvoffload.__file__.startswith(TARGET), kvoffload.__file__
assert "Stillwater" in demo.document()
with Client.connect("local://?dram=8MiB&prefault=0") as c:
    c.put(bytes(16), b"ok")
    assert c.get(bytes(16)) == b"ok"
with Client.connect("local://?dram=8MiB&prefault=0", codec="split-zstd") as c:
    c.put(bytes(16), bytes(4096))  # the codec modules ship and load
    assert c.get(bytes(16)) == bytes(4096) and c.stats().bytes_stored < 4096
from kvoffload.wire import fast  # KVOFFLOAD_REQUIRE_EXT: the C part built
assert fast.IMPLEMENTATION == "c" and fast.crc32c(b"123456789") == 0xE3069283
from kvoffload import core  # and the daemon's C core, which the engine above ran on
assert core.IMPLEMENTATION == "c" and core.dram_index_type() is not None
print("imports ok")
"""


def test_pip_install_dot(tmp_path: Path) -> None:
    target = tmp_path / "site"
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(target)]
    if importlib.util.find_spec("setuptools") is not None:
        cmd.append("--no-build-isolation")
    build = subprocess.run([*cmd, str(ROOT)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout + build.stderr
    env = dict(os.environ, PYTHONPATH=str(target), KVOFFLOAD_REQUIRE_EXT="1")
    env.pop("KVOFFLOAD_PURE_PYTHON", None)
    proc = subprocess.run(
        [sys.executable, "-c", f"TARGET={str(target)!r}\n" + CHECK],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "imports ok" in proc.stdout
