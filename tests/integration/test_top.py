"""`kvoffload top`: driven in a pseudo-terminal against real daemons with real traffic, its
screen read back; and its plain-text form when the output is no terminal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import termios
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from top_screen import TopScreen

from kvoffload.client_sdk import Client

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

Start = Callable[..., Any]  # the `start_daemon` fixture (conftest.py) -> Daemon


class Traffic:
    """Puts and gets (a quarter of them misses) against `url` until stopped."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._stop = threading.Event()
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        keys = [os.urandom(16) for _ in range(24)]
        value = os.urandom(256 * 1024)
        try:
            with Client.connect(self._url) as client:
                while not self._stop.is_set():
                    for key in keys[:18]:
                        client.put(key, value)
                    for key in keys:
                        client.get(key)
        except BaseException as exc:  # reported by the test, not lost in a thread
            self.errors.append(exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        assert not self.errors, self.errors


@pytest.fixture
def screens() -> Iterator[Callable[..., TopScreen]]:
    opened: list[TopScreen] = []

    def open_screen(*args: str) -> TopScreen:
        opened.append(TopScreen(*args))
        return opened[-1]

    yield open_screen
    for screen in opened:
        screen.close()


def _number(cell: str) -> float:
    return float(cell.split()[0].rstrip("%").replace(",", "")) if cell not in ("", "-") else 0.0


def test_top_shows_traffic_a_node_down_and_quits_on_q(
    start_daemon: Start, screens: Callable[..., TopScreen]
) -> None:
    busy = start_daemon("--dram", "4MiB", "--ssd", "32MiB")
    other = start_daemon()
    name = f"127.0.0.1-{busy.port}"  # a static cluster's node ids
    screen = screens(f"cluster://127.0.0.1:{busy.port},127.0.0.1:{other.port}")
    screen.wait_for("both nodes up", lambda: "2/2 up" in screen.frame())
    columns = screen.row("node")
    assert columns[:6] == ["node", "state", "ops/s", "in", "out", "hit"], columns
    for column in ("dram hit", "ssd hit", "p50", "p99", "dram fill", "ssd fill", "evict/s"):
        assert column in columns, columns

    def cell(node: str, column: str) -> str:
        row = screen.row(node)
        return row[columns.index(column)] if len(row) == len(columns) else ""

    # Idle: top's own stats requests are no traffic.
    screen.wait_for("an idle node", lambda: cell(name, "ops/s") == "0.0")
    traffic = Traffic(busy.url())
    screen.wait_for(
        "figures of the traffic",
        lambda: (
            _number(cell(name, "ops/s")) > 0
            and cell(name, "in").endswith("B/s")
            and cell(name, "out").endswith("B/s")
            and cell(name, "hit").endswith("%")
            and cell(name, "p99").endswith("ms")
            and _number(cell(name, "dram fill")) > 0
            and _number(cell(name, "ssd hit")) > 0  # 4 MiB of DRAM: hits from the SSD
            and _number(cell("cluster", "ops/s")) > 0
        ),
    )
    traffic.stop()
    screen.wait_for("the traffic gone again", lambda: cell(name, "ops/s") == "0.0")

    # A stalled node (stopped: connected, never answering, as a cut link looks) costs one
    # timeout per refresh and shows as down; it comes back when it answers again.
    other_name = f"127.0.0.1-{other.port}"
    # (its process group: a multi-worker node's workers too)
    os.killpg(other.proc.pid, signal.SIGSTOP)
    try:
        screen.wait_for("the stalled node shown as down", lambda: "1/2 up" in screen.frame())
        assert screen.row(other_name)[1].startswith("DOWN"), screen.frame()
        assert screen.row(name)[1] == "up"
    finally:
        os.killpg(other.proc.pid, signal.SIGCONT)
    screen.wait_for("the node back", lambda: "2/2 up" in screen.frame())

    os.killpg(other.proc.pid, signal.SIGKILL)
    other.proc.wait()
    screen.wait_for("the killed node shown as down", lambda: "1/2 up" in screen.frame())
    assert screen.row(other_name)[1].startswith("DOWN"), screen.frame()
    assert screen.row(name)[1] == "up"
    screen.wait_for("a retry of the down node", lambda: screen.text.count("1/2 up") >= 3)
    assert "not reachable" not in screen.text  # no SDK warnings scribbled over the screen

    screen.type(b"q")
    assert screen.wait() == 0
    assert "Traceback" not in screen.text
    # The terminal is as it was: line mode and echo back on.
    modes = termios.tcgetattr(screen.slave)
    assert modes[3] & (termios.ICANON | termios.ECHO) == termios.ICANON | termios.ECHO
    assert modes[3] == screen.slave_modes[3]


def test_top_exits_cleanly_on_ctrl_c(
    start_daemon: Start, screens: Callable[..., TopScreen]
) -> None:
    daemon = start_daemon()
    screen = screens(daemon.url())
    screen.wait_for("the node", lambda: "1/1 up" in screen.frame())
    screen.type(b"\x03")  # Ctrl-C, as the terminal sends it: SIGINT to its foreground
    assert screen.wait() == 0
    assert "Traceback" not in screen.text and "KeyboardInterrupt" not in screen.text
    assert termios.tcgetattr(screen.slave)[3] == screen.slave_modes[3]


def test_top_once_prints_plain_text_when_not_a_terminal(start_daemon: Start) -> None:
    daemon = start_daemon()
    with Client.connect(daemon.url()) as client:
        client.put(b"k" * 16, b"v" * 4096)
    # A token, in the URL or by --token, stays off the screen.
    done = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "top", "--once", "--interval", "0.2"]
        + [daemon.url(token="not-shown"), "--token", "nor-this"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout  # no colours, no cursor moves
    assert f"kv://127.0.0.1:{daemon.port}" in done.stdout
    assert "not-shown" not in done.stdout + done.stderr
    assert "nor-this" not in done.stdout + done.stderr
    # This daemon has no tenants: a token is refused, and top says so instead of failing.
    assert "DOWN" in done.stdout


def test_top_refuses_a_url_it_cannot_show() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "top", "--once", "local:///tmp/x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "top shows kv:// nodes and cluster URLs" in done.stderr
