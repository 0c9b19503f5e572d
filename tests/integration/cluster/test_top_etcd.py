"""`kvoffload top cluster+etcd://...`: the members come from a real etcd, and a member that is
killed shows as down (its record stays until its lease runs out)."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from etcd_server import EtcdServer

from kvoffload.client_sdk import Client

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

Start = Callable[..., Any]  # the `start_daemon` fixture (tests/conftest.py) -> Daemon


def _top_once(url: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "top", "--once", "--interval", "0.3", url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_top_shows_an_etcd_clusters_members_and_a_killed_one_as_down(
    etcd: EtcdServer, start_daemon: Start
) -> None:
    nodes = [
        start_daemon(
            "--cluster", f"etcd://{etcd.endpoint}/top", config=f'[cluster]\nnode_id = "{n}"\n'
        )
        for n in ("n1", "n2")
    ]
    url = f"cluster+etcd://{etcd.endpoint}/top"
    with Client.connect(url) as client:
        for i in range(64):
            client.put(i.to_bytes(16, "little"), b"v" * 4096)
    screen = _top_once(url)
    assert "2/2 up" in screen, screen
    header = next(line for line in screen.splitlines() if "┃ node" in line)
    columns = [c.strip() for c in header.strip("┃ ").split("┃")]
    rows = {}
    for line in screen.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if len(cells) == len(columns):
            rows[cells[0]] = dict(zip(columns, cells, strict=True))
    assert set(rows) == {"n1", "n2", "cluster"}, screen
    # Each node's DRAM holds some of the 64 blocks.
    assert all(float(rows[n]["dram fill"].rstrip("%")) > 0 for n in ("n1", "n2")), screen

    nodes[1].proc.send_signal(signal.SIGKILL)
    nodes[1].proc.wait()
    screen = _top_once(url)  # its record stays until the lease runs out: shown as down
    assert "1/2 up" in screen, screen
    assert "DOWN" in next(line for line in screen.splitlines() if "│ n2 " in line)
